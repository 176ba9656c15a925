"""Checkpoints, the runtime's one checkpoint module: ``torch.distributed.checkpoint`` (DCP) of
every rank's ``Worker.layer_state_dict()`` plus a JSON manifest, published atomically.

Layout of a checkpoint folder ``D``::

    D/step-000040/            one checkpoint (after 40 steps)
        manifest.json         {"format", "step", "data_position", "plan", "model_fingerprint",
                               "world_size", "seed", "batch", "example"}
        *.distcp, .metadata   DCP files (keys "layers.{l}.{param}", "optim.{l}.{param}.{state}")
    D/.tmp-step-000040/       while being written; renamed to step-000040 when complete
    D/plan-ids.json           {"format", "max_plan_id"}: the run's highest plan id in force,
                              also after the newest checkpoint (:func:`record_plan_id`)

:func:`save` is collective (every rank calls it); rank 0 writes the manifest into the temporary
folder and renames it (``os.replace``: atomic on POSIX), so a crash never leaves a half
checkpoint under a ``step-*`` name. :func:`load_latest` picks the highest complete step and
validates its manifest and the size and sha256 of every file (corruption is a one-line
:class:`CheckpointError`; ``fallback=True`` takes the newest valid one instead, never one of
another model); :func:`restore` loads into a
worker **under any plan and world size**: each rank reads exactly the keys of the layers it
owns in its current plan, whatever rank wrote them. On several nodes ``D`` must be a shared
file system.

Atomicity (:func:`save`): ``dcp.save`` writes every rank's tensors into ``.tmp-step-N``
(fsynced); rank 0 hashes every file, writes ``manifest.json`` last and renames the folder to
``step-N``, then deletes checkpoints older than the newest ``keep``. A crash at any point leaves
the previous checkpoints and a ``.tmp-*`` folder that is never loaded, or the new checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hetrain.errors import InputError
from hetrain.plan import Plan, plan_from_dict
from hetrain.runtime.fs_errors import write_failure_text

MANIFEST = "manifest.json"
CONTROLLER_FILE = "controller.json"
"""The controller's state in a checkpoint (``PlanController.state_dict()``, plain JSON)."""
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def model_fingerprint(model: torch.nn.Module, **extra: Any) -> str:
    """SHA-256 (16 hex digits) of the parameter and buffer names, shapes and dtypes of the whole
    chain (plus ``extra``, e.g. ``example="charlm"``): two models with the same fingerprint can
    load each other's checkpoints."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    if extra:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


class CheckpointError(InputError):
    """A checkpoint that must not be loaded: corrupted (size or checksum mismatch, unreadable
    manifest, missing file) or written for another model (fingerprint mismatch). One line,
    naming the checkpoint file; the CLI exits with status 2."""


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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


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


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder and validated manifest fields."""

    path: Path
    step: int
    data_position: int
    plan: Plan
    model_fingerprint: str
    manifest: dict[str, Any]

    def plan_to_resume(self, devices: Sequence[str], batch: int) -> Plan | None:
        """The checkpoint's plan when a round on ``devices`` with global ``batch`` (samples)
        can go on with it: the checkpoint was written by a round of the same devices (its
        manifest's ``devices``; the plan's own where a manifest lacks them) with the same
        global batch. Where the plan leaves devices of the round out (the controller had moved
        all work off a straggler), they get idle groups (:meth:`Plan.with_idle_groups`) and stay
        idle until the controller gives them work again. None otherwise (devices left or
        joined, another batch): the caller starts afresh."""
        round_devices = self.manifest.get("devices")
        if not isinstance(round_devices, list):
            round_devices = list(self.plan.devices)
        if set(round_devices) != set(devices) or self.plan.global_batch != batch:
            return None
        if not set(self.plan.devices) <= set(devices):
            return None
        return self.plan.with_idle_groups(devices)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, read-only or missing folder, I/O error):
    one line naming the checkpoint folder and the OS error (``No space left on device``). The
    partial folder has been removed; every earlier checkpoint is intact. Raised on every rank
    alike (the ranks agree on the outcome of each phase)."""


def _agree(error: str | None) -> str | None:
    """The first rank's error of a phase (collective when a process group is up): every rank
    gets the same answer, so that all stop or all go on."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return next((g for g in gathered if g), None)


