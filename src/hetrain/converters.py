"""Converters from published profiles in ``../shared/data`` into docs/model.md §7 model profiles.

Pure Python + numpy (no torch). Two sources:

* **sailor** (eth-easl/sailor, MIT): ``llm_info.json`` gives per-layer parameter and activation
  sizes of OPT-350M, GPT-Neo-2.7B, OPT-30B and LLaMA-3-8B for micro-batch 1 (one sequence);
  ``profiles/<MODEL>/<GPU>/profile.json`` gives measured per-layer forward/backward/update
  seconds per micro-batch, as ``{micro_batch: {tp_degree: {layer: [fwd_s, bwd_s, update_s]}}}``.
  Sizes carry no FLOPs, so FLOPs come from the published architecture (hidden size ``h``) and
  the standard count of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC'21), eq. (2): a transformer block does ``24 s h^2 + 4 s^2 h``
  forward FLOPs per sequence of ``s`` tokens, i.e. ``2 P s`` for its ``P ≈ 12 h^2`` weights plus
  ``4 s^2 h`` for the two attention matmuls; backward ``2x`` forward (no recomputation).
* **pipedream** (msr-fiddle/pipedream, MIT): ``<model>_graph.txt`` is a DAG of operators with
  measured forward/backward milliseconds per minibatch, output activation bytes per minibatch
  and parameter bytes. It is made a chain by cutting only where exactly one tensor crosses
  (PipeDream does the same for its partitioner); FLOPs come from each operator's shapes.

Both fill a profile's measured per-layer times per device kind (docs/model.md §3, §7):
:func:`sailor_profile_with_measured_times` (every GPU kind sailor profiled without tensor
parallelism) and :func:`pipedream_profile_with_measured_times` (one kind named by the caller).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetrain.errors import InputError
from hetrain.profile import LayerProfile, ModelProfile

# ---------------------------------------------------------------------------------------------
# sailor
# ---------------------------------------------------------------------------------------------

#: Hidden size ``h`` of each sailor model, from the published Hugging Face configurations
#: (``hidden_size`` of facebook/opt-350m, EleutherAI/gpt-neo-2.7B, facebook/opt-30b,
#: meta-llama/Meta-Llama-3-8B). The sequence length is derived from the data
#: (``act_output_floats`` of block 1 divided by ``h``).
SAILOR_HIDDEN_SIZE: dict[str, int] = {
    "OPT-350": 1024,
    "GPT-Neo-2.7": 2560,
    "OPT-30": 7168,
    "LLAMA-3-8": 4096,
}


def sailor_sequence_length(llm_info: dict[str, Any], model: str) -> int:
    """Tokens per sample ``s`` of a sailor model: block 1's output floats / hidden size.

    Raises:
        InputError: unknown model, or the sizes are not a whole number of tokens.
    """
    if model not in llm_info or model not in SAILOR_HIDDEN_SIZE:
        raise InputError("llm_info.json", model, f"expected one of {sorted(SAILOR_HIDDEN_SIZE)}")
    floats = int(llm_info[model]["1"]["1"]["act_output_floats"])
    h = SAILOR_HIDDEN_SIZE[model]
    if floats % h:
        raise InputError("llm_info.json", f"{model}.1.1.act_output_floats", f"a multiple of {h}")
    return floats // h


def sailor_model_profile(
    llm_info: dict[str, Any], model: str, name: str | None = None
) -> ModelProfile:
    """docs/model.md §7 profile of a sailor model (tensor-parallel degree 1), one sample = one
    sequence.

    Per layer ``l`` with ``P_l`` = ``params_floats``: embedding (layer 0) ``f = 0`` (a lookup;
    ``FlopCounterMode`` also counts 0); transformer blocks (same ``P`` as layer 1)
    ``f = 2 P s + 4 s^2 h``; other layers (final norm / head) ``f = 2 P s``. ``w = 2 f``.
    ``activation_bytes`` = ``act_output_bytes``, ``activation_memory_bytes`` = ``act_mem_bytes``,
    ``param_bytes`` = ``params_bytes`` (fp32, 4 bytes per float, as sailor stores them).

    Args:
        llm_info: parsed ``sailor/llm_info.json``.
        model: ``"OPT-350"``, ``"GPT-Neo-2.7"``, ``"OPT-30"`` or ``"LLAMA-3-8"``.
    """
    s = sailor_sequence_length(llm_info, model)
    h = SAILOR_HIDDEN_SIZE[model]
    info = llm_info[model]["1"]
    n = len(info)
    block_params = float(info["1"]["params_floats"])
    layers = []
    for i in range(n):
        li = info[str(i)]
        p = float(li["params_floats"])
        if i == 0:
            kind, f = "embedding", 0.0
        elif p == block_params:
            kind, f = f"block{i}", 2.0 * p * s + 4.0 * s * s * h
        else:
            kind, f = ("head" if i == n - 1 else f"final{i}"), 2.0 * p * s
        layers.append(
            LayerProfile(
                name=kind,
                fwd_flops=f,
                bwd_flops=2.0 * f,
                activation_bytes=float(li["act_output_bytes"]),
                activation_memory_bytes=float(li["act_mem_bytes"]),
                param_bytes=float(li["params_bytes"]),
            )
        )
    return ModelProfile(name=name or f"{model} (sailor, seq {s})", layers=layers)


def sailor_layer_times(
    profile_json: dict[str, Any], micro_batch: int, tp: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Measured per-layer ``(fwd_s, bwd_s)`` arrays, shape ``(L,)``, seconds per micro-batch,
    from a parsed sailor ``profile.json`` (update time left out: the optimizer step is not in
    docs/model.md §3's per-micro-batch model).

    Raises:
        KeyError: that micro-batch size / TP degree was not profiled.
    """
    layers = profile_json[str(micro_batch)][str(tp)]
    n = len(layers)
    fwd = np.array([float(layers[str(i)][0]) for i in range(n)])
    bwd = np.array([float(layers[str(i)][1]) for i in range(n)])
    return fwd, bwd


