"""The controller leaves nothing that delays its host process's exit, and its process under
torchrun accepts the ranks' store connections from the moment it is started."""

from __future__ import annotations

import socket
import threading

from hetrain._exit import THREAD_PREFIX
from hetrain.runtime.adapt import ControllerThread, spawn_controller_process
from hetrain.runtime.ctlcontroller import _search_executor


def test_a_stopped_controller_leaves_no_hetrain_thread_running():
    controller = ControllerThread().start()
    try:
        # the service's search thread has run a search (as after a run's first search)
        assert _search_executor().submit(lambda: 7).result(timeout=30) == 7
    finally:
        controller.close()
    ours = [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    for thread in ours:
        thread.join(timeout=5)  # an idle thread never ends: the process's exit waited for it
    assert [t.name for t in ours if t.is_alive()] == []


def test_the_controller_process_accepts_connections_as_soon_as_it_is_started():
    proc, endpoint = spawn_controller_process()
    try:
        host, port = endpoint.rsplit(":", 1)
        # the process is still starting (importing torch takes seconds): the socket it was
        # handed is already listening, so a store client is not refused
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)
