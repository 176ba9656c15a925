"""Ending a hetrain process while one of its background threads may be inside a C++ call.

At interpreter exit CPython ends a daemon thread with ``pthread_exit`` when the thread next
takes the GIL. A thread inside a torch call that released the GIL (a ``TCPStore`` ``get``,
``set`` or ``add`` of the controller link or the watchdog, waiting on a store that is slow or
gone) then unwinds through a ``noexcept`` C++ frame, and the C++ runtime calls
``std::terminate``: the process aborts (SIGABRT, "terminate called without an active
exception") after a run that succeeded, and torchrun's agents wait for it in their exit
barrier. :func:`exit_process` lets hetrain's threads finish first and, when one is still
inside such a call, ends the process without finalising the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import NoReturn

THREAD_PREFIX = "hetrain-"
"""Name prefix of every background thread hetrain starts."""

SETTLE_S = 5.0
"""Seconds :func:`exit_process` waits, in all, for hetrain's live threads to end."""


def live_threads() -> list[threading.Thread]:
    """hetrain's daemon threads (name starting with :data:`THREAD_PREFIX`) still running,
    the calling thread excluded."""
    me = threading.current_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me and t.daemon and t.is_alive() and t.name.startswith(THREAD_PREFIX)
    ]


def exit_process(code: int, settle_s: float = SETTLE_S) -> NoReturn:
    """End the process with status ``code``: ``sys.exit`` once hetrain's threads have ended
    (each joined, at most ``settle_s`` seconds in all); when one is still running after that,
    stdout and stderr are flushed and the process ends with ``os._exit`` (no interpreter
    finalisation, so no abort from a thread inside a torch call; ``atexit`` handlers do not
    run).
    """
    deadline = time.monotonic() + settle_s
    for thread in live_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    if live_threads():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)
