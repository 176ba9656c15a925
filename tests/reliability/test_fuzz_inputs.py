"""Fuzzing of every input file (issue 6): cluster (YAML/JSON), model profile, plan and trace CSV.

Each loader is fed structured mutations of a valid file (wrong types, missing and unknown keys,
negative, NaN, infinite and huge numbers, unicode and control characters, deep nesting, YAML
alias bombs), truncated files and binary garbage. Every input must either load (and the loaded
value must be usable: SI state finite, plan checkable, trace expandable) or raise
:class:`hetrain.errors.InputError` whose message is one line that starts with the file's path.
Anything else (another exception, a traceback, a hang) is a bug. A few end-to-end runs of the
CLI check exit status 0/1/2, one stderr line and no traceback.

The number of inputs tried is printed in the pytest summary ("fuzzed inputs tried: N").
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetrain.cluster import load_cluster
from hetrain.errors import InputError
from hetrain.plan import load_plan
from hetrain.profile import load_profile
from hetrain.trace import TRACE_COLUMNS, load_trace

CLUSTER = {
    "links": {"intra_node_gbps": 800, "latency_us": 20},
    "devices": [
        {"id": "a", "node": "n0", "tflops": 14.0, "memory_gib": 16, "nic_gbps": 25,
         "power_w": 300, "price_per_hour": 3.06, "microbatch_overhead_ms": 2.0},
        {"id": "b", "node": "n0", "tflops": 7.0, "memory_gib": 8, "nic_gbps": 10},
        {"id": "c", "tflops": 4.0, "memory_gib": 12, "nic_gbps": 10},
    ],
}  # fmt: skip
PROFILE = {
    "name": "toy",
    "layers": [
        {"name": "l0", "fwd_flops": 1e6, "bwd_flops": 2e6, "activation_bytes": 1024,
         "activation_memory_bytes": 2048, "param_bytes": 4096},
        {"name": "l1", "fwd_flops": 2e6, "activation_bytes": 512, "param_bytes": 8192},
        {"fwd_flops": 5e5, "activation_bytes": 64},
    ],
}  # fmt: skip
PLAN = {
    "plan_id": 3,
    "schedule": "1f1b",
    "groups": [
        {"devices": ["a", "b"], "stages": [[0, 1], [1, 3]], "microbatch_size": 2, "batch": 6},
        {"devices": ["c"], "stages": [[0, 3]], "microbatch_size": 1, "batch": 2},
    ],
    "iteration_time_s": 0.1,
    "lower_bound_s": 0.05,
    "cost": {"money": 0.01, "energy": 3.0},
}
BATCH = 8
NUM_LAYERS = 3

FUZZ = settings(
    max_examples=int(os.environ.get("HETRAIN_FUZZ_EXAMPLES", "250")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def counts(request) -> Counter:
    """Inputs tried per kind; shown by tests/reliability/conftest.py at the end of the run."""
    return request.config.__dict__.setdefault("_hetrain_fuzz_counts", Counter())


# ------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------

_NASTY_TEXT = st.sampled_from(
    ["", " ", "a\nb", "x\r\ny", "\u2028", "\x00", "\x1b[31mred", "é", "🚀", "../../etc/passwd",
     "null", "1e999", "NaN", "-1", "0x10", "true", "a" * 300, "${HOME}", "%s%n", "\ud800"]
)  # fmt: skip
_NUMBERS = st.one_of(
    st.sampled_from([0, -0.0, -1, 1e-320, 1e300, -1e300, 1.7976931348623157e308, 2**63, 10**40]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    _NUMBERS,
    _NASTY_TEXT,
    st.text(max_size=12),
    # replaced by [[[...]]] (this many levels) after serialisation: deep nesting
    st.integers(min_value=1, max_value=5000).map(lambda n: f"__DEEP_{n}__"),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), _NASTY_TEXT), children, max_size=4),
    ),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) into a JSON-like tree, the root included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


@st.composite
def mutated_tree(draw, template: dict) -> Any:
    """1-4 structural mutations of ``template``: replace a value (any type), delete a key, add an
    unknown key, duplicate or empty a list, wrap a value in a list or a dict."""
    tree = copy.deepcopy(template)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        op = draw(
            st.sampled_from(
                ["replace", "number", "number", "number", "delete", "add", "dup", "empty", "wrap"]
            )
        )
        if op == "number":  # a numeric leaf gets another number (negative, NaN, inf, huge)
            numeric = [p for p in paths if p and isinstance(_get(tree, p), (int, float))]
            path = draw(st.sampled_from(numeric)) if numeric else path
        if not path:
            if op == "replace":
                tree = draw(_VALUES)
            continue
        parent, key = _get(tree, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = draw(_VALUES)
        elif op == "number":
            parent[key] = draw(_NUMBERS)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(st.text(max_size=10), _NASTY_TEXT))] = draw(_VALUES)
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif op == "empty":
            parent[key] = draw(st.sampled_from([[], {}, "", None]))
        elif op == "wrap":
            inner = parent[key]
            parent[key] = [inner] if draw(st.booleans()) else {"value": inner}
        if not isinstance(tree, (dict, list)):
            break
    return tree


def _deepen(text: str) -> str:
    """Replace the ``__DEEP_n__`` markers with ``n`` nested lists (JSON and YAML flow syntax)."""

    def nest(m: re.Match) -> str:
        n = int(m.group(1))
        return "[" * n + "]" * n

    text = re.sub(r'"__DEEP_(\d+)__"', nest, text)
    return re.sub(r"'?__DEEP_(\d+)__'?", nest, text)


def _alias_bomb() -> str:
    """A YAML 'billion laughs': 10**8 leaves reachable through aliases, a few hundred bytes."""
    lines = ["a0: &a0 [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


@st.composite
def structured_file(draw, template: dict) -> tuple[bytes, str]:
    """(file bytes, suffix) for a cluster/profile/plan file: a mutated tree serialised as JSON or
    YAML, then maybe truncated or with garbage bytes inserted; or pure binary garbage; or a YAML
    alias bomb."""
    kind = draw(st.sampled_from(["tree"] * 8 + ["binary", "bomb"]))
    suffix = draw(st.sampled_from([".json", ".yaml", ".yml", ".json", ".yaml"]))
    if kind == "binary":
        return draw(st.binary(max_size=300)), suffix
    if kind == "bomb":
        body = _alias_bomb()
        key = draw(st.sampled_from(["devices", "layers", "groups", "links", "name", "cost"]))
        return (body + f"{key}: *a8\n").encode(), ".yaml"
    tree = draw(mutated_tree(template))
    if suffix == ".json":
        text = json.dumps(tree, allow_nan=True, ensure_ascii=draw(st.booleans()))
    else:
        try:
            text = yaml.safe_dump(tree, allow_unicode=draw(st.booleans()))
        except yaml.YAMLError:  # e.g. lone surrogates: fall back to JSON, which YAML reads
            text = json.dumps(tree, allow_nan=True)
    text = _deepen(text)
    data = text.encode("utf-8", errors="surrogatepass")
    cut = draw(st.sampled_from(["none"] * 4 + ["truncate", "garbage"]))
    if cut == "truncate" and data:
        data = data[: draw(st.integers(min_value=0, max_value=len(data) - 1))]
    elif cut == "garbage":
        at = draw(st.integers(min_value=0, max_value=len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=20)) + data[at:]
    return data, suffix


_CELLS = {
    "slot": st.one_of(
        st.integers(min_value=0, max_value=40).map(str),
        st.sampled_from(["-1", "1.5", "", "²", "١٢", "9" * 5000, "99999999999999999999", " 3"]),
    ),
    "device": st.one_of(st.sampled_from(["a", "b", "c"]), st.sampled_from(["", "zz", "a b"])),
    "available": st.sampled_from(["0", "1", "", "2", "yes", "-0", "1.0"]),
}
_FLOAT_CELL = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "0", "-1", "1e999", "nan", "inf", "1_0", "0x1p3", "1" * 400, "½"]),
)


def _slot_key(row: list[str]) -> int:
    ok = row and row[0].isascii() and row[0].isdigit() and len(row[0]) < 19
    return int(row[0]) if ok else 0


@st.composite
def trace_file(draw) -> bytes:
    """A trace CSV: a header (docs/model.md §7 columns, maybe shuffled, missing, duplicated or
    unknown)
    and rows of plausible or hostile cells; maybe truncated, with garbage, or pure binary."""
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        return draw(st.binary(max_size=300))
    header = list(TRACE_COLUMNS)
    if draw(st.booleans()):
        header = draw(st.permutations(header))
    if draw(st.integers(min_value=0, max_value=3)) == 0:
        header = draw(st.lists(st.sampled_from([*TRACE_COLUMNS, "extra", ""]), max_size=7))
    rows = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        cells = []
        for col in header:
            strat = _CELLS.get(col, _FLOAT_CELL)
            cells.append(
                draw(
                    st.one_of(strat, st.text(max_size=6))
                    if draw(st.integers(min_value=0, max_value=7)) == 0
                    else strat
                )
            )
        if draw(st.integers(min_value=0, max_value=9)) == 0:
            cells = cells[: draw(st.integers(min_value=0, max_value=len(cells)))]
        rows.append(cells)
    rows.sort(key=_slot_key)  # mostly non-decreasing slots, so that later checks are reached
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *rows])
    data = buf.getvalue().encode("utf-8", errors="surrogatepass")
    cut = draw(st.sampled_from(["none"] * 4 + ["truncate", "garbage"]))
    if cut == "truncate" and data:
        data = data[: draw(st.integers(min_value=0, max_value=len(data) - 1))]
    elif cut == "garbage":
        at = draw(st.integers(min_value=0, max_value=len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=20)) + data[at:]
    return data


# ------------------------------------------------------------------------------------------
# oracle
# ------------------------------------------------------------------------------------------

_ids = itertools.count()


def _write(directory: Path, data: bytes, suffix: str) -> Path:
    path = directory / f"in{next(_ids)}{suffix}"
    path.write_bytes(data)
    return path


def _check_error(exc: InputError, path: Path) -> None:
    message = str(exc)
    assert message.startswith(str(path)), message
    assert len(message.splitlines()) == 1, repr(message)
    assert message.isprintable(), repr(message)
    assert len(message) < 1000, message[:200]


def _finite_arrays(obj: Any) -> None:
    for name, value in vars(obj).items():
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.isfinite(value).all(), name
        elif isinstance(value, float):
            assert math.isfinite(value), name


def _load_or_input_error(loader, path: Path, use) -> str:
    """Run ``loader(path)`` then ``use(result)``; return "ok" or "error". Any exception other
    than InputError propagates and fails the test."""
    try:
        use(loader(path))
    except InputError as exc:
        _check_error(exc, path)
        return "error"
    return "ok"


# ------------------------------------------------------------------------------------------
# in-process fuzzing of the loaders
# ------------------------------------------------------------------------------------------


def _use_cluster(spec) -> None:
    state = spec.state()
    assert state.num_devices == len(spec.devices) >= 1
    _finite_arrays(state)


def _use_profile(profile) -> None:
    arrays = profile.arrays()
    assert arrays.num_layers == len(profile.layers) >= 1
    _finite_arrays(arrays)
    assert np.isfinite(arrays.train_flops).all()


def _use_plan(source: Path):
    def use(plan) -> None:
        assert plan.global_batch >= 0
        plan.validate_for(["a", "b", "c"], NUM_LAYERS, BATCH, str(source))
        json.loads(plan.to_json())  # serialisable, finite

    return use


@FUZZ
@given(case=structured_file(CLUSTER))
def test_fuzz_cluster_loader(case, fuzz_dir, counts):
    data, suffix = case
    path = _write(fuzz_dir, data, suffix)
    _load_or_input_error(load_cluster, path, _use_cluster)
    counts["cluster"] += 1


@FUZZ
@given(case=structured_file(PROFILE))
def test_fuzz_profile_loader(case, fuzz_dir, counts):
    data, suffix = case
    path = _write(fuzz_dir, data, suffix)
    _load_or_input_error(load_profile, path, _use_profile)
    counts["profile"] += 1


@FUZZ
@given(case=structured_file(PLAN))
def test_fuzz_plan_loader(case, fuzz_dir, counts):
    data, suffix = case
    path = _write(fuzz_dir, data, suffix)
    _load_or_input_error(load_plan, path, _use_plan(path))  # validate_for's errors included
    counts["plan"] += 1


@FUZZ
@given(data=trace_file(), with_cluster=st.booleans(), slots=st.integers(0, 60))
def test_fuzz_trace_loader(data, with_cluster, slots, fuzz_dir, counts):
    from hetrain.cluster import cluster_from_dict

    cluster = cluster_from_dict(CLUSTER)
    path = _write(fuzz_dir, data, ".csv")

    def use(trace) -> None:
        timeline = trace.timeline(cluster, slots)
        assert timeline.num_slots == slots
        if slots:
            state = timeline.state_at(slots - 1)
            _finite_arrays(state)
            assert (timeline.speed_factor > 0).all()

    _load_or_input_error(
        (lambda p: load_trace(p, cluster)) if with_cluster else load_trace, path, use
    )
    counts["trace"] += 1


def test_alias_bomb_is_rejected_quickly(fuzz_dir):
    """A YAML 'billion laughs' file must not be expanded (10**8 leaves): it fails fast."""
    path = _write(fuzz_dir, (_alias_bomb() + "devices: *a8\n").encode(), ".yaml")
    with pytest.raises(InputError) as info:
        load_cluster(path)
    _check_error(info.value, path)


@pytest.mark.parametrize(
    ("text", "field"),
    [("slot,device\n²,a\n", "row 2.slot"), ("slot,device\n" + "9" * 5000 + ",a\n", "row 2.slot")],
)
def test_trace_slot_must_be_ascii_integer(fuzz_dir, text, field):
    """Regression: unicode digits and 5000-digit slots used to escape as a bare ValueError."""
    path = _write(fuzz_dir, text.encode(), ".csv")
    with pytest.raises(InputError, match=field.replace(".", r"\.")) as info:
        load_trace(path)
    _check_error(info.value, path)


def test_deep_json_is_input_error(fuzz_dir):
    """Regression: 100 000 nested JSON lists used to raise RecursionError."""
    path = _write(fuzz_dir, b"[" * 100_000 + b"]" * 100_000, ".json")
    with pytest.raises(InputError) as info:
        load_profile(path)
    _check_error(info.value, path)


# ------------------------------------------------------------------------------------------
# end-to-end CLI runs on fuzzed files
# ------------------------------------------------------------------------------------------

CLI_TIMEOUT_S = 120


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``hetrain ARGS`` in this process through :func:`hetrain.cli.main` (what the console
    script calls), so that many fuzzed files take seconds, not minutes; an exception that
    escapes ``main`` is reported as a ``Traceback`` in stderr, which :func:`_check_cli` fails
    on. Start-up in a real process is covered by :func:`_run_cli_subprocess` and the subprocess
    tests of ``tests/test_cli_bad_input.py``."""
    import contextlib
    import signal
    import traceback

    from hetrain.cli import main

    def hang(signum, frame):  # a run that hangs fails the test, as the subprocess timeout did
        raise TimeoutError(f"hetrain {' '.join(args)} ran longer than {CLI_TIMEOUT_S} s")

    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_handler = Path.cwd(), signal.signal(signal.SIGALRM, hang)
    signal.alarm(CLI_TIMEOUT_S)
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except BaseException:  # noqa: BLE001 - the test fails on it via "Traceback"
                traceback.print_exc(file=err)
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        os.chdir(old_cwd)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _run_cli_subprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "hetrain", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,  # a hang fails the test (TimeoutExpired)
        cwd=cwd,
        env=env,
    )


