#!/usr/bin/env bash
# The main job on one GPU: `hetrain train --workers 1` (default example, charlm) with CUDA
# placement, pinned host->GPU batch copies and NCCL (issue 10). For a machine with a GPU; it
# cannot run on the CPU-only development machine. Target: under 5 minutes, exit 0.
# NCCL refuses two ranks on one GPU, so one GPU means one rank.
#
#   bash bench/gpu_check.sh            # PYTHON=... to pick the interpreter, STEPS=... to change
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN=${RUN_DIR:-runs/gpu_check}
STEPS=${STEPS:-300}

"$PY" - <<'PYEOF'
import sys

import torch

if not torch.cuda.is_available():
    print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
    sys.exit(2)
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF

rm -rf "$RUN"
start=$(date +%s)
timeout 300 "$PY" -m hetrain train --workers 1 --steps "$STEPS" --run-dir "$RUN" --no-progress
wall=$(( $(date +%s) - start ))

"$PY" - "$RUN" "$wall" "$STEPS" <<'PYEOF'
import json
import sys

run, wall, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
events = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
plan = next(e for e in events if e["event"] == "plan")
trained = [e for e in events if e["event"] == "step"]
end = next((e for e in events if e["event"] == "end"), None)
problems = []
if plan.get("device_type") != "cuda":
    problems.append(f"trained on {plan.get('device_type')!r}, expected cuda")
if plan.get("backend") != "nccl":
    problems.append(f"backend {plan.get('backend')!r}, expected nccl")
if len(trained) != steps or end is None:
    problems.append(f"{len(trained)} of {steps} steps, end event {'present' if end else 'missing'}")
if wall >= 300:
    problems.append(f"took {wall} s (target < 300 s)")
median = sorted(e["iteration_time_s"] for e in trained)[len(trained) // 2] if trained else 0
print(f"gpu_check: {len(trained)} steps in {wall} s, median iteration {median * 1e3:.1f} ms, "
      f"final loss {trained[-1]['loss'] if trained else float('nan'):.4f}, "
      f"validation {end.get('metrics') if end else None}")
for p in problems:
    print(f"FAIL {p}")
if not problems:
    print("PASS one GPU: CUDA + NCCL, all steps, under 5 minutes")
sys.exit(1 if problems else 0)
PYEOF
