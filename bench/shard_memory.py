"""What each rank of a parallel run holds, measured, against the dry run's figure and the one-process run's Adam state.

Reads the runs `bench.layout_agreement --out DIR` kept (each layout's msrun logs and, when the runs saved at their
last step, their checkpoints):

- the trainer's `[memory]` line of every rank: the bytes it measured (every Parameter it holds: weights, optimizer
  state, gradient buffers) and the dry run's figure for its stage (`rank_static_bytes`), and their difference;
- the Adam state in each rank's last checkpoint (the bytes of its adam_m / adam_v tensors, read off the
  safetensors header) as a share of the one-process run's, beside 1/dp (the issue's bound: at most 1/dp, plus the
  padding of buckets that do not divide).

    .venv/bin/python -m bench.layout_agreement --steps 30 --layout dp2 ... --set parallel_config.optimizer_shard=true \\
        --set training.save_interval=30 --out DIR
    .venv/bin/python -m bench.shard_memory DIR [--markdown FILE]
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from oneline import OneLineParser

MEMORY = re.compile(r"\[memory\] rank (\d+) holds ([\d,]+) bytes .* the dry run says ([\d,]+)")


def adam_bytes(checkpoint: Path) -> int:
    """Bytes of the adam_m.* / adam_v.* tensors of a checkpoint's weights.safetensors, from its header."""
    with open(checkpoint / "weights.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(end - start for name, entry in header.items() if name.startswith(("adam_m.", "adam_v."))
               for start, end in [entry["data_offsets"]])


def last_checkpoint(run: Path, rank: int) -> Path | None:
    steps = sorted((run / "checkpoints" / f"rank_{rank}").glob("step_*"))
    return steps[-1] if steps else None


def describe(run: Path) -> tuple[str, int]:
    """The run's layout as its saved recipe states it, and its data-parallel degree."""
    from telechat_moe.recipe import load_recipe
    r = load_recipe(str(run / "logs" / "recipe.yaml"))
    lay = r.layout
    parts = [f"{name}={value}" for name, value in (("dp", lay.dp), ("tp", lay.tp), ("pp", lay.pp), ("vpp", lay.vpp),
                                                   ("ep", lay.ep), ("etp", lay.etp)) if value > 1]
    if r.expert_placement.spare_slots:
        parts.append(f"spare slots {r.expert_placement.spare_slots}")
    return " x ".join(parts), lay.dp


def rows(root: Path) -> list[str]:
    one = last_checkpoint(root / "one", 0)
    whole = adam_bytes(one) if one else None
    out = ["| layout | rank | measured bytes | dry run bytes | diff | Adam bytes in its checkpoint | share of one "
           "process's | 1/dp |", "|" + " --- |" * 8]
    for logs in sorted(root.glob("layout*_logs"), key=lambda p: int(p.name[6:-5])):
        run = root / logs.name[:-5]
        name, dp = describe(run)
        text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("worker_*.log")))
        for rank, held, planned in sorted(MEMORY.findall(text), key=lambda m: int(m[0])):
            held, planned = int(held.replace(",", "")), int(planned.replace(",", ""))
            ckpt = last_checkpoint(run, int(rank))
            adam = adam_bytes(ckpt) if ckpt else None
            share = f"{adam / whole:.4f}" if adam is not None and whole else "-"
            out.append(f"| {name} | {rank} | {held:,} | {planned:,} | {held / planned - 1:+.3%} | "
                       f"{'-' if adam is None else f'{adam:,}'} | {share} | {1 / dp:.4f} |")
    if whole:
        out.append(f"\nOne process: {whole:,} bytes of Adam state ({one}).")
    return out


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m bench.shard_memory", description=__doc__.splitlines()[0])
    ap.add_argument("root", help="the --out folder of bench.layout_agreement")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if not (root / "one").is_dir():
        ap.error(f"{root}: not a bench.layout_agreement --out folder (no one/)")
    lines = rows(root)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