def sailor_measured_times(
    profile_json: dict[str, Any],
    num_layers: int,
    tp: int = 1,
    exclude_microbatch_sizes: tuple[int, ...] = (),
) -> dict[str, Any] | None:
    """The docs/model.md §7 ``measured_times`` entry of one GPU kind from a parsed sailor
    ``profile.json``: every micro-batch size profiled at tensor-parallel degree ``tp`` for all
    ``num_layers`` layers (sizes in ``exclude_microbatch_sizes`` left out), with the per-layer
    forward and backward seconds per micro-batch (:func:`sailor_layer_times`). None when no
    size qualifies (e.g. the GPU was profiled only with tensor parallelism, or for another
    layer count)."""
    sizes, fwd, bwd = [], [], []
    for mb in sorted(profile_json, key=int):
        if int(mb) in exclude_microbatch_sizes:
            continue
        layers = profile_json[mb].get(str(tp))
        if layers is None or len(layers) != num_layers:
            continue
        f, b = sailor_layer_times(profile_json, int(mb), tp)
        sizes.append(int(mb))
        fwd.append([float(x) for x in f])
        bwd.append([float(x) for x in b])
    if not sizes:
        return None
    return {"microbatch_sizes": sizes, "fwd_s": fwd, "bwd_s": bwd}


def sailor_profile_with_measured_times(
    data_dir: str | Path, model: str, kinds: tuple[str, ...] | None = None
) -> ModelProfile:
    """:func:`sailor_model_profile` of ``model`` with the ``measured_times`` of every GPU kind
    in ``<data_dir>/sailor/profiles/<model>/`` (or only ``kinds``) that
    :func:`sailor_measured_times` accepts, keyed by the sailor GPU name (``A100-40``,
    ``V100-16``, ...): a cluster names its devices ``A100-40-0``, ... (docs/model.md §7 kinds).

    Raises:
        InputError: unreadable files or an unknown model.
    """
    root = Path(data_dir) / "sailor"
    prof = sailor_model_profile(load_json(root / "llm_info.json"), model)
    measured = {}
    folder = root / "profiles" / model
    names = kinds if kinds is not None else sorted(p.name for p in folder.iterdir() if p.is_dir())
    for kind in names:
        table = sailor_measured_times(load_json(folder / kind / "profile.json"), prof.num_layers)
        if table is not None:
            measured[kind] = table
    return ModelProfile.model_validate({**prof.to_json_dict(), "measured_times": measured})


