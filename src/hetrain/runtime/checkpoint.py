"""Checkpoints: ``torch.distributed.checkpoint`` (DCP) of every rank's
``Worker.layer_state_dict()`` plus a JSON manifest, published atomically.

Layout of a checkpoint folder ``D``::

    D/step-000040/            one checkpoint (after 40 steps)
        manifest.json         {"format", "step", "data_position", "plan", "model_fingerprint",
                               "world_size", "seed", "batch", "example"}
        *.distcp, .metadata   DCP files (keys "layers.{l}.{param}", "optim.{l}.{param}.{state}")
    D/.tmp-step-000040/       while being written; renamed to step-000040 when complete

:func:`save` is collective (every rank calls it); rank 0 writes the manifest into the temporary
folder and renames it (``os.replace``: atomic on POSIX), so a crash never leaves a half
checkpoint under a ``step-*`` name. :func:`load_latest` picks the highest complete step and
validates its manifest and the size and sha256 of every file (corruption is a one-line
:class:`~hetrain.runtime.checkpoint_io.CheckpointError`); :func:`restore` loads into a
worker **under any plan and world size**: each rank reads exactly the keys of the layers it
owns in its current plan, whatever rank wrote them. On several nodes ``D`` must be a shared
file system.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hetrain.errors import InputError
from hetrain.plan import Plan, plan_from_dict
from hetrain.runtime.checkpoint_io import file_digests, publish_checkpoint, verify_files

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 (16 hex digits) of the parameter and buffer names, shapes and dtypes of the whole
    chain: two models with the same fingerprint can load each other's checkpoints."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder and validated manifest fields."""

    path: Path
    step: int
    data_position: int
    plan: Plan
    model_fingerprint: str
    manifest: dict[str, Any]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(
    directory: str | Path,
    step: int,
    layer_state: dict[str, torch.Tensor],
    manifest: dict[str, Any],
) -> Path:
    """Write a checkpoint of ``step`` (steps done) collectively; returns its final folder.

    Args:
        directory: checkpoint folder ``D`` (created).
        step: number of steps done (the resumed run starts at this step).
        layer_state: this rank's ``Worker.layer_state_dict()``.
        manifest: extra manifest fields (``data_position``, ``plan``, ``model_fingerprint``, ...);
            ``format`` and ``step`` are set here.
    """
    root = Path(directory)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    dcp.save(dict(layer_state), checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        # sizes and sha256 of the DCP files, so that corruption after the fact is detected on
        # load; the manifest is written last (fsync + rename), then the folder is published
        data = {"format": FORMAT, "step": int(step), **manifest, "files": file_digests(tmp)}
        publish_checkpoint(tmp, final, data)
    _barrier()
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoint folders of ``directory`` in step order (temporary ones skipped)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate one checkpoint's manifest.

    Raises:
        InputError: missing or malformed manifest.
    """
    path = Path(path)
    source = str(path / MANIFEST)
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(source, "", "file not found (incomplete checkpoint)") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(source, "", f"expected valid JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise InputError(source, "", "expected a JSON object (checkpoint manifest)")
    if data.get("format") != FORMAT:
        raise InputError(source, "format", f"expected {FORMAT}, got {data.get('format')!r}")
    for key in ("step", "data_position"):
        if not isinstance(data.get(key), int) or data[key] < 0:
            raise InputError(source, key, f"expected an integer >= 0, got {data.get(key)!r}")
    if not isinstance(data.get("model_fingerprint"), str):
        raise InputError(source, "model_fingerprint", "expected a string")
    if "files" in data:  # written by this version: verify every DCP file
        if not isinstance(data["files"], dict) or ".metadata" not in data["files"]:
            raise InputError(source, "files", "expected sizes and sha256 of the DCP files")
        verify_files(path, data["files"], source)
    plan = plan_from_dict(data.get("plan"), f"{source}: plan")
    return Checkpoint(
        path=path,
        step=data["step"],
        data_position=data["data_position"],
        plan=plan,
        model_fingerprint=data["model_fingerprint"],
        manifest=data,
    )


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The latest complete checkpoint of ``directory`` (validated), or None when there is none.

    Raises:
        InputError: the latest checkpoint's manifest is malformed.
    """
    found = list_checkpoints(directory)
    return read_checkpoint(found[-1]) if found else None


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in ("layers", "optim") and parts[1].isdigit():
        return int(parts[1])
    return None


def restore(checkpoint: Checkpoint, owned_layers: set[int] | list[int]) -> dict[str, Any]:
    """Read the keys of ``owned_layers`` (this rank's layers under its current plan) from
    ``checkpoint``; collective when a process group is up. Returns a state dict for
    ``Worker.load_layer_state_dict``.

    Layers without state (no parameters or buffers) have no keys; a layer whose state is
    missing is reported by ``Worker.load_layer_state_dict`` (``KeyError``).
    """
    reader = dcp.FileSystemReader(str(checkpoint.path))
    meta = reader.read_metadata().state_dict_metadata
    owned = set(owned_layers)
    state: dict[str, Any] = {}
    for key, md in meta.items():
        if _layer_of(key) not in owned:
            continue
        if hasattr(md, "size"):
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:  # non-tensor value (e.g. a Python number): DCP fills it in
            state[key] = None
    dcp.load(state, checkpoint_id=str(checkpoint.path))
    return state
