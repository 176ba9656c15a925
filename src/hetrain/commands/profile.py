"""Body of ``hetrain profile``: a docs/model.md §7 model profile of an example model and, with
``--measure``, this device's fitted speed and κ and the local link, as a cluster file."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetrain._io import check_output_path, check_seed
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


def parse_stage_lengths(text: str) -> tuple[int, ...]:
    """``"2,7,14"`` -> ``(2, 7, 14)`` (lengths of the timed stages besides one layer).

    Raises:
        InputError: not integers >= 1.
    """
    try:
        lengths = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        lengths = ()
    if not lengths or lengths[0] < 1:
        raise InputError("--stage-lengths", "", f"expected integers >= 1 like 2,7,14, got {text!r}")
    return lengths


#: ``--measure`` defaults (docs/profiling.md §2). Small models: 4 micro-batch sizes, 2 warm-up
#: and 5 timed rounds, stages of 1, 2, L/2 and L layers. The published shapes (GPT-2 small,
#: BERT-base, ResNet-50): sizes 1 and 2, no warm-up, 1 timed round, stages of 1 and L layers,
#: and the language models timed on windows of 128 tokens, so that GPT-2 small finishes in
#: about a minute on one CPU thread; every one of these is an option (heavier is opt-in).
LIGHT_MEASURE = {"microbatch_sizes": "1,2", "repeats": 1, "warmup": 0, "seq_len": 128}
FULL_MEASURE = {"microbatch_sizes": "1,2,4,8", "repeats": 5, "warmup": 2, "seq_len": None}


def _measure_path(out: Path) -> Path:
    """``<out>.measure.json``: every median time and fit of ``--measure``, next to ``out``."""
    return out.with_name(out.stem + ".measure.json")


MAX_TIMED_ROUNDS = 10_000
"""Most ``--repeats`` (and ``--warmup``) rounds accepted: medians settle after a few."""


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
    size: str | None = None,
    model: str | None = None,
    seq_len: int | None = None,
    stage_lengths: str | None = None,
    kind: str | None = None,
) -> int:
    """Profile example ``example`` and write/print the profile; returns the exit status.

    Without ``--measure``: FLOPs and bytes per layer (:func:`hetrain.profiler.profile_chain`)
    on ``batch`` samples, on ``device`` (``cpu``, ``meta``, or ``auto`` = ``meta`` for the
    large published-config models, ``cpu`` otherwise; a Hugging Face example on ``meta`` is
    built there and run on real inputs, :func:`hetrain.profiler.profile_on_meta`). With
    ``--measure`` additionally: layer times for each micro-batch size on this CPU with
    ``threads`` threads (what one local rank gets), times of stages of ``stage_lengths``
    layers, the least-squares fit of speed, κ and λ, a ping-pong between two local gloo ranks
    (unless ``link`` is off), and a cluster file of ``workers`` identical devices ``w0..``
    on one node (``cluster_out``, default next to ``out``), plus ``<out>.measure.json`` with
    every median time and fit. With ``--measure`` the profile also gets the measured
    per-layer times under device kind ``kind`` (default :func:`default_device_kind`;
    docs/model.md §3 "Measured times", §7) and the cluster file's devices that kind, so that
    plans made from the two files use the measured times; not when the timed input shape
    differs from the profiled one (``--seq-len``: the times are of other samples; said on
    stderr). Token inputs are timed on windows of ``seq_len`` tokens when
    given (the fit then uses the FLOPs of that shape). A progress bar (stderr) shows the
    remaining time; defaults :data:`LIGHT_MEASURE` for the published shapes,
    :data:`FULL_MEASURE` otherwise.

    Raises:
        InputError: unknown example, ``batch`` not in ``[1, MAX_PROFILE_BATCH]``, bad device
            or micro-batch sizes, ``workers``, ``repeats``, ``threads`` or ``seq_len`` < 1,
            ``warmup`` < 0, bad ``stage_lengths``, ``--out``/``--cluster-out`` not writable as
            a file, ``--measure`` without ``--out`` or with ``--model``.
    """
    from hetrain.models.registry import EXAMPLES

    if model is None and example not in EXAMPLES and example not in HF_EXAMPLES:
        raise InputError(
            "--example",
            "",
            f"expected one of {', '.join(sorted([*EXAMPLES, *HF_EXAMPLES]))}, got {example!r}",
        )
    if size is not None and (model is not None or example not in HF_EXAMPLES):
        # was silently ignored (hetrain train refuses it the same way)
        used = "--model" if model is not None else f"--example {example}"
        raise InputError(
            "--size", "", f"only used by --example {', '.join(HF_EXAMPLES)} (not with {used})"
        )
    size = size or "tiny"
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
    if model is None and example in HF_EXAMPLES:
        from hetrain.models.hf import _size

        large = _size(size) == "base"
    else:
        large = model is None and EXAMPLES[example].large
    defaults = LIGHT_MEASURE if large else FULL_MEASURE
    microbatch_sizes = microbatch_sizes or str(defaults["microbatch_sizes"])
    repeats = repeats if repeats is not None else int(defaults["repeats"])
    warmup = warmup if warmup is not None else int(defaults["warmup"])
    if seq_len is None and defaults["seq_len"] is not None:
        seq_len = int(defaults["seq_len"])
    for option, value, least in (
        ("--workers", workers, 1),
        ("--repeats", repeats, 1),
        ("--warmup", warmup, 0),
        ("--threads", threads, 1),
        ("--seq-len", seq_len if seq_len is not None else 1, 1),
    ):
        if value < least:
            raise InputError(option, "", f"expected an integer >= {least}, got {value}")
    check_seed("--seed", seed)
    # upper bounds (docs/profiling.md): torch crashed (SIGSEGV) setting 100000 threads; a
    # device of the measured cluster file gets memory / workers, which must stay >= 1 MiB (0 GiB
    # is not a valid memory_gib); timed rounds beyond MAX_TIMED_ROUNDS would run for hours
    max_threads = os.cpu_count() or 1
    max_workers = max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)
    for option, value, most, why in (
        ("--threads", threads, max_threads, "the CPUs of this machine"),
        ("--workers", workers, max_workers, "1 MiB of this machine's memory per device"),
        ("--repeats", repeats, MAX_TIMED_ROUNDS, "timed rounds"),
        ("--warmup", warmup, MAX_TIMED_ROUNDS, "untimed rounds"),
    ):
        if value > most:
            raise InputError(option, "", f"expected an integer <= {most} ({why}), got {value}")
    if measure and model is not None:
        raise InputError("--measure", "", "timing is available for --example models")
    if kind is not None and not measure:
        raise InputError("--kind", "", "only used with --measure")
    if kind is not None and not kind.strip():
        raise InputError("--kind", "", "expected a non-empty device kind name")
    kind = kind if kind is not None else default_device_kind(threads)
    if measure and out is None:
        raise InputError("--out", "", "required with --measure (the cluster file goes next to it)")
    if out is not None:
        check_output_path("--out", out)
    if measure and cluster_out is not None:
        check_output_path("--cluster-out", cluster_out)
        # the cluster file overwrote the profile (or the timings) it was measured with
        for other, what in ((out, "--out"), (_measure_path(out), "the timings file")):
            if Path(cluster_out).resolve() == Path(other).resolve():
                raise InputError(
                    "--cluster-out", "", f"expected a file other than {what}, got {cluster_out}"
                )
    sizes = parse_microbatch_sizes(microbatch_sizes) if measure else ()
    lengths = parse_stage_lengths(stage_lengths) if stage_lengths else None
    if model is not None or example in HF_EXAMPLES:
        subject = _module_subject(example, model, size, seed, device if device != "auto" else None)
    else:
        subject = _chain_subject(EXAMPLES[example], seed, device)
    start_s = time.perf_counter()
    inputs = subject.make_input(batch)
    profile = subject.profile(inputs, subject.label)
    if not _write_profile(profile, out):
        return 0
    shared = sum(t.bytes for t in profile.shared)
    print(
        f"wrote {out}: {subject.name}: {plural(profile.num_layers, 'layer')}, "
        f"{sum(ly.fwd_flops for ly in profile.layers) / 1e9:.4g} GFLOP forward per sample, "
        f"{(sum(ly.param_bytes for ly in profile.layers) + shared) / 2**20:.4g} MiB parameters"
        + (
            f" ({shared / 2**20:.4g} MiB shared by {plural(len(profile.shared), 'tied tensor')})"
            if profile.shared
            else ""
        )
        + f"; {time.perf_counter() - start_s:.3g} s on {subject.count_device}",
        flush=True,
    )
    if not measure:
        return 0
    return _measure(
        subject,
        profile,
        out,
        cluster_out,
        workers,
        sizes,
        repeats,
        warmup,
        threads,
        link,
        seed,
        seq_len,
        lengths,
        large,
        kind,
    )


def default_device_kind(threads: int) -> str:
    """This machine's device kind for ``--measure`` (docs/model.md §7): the CPU's model name
    (``/proc/cpuinfo``; else the machine type) in lower case with runs of other characters
    as ``-``, and the timing threads, e.g. ``intel-r-xeon-r-cpu-e5-2680-v4-2-40ghz-1t``."""
    import re

    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1]
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "cpu"
    return f"{slug}-{threads}t"


HF_EXAMPLES = ("gpt2", "bert", "resnet")


@dataclass
class _Subject:
    """What ``hetrain profile`` profiles and times: ``make_input(n)`` -> ``n`` samples of real
    model inputs; ``profile(inputs, label)`` -> the counted profile; ``build()`` -> the chain
    with real weights on the CPU (for timing); ``source``: the options that name it
    (``--example gpt2 --size base``), for messages and the measured files' headers."""

    name: str
    label: str
    count_device: str
    make_input: Callable[[int], Any]
    profile: Callable[[Any, str], Any]
    build: Callable[[], Any]
    source: str


