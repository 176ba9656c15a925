"""Bench inputs built directly from ../shared/data/sailor (until hetrain.catalog lands).

* Model profile (docs/model.md §7) from ``llm_info.json`` (per-layer parameter, output-activation
  and
  saved-activation bytes at micro-batch 1 = per sample) and the per-layer forward/backward
  seconds measured on A100-40 at micro-batch 1 (``profiles/<MODEL>/A100-40``), turned into
  FLOPs with a nominal effective A100-40 speed ``REF_FLOPS`` (only ratios matter for T/T_LB).
* Device speed of a kind = ``REF_FLOPS`` × (A100-40 seconds / that kind's seconds) summed over
  the model's layers (same micro-batch 1, tensor-parallel degree 1).
* Memory per GPU from ``basic_cluster_config.json``; NIC from ``multizone_bandwidths_het.json``
  (same zone, same kind, 4-GPU nodes, ``max_bw``); intra-node bandwidth: the smallest 4-GPU
  ``max_bw`` of ``intra_node_bandwidths.json`` among the kinds used.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sailor"
if not DATA.exists():
    DATA = Path("/work/shared/data/sailor")
REF_FLOPS = 100e12
ZONE = "us-central1-a"


@cache
def _json(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _times(model: str, kind: str) -> dict[int, tuple[float, float]]:
    """Per-layer (fwd, bwd) single-GPU seconds per sample: the smallest measured micro-batch
    and, within it, the smallest tensor-parallel degree tp; time × tp / micro-batch (a
    single-GPU estimate when tp = 1 was not measured)."""
    prof = json.loads((DATA / "profiles" / model / kind / "profile.json").read_text())
    mb = min(prof, key=int)
    tp = min(prof[mb], key=int)
    scale = int(tp) / int(mb)
    return {int(k): (v[0] * scale, v[1] * scale) for k, v in prof[mb][tp].items()}


def sailor_profile(model: str) -> dict:
    """docs/model.md §7 profile dict of ``model`` (OPT-350, GPT-Neo-2.7, LLAMA-3-8, OPT-30)."""
    info = _json("llm_info.json")[model]["1"]
    times = _times(model, "A100-40")
    layers = []
    for idx in sorted(int(k) for k in info):
        ly = info[str(idx)]
        fwd_s, bwd_s = times[idx]
        layers.append(
            {
                "name": f"{model}.{idx}",
                "fwd_flops": fwd_s * REF_FLOPS,
                "bwd_flops": bwd_s * REF_FLOPS,
                "activation_bytes": float(ly["act_output_bytes"]),
                "activation_memory_bytes": float(ly["act_mem_bytes"]),
                "param_bytes": float(ly["params_bytes"]),
            }
        )
    return {"name": model, "layers": layers}


def kind_tflops(model: str, kind: str) -> float:
    ref = _times(model, "A100-40")
    mine = _times(model, kind)
    common = [k for k in ref if k in mine]  # some profiles cover fewer layers
    return REF_FLOPS / 1e12 * sum(sum(ref[k]) for k in common) / sum(sum(mine[k]) for k in common)


def sailor_cluster(model: str, nodes: list[tuple[str, int]]) -> dict:
    """docs/model.md §7 cluster dict: one node per ``(kind, gpus)`` entry."""
    bws = _json("multizone_bandwidths_het.json")[ZONE]
    intra = _json("intra_node_bandwidths.json")
    mem = _json("basic_cluster_config.json")
    kinds = sorted({k for k, _ in nodes})
    intra_gbps = min(intra[k]["4"][1] for k in kinds) * 8 / 1e9
    devices = []
    for n, (kind, gpus) in enumerate(nodes):
        nic = bws[kind]["4"][ZONE][kind]["4"][1] * 8 / 1e9
        for g in range(gpus):
            devices.append(
                {
                    "id": f"{kind}-n{n}-{g}",
                    "node": f"n{n}",
                    "tflops": kind_tflops(model, kind),
                    "memory_gib": mem[kind]["mem_per_gpu"] / 2**30,
                    "nic_gbps": nic,
                }
            )
    return {"links": {"intra_node_gbps": intra_gbps, "latency_us": 20.0}, "devices": devices}
