"""One run's options, defined once: :class:`RunConfig` (what ``hetrain train`` and
``hetrain.train`` share) and :class:`CommandOptions` (what only the command has: which model,
multi-node launch, console output); the job every rank runs is the config resolved,
:class:`hetrain.runtime.trainjob.TrainJob`.

Every option is one dataclass field whose metadata holds its help text and, where it differs
from ``--`` plus the field name with dashes, its command-line flag (:func:`option`). The typer
parameters of ``hetrain train`` (:func:`cli_parameters`) and the keywords of ``hetrain.train``
(:func:`hetrain.runtime.api.train`) are generated from these fields, so no default or help text
is written twice. The values are checked in one place, the constructor (``__post_init__``):
one-line :class:`~hetrain.errors.InputError`, which the CLI prints and exits 2 on. Checks that
need the model, the files or the world (a plan against the layers and the ranks, a checkpoint
of another model) run once in the launching process, in :func:`hetrain.runtime.job.build_job`.

This module does not import torch (``hetrain --help`` builds the ``train`` command from it).
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetrain._io import MAX_BATCH, check_seed
from hetrain.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from hetrain.cluster import ClusterSpec
    from hetrain.plan import Plan

OPTIMIZERS = ("sgd", "adamw")
DTYPE_NAMES = ("float32", "float64")
SCHEDULES = ("1f1b", "gpipe")
LR_SCHEDULES = ("cosine", "constant")
ON_NONFINITE = ("stop", "skip")

MAX_LOCAL_WORKERS = 1024
"""Most ranks ``--workers`` starts on one machine (one process of about 0.4 GB each): a typo
such as ``--workers 100000`` forked processes until the machine ran out of memory."""

MAX_HANG_TIMEOUT_S = 1e6
"""Longest ``--hang-timeout`` and ``--rdzv-timeout`` accepted (seconds, about 11.6 days): far
above any step, and within what ``datetime.timedelta`` and the process group's millisecond
timeout hold (1e300 was an ``OverflowError`` in every rank)."""

# optimizer hyper-parameters beyond these overflow float32 in the optimizer step (--lr 1e300:
# "value cannot be converted to type float without overflow" in a rank, exit 1) or train to
# NaN from the first step (--weight-decay/--momentum 1e300); SGD momentum above 1 diverges
MAX_LR = 1e6
MAX_WEIGHT_DECAY = 1e6
MAX_MOMENTUM = 1.0


def option(default: Any, help: str, *, flag: str | None = None, cli_type: Any = None) -> Any:
    """A dataclass field that is one run option.

    Args:
        default: the default (the same for the command and ``hetrain.train``).
        help: one sentence, shown by ``hetrain train --help`` and in ``help(hetrain.train)``.
        flag: the command-line flag(s), e.g. ``"--report/--no-report"``; default ``--`` plus
            the field name with dashes.
        cli_type: the type typer converts the command-line text to, where the field's own
            type holds more than the command line can express (a ``Plan`` object, a mapping).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "cli_type": cli_type})


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of option field ``f`` (``--hang-timeout`` for ``hang_timeout_s``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _name(f_name: str, cls: type) -> str:
    """The flag of field ``f_name`` of ``cls``: the name bad values are reported under."""
    return flag_of(next(f for f in dataclasses.fields(cls) if f.name == f_name)).split("/")[0]


# --------------------------------------------------------------------------------------------
# checks of single values (one line each)
# --------------------------------------------------------------------------------------------


def check_int(
    name: str, value: Any, minimum: int = 1, maximum: int | None = None, *, source: str = ""
) -> int:
    """``value`` as an integer in ``[minimum, maximum]``.

    Raises:
        InputError: not an integer (a bool is not one), or out of range; named ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(name, source, f"expected an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InputError(
            name, source, f"expected an integer between {minimum} and {maximum:.0e}, got {value!r}"
        )
    return int(value)


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    strict: bool = True,
    maximum: float | None = None,
    unit: str = "",
) -> float:
    """``value`` as a finite float above ``minimum`` (at or above it with ``strict=False``) and
    at most ``maximum`` (in ``unit``, e.g. ``" seconds"``, named in the message).

    Raises:
        InputError: not a number (a bool is not one), not finite, or out of range.
    """
    if isinstance(value, bool):
        raise InputError(name, "", f"expected a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(name, "", f"expected a number, got {value!r}") from None
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        bound = ">" if strict else ">="
        raise InputError(name, "", f"expected a finite number {bound} {minimum:g}, got {value}")
    if maximum is not None and v > maximum:
        raise InputError(name, "", f"expected at most {maximum:g}{unit}, got {value}")
    return v


def _check_choice(name: str, value: Any, choices: Sequence[str | None]) -> Any:
    if value not in choices:
        words = " or ".join(c for c in choices if c is not None)
        raise InputError(name, "", f"expected {words}, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(name, "", f"expected True or False, got {value!r}")
    return value


def _as_path(name: str, value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value):
        raise InputError(name, "", f"expected a path, got {value!r}")
    return Path(value)


def parse_slowdown_items(
    items: Sequence[str] | Sequence[tuple[str, float]] | Mapping[str, float] | None,
) -> tuple[tuple[str, float], ...]:
    """``["w1=3", ...]`` (or ``{"w1": 3}``, or ``(("w1", 3), ...)``) -> ``(("w1", 3.0), ...)``:
    an emulated slow-down factor per device id (which ids the run has is checked against its
    devices by :func:`hetrain.runtime.job.parse_slowdown`).

    Raises:
        InputError: not ``DEVICE=FACTOR``, a device given twice, or a factor that is not a
            finite number >= 1.
    """
    if items is None:
        return ()
    if isinstance(items, str):
        items = [items]
    if isinstance(items, Mapping):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        pairs = []
        for item in items:
            if isinstance(item, tuple) and len(item) == 2:  # an already parsed pair
                pairs.append((str(item[0]), item[1]))
                continue
            device, sep, value = str(item).partition("=")
            if not sep or not device.strip():
                raise InputError("--slowdown", str(item), "expected DEVICE=FACTOR, e.g. w1=3")
            pairs.append((device.strip(), value.strip()))
    out: dict[str, float] = {}
    for device, value in pairs:
        if device in out:
            raise InputError("--slowdown", device, "expected each device at most once")
        try:
            factor = float(value)
        except (TypeError, ValueError):
            raise InputError("--slowdown", device, f"expected a number, got {value!r}") from None
        if not (math.isfinite(factor) and factor >= 1.0):
            raise InputError("--slowdown", device, f"expected a finite factor >= 1, got {value}")
        out[device] = factor
    return tuple(out.items())


# --------------------------------------------------------------------------------------------
# the run's options
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """The options of one training run, shared by ``hetrain train`` (as ``--flags``) and
    ``hetrain.train`` (as keywords). ``None`` defaults are resolved against the task's own
    defaults (an example's, or 100 steps, batch 32, AdamW at learning rate 1e-3 for your own
    model) and the world by :func:`hetrain.runtime.job.build_job`. Paths given as strings are
    kept as :class:`~pathlib.Path`; ``slowdown`` as ``((device, factor), ...)``.

    Raises:
        InputError: (from the constructor and :func:`dataclasses.replace`) any value of the
            wrong type or out of range, one line naming its flag: counts below 1 (or 0 where
            0 means never/none), steps, batch or micro-batch sizes above ``MAX_BATCH`` (1e15),
            a seed outside ``[0, 2**63-1]``, a learning rate, weight decay or momentum that is
            not finite or above its bound, an unknown optimizer, dtype, schedule, learning-rate
            schedule or ``on_nonfinite``, bad ``slowdown`` items, timeouts above
            :data:`MAX_HANG_TIMEOUT_S`, ``checkpoint_every`` without ``checkpoint_dir``, the
            user's optimizer together with ``lr``, ``weight_decay`` or ``momentum``.
    """

    # ---- devices and world ----
    workers: int | None = option(
        None, "local ranks w0..w{N-1} (default 4, or one per device of --cluster)"
    )
    cluster: "ClusterSpec | Mapping[str, Any] | Path | None" = option(
        None,
        "cluster file (YAML/JSON) whose devices the local ranks emulate, one rank each",
        cli_type=Path | None,
    )
    plan: "Plan | Mapping[str, Any] | Path | None" = option(
        None,
        "plan file (JSON): the run's fixed plan, or its first with --adaptive; default: chosen "
        "online",
        cli_type=Path | None,
    )
    slowdown: Sequence[str] | Mapping[str, float] | tuple[tuple[str, float], ...] | None = option(
        None,
        "emulated slow-down DEVICE=FACTOR, e.g. w1=3 (repeatable)",
        cli_type=list[str] | None,
    )
    trace: Path | None = option(None, "trace CSV of device dynamics, 1 slot = 1 step")
    adaptive: bool | None = option(
        None,
        "re-plan online, starting from --plan when given (default: only without --plan)",
        flag="--adaptive/--no-adaptive",
    )
    # ---- the iterations ----
    steps: int | None = option(
        None, "iterations to run (default: the example's; 100 for your own model)"
    )
    batch: int | None = option(
        None,
        "global batch B, samples per iteration (default: the plan's or the example's; 32 for "
        "your own model)",
    )
    seed: int = option(0, "seed of the initial weights and the data order")
    microbatch_size: int | None = option(
        None, "micro-batch size of the plans chosen online (default: the example's, or 8)"
    )
    schedule: str | None = option(
        None,
        "pipeline schedule 1f1b or gpipe of every plan, a --plan file's too (default: the "
        "plan file's, or the controller's choice)",
    )
    norm_block: int | None = option(
        None,
        "BatchNorm statistics over blocks of G samples (shares and micro-batches multiples of G)",
    )
    exact: bool = option(False, "refuse random ops whose values would depend on the plan")
    # ---- the optimizer ----
    optimizer: str | Callable[[list[dict[str, Any]]], Any] | None = option(
        None,
        "sgd or adamw (default: the example's, else adamw); hetrain.train also takes your own "
        "param groups -> torch.optim.Optimizer",
        cli_type=str | None,
    )
    lr: float | None = option(
        None, "peak learning rate (default: the example's, e.g. 3e-3 charlm; else 1e-3)"
    )
    weight_decay: float | None = option(None, "weight decay (default: the example's, else 0)")
    momentum: float = option(0.0, "SGD momentum in [0, 1]")
    lr_schedule: str = option("cosine", "cosine (to 10% at the last step) or constant")
    warmup_steps: int | None = option(
        None, "linear learning-rate warm-up steps (default: the example's, else 0)"
    )
    grad_clip_norm: float | None = option(
        None, "clip the global gradient norm to this (default: the example's; 0 = off)"
    )
    dtype: str = option("float32", "float32 or float64")
    bf16: bool = option(False, "bf16 autocast of forward passes")
    # ---- outputs ----
    run_dir: Path | None = option(None, "folder for metrics, report and model (default runs/NAME)")
    metrics_out: Path | None = option(None, "metrics JSONL file (default RUN_DIR/metrics.jsonl)")
    out: Path | None = option(None, "export the trained state_dict here (default RUN_DIR/model.pt)")
    report: bool = option(
        True,
        "write the report (plots, report.txt) into RUN_DIR at the end",
        flag="--report/--no-report",
    )
    tensorboard: bool = option(
        False,
        "also write TensorBoard event files next to the metrics (needs pip install "
        "'hetrain[tensorboard]')",
    )
    # ---- checkpoints, faults, stops ----
    checkpoint_dir: Path | None = option(
        None, "folder of the checkpoints; a run resumes from its latest"
    )
    checkpoint_every: int = option(0, "checkpoint every N steps (0 = never)")
    checkpoint_keep: int = option(
        3, "complete checkpoints kept; older ones are deleted once a new one is complete"
    )
    on_nonfinite: str = option(
        "stop", "a NaN/inf loss or gradient norm: stop the run, or skip the update"
    )
    max_restarts: int = option(
        0, "restart the ranks this often after a failure, from the latest checkpoint"
    )
    hang_timeout_s: float | None = option(
        None,
        "seconds without a finished step after which a rank counts as failed (default: off)",
        flag="--hang-timeout",
    )
    rdzv_timeout_s: float = option(
        60.0, "seconds to join the rendezvous before failing", flag="--rdzv-timeout"
    )

    def __post_init__(self) -> None:
        """Check and normalise every value (the one place a run's options are validated)."""
        n = lambda name: _name(name, RunConfig)  # noqa: E731
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.workers is not None:
            put("workers", check_int(n("workers"), self.workers))
            if self.workers > MAX_LOCAL_WORKERS:
                raise InputError(
                    "--workers",
                    "",
                    f"expected at most {MAX_LOCAL_WORKERS} ranks on one machine (one process "
                    f"each), got {self.workers}",
                )
        for name in ("plan", "cluster"):
            value = getattr(self, name)
            if isinstance(value, (str, Path)):
                put(name, _as_path(n(name), value))
            elif value is not None and not _is_spec(value):
                raise InputError(n(name), "", f"expected a file path or a mapping, got {value!r}")
        put("slowdown", parse_slowdown_items(self.slowdown))
        for name in ("trace", "run_dir", "metrics_out", "out", "checkpoint_dir"):
            put(name, _as_path(n(name), getattr(self, name)))
        # steps, batch and micro-batch size: at most MAX_BATCH (1e15), like hetrain plan's
        # --batch; above it numpy's arrays of one global batch cannot be made
        for name in ("steps", "batch", "microbatch_size"):
            if getattr(self, name) is not None:
                put(name, check_int(n(name), getattr(self, name), maximum=MAX_BATCH))
        put("seed", check_seed("--seed", self.seed))
        if self.norm_block is not None:
            put("norm_block", check_int(n("norm_block"), self.norm_block, maximum=MAX_BATCH))
        _check_choice(n("schedule"), self.schedule, (None, *SCHEDULES))
        if callable(self.optimizer):
            for name in ("lr", "weight_decay"):
                if getattr(self, name) is not None:
                    raise _not_with_user_optimizer(n(name))
            if self.momentum:
                raise _not_with_user_optimizer(n("momentum"))
        elif self.optimizer is not None:
            _check_choice(n("optimizer"), self.optimizer, OPTIMIZERS)
        if self.lr is not None:
            put("lr", check_float(n("lr"), self.lr, maximum=MAX_LR))
        if self.weight_decay is not None:
            put(
                "weight_decay",
                check_float(
                    n("weight_decay"), self.weight_decay, strict=False, maximum=MAX_WEIGHT_DECAY
                ),
            )
        put(
            "momentum",
            check_float(n("momentum"), self.momentum, strict=False, maximum=MAX_MOMENTUM),
        )
        _check_choice(n("lr_schedule"), self.lr_schedule, LR_SCHEDULES)
        if self.warmup_steps is not None:
            put("warmup_steps", check_int(n("warmup_steps"), self.warmup_steps, 0, MAX_BATCH))
        if self.grad_clip_norm is not None:
            put(
                "grad_clip_norm",
                check_float(n("grad_clip_norm"), self.grad_clip_norm, strict=False),
            )
        _check_choice(n("dtype"), self.dtype, DTYPE_NAMES)
        for name in ("bf16", "exact", "report", "tensorboard"):
            _check_bool(n(name), getattr(self, name))
        if self.adaptive is not None:
            _check_bool(n("adaptive"), self.adaptive)
        put(
            "checkpoint_every",
            check_int(n("checkpoint_every"), self.checkpoint_every, 0, MAX_BATCH),
        )
        if self.checkpoint_every > 0 and self.checkpoint_dir is None:
            raise InputError("--checkpoint-every", "", "expected --checkpoint-dir as well")
        put(
            "checkpoint_keep",
            check_int(n("checkpoint_keep"), self.checkpoint_keep, maximum=MAX_BATCH),
        )
        _check_choice(n("on_nonfinite"), self.on_nonfinite, ON_NONFINITE)
        put("max_restarts", check_int(n("max_restarts"), self.max_restarts, 0, MAX_BATCH))
        if self.hang_timeout_s is not None:
            put(
                "hang_timeout_s",
                check_float(
                    n("hang_timeout_s"),
                    self.hang_timeout_s,
                    maximum=MAX_HANG_TIMEOUT_S,
                    unit=" seconds",
                ),
            )
        put(
            "rdzv_timeout_s",
            check_float(
                n("rdzv_timeout_s"),
                self.rdzv_timeout_s,
                maximum=MAX_HANG_TIMEOUT_S,
                unit=" seconds",
            ),
        )

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any]) -> "RunConfig":
        """``RunConfig(**keywords)`` with an unknown keyword as one line.

        Raises:
            InputError: an unknown keyword (naming the known ones), or a bad value.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise InputError(
                ", ".join(unknown), "", f"expected a keyword of hetrain.train ({', '.join(names)})"
            )
        return cls(**keywords)

    def with_output_defaults(self, name: str) -> "RunConfig":
        """This config with ``run_dir`` defaulting to ``runs/<name>`` and ``metrics_out`` to
        ``RUN_DIR/metrics.jsonl`` (what both ``hetrain train`` and ``hetrain.train`` write)."""
        run_dir = self.run_dir or Path("runs") / name
        return dataclasses.replace(
            self, run_dir=run_dir, metrics_out=self.metrics_out or run_dir / "metrics.jsonl"
        )


def _is_spec(value: Any) -> bool:
    """A plan or cluster given as an object: a mapping or a pydantic model (``Plan``,
    ``ClusterSpec``)."""
    return isinstance(value, Mapping) or hasattr(value, "model_dump")


def _not_with_user_optimizer(name: str) -> InputError:
    return InputError(
        name,
        "",
        "not used with the user's own optimizer: set it in the optimizer (or its param_groups)",
    )


@dataclass(frozen=True)
class CommandOptions:
    """Options only ``hetrain train`` has: which model it trains, the multi-node launch, and
    the console output (``hetrain.train`` takes the model and data as objects instead).

    Raises:
        InputError: (from the constructor) ``nnodes`` < 1, ``--nnodes`` > 1 without
            ``--rdzv-endpoint``, an endpoint that is not ``HOST:PORT`` with a port from 1 to
            65535. Which ``--example``, ``--size``, ``--model`` and ``--data`` go together
            needs the examples (torch) and is checked when the task is made
            (``hetrain.commands.train``).
    """

    example: str = option("gpt2", "gpt2 (default), bert, resnet, charlm or digits")
    size: str | None = option(None, "tiny (default), small or base (--example gpt2, bert, resnet)")
    model: str | None = option(None, "your model and data: pkg.module:factory")
    data: Path | None = option(None, "text file for --example charlm")
    nnodes: int = option(1, "nodes (each runs this command)")
    rdzv_endpoint: str | None = option(None, "HOST:PORT of the c10d rendezvous")
    rdzv_id: str | None = option(None, "job id shared by nodes")
    demo_slowdown: bool = option(
        True,
        "example runs: w1 becomes 3x slower at step steps//3",
        flag="--demo-slowdown/--no-demo-slowdown",
    )
    progress: bool = option(True, "show a progress bar", flag="--progress/--no-progress")
    json_out: bool = option(False, "print the summary as JSON", flag="--json")

    def __post_init__(self) -> None:
        """Check the command's own options (one line each)."""
        object.__setattr__(self, "nnodes", check_int("--nnodes", self.nnodes))
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise InputError("--rdzv-endpoint", "", "expected HOST:PORT with --nnodes > 1")
        if self.rdzv_endpoint is not None:
            # torch's rendezvous raised a ValueError traceback (exit 1) on a bad port
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InputError(
                    "--rdzv-endpoint",
                    str(self.rdzv_endpoint),
                    "expected HOST:PORT with a port from 1 to 65535",
                )


# --------------------------------------------------------------------------------------------
# the command line, generated from the fields
# --------------------------------------------------------------------------------------------


def cli_type(f: dataclasses.Field) -> Any:
    """The type typer converts option ``f``'s text to."""
    return f.metadata.get("cli_type") or f.type


def cli_parameters() -> list[tuple[str, Any, Any, str, str]]:
    """``(name, type, default, flag, help)`` of every ``hetrain train`` option, in the order
    of :class:`CommandOptions` then :class:`RunConfig`; the name is the field's."""
    out = []
    for cls in (CommandOptions, RunConfig):
        for f in dataclasses.fields(cls):
            out.append((f.name, cli_type(f), f.default, flag_of(f), f.metadata["help"]))
    return out


def split_cli_values(values: Mapping[str, Any]) -> tuple[RunConfig, CommandOptions]:
    """The :class:`RunConfig` and :class:`CommandOptions` of parsed ``hetrain train`` values
    (field name -> value).

    Raises:
        InputError: a bad value (see both classes).
    """
    command = CommandOptions(**{f.name: values[f.name] for f in dataclasses.fields(CommandOptions)})
    config = RunConfig(**{f.name: values[f.name] for f in dataclasses.fields(RunConfig)})
    return config, command
