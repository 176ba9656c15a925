"""The ``hetrain`` command line (docs/model.md §7): ``plan``, ``evaluate``, ``simulate``,
``train``, ``profile``.

Each command's body lives in :mod:`hetrain.commands` and is imported only when that command
runs; only ``train`` and ``profile`` import torch. Any bad input (an
:class:`~hetrain.errors.InputError` or a usage error) prints one line on stderr and exits 2.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from hetrain._exit import exit_process
from hetrain.errors import InputError, RunComplete

app = typer.Typer(
    name="hetrain",
    help="Train one DNN on heterogeneous, changing devices: plan, evaluate, simulate, train, "
    "profile. The model hetrain plans with (cost model, controller, file formats) is described "
    "in docs/model.md.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from hetrain import __version__

        print(f"hetrain {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="print hetrain's version and exit",
        ),
    ] = False,
) -> None:
    """Options of ``hetrain`` itself (before the command): ``--version``."""


ClusterOpt = Annotated[
    Path, typer.Option("--cluster", help="cluster file (YAML/JSON, docs/model.md §7)")
]
ModelOpt = Annotated[Path, typer.Option("--model", help="model profile (JSON, docs/model.md §7)")]
BatchOpt = Annotated[int, typer.Option("--batch", help="global batch B (samples per iteration)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON only")]
OptStateOpt = Annotated[
    float,
    typer.Option(
        "--optimizer-state-factor",
        help="bytes of optimizer state per parameter byte (2 Adam, 1 SGD+momentum, 0 SGD)",
    ),
]

NormBlockOpt = Annotated[
    int | None,
    typer.Option(
        "--norm-block",
        help="BatchNorm norm block G: shares and micro-batch sizes multiples of G",
    ),
]


def parse_key_values(option: str, items: list[str] | None) -> dict[str, float]:
    """Parse ``["money=0.5", "energy=2"]`` into ``{"money": 0.5, "energy": 2.0}``.

    Raises:
        InputError: an item is not ``name=number`` with name ``money`` or ``energy`` and a
            finite number in ``[0, MAX_NUMBER]``, or a name is given twice.
    """
    import math

    from hetrain._io import MAX_NUMBER

    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in ("money", "energy"):
            raise InputError(option, item, "expected money=NUMBER or energy=NUMBER")
        if name in out:
            raise InputError(option, name, "expected each of money and energy at most once")
        try:
            number = float(value)
        except ValueError:
            raise InputError(option, name, f"expected a number, got {value.strip()!r}") from None
        if not (math.isfinite(number) and 0 <= number <= MAX_NUMBER):
            raise InputError(
                option, name, f"expected a finite number >= 0 and <= {MAX_NUMBER:g}, got {value}"
            )
        out[name] = number
    return out


@app.command()
def plan(
    cluster: ClusterOpt,
    model: ModelOpt,
    batch: BatchOpt,
    optimizer_state_factor: OptStateOpt = 2.0,
    v: Annotated[
        float, typer.Option("--V", help="weight V of the iteration time in V*T + sum_j Q_j y_j")
    ] = 1.0,
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            help="virtual queue backlog Q_j, money=Q or energy=Q, in seconds per USD or per J "
            "(repeatable)",
        ),
    ] = None,
    schedule: Annotated[str, typer.Option("--schedule", help="1f1b or gpipe")] = "1f1b",
    norm_block: NormBlockOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print the best plan for one slot (minimum T, or minimum V*T + sum_j Q_j y_j)."""
    from hetrain.commands.plan import run_plan

    raise typer.Exit(
        run_plan(
            cluster=cluster,
            model=model,
            batch=batch,
            optimizer_state_factor=optimizer_state_factor,
            v=v,
            queues=parse_key_values("--queue", queue),
            schedule=schedule,
            norm_block=norm_block,
            json_out=json_out,
        )
    )


