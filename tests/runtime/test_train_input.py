"""Bad input to ``hetrain train``: exit 2, one line, before any process starts (no hang)."""

from __future__ import annotations

import json

import pytest

from hetrain.cli import main


def _plan(tmp_path, groups, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"groups": groups}))
    return str(path)


def _run(capsys, *args):
    code = main(["train", "--example", "digits", "--steps", "2", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    return code, err


DP2 = [
    {"devices": ["w0"], "stages": [[0, 6]], "microbatch_size": 8, "batch": 16},
    {"devices": ["w1"], "stages": [[0, 6]], "microbatch_size": 8, "batch": 16},
]


@pytest.mark.parametrize(
    ("groups", "workers", "needle"),
    [
        # unknown device
        (
            [
                {
                    "devices": ["w0", "gpu7"],
                    "stages": [[0, 3], [3, 6]],
                    "microbatch_size": 4,
                    "batch": 32,
                }
            ],
            "2",
            "gpu7",
        ),
        # stages do not cover the 6 layers of digits_cnn
        (
            [
                {
                    "devices": ["w0", "w1"],
                    "stages": [[0, 2], [2, 5]],
                    "microbatch_size": 4,
                    "batch": 32,
                }
            ],
            "2",
            "covering layers [0, 6)",
        ),
    ],
)
def test_bad_plan_exits_2_with_one_line(tmp_path, capsys, groups, workers, needle):
    code, err = _run(capsys, "--workers", workers, "--plan", _plan(tmp_path, groups))
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("hetrain: error:")
    assert needle in err
    assert not (tmp_path / "run").exists()


def test_a_plan_that_leaves_a_rank_out_runs_it_idle(tmp_path, capsys):
    """``hetrain plan`` leaves out a device too slow to help: ``--plan`` with such a plan on
    3 ranks runs w2 idle (a warning names it) and trains exactly as the same plan on 2 ranks
    (it was refused: 'expected the plan to name every rank's device')."""
    from hetrain.runtime.metrics import read_metrics

    plan = _plan(tmp_path, DP2)
    losses = {}
    for workers in ("3", "2"):
        out = tmp_path / f"m{workers}.jsonl"
        code, err = _run(
            capsys, "--workers", workers, "--plan", plan, "--metrics-out", str(out),
            "--dtype", "float64",
        )  # fmt: skip
        assert code == 0, err
        warned = [x for x in err.splitlines() if "idle" in x]
        if workers == "3":
            assert warned == [
                f"hetrain: warning: {plan} leaves w2 out: idle (given no layers and no samples)"
            ]
        else:
            assert warned == []
        losses[workers] = [e["loss"] for e in read_metrics(out) if e.get("event") == "step"]
    # the losses as reported (summed over 3 ranks, one of them idle, or over 2)
    assert len(losses["3"]) == 2 and losses["3"] == pytest.approx(losses["2"], rel=1e-12)
    assert losses["3"][0] != losses["3"][1]


def test_microbatch_size_with_a_fixed_plan_exits_2(tmp_path, capsys):
    """--microbatch-size sets μ of the plans chosen online: with --plan it was ignored."""
    plan = _plan(tmp_path, DP2)
    code, err = _run(capsys, "--workers", "2", "--microbatch-size", "4", "--plan", plan)
    assert code == 2 and err == (
        f"hetrain: error: --microbatch-size: not used with {plan} (a fixed plan: its groups set "
        "microbatch_size)"
    )


def test_plan_batch_mismatch_exits_2(tmp_path, capsys):
    code, err = _run(capsys, "--workers", "2", "--batch", "40", "--plan", _plan(tmp_path, DP2))
    assert code == 2 and "summing to the global batch 40" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--example", "charlm", "--data", "missing.txt"], "missing.txt: file not found"),
        (["--plan", "nope.json"], "nope.json: file not found"),
        (["--trace", "nope.csv"], "nope.csv: file not found"),
        (["--cluster", "nope.yaml"], "nope.yaml: file not found"),
        (["--slowdown", "w9=2"], "--slowdown: w9: expected a device of this run"),
        (["--slowdown", "w1=abc"], "expected a number"),
        (["--slowdown", "w1=0.5"], "expected a finite factor >= 1"),
        (["--slowdown", "w1"], "expected DEVICE=FACTOR"),
        (["--optimizer", "lamb"], "expected sgd or adamw"),
        (["--dtype", "int8"], "expected float32 or float64"),
        (["--checkpoint-every", "5"], "expected --checkpoint-dir"),
        (["--example", "mnist"], "expected one of charlm, digits"),
        (["--model", "no_such_module_xyz:make"], "cannot import"),
        # --size on a model it does not size was silently ignored
        (["--example", "digits", "--size", "base"], "--size: only used by --example gpt2"),
        (["--example", "charlm", "--size", "small"], "(not with --example charlm)"),
        # a seed numpy or torch refuses: a rank failed (exit 1) or a traceback (exit 1)
        (["--seed", "-1"], "--seed: expected an integer between 0 and 2**63-1"),
        (["--seed", str(10**23)], "--seed: expected an integer between 0 and 2**63-1"),
        # absurd sizes: "Maximum allowed dimension exceeded" in every rank (exit 1)
        (["--batch", str(10**23)], "--batch: expected an integer between 1 and 1e+15"),
        (["--steps", str(10**23)], "--steps: expected an integer between 1 and 1e+15"),
        (["--microbatch-size", str(10**23)], "--microbatch-size: expected an integer between"),
        # the demo slow-down's dense (steps, devices) timeline in every rank
        (["--steps", "6000000"], "--steps: expected at most 5000000 steps with the demo"),
        # launch options: were checked after the demo line was printed (two lines)
        (["--max-restarts", "-1"], "--max-restarts: expected an integer >= 0, got -1"),
        (["--nnodes", "2"], "--rdzv-endpoint: expected HOST:PORT with --nnodes > 1"),
        (["--lr-schedule", "linear"], "--lr-schedule: expected cosine or constant"),
        # timedelta overflowed in every rank (exit 1)
        (["--hang-timeout", "1e300"], "--hang-timeout: expected at most 1e+06 seconds"),
        # a folder for --data was "file not found"
        (["--example", "charlm", "--data", "."], "--data: expected a text file, got a folder"),
        # torch's rendezvous raised a ValueError traceback (exit 1)
        (["--nnodes", "2", "--rdzv-endpoint", "localhost:notaport"],
         "--rdzv-endpoint: localhost:notaport: expected HOST:PORT with a port from 1 to 65535"),
        (["--nnodes", "2", "--rdzv-endpoint", "localhost:99999"], "a port from 1 to 65535"),
        (["--nnodes", "2", "--rdzv-endpoint", ":29500"], "a port from 1 to 65535"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohostport"], "a port from 1 to 65535"),
        # float32 overflow in the optimizer step of a rank (exit 1), or NaN from step 1
        (["--lr", "1e300"], "--lr: expected at most 1e+06, got 1e+300"),
        (["--weight-decay", "1e300"], "--weight-decay: expected at most 1e+06, got 1e+300"),
        (["--optimizer", "sgd", "--momentum", "1e300"], "--momentum: expected at most 1, got"),
    ],
)  # fmt: skip
def test_bad_options_exit_2(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "--workers", "2", *args)
    assert code == 2, err
    assert len(err.splitlines()) == 1
    assert needle in err


def test_trace_with_unknown_device_exits_2(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("slot,device,speed_factor\n3,w5,0.5\n")
    code, err = _run(capsys, "--workers", "2", "--trace", str(trace))
    assert code == 2 and "w5" in err
    # there is no cluster file to name: the devices are the run's ranks
    assert err == (
        f"hetrain: error: {trace}: row 2.device: expected a device of this run (w0, w1; no "
        "--cluster), got 'w5'"
    )


def test_trace_with_too_many_steps_exits_2(tmp_path, capsys):
    """A trace becomes dense (steps, devices) arrays in every rank: bounded like simulate."""
    trace = tmp_path / "t.csv"
    trace.write_text("slot,device,speed_factor\n3,w1,0.5\n")
    code, err = _run(capsys, "--workers", "2", "--trace", str(trace), "--steps", "6000000")
    assert code == 2, err
    assert err == (
        "hetrain: error: --steps: expected at most 5000000 steps with --trace (1e+07 "
        "device-steps for 2 devices), got 6000000"
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # the state_dict overwrote the metrics at the end, then the report's traceback
        (["--out", "run/metrics.jsonl"], "--out and --metrics-out: expected different files for "
         "the trained state_dict and the metrics, got run/metrics.jsonl for both"),
        (["--metrics-out", "run/model.pt"], "--run-dir and --metrics-out: expected different"),
        # controller.jsonl is written beside the metrics
        (["--metrics-out", "run/controller.jsonl"],
         "--metrics-out: expected different files for the metrics and the controller log"),
    ],
)  # fmt: skip
def test_outputs_that_are_one_file_exit_2(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "--workers", "2", "--run-dir", "run", *args)
    assert code == 2, err
    assert err == f"hetrain: error: {needle}" or (len(err.splitlines()) == 1 and needle in err)
    assert not (tmp_path / "run").exists()


def test_output_that_is_an_input_file_exits_2(tmp_path, capsys):
    """The metrics overwrote the plan file they were trained with."""
    plan = _plan(tmp_path, DP2)
    before = (tmp_path / "plan.json").read_text()
    code, err = _run(capsys, "--workers", "2", "--plan", plan, "--metrics-out", plan)
    assert code == 2, err
    assert err == (
        f"hetrain: error: --metrics-out and --plan: expected the metrics in a file other than "
        f"the --plan input, got {plan}"
    )
    assert (tmp_path / "plan.json").read_text() == before


def test_output_that_is_the_data_file_exits_2(tmp_path, capsys):
    """charlm's text was overwritten by the metrics it trained."""
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 500)
    args = ("--example", "charlm", "--data", str(text), "--workers", "2")
    code, err = _run(capsys, *args, "--metrics-out", str(text))
    assert code == 2 and err == (
        f"hetrain: error: --metrics-out and --data: expected a file other than the --data "
        f"input, got {text}"
    )
    assert text.read_text() == "hello world " * 500


