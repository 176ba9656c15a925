"""One run config (issue 20): every field of ``RunConfig`` is a ``hetrain train`` option and a
``hetrain.train`` keyword with the same default and help, ``hetrain train`` has no option
outside ``RunConfig`` and ``CommandOptions``, the config and the job are frozen, and a bad value
of any field is one line (exit 2 from the command) before any process starts, the same line
from ``hetrain.train``."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetrain
from hetrain.cli import app, main
from hetrain.errors import InputError
from hetrain.runtime.config import (
    CommandOptions,
    RunConfig,
    cli_type,
    flag_of,
)
from hetrain.runtime.trainjob import TrainJob

FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
COMMAND_FIELDS = {f.name: f for f in dataclasses.fields(CommandOptions)}
TRAIN_COMMAND = typer.main.get_command(app).commands["train"]
CLI_PARAMS = {p.name: p for p in TRAIN_COMMAND.params}
API_OWN = {  # hetrain.train's own arguments: objects a command line cannot carry
    "model",
    "dataset",
    "loss_fn",
    "val_dataset",
    "evaluate",
    "layers",
    "collate_fn",
    "target_key",
    "param_groups",
    "load_into_model",
}


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", [*FIELDS, *COMMAND_FIELDS])
def test_every_option_is_a_cli_option_with_the_fields_default_and_help(name: str) -> None:
    f = FIELDS.get(name) or COMMAND_FIELDS[name]
    param = CLI_PARAMS[name]
    assert flag_of(f).split("/")[0] in param.opts
    assert param.default == f.default
    assert param.help == f.metadata["help"] and f.metadata["help"].strip()


@pytest.mark.parametrize("name", list(FIELDS))
def test_every_run_option_is_a_train_keyword_with_the_fields_default_and_help(name: str) -> None:
    f = FIELDS[name]
    param = inspect.signature(hetrain.train).parameters[name]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert param.default == f.default
    doc = _words(inspect.getdoc(hetrain.train) or "")
    assert f"{name}: {_words(f.metadata['help'])} (default {f.default!r})" in doc


def test_no_option_outside_the_config() -> None:
    cli = {p.name for p in TRAIN_COMMAND.params if p.name != "help"}
    assert cli == set(FIELDS) | set(COMMAND_FIELDS)
    api = set(inspect.signature(hetrain.train).parameters)
    assert api == set(FIELDS) | API_OWN
    assert not set(FIELDS) & set(COMMAND_FIELDS)


def test_units_are_in_the_names() -> None:
    """A field whose help gives it in seconds ends in ``_s`` (``hang_timeout_s``)."""
    for name, f in FIELDS.items():
        assert ("seconds" in f.metadata["help"]) == name.endswith("_s"), name


def test_config_and_job_are_frozen() -> None:
    config = RunConfig(steps=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 4  # type: ignore[misc]
    assert dataclasses.replace(config, steps=4).steps == 4 and config.steps == 3
    job = TrainJob(task=None, devices=["w0"], steps=1, batch=1)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.trace_rows = []  # type: ignore[misc]
    import hetrain.runtime.worker_main as worker_main

    assert worker_main.TrainJob is TrainJob  # re-exported where the loop reads it


def test_values_are_normalised_once() -> None:
    config = RunConfig(run_dir="r", slowdown=["w1=3", "w2=1.5"], plan="p.json")
    assert str(config.run_dir) == "r" and config.run_dir.__class__.__name__.endswith("Path")
    assert config.slowdown == (("w1", 3.0), ("w2", 1.5))
    assert RunConfig(slowdown={"w1": 3}).slowdown == (("w1", 3.0),)
    assert dataclasses.replace(config) == config  # normalising twice changes nothing


# ---- bad values: a population derived from each field's type ----


def _kind(name: str) -> str:
    t = str(cli_type(FIELDS[name]))
    if "bool" in t:
        return "bool"
    if "int" in t:
        return "int"
    if "float" in t:
        return "float"
    return "other"


INT_FIELDS = [n for n in FIELDS if _kind(n) == "int"]
FLOAT_FIELDS = [n for n in FIELDS if _kind(n) == "float"]
CHOICE_FIELDS = {
    "optimizer": ("sgd", "adamw"),
    "dtype": ("float32", "float64"),
    "schedule": ("1f1b", "gpipe"),
    "lr_schedule": ("cosine", "constant"),
    "on_nonfinite": ("stop", "skip"),
}


def _cli_text(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _assert_one_line_everywhere(name: str, value, capsys) -> None:
    """The same one line from ``RunConfig``, ``hetrain train`` (exit 2) and ``hetrain.train``,
    naming the option's flag (``capsys`` is read after each call, so a fixture shared by the
    examples of one ``@given`` test holds only that call's output)."""
    flag = flag_of(FIELDS[name]).split("/")[0]
    with pytest.raises(InputError) as info:
        RunConfig(**{name: value})
    line = str(info.value)
    assert "\n" not in line and line.startswith(flag), line
    code = main(["train", "--example", "digits", "--no-progress", flag, _cli_text(value)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"hetrain: error: {line}\n", err
    with pytest.raises(InputError) as api:
        hetrain.train(model=None, dataset=None, loss_fn=None, **{name: value})
    assert str(api.value) == line


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_negative_or_huge_count_is_one_line(data, capsys) -> None:
    name = data.draw(st.sampled_from(INT_FIELDS))
    value = data.draw(st.integers(max_value=-1) | st.integers(min_value=10**19))
    _assert_one_line_everywhere(name, value, capsys)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_negative_or_non_finite_number_is_one_line(data, capsys) -> None:
    name = data.draw(st.sampled_from(FLOAT_FIELDS))
    value = data.draw(
        st.floats(max_value=-1e-9, allow_nan=False) | st.sampled_from([math.nan, math.inf])
    )
    _assert_one_line_everywhere(name, value, capsys)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_an_unknown_choice_is_one_line(data, capsys) -> None:
    name = data.draw(st.sampled_from(sorted(CHOICE_FIELDS)))
    value = data.draw(
        st.text("abcdefgxyz0123456789", min_size=1, max_size=8).filter(
            lambda v: v not in CHOICE_FIELDS[name]
        )
    )
    _assert_one_line_everywhere(name, value, capsys)


def test_combinations_checked_in_the_config() -> None:
    with pytest.raises(InputError, match="^--checkpoint-every: expected --checkpoint-dir"):
        RunConfig(checkpoint_every=2)
    with pytest.raises(InputError, match="^--lr: not used with the user's own optimizer"):
        RunConfig(optimizer=lambda groups: None, lr=0.1)
    with pytest.raises(InputError, match="^--rdzv-endpoint: expected HOST:PORT"):
        CommandOptions(nnodes=2)
    with pytest.raises(InputError, match="^nope: expected a keyword of hetrain.train"):
        RunConfig.from_keywords({"nope": 1})
