"""A rank's mixture-of-experts bookkeeping around a training step: the balancing losses'
gradient scale, the expert loads of the global batch, DeepSeek-V3's bias update, and the
figures of the log.

Loads are summed over the data- and context-parallel replicas, not over tensor ranks
(they route the same tokens), so every rank holding a layer moves its bias alike, as one
process would. The log's figures come from every pipeline stage, gathered on rank 0.
"""

from __future__ import annotations

import torch

from ptdp.model.gpt import GPT
from ptdp.model.moe import LayerStats
from ptdp.parallel.comm import Group, all_reduce_sum_, gather_objects


class MoESteps:
    """The MoE layers of a rank's chunks, stepped with the trainer (`ptdp.train.step.trainer`).

    Per step: `begin_step` before the forward-backward, `end_step` after it (the balancing
    losses of this rank's layers, for the logged loss; one reduction of the loads),
    `update_biases` after an applied optimizer step. `log_record` (collective over the
    pipeline group) gives the figures since the last one.
    """

    def __init__(
        self, chunks: list[GPT], *, dp_cp: Group, pp: Group, num_experts: int, tp: Group
    ) -> None:
        self.chunks, self.dp_cp, self.pp, self.tp = chunks, dp_cp, pp, tp
        self.num_experts = num_experts
        self.layers = {i: b for chunk in chunks for i, b in chunk.moe_layers().items()}
        self.loads: dict[int, torch.Tensor] = {}
        """The last step's token-choices per expert ([e], float64, global batch) by layer."""
        self._interval: dict[int, torch.Tensor] = {}
        self._steps = 0

    def begin_step(self, grad_scale: float) -> None:
        """`grad_scale`: d(step loss)/d(a microbatch's loss): 1/microbatches x loss scale."""
        for chunk in self.chunks:
            chunk.moe.begin_step(grad_scale)

    def end_step(self) -> torch.Tensor | None:
        """This rank's balancing losses (its layers' sum, mean over its microbatches, as they
        entered the optimised loss), None without MoE layers; reduces the loads."""
        if not self.layers:
            return None
        stats = {i: s for chunk in self.chunks for i, s in chunk.moe.stats.items()}
        order = sorted(self.layers)
        rows = torch.stack([self._row(stats.get(i)) for i in order])  # [layers, e + 3]
        # Each tensor rank routed its own tokens: the counts sum over tp and the replicas
        # (float64: exact up to 2**53), the losses average over them, as the loss does.
        all_reduce_sum_(rows, self.tp)
        rows[:, -2:] /= self.tp.size
        loss = rows[:, -2:].sum().float()
        all_reduce_sum_(rows, self.dp_cp)
        rows[:, -2:] /= self.dp_cp.size
        self.loads = {i: rows[j, : self.num_experts] for j, i in enumerate(order)}
        for j, i in enumerate(order):
            self._interval[i] = self._interval.get(i, 0) + rows[j]
        self._steps += 1
        return loss

    def _row(self, s: LayerStats | None) -> torch.Tensor:
        """[routed (e), dropped, aux, z] of one layer; aux and z per microbatch."""
        device = next(self.chunks[0].parameters()).device
        if s is None:  # no training forward this step
            return torch.zeros(self.num_experts + 3, dtype=torch.float64, device=device)
        losses = torch.stack([s.aux, s.z]).double() / max(s.microbatches, 1)
        return torch.cat([s.routed.double(), s.dropped.double().view(1), losses])

    @torch.no_grad()
    def update_biases(self) -> None:
        """DeepSeek-V3's step: each biased router moves towards the mean load."""
        for i, block in self.layers.items():
            if block.bias_update_rate and i in self.loads:
                block.router.update_bias(self.loads[i], block.bias_update_rate)

    def log_record(self, dropping: bool, z_loss: bool) -> dict:
        """The figures since the last call, complete on rank 0 (collective over pp):

        - moe_aux_loss: the balancing loss per step, summed over layers (part of the
          logged training `loss`, as of the optimised one; `val_loss` has none);
        - moe_z_loss (with a z-loss coefficient): the same for the z-loss;
        - moe_load: per MoE layer, in layer order, each expert's share of the token-choices
          routed in the interval (each row sums to 1);
        - moe_load_max_over_mean: the largest over layers of max_e load / mean_e load;
        - moe_dropped (`dropping`, a capacity factor): token-choices dropped per step,
          summed over layers and the global batch.
        """
        mine = {i: row.tolist() for i, row in self._interval.items()}
        steps, self._interval, self._steps = max(self._steps, 1), {}, 0
        parts = gather_objects(mine, self.pp)
        rows = {i: row for part in parts for i, row in part.items()}
        if not rows:
            return {}
        e = self.num_experts
        loads = [torch.tensor(rows[i][:e], dtype=torch.float64) for i in sorted(rows)]
        record = {
            "moe_aux_loss": sum(row[e + 1] for row in rows.values()) / steps,
            "moe_load": [(load / load.sum().clamp(min=1)).tolist() for load in loads],
            "moe_load_max_over_mean": max(
                float(load.max() / load.mean().clamp(min=1e-12)) for load in loads
            ),
        }
        if z_loss:
            record["moe_z_loss"] = sum(row[e + 2] for row in rows.values()) / steps
        if dropping:
            record["moe_dropped"] = sum(row[e] for row in rows.values()) / steps
        return record
