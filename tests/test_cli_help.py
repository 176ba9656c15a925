"""What a new user meets first: ``hetrain --version``, a help text for every option of every
command, and help texts that point at the repository's own docs (docs/model.md), never at a
file the repository does not ship."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

import hetrain
from hetrain.cli import app, main

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> dict:
    """The root command ("") and every subcommand, as the click objects typer builds (typer
    vendors click, so they are matched by duck typing)."""
    group = typer.main.get_command(app)
    return {"": group, **group.commands}


COMMANDS = _commands()


def test_the_command_tree_has_the_documented_commands() -> None:
    assert {"plan", "evaluate", "simulate", "train", "profile"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS), ids=lambda n: n or "hetrain")
def test_every_option_has_help(name: str) -> None:
    command = COMMANDS[name]
    missing = [
        "/".join(p.opts)
        for p in command.params
        if p.param_type_name == "option" and not (getattr(p, "help", None) or "").strip()
    ]
    assert not missing, f"hetrain {name}: options without help: {missing}"
    assert (command.help or "").strip(), f"hetrain {name} has no help text"


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hetrain {hetrain.__version__}"


def test_version_of_the_installed_script() -> None:
    exe = Path(sys.executable).with_name("hetrain")
    if not exe.is_file():
        pytest.skip("the hetrain script is not installed next to this interpreter")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"hetrain {hetrain.__version__}"


def _help_text(name: str, capsys) -> str:
    argv = [name, "--help"] if name else ["--help"]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS), ids=lambda n: n or "hetrain")
def test_help_cites_only_shipped_docs(name: str, capsys) -> None:
    text = _help_text(name, capsys)
    assert "Usage:" in text
    assert not re.search(r"\bSPEC\b", text), f"hetrain {name} --help cites SPEC: {text}"
    for doc in re.findall(r"docs/[\w.-]+\.md", text):
        assert (ROOT / doc).is_file(), f"hetrain {name} --help cites {doc}, not shipped"


def test_train_help_describes_the_options_the_issue_named(capsys) -> None:
    text = " ".join(_help_text("train", capsys).split())
    for option in (
        "--lr",
        "--optimizer",
        "--seed",
        "--weight-decay",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--max-restarts",
        "--tensorboard",
    ):
        # the option is followed by its metavar and then words of help, not the next option
        match = re.search(re.escape(option) + r"(?: <[^>]+>)? (\S+)", text)
        assert match and not match.group(1).startswith("--"), option
