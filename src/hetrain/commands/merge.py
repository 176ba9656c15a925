"""Body of ``hetrain merge-profiles`` (also ``hetrain profile merge``): join the measured
per-layer times of profiles of one model measured on several machines (docs/profiling.md,
docs/model.md §7). No torch."""

from __future__ import annotations

import json
from pathlib import Path

from hetrain._io import check_output_path
from hetrain.profile import load_profile, merge_profiles


def run_merge(inputs: list[Path], out: Path) -> int:
    """Load every profile of ``inputs``, merge them (:func:`hetrain.profile.merge_profiles`)
    and write the result to ``out`` (JSON, folders created); prints one line. Returns 0.

    Raises:
        InputError: fewer than two inputs, ``out`` not writable as a file or one of the
            inputs, an unreadable or invalid profile, or profiles that do not merge.
    """
    from hetrain.errors import InputError

    if len(inputs) < 2:
        raise InputError("merge-profiles", "", "expected at least two profiles to merge")
    check_output_path("--out", out)
    for p in inputs:
        if Path(p).resolve() == Path(out).resolve():
            raise InputError("--out", "", f"expected a file other than the input {p}")
    merged = merge_profiles([(str(p), load_profile(p)) for p in inputs])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged.to_json_dict(), indent=1) + "\n", encoding="utf-8")
    kinds = sorted(merged.measured_times)
    print(
        f"wrote {out}: {merged.num_layers} layers, measured times of "
        f"{len(kinds)} device kind(s): {', '.join(kinds) if kinds else 'none'}"
    )
    return 0