def _chain_subject(ex, seed: int, device: str) -> _Subject:
    """An ``nn.Sequential`` example of the registry (counted on ``meta`` inputs on meta)."""
    import torch

    from hetrain.profiler import profile_chain

    count_device = device if device != "auto" else ("meta" if ex.large else "cpu")

    def make_input(n: int) -> Any:
        return ex.make_input(n, torch.Generator().manual_seed(seed))

    def profile(inputs: Any, label: str) -> Any:
        torch.manual_seed(seed)
        with torch.device(count_device):
            model = ex.build()
        model.train()
        return profile_chain(model, inputs.to(count_device), name=label)

    def build() -> Any:
        torch.manual_seed(seed)
        model = ex.build()
        model.train()
        return model

    label = f"{ex.name} ({ex.description}; {count_device})"
    return _Subject(
        ex.name, label, count_device, make_input, profile, build, f"--example {ex.name}"
    )


def hf_inputs(example: str, size: str, batch: int, seed: int = 0, seq_len: int | None = None):
    """Random inputs of ``batch`` samples for a Hugging Face example of ``size``: token windows
    for GPT-2 / BERT (1024 / 512 tokens for ``base``, 64 otherwise, or ``seq_len``), images for
    ResNet (224x224 RGB for ``base``, 32x32 grey otherwise); from ``seed``, on the CPU."""
    import torch

    from hetrain.models import hf

    gen = torch.Generator().manual_seed(seed)
    base = size == "base"
    if example == "gpt2":
        seq, vocab = (1024, 50257) if base else (64, hf.BYTE_VOCAB)
        return torch.randint(0, vocab, (batch, seq_len or seq), generator=gen)
    if example == "bert":
        seq, vocab = (512, 30522) if base else (64, hf.BYTE_VOCAB + 1)
        return torch.randint(1, vocab, (batch, seq_len or seq), generator=gen)
    shape = (3, 224, 224) if base else (1, 32, 32)
    return torch.randn((batch, *shape), generator=gen)


