"""One line for a failed file-system write (full disk, read-only folder, I/O error): the OS
error found in an exception's chain (DCP's per-rank failures included), else a probe of the
folder. Used by :mod:`hetrain.runtime.checkpoint`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def os_error_line(exc: BaseException) -> str | None:
    """``strerror`` of the first ``OSError`` in ``exc``'s chain, DCP's per-rank failures
    included (``CheckpointException.failures``), or None."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and (e.strerror or e.errno):
            return e.strerror or os.strerror(e.errno)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                # DCP's WRAPPED_EXCEPTION: (exception, traceback summary)
                inner = f[0] if isinstance(f, tuple) and f else f
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def probe_error(folder: Path) -> str | None:
    """``strerror`` of writing 1 MiB into ``folder`` (None if that works): tells a full disk
    from other failures when a writer reported no ``OSError`` (torch's zip writer says only
    ``unexpected pos ...``)."""
    probe = folder / f".probe-{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def write_failure_text(exc: BaseException, folder: Path) -> str:
    """One line for a failed write: the OS error, else a probe of the folder, else the
    exception's type and first line (clipped)."""
    line = os_error_line(exc) or probe_error(folder)
    if line:
        return line
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}"