def load_json(path: str | Path) -> Any:
    """Read a JSON file (``InputError`` if missing or invalid)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(str(path), "", "file not found")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InputError(str(path), "", f"expected valid JSON ({exc})") from None


# ---------------------------------------------------------------------------------------------
# pipedream
# ---------------------------------------------------------------------------------------------

_NODE_RE = re.compile(
    r"^(node\d+) -- (.*) -- forward_compute_time=([0-9.eE+-]+), "
    r"backward_compute_time=([0-9.eE+-]+), activation_size=([0-9.eE+-]+), "
    r"parameter_size=([0-9.eE+-]+)\s*$"
)
_EDGE_RE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")
#: Tensors of at most this many bytes per minibatch (``Size`` results) are ignored when
#: deciding whether a cut between two operators is clean.
_TRIVIAL_BYTES = 64.0


@dataclass(frozen=True)
class PipedreamOp:
    """One operator of a pipedream graph: times in ms per minibatch, bytes per minibatch."""

    node: str
    desc: str
    fwd_ms: float
    bwd_ms: float
    activation_bytes: float
    param_bytes: float

    @property
    def kind(self) -> str:
        return self.desc.split("(")[0].split(" ")[0]


@dataclass(frozen=True)
class PipedreamChain:
    """A pipedream graph made a chain: the docs/model.md §7 profile (per sample) and, per layer, the
    published forward/backward milliseconds of the whole minibatch (``batch_size`` samples)."""

    profile: ModelProfile
    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    batch_size: int
    ops_per_layer: tuple[int, ...]


def parse_pipedream_graph(path: str | Path) -> tuple[list[PipedreamOp], list[tuple[str, str]]]:
    """Parse a pipedream ``graph.txt`` into operators and edges ``(src, dst)``.

    Raises:
        InputError: missing file or a line that is neither a node nor an edge.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(str(path), "", "file not found")
    ops, edges = [], []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        m = _NODE_RE.match(line)
        if m:
            node, desc, f, b, a, prm = m.groups()
            ops.append(PipedreamOp(node, desc, float(f), float(b), float(a), float(prm)))
            continue
        m = _EDGE_RE.match(line)
        if m:
            edges.append((m.group(1), m.group(2)))
            continue
        raise InputError(str(path), f"line {lineno}", "expected a node line or an edge line")
    return ops, edges


def _ints(desc: str, key: str) -> tuple[int, ...] | None:
    m = re.search(key + r"=\(([0-9, ]+)\)", desc) or re.search(key + r"=([0-9]+)", desc)
    if not m:
        return None
    return tuple(int(x) for x in m.group(1).replace(" ", "").split(",") if x)


def pipedream_op_flops(op: PipedreamOp, batch_size: int) -> tuple[float, float]:
    """Forward and backward FLOPs per sample of one pipedream operator.

    ``Conv2d(cin, cout, k, groups=g)``: ``2 · out_elems · cin/g · kh · kw``; ``Linear(i, o)``:
    ``2 i o``; backward ``2x`` forward for both (input and weight gradients). Element-wise and
    pooling ops get nominal counts (``BatchNorm2d`` 4, ``ReLU``/``Add``/``Dropout`` 1 per output
    element, pools ``k^2`` per output element) with backward = forward; shape-only ops 0.
    ``out_elems`` = ``activation_size / 4 / batch_size`` (fp32 outputs). LSTMs and other
    composite ops are not modelled (``ValueError``).
    """
    out_elems = op.activation_bytes / 4.0 / batch_size
    kind = op.kind
    if kind == "Conv2d":
        m = re.match(r"Conv2d\((\d+), (\d+)", op.desc)
        if m is None:
            raise ValueError(f"cannot parse {op.desc!r}")
        cin = int(m.group(1))
        kh, kw = _ints(op.desc, "kernel_size") or (1, 1)
        groups = (_ints(op.desc, "groups") or (1,))[0]
        f = 2.0 * out_elems * (cin / groups) * kh * kw
        return f, 2.0 * f
    if kind == "Linear":
        i = _ints(op.desc, "in_features")
        o = _ints(op.desc, "out_features")
        if i is None or o is None:
            raise ValueError(f"cannot parse {op.desc!r}")
        f = 2.0 * i[0] * o[0]
        return f, 2.0 * f
    per_elem = {"BatchNorm2d": 4.0, "ReLU": 1.0, "Add": 1.0, "Dropout": 1.0, "Concat": 0.0}
    if kind in per_elem:
        f = per_elem[kind] * out_elems
        return f, f
    if kind in ("MaxPool2d", "AvgPool2d"):
        k = _ints(op.desc, "kernel_size") or (1,)
        f = out_elems * (k[0] * (k[1] if len(k) > 1 else k[0]))
        return f, f
    if kind in ("View", "Size", "__getitem__", "Flatten"):
        return 0.0, 0.0
    raise ValueError(f"pipedream operator {kind!r} is not modelled")


