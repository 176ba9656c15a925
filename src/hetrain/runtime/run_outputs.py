"""The files a run writes, checked before any rank starts (:func:`check_outputs`, called by
:func:`hetrain.runtime.job.build_job`): each path can be written, the outputs are distinct
files, none is an input file, a report file or inside the checkpoint folder, and the checkpoint
folder's latest checkpoint belongs to this model and leaves steps to train. Bad paths raise a
one-line :class:`~hetrain.errors.InputError` naming the option.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain.errors import InputError, RunComplete
from hetrain.runtime.config import RunConfig


def check_output_path(option: str, path: Path, *, folder: bool) -> None:
    """An output path that training could not write is bad input, found before any rank starts
    (not after the ranks trained, whose model or checkpoints would then be lost): a folder
    where a file is expected or the reverse, a parent that is a file, or a path this process
    may not write (``os.access(W_OK)`` of the path when it exists, else of its nearest existing
    parent: no permission, or a read-only file system).

    Raises:
        InputError: one line naming the option and the path.
    """
    kind = "a folder" if folder else "a file"
    if path.exists() and path.is_dir() != folder:
        raise InputError(
            option, "", f"expected {kind}, got {'a file' if folder else 'a folder'}: {path}"
        )
    target = path if path.exists() else None
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(option, "", f"expected {kind} path, but {parent} is a file")
            target = target or parent
            break
    if target is not None and not os.access(target, os.W_OK):
        raise InputError(
            option, "", f"expected a writable path, but {target} cannot be written "
            "(no permission or a read-only file system)"
        )  # fmt: skip


REPORT_FILES = ("report.txt", "iteration_time.png", "predicted_vs_measured.png")


def check_outputs_apart(
    out: str | Path | None,
    metrics_out: str | Path | None,
    run_dir: str | Path | None,
    checkpoint_dir: str | Path | None,
) -> None:
    """``--out`` and ``--metrics-out`` are not files the run writes itself into ``--run-dir``
    (the report: ``report.txt``, ``iteration_time.png``, ``predicted_vs_measured.png``,
    ``timeline_step<N>.png``; ``model/``, where a Hugging Face model is exported) and not in
    ``--checkpoint-dir`` (an ``--out`` there replaced a checkpoint's data file, and the
    resume then refused the checkpoint as corrupted).

    Raises:
        InputError: naming the option and the file it would overwrite.
    """
    import fnmatch

    for option, given in (("--out", out), ("--metrics-out", metrics_out)):
        if given is None:
            continue
        path = Path(given).resolve()
        if run_dir is not None:
            folder = Path(run_dir).resolve()
            if path.parent == folder and (
                path.name in REPORT_FILES or fnmatch.fnmatch(path.name, "timeline_step*.png")
            ):
                raise InputError(
                    option,
                    str(given),
                    f"expected a file other than the run report's {path.name} in --run-dir",
                )
            hf = folder / "model"
            if path == hf or hf in path.parents:
                raise InputError(
                    option,
                    str(given),
                    "expected a path outside RUN_DIR/model (where a Hugging Face model is "
                    "exported)",
                )
        if checkpoint_dir is not None:
            ckpt_dir = Path(checkpoint_dir).resolve()
            if path == ckpt_dir or ckpt_dir in path.parents:
                raise InputError(
                    option,
                    str(given),
                    f"expected a path outside --checkpoint-dir {checkpoint_dir} (it would "
                    "overwrite the checkpoints)",
                )


def check_distinct_outputs(
    out: str | Path | None,
    metrics_out: str | Path | None,
    run_dir: str | Path | None,
    inputs: Sequence[tuple[str, Path]] = (),
) -> None:
    """The files a run writes are distinct: the trained ``state_dict`` (``--out``, default
    ``RUN_DIR/model.pt``), the metrics (``--metrics-out``) and the controller log
    (``controller.jsonl`` beside the metrics, hetrain.runtime.worker_main). ``--out`` equal to
    ``--metrics-out`` overwrote the metrics with the state_dict at the end (then a traceback).
    None of them is one of the ``inputs`` (``--plan``, ``--cluster``, ``--trace`` files: the
    metrics overwrote the plan they were trained with).

    Raises:
        InputError: two of them are the same file, or one is an input file, naming the options.
    """
    files: list[tuple[str, Path, str]] = []
    if out is not None:
        files.append(("--out", Path(out), "the trained state_dict"))
    elif run_dir is not None:
        files.append(("--run-dir", Path(run_dir) / "model.pt", "the trained state_dict"))
    if metrics_out is not None:
        files.append(("--metrics-out", Path(metrics_out), "the metrics"))
        controller = Path(metrics_out).with_name("controller.jsonl")
        files.append(("--metrics-out", controller, "the controller log"))
    elif run_dir is not None:
        files.append(("--run-dir", Path(run_dir) / "controller.jsonl", "the controller log"))
    for option, path, what in files:
        for in_option, in_path in inputs:
            if path.resolve() == in_path.resolve():
                raise InputError(
                    f"{option} and {in_option}",
                    "",
                    f"expected {what} in a file other than the {in_option} input, got {path}",
                )
    for i, (option, path, what) in enumerate(files):
        for earlier_option, earlier, earlier_what in files[:i]:
            if path.resolve() == earlier.resolve():
                raise InputError(
                    option if option == earlier_option else f"{earlier_option} and {option}",
                    "",
                    f"expected different files for {earlier_what} and {what}, got {path} for both",
                )


def check_checkpoint_dir(path: Path, chain: Any, steps: int) -> None:
    """Bad checkpoint folders are bad input, found before any rank starts: a file instead of a
    folder (or under a file), a latest checkpoint that is corrupted (size/sha256) or malformed,
    one written for another model (fingerprint), or one already at or past ``steps`` (nothing
    left to train).

    Raises:
        InputError: one line naming the folder or the checkpoint file.
        RunComplete: an elastic restart round (``TORCHELASTIC_RESTART_COUNT`` > 0) whose
            latest checkpoint is at ``steps``: the run ended before the round (success).
    """
    from hetrain.runtime import checkpoint as ckpt

    check_output_path("--checkpoint-dir", path, folder=True)
    latest = ckpt.load_latest(path)
    if latest is not None:
        mine = ckpt.model_fingerprint(chain)
        if latest.model_fingerprint != mine:
            raise InputError(
                str(latest.path / ckpt.MANIFEST),
                "model_fingerprint",
                f"checkpoint of another model ({latest.model_fingerprint}; this model {mine})",
            )
    restart_round = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if latest is not None and latest.step == steps and restart_round:
        raise RunComplete(
            f"the run is complete: the latest checkpoint {latest.path} is at step {steps} of "
            f"{steps} (an elastic restart after the last step)"
        )
    if latest is not None and latest.step >= steps:
        raise InputError(
            "--steps",
            "",
            f"more than the {latest.step} steps of the latest checkpoint {latest.path} to "
            f"resume from, got {steps} (nothing left to train)",
        )


def check_outputs(config: RunConfig, model: Any, steps: int) -> None:
    """The output paths and the checkpoint folder, before any rank starts.

    Raises:
        InputError: see :func:`check_checkpoint_dir`, :func:`check_output_path`,
            :func:`check_outputs_apart`, :func:`check_distinct_outputs`.
    """
    if config.checkpoint_dir is not None:
        check_checkpoint_dir(config.checkpoint_dir, model, steps)
    if config.run_dir is not None:
        check_output_path("--run-dir", config.run_dir, folder=True)
    if config.metrics_out is not None:
        check_output_path("--metrics-out", config.metrics_out, folder=False)
    if config.out is not None:
        check_output_path("--out", config.out, folder=False)
    check_outputs_apart(config.out, config.metrics_out, config.run_dir, config.checkpoint_dir)
    check_distinct_outputs(
        config.out,
        config.metrics_out,
        config.run_dir,
        inputs=[
            (option, path)
            for option, path in (
                ("--plan", config.plan),
                ("--cluster", config.cluster),
                ("--trace", config.trace),
            )
            if isinstance(path, Path)
        ],
    )
