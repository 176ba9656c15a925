"""Reading YAML/JSON files into plain Python objects, with :class:`~hetrain.errors.InputError`
on any failure (missing file, unreadable, not YAML/JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hetrain.errors import InputError


def read_structured(path: str | Path) -> Any:
    """Load a JSON or YAML file (chosen by suffix; YAML otherwise since YAML is a superset).

    Raises:
        InputError: the file is missing, unreadable, or not valid JSON/YAML.
    """
    p = Path(path)
    text = read_text(p)
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
        except _DuplicateKey as exc:
            raise InputError(str(path), "", f"expected each key once per mapping, {exc}") from None
        except ValueError as exc:
            raise InputError(str(path), "", f"expected valid JSON ({exc})") from None
        except RecursionError:
            raise InputError(str(path), "", "expected valid JSON (nested too deeply)") from None
    import yaml  # only for YAML files

    try:
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as exc:
        raise InputError(str(path), "", f"expected each key once per mapping, {exc}") from None
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise InputError(str(path), "", f"expected valid YAML{where}") from None
    except (RecursionError, ValueError, TypeError, OverflowError):
        raise InputError(str(path), "", "expected valid YAML") from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON-object lines of a JSONL file (metrics, controller log, rank failure records), in
    order; ``[]`` for a missing file. A torn line (a crash mid-write), a line that is not JSON
    and a line that is JSON but not an object (``[1, 2]``) are skipped, as are undecodable
    bytes. The one reader of every JSONL file hetrain writes.
    """
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_text(path: str | Path) -> str:
    """The UTF-8 text of an input file.

    Raises:
        InputError: the file is missing, a directory, unreadable or not UTF-8 text.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(str(path), "", "file not found")
    if p.is_dir():
        raise InputError(str(path), "", "expected a file, got a directory")
    try:
        # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first key/column
        return p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(str(path), "", "expected a UTF-8 text file") from None
    except OSError as exc:
        raise InputError(str(path), "", f"cannot read file ({exc.strerror or exc})") from None


def check_output_path(option: str, path: str | Path) -> None:
    """Fail early, before any work, when ``path`` cannot be written as a file: it is a
    directory, or its parent exists and is not a directory (missing parents are created by
    the writers).

    Raises:
        InputError: naming ``option``.
    """
    p = Path(path)
    if p.is_dir():
        raise InputError(option, "", f"expected a file path, got the directory {str(path)!r}")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(
                    option, "", f"expected a file path, but {str(parent)!r} is not a directory"
                )
            break


class _DuplicateKey(ValueError):
    """A mapping of an input file names a key twice (JSON and YAML parsers keep the last)."""


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"got {str(key)[:80]!r} twice")
        out[key] = value
    return out


_LOADER: Any = None


def _unique_key_loader() -> Any:
    """A ``yaml.SafeLoader`` subclass whose mappings reject duplicate keys."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):  # type: ignore[override]
                # explicit keys only: a '<<' merge may be overridden (YAML merge semantics)
                seen: set = set()
                for key_node, _ in getattr(node, "value", ()):
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    if not isinstance(key, (str, int, float, bool)):
                        continue
                    if key in seen:
                        line = key_node.start_mark.line + 1
                        raise _DuplicateKey(f"got {str(key)[:80]!r} twice (line {line})")
                    seen.add(key)
                return super().construct_mapping(node, deep=deep)

        _LOADER = UniqueKeyLoader
    return _LOADER


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


MAX_NUMBER = 1e30
"""Largest magnitude accepted for a number in a cluster or profile file, in the file's units.
Far above any real device or layer (1e30 FLOP per sample, 1e30 TFLOP/s), and small enough that
unit conversions and the cost model's products stay finite (docs/model.md §7: numbers must be
finite)."""

MIN_POSITIVE = 1e-30
"""Smallest value accepted for a speed or bandwidth (``tflops``, ``*_gbps``, a trace's
``speed_factor``), the divisors of the cost model: with :data:`MAX_NUMBER` and
:data:`MAX_BATCH` every time, cost and objective stays far below the float range (1e-300
TFLOP/s made times infinite and the planner report that the model fits nowhere)."""


def check_not_tiny(value: float) -> float:
    """Pydantic after-validator: ``value`` is 0 (rejected elsewhere) or >= :data:`MIN_POSITIVE`."""
    if 0 < value < MIN_POSITIVE:
        raise ValueError(f"expected a number >= {MIN_POSITIVE:g} (or check the units)")
    return value


MAX_BATCH = 10**15
"""Largest global batch, share or micro-batch size accepted (samples). Far above any real
run, and small enough that the planner's int64 arithmetic cannot overflow."""

MAX_SEED = 2**63 - 1
"""Largest ``--seed`` accepted: torch's generators take a 64-bit seed and
``numpy.random.default_rng`` a non-negative one, so seeds are integers in ``[0, 2**63 - 1]``
(docs/training.md "Options")."""


def check_seed(option: str, value: Any) -> int:
    """``value`` as a seed for torch and numpy: an integer in ``[0, MAX_SEED]``.

    Raises:
        InputError: not an integer, negative (numpy's ``default_rng`` refuses it in every rank)
            or above :data:`MAX_SEED` (torch's ``manual_seed`` overflows).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InputError(
            option, "", f"expected an integer between 0 and 2**63-1 ({MAX_SEED}), got {value!r}"
        )
    return value


MAX_NESTING = 100
"""Deepest nesting of lists/mappings accepted in an input file (the formats need 4)."""


def check_finite_tree(
    source: str, obj: Any, field: str = "", *, bool_keys: tuple[str, ...] = ()
) -> None:
    """Raise :class:`InputError` for any NaN or infinite float inside ``obj`` (docs/model.md §7:
    "Numbers must be finite"), any boolean except as the value of a mapping key named in
    ``bool_keys`` (e.g. a profile's ``shared[].frozen``), or for nesting deeper than
    :data:`MAX_NESTING`.

    Iterative, and each container is visited once even when YAML aliases make it reachable many
    times, so hostile files (deep nesting, "billion laughs" alias bombs) fail fast instead of
    overflowing the stack or running for hours.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(obj, field, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, bool) and bool_keys and where.rsplit(".", 1)[-1] in bool_keys:
            continue
        if isinstance(item, bool):
            # no field of the cluster, profile or plan formats is a boolean; pydantic would
            # read true as 1 (YAML's yes/on are booleans too)
            raise InputError(
                source, where, f"expected a number or a string, got {str(item).lower()}"
            )
        if isinstance(item, float):
            if not math.isfinite(item):
                raise InputError(source, where, f"expected a finite number, got {item}")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_NESTING:
            raise InputError(source, where, f"expected at most {MAX_NESTING} levels of nesting")
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            children = [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
        else:
            children = [(v, f"{where}[{i}]") for i, v in enumerate(item)]
        stack.extend((v, w, depth + 1) for v, w in reversed(children))