def test_bad_norm_block_is_refused_before_launch(tmp_path):
    import torch
    from torch import nn

    import hetrain
    from hetrain.errors import InputError

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    data = (torch.randn(32, 4), torch.randint(0, 2, (32,)))
    kw = dict(model=model, dataset=data, loss_fn=nn.functional.cross_entropy, steps=2)
    with pytest.raises(InputError, match="--norm-block: 3 does not divide the global batch 8"):
        hetrain.train(workers=2, batch=8, norm_block=3, **kw)
    plan = {
        "groups": [
            {"devices": ["w0"], "stages": [[0, 3]], "microbatch_size": 4, "batch": 4},
            {"devices": ["w1"], "stages": [[0, 3]], "microbatch_size": 2, "batch": 4},
        ]
    }
    with pytest.raises(InputError, match=r"--plan: groups\[1\]: share 4 and micro-batch size 2"):
        hetrain.train(workers=2, batch=8, plan=plan, norm_block=4, **kw)


def test_cli_norm_block_that_does_not_divide_the_batch_exits_2(capsys):
    code, err = _run(capsys, "--norm-block", "5", "--batch", "32", "--exact")
    assert (
        code == 2 and err == "hetrain: error: --norm-block: 5 does not divide the global batch 32"
    )


def test_exact_refuses_multihead_attention_dropout_before_launch():
    import torch
    from torch import nn

    import hetrain
    from hetrain.errors import InputError

    model = nn.Sequential(nn.Linear(4, 4), nn.TransformerEncoderLayer(4, 2, 8, dropout=0.1))
    data = (torch.randn(16, 3, 4), torch.randn(16, 3, 4))
    with pytest.raises(InputError, match=r"1\.self_attn: nn\.MultiheadAttention\(dropout=0\.1\)"):
        hetrain.train(model=model, dataset=data, loss_fn=nn.functional.mse_loss, exact=True)


