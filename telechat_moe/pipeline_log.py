"""The pipeline engine's per-step timeline file: each stage's step as the executor ran it, one JSON line per step
in `<output_dir>/logs/pipeline_timeline/rank_<r>.jsonl` (parallel/pipeline/timeline.py; `python -m
scripts.pipeline_timeline` draws a step beside its simulation)."""
from __future__ import annotations

import json
import resource
from pathlib import Path

from parallel.layout import Axis
from telechat_moe.metrics import keep_records_until


class TimelineLog:
    def __init__(self, out: Path, rank: int, layout, schedule, start_step: int):
        """Opened once a run starts at `start_step`: lines of later steps (of a run resumed earlier) go."""
        self.rank, self.schedule = rank, schedule
        self.pipeline = min(layout.group_of(Axis.PP, rank))
        path = out / "logs" / "pipeline_timeline" / f"rank_{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        keep_records_until(path, start_step)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, step: int, record) -> None:
        """Step `step` of this stage, with the process's peak resident set so far beside the activations the
        schedule held."""
        from parallel.pipeline.timeline import StageTimeline
        line = {"step": step, "rank": self.rank, "pipeline": self.pipeline,
                **StageTimeline.of(self.schedule, record).to_json(),
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
