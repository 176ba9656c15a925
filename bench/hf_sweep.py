"""Which Hugging Face language models hetrain trains exactly: every causal-LM and masked-LM
type the installed ``transformers`` registers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES``), each built tiny from its own config class (random
weights, no download).

Per type, in order (the first failure is the type's one-line reason):

1. ``build``: the type's config class with its defaults, shrunk (hidden 32, 2 layers, 4 heads,
   2 key/value heads, feed-forward 64, vocabulary 128, 4 experts top-2, every dropout 0,
   ``use_cache=False``), then ``AutoModelFor{CausalLM,MaskedLM}.from_config``;
2. ``plain``: a plain PyTorch loop (float64, no hetrain code) trains it: 2 SGD steps on 6
   random sequences of 8 tokens, cross-entropy of the logits against random targets, finite
   losses and gradients;
3. ``cut``: hetrain cuts it at its default blocks and runs every layer as its own stage
   (``ModuleCut.verify``, what ``hetrain train`` does at start-up);
4. ``pipeline-2`` and ``hybrid``: 3 forked gloo ranks train it with hetrain's engine, a 2-stage
   pipeline (2 ranks, micro-batches of 2) and a hybrid (a 2-stage group of 4 samples and a
   1-rank group of 2), and the losses and final weights equal the plain loop at ``rtol 1e-9,
   atol 1e-12``. A model that computes in float32 internally whatever its dtype (detected by
   float32 results of ATen ops during the float64 forward) and fails that is compared again at
   ``rtol 1e-5, atol 1e-7`` and is marked ``float32-internal``.

Writes one JSON line per type to ``--out`` (default ``bench/results/hf_sweep.jsonl``) as it
goes (a rerun skips the types already there) and prints the summary: of the types that train in
plain PyTorch, the share that train exactly on a 2-stage pipeline and on a hybrid (target
>= 90 %), and every other type with its reason.

Usage: ``.venv/bin/python bench/hf_sweep.py [--out FILE] [--types a,b] [--limit N]
[--timeout-s 120] [--memory-gib 6] [--summary-only]``; each type runs in a child process
capped at ``--memory-gib`` of address space (a default config too big to build is a reason,
not an out-of-memory kill of the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

TARGET = 0.90
VOCAB = 128
BATCH = 6
SEQ = 8
STEPS = 2
LR = 0.1

_SIZES = {
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed", "embedding_size"): 32,
    (
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
        "encoder_layers",
        "decoder_layers",
        "num_decoder_layers",
    ): 2,
    (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
    ): 4,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads"): 2,
    ("head_dim", "d_kv", "kv_channels"): 8,
    (
        "intermediate_size",
        "ffn_dim",
        "n_inner",
        "d_ff",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "ffn_hidden_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "hidden_dim",
    ): 64,
    ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_k", "top_k"): 2,
    ("vocab_size",): VOCAB,
}


def tiny_config(model_type: str) -> Any:
    """The type's config class with its defaults, shrunk (module docstring)."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    for names, value in _SIZES.items():
        for name in names:
            if isinstance(getattr(cfg, name, None), int) and not isinstance(
                getattr(cfg, name), bool
            ):
                with contextlib.suppress(Exception):  # a computed attribute
                    setattr(cfg, name, value)
    for name, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(cfg, name, 0.0)
        if name.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(cfg, name, 2)
    for name in ("use_cache",):
        if hasattr(cfg, name):
            cfg.use_cache = False
    with contextlib.suppress(Exception):  # torch's grouped mm has no float64 CPU kernel
        cfg._experts_implementation = "eager"
    return cfg


