"""Fork-and-run helper for multi-process tests (gloo on CPU), reusable by every runtime test.

``run_ranks(fn, world_size, tmp_path)`` forks ``world_size`` processes, each with one torch
thread and a gloo process group rendezvousing through a file in ``tmp_path`` (no ports), runs
``fn(rank, world_size, *args)`` and returns the ranks' return values. Any rank failing, or
the run exceeding ``timeout_s``, kills the leftovers and raises :class:`RankFailure` naming the
rank, the exception type and its message.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised, died or timed out. ``failures`` maps rank -> (exception type name,
    message, traceback text)."""

    def __init__(self, failures: dict[int, tuple[str, str, str]]) -> None:
        self.failures = failures
        lines = [f"rank {r}: {kind}: {msg}" for r, (kind, msg, _) in sorted(failures.items())]
        tbs = [f"--- rank {r}\n{tb}" for r, (_, _, tb) in sorted(failures.items()) if tb]
        super().__init__("\n".join(lines + tbs))


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    rdzv: str,
    out_dir: str,
    pg_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rdzv}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        result = ("error", (type(exc).__name__, str(exc), traceback.format_exc()))
    path = Path(out_dir) / f"rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps(result))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result
        tmp.write_bytes(pickle.dumps(("error", (type(exc).__name__, str(exc), ""))))
    os.replace(tmp, path)
    os._exit(0)


def _warm_imports() -> None:
    """Import in the parent what every rank would otherwise import by itself after the fork
    (``torch.optim.AdamW`` pulls in ``torch._dynamo``: seconds per process on a busy box)."""
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], foreach=False)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | Path,
    *,
    args: tuple[Any, ...] = (),
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    Args:
        fn: a module-level or local function (fork: no pickling of ``fn``); its return value
            must be picklable.
        tmp_path: a fresh directory for the rendezvous file and the results.
        timeout_s: wall-clock limit for the whole run (leftovers are killed).
        pg_timeout_s: timeout of the process group's collectives.

    Returns:
        The ranks' return values, index = rank.

    Raises:
        RankFailure: a rank raised, exited without a result, or the run timed out.
    """
    _warm_imports()
    tmp = Path(tmp_path)
    tmp.mkdir(parents=True, exist_ok=True)
    rdzv = tmp / "rdzv"
    out_dir = tmp / "results"
    out_dir.mkdir(exist_ok=True)
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, str(rdzv), str(out_dir), pg_timeout_s, args),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    failures: dict[int, tuple[str, str, str]] = {}
    results: list[Any] = [None] * world_size
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            failures[r] = ("TimeoutError", f"rank {r} still running after {timeout_s} s", "")
            continue
        path = out_dir / f"rank{r}.pkl"
        if not path.exists():
            failures[r] = ("ProcessDied", f"exit code {p.exitcode}, no result", "")
            continue
        status, value = pickle.loads(path.read_bytes())
        if status == "ok":
            results[r] = value
        else:
            failures[r] = value
    if failures:
        raise RankFailure(failures)
    return results