def test_absurd_number_of_local_workers_exits_2(tmp_path, capsys, monkeypatch):
    """``--workers 100000`` (a typo) forked processes until memory ran out; now one line."""
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "--workers", "100000")
    assert code == 2, err
    assert err.strip().splitlines() == [
        "hetrain: error: --workers: expected at most 1024 ranks on one machine (one process "
        "each), got 100000"
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # the report written at the end replaced the trained weights (exit 0)
        (["--out", "run/report.txt"],
         "--out: run/report.txt: expected a file other than the run report's report.txt in "
         "--run-dir"),
        (["--metrics-out", "run/timeline_step1.png"],
         "--metrics-out: run/timeline_step1.png: expected a file other than the run report's "
         "timeline_step1.png in --run-dir"),
        (["--out", "run/model/weights.pt"],
         "--out: run/model/weights.pt: expected a path outside RUN_DIR/model (where a Hugging "
         "Face model is exported)"),
        # an --out there replaced a checkpoint's data file; the resume then refused it
        (["--checkpoint-dir", "ckpt", "--out", "ckpt/step-000004/__0_0.distcp"],
         "--out: ckpt/step-000004/__0_0.distcp: expected a path outside --checkpoint-dir ckpt "
         "(it would overwrite the checkpoints)"),
        (["--checkpoint-dir", "ckpt", "--metrics-out", "ckpt/metrics.jsonl"],
         "--metrics-out: ckpt/metrics.jsonl: expected a path outside --checkpoint-dir ckpt (it "
         "would overwrite the checkpoints)"),
    ],
)  # fmt: skip
def test_outputs_over_files_the_run_writes_itself_exit_2(
    tmp_path, capsys, monkeypatch, args, needle
):
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, "--workers", "2", "--run-dir", "run", *args)
    assert code == 2, err
    assert err == f"hetrain: error: {needle}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


