"""The collectives each training step issued on this rank, as the comm layer's counters saw them
(parallel/comm/counters.py; recipe `profile.collectives: true`): logs/collectives/rank_<R>.jsonl, one line per
step with calls and bytes by kind and group.

The counters run as the device does, behind the host: a line is written once the step's weights are read back
(each collective of the step feeds them, the distributed optimizer's all-gathers last), so it holds the step's own
collectives; a held-out evaluation's forward collectives land in the line of the step after it.
"""
from __future__ import annotations

import json
from pathlib import Path

from parallel.comm.counters import COUNTERS, by_kind
from telechat_moe.metrics import keep_records_until


class CollectiveLog:
    def __init__(self, out: Path, rank: int, start_step: int):
        """Opened once a run starts at `start_step`: lines of later steps (of a run resumed earlier) go."""
        self.rank = rank
        path = out / "logs" / "collectives" / f"rank_{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        keep_records_until(path, start_step)
        COUNTERS.take()         # what ran before the first step (checkpoint loading, setup) is not a step's
        self.file = open(path, "a", encoding="utf-8")

    def write(self, step: int, weights) -> None:
        """Step `step`'s line, once `weights` (every weight the step updates) are read back."""
        for w in weights:
            w.asnumpy()
        records = COUNTERS.take()
        line = {"step": step, "rank": self.rank, "bytes_by_kind": by_kind(records), "collectives": records}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_step(out: Path, rank: int, step: int) -> dict:
    """Rank `rank`'s line of step `step` in a run's logs."""
    path = Path(out) / "logs" / "collectives" / f"rank_{rank}.jsonl"
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return record
    raise KeyError(f"{path}: no line of step {step}")