@app.command()
def evaluate(
    cluster: ClusterOpt,
    model: ModelOpt,
    batch: BatchOpt,
    plan: Annotated[Path, typer.Option("--plan", help="plan file (JSON, docs/model.md §7)")],
    optimizer_state_factor: OptStateOpt = 2.0,
    norm_block: NormBlockOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print the figures of docs/model.md §3 for a given plan (exit 1 if some device runs out of
    memory)."""
    from hetrain.commands.plan import run_evaluate

    raise typer.Exit(
        run_evaluate(
            cluster=cluster,
            model=model,
            batch=batch,
            plan=plan,
            optimizer_state_factor=optimizer_state_factor,
            norm_block=norm_block,
            json_out=json_out,
        )
    )


# --------------------------------------------------------------------------------------------
# simulate  (body: hetrain.commands.simulate; owner: controller/simulator work, issue 4)
# --------------------------------------------------------------------------------------------


@app.command()
def simulate(
    cluster: Annotated[
        Path | None,
        typer.Option("--cluster", help="cluster file (YAML/JSON, docs/model.md §7)"),
    ] = None,
    model: Annotated[
        Path | None, typer.Option("--model", help="model profile (JSON, docs/model.md §7)")
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", help="global batch B (samples per iteration)")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="trace CSV (docs/model.md §7)")
    ] = None,
    slots: Annotated[int, typer.Option("--slots", help="number of slots (iterations)")] = 100,
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="lyapunov, greedy, dp-even, dp-proportional, pipeline or static-hybrid",
        ),
    ] = "lyapunov",
    v: Annotated[
        float,
        typer.Option(
            "--V",
            help="weight V of the iteration time against the budgets' virtual queues (10: the "
            "one V of bench/policies.py's grid that keeps every budget within 5 % of the "
            "stale-information reference's time)",
        ),
    ] = 10.0,
    budget: Annotated[
        list[str] | None,
        typer.Option(
            "--budget",
            help="long-run budget per iteration, money=X (USD/iteration) or energy=X "
            "(J/iteration); repeatable",
        ),
    ] = None,
    optimizer_state_factor: OptStateOpt = 2.0,
    csv_out: Annotated[
        Path | None, typer.Option("--csv-out", help="write per-slot rows to this CSV")
    ] = None,
    plan: Annotated[
        Path | None,
        typer.Option("--plan", help="simulate this fixed plan every slot (policy 'fixed')"),
    ] = None,
    norm_block: NormBlockOpt = None,
    decision_delay: Annotated[
        int,
        typer.Option(
            "--decision-delay",
            help="slots between the last measurement a decision uses and the slot after which "
            "it runs (1: the runtime's asynchronous controller; 0: applied at once)",
        ),
    ] = 1,
    search_latency: Annotated[
        int | None,
        typer.Option(
            "--search-latency",
            help="slots a planner search takes to join the controller's choices (the runtime's "
            "search thread; each decision is then the cheap keep-or-rebalance one); default: "
            "searches run inside the decision",
        ),
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            help="a hetrain train run folder: replay its recorded measurements through the "
            "controller and compare the decisions with the run's (other options ignored)",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a policy over a trace for N slots and print mean time, cost and plan changes
    (--cluster, --model, --batch), or replay a training run's controller (--replay)."""
    from hetrain.commands.simulate import run_replay, run_simulate

    if replay is not None:
        raise typer.Exit(run_replay(replay, json_out=json_out))
    raise typer.Exit(
        run_simulate(
            cluster=cluster,
            model=model,
            batch=batch,
            trace=trace,
            slots=slots,
            policy=policy,
            v=v,
            budgets=parse_key_values("--budget", budget),
            optimizer_state_factor=optimizer_state_factor,
            csv_out=csv_out,
            json_out=json_out,
            plan=plan,
            norm_block=norm_block,
            decision_delay=decision_delay,
            search_latency=search_latency,
        )
    )


# --------------------------------------------------------------------------------------------
# train  (body: hetrain.commands.train; owner: runtime work, issues 3 and 6)
# --------------------------------------------------------------------------------------------


def train(**values: Any) -> None:
    """Train a model on local worker processes (or torchrun nodes) under adaptive plans."""
    from hetrain.commands.train import run_train
    from hetrain.runtime.config import split_cli_values

    config, command = split_cli_values(values)
    raise typer.Exit(run_train(config, command))


def _train_signature() -> None:
    """``train``'s typer parameters, one per field of ``RunConfig`` and ``CommandOptions``
    (hetrain.runtime.config): flag, type, default and help come from the field."""
    import inspect

    from hetrain.runtime.config import cli_parameters

    params, annotations = [], {}
    for name, type_, default, flag, help_ in cli_parameters():
        annotation = Annotated[type_, typer.Option(*flag.split(" "), help=help_)]
        annotations[name] = annotation
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
    train.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    train.__annotations__ = {**annotations, "return": None}


_train_signature()
app.command()(train)


# --------------------------------------------------------------------------------------------
# profile  (body: hetrain.commands.profile; owner: profiling work, issues 2 and 5)
# --------------------------------------------------------------------------------------------


@app.command()
def profile(
    example: Annotated[
        str,
        typer.Option(
            "--example",
            help="charlm, digits, gpt2-small, bert-base, resnet50, or gpt2, bert, resnet (HF)",
        ),
    ] = "charlm",
    out: Annotated[Path | None, typer.Option("--out", help="write the profile JSON here")] = None,
    batch: Annotated[int, typer.Option("--batch", help="samples used to profile")] = 8,
    measure: Annotated[
        bool, typer.Option("--measure", help="also time layers and fit speed and overhead")
    ] = False,
    device: Annotated[
        str,
        typer.Option("--device", help="count on cpu or meta (auto: meta for the large examples)"),
    ] = "auto",
    cluster_out: Annotated[
        Path | None,
        typer.Option(
            "--cluster-out", help="with --measure: cluster file (default OUT.cluster.yaml)"
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", help="with --measure: devices w0.. in the cluster file")
    ] = 4,
    microbatch_sizes: Annotated[
        str | None,
        typer.Option(
            "--microbatch-sizes",
            help="with --measure: sizes to time (default 1,2,4,8; 1,2 for the large examples)",
        ),
    ] = None,
    repeats: Annotated[
        int | None, typer.Option("--repeats", help="timed passes (median; default 5, large 2)")
    ] = None,
    warmup: Annotated[
        int | None, typer.Option("--warmup", help="untimed passes first (default 2, large 0)")
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="with --measure: tokens per timed sample (default: the model's; large 128)",
        ),
    ] = None,
    stage_lengths: Annotated[
        str | None,
        typer.Option(
            "--stage-lengths",
            help="with --measure: timed stage lengths besides 1 (default 2,L/2,L; large L)",
        ),
    ] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch threads while timing")] = 1,
    link: Annotated[
        bool, typer.Option("--link/--no-link", help="with --measure: ping-pong two gloo ranks")
    ] = True,
    seed: Annotated[
        int, typer.Option("--seed", help="seed of the random weights and inputs profiled")
    ] = 0,
    size: Annotated[
        str | None,
        typer.Option(
            "--size",
            help="tiny (default), small or base (--example gpt2, bert, resnet); the default is "
            "what hetrain train --example X trains",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="your model and data: pkg.module:factory")
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            "--kind",
            help="with --measure: device kind the layer times are written under (default: "
            "this CPU's model name and threads)",
        ),
    ] = None,
) -> None:
    """Build a model profile (docs/model.md §7) of an example: FLOPs, activation and param bytes.
    ``hetrain profile merge A.json B.json --out C.json`` joins measured times (merge-profiles)."""
    from hetrain.commands.profile import run_profile

    raise typer.Exit(
        run_profile(
            size=size,
            model=model,
            example=example,
            out=out,
            batch=batch,
            measure=measure,
            device=device,
            cluster_out=cluster_out,
            workers=workers,
            microbatch_sizes=microbatch_sizes,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            link=link,
            seed=seed,
            seq_len=seq_len,
            stage_lengths=stage_lengths,
            kind=kind,
        )
    )