def _check_cli(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode in (0, 1, 2), (proc.returncode, proc.stderr[-2000:])
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("hetrain: error:"), proc.stderr


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not on this branch yet")


# 100 fuzzed files per command, run in-process (~25 s for the three tests on 2 loaded cores)
CLI_FUZZ = settings(FUZZ, max_examples=int(os.environ.get("HETRAIN_FUZZ_CLI_EXAMPLES", "100")))


def _valid_files(directory: Path) -> dict[str, Path]:
    files = {
        "cluster": directory / "ok_cluster.yaml",
        "model": directory / "ok_model.json",
        "plan": directory / "ok_plan.json",
        "trace": directory / "ok_trace.csv",
    }
    files["cluster"].write_text(yaml.safe_dump(CLUSTER))
    files["model"].write_text(json.dumps(PROFILE))
    files["plan"].write_text(json.dumps(PLAN))
    files["trace"].write_text("slot,device,speed_factor,available\n0,a,1,1\n3,b,0.5,\n5,c,,0\n")
    return files


@pytest.mark.parametrize(
    "cluster_text",
    ["devices: [{id: a, tflops: -1, memory_gib: 1, nic_gbps: 1}]\n", "devices: [\n", "{}\n"],
)
def test_in_process_runner_answers_like_a_real_process(fuzz_dir, cluster_text):
    """The in-process runner of the fuzz tests gives the exit status and the one line a real
    ``python -m hetrain`` process gives, for bad files of three kinds."""
    files = _valid_files(fuzz_dir)
    files["cluster"].write_text(cluster_text)
    args = ["plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
            "--batch", str(BATCH)]  # fmt: skip
    inproc, real = _run_cli(args, fuzz_dir), _run_cli_subprocess(args, fuzz_dir)
    assert inproc.returncode == real.returncode == 2
    assert inproc.stderr == real.stderr and inproc.stderr.count("\n") == 1


@CLI_FUZZ
@given(
    which=st.sampled_from(["cluster", "model"]),
    cluster=structured_file(CLUSTER),
    model=structured_file(PROFILE),
)
def test_fuzz_cli_plan(which, cluster, model, fuzz_dir, counts):
    _needs("hetrain.commands.plan")
    files = _valid_files(fuzz_dir)
    case = cluster if which == "cluster" else model
    files[which] = _write(fuzz_dir, case[0], case[1])
    proc = _run_cli(
        ["plan", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
         "--batch", str(BATCH), "--json"],
        fuzz_dir,
    )  # fmt: skip
    _check_cli(proc)
    counts["cli"] += 1


@CLI_FUZZ
@given(plan=structured_file(PLAN))
def test_fuzz_cli_evaluate(plan, fuzz_dir, counts):
    _needs("hetrain.commands.plan")
    files = _valid_files(fuzz_dir)
    files["plan"] = _write(fuzz_dir, plan[0], plan[1])
    proc = _run_cli(
        ["evaluate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
         "--batch", str(BATCH), "--plan", str(files["plan"]), "--json"],
        fuzz_dir,
    )  # fmt: skip
    _check_cli(proc)
    counts["cli"] += 1


@CLI_FUZZ
@given(trace=trace_file())
def test_fuzz_cli_simulate(trace, fuzz_dir, counts):
    _needs("hetrain.commands.simulate")
    files = _valid_files(fuzz_dir)
    files["trace"] = _write(fuzz_dir, trace, ".csv")
    proc = _run_cli(
        ["simulate", "--cluster", str(files["cluster"]), "--model", str(files["model"]),
         "--batch", str(BATCH), "--trace", str(files["trace"]), "--slots", "12",
         "--policy", "greedy", "--json"],
        fuzz_dir,
    )  # fmt: skip
    _check_cli(proc)
    counts["cli"] += 1


# ------------------------------------------------------------------------------------------
# checkpoint manifests (a hand-edited or damaged manifest must not load wrong weights)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory):
    import torch

    from hetrain.runtime import checkpoint as ckpt

    root = tmp_path_factory.mktemp("ckpts")
    state = {"layers.0.weight": torch.arange(6.0).reshape(2, 3), "layers.1.bias": torch.ones(2)}
    plan = {"groups": [{"devices": ["a"], "stages": [[0, 2]], "microbatch_size": 1, "batch": 2}]}
    train_path = ckpt.save(
        root / "train", 3, state, {"data_position": 6, "plan": plan, "model_fingerprint": "fp"}
    )
    return {"train": (train_path, json.loads((train_path / "manifest.json").read_text()))}


@FUZZ
@given(which=st.sampled_from(["train"]), data=st.data())
def test_fuzz_checkpoint_manifest(which, data, saved_checkpoints, counts):
    """Any mutation of a checkpoint's manifest either still describes the same files (loads
    the same tensors) or is a one-line error naming the checkpoint; never a crash."""
    from hetrain.runtime import checkpoint as ckpt

    path, good = saved_checkpoints[which]
    mutated = data.draw(mutated_tree(good))
    text = _deepen(json.dumps(mutated, allow_nan=True))
    target = path / "manifest.json"
    original = target.read_bytes()
    target.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    try:
        info = ckpt.read_checkpoint(path, fingerprint="fp")
        tensors = ckpt.load_tensors(info)
        assert float(tensors["layers.0.weight"].sum()) == 15.0
    except InputError as exc:  # CheckpointError is an InputError
        message = str(exc)
        assert message.startswith(str(path)), message
        assert len(message.splitlines()) == 1 and message.isprintable(), repr(message)
    finally:
        target.write_bytes(original)
    counts["checkpoint_manifest"] += 1
