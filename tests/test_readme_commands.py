"""The ``plan``, ``evaluate`` and ``simulate`` commands shown in README.md run as written (every
file they name is shipped) and give sensible answers."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from hetrain.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if re.match(r"hetrain (plan|evaluate|simulate) ", line) and " ... " not in line:
            out.append(shlex.split(line)[1:])
    return out


COMMANDS = _readme_commands()


def test_readme_shows_the_planning_commands() -> None:
    assert [c[0] for c in COMMANDS] == ["plan", "evaluate", "simulate"]


@pytest.mark.parametrize("argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_readme_command_runs(argv: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    for a in argv:
        if a.endswith((".yaml", ".json", ".csv")) and a != "plan.json":
            assert (ROOT / a).is_file(), f"README names {a}, which is not shipped"
    if "--plan" in argv:  # README: hetrain plan ... --json > plan.json, then evaluate it
        plan_argv = [a for a in argv if a not in ("--plan", "plan.json")]
        plan_argv[0] = "plan"
        assert main([*plan_argv, "--json"]) == 0
        (tmp_path / "plan.json").write_text(capsys.readouterr().out)
        argv = [str(tmp_path / a) if a == "plan.json" else a for a in argv]
    assert main(argv) == 0
    out = capsys.readouterr().out
    if argv[0] == "simulate":
        summary = json.loads(out)
        budget = float(argv[argv.index("--budget") + 1].split("=")[1])
        assert summary["infeasible_slots"] == 0
        # the budget binds (lyapunov saves against greedy) and is met on average
        assert 0.8 * budget < summary["mean_cost"]["money"] < 1.05 * budget
