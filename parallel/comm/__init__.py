"""The communication layer every parallel module calls: process groups from a `ParallelLayout` (`groups.py`), the
data movement of each collective on this machine (`transport.py`: MindSpore's own collectives on HCCL/NCCL, or a
CPU transport made of what mccl provides), and the collectives as Cells with gradients (`collectives.py`)."""
from parallel.comm.collectives import (AllReduce, AllToAll, AllToAllV, Broadcast, CopyToGroup, GatherFromGroup,
                                       ReduceFromGroup, ReduceScatterToGroup)
from parallel.comm.groups import Group, ProcessGroups
from parallel.comm.transport import CpuTransport, NativeTransport, transport_for

__all__ = ["AllReduce", "AllToAll", "AllToAllV", "Broadcast", "CopyToGroup", "CpuTransport", "GatherFromGroup",
           "Group", "NativeTransport", "ProcessGroups", "ReduceFromGroup", "ReduceScatterToGroup", "transport_for"]
