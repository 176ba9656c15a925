"""Body of ``hetrain profile``: a docs/model.md §7 model profile of an example model and, with
``--measure``, this device's fitted speed and κ and the local link, as a cluster file."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetrain._io import check_output_path
from hetrain._text import plural
from hetrain.errors import InputError

MAX_PROFILE_BATCH = 4096
"""Most samples ``hetrain profile`` runs at once (``--batch``, ``--microbatch-sizes``): the
profile is per sample, and real inputs of that many samples are allocated."""


def parse_microbatch_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``.

    Raises:
        InputError: not at least 2 distinct integers in ``[1, MAX_PROFILE_BATCH]``.
    """
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise InputError(
            "--microbatch-sizes", "", f"expected integers like 1,2,4,8, got {text!r}"
        ) from None
    if len(sizes) < 2 or sizes[0] < 1 or sizes[-1] > MAX_PROFILE_BATCH:
        raise InputError(
            "--microbatch-sizes",
            "",
            f"expected at least 2 distinct integers between 1 and {MAX_PROFILE_BATCH}, "
            f"got {text!r}",
        )
    return sizes


def run_profile(
    *,
    example: str,
    out: Path | None,
    batch: int = 8,
    measure: bool = False,
    device: str = "auto",
    cluster_out: Path | None = None,
    workers: int = 4,
    microbatch_sizes: str | None = None,
    repeats: int | None = None,
    warmup: int | None = None,
    threads: int = 1,
    link: bool = True,
    seed: int = 0,
    size: str = "tiny",
    model: str | None = None,
) -> int:
    """Profile example ``example`` and write/print the profile; returns the exit status.

    Without ``--measure``: FLOPs and bytes per layer (:func:`hetrain.profiler.profile_chain`)
    on ``batch`` samples, on ``device`` (``cpu``, ``meta``, or ``auto`` = ``meta`` for the
    large published-config models, ``cpu`` otherwise). With ``--measure`` additionally: layer
    times for each micro-batch size on this CPU with ``threads`` threads (what one local rank
    gets), the least-squares fit of speed and κ, a ping-pong between two local gloo ranks
    (unless ``link`` is off), and a cluster file of ``workers`` identical devices ``w0..``
    on one node (``cluster_out``, default next to ``out``), plus ``<out>.measure.json`` with
    every median time and fit.

    Raises:
        InputError: unknown example, ``batch`` not in ``[1, MAX_PROFILE_BATCH]``, bad device
            or micro-batch sizes, ``workers``, ``repeats`` or ``threads`` < 1, ``warmup`` < 0,
            ``--out``/``--cluster-out`` not writable as a file, or ``--measure`` without
            ``--out``.
    """
    import torch

    from hetrain.models.registry import EXAMPLES
    from hetrain.profiler import profile_chain

    if model is not None or example in HF_EXAMPLES:
        if measure:
            raise InputError(
                "--measure", "", "timing is available for the chain examples (charlm, digits)"
            )
        if out is not None:
            check_output_path("--out", out)
        return _profile_module(example, model, size, batch, out, seed)
    if example not in EXAMPLES:
        raise InputError(
            "--example",
            "",
            f"expected one of {', '.join(sorted([*EXAMPLES, *HF_EXAMPLES]))}, got {example!r}",
        )
    # --measure defaults: the large published shapes get a light setting (about 1-2 minutes on
    # one CPU thread); heavier settings are opt-in through the options
    large = EXAMPLES[example].large
    microbatch_sizes = microbatch_sizes or ("1,2" if large else "1,2,4,8")
    repeats = repeats if repeats is not None else (2 if large else 5)
    warmup = warmup if warmup is not None else (0 if large else 2)
    if batch < 1:
        raise InputError("--batch", "", f"expected an integer >= 1, got {batch}")
    if device not in ("auto", "cpu", "meta"):
        raise InputError("--device", "", f"expected auto, cpu or meta, got {device!r}")
    if batch > MAX_PROFILE_BATCH:
        raise InputError(
            "--batch",
            "",
            f"expected at most {MAX_PROFILE_BATCH} samples (per-sample figures; a few suffice), "
            f"got {batch}",
        )
    for option, value, least in (
        ("--workers", workers, 1),
        ("--repeats", repeats, 1),
        ("--warmup", warmup, 0),
        ("--threads", threads, 1),
    ):
        if value < least:
            raise InputError(option, "", f"expected an integer >= {least}, got {value}")
    if measure and out is None:
        raise InputError("--out", "", "required with --measure (the cluster file goes next to it)")
    if out is not None:
        check_output_path("--out", out)
    if measure and cluster_out is not None:
        check_output_path("--cluster-out", cluster_out)
    sizes = parse_microbatch_sizes(microbatch_sizes) if measure else ()
    ex = EXAMPLES[example]
    count_device = device if device != "auto" else ("meta" if ex.large else "cpu")
    torch.manual_seed(seed)
    with torch.device(count_device):
        model = ex.build()
    model.train()
    gen = torch.Generator().manual_seed(seed)
    inputs = ex.make_input(batch, gen, device=count_device)
    profile = profile_chain(model, inputs, name=f"{example} ({ex.description}; {count_device})")
    if not _write_profile(profile, out):
        return 0
    print(
        f"wrote {out}: {plural(profile.num_layers, 'layer')}, "
        f"{sum(ly.fwd_flops for ly in profile.layers) / 1e9:.4g} GFLOP forward per sample, "
        f"{sum(ly.param_bytes for ly in profile.layers) / 2**20:.4g} MiB parameters"
    )
    if not measure:
        return 0
    return _measure(
        ex, profile, out, cluster_out, workers, sizes, repeats, warmup, threads, link, seed
    )