def test_output_that_is_the_model_factorys_source_exits_2(tmp_path, capsys, monkeypatch):
    """``--out myfac.py`` replaced the factory's code with the saved state_dict (exit 0)."""
    monkeypatch.chdir(tmp_path)
    source = (
        "import torch\n\n\ndef make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), "
        "torch.nn.Linear(8, 2))\n"
        "    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))\n"
        '    return {"model": model, "dataset": (x, y), '
        '"loss_fn": torch.nn.functional.cross_entropy}\n'
    )
    (tmp_path / "qa_factory_src.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        ["train", "--model", "qa_factory_src:make", "--workers", "2", "--steps", "2",
         "--no-progress", "--out", "qa_factory_src.py"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err == (
        "hetrain: error: --out and --model: expected a file other than the --model input, "
        "got qa_factory_src.py"
    )
    assert (tmp_path / "qa_factory_src.py").read_text() == source


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("def f(:\n", "failed at {path}:1: SyntaxError: invalid syntax"),
        ("x = 1 / 0\n", "failed: ZeroDivisionError: division by zero"),
    ],
)
def test_model_module_that_fails_on_import_exits_2(tmp_path, capsys, monkeypatch, source, needle):
    """A SyntaxError or an exception in the factory's module was a 60-line traceback, exit 1."""
    name = f"qa_broken_{abs(hash(source)) % 10_000}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for command in (["train", "--workers", "2", "--steps", "2"], ["profile"]):
        code = main([*command, "--model", f"{name}:make"])
        err = capsys.readouterr().err.strip()
        assert code == 2, err
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"hetrain: error: --model: {name}:make: importing '{name}' ")
        assert needle.format(path=path) in err


@pytest.mark.parametrize(
    ("args", "option", "factor"),
    [
        (["--slowdown", "w1=1e30"], "--slowdown", "1e+30"),
        (["--slowdown", "w1=100", "--trace", "TRACE"], "--slowdown and --trace", "1e+07"),
    ],
)
def test_emulated_slow_down_beyond_1e6_exits_2(tmp_path, capsys, args, option, factor):
    """``--slowdown w1=1e30`` overflowed ``time.sleep`` in a rank (exit 1); a trace's tiny
    speed factor did the same."""
    trace = tmp_path / "trace.csv"
    trace.write_text("slot,device,speed_factor,available,price_per_hour,nic_gbps\n0,w1,1e-5,,,\n")
    args = [str(trace) if a == "TRACE" else a for a in args]
    code, err = _run(capsys, "--workers", "2", *args)
    assert code == 2, err
    assert err == (
        f"hetrain: error: {option}: w1: expected an emulated slow-down of at most 1e+06x a host "
        f"core, got {factor}x (the rank would sleep that many times its compute)"
    )
