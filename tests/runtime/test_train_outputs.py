"""What a run leaves in its run directory: ``hetrain.train(run_dir=...)`` writes the report its
docstring promises (plots and ``report.txt``), and ``tensorboard=True`` / ``hetrain train
--tensorboard`` write TensorBoard event files next to ``metrics.jsonl`` with the run's scalars;
without the ``tensorboard`` package the option is one line and exit 2."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hetrain
from hetrain.cli import main
from hetrain.errors import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 3),
    )


def _data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("run")
    summary = hetrain.train(
        _model(),
        _data(),
        nn.functional.cross_entropy,
        val_dataset=_data(32),
        workers=2,
        steps=STEPS,
        batch=16,
        lr=1e-2,
        run_dir=run_dir,
        tensorboard=True,
        microbatch_size=4,
    )
    return run_dir, summary


@pytest.mark.multiprocess
def test_train_writes_the_report(trained_run) -> None:
    run_dir, summary = trained_run
    files = [Path(f) for f in summary["report_files"]]
    assert run_dir / "iteration_time.png" in files
    assert any(f.name.startswith("timeline_step") for f in files)
    import matplotlib.image

    for f in files:
        data = f.read_bytes()
        assert f.parent == run_dir and data.startswith(PNG_MAGIC) and len(data) > 1000, f
        pixels = matplotlib.image.imread(f)  # decodes: a whole, valid PNG
        assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100 and pixels.std() > 0, f
    report = (run_dir / "report.txt").read_text()
    assert f"steps: {STEPS}," in report
    assert (run_dir / "model.pt").stat().st_size > 0
    assert (run_dir / "metrics.jsonl").stat().st_size > 0


@pytest.mark.multiprocess
def test_tensorboard_event_files_hold_the_run_scalars(trained_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, summary = trained_run
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/iteration_time_s", "shares/group0", "val/loss"} <= tags
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in metrics if e["event"] == "step"]
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == [e["step"] for e in steps] == list(range(STEPS))
    for scalar, e in zip(loss, steps, strict=True):
        assert scalar.value == pytest.approx(e["loss"], rel=1e-6)
    shares = [acc.Scalars(t) for t in sorted(tags) if t.startswith("shares/")]
    for i, e in enumerate(steps):  # the shares of each step sum to the global batch
        assert sum(s[i].value for s in shares) == e["global_batch"] == 16
    assert acc.Scalars("val/loss")[-1].value == pytest.approx(summary["metrics"]["val_loss"])


def test_tensorboard_is_off_by_default() -> None:
    import inspect

    assert inspect.signature(hetrain.train).parameters["tensorboard"].default is False
    from hetrain.runtime.config import RunConfig

    assert RunConfig().tensorboard is False


def _hide_tensorboard(monkeypatch) -> None:
    """Simulate an environment without the ``tensorboard`` package."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    for mod in list(__import__("sys").modules):
        if mod == "tensorboard" or mod.startswith(("tensorboard.", "torch.utils.tensorboard")):
            monkeypatch.delitem(__import__("sys").modules, mod)


def test_missing_tensorboard_is_one_line_exit_2(tmp_path, monkeypatch, capsys) -> None:
    _hide_tensorboard(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--example", "digits", "--workers", "2", "--steps", "2", "--tensorboard"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("hetrain: error: --tensorboard")
    assert "pip install 'hetrain[tensorboard]'" in err
    assert not (tmp_path / "runs").exists()  # refused before any process started


def test_missing_tensorboard_in_the_python_api(tmp_path, monkeypatch) -> None:
    _hide_tensorboard(monkeypatch)
    with pytest.raises(InputError, match="tensorboard"):
        hetrain.train(
            _model(), _data(), nn.functional.cross_entropy, workers=2, steps=2,
            run_dir=tmp_path, tensorboard=True,
        )  # fmt: skip


def test_a_run_folder_hetrain_creates_ignores_its_outputs(tmp_path):
    """Run outputs are never committed, wherever a run writes them: the folder gets a
    ``.gitignore`` of ``*`` when hetrain creates it, and a folder the user made is left alone."""
    from hetrain.runtime.api import make_run_dir

    made = make_run_dir(tmp_path / "a" / "run")
    assert (made / ".gitignore").read_text().splitlines()[-1] == "*"
    own = tmp_path / "mine"
    own.mkdir()
    make_run_dir(own)
    assert not (own / ".gitignore").exists()


@pytest.mark.parametrize(
    "option, name",
    [("--out", "model.pt"), ("--metrics-out", "m.jsonl"), ("--checkpoint-dir", "ck"),
     ("--run-dir", "run")],
)  # fmt: skip
def test_an_unwritable_output_is_one_line_exit_2_before_any_rank_starts(
    tmp_path, monkeypatch, capsys, option, name
) -> None:
    """An output under a folder this process may not write (a read-only file system: what
    ``os.access`` says, emulated here for one folder, since a test cannot mount one) is bad
    input found before training: one line naming the option, exit 2, nothing written (the
    ranks trained a whole run and lost the model when ``--out`` was found unwritable at the
    end)."""
    import os

    import hetrain.runtime.run_outputs as run_outputs

    locked = tmp_path / "readonly"
    locked.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).resolve() == locked.resolve():
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_outputs.os, "access", access)
    run_dir = tmp_path / "r"
    argv = ["train", "--example", "digits", "--workers", "2", "--steps", "3", "--no-progress"]
    argv += [option, str(locked / name)]
    if option != "--run-dir":
        argv += ["--run-dir", str(run_dir)]
    if option == "--checkpoint-dir":
        argv += ["--checkpoint-every", "2"]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and option in err[0] and "cannot be written" in err[0], err
    assert not (run_dir / "metrics.jsonl").exists() and not any(locked.iterdir())
