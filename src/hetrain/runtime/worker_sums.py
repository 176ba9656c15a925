"""The per-step sums of a :class:`hetrain.runtime.engine.Worker`: the loss sum, the squared
gradient norm, the item count, the got-gradient flags and the report rows, combined over the
ranks in one flat vector (docs/runtime.md "Per-step collectives"). :class:`StepSums` is a base
of ``Worker`` and uses its attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hetrain.runtime.data_parallel import GradientSync
from hetrain.runtime.worker_state import Unit


class StepSums:
    """Got-gradient flags, the step's sums vector and gradient norms of one rank (a base of
    :class:`hetrain.runtime.engine.Worker`)."""

    def _local_grad_flags(self) -> torch.Tensor:
        """``(T,)`` float64 over the trainable tensors (:attr:`_grad_index` order): 1 where a
        tensor held here got a gradient in this rank's backward (before the gradient sync
        fills zeros), else 0."""
        flags = [0.0] * len(self._grad_index)
        for name in self._held:
            i = self._grad_index.get(name)
            if i is not None and self.chain.tensors[name].grad is not None:
                flags[i] = 1.0
        return torch.tensor(flags, dtype=torch.float64, device=self.device)

    def _drop_absent_grads(self, counts: Sequence[float]) -> None:
        """Set ``.grad = None`` on held tensors that no rank gave a gradient this step
        (``counts`` = :meth:`_local_grad_flags` summed over the ranks, as floats), so the
        optimizer skips them as it does in one process (no weight decay, no momentum step)."""
        absent = {i for i, v in enumerate(counts) if v == 0}
        if not absent:
            return
        for name in self._held:
            if self._grad_index.get(name) in absent:
                self.chain.tensors[name].grad = None

    # ----------------------------------------------------------------------------- step sums
    # Per step the engine combines, over all ranks: the loss sum, the squared gradient norm,
    # the item count and kind of a (sum, count) loss, the random-op flag and the callers'
    # report rows (one flat float vector, docs/runtime.md "Per-step collectives"):
    # - every rank an active owner of every layer (pure data parallelism): appended to the
    #   last gradient bucket's all-reduce; the norm is computed locally from the combined
    #   gradients (the same on every rank): no collective beyond the gradient all-reduce;
    # - else, when the optimizer step needs them (clipping, or a (sum, count) loss, or the
    #   loss kind not known yet: the first step): one blocking world all-reduce;
    # - else: a non-blocking world all-reduce, completed at the end of the next step.
    def _arm(self, grad_sync: GradientSync) -> Callable[..., None] | None:
        def arm(loss_sum: torch.Tensor, count_sum: torch.Tensor, sum_mode: bool) -> None:
            self._step_sums = (loss_sum, count_sum, sum_mode)
            if self.overlap_grad_sync:
                grad_sync.arm()

        return arm

    def _report_row(self) -> list[float]:
        return [float(v) for v in self._report()] if self._report is not None else []

    def _sums_vector(
        self,
        loss: torch.Tensor,
        count: torch.Tensor,
        sum_mode: bool,
        sqnorm: float,
        got_grad: torch.Tensor,
    ) -> torch.Tensor:
        """``[loss sum, squared norm, count, (sum, count) flag, random-op flag, got-gradient
        flags (one per trainable tensor, :meth:`_local_grad_flags`), report rows (one per
        rank)]`` of this rank, float64: summed over the ranks it gives the step's totals."""
        random_problem = float(bool(self.randomness.problems) and not self._random_reported)
        row = self._report_row()
        values = [float(loss), sqnorm, float(count), float(sum_mode), random_problem]
        values += got_grad.tolist()
        if row:
            values += [0.0] * (self.rank * len(row)) + row
            values += [0.0] * ((self.world_size - self.rank - 1) * len(row))
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def _carried_sums(self) -> torch.Tensor:
        """The sums vector appended to the last gradient bucket (norm slot 0: local); it is
        made when that bucket is launched, before any combined gradient is written back, so
        the got-gradient flags are this rank's own."""
        loss, count, sum_mode = self._step_sums or (0.0, 0.0, False)
        return self._sums_vector(loss, count, sum_mode, 0.0, self._local_grad_flags())

    def _sqnorm(self, units: Sequence[Unit]) -> float:
        """Squared L2 norm of the gradients of ``units`` (``torch.nn.utils.get_total_norm``:
        per-tensor norms in the gradients' dtype, fused, as ``clip_grad_norm_`` computes them;
        a per-tensor float64 ``pow(2).sum()`` loop took 3-12x as long)."""
        grads = [p.grad for u in units for p in self._unit_params(u) if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, 2.0)) ** 2

    def _sqnorm_canonical(self) -> float:
        """Squared gradient norm of the units this rank canonically owns."""
        return self._sqnorm([u for u in self._all_units() if self._canonical(u) == self.rank])

    def _local_sqnorm(self) -> float:
        """Squared norm of the whole combined gradient, every unit held here, in the same
        order on every rank (so every rank computes the same value)."""
        return self._sqnorm(self._all_units())

    def _finish_late(self) -> None:
        """Complete the previous step's non-blocking sums (every rank at the same step) and
        act on its random-op flag."""
        late, self._late = self._late, None
        if late is None:
            return
        late.resolve()
        if late.random_problems > 0:
            self._report_random_problems()
