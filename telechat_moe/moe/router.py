"""Top-k token-choice router: sigmoid or softmax scores, optional group-limited choice, an expert bias for
aux-loss-free balancing, a sequence-level auxiliary loss, an optional device-level (EP-group) balance loss and an
optional z-loss.

The expert bias only changes which experts are chosen, never the combine weights, and it is not trained by the
gradient: `update_expert_bias` moves it after each step towards equal load (DeepSeek-V3's rule).

Under tensor parallelism each rank routes its own 1/tp of the sequence positions (every token is routed once, by
one rank), and the losses' statistics (per-sequence counts and score sums, the z-loss sum) are summed over the
tensor-parallel group first, so each rank's balance losses are those of the whole sequences.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from parallel.comm import ReduceFromGroup
from parallel.tp.layers import full_normal
from parallel.tp.mappings import TensorParallel
from telechat_moe.config import ModelConfig
from telechat_moe.layers import logsumexp


class TopKRouter(nn.Cell):
    def __init__(self, cfg: ModelConfig, expert_groups: int = 1, seed=(0, 0), tp: TensorParallel = TensorParallel()):
        """`expert_groups` (D): the expert-parallel degree; the device-level balance loss treats experts
        [d*E/D, (d+1)*E/D) as the group on rank d of the EP group. `tp`: the group whose ranks each route a
        share of the sequence positions (see the module docstring)."""
        super().__init__()
        e = cfg.n_routed_experts
        if isinstance(expert_groups, bool) or not isinstance(expert_groups, (int, np.integer)) \
                or expert_groups < 1 or e % expert_groups:
            raise ValueError(f"expert_groups: expected a positive divisor of n_routed_experts={e}, "
                             f"got {expert_groups!r}")
        self.cfg = cfg
        self.expert_groups = int(expert_groups)
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.weight = Parameter(Tensor(full_normal((e, cfg.hidden_size), cfg.initializer_range, seed)),
                                name="weight")
        # the sums over the tp group (identity at tp=1); the backward passes each rank its own share
        self.over_tp = ReduceFromGroup(tp.transport) if tp.tp > 1 else nn.Identity()
        self.tp = tp.tp
        self.expert_bias = Parameter(Tensor(np.zeros(e, np.float32)), name="expert_bias", requires_grad=False)
        self.matmul = ops.MatMul(transpose_b=True)
        self.on_value, self.off_value = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        self.zero = Tensor(0.0, ms.float32)

    def _choice_scores(self, scores):
        choice = scores
        if self.cfg.moe_router_enable_expert_bias:
            choice = choice + self.expert_bias
        if self.cfg.n_group > 1:
            t, g = choice.shape[0], self.cfg.n_group
            grouped = choice.reshape(t, g, self.num_experts // g)
            if self.cfg.scoring_func == "sigmoid":
                group_scores = ops.topk(grouped, 2)[0].sum(-1)
            else:
                group_scores = ops.amax(grouped, -1)
            group_idx = ops.topk(group_scores, self.cfg.topk_group)[1]
            group_mask = ops.one_hot(group_idx, g, self.on_value, self.off_value).sum(1)
            expert_mask = ops.broadcast_to(ops.expand_dims(group_mask, -1), grouped.shape).reshape(t, -1)
            choice = choice * expert_mask
        return ops.stop_gradient(choice)

    def construct(self, x, batch: int):
        """x [T, h] (T = batch * seq) -> indices [T, k], weights [T, k], aux loss, z loss, load [E]."""
        logits = self.matmul(x.astype(ms.float32), self.weight)
        if self.cfg.scoring_func == "sigmoid":
            scores = ops.sigmoid(logits)
        else:
            scores = ops.softmax(logits, -1)
        indices = ops.topk(self._choice_scores(scores), self.top_k)[1]
        weights = ops.gather_elements(scores, 1, indices)
        if self.cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * self.cfg.routed_scaling_factor

        selected = ops.one_hot(indices, self.num_experts, self.on_value, self.off_value).sum(1)  # [T, E]
        load = selected.sum(0)
        aux = self._sequence_aux_loss(scores, selected, batch)
        if self.cfg.moe_device_aux_loss_coeff > 0:
            aux = aux + self._device_aux_loss(scores, load)
        z = self.zero
        if self.cfg.moe_z_loss_coeff > 0:
            z = self.over_tp(ops.square(logsumexp(logits, -1)).sum()) / (logits.shape[0] * self.tp) \
                * self.cfg.moe_z_loss_coeff
        return indices.astype(ms.int32), weights, aux, z, ops.stop_gradient(load)

    def _sequence_aux_loss(self, scores, selected, batch: int):
        """alpha * sum_e f_e * P_e per sequence, averaged over sequences (DeepSeek-V3, eq. 17-20)."""
        local = scores.shape[0] // batch
        seq = local * self.tp
        e, k = self.num_experts, self.top_k
        counts = self.over_tp(ops.stop_gradient(selected).reshape(batch, local, e).sum(1))
        f = ops.stop_gradient(counts) * (e / (k * seq))
        normed = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        p = self.over_tp(normed.reshape(batch, local, e).sum(1)) / seq
        return (f * p).sum(-1).mean() * self.cfg.moe_aux_loss_coeff

    def _device_aux_loss(self, scores, load):
        """alpha_2 * sum_d f'_d * P'_d over the D expert groups, on the whole micro-batch (DeepSeek-V2, eq. 15-17):
        f'_d the mean of f_e = E / (k T) * load_e over group d's experts (a count, no gradient), P'_d the sum over
        them of P_e, the mean over the T tokens of the normalised score (as in the sequence-level loss)."""
        t = scores.shape[0] * self.tp
        e, k, d = self.num_experts, self.top_k, self.expert_groups
        f = ops.stop_gradient(self.over_tp(load)) * (e / (k * t))
        normed = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        p = self.over_tp(normed.sum(0)) / t
        f_group = f.reshape(d, e // d).mean(-1)
        p_group = p.reshape(d, e // d).sum(-1)
        return (f_group * p_group).sum() * self.cfg.moe_device_aux_loss_coeff


def expert_bias_delta(load: np.ndarray, rate: float) -> np.ndarray:
    """The aux-loss-free update: raise the bias of under-loaded experts, lower over-loaded ones, by `rate`."""
    load = np.asarray(load, dtype=np.float64)
    return (rate * np.sign(load.mean(-1, keepdims=True) - load)).astype(np.float32)
