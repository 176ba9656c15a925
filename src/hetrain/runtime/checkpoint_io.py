"""Atomic, validated checkpoints on top of ``torch.distributed.checkpoint`` (DCP).

Layout of a checkpoint directory ``D``::

    D/step-000000120/            one complete checkpoint (step 120)
        .metadata                DCP metadata (written by DCP's coordinator)
        __0_0.distcp ...         DCP data, one file per saving rank
        manifest.json            written LAST: step, fingerprint, meta, sha256 + size per file
    D/.tmp-step-000000140/       a checkpoint being written (ignored by loaders)

Protocol of :func:`save_checkpoint` (every rank calls it; collective when a process group is
given):

1. rank 0 removes a stale ``.tmp-step-N`` left by a crash, then all ranks meet (barrier);
2. ``dcp.save`` writes every rank's tensors into ``.tmp-step-N`` (files are fsynced);
3. rank 0 hashes every file, writes ``manifest.json`` (to a temporary name, fsync, rename),
   fsyncs the folder, renames ``.tmp-step-N`` to ``step-N`` (atomic on POSIX) and fsyncs ``D``;
4. rank 0 deletes checkpoints older than the newest ``keep`` (only after step 3);
5. all ranks meet again, so a checkpoint is complete on disk before any rank goes on.

A crash (SIGKILL, power loss after fsync) at any point leaves either the previous checkpoints
untouched and a ``.tmp-*`` folder that is never loaded, or the new complete checkpoint. A
``step-*`` folder therefore always has a manifest; :func:`load_latest` still verifies sizes,
checksums and the model fingerprint, so corruption after the fact (a bad disk, a file edited or
truncated by hand) or a checkpoint of another model raises :class:`CheckpointError` with one
line naming the file, instead of loading wrong weights.

Limits: the checkpoint folder must be one shared filesystem for all ranks (local disk for local
runs); rank 0 reads every file once to hash it (fine for models that fit in host memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetrain.errors import InputError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class CheckpointError(InputError):
    """A checkpoint that must not be loaded: corrupted (size or checksum mismatch, unreadable
    manifest, missing file) or written for another model (fingerprint mismatch). One line,
    naming the checkpoint file; the CLI exits with status 2."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, validated checkpoint on disk.

    Attributes:
        path: the ``step-N`` folder.
        step: training steps completed when it was written.
        fingerprint: the model fingerprint it was written for (:func:`model_fingerprint`).
        meta: the caller's JSON metadata (data position, plan, controller state, ...).
        keys: tensor keys stored, with their shapes.
    """

    path: Path
    step: int
    fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, tuple[int, ...]] = field(default_factory=dict)


def model_fingerprint(model: torch.nn.Module | Mapping[str, torch.Tensor], **extra: Any) -> str:
    """A short hex digest identifying a model architecture: parameter and buffer names, shapes
    and dtypes (values excluded), plus ``extra`` (e.g. ``example="charlm"``), JSON-encoded.

    Two runs that build the same model get the same fingerprint; a checkpoint written for a
    different architecture (another layer count, width or dtype) does not match.
    """
    items = model.state_dict().items() if isinstance(model, torch.nn.Module) else model.items()
    desc = [[k, list(v.shape), str(v.dtype)] for k, v in sorted(items)]
    blob = json.dumps({"tensors": desc, "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def step_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint of ``step`` inside ``root``."""
    return Path(root) / f"step-{int(step):09d}"


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{int(step):09d}"


def fsync_dir(path: str | Path) -> None:
    """``fsync`` a folder so that renames and new entries in it are durable (best effort)."""
    _fsync_dir(Path(path))


def file_digests(folder: str | Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"size": bytes, "sha256": hex}}`` of the regular files of ``folder``."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(Path(folder).iterdir())
        if p.is_file()
    }


