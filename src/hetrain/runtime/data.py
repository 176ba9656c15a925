"""Data for the runtime: a deterministic global-batch sampler, the sample sources, and the
:class:`Task` a rank trains (model factory, data, loss, evaluation) with its model as a chain
(:func:`task_chain`, :func:`as_chain`).

The sampler gives the **same global batch at step t whatever the plan or world size**: the
indices of step ``t`` are positions ``[t*B, (t+1)*B)`` of an endless stream made of one seeded
permutation of the training samples per epoch (``numpy.random.default_rng([seed, epoch])``).
Every rank builds the whole global batch (cheap for these data sets) and the engine slices its
group's rows ``[offset_g, offset_g + b_g)``.

User data (:func:`as_source`): tensors, a ``TensorDataset``, or a map-style data set of
``(input, target)`` pairs, of dicts (the targets under ``target_key``, default ``labels``; the
other keys are the model's keyword arguments) or of ``(dict, target)`` pairs, collated by
:func:`stack_samples` or by the user's ``collate_fn``, always over the whole global batch.

The example tasks (``--example``) are in :mod:`hetrain.runtime.examples`; their names stay
importable from here (loaded on first use).

Importing this module imports torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from hetrain.errors import InputError

# --------------------------------------------------------------------------------------------
# sampler
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The permutation of epoch ``epoch`` (cached: drawing one costs milliseconds for the
    400k windows of ``charlm``, and every step of an epoch reads the same one)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    perm.setflags(write=False)
    return perm


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Deterministic global batches of ``batch`` sample indices over ``num_samples`` samples.

    Step ``t`` reads stream positions ``[t*batch, (t+1)*batch)``; position ``p`` is sample
    ``perm_e[p mod N]`` of epoch ``e = p // N`` with ``perm_e`` a permutation drawn from
    ``numpy.random.default_rng([seed, e])``. The result depends only on ``(seed, num_samples,
    batch, t)``: not on the plan, the world size or the rank.

    Raises:
        ValueError: ``num_samples < 1`` or ``batch < 1``.
    """

    num_samples: int
    batch: int
    seed: int = 0
    offset: int = 0
    """Stream positions shift: step ``t`` reads ``[offset + t*batch, ...)`` (a run resumed with
    another global batch continues at the checkpoint's data position, in samples)."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples: expected >= 1, got {self.num_samples}")
        if self.batch < 1:
            raise ValueError(f"batch: expected >= 1, got {self.batch}")

    def _perm(self, epoch: int) -> np.ndarray:
        return _epoch_permutation(int(self.seed), int(epoch), int(self.num_samples))

    def indices(self, step: int) -> np.ndarray:
        """Sample indices of the global batch of ``step`` (0-based), shape ``(batch,)`` int64."""
        start = self.offset + int(step) * self.batch
        out = np.empty(self.batch, dtype=np.int64)
        filled = 0
        while filled < self.batch:
            pos = start + filled
            epoch, offset = divmod(pos, self.num_samples)
            perm = self._perm(epoch)
            take = min(self.batch - filled, self.num_samples - offset)
            out[filled : filled + take] = perm[offset : offset + take]
            filled += take
        return out

    def position(self, step: int) -> int:
        """Samples consumed before ``step`` (the data position saved in checkpoints)."""
        return self.offset + int(step) * self.batch


# --------------------------------------------------------------------------------------------
# sample sources
# --------------------------------------------------------------------------------------------


class SampleSource(Protocol):
    """A split of a data set: ``len()`` samples, ``batch(indices) -> (inputs, targets)``
    (tensors with a leading sample dimension, or pytrees of them: a dict of keyword inputs)."""

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> tuple[Any, Any]: ...


@dataclass(frozen=True)
class TensorSource:
    """Samples held as two tensors with a leading sample dimension ``(N, ...)``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.targets):
            raise InputError(
                "dataset",
                "",
                f"inputs and targets of the same length, got {len(self.inputs)} vs "
                f"{len(self.targets)}",
            )

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[idx], self.targets[idx]


DEFAULT_TARGET_KEY = "labels"
"""Key of a dict sample (or of a collated dict batch) that holds the targets given to
``loss_fn`` (the Hugging Face convention); the other keys are the model's keyword arguments."""