HF_EXAMPLES = ("gpt2", "bert", "resnet")


def hf_example(example: str, size: str, batch: int, seed: int = 0):
    """``(model, inputs, description)`` of a Hugging Face example of ``size``: GPT-2 / BERT on
    token windows (1024 / 512 tokens for ``base``, 64 otherwise), ResNet on images (224x224 RGB
    for ``base``, 32x32 grey otherwise); random weights and inputs from ``seed``."""
    import torch

    from hetrain.models import hf

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    base = size == "base"
    if example == "gpt2":
        model = hf.gpt2_model(size, dropout=0.1)
        seq, vocab = (1024, 50257) if base else (64, hf.BYTE_VOCAB)
        inputs = torch.randint(0, vocab, (batch, seq), generator=gen)
        what = "Hugging Face GPT2LMHeadModel" + (" (GPT-2 small)" if base else f" ({size})")
    elif example == "bert":
        model = hf.bert_model(size, dropout=0.1)
        seq, vocab = (512, 30522) if base else (64, hf.BYTE_VOCAB + 1)
        inputs = torch.randint(1, vocab, (batch, seq), generator=gen)
        what = "Hugging Face BertForMaskedLM" + (" (BERT-base)" if base else f" ({size})")
    else:
        model = hf.resnet_model(size)
        shape = (3, 224, 224) if base else (1, 32, 32)
        inputs = torch.randn((batch, *shape), generator=gen)
        what = "Hugging Face ResNetForImageClassification" + (" (ResNet-50)" if base else "")
    model.train()
    return model, inputs, f"{what}, cut at its blocks"


