"""Plans (docs/model.md §7): the small serialisable value that the planner produces and the
simulator
and the runtime consume.

``{"plan_id": 3, "schedule": "1f1b", "groups": [{"devices": ["a", "b"], "stages": [[0, 3],
[3, 8]], "microbatch_size": 4, "batch": 12}, ...], "iteration_time_s": T, "lower_bound_s": T_LB,
"cost": {"money": y_money, "energy": y_energy}}``

Group ``g`` runs a pipeline over ``devices`` in order; device ``k`` holds layers
``stages[k] = [start, end)``; ``batch`` is its share ``b_g`` of the global batch (0 = idle).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetrain._io import MAX_BATCH, check_finite_tree, read_structured
from hetrain.errors import InputError, from_validation_error

Schedule = Literal["1f1b", "gpipe"]


class GroupPlan(BaseModel):
    """One data-parallel group: a pipeline over ``devices`` with contiguous ``stages``
    (``[start, end)`` layer ranges, one per device, 0-based), ``microbatch_size`` μ_g samples
    and share ``batch`` b_g samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    devices: tuple[str, ...] = Field(min_length=1)
    stages: tuple[tuple[int, int], ...] = Field(min_length=1)
    microbatch_size: int = Field(ge=1, le=MAX_BATCH)
    batch: int = Field(ge=0, le=MAX_BATCH)

    @model_validator(mode="after")
    def _check(self) -> GroupPlan:
        if len(self.stages) != len(self.devices):
            raise ValueError(
                f"stages: expected one stage per device ({len(self.devices)}), "
                f"got {len(self.stages)}"
            )
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("devices: a device appears twice in the group")
        expect = 0
        for k, (start, end) in enumerate(self.stages):
            if start != expect:
                raise ValueError(
                    f"stages[{k}]: expected contiguous stages starting at layer {expect}, "
                    f"got [{start}, {end})"
                )
            if end <= start:
                raise ValueError(f"stages[{k}]: expected a non-empty range, got [{start}, {end})")
            expect = end
        return self

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_microbatches(self) -> int:
        """``n_g = ceil(b_g / μ_g)`` (docs/model.md §3); 0 when idle."""
        return -(-self.batch // self.microbatch_size)

    @property
    def structure(self) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
        """Devices and stages (what a migration depends on; shares excluded)."""
        return (self.devices, self.stages)


class Plan(BaseModel):
    """A full plan for one slot (docs/model.md §7). Figures (``iteration_time_s``,
    ``lower_bound_s``,
    ``cost``) are optional on input and filled by the planner."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    plan_id: int | None = None
    schedule: Schedule = "1f1b"
    groups: tuple[GroupPlan, ...] = Field(min_length=1)
    iteration_time_s: float | None = Field(None, ge=0)
    lower_bound_s: float | None = Field(None, ge=0)
    cost: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check(self) -> Plan:
        seen: dict[str, int] = {}
        for g, group in enumerate(self.groups):
            for d in group.devices:
                if d in seen:
                    raise ValueError(
                        f"groups[{g}].devices: device {d!r} is also in groups[{seen[d]}]"
                    )
                seen[d] = g
        return self

    @property
    def global_batch(self) -> int:
        return sum(g.batch for g in self.groups)

    @property
    def devices(self) -> list[str]:
        """All devices named by the plan (used or idle), group by group, in pipeline order."""
        return [d for g in self.groups for d in g.devices]

    def structure(self) -> tuple:
        """Groups and stages without shares; plans with equal structure need no migration
        (docs/model.md §7: share-only changes are not plan changes)."""
        return tuple(sorted(g.structure for g in self.groups if g.batch > 0))

    def validate_for(
        self, device_ids: list[str] | tuple[str, ...], num_layers: int, batch: int, source: str
    ) -> None:
        """Check the plan against a cluster, a model and the global batch ``B``.

        Raises:
            InputError: unknown device, stages not covering ``[0, num_layers)``, or shares not
                summing to ``batch``.
        """
        known = set(device_ids)
        for g, group in enumerate(self.groups):
            for k, d in enumerate(group.devices):
                if d not in known:
                    raise InputError(
                        source,
                        f"groups[{g}].devices[{k}]",
                        f"expected a device id of the cluster, got {d!r}",
                    )
            end = group.stages[-1][1]
            if end != num_layers:
                raise InputError(
                    source,
                    f"groups[{g}].stages",
                    f"expected stages covering layers [0, {num_layers}), last stage ends at {end}",
                )
        if self.global_batch != batch:
            raise InputError(
                source,
                "groups[].batch",
                f"expected shares summing to the global batch {batch}, got {self.global_batch}",
            )

    def with_idle_groups(self, device_ids: Sequence[str]) -> Plan:
        """This plan with an idle group (``b_g = 0``, the whole model as one stage) for each
        of ``device_ids`` it does not name: a runtime's first plan must name every rank, and
        idle groups hold nothing and are sent nothing. The model's layer count is the end of
        the plan's last stage."""
        named = set(self.devices)
        missing = [d for d in device_ids if d not in named]
        if not missing:
            return self
        num_layers = self.groups[0].stages[-1][1]
        idle = tuple(
            GroupPlan(devices=(d,), stages=((0, num_layers),), microbatch_size=1, batch=0)
            for d in missing
        )
        return self.model_copy(update={"groups": (*self.groups, *idle)})

    def to_json_dict(self) -> dict[str, Any]:
        """The docs/model.md §7 plan object (stages as lists)."""
        data = self.model_dump(mode="json", exclude_none=True)
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """docs/model.md §7 JSON text; :func:`plan_from_dict` of ``json.loads`` of it gives an equal
        plan."""
        return json.dumps(self.to_json_dict(), indent=indent)


def check_norm_block(plan: Plan, norm_block: int | None, source: str = "<plan>") -> None:
    """Check that every group's share ``batch`` and ``microbatch_size`` are multiples of the
    norm block ``G`` (docs/model.md §5: ghost batch norm over aligned blocks of ``G`` samples needs
    every micro-batch to hold whole blocks). No check when ``norm_block`` is None.

    Raises:
        InputError: naming the first group (``groups[g].batch`` or
            ``groups[g].microbatch_size``) that breaks the rule.
    """
    if norm_block is None:
        return
    g_size = int(norm_block)
    for g, group in enumerate(plan.groups):
        if group.batch % g_size:
            raise InputError(
                source,
                f"groups[{g}].batch",
                f"expected a share that is a multiple of the norm block {g_size}, "
                f"got {group.batch}",
            )
        if group.batch > 0 and group.microbatch_size % g_size:
            raise InputError(
                source,
                f"groups[{g}].microbatch_size",
                f"expected a micro-batch size that is a multiple of the norm block {g_size}, "
                f"got {group.microbatch_size}",
            )


def plan_from_dict(raw: Any, source: str = "<plan>") -> Plan:
    """Validate an already-parsed plan object.

    Raises:
        InputError: any invalid field (one line: source, field, expectation).
    """
    if not isinstance(raw, dict):
        raise InputError(source, "", "expected a mapping with key 'groups'")
    check_finite_tree(source, raw)
    try:
        return Plan.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(source, exc, Plan) from None


def load_plan(path: str | Path) -> Plan:
    """Load and validate a plan file (JSON or YAML, docs/model.md §7).

    Raises:
        InputError: missing file, bad syntax or an invalid field.
    """
    return plan_from_dict(read_structured(path), str(path))
