"""Regenerate the shipped example profiles and clusters converted from ``../shared/data``.

Run from the repository root::

    PYTHONPATH=src python examples/build_examples.py [--data-dir /work/shared/data]

Writes ``examples/profiles/{opt-350m,gpt-neo-2.7b,vgg16,resnet50-pipedream}.json`` (converted
with :mod:`hetrain.converters`), ``examples/clusters/*.yaml`` (built with
:func:`hetrain.catalog.make_cluster`) and ``examples/traces/priced8-spot.csv`` (a docs/model.md §7
trace
for ``clusters/priced8.yaml``: real AWS spot prices via :mod:`hetrain.sim.converters`, speed
drift and straggler spikes from :mod:`hetrain.sim.dynamics`). The profiles measured by
``hetrain profile`` are made by ``examples/profile_examples.sh``. Deterministic: running it
twice gives the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from hetrain.catalog import DEFAULT_DATA_DIR, make_cluster
from hetrain.converters import load_json, pipedream_chain, sailor_model_profile
from hetrain.sim.converters import spot_price_rows
from hetrain.sim.dynamics import generate_trace
from hetrain.trace import write_trace

HERE = Path(__file__).resolve().parent


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    print("wrote", path.relative_to(HERE.parent))


def write_yaml(path: Path, header: str, spec) -> None:
    body = yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False)
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + body, "utf-8")
    print("wrote", path.relative_to(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = ap.parse_args()
    data = args.data_dir
    prof = HERE / "profiles"
    clus = HERE / "clusters"
    prof.mkdir(exist_ok=True)
    clus.mkdir(exist_ok=True)

    llm = load_json(data / "sailor" / "llm_info.json")
    for model, fname, title in (
        ("OPT-350", "opt-350m.json", "OPT-350M"),
        ("GPT-Neo-2.7", "gpt-neo-2.7b.json", "GPT-Neo-2.7B"),
    ):
        p = sailor_model_profile(llm, model, name=f"{title} (sailor llm_info, seq 2048)")
        write_json(prof / fname, p.to_json_dict())
    for graph, fname, title in (
        ("vgg16", "vgg16.json", "VGG16"),
        ("resnet50", "resnet50-pipedream.json", "ResNet-50"),
    ):
        chain = pipedream_chain(data / "pipedream-profiles" / f"{graph}_graph.txt")
        chain = chain.profile.model_copy(update={"name": f"{title} (pipedream graph, 224x224)"})
        write_json(prof / fname, chain.to_json_dict())

    write_yaml(
        clus / "mixed4.yaml",
        "4 mixed GPUs, one per node (hetrain.catalog: speeds fitted on sailor/gavel data).",
        make_cluster({"A100-40": 1, "V100-16": 1, "P100": 1, "K80": 1}),
    )
    write_yaml(
        clus / "two_nodes_slow.yaml",
        "Two nodes of 4 GPUs joined by a slow wide-area link: NIC 0.79 Gbit/s, the measured\n"
        "AWS Oregon-Virginia bandwidth (dtfm-aws-interregion). docs/model.md §7 has one latency "
        "for\n"
        "every link, so the 67 ms inter-region delay is not representable; 20 us is kept.",
        make_cluster({"V100-16": 4, "A100-40": 4}, devices_per_node=4, nic_gbps=0.79),
    )
    write_yaml(
        clus / "priced8.yaml",
        "8 GPUs with power (datasheet TDP) and prices (USD/h): V100 and K80 at the median AWS\n"
        "spot price of Dec 2019 - Feb 2020 (spot-prices-aws), A100 at the on-demand price.",
        make_cluster({"A100-40": 2, "V100-16": 2, "K80": 4}, spot=True),
    )

    write_priced8_trace(data, HERE / "traces" / "priced8-spot.csv")


PRICED8_TRACE_SLOTS = 300


def write_priced8_trace(data: Path, path: Path) -> None:
    """A 300-slot trace for ``clusters/priced8.yaml`` (1 slot = 1 hour of price history): the
    K80s follow the us-east-1 spot price of p2.xlarge and the V100s that of p3.2xlarge (one GPU
    per instance; the A100s stay at their on-demand price), every device's speed drifts
    (Ornstein-Uhlenbeck, 1% per slot) and has rare straggler spikes (0.3x). Seeded."""
    slots = PRICED8_TRACE_SLOTS
    spot = data / "spot-prices-aws" / "us-east-1"
    k80 = [f"k80-{i}" for i in range(4)]
    v100 = [f"v100-16-{i}" for i in range(2)]
    everyone = ["a100-40-0", "a100-40-1", *v100, *k80]
    rows = spot_price_rows(spot / "p2.xlarge.json", k80, slots)
    rows += spot_price_rows(spot / "p3.2xlarge.json", v100, slots)
    rows += generate_trace(
        everyone,
        slots,
        seed=8,
        drift={"sigma": 0.01},
        stragglers={"rate": 0.003, "slowdown": 0.3, "mean_duration_slots": 10.0},
    )
    rows.sort(key=lambda r: r.slot)
    path.parent.mkdir(exist_ok=True)
    write_trace(path, rows)
    print("wrote", path.relative_to(HERE.parent))


if __name__ == "__main__":
    main()
