"""A rendezvous that cannot be joined (another program holds the ``--rdzv-endpoint`` port) is
one line naming the endpoint after ``--rdzv-timeout`` seconds, not a silent wait."""

from __future__ import annotations

import socket

import pytest

from hetrain.cli import main

COMMON = [
    "train",
    "--example",
    "digits",
    "--workers",
    "2",
    "--steps",
    "3",
    "--no-progress",
    "--no-report",
    "--no-demo-slowdown",
]


def test_held_port_is_one_line_naming_the_endpoint(tmp_path, capsys):
    with socket.socket() as holder:  # a program that is not a rendezvous store
        holder.bind(("127.0.0.1", 0))
        holder.listen(8)
        endpoint = f"127.0.0.1:{holder.getsockname()[1]}"
        code = main(
            [
                *COMMON,
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-timeout",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
        err = capsys.readouterr().err
    assert code == 1
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [
        f"hetrain: error: rendezvous at {endpoint} cannot be joined: no rendezvous store "
        "answered within --rdzv-timeout 2 s; is another program using that port?"
    ]


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_bad_rdzv_timeout_is_bad_input(tmp_path, capsys, bad):
    code = main([*COMMON, "--rdzv-timeout", bad, "--run-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rdzv-timeout" in err[0]
