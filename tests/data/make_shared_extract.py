"""Make ``tests/data/shared/``: the part of the public data sets (``/work/shared/data``, see its
README and each folder's PROVENANCE.md) that ``tests/test_catalog.py`` checks the catalog,
converters and shipped examples against, so that those tests run on a fresh clone.

Values are copied unchanged; only entries the tests do not read are left out (other models,
tensor-parallel degrees, regions, job types, spot-price fields). Run from the repository root:
``python tests/data/make_shared_extract.py [SOURCE]`` (default ``$HETRAIN_SHARED_DATA`` or
``/work/shared/data``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "shared"
SAILOR_MODEL = "OPT-350"
SAILOR_ZONE = "us-central1-a"
GAVEL_KINDS = ("k80", "p100", "v100")
SPOT_FILES = ("us-east-1/p2.xlarge.json", "us-east-1/p3.2xlarge.json")
PIPEDREAM_FILES = ("vgg16_graph.txt", "resnet50_graph.txt")


def _dump(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")


def _copy_attribution(src: Path, folder: str) -> None:
    for f in sorted((src / folder).iterdir()):
        if f.name.startswith(("LICENSE", "PROVENANCE")):
            (OUT / folder).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, OUT / folder / f.name)


def main(src: Path) -> None:
    for old in OUT.glob("*/"):  # the folders are remade; README.md (attribution) is kept
        shutil.rmtree(old)
    sailor = src / "sailor"
    llm = json.loads((sailor / "llm_info.json").read_text())
    _dump(OUT / "sailor" / "llm_info.json", {SAILOR_MODEL: {"1": llm[SAILOR_MODEL]["1"]}})
    for prof in sorted((sailor / "profiles" / SAILOR_MODEL).glob("*/profile.json")):
        data = json.loads(prof.read_text())
        tp1 = {mb: {"1": by_tp["1"]} for mb, by_tp in data.items() if "1" in by_tp}
        _dump(OUT / "sailor" / "profiles" / SAILOR_MODEL / prof.parent.name / "profile.json", tp1)
    shutil.copyfile(
        sailor / "basic_cluster_config.json", OUT / "sailor" / "basic_cluster_config.json"
    )
    het = json.loads((sailor / "multizone_bandwidths_het.json").read_text())[SAILOR_ZONE]
    zone = {
        kind: {"1": {SAILOR_ZONE: {kind: {"1": by_n["1"][SAILOR_ZONE][kind]["1"]}}}}
        for kind, by_n in het.items()
        if kind in by_n.get("1", {}).get(SAILOR_ZONE, {})
    }
    _dump(OUT / "sailor" / "multizone_bandwidths_het.json", {SAILOR_ZONE: zone})
    _copy_attribution(src, "sailor")

    gavel = json.loads((src / "gavel" / "simulation_throughputs.json").read_text())
    small = {
        kind: {job: {"null": v["null"]} for job, v in gavel[kind].items() if job.endswith(", 1)")}
        for kind in GAVEL_KINDS
    }
    _dump(OUT / "gavel" / "simulation_throughputs.json", small)
    _copy_attribution(src, "gavel")

    for name in SPOT_FILES:
        hist = json.loads((src / "spot-prices-aws" / name).read_text())
        rows = [
            {k: r[k] for k in ("SpotPrice", "Timestamp", "InstanceType") if k in r}
            for r in hist["SpotPriceHistory"]
        ]
        _dump(OUT / "spot-prices-aws" / name, {"SpotPriceHistory": rows})
    _copy_attribution(src, "spot-prices-aws")

    for name in PIPEDREAM_FILES:
        dst = _mk(OUT / "pipedream-profiles") / name
        shutil.copyfile(src / "pipedream-profiles" / name, dst)
    _copy_attribution(src, "pipedream-profiles")
    # two_nodes_slow.yaml uses one bandwidth of this set: its license and provenance only
    _copy_attribution(src, "dtfm-aws-interregion")


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


if __name__ == "__main__":
    default = os.environ.get("HETRAIN_SHARED_DATA", "/work/shared/data")
    main(Path(sys.argv[1] if len(sys.argv) > 1 else default))
