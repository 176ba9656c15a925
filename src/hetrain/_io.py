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
    if not p.exists():
        raise InputError(str(path), "", "file not found")
    if p.is_dir():
        raise InputError(str(path), "", "expected a file, got a directory")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(path), "", f"cannot read file ({type(exc).__name__})") from None
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:
            raise InputError(str(path), "", f"expected valid JSON ({exc})") from None
    import yaml  # only for YAML files

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise InputError(str(path), "", f"expected valid YAML{where}") from None
    except (RecursionError, ValueError, TypeError, OverflowError):
        raise InputError(str(path), "", "expected valid YAML") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def check_finite_tree(source: str, obj: Any, field: str = "") -> None:
    """Raise :class:`InputError` for any NaN or infinite float inside ``obj`` (SPEC §7:
    "Numbers must be finite")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise InputError(source, field, f"expected a finite number, got {obj}")
    if isinstance(obj, dict):
        for k, v in obj.items():
            check_finite_tree(source, v, f"{field}.{k}" if field else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_finite_tree(source, v, f"{field}[{i}]")