def verify_files(folder: str | Path, files: Mapping[str, Any], manifest_path: str) -> None:
    """Check that every file listed in a manifest exists in ``folder`` with its size and sha256.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    folder = Path(folder)
    for name, rec in files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\0" in name
            or len(name.encode("utf-8", "surrogatepass")) > 255
        ):
            raise CheckpointError(
                manifest_path, "files", f"expected plain file names, got {name!r}"
            )
        fpath = folder / name
        try:
            size, digest = int(rec["size"]), str(rec["sha256"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise CheckpointError(
                manifest_path, f"files.{name}", "expected size and sha256"
            ) from None
        try:
            if not fpath.is_file():
                raise CheckpointError(str(fpath), "", "missing (checkpoint corrupted)")
            actual = fpath.stat().st_size
            if actual != size:
                raise CheckpointError(
                    str(fpath),
                    "",
                    f"size {actual} bytes, manifest says {size} (checkpoint corrupted)",
                )
            if _sha256(fpath) != digest:
                raise CheckpointError(str(fpath), "", "checksum mismatch (checkpoint corrupted)")
        except OSError as exc:
            raise CheckpointError(str(fpath), "", f"unreadable ({type(exc).__name__})") from None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_single_process():
    """Silence DCP's "assuming the intent is to save in a single process" warning (intended)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def _barrier(process_group: Any) -> None:
    if process_group is not None:
        import torch.distributed as dist

        dist.barrier(group=process_group)


def _rank(process_group: Any) -> int:
    if process_group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=process_group)