def build(model_type: str, task: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForCausalLM if task == "causal" else AutoModelForMaskedLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(tiny_config(model_type))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (STEPS * BATCH, SEQ), generator=g)
    return ids, torch.randint(4, 100, (STEPS * BATCH, SEQ), generator=g)


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, -target.shape[1] :]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _Float32Ops(TorchDispatchMode):
    """Counts ATen ops that return float32 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.count += 1
        return out


def plain_loop(model_type: str, task: str) -> tuple[list[float], dict, bool]:
    """Reference without hetrain code; returns losses, final state and whether the float64
    forward computes in float32 anywhere."""
    torch.manual_seed(0)
    model = build(model_type, task).to(torch.float64)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids, target = data()
    losses = []
    float32 = False
    for t in range(STEPS):
        rows = slice(t * BATCH, (t + 1) * BATCH)
        opt.zero_grad(set_to_none=True)
        with _Float32Ops() as ops:
            loss = loss_fn(model(ids[rows]), target[rows])
        float32 |= ops.count > 0
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not math.isfinite(loss.item()) or not grads:
            raise RuntimeError("loss not finite or no gradient")
        if not all(torch.isfinite(g).all() for g in grads):
            raise RuntimeError("gradient not finite")
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, float32


def _plans(layers: int) -> dict[str, dict]:
    k = layers // 2

    def g(devices: list[str], stages: list[list[int]], mb: int, batch: int) -> dict:
        return {"devices": devices, "stages": stages, "microbatch_size": mb, "batch": batch}

    return {
        "pipeline-2": {"groups": [g(["w0", "w1"], [[0, k], [k, layers]], 2, BATCH)]},
        "hybrid": {
            "schedule": "gpipe",
            "groups": [
                g(["w0", "w1"], [[0, k], [k, layers]], 2, 4),
                g(["w2"], [[0, layers]], 1, 2),
            ],
        },
    }


def _ranks(rank: int, world: int, model_type: str, task: str, plans: dict[str, dict]) -> dict:
    from hetrain.plan import plan_from_dict
    from hetrain.runtime import OptimizerSpec, Worker
    from hetrain.runtime.cutting import cut_module

    ids, target = data()
    out = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        model = build(model_type, task)
        chain = cut_module(model, ids[:2])
        worker = Worker(
            chain,
            plan_from_dict(plan),
            f"w{rank}",
            loss_fn,
            OptimizerSpec("sgd", lr=LR),
            dtype=torch.float64,
            allow_unused_ranks=True,
        )
        losses = []
        for t in range(STEPS):
            rows = slice(t * BATCH, (t + 1) * BATCH)
            losses.append(worker.step(ids[rows], target[rows], t).loss)
        state = worker.full_state_dict()
        out[name] = (losses, state if rank == 0 else None)
    return out


def _equal(got: tuple[list[float], dict], ref: tuple[list[float], dict], rtol: float, atol: float):
    try:
        torch.testing.assert_close(got[0], ref[0], rtol=rtol, atol=atol)
        for key, value in ref[1].items():
            torch.testing.assert_close(got[1][key].to(value.dtype), value, rtol=rtol, atol=atol)
    except (AssertionError, KeyError) as exc:
        return str(exc).strip().splitlines()[0][:160]
    return None


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def sweep_one(model_type: str, task: str, timeout_s: float) -> dict:
    """One type's record: ``{"type", "task", "stage", "reason", "float32_internal",
    "pipeline", "hybrid", "time_s"}`` (``stage``: the first step that failed, or "ok")."""
    from hetrain.runtime.cutting import cut_module
    from hetrain.runtime.testing import RankFailure, run_ranks

    t0 = time.perf_counter()
    rec: dict[str, Any] = {"type": model_type, "task": task, "float32_internal": False}

    def done(stage: str, reason: str | None = None) -> dict:
        rec.update(stage=stage, reason=reason, time_s=round(time.perf_counter() - t0, 1))
        return rec

    try:
        build(model_type, task)
    except Exception as exc:  # noqa: BLE001
        return done("build", _line(exc))
    try:
        ref_losses, ref_state, float32 = plain_loop(model_type, task)
    except Exception as exc:  # noqa: BLE001
        return done("plain", _line(exc))
    rec["float32_internal"] = float32
    ids, _ = data()
    try:
        torch.manual_seed(0)
        chain = cut_module(build(model_type, task), ids[:2])
        chain.verify(ids[:BATCH])
    except Exception as exc:  # noqa: BLE001
        return done("cut", _line(exc))
    plans = _plans(chain.num_layers)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_ranks(_ranks, 3, tmp, args=(model_type, task, plans), timeout_s=timeout_s)
    except RankFailure as exc:
        return done("run", str(exc).splitlines()[0][:240])
    ok = True
    for name in plans:
        diff = _equal(results[0][name], (ref_losses, ref_state), 1e-9, 1e-12)
        if diff is not None and float32:
            loose = _equal(results[0][name], (ref_losses, ref_state), 1e-5, 1e-7)
            rec[name] = "equal at float32 tolerance" if loose is None else f"differs: {loose}"
            ok &= loose is None
        else:
            rec[name] = "exact" if diff is None else f"differs: {diff}"
            ok &= diff is None
    return done("ok" if ok else "exact", None if ok else "not equal to the plain loop")


def _child(model_type: str, task: str, timeout_s: float, path: str, memory_bytes: int) -> None:
    import resource

    # a default config too big for a tiny model fails here, not by the machine's OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        rec = sweep_one(model_type, task, timeout_s)
    except BaseException as exc:  # noqa: BLE001 - MemoryError and the like: the reason
        rec = {"type": model_type, "task": task, "stage": "build", "reason": _line(exc)}
    Path(path).write_text(json.dumps(rec))


def sweep_isolated(model_type: str, task: str, timeout_s: float, memory_bytes: int) -> dict:
    """:func:`sweep_one` in a child process with an address-space limit and a time limit."""
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rec.json")
        proc = mp.get_context("fork").Process(
            target=_child, args=(model_type, task, timeout_s, path, memory_bytes)
        )
        t0 = time.perf_counter()
        proc.start()
        proc.join(3 * timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if Path(path).exists():
            return json.loads(Path(path).read_text())
        why = "timed out" if proc.exitcode in (None, -9) else f"exit code {proc.exitcode}"
        return {
            "type": model_type,
            "task": task,
            "stage": "build",
            "reason": f"the sweep's child process died ({why})",
            "time_s": round(time.perf_counter() - t0, 1),
        }


def summary(records: list[dict]) -> list[str]:
    plain = [r for r in records if r["stage"] not in ("build", "plain")]
    trained = [r for r in plain if r["stage"] == "ok"]
    pipe = sum(1 for r in plain if r.get("pipeline-2", "").startswith(("exact", "equal")))
    hyb = sum(1 for r in plain if r.get("hybrid", "").startswith(("exact", "equal")))
    f32 = [r for r in trained if r.get("pipeline-2", "").startswith("equal")]
    n = max(len(plain), 1)
    lines = [
        f"types swept: {len(records)} ({sum(r['task'] == 'causal' for r in records)} causal-LM, "
        f"{sum(r['task'] == 'masked' for r in records)} masked-LM)",
        f"build from a tiny config of their own class: "
        f"{sum(r['stage'] != 'build' for r in records)}",
        f"train in plain PyTorch (float64): {len(plain)}",
        f"of those, exactly on a 2-stage pipeline: {pipe} ({100 * pipe / n:.1f} %); on a hybrid: "
        f"{hyb} ({100 * hyb / n:.1f} %); both: {len(trained)} ({100 * len(trained) / n:.1f} %), "
        f"target >= {100 * TARGET:.0f} %: {'PASS' if len(trained) / n >= TARGET else 'FAIL'}",
        f"float32-internal, compared at rtol 1e-5: {len(f32)}"
        + (f" ({', '.join(r['type'] for r in f32)})" if f32 else ""),
        "every other type and its reason:",
    ]
    for r in records:
        if r["stage"] != "ok":
            reason = r["reason"]
            if r["stage"] == "exact":
                reason = f"pipeline-2: {r.get('pipeline-2')}; hybrid: {r.get('hybrid')}"
            lines.append(f"  {r['type']} ({r['task']}) [{r['stage']}]: {reason}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/hf_sweep.jsonl")
    parser.add_argument("--types", default=None, help="comma-separated model types")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--memory-gib", type=float, default=6.0, help="per-type memory cap")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.models.auto import modeling_auto as auto

    todo = [(t, "causal") for t in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES] + [
        (t, "masked") for t in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ]
    if args.types:
        wanted = set(args.types.split(","))
        todo = [x for x in todo if x[0] in wanted]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    seen = {(r["type"], r["task"]) for r in records}
    if not args.summary_only:
        todo = [x for x in todo if x not in seen][: args.limit]
        for model_type, task in todo:
            rec = sweep_isolated(model_type, task, args.timeout_s, int(args.memory_gib * 2**30))
            records.append(rec)
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(
                f"{model_type} ({task}): {rec['stage']} {rec.get('reason') or ''} "
                f"[{rec['time_s']} s]",
                flush=True,
            )
    for line in summary(records):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
