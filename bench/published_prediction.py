"""How well does docs/model.md §3's compute model predict *published* per-layer measurements?

What this is: sailor (eth-easl/sailor) and pipedream (msr-fiddle/pipedream) publish measured
per-layer forward/backward times. docs/model.md §3 models a stage's time per micro-batch as
``μ · Σ(f_l + w_l) / s + κ`` with one speed ``s`` and one ``κ`` per device. Here ``s`` and
``κ`` are fitted on part of the published measurements and used to predict the rest:

A. sailor, per (model, GPU) at tensor-parallel degree 1: fit on all micro-batch sizes but the
   largest, predict (1) the whole chain at the largest size and (2) each of 4 FLOP-balanced
   stages at every size, with docs/model.md §3's κ per stage = the chain's κ (what the catalog
   ships).
B. sailor, across models: the speed fitted on OPT-350M predicts GPT-Neo-2.7B on the same GPU
   (the catalog's speeds are per model family: this shows by how much that matters).
C. pipedream (one minibatch size, so κ = 0): one speed per network from its total time,
   predicting per-layer times and 4 FLOP-balanced stages.
D. sailor, the measured-times model (docs/model.md §3 "Measured times") next to the FLOP
   model, per (model, GPU) with at least 3 micro-batch sizes at tensor-parallel degree 1:
   leave one size out (each size in turn), build the profile's measured times from the other
   sizes (hetrain.converters.sailor_measured_times) and predict the 4 FLOP-balanced stages and
   the whole chain at the held-out size through hetrain.costmodel.stage_compute_s
   (interpolated inside, extrapolated at the ends); the FLOP model fits s and κ on the same
   sizes. Targets of the measured-times model: median ≤ 3 %, max ≤ 15 %.

It is *not* a comparison with measured end-to-end iteration times: the shared data has none
for these models. Run: ``PYTHONPATH=src python bench/published_prediction.py``; last line JSON.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import numpy as np

from hetrain.calibration import fit_speed_kappa
from hetrain.catalog import DEFAULT_DATA_DIR
from hetrain.cluster import cluster_from_dict
from hetrain.converters import (
    load_json,
    pipedream_chain,
    sailor_layer_times,
    sailor_measured_times,
    sailor_model_profile,
)
from hetrain.costmodel import profile_prefix, stage_compute_s
from hetrain.profile import ModelProfile


def balanced_stages(flops: np.ndarray, k: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` stages with about equal FLOPs (greedy on the prefix sum)."""
    cum = np.cumsum(flops)
    cuts = [0]
    for j in range(1, k):
        cut = int(np.searchsorted(cum, cum[-1] * j / k)) + 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(flops) - (k - j)))
    cuts.append(len(flops))
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def sailor_rows(data: Path):
    llm = load_json(data / "sailor" / "llm_info.json")
    rows_a, rows_stage, fits = [], [], {}
    for path in sorted(glob.glob(str(data / "sailor" / "profiles" / "*" / "*" / "profile.json"))):
        model, gpu = Path(path).parts[-3], Path(path).parts[-2]
        prof = sailor_model_profile(llm, model)
        flops = prof.arrays().train_flops
        pj = load_json(path)
        mus, layer_t = [], []
        for mb in sorted(pj, key=int):
            if "1" in pj[mb] and len(pj[mb]["1"]) == prof.num_layers:
                f, b = sailor_layer_times(pj, int(mb))
                mus.append(int(mb))
                layer_t.append(f + b)
        if len(mus) < 2:
            continue
        chain_t = [float(t.sum()) for t in layer_t]
        fits[(model, gpu)] = fit_speed_kappa(mus, flops.sum(), chain_t)
        if len(mus) < 3:
            continue
        fit = fit_speed_kappa(mus[:-1], flops.sum(), chain_t[:-1])
        pred = fit.predict_s(mus[-1], flops.sum())
        rows_a.append((model, gpu, mus[-1], pred, chain_t[-1], rel(pred, chain_t[-1])))
        stages = balanced_stages(flops, 4)
        for mu, lt in zip(mus, layer_t, strict=True):
            for s0, s1 in stages:
                p = mu * flops[s0:s1].sum() / fit.speed_flops + fit.kappa_s
                rows_stage.append((model, gpu, mu, (s0, s1), p, float(lt[s0:s1].sum())))
    return rows_a, rows_stage, fits


