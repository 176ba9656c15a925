"""Soak test of elastic training under real device churn (issue 6; not part of CI).

Replays a real spot-instance availability trace (default: Bamboo's AWS p3 trace,
``../shared/data/bamboo/p3-trace.csv``: 344 add/remove events over ~11 h) onto a local pool of
``--devices`` emulated devices, each one torchrun agent + one rank
(:class:`hetrain.runtime.elastic.ElasticController`), training ``hetrain train --example digits``
(the one per-rank loop). The trace's instance count ``N(t)`` is
scaled to the pool, ``target(t) = clamp(round(D * N(t) / max N), 1, D)``, and the whole trace is
compressed into ``--minutes`` of wall time (changes closer than ``--min-gap`` seconds are merged).
When the target drops, the highest-numbered live device is lost without warning (SIGKILL to its
agent and rank; ``--graceful`` sends SIGTERM, a spot warning, instead); when it rises, the lowest
missing device joins. At the end every agent gets SIGTERM (graceful stop with a checkpoint).

Report (stdout, and JSON with ``--json-out``): steps completed, restarts (rounds after the
first), devices lost and joined, lost steps = steps redone after a restart, lost steps beyond
the checkpoint interval (target 0), steps of the data order skipped (must be 0).

    PYTHONPATH=src python bench/soak.py --minutes 30
    PYTHONPATH=src python bench/soak.py --minutes 3 --json-out runs/soak.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path

from hetrain._io import read_jsonl
from hetrain.runtime.elastic import ElasticController

_REPO = Path(__file__).resolve().parents[1]
_CANDIDATES = [_REPO.parent / "shared", _REPO.parent.parent / "shared"]  # checkout or worktree
DEFAULT_TRACE = next(
    (c / "data/bamboo/p3-trace.csv" for c in _CANDIDATES if (c / "data/bamboo").is_dir()),
    _CANDIDATES[0] / "data/bamboo/p3-trace.csv",
)


def instance_counts(path: Path) -> list[tuple[float, int]]:
    """``(seconds from start, live instances)`` after each event of a Bamboo trace
    (rows ``delta_ms,add|remove,node``)."""
    live: set[str] = set()
    out: list[tuple[float, int]] = []
    with open(path, newline="") as fh:
        for row in csv.reader(fh):
            if len(row) < 3 or not row[0].strip().isdigit():
                continue
            t, event, node = int(row[0]) / 1000.0, row[1].strip(), row[2].strip()
            (live.add if event == "add" else live.discard)(node)
            out.append((t, len(live)))
    return out


def schedule(counts: list[tuple[float, int]], devices: int, seconds: float, min_gap: float):
    """Wall-clock schedule ``[(t_s, target_devices)]`` of the compressed, scaled trace."""
    peak = max(n for _, n in counts) or 1
    span = max(counts[-1][0], 1.0)
    out: list[tuple[float, int]] = []
    for t, n in counts:
        target = min(devices, max(1, round(devices * n / peak)))
        wall = t / span * seconds
        if out and wall - out[-1][0] < min_gap:
            out[-1] = (out[-1][0], target)  # merge with the previous change
        elif not out or target != out[-1][1]:
            out.append((wall, target))
    return out


def summarise(records: list[dict], every: int) -> dict:
    steps = [r for r in records if r.get("event") == "step"]
    restarts = [r for r in records if r.get("event") == "restart"]
    trained = {r["step"] for r in steps}
    final = max((r["step"] for r in records if r.get("event") == "checkpoint"), default=0)
    redone = [int(r.get("redone_steps", 0)) for r in restarts]
    return {
        "steps_completed": final,
        "steps_trained_incl_redone": len(steps),
        "restarts": len(restarts),
        "devices_lost": sum(len(r.get("lost_devices", [])) for r in restarts),
        "devices_joined": sum(len(r.get("joined_devices", [])) for r in restarts),
        "lost_steps": sum(redone),
        "lost_steps_beyond_checkpoint_interval": sum(max(0, x - every) for x in redone),
        "skipped_steps": sum(1 for s in range(final) if s not in trained),
        "world_sizes": sorted({r["world_size"] for r in steps}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--min-gap", type=float, default=20.0, help="seconds between changes")
    p.add_argument(
        "--slowdown",
        type=float,
        default=4.0,
        help="every device emulates one this many times slower than a host core (sleeping), so "
        "steps take long enough for churn to land mid-run",
    )
    p.add_argument("--graceful", action="store_true", help="SIGTERM instead of SIGKILL")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: a temp dir)")
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args(argv)
    if not a.trace.is_file():
        print(f"soak: error: {a.trace}: trace not found", file=sys.stderr)
        return 2
    out = a.out or Path(tempfile.mkdtemp(prefix="hetrain-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    seconds = a.minutes * 60.0
    plan = schedule(instance_counts(a.trace), a.devices, seconds, a.min_gap)
    names = [f"w{i}" for i in range(a.devices)]
    worker_args = [
        "train", "--example", "digits", "--steps", "100000000", "--batch", "24",
        "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", str(a.checkpoint_every),
        "--metrics-out", str(out / "metrics.jsonl"), "--run-dir", str(out / "run"),
        "--no-report", "--no-progress", "--hang-timeout", "60",
        *[x for d in names for x in ("--slowdown", f"{d}={a.slowdown:g}")],
    ]  # fmt: skip
    sig = signal.SIGTERM if a.graceful else signal.SIGKILL
    events: list[dict] = []
    t0 = time.monotonic()
    with ElasticController(
        worker_args, min_devices=1, max_devices=a.devices, max_restarts=1000,
        log_dir=out / "logs", last_call_s=3, run_id="soak",
    ) as ctl:  # fmt: skip
        first = plan[0][1] if plan else a.devices
        for d in names[:first]:
            ctl.add_device(d)
        for wall, target in plan[1:]:
            while time.monotonic() - t0 < wall:
                time.sleep(0.2)
            alive = [d for d in names if d in ctl.agents]
            if target < len(alive):
                for d in sorted(alive, key=names.index)[target:]:
                    ctl.kill_device(d, sig)
                    events.append({"t_s": round(wall, 1), "lost": d})
            for d in [d for d in names if d not in ctl.agents][: max(0, target - len(alive))]:
                ctl.add_device(d)
                events.append({"t_s": round(wall, 1), "joined": d})
        while time.monotonic() - t0 < seconds:
            time.sleep(0.2)
        for proc in ctl.agents.values():  # graceful end: every rank checkpoints and exits
            proc.send_signal(signal.SIGTERM)
        ctl.wait(90)
    wall_s = time.monotonic() - t0
    report = summarise(read_jsonl(out / "metrics.jsonl"), a.checkpoint_every)
    report.update(
        minutes=a.minutes, trace=str(a.trace), devices=a.devices,
        checkpoint_every=a.checkpoint_every, churn_events=events, wall_s=round(wall_s, 1),
        kill_signal="SIGTERM" if a.graceful else "SIGKILL", run_dir=str(out),
        steps_per_s=round(report["steps_completed"] / max(wall_s, 1e-9), 2),
    )  # fmt: skip
    for k, v in report.items():
        if k != "churn_events":
            print(f"{k:40s} {v}")
    print(f"{'churn_events':40s} {len(events)}: {events}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(report, indent=1))
    ok = report["skipped_steps"] == 0 and math.isfinite(report["steps_per_s"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