def stack_samples(items: Sequence[Any]) -> Any:
    """Collate samples of one structure into one batch: a dict per key, a tuple/list per
    position, anything else (tensor, array, number) with ``torch.stack(torch.as_tensor(...))``
    along a new first dimension. Row ``i`` of the result is sample ``i``, whatever the other
    samples are.

    Raises:
        ValueError: samples of different structure or shape.
    """
    first = items[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for item in items:
            if not isinstance(item, Mapping) or list(item) != keys:
                raise ValueError(f"samples with different keys ({keys} and {list(item)})")
        return {k: stack_samples([item[k] for item in items]) for k in keys}
    if isinstance(first, tuple | list):
        if any(not isinstance(i, tuple | list) or len(i) != len(first) for i in items):
            raise ValueError("samples with different numbers of fields")
        return tuple(stack_samples(list(col)) for col in zip(*items, strict=True))
    return torch.stack([torch.as_tensor(x) for x in items])


def split_target(batch: Any, target_key: str = DEFAULT_TARGET_KEY) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a collated batch: a dict loses its ``target_key`` entry (the
    targets) and the rest are the model's keyword arguments; a pair is ``(inputs, targets)``
    (``inputs`` itself may be a dict).

    Raises:
        ValueError: a dict without ``target_key`` or anything other than a dict or a pair.
    """
    if isinstance(batch, Mapping):
        if target_key not in batch:
            raise ValueError(
                f"dict samples without the target key {target_key!r} (keys: "
                f"{', '.join(map(str, batch))}); name the key of the targets with target_key"
            )
        return {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"expected (input, target) pairs or dicts with a {target_key!r} key, got "
        f"{type(batch).__name__}"
    )


@dataclass(frozen=True)
class MapSource:
    """Any map-style data set (``len()`` and ``dataset[i]``, e.g. a ``torch.utils.data.Dataset``,
    a list, a Hugging Face ``datasets`` data set in torch format) whose items are ``(input,
    target)`` pairs, dicts (the targets under ``target_key``, the other keys the model's keyword
    arguments) or ``(dict, target)`` pairs.

    A batch is ``collate_fn(items)`` (a list of items in, a dict or an ``(inputs, targets)``
    pair out, as a ``DataLoader``'s ``collate_fn``, e.g. ``transformers``'
    ``DataCollatorWithPadding``) or, without one, :func:`stack_samples`. The whole global batch
    is collated at once (padding to its longest sequence, as one device's loop over it does)
    and the engine takes each micro-batch's rows from it, so every plan computes on the same
    padded rows (a sample's dropout draws depend on its padded shape)."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    target_key: str = DEFAULT_TARGET_KEY

    def __len__(self) -> int:
        return len(self.dataset)

    def items(self, indices: np.ndarray) -> list[Any]:
        """The raw items ``dataset[i]`` of ``indices``."""
        return [self.dataset[int(i)] for i in indices]

    def collate(self, items: list[Any]) -> tuple[Any, Any]:
        """``(inputs, targets)`` of ``items`` (see the class)."""
        batch = self.collate_fn(list(items)) if self.collate_fn else stack_samples(items)
        return split_target(batch, self.target_key)

    def batch(self, indices: np.ndarray) -> tuple[Any, Any]:
        return self.collate(self.items(indices))


@dataclass(frozen=True)
class CharWindows:
    """Character windows over a token tensor ``(n,)`` int64: sample ``i`` is input
    ``tokens[i : i+T]`` and target ``tokens[i+1 : i+T+1]`` with ``T = block_size``."""

    tokens: torch.Tensor
    block_size: int

    def __len__(self) -> int:
        return max(len(self.tokens) - self.block_size - 1, 0)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)[:, None] + torch.arange(
            self.block_size + 1
        )
        win = self.tokens[idx]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _is_array(x: Any) -> bool:
    return isinstance(x, torch.Tensor | np.ndarray)


def as_source(
    dataset: Any,
    name: str = "dataset",
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    target_key: str = DEFAULT_TARGET_KEY,
) -> SampleSource:
    """Turn what a user passes as a data set into a :class:`SampleSource`.

    Accepts a :class:`SampleSource`, a pair ``(inputs, targets)`` of tensors/arrays, a
    ``torch.utils.data.TensorDataset`` of two tensors, or any map-style data set (a list
    included) of ``(input, target)`` pairs, of dicts (targets under ``target_key``, the other
    keys the model's keyword arguments) or of ``(dict, target)`` pairs (:class:`MapSource`,
    collated by ``collate_fn`` over the whole global batch when given). The first two items
    are collated here, so a bad item or ``collate_fn`` is reported before training.

    Raises:
        InputError: anything else, an empty data set, ``collate_fn`` not callable or with a
            data set that is not map-style, or items that do not collate.
    """
    if collate_fn is not None and not callable(collate_fn):
        raise InputError("collate_fn", "", f"expected a callable, got {type(collate_fn).__name__}")
    if not isinstance(target_key, str) or not target_key:
        raise InputError("target_key", "", f"expected a non-empty string, got {target_key!r}")
    plain = collate_fn is None and target_key == DEFAULT_TARGET_KEY
    if hasattr(dataset, "batch") and hasattr(dataset, "__len__"):
        src = dataset
    elif (
        plain
        and isinstance(dataset, tuple | list)
        and len(dataset) == 2
        and all(_is_array(d) for d in dataset)
    ):
        src = TensorSource(torch.as_tensor(dataset[0]), torch.as_tensor(dataset[1]))
    elif (
        plain and isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2
    ):
        src = TensorSource(*dataset.tensors)
    elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        src = MapSource(dataset, collate_fn, target_key)
    else:
        raise InputError(
            name,
            "",
            "expected (inputs, targets) tensors, a TensorDataset or a map-style dataset of "
            "(input, target) pairs or dicts",
        )
    if collate_fn is not None and not isinstance(src, MapSource):
        raise InputError("collate_fn", "", f"expected a map-style {name} of samples to collate")
    if len(src) < 1:
        raise InputError(name, "", "expected at least one sample")
    if isinstance(src, MapSource):
        try:
            src.batch(np.arange(min(2, len(src))))
        except Exception as exc:  # the user's items or collate_fn: one line
            what = "collate_fn" if collate_fn is not None else name
            raise InputError(
                what, "", f"items 0-1 do not collate: {type(exc).__name__}: {exc}"
            ) from None
    return src


# --------------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------------


def _mean_loss(
    model: nn.Module, loss_fn: Callable, source: SampleSource, batch: int, limit: int, dtype
) -> float:
    """Mean ``loss_fn`` over the first ``limit`` samples of ``source`` in batches of ``batch``
    (a ``(sum, count)`` loss: total sum over total count)."""
    total, count = 0.0, 0.0
    n = min(len(source), limit)
    with torch.no_grad():
        for start in range(0, n, batch):
            idx = np.arange(start, min(start + batch, n))
            x, y = source.batch(idx)
            value = loss_fn(call_model(model, cast_inputs(x, dtype)), y)
            if isinstance(value, tuple | list):  # (sum, count)
                total, count = total + float(value[0]), count + float(value[1])
            else:
                total, count = total + float(value) * len(idx), count + len(idx)
    return total / max(count, 1.0)


def cast_inputs(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``x`` (a tensor or a pytree: dict, tuple) to the training ``dtype``;
    integer tensors (token ids, masks) unchanged."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, x
    )


def call_model(model: nn.Module, x: Any) -> Any:
    """``model(**x)`` for a dict of inputs (keyword arguments), else ``model(x)``."""
    return model(**x) if isinstance(x, Mapping) else model(x)


@dataclass
class Task:
    """Everything a rank needs to train one model on one data set.

    Attributes:
        name: short name (``charlm``, ``digits`` or the user's).
        build_model: zero-argument factory of the ``nn.Sequential`` chain; every rank calls it
            after ``torch.manual_seed(seed)`` so all ranks start from the same weights.
        train: training split; ``val``: validation split or None.
        loss_fn: ``(outputs, targets) -> scalar``, the **mean** over the samples given.
        evaluate: ``model -> {metric: value}`` on the validation split (whole model).
        quality_metric: key of ``evaluate``'s result that states the quality;
            ``quality_target`` and ``higher_is_better`` state what the default run reaches.
        defaults: default ``steps``, ``batch``, ``lr``, ``optimizer``, ``microbatch_size``,
            ``warmup_steps``, ``grad_clip_norm``, ``weight_decay``.
        layers: cut points (module names) or None (the default cut).
        optimizer: the user's ``param groups -> torch.optim.Optimizer`` or None (hetrain's).
        param_groups: parameter groups by parameter name with their options
            (:func:`hetrain.runtime.optim.resolve_param_groups`) or None (one group).
    """

    name: str
    build_model: Callable[[], nn.Module]
    train: SampleSource
    val: SampleSource | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module, torch.dtype], dict[str, float]] | None = None
    quality_metric: str | None = None
    quality_target: float | None = None
    higher_is_better: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    # cut points (module names); None = the default cut of docs/model.md §5
    layers: list[str] | None = None
    # the user's optimizer ``param groups -> torch.optim.Optimizer`` (None: hetrain's own)
    optimizer: Callable[[list[dict[str, Any]]], Any] | None = None
    # parameter groups by name: ((names, options), ...) (hetrain.runtime.optim)
    param_groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] | None = None

    def quality_line(self, metrics: dict[str, float]) -> str:
        """One line stating the reached quality against the stated target (or that none was
        measured: a task without ``val_dataset`` or ``evaluate`` printed an empty line)."""
        if not metrics:
            return "not measured (no val_dataset or evaluate given)"
        if not self.quality_metric or self.quality_metric not in metrics:
            return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        value = metrics[self.quality_metric]
        if self.quality_target is None:
            return f"{self.quality_metric} {value:.4f}"
        ok = value >= self.quality_target if self.higher_is_better else value <= self.quality_target
        rel = ">=" if self.higher_is_better else "<="
        verdict = "reached" if ok else "NOT reached"
        return (
            f"{self.quality_metric} {value:.4f} (target {rel} {self.quality_target:g}: {verdict})"
        )

    def quality_reached(self, metrics: dict[str, float]) -> bool | None:
        if self.quality_target is None or self.quality_metric not in metrics:
            return None
        v = metrics[self.quality_metric]
        return v >= self.quality_target if self.higher_is_better else v <= self.quality_target