def held_out_rows(data: Path) -> list[tuple]:
    """Section D: ``(model, gpu, held-out μ, what, FLOP-model s, measured-times s, measured
    s)`` per stage (``what`` = ``(start, end)``) and per chain (``what`` = ``"chain"``)."""
    llm = load_json(data / "sailor" / "llm_info.json")
    out = []
    for path in sorted(glob.glob(str(data / "sailor" / "profiles" / "*" / "*" / "profile.json"))):
        model, gpu = Path(path).parts[-3], Path(path).parts[-2]
        prof = sailor_model_profile(llm, model)
        pj = load_json(path)
        full = sailor_measured_times(pj, prof.num_layers)
        if full is None or len(full["microbatch_sizes"]) < 3:
            continue
        flops = prof.arrays().train_flops
        stages = balanced_stages(flops, 4) + [(0, prof.num_layers)]
        state = cluster_from_dict(
            {"devices": [{"id": "gpu", "kind": gpu, "tflops": 1, "memory_gib": 80,
                          "nic_gbps": 100}]}
        ).state()  # fmt: skip
        for i, held in enumerate(full["microbatch_sizes"]):
            table = sailor_measured_times(pj, prof.num_layers, exclude_microbatch_sizes=(held,))
            measured = ModelProfile.model_validate(
                {**prof.to_json_dict(), "measured_times": {gpu: table}}
            )
            prefix = profile_prefix(measured.arrays())
            starts = np.array([a for a, _ in stages])
            ends = np.array([b for _, b in stages])
            pred = stage_compute_s(state, prefix, np.zeros(len(stages), dtype=int), starts,
                                   ends, held)  # fmt: skip
            rest = [m for m in full["microbatch_sizes"] if m != held]
            chain = [float(np.sum(np.add(full["fwd_s"][j], full["bwd_s"][j])))
                     for j, m in enumerate(full["microbatch_sizes"]) if m != held]  # fmt: skip
            fit = fit_speed_kappa(rest, flops.sum(), chain)
            layer_t = np.add(full["fwd_s"][i], full["bwd_s"][i])
            for (a, b), p in zip(stages, pred, strict=True):
                flop = held * flops[a:b].sum() / fit.speed_flops + fit.kappa_s
                what = "chain" if (a, b) == (0, prof.num_layers) else (a, b)
                out.append((model, gpu, held, what, flop, float(p), float(layer_t[a:b].sum())))
    return out


