"""The ``hetrain`` command line (docs/model.md §7): ``plan``, ``evaluate``, ``simulate``,
``train``, ``profile``.

Each command's body lives in :mod:`hetrain.commands` and is imported only when that command
runs; only ``train`` and ``profile`` import torch. Any bad input (an
:class:`~hetrain.errors.InputError` or a usage error) prints one line on stderr and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from hetrain.errors import InputError

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


@app.command()
def train(
    example: Annotated[
        str, typer.Option("--example", help="gpt2 (default), bert, resnet, charlm or digits")
    ] = "gpt2",
    workers: Annotated[
        int | None,
        typer.Option("--workers", help="local ranks w0..w{N-1} (default 4, or the cluster size)"),
    ] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="iterations to run")] = None,
    plan: Annotated[Path | None, typer.Option("--plan", help="fixed plan (no re-planning)")] = None,
    seed: Annotated[
        int, typer.Option("--seed", help="seed of the initial weights and the data order")
    ] = 0,
    batch: Annotated[
        int | None,
        typer.Option("--batch", help="global batch B, samples per iteration (default: example's)"),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option("--lr", help="peak learning rate (default: the example's, e.g. 3e-3 charlm)"),
    ] = None,
    optimizer: Annotated[
        str | None, typer.Option("--optimizer", help="sgd or adamw (default: the example's)")
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or float64")] = "float32",
    slowdown: Annotated[
        list[str] | None, typer.Option("--slowdown", help="DEVICE=FACTOR (repeatable)")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="trace CSV, 1 slot = 1 step")
    ] = None,
    cluster: Annotated[
        Path | None, typer.Option("--cluster", help="cluster file the local ranks emulate")
    ] = None,
    metrics_out: Annotated[Path | None, typer.Option("--metrics-out", help="JSONL file")] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint-dir", help="folder of the checkpoints; a run resumes from its latest"
        ),
    ] = None,
    checkpoint_every: Annotated[
        int,
        typer.Option("--checkpoint-every", help="checkpoint every N steps (0 = never)"),
    ] = 0,
    checkpoint_keep: Annotated[
        int,
        typer.Option(
            "--checkpoint-keep",
            help="complete checkpoints kept; older ones are deleted once a new one is complete",
        ),
    ] = 3,
    on_nonfinite: Annotated[
        str,
        typer.Option(
            "--on-nonfinite",
            help="a NaN/inf loss or gradient norm: stop (default) the run, or skip the update",
        ),
    ] = "stop",
    rdzv_timeout: Annotated[
        float,
        typer.Option(
            "--rdzv-timeout", help="seconds to join the rendezvous before failing (default 60)"
        ),
    ] = 60.0,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts", help="restart the ranks this often after a failure (elastic)"
        ),
    ] = 0,
    hang_timeout: Annotated[
        float | None,
        typer.Option("--hang-timeout", help="seconds without a finished step = rank failed"),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="your model and data: pkg.module:factory")
    ] = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="text file for --example charlm")
    ] = None,
    norm_block: Annotated[
        int | None,
        typer.Option("--norm-block", help="BatchNorm statistics over blocks of G samples"),
    ] = None,
    exact: Annotated[
        bool, typer.Option("--exact", help="refuse random ops that depend on the plan")
    ] = False,
    schedule: Annotated[str | None, typer.Option("--schedule", help="1f1b or gpipe")] = None,
    microbatch_size: Annotated[
        int | None, typer.Option("--microbatch-size", help="μ of the plans chosen online")
    ] = None,
    grad_clip_norm: Annotated[
        float | None, typer.Option("--grad-clip-norm", help="clip the global gradient norm")
    ] = None,
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 autocast of forward passes")] = False,
    lr_schedule: Annotated[
        str, typer.Option("--lr-schedule", help="cosine (to 10% at the end) or constant")
    ] = "cosine",
    warmup_steps: Annotated[
        int | None, typer.Option("--warmup-steps", help="linear LR warm-up steps")
    ] = None,
    weight_decay: Annotated[
        float | None,
        typer.Option("--weight-decay", help="weight decay (default: the example's)"),
    ] = None,
    momentum: Annotated[float, typer.Option("--momentum", help="SGD momentum")] = 0.0,
    nnodes: Annotated[int, typer.Option("--nnodes", help="nodes (each runs this command)")] = 1,
    rdzv_endpoint: Annotated[
        str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous")
    ] = None,
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", help="job id shared by nodes")] = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="folder for metrics, report, model")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="export the trained state_dict here")
    ] = None,
    demo_slowdown: Annotated[
        bool,
        typer.Option(
            "--demo-slowdown/--no-demo-slowdown",
            help="example runs: w1 becomes 3x slower at step steps//3",
        ),
    ] = True,
    report: Annotated[bool, typer.Option("--report/--no-report", help="plots at the end")] = True,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="show a progress bar")
    ] = True,
    tensorboard: Annotated[
        bool,
        typer.Option(
            "--tensorboard",
            help="also write TensorBoard event files next to metrics.jsonl "
            "(needs pip install 'hetrain[tensorboard]')",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    size: Annotated[
        str | None,
        typer.Option("--size", help="tiny (default), small or base (--example gpt2, bert, resnet)"),
    ] = None,
) -> None:
    """Train a model on local worker processes (or torchrun nodes) under adaptive plans."""
    from hetrain.commands.train import run_train

    raise typer.Exit(
        run_train(
            size=size,
            example=example,
            workers=workers,
            steps=steps,
            plan=plan,
            seed=seed,
            batch=batch,
            lr=lr,
            optimizer=optimizer,
            dtype=dtype,
            slowdown=slowdown or [],
            trace=trace,
            cluster=cluster,
            metrics_out=metrics_out,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            on_nonfinite=on_nonfinite,
            rdzv_timeout_s=rdzv_timeout,
            max_restarts=max_restarts,
            hang_timeout_s=hang_timeout,
            norm_block=norm_block,
            exact=exact,
            model=model,
            data=data,
            schedule=schedule,
            microbatch_size=microbatch_size,
            grad_clip_norm=grad_clip_norm,
            bf16=bf16,
            lr_schedule=lr_schedule,
            warmup_steps=warmup_steps,
            weight_decay=weight_decay,
            momentum=momentum,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id,
            run_dir=run_dir,
            out=out,
            demo_slowdown=demo_slowdown,
            report=report,
            progress=progress,
            json_out=json_out,
            tensorboard=tensorboard,
        )
    )


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
    try:
        rv = app(args=args, prog_name="hetrain", standalone_mode=False)
    except InputError as exc:
        print(f"hetrain: error: {exc}", file=sys.stderr)
        return _exit(2, argv)
    except typer.Exit as exc:
        return _exit(int(exc.exit_code or 0), argv)
    except typer.Abort:
        print("hetrain: aborted", file=sys.stderr)
        return _exit(130, argv)
    except SystemExit as exc:
        return _exit(exc.code if isinstance(exc.code, int) else 1, argv)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops cleanly itself)
        print("hetrain: interrupted", file=sys.stderr)
        return _exit(130, argv)
    except BrokenPipeError:  # `hetrain plan --json | head`: the reader left, nothing to say
        return _exit(1, argv)
    except OSError as exc:  # e.g. stdout on a full disk (/dev/full): one line, not a traceback
        where = exc.filename if exc.filename is not None else "output"
        print(f"hetrain: error: {where}: cannot write ({exc.strerror or exc})", file=sys.stderr)
        return _exit(2, argv)
    except Exception as exc:
        # typer's (vendored click) usage errors: ClickException subclasses with exit_code 2
        if not hasattr(exc, "format_message") or not hasattr(exc, "exit_code"):
            raise
        if type(exc).__name__ == "NoArgsIsHelpError":
            print(exc.format_message())
            return _exit(0, argv)
        message = " ".join(str(exc.format_message()).split())
        print(f"hetrain: error: {message}", file=sys.stderr)
        return _exit(int(exc.exit_code) or 2, argv)
    return _exit(int(rv or 0) if isinstance(rv, int) else 0, argv)


def _exit(code: int, argv: list[str] | None) -> int:
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