def hf_build(example: str, size: str):
    """The Hugging Face example ``example`` of ``size`` in training mode (dropout 0.1, random
    weights), on the current default device (``with torch.device("meta")``: no weights)."""
    from hetrain.models import hf

    if example == "gpt2":
        model = hf.gpt2_model(size, dropout=0.1)
    elif example == "bert":
        model = hf.bert_model(size, dropout=0.1)
    else:
        model = hf.resnet_model(size)
    model.train()
    return model


def _hf_description(example: str, size: str) -> str:
    base = size == "base"
    what = {
        "gpt2": "Hugging Face GPT2LMHeadModel" + (" (GPT-2 small)" if base else f" ({size})"),
        "bert": "Hugging Face BertForMaskedLM" + (" (BERT-base)" if base else f" ({size})"),
        "resnet": "Hugging Face ResNetForImageClassification" + (" (ResNet-50)" if base else ""),
    }[example]
    return f"{what}, cut at its blocks"


def _module_subject(
    example: str, model_spec: str | None, size: str, seed: int, device: str | None
) -> _Subject:
    """A Hugging Face example or a ``--model`` factory's module, cut into layers as in
    training (runtime/cutting.py); counted on ``meta`` (:func:`~hetrain.profiler.
    profile_on_meta`) for the ``base`` examples or ``--device meta``, else on the CPU."""
    import numpy as np
    import torch

    from hetrain.models.hf import _size
    from hetrain.profiler import profile_chain, profile_on_meta

    if model_spec is not None:
        from hetrain.runtime.api import task_from_factory
        from hetrain.runtime.data import task_chain

        task = task_from_factory(model_spec, seed)
        count_device = device or "cpu"

        def make_input(n: int) -> Any:
            return task.train.batch(np.arange(min(n, len(task.train))))[0]

        def build() -> Any:
            torch.manual_seed(seed)
            return task.build_model()

        def profile(inputs: Any, label: str) -> Any:
            try:
                if count_device == "meta":
                    return profile_on_meta(build, inputs, name=label, layers=task.layers)
                module = build()
                return profile_chain(task_chain(task, module, verify=True), inputs, name=label)
            except InputError:
                raise
            except Exception as exc:  # the user's model fails its own forward: one line
                message = (str(exc).strip().splitlines() or [""])[0]
                raise InputError(
                    "--model",
                    model_spec,
                    f"running the model failed: {type(exc).__name__}: {message}",
                ) from None

        return _Subject(
            model_spec,
            f"{model_spec} ({count_device})",
            count_device,
            make_input,
            profile,
            build,
            f"--model {model_spec}",
        )
    size = _size(size)
    count_device = device or ("meta" if size == "base" else "cpu")
    source = f"--example {example} --size {size}"

    def make_hf_input(n: int) -> Any:
        return hf_inputs(example, size, n, seed)

    def build_hf() -> Any:
        torch.manual_seed(seed)
        return hf_build(example, size)

    def profile_hf(inputs: Any, label: str) -> Any:
        if count_device == "meta":
            return profile_on_meta(build_hf, inputs, name=label, source=source)
        from hetrain.runtime.cutting import cut_module

        chain = cut_module(build_hf(), inputs[:1], source=source)
        return profile_chain(chain, inputs, name=label)

    label = f"{example} {size} ({_hf_description(example, size)}; {count_device})"
    return _Subject(
        f"{example}-{size}", label, count_device, make_hf_input, profile_hf, build_hf, source
    )


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
    subject: _Subject,
    full_profile,
    out: Path,
    cluster_out,
    workers,
    sizes: Sequence[int],
    repeats,
    warmup,
    threads,
    link,
    seed,
    seq_len: int | None,
    lengths: Sequence[int] | None,
    large: bool,
    kind: str,
) -> int:
    import torch
    import yaml
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from hetrain.cluster import cluster_from_dict
    from hetrain.profiler import (
        fit_device,
        fit_stages,
        measure_p2p,
        profile_chain,
        time_layers,
        time_stages,
    )
    from hetrain.runtime.cutting import cut_module

    start_s = time.perf_counter()
    load_before = os.getloadavg()[0]

    def make_input(n: int) -> Any:
        x = subject.make_input(n)
        if seq_len is not None and not x.is_floating_point() and x.dim() == 2:
            x = x[:, :seq_len].contiguous()  # token windows of seq_len (docs/profiling.md §2)
        return x

    probe = make_input(1)
    timed_shape = tuple(probe.shape[1:])
    model = subject.build()
    chain = cut_module(model, probe, source=subject.source)
    num_layers = chain.num_layers
    if lengths is None:  # stages of 1 (time_layers'), 2, L/2 and L layers; large: 1 and L
        from hetrain.profiler.timing import default_stage_lengths

        lengths = (num_layers,) if large else default_stage_lengths(num_layers)
    lengths = [n for n in lengths if 1 < n <= num_layers]
    if not lengths and num_layers > 1:
        lengths = [num_layers]
    rounds = warmup + repeats
    # samples through all layers: the counting pass, then the timed rounds
    total = min(sizes) + rounds * sum(sizes) * (1 + len(lengths))
    print(
        f"timing {subject.name} on inputs of shape {'x'.join(map(str, timed_shape))} with "
        f"{plural(threads, 'thread')}: micro-batch sizes {','.join(map(str, sizes))}, "
        f"{warmup} warm-up + {plural(repeats, 'timed round')}, stages of 1 and "
        f"{','.join(map(str, lengths))} layers (heavier: --repeats, --warmup, "
        "--microbatch-sizes, --seq-len, --stage-lengths)",
        file=sys.stderr,
    )
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        TextColumn("remaining"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task_id = bar.add_task("counting", total=total)
        # first an untimed pass of every layer at the smallest size (warms up the kernels, the
        # allocator and the cut's replay) that counts the FLOPs of the timed shape for the fit
        # (profile_chain on the real model; equal per sample to the written profile when the
        # shape is the same)
        profile = profile_chain(chain, make_input(min(sizes)), name=full_profile.name)
        bar.update(task_id, advance=min(sizes), description="timing layers")

        def advance(samples: int) -> None:
            bar.advance(task_id, samples)

        times = time_layers(
            chain,
            make_input,
            sizes,
            warmup=warmup,
            repeats=repeats,
            threads=threads,
            progress=advance,
        )
        # stages of several lengths (the one-layer stages are time_layers' own): λ vs κ
        stage_times = None
        if lengths:
            bar.update(task_id, description="timing stages")
            stage_times = time_stages(
                chain,
                make_input,
                sizes,
                lengths,
                warmup=warmup,
                repeats=repeats,
                threads=threads,
                progress=advance,
            )
    # the measured per-layer times under this machine's kind (docs/model.md §3, §7), when
    # they are times of the profiled samples and layers
    same_shape = tuple(subject.make_input(1).shape[1:]) == timed_shape
    measured_kind = kind if same_shape and num_layers == full_profile.num_layers else None
    if measured_kind is not None:
        table = {
            "microbatch_sizes": [int(x) for x in times.microbatch_sizes],
            "fwd_s": times.fwd_s.tolist(),
            "bwd_s": times.bwd_s.tolist(),
        }
        from hetrain.profile import profile_from_dict

        data = full_profile.to_json_dict()
        data["measured_times"] = {**data.get("measured_times", {}), kind: table}
        full_profile = profile_from_dict(data, "<measured profile>")
        _write_profile(full_profile, out)
    else:
        print(
            f"hetrain: note: the timed inputs ({'x'.join(map(str, timed_shape))}) are not the "
            "profiled ones; the profile gets no measured times (time without --seq-len)",
            file=sys.stderr,
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
                "tflops": float(f"{device_fit.speed_flops / 1e12:.6g}"),  # 6 significant digits
                "memory_gib": round(mem_bytes / workers / 2**30, 3),
                "nic_gbps": round(nic_gbps, 4),
                "microbatch_overhead_ms": round(device_fit.kappa_s * 1e3, 4),
                "layer_overhead_ms": round(lam_s * 1e3, 4),
                **({"kind": measured_kind} if measured_kind is not None else {}),
            }
            for r in range(workers)
        ],
    }
    cluster_from_dict(cluster, "<measured cluster>")  # validate before writing
    cpath = cluster_out or out.with_name(out.stem + ".cluster.yaml")
    cpath.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# measured by `hetrain profile {subject.source} --measure` on "
        f"{platform.node()}\n"
        f"# ({platform.processor() or platform.machine()}, {times.threads} thread(s) per rank);"
        f" speed/kappa/lambda fit rms rel error {device_fit.rms_rel_error:.3f}\n"
    )
    cpath.write_text(header + yaml.safe_dump(cluster, sort_keys=False), encoding="utf-8")
    details = {
        "example": subject.name,
        "timed_input_shape": list(timed_shape),
        "warmup": warmup,
        "repeats": repeats,
        "threads": times.threads,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        "wall_s": round(time.perf_counter() - start_s, 2),
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
    mpath = _measure_path(out)
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
    if measured_kind is not None:
        print(f"wrote measured layer times of kind {measured_kind!r} into {out}")
    print(f"wrote {cpath} and {mpath} ({details['wall_s']:.0f} s)")
    return 0


def _fit_dict(fit) -> dict[str, float]:
    return {
        "speed_flops": fit.speed_flops,
        "kappa_s": fit.kappa_s,
        "rms_rel_error": fit.rms_rel_error,
        "max_abs_rel_error": fit.max_abs_rel_error,
    }
