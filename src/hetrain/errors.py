"""Errors for bad input: one clear line naming the file, the field and what was expected.

Every loader raises :class:`InputError`; the CLI prints ``str(error)`` on one line to stderr and
exits with status 2 (SPEC §7: "Bad input of any kind ... exits with status 2 and one clear line
naming the file, the field and what was expected").
"""

from __future__ import annotations

from typing import Any


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


def from_validation_error(source: str, exc: Any) -> InputError:
    """Convert the first error of a ``pydantic.ValidationError`` into an :class:`InputError`.

    The message names the field and pydantic's expectation, with the offending value when it is
    short (e.g. ``cluster.yaml: devices[0].tflops: expected a finite number > 0, got -3``).
    """
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    # drop pydantic's internal tags such as 'function-after[...]'
    loc = tuple(p for p in loc if not (isinstance(p, str) and "[" in p and "]" in p))
    field = format_loc(loc)
    msg = str(err.get("msg", "invalid value"))
    kind = err.get("type", "")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "extra_forbidden":
        msg = "unknown key (not in the format; check the spelling and units)"
    elif kind == "missing":
        msg = "missing required field"
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
    available. Commands turn it into an :class:`InputError` naming the model file (SPEC §7: "a
    model that fits on no arrangement of the devices" is bad input, exit 2)."""