def publish_checkpoint(tmp: Path, final: Path, manifest: Mapping[str, Any]) -> None:
    """Make the fully written checkpoint folder ``tmp`` visible as ``final``, atomically.

    The manifest is written last (``.part`` + fsync + ``os.replace``), then ``tmp`` is renamed
    to ``final``; an existing ``final`` (a step re-saved after a restart) is swapped out, never
    deleted first, so a crash at any point leaves either the old or the new checkpoint
    complete. Called on one rank (rank 0) after every rank's data is on disk.

    Raises:
        OSError: the filesystem failed (earlier checkpoints are intact).
    """
    part = tmp / (MANIFEST + ".part")
    with open(part, "w", encoding="utf-8") as fh:
        json.dump(dict(manifest), fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, tmp / MANIFEST)
    _fsync_dir(tmp)
    root = final.parent
    if final.exists():  # re-saving a step (e.g. after a restart): replace it atomically
        old = root / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def save_checkpoint(
    root: str | Path,
    step: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    meta: Mapping[str, Any] | None = None,
    process_group: Any = None,
    keep: int = 2,
) -> Path:
    """Write ``state_dict`` (this rank's tensors; keys unique across ranks, e.g. the engine's
    ``layer_state_dict()``) as the checkpoint of ``step``, atomically; see the module docstring.

    Args:
        root: checkpoint folder (created if missing).
        step: training steps completed (>= 0).
        state_dict: this rank's tensors (CPU or not; copied by DCP).
        fingerprint: :func:`model_fingerprint` of the model being trained.
        meta: JSON-serialisable metadata from rank 0 (data position, plan, RNG seeds...).
        process_group: the group of all saving ranks; ``None`` for a single process.
        keep: complete checkpoints to keep (>= 1); older ones are deleted after this one is
            complete.

    Returns:
        The ``step-N`` folder.

    Raises:
        ValueError: ``step < 0``, ``keep < 1``, or ``meta`` not JSON-serialisable.
        OSError: the filesystem failed (the previous checkpoints are intact).
    """
    import torch.distributed.checkpoint as dcp

    if int(step) < 0:
        raise ValueError(f"step: expected an integer >= 0, got {step}")
    if int(keep) < 1:
        raise ValueError(f"keep: expected an integer >= 1, got {keep}")
    meta_json = json.loads(json.dumps(dict(meta or {}), allow_nan=False))  # fail early
    root = Path(root)
    rank = _rank(process_group)
    tmp, final = _tmp_dir(root, step), step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier attempt at this step
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier(process_group)
    tensors = {k: v.detach() for k, v in state_dict.items()}
    with _quiet_single_process():
        dcp.save(
            tensors,
            storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
            process_group=process_group,
            no_dist=process_group is None,
        )
    if rank == 0:
        files = file_digests(tmp)
        manifest = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "fingerprint": fingerprint,
            "meta": meta_json,
            "files": files,
        }
        publish_checkpoint(tmp, final, manifest)
        for stale in list_checkpoints(root)[: -int(keep)]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(process_group)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete-looking ``step-N`` folders of ``root``, oldest first (not validated)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def validate_checkpoint(path: str | Path, *, fingerprint: str | None = None) -> CheckpointInfo:
    """Read and check a ``step-N`` folder: the manifest parses, every file it lists exists with
    the recorded size and sha256, DCP metadata is readable, and (if given) the fingerprint
    matches.

    Raises:
        CheckpointError: one line naming the offending file and what is wrong.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    mpath = path / MANIFEST
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        step = manifest["step"]
        # exact types: JSON numbers such as 3.0, true or Infinity are not steps or versions
        if type(step) is not int or step < 0 or type(manifest.get("format")) is not int:
            raise ValueError("step/format")
        files = dict(manifest["files"])
        stored_fp = str(manifest["fingerprint"])
        meta = dict(manifest.get("meta") or {})
        if manifest["format"] != FORMAT_VERSION:
            raise ValueError("format")
    except FileNotFoundError:
        raise CheckpointError(str(mpath), "", "missing (checkpoint incomplete)") from None
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        RecursionError,
        OverflowError,
    ):
        raise CheckpointError(
            str(mpath), "", f"expected a hetrain checkpoint manifest (format {FORMAT_VERSION})"
        ) from None
    if fingerprint is not None and stored_fp != fingerprint:
        raise CheckpointError(
            str(mpath),
            "fingerprint",
            f"checkpoint of another model (fingerprint {stored_fp}, this model {fingerprint})",
        )
    verify_files(path, files, str(mpath))
    if ".metadata" not in files:
        raise CheckpointError(str(path / ".metadata"), "", "not listed (checkpoint incomplete)")
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            str(path / ".metadata"), "", f"unreadable DCP metadata ({type(exc).__name__})"
        ) from None
    keys = {
        k: tuple(int(s) for s in v.size)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    return CheckpointInfo(path=path, step=step, fingerprint=stored_fp, meta=meta, keys=keys)


def load_latest(
    root: str | Path, *, fingerprint: str | None = None, fallback: bool = False
) -> CheckpointInfo | None:
    """The newest complete checkpoint of ``root``, validated (:func:`validate_checkpoint`);
    ``None`` when there is none (``.tmp-*`` folders of interrupted writes are ignored).

    Args:
        fingerprint: expected model fingerprint; a mismatch is an error (never skipped).
        fallback: if the newest checkpoint is corrupted, try older ones instead of raising.

    Raises:
        CheckpointError: the newest checkpoint is corrupted (and not ``fallback``), or it was
            written for another model.
    """
    first_error: CheckpointError | None = None
    for path in reversed(list_checkpoints(root)):
        try:
            return validate_checkpoint(path, fingerprint=fingerprint)
        except CheckpointError as exc:
            if not fallback or exc.field == "fingerprint":
                raise
            first_error = first_error or exc
    return None


def load_tensors(
    info: CheckpointInfo,
    keys: Iterable[str] | Callable[[str], bool] | None = None,
    *,
    like: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read tensors of a validated checkpoint (no collectives: each rank reads what it needs,
    whatever plan wrote the checkpoint).

    Args:
        info: from :func:`load_latest` / :func:`validate_checkpoint`.
        keys: the keys to read (an iterable, or a predicate on the key); ``None`` = all.
        like: optional tensors giving dtype/device per key (default: DCP's stored dtype, CPU).

    Raises:
        CheckpointError: a requested key is not in the checkpoint, or its shape differs from
            ``like``.
    """
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    if keys is None:
        wanted = list(info.keys)
    elif callable(keys):
        wanted = [k for k in info.keys if keys(k)]
    else:
        wanted = list(keys)
    out: dict[str, torch.Tensor] = {}
    for k in wanted:
        if k not in info.keys:
            raise CheckpointError(str(info.path / MANIFEST), k, "key not in checkpoint")
        shape = info.keys[k]
        if like is not None and k in like:
            ref = like[k]
            if tuple(ref.shape) != shape:
                raise CheckpointError(
                    str(info.path / MANIFEST),
                    k,
                    f"shape {list(shape)} in checkpoint, model has {list(ref.shape)}",
                )
            out[k] = torch.empty(shape, dtype=ref.dtype, device=ref.device)
        else:
            dtype = md[k].properties.dtype
            out[k] = torch.empty(shape, dtype=dtype)
    if out:
        with _quiet_single_process():
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(info.path)), no_dist=True)
    return out