def pipedream_chain(
    path: str | Path,
    *,
    name: str | None = None,
    input_bytes_per_sample: float = 3 * 224 * 224 * 4,
) -> PipedreamChain:
    """Turn a pipedream CNN graph into a chain of layers (docs/model.md §7 profile, per sample).

    Operators are put in topological order (ties by node number); the ``Input`` node is the
    data and is dropped. A layer boundary is placed after operator ``i`` only when the single
    non-trivial tensor crossing from ``≤ i`` to ``> i`` is ``i``'s own output, so residual
    blocks become one layer each. Per layer: FLOPs are the sums of :func:`pipedream_op_flops`;
    ``activation_bytes`` is the boundary tensor per sample; ``activation_memory_bytes`` the
    sum of all its operators' outputs per sample (every intermediate is kept for backward);
    ``param_bytes`` the sum of parameter bytes.

    Args:
        path: a ``<model>_graph.txt``.
        input_bytes_per_sample: bytes of one input sample (fp32 3×224×224 by default); the
            minibatch size is the Input node's activation bytes divided by it.

    Raises:
        InputError: unreadable graph, no Input node, or a minibatch size that is not whole.
        ValueError: an operator kind that is not modelled (e.g. the GNMT LSTMs).
    """
    ops, edges = parse_pipedream_graph(path)
    by_id = {op.node: op for op in ops}
    inputs = [op for op in ops if op.kind.startswith("Input")]
    if len(inputs) != 1:
        raise InputError(str(path), "Input", "exactly one Input node (CNN graphs only)")
    batch_f = inputs[0].activation_bytes / input_bytes_per_sample
    batch = round(batch_f)
    if batch < 1 or abs(batch_f - batch) > 1e-9:
        raise InputError(str(path), "Input.activation_size", "a whole number of input samples")
    succ: dict[str, list[str]] = {op.node: [] for op in ops}
    indeg = {op.node: 0 for op in ops}
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    num = lambda node: int(node[4:])  # noqa: E731
    ready = sorted((n for n, d in indeg.items() if d == 0), key=num)
    order: list[str] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
        ready.sort(key=num)
    if len(order) != len(ops):
        raise InputError(str(path), "edges", "an acyclic graph")
    order = [n for n in order if n != inputs[0].node]
    pos = {n: i for i, n in enumerate(order)}
    last_use = {n: max((pos.get(m, -1) for m in succ[n]), default=-1) for n in order}

    layers: list[LayerProfile] = []
    fwd_ms, bwd_ms, counts = [], [], []
    seg: list[PipedreamOp] = []
    for i, n in enumerate(order):
        seg.append(by_id[n])
        crossing = [
            m
            for m in order[: i + 1]
            if last_use[m] > i and by_id[m].activation_bytes > _TRIVIAL_BYTES
        ]
        end = i == len(order) - 1
        clean = crossing == [n] and by_id[n].activation_bytes > _TRIVIAL_BYTES
        if not (clean or end):
            continue
        flops = [pipedream_op_flops(op, batch) for op in seg]
        kinds = [op.kind for op in seg]
        label = kinds[0] if len(kinds) == 1 else f"{kinds[0]}+{len(kinds) - 1}"
        layers.append(
            LayerProfile(
                name=f"{len(layers)}:{label}",
                fwd_flops=sum(f for f, _ in flops),
                bwd_flops=sum(b for _, b in flops),
                activation_bytes=by_id[n].activation_bytes / batch,
                activation_memory_bytes=sum(op.activation_bytes for op in seg) / batch,
                param_bytes=sum(op.param_bytes for op in seg),
            )
        )
        fwd_ms.append(sum(op.fwd_ms for op in seg))
        bwd_ms.append(sum(op.bwd_ms for op in seg))
        counts.append(len(seg))
        seg = []
    stem = Path(path).name.replace("_graph.txt", "")
    return PipedreamChain(
        profile=ModelProfile(name=name or f"{stem} (pipedream, minibatch {batch})", layers=layers),
        fwd_ms=np.array(fwd_ms),
        bwd_ms=np.array(bwd_ms),
        batch_size=batch,
        ops_per_layer=tuple(counts),
    )


def pipedream_profile_with_measured_times(chain: PipedreamChain, kind: str) -> ModelProfile:
    """``chain.profile`` with the published per-layer times as docs/model.md §7
    ``measured_times`` of device kind ``kind`` at one micro-batch size (the minibatch the
    graph was profiled with, ``chain.batch_size``): forward and backward seconds per layer.
    pipedream does not record the GPU, so the caller names the kind (docs/model.md §3: with
    one measured size, times scale in proportion to the micro-batch size)."""
    table = {
        "microbatch_sizes": [int(chain.batch_size)],
        "fwd_s": [[float(x) / 1e3 for x in chain.fwd_ms]],
        "bwd_s": [[float(x) / 1e3 for x in chain.bwd_ms]],
    }
    return ModelProfile.model_validate(
        {**chain.profile.to_json_dict(), "measured_times": {kind: table}}
    )


def total_train_flops(profile: ModelProfile) -> float:
    """``Σ_l (f_l + w_l)`` per sample (FLOP)."""
    return float(math.fsum(ly.fwd_flops + (ly.bwd_flops or 0.0) for ly in profile.layers))
