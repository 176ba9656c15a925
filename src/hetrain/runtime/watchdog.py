"""Hang detection: a rank that makes no progress within a timeout is treated as failed.

Two layers, both cheap:

- :class:`Watchdog` (a daemon thread per rank). The training loop calls :meth:`Watchdog.beat`
  after every step. When no beat arrives for ``timeout_s`` seconds the rank declares itself
  hung: one line on stderr, an optional callback (e.g. a metrics record), then
  ``os._exit(HANG_EXIT_CODE)`` so that the launcher (or torchrun's elastic agent) sees a failed
  worker and restarts the survivors instead of waiting forever. With a ``store`` (a
  ``torch.distributed.Store`` or anything with ``add(key, n) -> int``) each rank also publishes
  a progress counter and watches its peers' counters: a peer whose counter does not move for
  ``timeout_s`` (hung, or killed without its sockets closing) makes this rank fail too. Counters
  are compared against this rank's own monotonic clock, so clocks need not agree across
  machines.
- A hard backstop for code that holds the GIL forever (a C extension spinning): with
  ``hard_timeout_s``, :mod:`faulthandler` (a C thread) dumps every thread's stack and exits
  the process if no beat arrived for that long.

Collectives additionally time out on their own when the process group is created with
``timeout=datetime.timedelta(seconds=...)`` (gloo and NCCL honour it); see
:func:`process_group_timeout`.

Known long operations that make no step progress (a checkpoint write, a plan migration) run
inside :meth:`Watchdog.suspended`: the rank counts as alive, not hung.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

HANG_EXIT_CODE = 124
"""Exit status of a rank that the watchdog declared hung (like ``timeout(1)``)."""


class CounterStore(Protocol):
    """What the watchdog needs from a store: an atomic ``add`` that returns the new value
    (``torch.distributed.Store.add``; ``add(key, 0)`` reads)."""

    def add(self, key: str, amount: int) -> int: ...


def process_group_timeout(hang_timeout_s: float) -> datetime.timedelta:
    """The ``timeout`` to pass to ``torch.distributed.init_process_group`` so that a collective
    (or a point-to-point receive) that waits on a hung peer fails after ``hang_timeout_s``
    seconds instead of the default 30 minutes.

    Raises:
        ValueError: ``hang_timeout_s`` is not a finite number > 0.
    """
    _check_timeout("hang_timeout_s", hang_timeout_s)
    return datetime.timedelta(seconds=float(hang_timeout_s))


def _check_timeout(name: str, value: float | None) -> None:
    if value is None:
        return
    try:
        ok = float(value) > 0 and float(value) != float("inf")
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")


class Watchdog:
    """Per-rank progress watchdog; see the module docstring.

    Args:
        timeout_s: seconds without a :meth:`beat` (outside :meth:`suspended`) after which this
            rank is declared hung; also the time a peer's counter may stand still.
        rank: this rank (for messages and the store key).
        peers: ranks to watch through ``store`` (default: none).
        store: a store client used only by the watchdog thread (give it its own client, e.g.
            ``torch.distributed.TCPStore(host, port, is_master=False)`` or a ``FileStore``; the
            main thread's client may not be thread-safe). ``None`` = watch only this rank.
        prefix: key prefix in the store (use a new one per restart/round, e.g. the round id).
        poll_s: how often the thread checks, default ``min(1, timeout_s / 4)`` seconds.
        on_hang: called with a one-line reason before the process exits; if it returns, the
            process exits with :data:`HANG_EXIT_CODE`. Exceptions in it are ignored.
        exit_process: ``False`` only in tests: call ``on_hang`` but keep the process alive.
        hard_timeout_s: optional GIL-independent backstop (:mod:`faulthandler`), seconds; should
            be larger than ``timeout_s``.

    Raises:
        ValueError: a timeout that is not a finite number > 0.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int = 0,
        peers: Sequence[int] = (),
        store: CounterStore | None = None,
        prefix: str = "hetrain/watchdog",
        poll_s: float | None = None,
        on_hang: Callable[[str], Any] | None = None,
        exit_process: bool = True,
        hard_timeout_s: float | None = None,
    ) -> None:
        _check_timeout("timeout_s", timeout_s)
        _check_timeout("poll_s", poll_s)
        _check_timeout("hard_timeout_s", hard_timeout_s)
        self.timeout_s = float(timeout_s)
        self.rank = int(rank)
        self.peers = [int(p) for p in peers if int(p) != int(rank)]
        self.store = store
        self.prefix = prefix
        self.poll_s = float(poll_s) if poll_s is not None else min(1.0, self.timeout_s / 4)
        self.on_hang = on_hang
        self.exit_process = exit_process
        self.hard_timeout_s = hard_timeout_s
        self.reason: str | None = None  # set when a hang was detected
        self.last_step: int | None = None
        self._last_beat = time.monotonic()
        self._suspended = 0
        self._progress = 0  # own beats, published to the store
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- main-thread API
    def start(self) -> Watchdog:
        """Start the watchdog thread (idempotent); returns ``self``."""
        if self._thread is None:
            self._last_beat = time.monotonic()
            self._thread = threading.Thread(
                target=self._run, name=f"hetrain-watchdog-{self.rank}", daemon=True
            )
            self._thread.start()
            self._arm_hard()
        return self

    def beat(self, step: int | None = None) -> None:
        """Record progress (call after every training step). ``step`` is only reported."""
        with self._lock:
            self._last_beat = time.monotonic()
            self._progress += 1
            if step is not None:
                self.last_step = int(step)
        self._arm_hard()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """A known long operation (checkpoint write, migration): alive, not hung. The rank keeps
        publishing progress to its peers while inside."""
        with self._lock:
            self._suspended += 1
        if self.hard_timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1
                self._last_beat = time.monotonic()
            self._arm_hard()

    def stop(self) -> None:
        """Stop the thread and the hard backstop (idempotent)."""
        self._stop.set()
        if self.hard_timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- thread
    def _arm_hard(self) -> None:
        if self.hard_timeout_s is not None and not self._stop.is_set() and not self._suspended:
            faulthandler.dump_traceback_later(self.hard_timeout_s, repeat=False, exit=True)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/progress/{rank}"

    def _run(self) -> None:
        peer_seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            with self._lock:
                idle_s = now - self._last_beat
                busy = self._suspended > 0
                if busy:
                    self._progress += 1
                progress = self._progress
            if not busy and idle_s > self.timeout_s:
                last = (
                    f"last step {self.last_step}" if self.last_step is not None else "no step yet"
                )
                self._fail(
                    f"rank {self.rank}: no progress for {idle_s:.1f} s "
                    f"(timeout {self.timeout_s:g} s, {last}); treating it as failed"
                )
                return
            if self.store is None:
                continue
            try:
                published = self.store.add(self._key(self.rank), 0)
                if progress > published:
                    self.store.add(self._key(self.rank), progress - published)
                for peer in self.peers:
                    value = self.store.add(self._key(peer), 0)
                    old = peer_seen.get(peer)
                    if old is None or value != old[0]:
                        peer_seen[peer] = (value, now)
                    elif now - old[1] > self.timeout_s:
                        self._fail(
                            f"rank {self.rank}: peer rank {peer} made no progress for "
                            f"{now - old[1]:.1f} s (timeout {self.timeout_s:g} s); "
                            "treating it as failed"
                        )
                        return
            except Exception as exc:  # the store is gone: the run is being torn down
                self._fail(f"rank {self.rank}: watchdog store unreachable ({type(exc).__name__})")
                return

    def _fail(self, reason: str) -> None:
        self.reason = reason
        print(f"hetrain: watchdog: {reason}", file=sys.stderr, flush=True)
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(reason)
        if self.exit_process:
            os._exit(HANG_EXIT_CODE)
