"""Hang detection (issue 6): a rank that makes no progress within a timeout is treated as failed,
and the other ranks fail too instead of waiting forever."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetrain.runtime.watchdog import HANG_EXIT_CODE, Watchdog, process_group_timeout

WORLD = 3
HANG_RANK = 2
HANG_AT_STEP = 3
TIMEOUT_S = 3.0


def _rank_main(rank: int, tmp: str) -> None:
    """One rank: all-reduce a counter every step; rank HANG_RANK stops making progress (sleeps
    forever, as a deadlocked or stuck rank would) at step HANG_AT_STEP."""
    log = open(Path(tmp) / f"rank{rank}.log", "w")  # noqa: SIM115 - lives until os._exit
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(tmp) / "pg_store"), WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=process_group_timeout(30)
    )
    watch_store = dist.FileStore(str(Path(tmp) / "watchdog_store"), WORLD)
    wd = Watchdog(TIMEOUT_S, rank=rank, peers=range(WORLD), store=watch_store, poll_s=0.2)
    wd.start()
    try:
        for step in range(200):
            if rank == HANG_RANK and step == HANG_AT_STEP:
                time.sleep(3600)
            t = torch.ones(4)
            dist.all_reduce(t)
            wd.beat(step)
            time.sleep(0.02)
    except Exception as exc:  # a collective failed because a peer went away: failed, not hung
        print(f"rank {rank}: collective failed: {type(exc).__name__}", file=sys.stderr, flush=True)
        os._exit(3)
    print(f"rank {rank}: finished all steps", file=sys.stderr, flush=True)
    os._exit(0)


@pytest.mark.multiprocess
def test_hung_rank_fails_and_others_do_not_wait(tmp_path):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)  # far above TIMEOUT_S: only a real hang reaches it
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not alive, f"ranks {alive} still waiting"
        logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(WORLD)}
        # the stuck rank declared itself hung
        assert procs[HANG_RANK].exitcode == HANG_EXIT_CODE, logs
        assert f"rank {HANG_RANK}: no progress" in logs[HANG_RANK]
        assert f"last step {HANG_AT_STEP - 1}" in logs[HANG_RANK]
        # the others failed (peer watchdog or a broken collective), none finished
        for r in range(WORLD):
            if r != HANG_RANK:
                assert procs[r].exitcode in (HANG_EXIT_CODE, 3), (r, logs[r])
                assert "finished all steps" not in logs[r]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def test_watchdog_in_process_beats_suspension_and_hang():
    reasons: list[str] = []
    wd = Watchdog(1.0, rank=7, poll_s=0.05, on_hang=reasons.append, exit_process=False)
    with wd:
        for step in range(5):
            time.sleep(0.05)
            wd.beat(step)
        with wd.suspended():  # a long checkpoint write is not a hang
            time.sleep(2.0)
        wd.beat(5)
        assert wd.reason is None
        deadline = time.monotonic() + 60
        while wd.reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert wd.reason is not None and wd.reason.startswith("rank 7: no progress")
    assert "last step 5" in wd.reason
    assert reasons == [wd.reason]


class _DictStore:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


def test_watchdog_flags_a_silent_peer():
    store = _DictStore()
    wd = Watchdog(0.5, rank=0, peers=[0, 1], store=store, poll_s=0.05, exit_process=False)
    with wd:
        deadline = time.monotonic() + 60
        while wd.reason is None and time.monotonic() < deadline:
            wd.beat()  # this rank progresses; peer 1 never does
            time.sleep(0.05)
    assert wd.reason is not None and "peer rank 1" in wd.reason
    assert store.values["hetrain/watchdog/progress/0"] > 0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "x"])
def test_bad_timeouts_are_value_errors(bad):
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(bad)
    with pytest.raises(ValueError, match="hang_timeout_s"):
        process_group_timeout(bad)


def _train_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "hetrain", "train", "--example", "digits", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )  # fmt: skip


@pytest.mark.multiprocess
def test_train_with_a_stuck_rank_fails_instead_of_waiting(tmp_path):
    """``hetrain train --hang-timeout 3``: rank w1 is stuck (emulated slow-down of 10^5, a step
    of minutes); the run fails with one error line instead of waiting (torch's default
    collective timeout is 30 minutes)."""
    proc = _train_cli(
        ["--workers", "2", "--steps", "5", "--slowdown", "w1=100000", "--hang-timeout", "3",
         "--run-dir", str(tmp_path / "run"), "--no-report"],
        tmp_path,
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("hetrain: error: rank ") and "failed" in last, last
    assert "Timed out" in proc.stderr or "no progress" in proc.stderr


def test_train_rejects_a_bad_hang_timeout(tmp_path):
    proc = _train_cli(["--workers", "1", "--steps", "1", "--hang-timeout", "-1"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hetrain: error: --hang-timeout: expected a finite number > 0, got -1.0"
    ]
