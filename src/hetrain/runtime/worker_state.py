"""The tensors a :class:`hetrain.runtime.engine.Worker` holds and how they move: units (a
layer's own tensors, or one shared tensor), their optimizers, materialising and releasing them
(``meta``), a plan change (:meth:`LayerState.apply_plan`) and the checkpoint state dicts
(docs/model.md §2, §7; docs/runtime.md). :class:`LayerState` is a base of ``Worker`` and uses
its attributes (``chain``, ``layout``, ``rank``, ``optimizers``...).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.plan import Plan
from hetrain.runtime.emulation import sleep_s
from hetrain.runtime.layout import Layout, build_layout
from hetrain.runtime.migrate import plan_transfers, recv_object, send_object
from hetrain.runtime.norm import check_plan_norm_block
from hetrain.runtime.optim import load_state
from hetrain.runtime.step_result import MigrationResult

Unit = int | str  # a layer's own tensors (its index) or one shared tensor (its name)


def _plan_digest(plan: Plan) -> str:
    """Hash of what the engine executes (groups, stages, shares, micro-batches, schedule)."""
    body = json.dumps([plan.schedule, [g.model_dump(mode="json") for g in plan.groups]])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _check_agreement(gathered: list[Any], mine: tuple, names: tuple[str, ...]) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks were given different plans
    or models (``gathered[r] = (device_id, digest, ...)``), instead of hanging later."""
    for position, name in enumerate(names, start=1):
        values = {g[position] for g in gathered}
        if len(values) > 1:
            by_rank = ", ".join(f"rank {r} ({g[0]}): {g[position]}" for r, g in enumerate(gathered))
            raise ValueError(
                f"ranks were given different {name}s ({by_rank}); every rank "
                f"must pass the same {name}"
            )


def _check_norm_plan(layout: Layout, norm_block: int | None) -> None:
    """InputError (every rank) if a group's share or micro-batch size is not a multiple of the
    norm block (:func:`hetrain.runtime.norm.check_plan_norm_block`)."""
    groups = [(g.index, g.batch, g.microbatch_size) for g in layout.groups]
    check_plan_norm_block(groups, norm_block)


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty_like(t, device="meta")
    return nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m


