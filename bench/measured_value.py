"""What planning with measured per-layer times is worth on real GPU mixes (issue 21).

For heterogeneous clusters built from sailor's GPU kinds (hetrain.catalog: memory, NIC,
intra-node bandwidth, devices per node) and sailor's models, plan twice:

* **FLOP model**: the profile's FLOPs (hetrain.converters.sailor_model_profile) and, per kind,
  the speed ``s`` and ``κ`` least-squares fitted on *this model's* measured chain times at
  every micro-batch size (hetrain.calibration.fit_speed_kappa) — the best one speed per kind
  can do (the catalog ships OPT-350M speeds for every model);
* **measured times**: the same profile with every kind's measured per-layer times
  (hetrain.converters.sailor_profile_with_measured_times; docs/model.md §3 "Measured times").

Both plans are evaluated with the measured-times model (the closest to the GPUs that the
data allows: it predicts held-out stages within 1 % median, bench/published_prediction.py
section D) and the FLOP model's regret is ``T(FLOP plan) / T(measured plan) − 1``. LLaMA-3-8B
is left out: sailor profiled it without tensor parallelism only on GH-96 (one kind, no mix).

Run: ``PYTHONPATH=src python bench/measured_value.py [DATA_DIR]``; last line JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from hetrain.calibration import fit_speed_kappa
from hetrain.catalog import DEFAULT_DATA_DIR, make_cluster
from hetrain.cluster import cluster_from_dict, default_kind
from hetrain.converters import sailor_profile_with_measured_times
from hetrain.costmodel import TrainingConfig, evaluate_plan
from hetrain.errors import NoFeasiblePlanError
from hetrain.planner import best_plan
from hetrain.profile import ModelProfile

# (model, {kind: count}, global batch B)
CASES: list[tuple[str, dict[str, int], int]] = [
    ("OPT-350", {"A100-40": 2, "V100-16": 2}, 32),
    ("OPT-350", {"GH-96": 2, "RTX-2080": 4}, 32),
    ("OPT-350", {"RTX-2080": 2, "RTX-3090": 2, "Titan-RTX": 2, "V100-16": 2}, 64),
    ("OPT-350", {"A100-80": 4, "GH-96": 4, "RTX-3090": 4, "V100-16": 4}, 64),
    ("GPT-Neo-2.7", {"A100-40": 4, "V100-16": 4}, 32),
    ("GPT-Neo-2.7", {"A100-80": 2, "A100-40": 2, "V100-16": 4}, 32),
    ("GPT-Neo-2.7", {"A100-80": 4, "A100-40": 4, "V100-16": 8}, 64),
    ("OPT-30", {"A100-40": 8, "GH-96": 8}, 16),
]


def flop_cluster(measured: ModelProfile, counts: dict[str, int]) -> dict:
    """The catalog cluster of ``counts`` with each kind's ``tflops`` and ``κ`` fitted on the
    model's measured chain times (every measured micro-batch size)."""
    spec = make_cluster(counts)
    flops = float(np.sum(measured.arrays().train_flops))
    fits = {}
    for kind, table in measured.measured_times.items():
        chain = [float(np.sum(f) + np.sum(b)) for f, b in zip(table.fwd_s, table.bwd_s,
                                                                strict=True)]  # fmt: skip
        if len(chain) >= 2:
            fit = fit_speed_kappa(table.microbatch_sizes, flops, chain)
            fits[kind.casefold()] = (fit.speed_flops / 1e12, fit.kappa_s * 1e3)
        else:  # one size: a line through 0
            fits[kind.casefold()] = (table.microbatch_sizes[0] * flops / chain[0] / 1e12, 0.0)
    raw = spec.model_dump(mode="json", exclude_none=True)
    for d in raw["devices"]:
        tflops, kappa_ms = fits[default_kind(d["id"]).casefold()]
        d["tflops"], d["microbatch_overhead_ms"] = tflops, kappa_ms
    return raw


def run_case(data: Path, model: str, counts: dict[str, int], batch: int) -> dict:
    measured = sailor_profile_with_measured_times(data, model, tuple(counts))
    missing = [k for k in counts if k not in measured.measured_times]
    if missing:
        raise SystemExit(f"{model}: no measured times for {missing} in the sailor data")
    flop_only = ModelProfile.model_validate(
        {k: v for k, v in measured.to_json_dict().items() if k != "measured_times"}
    )
    state = cluster_from_dict(flop_cluster(measured, counts), "<bench>").state()
    config = TrainingConfig(batch=batch)
    truth = measured.arrays()
    out = {"model": model, "cluster": counts, "batch": batch}
    try:
        t0 = time.perf_counter()
        p_flop = best_plan(state, flop_only.arrays(), config)
        t1 = time.perf_counter()
        p_meas = best_plan(state, truth, config)
        t2 = time.perf_counter()
    except NoFeasiblePlanError:
        out["fits"] = False
        return out
    e_flop = evaluate_plan(p_flop, state, truth, config)
    e_meas = evaluate_plan(p_meas, state, truth, config)
    out.update(
        fits=True,
        flop_plan_predicted_s=float(p_flop.iteration_time_s),
        flop_plan_measured_s=e_flop.iteration_time_s,
        measured_plan_s=e_meas.iteration_time_s,
        regret=e_flop.iteration_time_s / e_meas.iteration_time_s - 1.0,
        flop_plan=_shape(p_flop),
        measured_plan=_shape(p_meas),
        plan_seconds=(t1 - t0, t2 - t1),
    )
    return out


def _shape(plan) -> str:
    return " | ".join(
        f"{'>'.join(g.devices)} mu={g.microbatch_size} b={g.batch}" for g in plan.groups
    )


def main() -> None:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA_DIR
    rows = [run_case(data, *case) for case in CASES]
    print(f"{'model':<12}{'cluster':<40}{'B':>4}{'FLOP plan':>11}{'(its own':>10}"
          f"{'meas plan':>11}{'regret':>8}")  # fmt: skip
    for r in rows:
        mix = " ".join(f"{c}x{k}" for k, c in r["cluster"].items())
        if not r["fits"]:
            print(f"{r['model']:<12}{mix:<40}{r['batch']:>4}  does not fit")
            continue
        print(
            f"{r['model']:<12}{mix:<40}{r['batch']:>4}{r['flop_plan_measured_s']:>10.3f}s"
            f"{r['flop_plan_predicted_s']:>9.3f}s){r['measured_plan_s']:>10.3f}s"
            f"{r['regret']:>+8.1%}"
        )
    for r in rows:
        if r["fits"]:
            print(f"  {r['model']} {r['cluster']}:\n    FLOP plan:     {r['flop_plan']}\n"
                  f"    measured plan: {r['measured_plan']}")  # fmt: skip
    regrets = [r["regret"] for r in rows if r["fits"]]
    print(
        f"FLOP model's regret over {len(regrets)} cases: median {np.median(regrets):.1%}, "
        f"max {max(regrets):.1%} (iteration times evaluated with the measured times)"
    )
    print(json.dumps({"cases": rows, "median_regret": float(np.median(regrets)),
                      "max_regret": float(max(regrets))}))  # fmt: skip


if __name__ == "__main__":
    main()
