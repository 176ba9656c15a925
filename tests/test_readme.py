"""Every command in a fenced ``bash`` block of README.md runs as a new user would type it, and
the test fails when one breaks.

The commands are parsed from the README (not copied here), so a changed or added command is
tested as written. What differs from a user's shell, and why:

- **set-up** (``python3 -m venv .venv``, ``.venv/bin/pip install ...``) is not repeated: the
  test runs in the environment pytest runs in, which ``.ci/run`` builds with exactly that
  set-up command. ``.venv/bin/hetrain`` / ``hetrain`` become ``python -m hetrain`` and
  ``.venv/bin/python`` / ``python`` this interpreter.
- **the test command** (``python -m pytest``) is not run from inside the test suite.
- **training** runs with few steps (``--steps 3``, no progress bar) so the suite stays fast;
  everything else in the command is kept.
- ``[--opt]`` in a command is an optional part: the command runs without it. ``cmd ...`` means
  the previous command of the same kind with its arguments; ``> FILE`` redirects stdout.
- Commands run in a scratch folder that links the repository's ``examples/``, so files the
  README names are the shipped ones and files it writes do not land in the checkout.

A command the parser does not recognise fails the test: extend the parser when the README
gains a new kind of command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRAIN_STEPS = "3"
SETUP = re.compile(r"^(python3? -m venv|(\.venv/bin/)?pip3? install)\b")
TEST_RUN = re.compile(r"^(\.venv/bin/)?python3? -m pytest\b")


@dataclass
class ReadmeCommand:
    """One command of the README: ``kind`` (``hetrain``, ``python``, ``setup``, ``tests``),
    ``argv`` (after the program), ``stdout_to`` (``> FILE``) and the README text."""

    kind: str
    argv: list[str]
    stdout_to: str | None
    text: str
    program: str = ""

    @property
    def id(self) -> str:
        return " ".join([self.kind, *self.argv[:1]])


def fenced_bash_blocks(text: str) -> list[str]:
    """The contents of every ```bash (or ```sh / ```console) block of ``text``."""
    return re.findall(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", text, re.S | re.M)


def readme_commands(text: str) -> list[ReadmeCommand]:
    """Commands of the fenced blocks: continuation lines joined, comments dropped, ``&&``
    chains split, ``cmd ...`` expanded from the previous command of the same kind.

    Raises:
        ValueError: a command that is not one of the kinds above.
    """
    out: list[ReadmeCommand] = []
    last: dict[str, list[str]] = {}
    for block in fenced_bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                out.append(_parse(part.strip(), last))
    return out


def _parse(text: str, last: dict[str, list[str]]) -> ReadmeCommand:
    if SETUP.match(text):
        return ReadmeCommand("setup", shlex.split(text), None, text)
    if TEST_RUN.match(text):
        return ReadmeCommand("tests", shlex.split(text), None, text)
    words = shlex.split(text)
    stdout_to = None
    if ">" in words:
        i = words.index(">")
        stdout_to, words = words[i + 1], words[:i]
    words = [w for w in words if not (w.startswith("[") and w.endswith("]"))]  # optional parts
    program, args = words[0], words[1:]
    if program in ("hetrain", ".venv/bin/hetrain"):
        kind = "hetrain"
    elif program in ("python", "python3", ".venv/bin/python", ".venv/bin/python3"):
        kind = "python"
    else:
        raise ValueError(f"README command not understood by tests/test_readme.py: {text!r}")
    if "..." in args:  # "hetrain plan ... --json": the previous plan command's arguments
        key = f"{kind} {args[0]}"
        if key not in last:
            raise ValueError(f"README command {text!r}: '...' without an earlier {key!r}")
        i = args.index("...")
        args = args[:i] + last[key][1:] + args[i + 1 :]
    elif args:
        last[f"{kind} {args[0]}"] = args
    return ReadmeCommand(kind, args, stdout_to, text, program)


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))
RUNNABLE = [c for c in COMMANDS if c.kind in ("hetrain", "python")]


def test_the_readme_commands_are_found() -> None:
    kinds = {c.kind for c in COMMANDS}
    assert {"setup", "tests", "hetrain"} <= kinds
    subcommands = {c.argv[0] for c in RUNNABLE if c.kind == "hetrain"}
    # the README shows the main job and the planning commands
    assert {"train", "plan", "evaluate", "simulate"} <= subcommands


def test_the_setup_command_is_what_ci_runs() -> None:
    """The skipped set-up is the one ``.ci/run`` performs before running this suite."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    setups = [c for c in COMMANDS if c.kind == "setup"]
    assert setups
    for c in setups:
        if "venv" in c.argv:
            assert "python3 -m venv .venv" in ci
        else:  # pip install -e ".[extras]": the same extras
            assert f'-e "{c.argv[-1]}"' in ci, c.text


def test_commands_use_the_programs_the_setup_installs() -> None:
    """After the set-up command, ``hetrain`` is not on the PATH (the venv is not activated):
    the README's commands must name ``.venv/bin/hetrain`` / ``.venv/bin/python``."""
    bare = [c.text for c in RUNNABLE if not c.program.startswith(".venv/bin/")]
    assert not bare, f"README commands that a fresh shell cannot run: {bare}"


def test_parser_understands_the_forms_used() -> None:
    text = (
        "```bash\n# comment\npython3 -m venv .venv && .venv/bin/hetrain plan --batch 2 \\\n"
        "    --model m.json [--json]\nhetrain plan ... --json > p.json\n```\n"
    )
    cmds = readme_commands(text)
    assert [c.kind for c in cmds] == ["setup", "hetrain", "hetrain"]
    assert cmds[1].argv == ["plan", "--batch", "2", "--model", "m.json"]
    assert cmds[2].argv == ["plan", "--batch", "2", "--model", "m.json", "--json"]
    assert cmds[2].stdout_to == "p.json"
    with pytest.raises(ValueError, match="not understood"):
        readme_commands("```bash\ncurl http://example.com\n```\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch folder with the repository's ``examples/`` linked in; commands run in order
    (a later command may read what an earlier one wrote, e.g. ``plan.json``)."""
    path = tmp_path_factory.mktemp("readme")
    (path / "examples").symlink_to(ROOT / "examples")
    return path


def _argv(command: ReadmeCommand) -> list[str]:
    if command.kind == "python":
        return [sys.executable, *command.argv]
    argv = list(command.argv)
    if argv[0] == "train":
        if "--steps" in argv:
            argv[argv.index("--steps") + 1] = TRAIN_STEPS
        else:
            argv += ["--steps", TRAIN_STEPS]
        argv += ["--no-progress"]
    return [sys.executable, "-m", "hetrain", *argv]


@pytest.mark.parametrize(
    "index", range(len(RUNNABLE)), ids=[f"{i}-{c.id}" for i, c in enumerate(RUNNABLE)]
)
def test_readme_command_runs(index: int, workdir: Path) -> None:
    command = RUNNABLE[index]
    for word in command.argv:  # every shipped file the README names exists
        if word.startswith("examples/"):
            assert (ROOT / word).exists(), f"README names {word}, which is not shipped"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="120")
    run = subprocess.run(
        _argv(command), cwd=workdir, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, (
        f"README command failed ({run.returncode}): {command.text}\n{run.stdout}\n{run.stderr}"
    )
    if command.stdout_to:
        (workdir / command.stdout_to).write_text(run.stdout, encoding="utf-8")
    _check_output(command, run.stdout, workdir)


def _check_output(command: ReadmeCommand, stdout: str, workdir: Path) -> None:
    """What each kind of command must have produced, beyond exit status 0."""
    argv = command.argv
    if command.kind == "python":
        if "help(hetrain.train)" in " ".join(argv):
            # the real signature and docstring, not a (*args, **kwargs) wrapper
            assert re.search(r"^train\((?!\*args)", stdout, re.M), stdout[:500]
            assert "Returns" in stdout and "Raises" in stdout
        return
    name = argv[0]
    if name == "plan" and "--json" in argv:
        plan = json.loads(stdout)
        batch = int(argv[argv.index("--batch") + 1])
        assert sum(g["batch"] for g in plan["groups"]) == batch
    elif name == "evaluate":
        assert "iteration time T =" in stdout
    elif name == "simulate" and "--json" in argv:
        summary = json.loads(stdout)
        assert summary["infeasible_slots"] == 0
        for item in argv[argv.index("--budget") + 1 :: 2] if "--budget" in argv else []:
            if not item.startswith("money="):
                continue
            budget = float(item.split("=")[1])  # the budget is met on average
            assert summary["mean_cost"]["money"] < 1.05 * budget
    elif name == "profile" and "--out" in argv:
        profile = json.loads((workdir / argv[argv.index("--out") + 1]).read_text())
        assert profile["layers"] and all(ly["fwd_flops"] >= 0 for ly in profile["layers"])
    elif name == "train":
        assert re.search(r"trained \d+ steps?", stdout), stdout
        (metrics,) = (workdir / "runs").rglob("metrics.jsonl")
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert sum(e["event"] == "step" for e in events) == int(TRAIN_STEPS)
        for name in ("model.pt", "iteration_time.png"):  # what the README says it writes
            assert (metrics.parent / name).stat().st_size > 0, name


def _user_docs() -> list[Path]:
    return [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_user_docs_cite_only_files_the_repository_ships() -> None:
    """README, examples/README.md and docs/ never send the reader to SPEC.md (not in the
    repository; docs/model.md states the model), and every docs page or repository file they
    name in backquotes exists."""
    for doc in _user_docs():
        text = doc.read_text(encoding="utf-8")
        assert not re.search(r"\bSPEC\b", text), f"{doc.relative_to(ROOT)} cites SPEC"
        for ref in re.findall(
            r"`((?:docs|examples|bench|src|tests)/[\w./-]+\.(?:md|py|yaml))`", text
        ):
            assert (ROOT / ref).exists(), f"{doc.relative_to(ROOT)} names {ref}, not shipped"
