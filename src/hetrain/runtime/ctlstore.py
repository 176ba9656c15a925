"""The controller's store and rank 0's side of its protocol (keys: :mod:`hetrain.runtime.adapt`):
the ``TCPStore`` the controller hosts, bound to one interface and guarded against forks
(:func:`_store`, :class:`_ForkSafeStore`), and :class:`ControllerLink`, the background thread of
a rank that sends the round's start and its measurements and keeps the newest decision, all as
JSON data (:mod:`hetrain.runtime.ctlwire`), never a pickle.

Imports torch only inside :func:`_store`, lazily.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from typing import Any

from hetrain.runtime.ctldecision import Decision
from hetrain.runtime.ctlwire import WireError, decode_decision, encode_init, encode_record

PREFIX = "hetrain/ctl/"

NEWS_KEY = "news"
"""A counter the controller raises (``store.add``) after it writes ``plan`` or ``error``: rank
0's link reads those keys only when the counter moved, one store request per read instead of
two or three."""

_FORK_LOCK = threading.Lock()
"""Held around every call into a controller store; a fork (the elastic agent forking the ranks
in the launching process, where the controller thread runs) waits for it. A store call holds
native mutexes of torch (c10's wait counters): a child forked while another thread is inside
one inherits the mutex locked and hangs at its first collective (seen: a rank of
bench/runtime_vs_ddp.py stuck in ``init_process_group``, ``WaitCounterHandle``)."""


def publish(store: Any, key: str, value: bytes | str) -> None:
    """The controller's write of ``plan`` or ``error`` (``key`` without :data:`PREFIX`): the
    value, then the :data:`NEWS_KEY` counter raised, which tells rank 0's link to read it."""
    store.set(PREFIX + key, value)
    store.add(PREFIX + NEWS_KEY, 1)


def _after_fork_in_child() -> None:
    if _FORK_LOCK.locked():
        _FORK_LOCK.release()


os.register_at_fork(
    before=_FORK_LOCK.acquire,
    after_in_parent=_FORK_LOCK.release,
    after_in_child=_after_fork_in_child,
)


class _ForkSafeStore:
    """A ``TCPStore`` whose calls hold :data:`_FORK_LOCK`."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with _FORK_LOCK:
                return attr(*args, **kwargs)

        return call


def _store(
    host: str, port: int, *, master: bool, timeout_s: float = 300.0, listen_fd: int | None = None
):
    """A ``TCPStore`` client, or (``master``) the server listening on ``host`` only: torch's
    own server listens on every interface whatever ``host`` says, so the listening socket is
    bound here (``127.0.0.1`` for a local run) and handed over (``master_listen_fd``);
    ``listen_fd``: a socket already bound to ``host:port`` and listening (inherited from the
    process that chose the port), used instead of binding one."""
    import datetime
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not master:  # connecting may wait for the server: a fork must not wait for it
        return _ForkSafeStore(dist.TCPStore(host, port, is_master=False, timeout=timeout))
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    port = int(sock.getsockname()[1])
    with _FORK_LOCK:
        return _ForkSafeStore(
            dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
                master_listen_fd=sock.detach(),  # the store's server owns the descriptor now
            )
        )


class ControllerLink:
    """Rank 0's side of the protocol; never blocks rank 0's step: one background thread makes
    the store connection (a controller process started under ``torchrun`` may take seconds to
    come up on a busy machine), sends the round's start and the measurements in order, and
    keeps the newest decision (and any controller failure) in memory; :meth:`post` and
    :meth:`poll` only touch that memory (no socket round trip on the step's path, which every
    other rank would wait for at the step's collective)."""

    REFRESH_S = 0.2
    """Seconds between two reads of the controller's newest decision when nothing is posted
    (it is also read after every post, once per step; reading every 20 ms instead delayed the
    main job's first re-plan by 10 steps on a loaded 2-core machine: 150 store requests a
    second from rank 0's process and the controller's host)."""

    def __init__(
        self, endpoint: str, timeout_s: float = 120.0, *, rank: int = 0, round_id: str = ""
    ) -> None:
        self.endpoint = endpoint
        self.rank = int(rank)
        self.round_id = round_id or uuid.uuid4().hex
        self.store: Any = None
        self._queue: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._failure: str | None = None
        self._decision: Decision | None = None
        self._decision_raw: bytes | None = None
        self._round_id: bytes | None = None  # the init_id of this link's round
        self._news: int | None = None  # the controller's NEWS_KEY counter when last read
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, args=(timeout_s,), name="hetrain-controller-link", daemon=True
        )
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        host, port = self.endpoint.rsplit(":", 1)
        try:
            store = _store(host.strip("[]"), int(port), master=False, timeout_s=timeout_s)
        except BaseException as exc:  # reported by the next poll
            self._error = exc
            return
        self.store = store
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._stop:
                        self._cond.wait(timeout=self.REFRESH_S)
                    items, self._queue = self._queue, []
                    stop = self._stop
                for kind, payload in items:
                    self._send(store, kind, payload)
                if stop:
                    return
                if self.rank == 0:
                    self._refresh(store)
        except BaseException as exc:  # reported by the next poll
            self._error = exc

    def _refresh(self, store: Any) -> None:
        news = int(store.add(PREFIX + NEWS_KEY, 0))  # creates it at 0 when absent
        if news == self._news:
            return
        self._news = news
        if store.check([PREFIX + "error"]):
            text = store.get(PREFIX + "error").decode(errors="replace").strip()
            self._failure = text.splitlines()[-1] if text else "unknown error"
            return
        if not store.check([PREFIX + "plan"]):
            return
        raw = store.get(PREFIX + "plan")
        if raw != self._decision_raw:
            self._decision_raw = raw
            try:
                round_id, decision = decode_decision(raw, Decision)
            except WireError as exc:
                print(f"hetrain: ignored a {exc}", file=sys.stderr, flush=True)
                return
            if round_id.encode() == self._round_id:  # another round's decision is not this one's
                self._decision = decision

    def _send(self, store: Any, kind: str, payload: Any) -> None:
        if kind == "init":
            self._news = None  # the next refresh reads the (new) round's keys
            for key in ("plan", "done", "error"):
                if store.check([PREFIX + key]):
                    store.delete_key(PREFIX + key)
            store.set(PREFIX + "init", encode_init({**payload, "round": self.round_id}))
            self._round_id = self.round_id.encode()
            store.set(PREFIX + "init_id", self._round_id)
        elif kind == "m":
            step, record = payload
            body = {**record, "round": self.round_id, "rank": self.rank}
            store.set(PREFIX + f"m/{step}/{self.rank}", encode_record(body))
        elif kind == "done":
            store.set(PREFIX + "done", "1")

    def _submit(self, kind: str, payload: Any) -> None:
        with self._cond:
            if kind == "init":  # a new round: the previous round's decision is not this one's
                self._decision = None
                self._decision_raw = None
            self._queue.append((kind, payload))
            self._cond.notify()

    def start_round(self, init: dict[str, Any]) -> None:
        """Post this round's start (the previous round's keys are dropped)."""
        self._submit("init", init)

    def post(self, step: int, record: dict[str, Any]) -> None:
        """This rank's measurements of ``step`` (``device``, ``plan_id`` and the seconds of
        :func:`~hetrain.runtime.ctlwire.encode_record`); returns at once (the link's thread
        writes them)."""
        self._submit("m", (step, record))

    def poll(self, current_plan_id: int) -> Decision | None:
        """The newest decision read so far when it is newer than ``current_plan_id``, else
        None (also while the connection is not up yet). No I/O: the thread reads it.

        Raises:
            RuntimeError: the controller failed (its traceback's last line), or its store could
                not be reached.
        """
        if self._error is not None:
            raise RuntimeError(f"the controller is unreachable at {self.endpoint}: {self._error}")
        if self._failure is not None:
            raise RuntimeError(f"the controller failed: {self._failure}")
        with self._cond:
            pending = any(kind == "init" for kind, _ in self._queue)
            decision = None if pending else self._decision
        if decision is None or int(decision.plan.plan_id) <= int(current_plan_id):
            return None
        return decision

    def close(self, wait_s: float = 5.0) -> None:
        """Tell the controller the round is over (sends what is queued first; waits up to
        ``wait_s`` for the connection and the sends)."""
        with self._cond:
            if self.rank == 0:  # the round is over when rank 0 says so
                self._queue.append(("done", None))
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=wait_s)