def _profile_module(example, model_spec, size, batch, out, seed) -> int:
    """Profile a Hugging Face example or a ``--model`` factory's module on the CPU (cut into
    layers as in training, runtime/cutting.py)."""
    import numpy as np
    import torch

    from hetrain.models.hf import _size
    from hetrain.profiler import profile_chain

    if model_spec is not None:
        from hetrain.runtime.api import task_from_factory
        from hetrain.runtime.data import task_chain

        task = task_from_factory(model_spec)
        torch.manual_seed(seed)
        module = task.build_model()
        inputs, _ = task.train.batch(np.arange(min(batch, len(task.train))))
        chain = task_chain(task, module, verify=True)
        name, label = model_spec, model_spec
    else:
        module, inputs, what = hf_example(example, _size(size), batch, seed)
        from hetrain.runtime.cutting import cut_module

        chain = cut_module(module, inputs[:1], source=f"--example {example}")
        name, label = f"{example}-{size}", f"{example} {size} ({what}; cpu)"
    profile = profile_chain(chain, inputs, name=label)
    if not _write_profile(profile, out):
        return 0
    shared = sum(t.bytes for t in profile.shared)
    print(
        f"wrote {out}: {name}: {profile.num_layers} layers, "
        f"{sum(ly.fwd_flops for ly in profile.layers) / 1e9:.4g} GFLOP forward per sample, "
        f"{(sum(ly.param_bytes for ly in profile.layers) + shared) / 2**20:.4g} MiB parameters "
        f"({shared / 2**20:.4g} MiB shared by {len(profile.shared)} tied tensor(s))"
    )
    return 0


def _write_profile(profile, out: Path | None) -> bool:
    """Write ``profile`` as JSON to ``out`` (folders created), or print it when ``out`` is
    None. Returns whether it was written to a file (the caller then prints a summary)."""
    text = json.dumps(profile.to_json_dict(), indent=1)
    if out is None:
        print(text)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")
    return True


