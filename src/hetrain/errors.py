"""Errors for bad input: one clear line naming the file, the field and what was expected.

Every loader raises :class:`InputError`; the CLI prints ``str(error)`` on one line to stderr and
exits with status 2 (docs/model.md §7: "Bad input of any kind ... exits with status 2 and one clear
line
naming the file, the field and what was expected").
"""

from __future__ import annotations

from typing import Any


class RunComplete(Exception):
    """An elastic restart round of a run whose latest checkpoint is already at its last step
    (a device joined as the run ended): nothing is left to train, which is success. The
    message is the one console line."""


class InputError(ValueError):
    """Bad user input (a file, a field, a command-line value).

    Args:
        source: the file path or command-line option the value came from, e.g. ``"cluster.yaml"``
            or ``"--batch"``.
        field: dotted path of the field inside that source, e.g. ``"devices[2].tflops"``;
            empty when the whole source is wrong (missing file, not YAML).
        expected: what was expected, e.g. ``"a finite number > 0, got -3"``.
    """

    def __init__(self, source: str, field: str, expected: str) -> None:
        self.source = str(source)
        self.field = field
        self.expected = expected
        where = f"{self.source}: {_clip(field)}" if field else self.source
        super().__init__(_one_line(f"{where}: {_clip(expected, 400)}"))


def _clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (hostile inputs can make keys megabytes long)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str) -> str:
    """Replace line breaks and other non-printable characters (``\\r``, ``\\u2028``, terminal
    escapes) by spaces, so that the message is exactly one printable line."""
    return "".join(c if c.isprintable() else " " for c in text)


def format_loc(loc: tuple[Any, ...]) -> str:
    """Turn a pydantic error location such as ``("devices", 2, "tflops")`` into
    ``"devices[2].tflops"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic location without its internal tags such as ``'function-after[...]'``."""
    return tuple(p for p in loc if not (isinstance(p, str) and "[" in p and "]" in p))


def _known_keys(model: Any, parent: tuple[Any, ...]) -> list[str]:
    """The field names of the pydantic model found at location ``parent`` inside ``model``
    (list indices skipped; ``list[X]``, ``tuple[X, ...]`` and ``X | None`` unwrapped); empty
    when it cannot be resolved."""
    import typing

    def inner_model(annotation: Any) -> Any:
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            return annotation
        for arg in typing.get_args(annotation):
            found = inner_model(arg)
            if found is not None:
                return found
        return None

    current = model
    for part in parent:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = inner_model(fields[part].annotation)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}) or {})


def from_validation_error(source: str, exc: Any, model: Any = None) -> InputError:
    """Convert the first error of a ``pydantic.ValidationError`` into an :class:`InputError`.

    The message names the field and pydantic's expectation, with the offending value when it is
    short (e.g. ``cluster.yaml: devices[0].tflops: expected a finite number > 0, got -3``).
    A missing field whose name is close (``difflib``) to an unknown key of the same mapping
    names that key as the probable typo (``missing required field; the unknown key 'tflop'
    is probably a typo of it``); an unknown key names the close known key (of the missing
    ones, or of ``model``'s fields at that place when the pydantic ``model`` is given).
    """
    import difflib

    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = _clean_loc(tuple(err.get("loc", ())))
    field = format_loc(loc)
    msg = str(err.get("msg", "invalid value"))
    kind = err.get("type", "")
    parent, name = loc[:-1], (str(loc[-1]) if loc else "")

    def siblings(of_kind: str) -> list[str]:
        out = []
        for other in errors:
            where = _clean_loc(tuple(other.get("loc", ())))
            if other.get("type") == of_kind and where[:-1] == parent and where:
                out.append(str(where[-1]))
        return out

    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "extra_forbidden":
        msg = "unknown key (not in the format; check the spelling and units)"
        known = siblings("missing") or [
            k for k in _known_keys(model, parent) if k not in siblings("extra_forbidden")
        ]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            msg += f"; did you mean {close[0]!r}?"
    elif kind == "missing":
        msg = "missing required field"
        close = difflib.get_close_matches(name, siblings("extra_forbidden"), n=1, cutoff=0.6)
        if close:
            msg += f"; the unknown key {close[0][:80]!r} is probably a typo of {name!r}"
    else:
        value = err.get("input")
        if msg.startswith("Input should be "):
            msg = "expected " + msg[len("Input should be ") :]
        elif not msg.startswith("expected"):
            msg = "expected valid value: " + msg
        if isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 40:
            msg = f"{msg}, got {value!r}"
    return InputError(source, field, msg)


class NoFeasiblePlanError(ValueError):
    """No arrangement of the available devices can hold the model (memory), or no device is
    available. Commands turn it into an :class:`InputError` naming the model file (docs/model.md §7:
    "a
    model that fits on no arrangement of the devices" is bad input, exit 2;
    :func:`no_fit_input_error`).

    Args:
        message: what does not fit.
        layer: the 0-based index of a layer that alone fits on no available device, when
            that is the reason (the message then names it, its bytes and the largest device
            memory); None otherwise.
    """

    def __init__(self, message: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.layer = layer


def no_fit_input_error(model_source: str, exc: NoFeasiblePlanError) -> InputError:
    """The exit-2 :class:`InputError` for a model that fits no arrangement of the devices:
    field ``layers[l]`` when one layer alone is the reason, else ``layers``."""
    layer = getattr(exc, "layer", None)
    field = "layers" if layer is None else f"layers[{layer}]"
    return InputError(
        model_source, field, f"expected a model that fits some arrangement of the devices ({exc})"
    )