def _real_copy(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(t, nn.Parameter):
        return nn.Parameter(value, requires_grad=t.requires_grad)
    return value


class LayerState:
    """Units, their optimizers, plan changes and state dicts of one rank (a base of
    :class:`hetrain.runtime.engine.Worker`)."""

    def _nbytes(self, name: str) -> int:
        t = self.chain.tensors[name]
        return t.numel() * t.element_size()

    def _unit_names(self, unit: Unit) -> list[str]:
        return [unit] if isinstance(unit, str) else self._private[unit]

    def _unit_params(self, unit: Unit) -> list[nn.Parameter]:
        return [self.chain.tensors[n] for n in self._unit_names(unit) if not self.chain.frozen(n)]

    def _units(self, layout: Layout) -> list[Unit]:
        """Units this rank holds under ``layout``: its layers, then the shared tensors they
        use."""
        owned = layout.owned_layers(self.rank)
        shared = [n for n, layers in self.shared.items() if any(layer in owned for layer in layers)]
        return [*owned, *shared]

    def _held_names(self, layout: Layout) -> set[str]:
        return {
            n for layer in layout.owned_layers(self.rank) for n in self.chain.layer_tensors[layer]
        }

    def _materialize(self, name: str, value: torch.Tensor) -> None:
        t = self.chain.tensors[name]
        if t.device == value.device and t.device.type != "meta":
            with torch.no_grad():
                t.copy_(value)
        else:
            torch.utils.swap_tensors(t, _real_copy(t, value.to(dtype=t.dtype)))
        t.grad = None
        self._held.add(name)

    def _release(self, name: str) -> None:
        t = self.chain.tensors[name]
        t.grad = None
        if t.device.type != "meta":
            torch.utils.swap_tensors(t, _meta_copy(t))
        self._held.discard(name)

    def _build_optimizer(self, unit: Unit) -> torch.optim.Optimizer | None:
        """The unit's own optimizer (None without trainable parameters: frozen parameters get
        no optimizer state)."""
        names = [n for n in self._unit_names(unit) if not self.chain.frozen(n)]
        if not names:
            return None
        groups = [self._group_of[n] for n in names] if self._group_of else None
        return self.optimizer_spec.build([self.chain.tensors[n] for n in names], groups)

    def _optimizer_names(self, unit: Unit, opt: torch.optim.Optimizer) -> list[str]:
        """Local names of ``opt``'s parameters in its ``state_dict`` order (group by group)."""
        return [
            self._local(unit, self.chain._name_of[id(p)])
            for group in opt.param_groups
            for p in group["params"]
        ]

    def _canonical(self, unit: Unit, layout: Layout | None = None) -> int:
        layout = layout or self.layout
        if isinstance(unit, int):
            return layout.canonical[unit]
        for layer in self.shared[unit]:  # the first active holder (plan order of its layers)
            if layout.active_owners[layer]:
                return layout.active_owners[layer][0]
        return layout.owners[self.shared[unit][0]][0]

    # ----------------------------------------------------------------------------- plan change
    def _unit_payload(self, unit: Unit) -> dict[str, Any]:
        names = self._unit_names(unit)
        opt = self.optimizers.get(unit)
        return {
            "tensors": {n: self.chain.tensors[n].detach() for n in names},
            "optim": None if opt is None else opt.state_dict(),
        }

    def apply_plan(self, plan: Plan) -> MigrationResult:
        """Switch to ``plan`` between steps (collective: call on every rank with the same plan).

        Layers move with their parameters, buffers and optimizer state from an old owner to
        each new owner; a shared tensor moves (with its optimizer state) to every new holder
        that lacks it; tensors no longer held are released (``meta``). The new plan may leave
        ranks out (they hold nothing and only join the collectives).

        Raises:
            InputError: the plan names unknown devices or does not cover the layers.
        """
        t0 = time.perf_counter()
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, (self.device_id, _plan_digest(plan)))
        _check_agreement(digests, (self.device_id, _plan_digest(plan)), ("plan",))
        new = build_layout(plan, self.layout.devices, self.layout.num_layers, require_all=False)
        _check_norm_plan(new, self.norm.norm_block)
        old = self.layout
        transfers: list[tuple[Unit, int, int]] = [
            (t.layer, t.src, t.dst) for t in plan_transfers(old, new)
        ]
        # shared tensors: holders = ranks holding any layer that uses them
        sends: dict[int, int] = {}
        for name, layers in self.shared.items():
            have = sorted({r for layer in layers for r in old.owners[layer]})
            want = sorted({r for layer in layers for r in new.owners[layer]})
            for dst in want:
                if dst not in have:
                    src = min(have, key=lambda r: (sends.get(r, 0), r))
                    sends[src] = sends.get(src, 0) + 1
                    transfers.append((name, src, dst))
        sent = received = 0
        for unit, src, dst in transfers:
            if src == self.rank:
                sent += send_object(self._unit_payload(unit), dst, self.device)
            elif dst == self.rank:
                t_recv = time.perf_counter()
                payload, nbytes = recv_object(src, self.device)
                received += nbytes
                if self.emulation is not None and self.emulation.limits_links():
                    link = (self.layout.devices[src], self.device_id)
                    duration = self.emulation.transfer_time_s(*link, nbytes)
                    sleep_s(duration - (time.perf_counter() - t_recv))
                for n, value in payload["tensors"].items():
                    self._materialize(n, value.to(self.device))
                opt = self._build_optimizer(unit)
                if opt is not None and payload["optim"] is not None:
                    load_state(opt, payload["optim"])
                self.optimizers[unit] = opt
        now_units = set(self._units(new))
        for unit in list(self.optimizers):
            if unit not in now_units:
                del self.optimizers[unit]
        keep = self._held_names(new)
        for name in list(self._held):
            if name not in keep:
                self._release(name)
        self.layout = new
        self._setup_buckets()
        return MigrationResult(len(transfers), sent, received, time.perf_counter() - t0)

    # ----------------------------------------------------------------------------- state
    def _all_units(self) -> list[Unit]:
        return [*range(self.layout.num_layers), *self.shared]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gather the whole model on rank 0 (collective): a plain ``state_dict`` with the keys of
        the original module (tied tensors under each of their keys, the same tensor), CPU
        tensors in the worker's dtype; loads into the original module without hetrain. None on
        other ranks."""
        out: dict[str, torch.Tensor] = {}
        for unit in self._all_units():
            src = self._canonical(unit)
            names = self._unit_names(unit)
            if src == self.rank and self.rank == 0:
                sd = {n: self.chain.tensors[n].detach().cpu().clone() for n in names}
            elif src == self.rank:
                send_object({n: self.chain.tensors[n].detach() for n in names}, 0, self.device)
                continue
            elif self.rank == 0:
                sd, _ = recv_object(src, self.device)
            else:
                continue
            out.update(sd)
        if self.rank != 0:
            return None
        keyed: dict[str, torch.Tensor] = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            name = self.chain._name_of.get(id(t))
            if name is not None and name in out:
                keyed[key] = out[name]
        return keyed

    def _local(self, unit: Unit, name: str) -> str:
        if (
            isinstance(unit, int)
            and name.startswith(f"{unit}.")
            and isinstance(self.module, nn.Sequential)
        ):
            return name[len(f"{unit}.") :]
        return name

    def _key(self, unit: Unit) -> str:
        return f"layers.{unit}" if isinstance(unit, int) else "shared"

    def layer_state_dict(self, *, replicas: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors as flat tensors for checkpoints: ``"layers.{l}.{name}"`` (a
        layer's own tensors), ``"shared.{name}"`` (a shared tensor, once), and
        ``"optim.{l}.{param}.{state}"`` / ``"optim.shared.{name}.{state}"`` (optimizer state,
        e.g. ``exp_avg``, ``step``; absent before the first step). Frozen parameters and
        buffers (BatchNorm statistics) are saved, with no optimizer state.

        Args:
            replicas: False (default): only units whose canonical owner is this rank (each
                tensor once across the world, for saving); True: every unit held here.
        """
        out: dict[str, torch.Tensor] = {}
        for unit in self._units(self.layout):
            if not replicas and self._canonical(unit) != self.rank:
                continue
            for n in self._unit_names(unit):
                out[f"{self._key(unit)}.{self._local(unit, n)}"] = self.chain.tensors[n].detach()
            opt = self.optimizers.get(unit)
            if opt is None:
                continue
            names = self._optimizer_names(unit, opt)
            okey = f"optim.{unit}" if isinstance(unit, int) else "optim.shared"
            for pidx, pstate in opt.state_dict()["state"].items():
                for key, value in pstate.items():
                    if isinstance(value, torch.Tensor):
                        out[f"{okey}.{names[pidx]}.{key}"] = value
        return out

    def load_layer_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load this rank's tensors (and their optimizer state when present) from a dict in the
        :meth:`layer_state_dict` format; entries of other layers are ignored.

        Raises:
            KeyError: a held tensor is missing.
        """
        for unit in self._units(self.layout):
            prefix = self._key(unit)
            for n in self._unit_names(unit):
                key = f"{prefix}.{self._local(unit, n)}"
                if key not in state_dict:
                    raise KeyError(f"layer_state_dict: {prefix} lacks {self._local(unit, n)!r}")
                self._materialize(n, state_dict[key].to(self.device))
            okey = f"optim.{unit}." if isinstance(unit, int) else "optim.shared."
            opt = self._build_optimizer(unit)
            names = (
                {n: i for i, n in enumerate(self._optimizer_names(unit, opt))}
                if opt is not None
                else {}
            )
            ostate: dict[int, dict[str, torch.Tensor]] = {}
            for k, v in state_dict.items():
                if k.startswith(okey):
                    pname, key = k[len(okey) :].rsplit(".", 1)
                    if pname in names:
                        ostate.setdefault(names[pname], {})[key] = v
            if ostate and opt is not None:
                groups = opt.state_dict()["param_groups"]
                load_state(opt, {"state": ostate, "param_groups": groups})
            self.optimizers[unit] = opt
