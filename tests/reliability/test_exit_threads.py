"""A hetrain process whose background thread is inside a torch store call when the command
ends exits with the command's status, not SIGABRT ("terminate called without an active
exception" from CPython ending the thread during interpreter finalisation): a rank of an
elastic run aborted that way after training when its controller link or watchdog was still
waiting on a store."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import datetime, subprocess, sys, threading, time
    import torch.distributed as dist

    server = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time, torch.distributed as d\\n"
         "parent = os.getppid()\\n"
         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\\n"
         "print(s.port, flush=True)\\n"
         "while os.getppid() == parent:\\n"
         "    time.sleep(0.2)\\n"],
        stdout=subprocess.PIPE, text=True,
    )
    port = int(server.stdout.readline())
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=datetime.timedelta(seconds=30))
    inside = threading.Event()
    from hetrain.cli import main

    def use_store():
        inside.set()
        try:
            if sys.argv[2] == "busy":  # a watchdog's or link's loop of store calls
                while True:
                    client.add("progress", 1)
            client.get("a key nobody sets")  # blocks inside C++, the GIL released
        except Exception:
            pass

    threading.Thread(target=use_store, name=sys.argv[1], daemon=True).start()
    inside.wait()
    time.sleep(0.3)
    if sys.argv[2] == "gone":  # the store's host ended while the thread waits on it
        server.kill()
    sys.argv = ["hetrain", "--version"]
    main()
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("thread", "store"), [("hetrain-watchdog-2", "busy"), ("hetrain-controller-link", "gone")]
)
def test_a_command_ends_cleanly_while_a_store_thread_waits(tmp_path, store, thread):
    script = tmp_path / "store_thread.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), thread, store],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