@app.command("merge-profiles")
def merge_profiles(
    inputs: Annotated[
        list[Path], typer.Argument(help="profiles of one model (JSON), e.g. from several machines")
    ],
    out: Annotated[Path, typer.Option("--out", help="write the merged profile JSON here")],
) -> None:
    """Merge profiles of one model measured on several machines into one (docs/profiling.md):
    the layers must agree; the measured times of every device kind are joined. Also spelled
    ``hetrain profile merge A.json B.json --out C.json``."""
    from hetrain.commands.merge import run_merge

    raise typer.Exit(run_merge(inputs, out))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the typer app, turning bad input into one line + exit 2.

    Returns the exit status (also used by tests that call the CLI in-process).
    """
    args = sys.argv[1:] if argv is None else argv
    if list(args[:2]) == ["profile", "merge"]:  # `hetrain profile merge ...` = merge-profiles
        args = ["merge-profiles", *args[2:]]
    with _Interrupts() as interrupts:
        rv = _run_app(args)
    if interrupts.signum is not None:
        # SIGINT/SIGTERM outside a training loop (start-up, report): typer turns the
        # KeyboardInterrupt into a silent exit 130, so the line is printed here
        name = signal.Signals(interrupts.signum).name
        print(f"hetrain: interrupted ({name}) outside the training loop", file=sys.stderr)
        return _exit(128 + interrupts.signum, argv)
    return _exit(rv, argv)


class _Interrupts:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread while a command runs,
    and the signal is recorded (:attr:`signum`); the previous handlers come back on exit. A
    training loop installs its own handlers (a clean stop) and restores these after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.signum = int(signum)
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _run_app(args: list[str]) -> int:
    """The typer app on ``args``; bad input and faults become one line and an exit status."""
    try:
        rv = app(args=args, prog_name="hetrain", standalone_mode=False)
    except InputError as exc:
        print(f"hetrain: error: {exc}", file=sys.stderr)
        return 2
    except RunComplete as exc:
        print(f"hetrain: {exc}", file=sys.stderr)
        return 0
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except typer.Abort:
        print("hetrain: aborted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:  # reported by main (the signal is known there)
        return 130
    except BrokenPipeError:  # `hetrain plan --json | head`: the reader left, nothing to say
        return 1
    except OSError as exc:  # e.g. stdout on a full disk (/dev/full): one line, not a traceback
        where = exc.filename if exc.filename is not None else "output"
        print(f"hetrain: error: {where}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except Exception as exc:
        # typer's (vendored click) usage errors: ClickException subclasses with exit_code 2
        if not hasattr(exc, "format_message") or not hasattr(exc, "exit_code"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(exc.format_message())
            return 0
        message = _option_message(exc, args) or " ".join(str(exc.format_message()).split())
        print(f"hetrain: error: {message}", file=sys.stderr)
        return int(exc.exit_code) or 2
    return int(rv or 0) if isinstance(rv, int) else 0


def _option_message(exc: Exception, args: list[str]) -> str | None:
    """A value typer could not convert, in the ``--opt: expected ..., got V`` form of the
    other option errors (the value as given: the word after the option or after ``=``);
    None for other usage errors."""
    param = getattr(exc, "param", None)
    opts = [o for o in getattr(param, "opts", None) or [] if o.startswith("--")]
    message = str(getattr(exc, "message", "") or "")
    if not opts or not message:
        return None
    if message.startswith("Input should be "):
        message = "expected " + message[len("Input should be ") :]
    message = " ".join(message.split(", unable to parse")[0].split())
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                return f"{opt}: {message}, got {args[i + 1]!r}"
            if arg.startswith(opt + "="):
                return f"{opt}: {message}, got {arg[len(opt) + 1 :]!r}"
    return f"{opts[0]}: {message}"


def _exit(code: int, argv: list[str] | None) -> int:
    if argv is None:  # the process's own command line: end the process
        exit_process(code)
    return code


if __name__ == "__main__":
    main()