def task_chain(task: Task, model: nn.Module, *, verify: bool = False) -> Any:
    """The chain hetrain trains for ``task``'s ``model`` (``hetrain.runtime.cutting``): an
    ``nn.Sequential`` cut at its children, any other module at its blocks (or ``task.layers``),
    recorded on two training samples; ``verify`` also runs every layer as its own stage once
    (bad cuts fail before any process starts).

    Raises:
        InputError: a bad cut point or a model that cannot be captured.
    """
    from hetrain.runtime.cutting import Chain, cut_module

    if isinstance(model, Chain):
        return model
    if isinstance(model, nn.Sequential) and task.layers is None:
        return cut_module(model, source=task.name)
    x, _ = task.train.batch(np.arange(min(2, len(task.train))))
    chain = cut_module(model, x, task.layers, source=task.name)
    if verify and hasattr(chain, "verify"):
        chain.verify(x)
    return chain


def layer_count(model: nn.Module) -> int:
    """Number of pipeline layers (children) of a chain."""
    return len(list(model.children()))


def as_chain(model: nn.Module | Sequence[nn.Module], source: str = "model") -> nn.Module:
    """The model to train: any ``nn.Module`` as it is (cut by :func:`task_chain`), or an
    ``nn.Sequential`` of a list of blocks.

    Raises:
        InputError: not a module or a list of modules, or an empty chain.
    """
    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential):
        return model
    if isinstance(model, nn.Sequential):
        chain = model
    elif isinstance(model, list | tuple) and all(isinstance(m, nn.Module) for m in model):
        chain = nn.Sequential(*model)
    else:
        raise InputError(
            source,
            "",
            f"expected a torch.nn.Module or a list of modules, got {type(model).__name__}",
        )
    if len(chain) == 0:
        raise InputError(source, "", "expected at least one layer")
    return chain


_EXAMPLE_NAMES = frozenset(
    {
        "CHARLM_BLOCK_SIZE",
        "EXAMPLES",
        "HF_CONTEXT",
        "HF_EXAMPLES",
        "IMAGE_DEFAULTS",
        "LM_DEFAULTS",
        "MaskedWindows",
        "bert_task",
        "charlm_loss",
        "charlm_task",
        "charlm_text",
        "charlm_vocab",
        "digits_loss",
        "digits_task",
        "encode_chars",
        "example_task",
        "gpt2_task",
        "lm_loss",
        "masked_lm_loss",
        "model_logits",
        "pydoc_bytes",
        "resnet_task",
    }
)


def __getattr__(name: str) -> Any:
    """The example tasks' names (:mod:`hetrain.runtime.examples`), imported on first use (PEP
    562: that module imports this one)."""
    if name in _EXAMPLE_NAMES:
        from hetrain.runtime import examples

        return getattr(examples, name)
    raise AttributeError(f"module 'hetrain.runtime.data' has no attribute {name!r}")
