"""The run's data: its corpus and tokenizer prepared (data_sched/prepare.py), the loader of this rank's share of
every global batch (data_sched/loader.py), what the step log says about the data, and a batch's rows as the model's
input tensors."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from mindspore import Tensor

from data_sched.attention_cost import CostModel
from data_sched.loader import BatchLoader
from data_sched.prepare import TOKENIZER_FILE, prepare_data, tokenizer_in_use
from telechat_moe.recipe_schema import Recipe


def prepare_run_data(recipe: Recipe, rank: int, out: Path):
    """-> (the prepared data, the temporary folder of a tokenizer this run trained, or None). The tokenizer already
    in use (the recipe's, or the one in output_dir) is kept; otherwise every rank trains the same deterministic
    tokenizer in a temporary folder of its own, which `publish_tokenizer` moves into output_dir once the run is
    known to start."""
    cfg, d = recipe.model, recipe.data
    existing = tokenizer_in_use(d.tokenizer, out)
    if existing:
        return prepare_data(d.paths, cfg.seq_length, recipe.seed, d.eval_fraction, tokenizer_path=existing,
                            vocab_size=cfg.vocab_size, cache_dir=d.cache_dir), None
    staged = tempfile.TemporaryDirectory(prefix=f"telechat_tokenizer_rank{rank}_")
    return prepare_data(d.paths, cfg.seq_length, recipe.seed, d.eval_fraction, vocab_size=cfg.vocab_size,
                        tokenizer_out=str(Path(staged.name) / "spm"), cache_dir=d.cache_dir), staged


def publish_tokenizer(staged: tempfile.TemporaryDirectory, out: Path, rank: int) -> None:
    """The tokenizer this run trained, into output_dir atomically (every rank publishes the same file)."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / f".{TOKENIZER_FILE}.rank{rank}.{os.getpid()}"
    shutil.copyfile(Path(staged.name) / "spm.model", target)
    os.replace(target, out / TOKENIZER_FILE)
    staged.cleanup()


def train_loader(recipe: Recipe, samples, dp_rank: int) -> BatchLoader:
    """This data-parallel rank's share of every global batch, balanced as the recipe's `data:` section says."""
    d, p = recipe.data, recipe.parallel_config
    cost = CostModel.load(d.attention_cost) if d.attention_cost else None
    return BatchLoader(samples, recipe.training.global_batch_size, recipe.seed, dp_rank, p.data_parallel,
                       micro_batch_num=p.micro_batch_num, attention_balance=d.attention_balance,
                       cost_model=cost, max_context_loss=d.max_context_loss, context_parallel=p.context_parallel)


def source_shares(loader: BatchLoader) -> dict[str, float]:
    """share/<source>: each source's share of the global batch being trained, for the step log (blends only)."""
    if len(loader.samples.source_names) < 2:
        return {}
    return {f"share/{name}": v for name, v in loader.source_shares(loader.epoch, loader.index).items()}


class SampleLog:
    """data.log_samples: the ids of the samples this rank read at each step, one JSON line a step, appended to
    logs/samples_rank<r>.jsonl (a resumed run continues the file)."""

    def __init__(self, out: Path, rank: int):
        self.path = out / "logs" / f"samples_rank{rank}.jsonl"
        self.file = None

    def write(self, step: int, loader: BatchLoader) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
        ids = loader.samples_read(loader.epoch, loader.index)
        self.file.write(json.dumps({"step": step, "samples": [int(i) for i in ids]}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def position_ids(batch: int, seq: int) -> np.ndarray:
    return np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()


def batch_tensors(batch: dict, rows: slice) -> tuple:
    """The rows of a batch as the model's inputs: token ids, labels, loss mask, segment ids, positions."""
    ids = batch["input_ids"][rows]
    b, s = ids.shape
    return (Tensor(ids), Tensor(batch["labels"][rows]), Tensor(np.ones((b, s), np.float32)),
            Tensor(batch["segment_ids"][rows]), Tensor(position_ids(b, s)))
