"""Bad input to ``hetrain plan``, ``evaluate``, ``simulate`` and ``profile`` (docs/model.md §7):
exit 2
and exactly one line on stderr naming the file or option, the field and what was expected;
never a traceback. Exit 1 from ``evaluate`` only for a valid plan that runs out of memory.

Each case is ``(argv, expected exit, words the one line must contain)``; ``{d}`` in an
argument is the folder of the files written by the ``inputs`` fixture. In-process
(:func:`hetrain.cli.main` returns the exit status) except for two subprocess checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.cli import main

DEV = {"tflops": 10, "memory_gib": 16, "nic_gbps": 10, "power_w": 100, "price_per_hour": 1.0}
CLUSTER = {"devices": [{"id": i, "node": "n0", **DEV} for i in ("a", "b", "c")]}
PROFILE = {
    "name": "toy",
    "layers": [
        {"name": f"l{i}", "fwd_flops": 1e9, "activation_bytes": 1e6, "param_bytes": 1e8}
        for i in range(4)
    ],
}
PLAN = {"groups": [{"devices": ["a", "b"], "stages": [[0, 2], [2, 4]], "microbatch_size": 2,
                    "batch": 8}]}  # fmt: skip
TRACE_HEADER = "slot,device,speed_factor,available,price_per_hour,nic_gbps\n"


def _cluster(**device_changes) -> dict:
    return {"devices": [{**CLUSTER["devices"][0], **device_changes}, *CLUSTER["devices"][1:]]}


def _group(**changes) -> dict:
    return {"groups": [{**PLAN["groups"][0], **changes}]}


FILES: dict[str, object] = {
    "c.yaml": CLUSTER,
    "m.json": PROFILE,
    "p.json": PLAN,
    "one.yaml": {"devices": [{"id": "a", **DEV}]},
    "one_layer.json": {"layers": [PROFILE["layers"][0]]},
    "huge_model.json": {"layers": [{**PROFILE["layers"][0], "param_bytes": 1e15}]},
    "list.yaml": "- a\n- b\n",
    "empty.yaml": "",
    "empty.json": "",
    "dup.yaml": {"devices": [CLUSTER["devices"][0], CLUSTER["devices"][0]]},
    "missing.yaml": {"devices": [{"id": "a", "tflops": 1, "memory_gib": 1}]},
    "unknown.yaml": _cluster(tflop=3),
    "negative.yaml": _cluster(tflops=-1),
    "nan.yaml": "devices:\n- {id: a, tflops: .nan, memory_gib: 1, nic_gbps: 1}\n",
    "huge.yaml": _cluster(memory_gib=1e300),
    "bool.yaml": "devices:\n- {id: a, tflops: true, memory_gib: 1, nic_gbps: 1}\n",
    "yes.yaml": "devices:\n- {id: a, tflops: 1, memory_gib: 1, nic_gbps: yes}\n",
    "p_unknown_dev.json": _group(devices=["a", "zz"]),
    "p_short.json": _group(stages=[[0, 2], [2, 3]]),
    "p_shares.json": _group(batch=7),
    "p_mu_huge.json": _group(microbatch_size=10**30),
    "p_batch_huge.json": _group(batch=10**30),
    "p_batch_bool.json": _group(batch=True),
    "p_oom.json": {
        "groups": [{"devices": ["a"], "stages": [[0, 4]], "microbatch_size": 10**6, "batch": 8}]
    },  # fmt: skip
    "t_unknown.csv": TRACE_HEADER + "0,zz,0.5,,,\n",
    "t_all_down.csv": "slot,device,available\n0,a,0\n0,b,0\n0,c,0\n",
    "t_order.csv": TRACE_HEADER + "5,a,0.5,,,\n2,a,0.5,,,\n",
    "afile": "x",
    "dupkey.yaml": "devices:\n- {id: a, tflops: 1, tflops: 2, memory_gib: 1, nic_gbps: 1}\n",
    "dupkey.json": '{"layers": [{"fwd_flops": 1, "activation_bytes": 1, "fwd_flops": 2}]}',
    "merge.yaml": "devices:\n- &d {id: a, tflops: 1, memory_gib: 16, nic_gbps: 1}\n"
    "- {<<: *d, id: b}\n",
    "free.yaml": {"devices": [{"id": "a", "tflops": 1, "memory_gib": 16, "nic_gbps": 1}]},
    "tiny.yaml": _cluster(tflops=1e-300),
    "slow.yaml": {
        "devices": [
            {
                **DEV,
                "id": i,
                "tflops": 1e-30,
                "nic_gbps": 1e-30,
                "memory_gib": 1e30,
                "price_per_hour": 1e30,
                "power_w": 1e30,
            }
            for i in ("a", "b")
        ]
    },  # fmt: skip
    "t_tiny.csv": TRACE_HEADER + "0,a,1e-300,,,\n",
    # 2048 devices of 4 kinds, 8 per node: the polish's μ move idled groups (IndexError)
    "big2048.json": {
        "devices": [
            {
                "id": f"d{i}",
                "node": f"n{i // 8}",
                "tflops": (10, 20, 5, 8)[i % 4],
                "memory_gib": (16, 40, 12, 16)[i % 4],
                "nic_gbps": 10,
            }
            for i in range(2048)
        ]
    },
    "t_bom.csv": "\ufeff" + TRACE_HEADER + "0,a,0.5,,,\n",
    # issue 11 case 6: a typo in a required field, in every file kind read through pydantic
    "typo.yaml": {"devices": [{"id": "a", "tflop": 10, "memory_gib": 16, "nic_gbps": 10}]},
    "typo_opt.yaml": _cluster(power_watt=3),
    "typo_model.json": {"layers": [{"fwd_flop": 1e9, "activation_bytes": 1e6}]},
    "typo_shared.json": {**PROFILE, "shared": [{"name": "t", "byte": 1, "layers": [0]}]},
    "p_typo.json": {
        "groups": [{"devices": ["a", "b"], "stages": [[0, 2], [2, 4]], "microbatch": 2, "batch": 8}]
    },  # fmt: skip
    # issue 11 case 5: one layer (4e10 bytes with Adam) larger than any device (16 GiB)
    "big_layer.json": {
        "layers": [
            {**ly, "param_bytes": 1e10 if i == 2 else ly["param_bytes"]}
            for i, ly in enumerate(PROFILE["layers"])
        ]
    },
    "bom.json": "\ufeff" + json.dumps(CLUSTER),
    "t_keep.csv": TRACE_HEADER + "0,a,0.5,,,\n",
    "c_keep.yaml": CLUSTER,
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    for name, content in FILES.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (d / name).write_text(text)
    (d / "adir").mkdir()
    return d


ROOT = Path(__file__).resolve().parents[1]


def _argv(args: str, d: Path) -> list[str]:
    out = [a.replace("{d}", str(d)) for a in args.split()]
    return [str(ROOT / a) if a.startswith("examples/") else a for a in out]


def _check(inputs: Path, capsys, args: str, code: int, words: tuple[str, ...]) -> None:
    rc = main(_argv(args, inputs))
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == code, err
    if code == 0:
        assert err == "", err  # e.g. no numpy overflow warnings on valid extreme inputs
        return
    assert len(lines) >= 1 and "Traceback" not in err
    if code == 2:
        assert len(lines) == 1, err
    for w in words:
        assert w.replace("{d}", str(inputs)) in err, (w, err)


PLAN_ARGS = "plan --cluster {d}/c.yaml --model {d}/m.json --batch 8"
EVAL_ARGS = "evaluate --cluster {d}/c.yaml --model {d}/m.json --batch 8 --plan"
SIM_ARGS = "simulate --cluster {d}/c.yaml --model {d}/m.json --batch 8 --slots 5"

CASES = [
    # --- files (read through plan) -------------------------------------------------------
    ("plan --cluster {d}/nope.yaml --model {d}/m.json --batch 8", 2, ("nope.yaml", "not found")),
    ("plan --cluster {d}/adir --model {d}/m.json --batch 8", 2, ("adir", "directory")),
    ("plan --cluster {d}/empty.yaml --model {d}/m.json --batch 8", 2, ("empty.yaml", "mapping")),
    ("plan --cluster {d}/c.yaml --model {d}/empty.json --batch 8", 2, ("empty.json", "JSON")),
    ("plan --cluster {d}/list.yaml --model {d}/m.json --batch 8", 2, ("list.yaml", "mapping")),
    ("plan --cluster {d}/dup.yaml --model {d}/m.json --batch 8", 2, ("dup.yaml", "duplicate")),
    ("plan --cluster {d}/missing.yaml --model {d}/m.json --batch 8", 2,
     ("missing.yaml", "devices[0].nic_gbps", "missing")),
    ("plan --cluster {d}/unknown.yaml --model {d}/m.json --batch 8", 2,
     ("unknown.yaml", "devices[0].tflop", "unknown key")),
    ("plan --cluster {d}/negative.yaml --model {d}/m.json --batch 8", 2,
     ("negative.yaml", "devices[0].tflops", "greater than 0")),
    ("plan --cluster {d}/nan.yaml --model {d}/m.json --batch 8", 2,
     ("nan.yaml", "devices[0].tflops", "finite")),
    ("plan --cluster {d}/huge.yaml --model {d}/m.json --batch 8", 2,
     ("huge.yaml", "devices[0].memory_gib", "less than or equal")),
    # a boolean is not a number (pydantic would read true as 1; YAML's yes is true)
    ("plan --cluster {d}/bool.yaml --model {d}/m.json --batch 8", 2,
     ("bool.yaml", "devices[0].tflops", "expected a number", "true")),
    ("plan --cluster {d}/yes.yaml --model {d}/m.json --batch 8", 2,
     ("yes.yaml", "devices[0].nic_gbps", "expected a number")),
    # a key given twice (parsers keep the last silently); YAML merge overrides are fine
    ("plan --cluster {d}/dupkey.yaml --model {d}/m.json --batch 8", 2,
     ("dupkey.yaml", "'tflops' twice", "line 2")),
    ("plan --cluster {d}/c.yaml --model {d}/dupkey.json --batch 8", 2,
     ("dupkey.json", "'fwd_flops' twice")),
    ("plan --cluster {d}/merge.yaml --model {d}/m.json --batch 8", 0, ()),
    # speeds and bandwidths below 1e-30 made times infinite ("fits nowhere" + overflow warnings)
    ("plan --cluster {d}/tiny.yaml --model {d}/m.json --batch 8", 2,
     ("tiny.yaml", "devices[0].tflops", ">= 1e-30")),
    ("plan --cluster {d}/slow.yaml --model {d}/m.json --batch 1000000000000000 "
     "--queue money=1e30 --V 1e-30", 0, ()),
    (SIM_ARGS + " --trace {d}/t_tiny.csv", 2, ("t_tiny.csv", "row 2.speed_factor", ">= 1e-30")),
    ("plan --cluster {d}/c.yaml --model {d}/huge_model.json --batch 8", 2,
     ("huge_model.json", "layers[0]", "fits", "alone needs 4e+15 bytes", "has 1.71799e+10 bytes")),
    # one layer too large for every device: the message names it and its bytes (case 5)
    ("plan --cluster {d}/c.yaml --model {d}/big_layer.json --batch 8", 2,
     ("big_layer.json", "layers[2]", "layer 2 ('l2') alone needs 4.0001e+10 bytes",
      "largest available device, 'a', has 1.71799e+10 bytes (16 GiB)")),
    ("simulate --cluster {d}/c.yaml --model {d}/big_layer.json --batch 8 --slots 2", 2,
     ("big_layer.json", "layers[2]", "layer 2 ('l2') alone needs")),
    ("simulate --cluster {d}/c.yaml --model {d}/big_layer.json --batch 8 --slots 2 "
     "--budget money=1", 2, ("big_layer.json", "layers[2]", "alone needs")),
    # a typo in a field: the missing field and the unknown key that is probably it (case 6)
    ("plan --cluster {d}/typo.yaml --model {d}/m.json --batch 8", 2,
     ("typo.yaml", "devices[0].tflops", "missing", "unknown key 'tflop' is probably a typo")),
    ("plan --cluster {d}/typo_opt.yaml --model {d}/m.json --batch 8", 2,
     ("typo_opt.yaml", "devices[0].power_watt", "unknown key", "did you mean 'power_w'")),
    ("plan --cluster {d}/c.yaml --model {d}/typo_model.json --batch 8", 2,
     ("typo_model.json", "layers[0].fwd_flops", "'fwd_flop' is probably a typo")),
    ("plan --cluster {d}/c.yaml --model {d}/typo_shared.json --batch 8", 2,
     ("typo_shared.json", "shared[0].bytes", "'byte' is probably a typo")),
    (EVAL_ARGS + " {d}/p_typo.json", 2,
     ("p_typo.json", "groups[0].microbatch_size", "'microbatch' is probably a typo")),
    ("plan --cluster {d}/one.yaml --model {d}/one_layer.json --batch 8", 0, ()),
    ("plan --cluster {d}/big2048.json --model examples/profiles/resnet50.json --batch 512", 0,
     ()),
    # --- plan options -----------------------------------------------------------------------
    ("plan --cluster {d}/c.yaml --model {d}/m.json --batch 0", 2, ("--batch", ">= 1", "got 0")),
    ("plan --cluster {d}/c.yaml --model {d}/m.json --batch -3", 2, ("--batch", "got -3")),
    ("plan --cluster {d}/c.yaml --model {d}/m.json --batch 10000000000000000000000", 2,
     ("--batch", "<= 1e+15")),
    ("plan --cluster {d}/c.yaml --model {d}/m.json --batch abc", 2,
     ("--batch: expected a valid integer, got 'abc'",)),
    ("plan --cluster {d}/c.yaml --model {d}/m.json --batch=2.5", 2,
     ("--batch: expected a valid integer, got '2.5'",)),
    (PLAN_ARGS + " --V x", 2, ("--V: expected a valid number, got 'x'",)),
    (PLAN_ARGS + " --V 0", 2, ("--V", "> 0")),
    (PLAN_ARGS + " --V -1", 2, ("--V", "> 0")),
    (PLAN_ARGS + " --V nan", 2, ("--V", "finite")),
    (PLAN_ARGS + " --V 1e300", 2, ("--V", "<= 1e+30")),
    (PLAN_ARGS + " --queue money=abc", 2, ("--queue", "money", "expected a number", "abc")),
    (PLAN_ARGS + " --queue foo=1", 2, ("--queue", "foo=1", "money=NUMBER")),
    (PLAN_ARGS + " --queue money=-1", 2, ("--queue", "money", ">= 0")),
    (PLAN_ARGS + " --queue energy=1e300", 2, ("--queue", "energy", "<= 1e+30")),
    (PLAN_ARGS + " --queue money=1 --queue money=2", 2, ("--queue", "money", "at most once")),
    (PLAN_ARGS + " --optimizer-state-factor -1", 2, ("--optimizer-state-factor", "between 0")),
    (PLAN_ARGS + " --optimizer-state-factor 1e300", 2, ("--optimizer-state-factor", "1e+30")),
    (PLAN_ARGS + " --schedule nope", 2, ("--schedule", "1f1b", "nope")),
    # --- evaluate -----------------------------------------------------------------------------
    (EVAL_ARGS + " {d}/p.json", 0, ()),
    (EVAL_ARGS + " {d}/adir", 2, ("adir", "directory")),
    (EVAL_ARGS + " {d}/p_unknown_dev.json", 2,
     ("p_unknown_dev.json", "groups[0].devices[1]", "'zz'")),
    (EVAL_ARGS + " {d}/p_short.json", 2, ("p_short.json", "groups[0].stages", "[0, 4)")),
    (EVAL_ARGS + " {d}/p_shares.json", 2, ("p_shares.json", "batch", "summing to", "8")),
    (EVAL_ARGS + " {d}/p_mu_huge.json", 2,
     ("p_mu_huge.json", "groups[0].microbatch_size", "less than or equal")),
    (EVAL_ARGS + " {d}/p_batch_huge.json", 2,
     ("p_batch_huge.json", "groups[0].batch", "less than or equal")),
    (EVAL_ARGS + " {d}/p_batch_bool.json", 2,
     ("p_batch_bool.json", "groups[0].batch", "expected a number")),
    (EVAL_ARGS + " {d}/p_oom.json", 1, ("out of memory", "device a")),
    ("evaluate --cluster {d}/c.yaml --model {d}/m.json --batch 10000000000000000000000 "
     "--plan {d}/p.json", 2, ("--batch", "<= 1e+15")),
    # --- simulate ---------------------------------------------------------------------------
    (SIM_ARGS, 0, ()),
    (SIM_ARGS.replace("--slots 5", "--slots 0"), 2, ("--slots", "between 1 and", "got 0")),
    (SIM_ARGS.replace("--slots 5", "--slots -5"), 2, ("--slots", "got -5")),
    # dense (slots, devices) arrays: this used to be a MemoryError traceback
    (SIM_ARGS.replace("--slots 5", "--slots 1000000000"), 2, ("--slots", "device-slots")),
    (SIM_ARGS.replace("--slots 5", "--slots 100000000000000000000000"), 2, ("--slots",)),
    (SIM_ARGS.replace("--batch 8", "--batch 10000000000000000000000"), 2, ("--batch",)),
    (SIM_ARGS + " --policy nope", 2, ("--policy", "lyapunov", "nope")),
    # --cluster/--model/--batch are optional only beside --replay
    ("simulate --model {d}/m.json --batch 8", 2, ("--cluster", "--replay")),
    ("simulate --cluster {d}/c.yaml --model {d}/m.json", 2, ("--batch", "--replay")),
    ("simulate --replay {d}", 2, ("--replay", "controller.jsonl")),
    (SIM_ARGS + " --V 0", 2, ("--V", "> 0")),
    (SIM_ARGS + " --V -1", 2, ("--V", "> 0")),
    (SIM_ARGS + " --budget money=-1", 2, ("--budget", "money", ">= 0")),
    (SIM_ARGS + " --budget money=0", 2, ("--budget", "money", ">= 1e-30")),
    # free devices: any budget is feasible; 1e-300 squared made the controller divide by 0
    ("simulate --cluster {d}/free.yaml --model {d}/m.json --batch 8 --budget money=1e-300", 2,
     ("--budget", "money", ">= 1e-30")),
    ("simulate --cluster {d}/free.yaml --model {d}/m.json --batch 8 --slots 3 "
     "--budget money=1e-30", 0, ()),
    (SIM_ARGS + " --budget money=1e-12", 2, ("--budget", "money", "minimum feasible budget")),
    (SIM_ARGS + " --budget money=1 --budget money=2", 2, ("--budget", "money", "at most once")),
    (SIM_ARGS + " --trace {d}/nope.csv", 2, ("nope.csv", "not found")),
    (SIM_ARGS + " --trace {d}/t_bom.csv", 0, ()),  # spreadsheet export with a byte-order mark
    ("plan --cluster {d}/bom.json --model {d}/m.json --batch 8", 0, ()),
    (SIM_ARGS + " --trace {d}/adir", 2, ("adir", "directory")),
    (SIM_ARGS + " --trace {d}/t_unknown.csv", 2, ("t_unknown.csv", "row 2.device", "'zz'")),
    (SIM_ARGS + " --trace {d}/t_order.csv", 2, ("t_order.csv", "row 3.slot", "non-decreasing")),
    # every device down in every slot: nothing to simulate (used to print "infeasible", exit 0)
    (SIM_ARGS + " --trace {d}/t_all_down.csv", 2, ("t_all_down.csv", "available")),
    (SIM_ARGS + " --trace {d}/t_all_down.csv --budget money=1", 2, ("t_all_down.csv",)),
    # --csv-out that cannot be written: checked before simulating (was an OSError traceback)
    (SIM_ARGS + " --csv-out {d}/adir", 2, ("--csv-out", "directory")),
    (SIM_ARGS + " --csv-out {d}/afile/x.csv", 2, ("--csv-out", "not a directory")),
    # the per-slot rows overwrote the input they were simulated from (exit 0, input lost)
    (SIM_ARGS + " --trace {d}/t_keep.csv --csv-out {d}/t_keep.csv", 2,
     ("--csv-out", "other than the --trace input")),
    ("simulate --cluster {d}/c_keep.yaml --model {d}/m.json --batch 8 --slots 2 "
     "--csv-out {d}/c_keep.yaml", 2, ("--csv-out", "other than the --cluster input")),
    ("simulate --cluster {d}/c.yaml --model {d}/huge_model.json --batch 8", 2,
     ("huge_model.json", "fits")),
    ("simulate --cluster {d}/one.yaml --model {d}/one_layer.json --batch 8 --slots 3 "
     "--policy pipeline", 0, ()),
]  # fmt: skip


@pytest.mark.parametrize(("args", "code", "words"), CASES, ids=[c[0][-60:] for c in CASES])
def test_bad_input(inputs: Path, capsys, args: str, code: int, words: tuple[str, ...]) -> None:
    _check(inputs, capsys, args, code, words)


PROFILE_CASES = [
    ("profile --example nope", ("--example", "charlm")),
    ("profile --example charlm --batch 0", ("--batch", ">= 1")),
    ("profile --example charlm --batch 1000000000", ("--batch", "at most")),
    ("profile --example charlm --device gpu", ("--device", "meta")),
    ("profile --example charlm --out {d}/adir", ("--out", "directory")),
    ("profile --example charlm --out {d}/afile/p.json", ("--out", "not a directory")),
    ("profile --example charlm --measure", ("--out", "required")),
    ("profile --example charlm --measure --out {d}/o.json --repeats 0", ("--repeats", ">= 1")),
    ("profile --example charlm --measure --out {d}/o.json --warmup -1", ("--warmup", ">= 0")),
    ("profile --example charlm --measure --out {d}/o.json --threads 0", ("--threads", ">= 1")),
    ("profile --example charlm --measure --out {d}/o.json --workers 0", ("--workers", ">= 1")),
    ("profile --example charlm --measure --out {d}/o.json --microbatch-sizes 1,100000",
     ("--microbatch-sizes", "between 1 and")),
    ("profile --example charlm --measure --out {d}/o.json --cluster-out {d}/adir",
     ("--cluster-out", "directory")),
    ("profile --example gpt2 --measure --out {d}/o.json --seq-len 0", ("--seq-len", ">= 1")),
    ("profile --example gpt2 --measure --out {d}/o.json --stage-lengths 2,x",
     ("--stage-lengths", "integers >= 1")),
    ("profile --example gpt2 --size huge", ("--size", "tiny, small or base")),
    # --size on a model it does not size was silently ignored (train refuses it)
    ("profile --example digits --size base", ("--size", "(not with --example digits)")),
    ("profile --model m:f --size small", ("--size", "(not with --model)")),
    ("profile --example gpt2 --batch 0", ("--batch", ">= 1")),
    # a seed torch refuses (traceback), or numpy (train's data order) refuses
    ("profile --example charlm --seed 100000000000000000000000", ("--seed", "2**63-1")),
    ("profile --example charlm --seed -1", ("--seed", "between 0 and")),
    # 100000 torch threads crashed the process (SIGSEGV); too many workers gave 0-GiB devices
    # after the timing; 1e20 rounds ran for ever
    ("profile --example charlm --measure --out {d}/o.json --threads 100000",
     ("--threads", "the CPUs of this machine")),
    ("profile --example charlm --measure --out {d}/o.json --workers 100000000",
     ("--workers", "1 MiB of this machine's memory per device")),
    ("profile --example charlm --measure --out {d}/o.json --repeats 100000000000000000000",
     ("--repeats", "<= 10000")),
    ("profile --example charlm --measure --out {d}/o.json --warmup 100000000000000000000",
     ("--warmup", "<= 10000")),
    # the cluster file overwrote the profile it was measured with (exit 0, profile lost)
    ("profile --example charlm --measure --out {d}/o.json --cluster-out {d}/o.json",
     ("--cluster-out", "expected a file other than --out")),
    ("profile --example charlm --measure --out {d}/o.json --cluster-out {d}/o.measure.json",
     ("--cluster-out", "other than the timings file")),
]  # fmt: skip


@pytest.mark.parametrize(("args", "words"), PROFILE_CASES, ids=[c[0][16:] for c in PROFILE_CASES])
def test_profile_bad_input(inputs: Path, capsys, args: str, words: tuple[str, ...]) -> None:
    pytest.importorskip("torch")
    _check(inputs, capsys, args, 2, words)


@pytest.mark.parametrize(
    "args",
    [
        "plan --cluster {d}/c.yaml --model {d}/m.json --batch 10000000000000000000000",
        SIM_ARGS + " --trace {d}/t_all_down.csv",
    ],
)
def test_bad_input_subprocess_one_line(inputs: Path, args: str) -> None:
    """The console entry point: exit 2, one line, no traceback (no in-process shortcuts)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "hetrain", *_argv(args, inputs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("hetrain: error: ")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [PLAN_ARGS, PLAN_ARGS + " --json", SIM_ARGS])
def test_stdout_that_cannot_be_written_is_one_line(inputs: Path, args: str) -> None:
    """stdout on a full disk: an OSError traceback from rich's console before."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "hetrain", *_argv(args, inputs)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "hetrain: error: output: cannot write (No space left on device)\n"


def test_plan_and_minimum_budget_searches_are_time_bounded(inputs: Path, monkeypatch) -> None:
    """Large valid inputs must not hang: ``plan`` and simulate's minimum-budget estimate give
    the planner a time budget (256 devices × 1000 layers searched for minutes without one)."""
    import hetrain.planner as planner
    from hetrain.commands.plan import PLAN_TIME_BUDGET_S

    budgets: list[float | None] = []
    real = planner.best_plan

    def spy(*args, **kwargs):
        budgets.append(kwargs.get("time_budget_s"))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "best_plan", spy)
    assert main(_argv(PLAN_ARGS, inputs)) == 0
    assert budgets == [PLAN_TIME_BUDGET_S]
    budgets.clear()
    assert main(_argv(SIM_ARGS + " --policy dp-even --budget money=1", inputs)) == 0
    assert budgets and all(b is not None and b <= PLAN_TIME_BUDGET_S for b in budgets)
