"""Replicas of hot experts in spare slots (`expert_placement.spare_slots` R > 0): where a routed copy goes, and the
copies' gradients summed.

Rank r of the EP group holds S = E/ep + R slots: the home slots of its labels [r*E/ep, (r+1)*E/ep) (as without
replicas) and R spare slots, each empty or holding a replica of one expert. `ExpertSlots` maps the router's labels
to global slots (rank * S + slot): token t's copy routed to an expert with c copies goes to its copy t % c, so a
replicated expert's tokens divide evenly between its ranks (the planner's assumption). A replica computes with its
home copy's weights; `SumReplicaGradients` adds the gradients of all copies of an expert and hands the sum to each,
so with the Adam moments moved along with the replica every copy takes the same update and they stay equal.

The tables (written by the migrator, telechat_moe/expert_placement.py; not trained) and the spare slots' weights
and moments are not checkpointed (`outside_checkpoints`): they depend on the EP degree, and a replica equals its
home copy, so the trainer state's list of the spare slots' experts rebuilds them.
    copies [E]          copies per label
    targets [E, 1 + ep*R]  the global slot of each copy (home first; unused columns repeat the home slot)
    slot_label [ep*S]   the label each global slot holds (E: an empty spare slot)
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from parallel.comm import GatherFromGroup


def outside_checkpoints(name: str) -> bool:
    """A spare slot's weight or moment, or a slot table: rebuilt from the trainer state, not saved."""
    return name.endswith("_spare") or ".slots." in f".{name}"


def home_slots(num_experts: int, ep: int, spare: int) -> np.ndarray:
    """The global slot of each label's home copy."""
    per = num_experts // ep
    labels = np.arange(num_experts)
    return (labels // per) * (per + spare) + labels % per


def slot_tables(num_experts: int, ep: int, spare_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(copies, targets, slot_label) for spare slots holding `spare_labels` [ep, R] (-1: empty)."""
    r = spare_labels.shape[1]
    per = num_experts // ep
    home = home_slots(num_experts, ep, r)
    copies = np.ones(num_experts, np.int32)
    targets = np.repeat(home[:, None], 1 + ep * r, 1).astype(np.int32)
    slot_label = np.full((ep, per + r), num_experts, np.int32)
    slot_label[:, :per] = np.arange(num_experts).reshape(ep, per)
    for rank in range(ep):
        for i, label in enumerate(spare_labels[rank]):
            if label >= 0:
                targets[label, copies[label]] = rank * (per + r) + per + i
                copies[label] += 1
                slot_label[rank, per + i] = label
    return copies, targets, slot_label.reshape(-1)


class ExpertSlots(nn.Cell):
    def __init__(self, num_experts: int, ep: int, spare: int):
        super().__init__()
        copies, targets, slot_label = slot_tables(num_experts, ep, np.full((ep, spare), -1))
        self.copies = Parameter(Tensor(copies), name="copies", requires_grad=False)
        self.targets = Parameter(Tensor(targets), name="targets", requires_grad=False)
        self.slot_label = Parameter(Tensor(slot_label), name="slot_label", requires_grad=False)

    def construct(self, indices):
        """indices [T, k]: labels (-1: a dropped copy) -> [T, k] global slots (-1 kept)."""
        t, k = indices.shape
        label = ops.maximum(indices, 0)
        n = ops.gather(self.copies, label.reshape(-1), 0).reshape(t, k)
        copy = ops.arange(0, t, dtype=ms.int32).reshape(t, 1) % n
        slot = ops.gather_nd(self.targets, ops.stack((label, copy), -1))
        return ops.stop_gradient(ops.where(indices >= 0, slot, -1))


class SumReplicaGradients(nn.Cell):
    """The step's gradients (in `weights`' order) with every expert's copies' gradients summed onto each copy: per
    MoE layer its home and spare weights' gradients gathered over the EP group by slot, summed by label, and each
    slot given its label's sum. `layers`: per MoE layer ((home, spare) weight pairs, its ExpertSlots)."""

    def __init__(self, weights, layers: list, num_experts: int, ep_transport, index: int):
        super().__init__(auto_prefix=False)
        position = {id(w): i for i, w in enumerate(weights)}
        role = [(-1, 0)] * len(weights)
        pairs, tables = [], []
        for pairs_of_layer, slots in layers:
            for home, spare in pairs_of_layer:
                j = len(pairs)
                pairs.append((position[id(home)], position[id(spare)], len(tables)))
                role[position[id(home)]], role[position[id(spare)]] = (j, 0), (j, 1)
            tables.append(slots.slot_label)
        self.pairs, self.role = tuple(pairs), tuple(role)
        self.labels = ParameterTuple(tables)
        self.experts = num_experts
        self.gather = GatherFromGroup(ep_transport)
        self.index = index

    def construct(self, grads):
        summed = ()
        for j in range(len(self.pairs)):
            home, spare, t = self.pairs[j]
            local = ops.concat((grads[home], grads[spare]), 0)
            slots = local.shape[0]
            labels = self.labels[t]
            sums = ops.unsorted_segment_sum(self.gather(local), labels, self.experts + 1)
            mine = ops.gather(sums, labels[self.index * slots:(self.index + 1) * slots], 0)
            per = grads[home].shape[0]
            summed = summed + (mine[:per], mine[per:])
        out = ()
        for i in range(len(grads)):
            j, part = self.role[i]
            if j < 0:
                out = out + (grads[i],)
            else:
                out = out + (summed[2 * j + part],)
        return out