def _measure(
    ex,
    profile,
    out: Path,
    cluster_out,
    workers,
    sizes: Sequence[int],
    repeats,
    warmup,
    threads,
    link,
    seed,
) -> int:
    import torch
    import yaml

    from hetrain.cluster import cluster_from_dict
    from hetrain.profiler import fit_device, fit_stages, measure_p2p, time_layers, time_stages
    from hetrain.profiler.timing import default_stage_lengths

    load_before = os.getloadavg()[0]
    torch.manual_seed(seed)
    model = ex.build()
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    num_layers = len(list(model))
    with Progress(
        TextColumn("[bold]timing layers"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} passes"),
        TimeRemainingColumn(),
        transient=False,
    ) as bar:
        task_id = bar.add_task("timing", total=(warmup + repeats) * len(sizes))
        times = time_layers(
            model,
            lambda n: ex.make_input(n, gen),
            sizes,
            warmup=warmup,
            repeats=repeats,
            threads=threads,
            progress=lambda done, total: bar.update(task_id, completed=done, total=total),
        )
    # chains of 2, L/2 and L layers (the one-layer stages are time_layers' own): λ vs κ
    stage_times = None
    if num_layers > 1:
        print("timing stages of 2, L/2 and L layers (λ vs κ) ...", file=sys.stderr)
        stage_times = time_stages(
            model,
            lambda n: ex.make_input(n, gen),
            sizes,
            [n for n in default_stage_lengths(num_layers) if n > 1],
            warmup=warmup,
            repeats=repeats,
            threads=threads,
        )
    try:
        fit = fit_device(profile, times)
        stage_fit = fit_stages(profile, stage_times, times) if stage_times is not None else None
    except ValueError as exc:  # e.g. timings too noisy on a busy machine
        print(
            f"hetrain: measurement failed: {exc} (try more --repeats or wider --microbatch-sizes)",
            file=sys.stderr,
        )
        return 1
    link_fit = measure_p2p() if link else None
    mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nic_gbps = link_fit.bandwidth_bytes_per_s * 8 / 1e9 if link_fit else 10.0
    lat_us = link_fit.latency_s * 1e6 if link_fit else 20.0
    # docs/model.md (v3): speed, κ and λ from stages of 1, 2, L/2 and L layers (a one-layer chain:
    # the
    # chain fit, λ = 0)
    device_fit = stage_fit if stage_fit is not None else fit.chain
    lam_s = stage_fit.layer_overhead_s if stage_fit is not None else 0.0
    cluster: dict[str, Any] = {
        "links": {"intra_node_gbps": round(nic_gbps, 4), "latency_us": round(lat_us, 3)},
        "devices": [
            {
                "id": f"w{r}",
                "node": "local",
                "tflops": round(device_fit.speed_flops / 1e12, 6),
                "memory_gib": round(mem_bytes / workers / 2**30, 3),
                "nic_gbps": round(nic_gbps, 4),
                "microbatch_overhead_ms": round(device_fit.kappa_s * 1e3, 4),
                "layer_overhead_ms": round(lam_s * 1e3, 4),
            }
            for r in range(workers)
        ],
    }
    cluster_from_dict(cluster, "<measured cluster>")  # validate before writing
    cpath = cluster_out or out.with_name(out.stem + ".cluster.yaml")
    cpath.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# measured by `hetrain profile --example {ex.name} --measure` on {platform.node()}\n"
        f"# ({platform.processor() or platform.machine()}, {times.threads} thread(s) per rank);"
        f" speed/kappa/lambda fit rms rel error {device_fit.rms_rel_error:.3f}\n"
    )
    cpath.write_text(header + yaml.safe_dump(cluster, sort_keys=False), encoding="utf-8")
    details = {
        "example": ex.name,
        "threads": times.threads,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        "microbatch_sizes": list(times.microbatch_sizes),
        "layer_names": [ly.name for ly in profile.layers],
        "fwd_s": times.fwd_s.tolist(),
        "bwd_s": times.bwd_s.tolist(),
        "chain_fit": _fit_dict(fit.chain),
        "stage_fit": None
        if stage_fit is None
        else {**_fit_dict(stage_fit), "layer_overhead_s": stage_fit.layer_overhead_s},
        "stages": None if stage_times is None else [list(st) for st in stage_times.stages],
        "stage_train_s": None if stage_times is None else stage_times.train_s.tolist(),
        "per_layer_fit": _fit_dict(fit.per_layer),
        "layer_speed_flops_at_largest_microbatch": list(fit.layer_speed_flops),
        "link": None
        if link_fit is None
        else {
            "bandwidth_bytes_per_s": link_fit.bandwidth_bytes_per_s,
            "latency_s": link_fit.latency_s,
            "rms_rel_error": link_fit.rms_rel_error,
            "sizes_bytes": list(link_fit.sizes_bytes),
            "one_way_s": list(link_fit.one_way_s),
        },
    }
    mpath = out.with_name(out.stem + ".measure.json")
    mpath.write_text(json.dumps(details, indent=1) + "\n", encoding="utf-8")
    print(
        f"speed {device_fit.speed_flops / 1e9:.4g} GFLOP/s, kappa {device_fit.kappa_s * 1e3:.3g}"
        f" ms per micro-batch and stage, lambda {lam_s * 1e3:.3g} ms per layer (fit rms rel "
        f"error {device_fit.rms_rel_error:.3f}, max {device_fit.max_abs_rel_error:.3f}; whole-"
        f"chain fit: {fit.chain.speed_flops / 1e9:.4g} GFLOP/s, kappa "
        f"{fit.chain.kappa_s * 1e3:.3g} ms; one-layer fit: {fit.per_layer.speed_flops / 1e9:.4g}"
        f" GFLOP/s, kappa {fit.per_layer.kappa_s * 1e3:.3g} ms,"
        f" rms {fit.per_layer.rms_rel_error:.3f})"
    )
    if link_fit:
        print(
            f"link: {link_fit.bandwidth_bytes_per_s / 1e9:.4g} GB/s, latency "
            f"{link_fit.latency_s * 1e6:.4g} us (fit rms {link_fit.rms_rel_error:.3f})"
        )
    print(f"wrote {cpath} and {mpath}")
    return 0


def _fit_dict(fit) -> dict[str, float]:
    return {
        "speed_flops": fit.speed_flops,
        "kappa_s": fit.kappa_s,
        "rms_rel_error": fit.rms_rel_error,
        "max_abs_rel_error": fit.max_abs_rel_error,
    }