def main() -> None:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA_DIR
    rows_a, rows_stage, fits = sailor_rows(data)
    print("A1. sailor: fit on smaller micro-batches, predict the whole chain at the largest")
    print(f"{'model':<12}{'GPU':<11}{'mu':>4}{'pred s':>10}{'meas s':>10}{'err':>8}")
    for model, gpu, mu, p, m, e in rows_a:
        print(f"{model:<12}{gpu:<11}{mu:>4}{p:>10.4f}{m:>10.4f}{e:>+8.1%}")
    errs_a = [abs(r[-1]) for r in rows_a]
    stage_errs = [abs(rel(p, m)) for *_, p, m in rows_stage]
    print(
        f"A2. sailor: 4 FLOP-balanced stages x every micro-batch size: {len(stage_errs)} "
        f"stage times, median |err| {np.median(stage_errs):.1%}, max {max(stage_errs):.1%}"
    )
    worst = max(rows_stage, key=lambda r: abs(rel(r[-2], r[-1])))
    print(
        f"    worst: {worst[0]} {worst[1]} mu={worst[2]} layers {worst[3]}: predicted "
        f"{worst[4]:.4f} s, measured {worst[5]:.4f} s (embedding/head layers run at other "
        "speeds than the blocks)"
    )

    print("B. sailor: speed fitted on OPT-350M predicting GPT-Neo-2.7B on the same GPU")
    llm = load_json(data / "sailor" / "llm_info.json")
    neo = sailor_model_profile(llm, "GPT-Neo-2.7").arrays().train_flops.sum()
    cross = []
    for model, gpu in sorted(fits):
        if model != "GPT-Neo-2.7" or ("OPT-350", gpu) not in fits:
            continue
        pj = load_json(data / "sailor" / "profiles" / model / gpu / "profile.json")
        mu = min(int(m) for m in pj if "1" in pj[m])
        f, b = sailor_layer_times(pj, mu)
        p = fits[("OPT-350", gpu)].predict_s(mu, neo)
        cross.append(rel(p, float((f + b).sum())))
        print(
            f"    {gpu:<10} mu={mu}: predicted {p:.3f} s, measured {(f + b).sum():.3f} s, "
            f"error {cross[-1]:+.1%}"
        )

    print("C. pipedream (one minibatch size, kappa = 0): one speed per network")
    layer_errs, layer_errs_mm, stage_errs_pd = [], [], []
    for net in ("vgg16", "resnet18", "resnet50", "alexnet", "resnext50", "resnet101"):
        ch = pipedream_chain(data / "pipedream-profiles" / f"{net}_graph.txt")
        flops = ch.profile.arrays().train_flops * ch.batch_size
        meas = (ch.fwd_ms + ch.bwd_ms) / 1e3
        speed = flops.sum() / meas.sum()
        le = [abs(rel(f / speed, m)) for f, m in zip(flops, meas, strict=True) if m > 0]
        names = [ly.name for ly in ch.profile.layers]
        le_mm = [
            abs(rel(f / speed, m))
            for f, m, n in zip(flops, meas, names, strict=True)
            if m > 0 and n.split(":")[1].startswith(("Conv2d", "Linear"))
        ]
        layer_errs_mm += le_mm
        se = [
            abs(rel(flops[a:b].sum() / speed, meas[a:b].sum()))
            for a, b in balanced_stages(flops, 4)
        ]
        layer_errs += le
        stage_errs_pd += se
        print(
            f"    {net:<10} {speed / 1e12:6.2f} TFLOP/s  per-layer median |err| "
            f"{np.median(le):6.1%} (conv/linear-led {np.median(le_mm):6.1%})  4 stages median "
            f"|err| {np.median(se):6.1%} max "
            f"{max(se):6.1%}"
        )
    print("D. sailor, leave one micro-batch size out: FLOP model (s, kappa fitted on the other")
    print("   sizes) vs measured-times model (interpolated/extrapolated per layer), |error|")
    rows_d = held_out_rows(data)
    print(f"{'model':<12}{'GPU':<11}{'mu':>4}{'stages FLOP':>13}{'stages meas':>13}"
          f"{'chain FLOP':>12}{'chain meas':>12}")  # fmt: skip
    keys = sorted({(r[0], r[1], r[2]) for r in rows_d}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        st = [r for r in rows_d if r[:3] == key and r[3] != "chain"]
        (ch,) = [r for r in rows_d if r[:3] == key and r[3] == "chain"]
        print(
            f"{key[0]:<12}{key[1]:<11}{key[2]:>4}"
            f"{max(abs(rel(r[4], r[6])) for r in st):>13.1%}"
            f"{max(abs(rel(r[5], r[6])) for r in st):>13.1%}"
            f"{abs(rel(ch[4], ch[6])):>12.1%}{abs(rel(ch[5], ch[6])):>12.1%}"
        )
    d = {}
    for part in ("stage", "chain"):
        sel = [r for r in rows_d if (r[3] == "chain") == (part == "chain")]
        for name, col in (("flop", 4), ("measured", 5)):
            errs = [abs(rel(r[col], r[6])) for r in sel]
            d[f"sailor_heldout_{part}_{name}_median_abs_rel_error"] = float(np.median(errs))
            d[f"sailor_heldout_{part}_{name}_max_abs_rel_error"] = float(max(errs))
        print(
            f"   {part}s ({len(sel)}): FLOP model median "
            f"{d[f'sailor_heldout_{part}_flop_median_abs_rel_error']:.1%} max "
            f"{d[f'sailor_heldout_{part}_flop_max_abs_rel_error']:.1%} | measured times median "
            f"{d[f'sailor_heldout_{part}_measured_median_abs_rel_error']:.1%} max "
            f"{d[f'sailor_heldout_{part}_measured_max_abs_rel_error']:.1%} (target <= 3 %, <= 15 %)"
        )
    summary = {
        **d,
        "sailor_chain_heldout_median_abs_rel_error": float(np.median(errs_a)),
        "sailor_chain_heldout_max_abs_rel_error": float(max(errs_a)),
        "sailor_stage_median_abs_rel_error": float(np.median(stage_errs)),
        "sailor_stage_max_abs_rel_error": float(max(stage_errs)),
        "sailor_cross_model_abs_rel_errors": [abs(c) for c in cross],
        "pipedream_layer_median_abs_rel_error": float(np.median(layer_errs)),
        "pipedream_conv_linear_layer_median_abs_rel_error": float(np.median(layer_errs_mm)),
        "pipedream_stage_median_abs_rel_error": float(np.median(stage_errs_pd)),
        "pipedream_stage_max_abs_rel_error": float(max(stage_errs_pd)),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