def save(
    directory: str | Path,
    step: int,
    layer_state: Mapping[str, torch.Tensor],
    manifest: Mapping[str, Any],
    *,
    keep: int | None = None,
    controller_state: str | Path | None = None,
) -> Path:
    """Write a checkpoint of ``step`` (steps done) collectively; returns its final folder.

    Args:
        directory: checkpoint folder ``D`` (created).
        step: number of steps done (the resumed run starts at this step).
        layer_state: this rank's ``Worker.layer_state_dict()``.
        manifest: extra manifest fields (``data_position``, ``plan``, ``model_fingerprint``, ...);
            ``format`` and ``step`` are set here.
        keep: complete checkpoints to keep (>= 1; older ones are deleted once this one is
            complete); None keeps all.
        controller_state: rank 0: the controller's staged JSON state
            (:func:`hetrain.runtime.adapt.controller_state_path`), copied into the checkpoint
            as :data:`CONTROLLER_FILE` (checksummed like every file; manifest
            ``"controller"``); None, or a file the controller process removed before the copy:
            the checkpoint has no controller state.

    Raises:
        ValueError: ``keep < 1``.
        CheckpointWriteError: the filesystem failed in any phase, on any rank (every rank
            raises it; the partial folder is removed, the previous checkpoints are intact).
    """
    if keep is not None and int(keep) < 1:
        raise ValueError(f"keep: expected an integer >= 1, got {keep}")
    root = Path(directory)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    lead = _rank() == 0

    def fail(error: str) -> CheckpointWriteError:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        return CheckpointWriteError(f"checkpoint {final}: cannot write: {error}")

    error = None
    if lead:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            error = exc.strerror or str(exc)
    error = _agree(error)
    if error:
        raise fail(error)
    tensors = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in layer_state.items()}
    single = not (dist.is_available() and dist.is_initialized())
    try:
        with _quiet_single_process():
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                no_dist=single,
            )
    except (Exception, CheckpointException) as exc:
        # any rank's write failure: DCP raises CheckpointException (a BaseException) on every
        # rank
        error = write_failure_text(exc, root)
    error = _agree(error)
    if error:
        raise fail(error)
    if lead:
        # sizes and sha256 of the DCP files, so that corruption after the fact is detected on
        # load; the manifest is written last (fsync + rename), then the folder is published
        try:
            extra: dict[str, Any] = {"controller": None}
            if controller_state is not None:
                try:
                    shutil.copyfile(controller_state, tmp / CONTROLLER_FILE)
                    extra["controller"] = CONTROLLER_FILE
                except FileNotFoundError:
                    # the controller process removed the staged file (a new round clears the
                    # states staged before it): a checkpoint without controller state, as
                    # when none was staged
                    pass
            data = {
                "format": FORMAT,
                "step": int(step),
                **manifest,
                **extra,
                "files": file_digests(tmp),
            }
            publish_checkpoint(tmp, final, data)
        except OSError as exc:
            error = exc.strerror or str(exc)
    error = _agree(error)
    if error:
        raise fail(error)
    if lead and keep is not None:
        # older checkpoints go only once this one is complete (their controller state in them)
        for stale in list_checkpoints(root)[: -int(keep)]:
            shutil.rmtree(stale, ignore_errors=True)
    if lead and controller_state is not None:
        # the controller's staged states before the one used are superseded (the one used
        # stays: a stop or the last step, whose measurements are never posted, takes it)
        used = Path(controller_state)
        for staged in used.parent.glob("state-*.json"):
            if staged.name < used.name:
                with contextlib.suppress(OSError):
                    staged.unlink()
    _barrier()
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoint folders of ``directory`` in step order (temporary ones skipped)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def read_checkpoint(path: str | Path, *, fingerprint: str | None = None) -> Checkpoint:
    """Read and validate one checkpoint: its manifest, the size and sha256 of every file it
    lists, and (when given) the model fingerprint.

    Raises:
        CheckpointError: one line naming the offending file: missing or malformed manifest, a
            missing, truncated or altered file, or a checkpoint of another model.
    """
    path = Path(path)
    source = str(path / MANIFEST)
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(source, "", "file not found (incomplete checkpoint)") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(source, "", f"expected valid JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointError(source, "", "expected a JSON object (checkpoint manifest)")
    if type(data.get("format")) is not int or data["format"] != FORMAT:
        raise CheckpointError(source, "format", f"expected {FORMAT}, got {data.get('format')!r}")
    for key in ("step", "data_position"):
        if type(data.get(key)) is not int or data[key] < 0:
            raise CheckpointError(source, key, f"expected an integer >= 0, got {data.get(key)!r}")
    if not isinstance(data.get("model_fingerprint"), str):
        raise CheckpointError(source, "model_fingerprint", "expected a string")
    if fingerprint is not None and data["model_fingerprint"] != fingerprint:
        raise CheckpointError(
            source,
            "model_fingerprint",
            f"checkpoint of another model ({data['model_fingerprint']}; this model {fingerprint})",
        )
    if not isinstance(data.get("files"), dict) or ".metadata" not in data["files"]:
        raise CheckpointError(source, "files", "expected sizes and sha256 of the DCP files")
    verify_files(path, data["files"], source)
    try:
        plan = plan_from_dict(data.get("plan"), f"{source}: plan")
    except InputError as exc:
        raise CheckpointError(source, "plan", str(exc).split(": ", 1)[-1]) from None
    return Checkpoint(
        path=path,
        step=data["step"],
        data_position=data["data_position"],
        plan=plan,
        model_fingerprint=data["model_fingerprint"],
        manifest=data,
    )


def load_latest(
    directory: str | Path, *, fingerprint: str | None = None, fallback: bool = False
) -> Checkpoint | None:
    """The newest complete checkpoint of ``directory`` (validated by
    :func:`read_checkpoint`), or None when there is none (``.tmp-*`` folders of interrupted
    writes are ignored).

    Args:
        fingerprint: expected model fingerprint; a mismatch is an error (never skipped).
        fallback: if the newest checkpoint is corrupted, take the newest valid older one.

    Raises:
        CheckpointError: the newest checkpoint is corrupted (and not ``fallback``), or it was
            written for another model.
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            return read_checkpoint(path, fingerprint=fingerprint)
        except CheckpointError as exc:
            if not fallback or exc.field == "model_fingerprint":
                raise
    return None


PLAN_IDS_FILE = "plan-ids.json"


def record_plan_id(directory: str | Path, plan_id: int) -> None:
    """Rank 0, when a plan id comes into force (a round's first plan, a re-plan): record it
    in ``directory /`` :data:`PLAN_IDS_FILE` (fsync + ``os.replace``) for :func:`max_plan_id`.
    A failed write (full disk) is skipped: no training state, the next checkpoint says why."""
    root = Path(directory)
    part = root / (PLAN_IDS_FILE + ".part")
    with contextlib.suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
        with open(part, "w", encoding="utf-8") as fh:
            json.dump({"format": FORMAT, "max_plan_id": int(plan_id)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, root / PLAN_IDS_FILE)


def max_plan_id(directory: str | Path, checkpoint: Checkpoint | None) -> int:
    """The run's highest plan id so far (-1: none): of ``checkpoint``'s plan and of the
    :data:`PLAN_IDS_FILE` record of ``directory`` (plans put in force after that checkpoint);
    a missing, unreadable or malformed record counts as none."""
    ids = [int(checkpoint.plan.plan_id or 0)] if checkpoint is not None else [-1]
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, RecursionError):
        data = json.loads((Path(directory) / PLAN_IDS_FILE).read_text(encoding="utf-8"))
        if data.get("format") == FORMAT and type(data.get("max_plan_id")) is int:
            ids.append(data["max_plan_id"])
    return max(ids)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """The folder of the complete checkpoint of ``step`` in ``directory``."""
    return Path(directory) / f"step-{int(step):06d}"


def read_controller_state(directory: str | Path, step: int) -> dict[str, Any] | None:
    """The controller's state in the checkpoint of ``step`` (plain JSON, its size and sha256
    checked against the manifest), or None when that checkpoint has none.

    Raises:
        CheckpointError: a missing or malformed manifest, or the state file missing, altered
            or not a JSON object.
    """
    path = checkpoint_path(directory, step)
    source = str(path / MANIFEST)
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(source, "", f"unreadable manifest ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("controller") is None:
        return None
    files = data.get("files")
    if data["controller"] != CONTROLLER_FILE or not isinstance(files, dict):
        raise CheckpointError(source, "controller", f"expected {CONTROLLER_FILE!r} or null")
    if CONTROLLER_FILE not in files:
        raise CheckpointError(source, "files", f"expected the checksum of {CONTROLLER_FILE}")
    verify_files(path, {CONTROLLER_FILE: files[CONTROLLER_FILE]}, source)
    state_path = path / CONTROLLER_FILE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            str(state_path), "", f"expected JSON ({type(exc).__name__})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(str(state_path), "", "expected a JSON object")
    return state


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in ("layers", "optim") and parts[1].isdigit():
        return int(parts[1])
    return None


def _shared_of(key: str, shared: set[str]) -> str | None:
    """The shared tensor a ``shared.{name}`` or ``optim.shared.{name}.{state}`` key belongs
    to (None for other keys or names not in ``shared``)."""
    if key.startswith("shared."):
        name = key[len("shared.") :]
        return name if name in shared else None
    if key.startswith("optim.shared."):
        name = key[len("optim.shared.") :].rsplit(".", 1)[0]
        return name if name in shared else None
    return None


def restore(
    checkpoint: Checkpoint,
    owned_layers: set[int] | list[int],
    shared: Iterable[str] = (),
) -> dict[str, Any]:
    """Read this rank's keys from ``checkpoint``: those of ``owned_layers`` (its layers under
    its current plan) and of the ``shared`` tensors it holds (tied weights, e.g. GPT-2's
    ``transformer.wte.weight``, stored once as ``shared.{name}`` by whichever rank owned it
    when the checkpoint was written), with their optimizer state. Collective when a process
    group is up. Returns a state dict for ``Worker.load_layer_state_dict``.

    Layers without state (no parameters or buffers) have no keys; a layer or shared tensor
    whose state is missing is reported by ``Worker.load_layer_state_dict`` (``KeyError``).
    """
    reader = dcp.FileSystemReader(str(checkpoint.path))
    meta = reader.read_metadata().state_dict_metadata
    owned = set(owned_layers)
    held_shared = set(shared)
    state: dict[str, Any] = {}
    for key, md in meta.items():
        if _layer_of(key) not in owned and _shared_of(key, held_shared) is None:
            continue
        if hasattr(md, "size"):
            state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:  # non-tensor value (e.g. a Python number): DCP fills it in
            state[key] = None
    dcp.load(state, checkpoint_id=str(checkpoint.path))
    return state


def load_tensors(
    checkpoint: Checkpoint,
    keys: Iterable[str] | Callable[[str], bool] | None = None,
    *,
    like: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read tensors of a validated checkpoint without collectives (each process reads what it
    needs, whatever plan wrote it).

    Args:
        keys: the keys to read (an iterable, or a predicate on the key); None = all tensors.
        like: optional tensors giving dtype/device per key (default: the stored dtype, CPU).

    Raises:
        CheckpointError: a requested key is not in the checkpoint, or its shape differs from
            ``like``.
    """
    md = dcp.FileSystemReader(str(checkpoint.path)).read_metadata().state_dict_metadata
    stored = {k: tuple(int(x) for x in v.size) for k, v in md.items() if hasattr(v, "size")}
    if keys is None:
        wanted = list(stored)
    elif callable(keys):
        wanted = [k for k in stored if keys(k)]
    else:
        wanted = list(keys)
    source = str(checkpoint.path / MANIFEST)
    out: dict[str, torch.Tensor] = {}
    for k in wanted:
        if k not in stored:
            raise CheckpointError(source, k, "key not in checkpoint")
        shape = stored[k]
        if like is not None and k in like:
            ref = like[k]
            if tuple(ref.shape) != shape:
                raise CheckpointError(
                    source, k, f"shape {list(shape)} in checkpoint, model has {list(ref.shape)}"
                )
            out[k] = torch.empty(shape, dtype=ref.dtype, device=ref.device)
        else:
            out[k] = torch.empty(shape, dtype=md[k].properties.dtype)
    if out:
        with _quiet_single_process():
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(checkpoint.path)), no_dist=True)
    return out
