"""Indexed datasets: Megatron's byte format, round trip, bad files, and the preprocessing script end to end."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_sched.errors import DataError

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
os.environ.setdefault("LOG_MF_PATH", "/tmp/telechat_mf_log")

from data_sched import indexed_dataset as indexed  # noqa: E402


def _parse_megatron_index(path: Path) -> dict:
    """The .idx layout of Megatron-Core's MMapIndexedDataset, read by hand."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code = struct.unpack("<QB", raw[9:18])
    seqs, docs = struct.unpack("<QQ", raw[18:34])
    off = 34
    lengths = np.frombuffer(raw, np.int32, seqs, off)
    off += 4 * seqs
    pointers = np.frombuffer(raw, np.int64, seqs, off)
    off += 8 * seqs
    doc_idx = np.frombuffer(raw, np.int64, docs, off)
    off += 8 * docs
    assert off == len(raw)
    return {"version": version, "code": code, "lengths": lengths, "pointers": pointers, "doc_idx": doc_idx}


def test_written_bytes_follow_megatron_layout_and_read_back(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([1, 2, 60000, 4]), np.array([9])]
    prefix = str(tmp_path / "ds")
    assert indexed.write_indexed_dataset(prefix, docs, vocab_size=65000) == (4, 8)
    idx = _parse_megatron_index(tmp_path / "ds.idx")
    assert idx["version"] == 1 and idx["code"] == 8  # uint16, Megatron's DType code
    assert idx["lengths"].tolist() == [3, 0, 4, 1]
    assert idx["pointers"].tolist() == [0, 6, 6, 14]
    assert idx["doc_idx"].tolist() == [0, 1, 2, 3, 4]
    assert (tmp_path / "ds.bin").read_bytes() == np.concatenate(docs).astype(np.uint16).tobytes()
    back = indexed.read_documents(prefix + ".bin")
    assert [d.tolist() for d in back] == [d.tolist() for d in docs]
    assert not list(tmp_path.glob("*.tmp*"))


def test_large_vocabularies_use_int32_and_trailing_eod_is_dropped(tmp_path):
    prefix = str(tmp_path / "big")
    indexed.write_indexed_dataset(prefix, [np.array([100000, 2]), np.array([3, 2, 2])], vocab_size=131072)
    assert _parse_megatron_index(tmp_path / "big.idx")["code"] == 4
    assert [d.tolist() for d in indexed.read_documents(prefix, eod_id=2)] == [[100000], [3, 2]]


def test_bad_indexed_files_raise_one_line(tmp_path):
    prefix = str(tmp_path / "ds")
    indexed.write_indexed_dataset(prefix, [np.arange(10)], vocab_size=100)
    with pytest.raises(DataError, match="not found"):
        indexed.read_documents(str(tmp_path / "absent"))
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-4])
    with pytest.raises(DataError, match="holds 16 bytes, its index describes 20"):
        indexed.read_documents(prefix)
    Path(prefix + ".idx").write_bytes(b"PK\x03\x04 not an index at all")
    with pytest.raises(DataError) as e:
        indexed.read_documents(prefix)
    assert "not a Megatron indexed dataset" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="outside"):
        indexed.write_indexed_dataset(str(tmp_path / "x"), [np.array([5, 100])], vocab_size=100)


def _run(*args, cwd=REPO):
    return subprocess.run([PYTHON, "-m", "scripts.preprocess_data", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "LOG_MF_PATH": "/tmp/telechat_mf_log"}, timeout=300)


def test_preprocess_script_is_parallel_deterministic_and_feeds_prepare_data(tmp_path):
    from data_sched.prepare import prepare_data

    corpus = tmp_path / "c.jsonl"
    rng = np.random.default_rng(0)
    words = ["river", "mountain", "梁山", "好汉", "the", "of", "and"]
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 200)))}) + "\n"
                              for _ in range(300)), encoding="utf-8")
    one = _run("--input", str(corpus), "--output-prefix", str(tmp_path / "one" / "ds"), "--vocab-size", "300",
               "--workers", "1")
    assert one.returncode == 0, one.stderr[-2000:]
    model = str(tmp_path / "one" / "ds.model")
    two = _run("--input", str(corpus), "--output-prefix", str(tmp_path / "two" / "ds"), "--tokenizer", model,
               "--workers", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "tokenizing" in two.stderr and "300 documents" in two.stdout
    for ext in ("bin", "idx"):
        assert (tmp_path / "one" / f"ds.{ext}").read_bytes() == (tmp_path / "two" / f"ds.{ext}").read_bytes()
    from_index = prepare_data([str(tmp_path / "two" / "ds.bin")], 32, seed=0, eval_fraction=0.05,
                              tokenizer_path=model)
    from_text = prepare_data([str(corpus)], 32, seed=0, eval_fraction=0.05, tokenizer_path=model)
    everything = np.arange(len(from_text.train))
    assert np.array_equal(from_index.train.take(everything), from_text.train.tokens)
    with pytest.raises(DataError, match="name the tokenizer"):
        prepare_data([str(tmp_path / "two" / "ds.idx")], 32, seed=0, eval_fraction=0.05)


@pytest.mark.parametrize("args, expected", [
    (["--input", "{missing}"], "corpus file not found"),
    (["--input", "{corrupt}"], ":2: corrupt JSONL"),
    (["--input", "{good}", "--tokenizer", "{corrupt}"], "not a SentencePiece"),
    (["--input", "{good}", "--workers", "0"], "--workers"),
])
def test_preprocess_script_bad_input_exits_2_with_one_line_and_keeps_old_output(tmp_path, args, expected):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello world"}\n', encoding="utf-8")
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds.bin").write_bytes(b"previous dataset")
    names = {"missing": str(tmp_path / "absent.jsonl"), "corrupt": str(corrupt), "good": str(good)}
    result = _run(*[a.format(**names) for a in args], "--output-prefix", str(out / "ds"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr
    assert (out / "ds.bin").read_bytes() == b"previous dataset"


def test_preprocess_script_unwritable_output_exits_2(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/telechat_cannot_write_here/ds"   # root may write anywhere else
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = str(locked / "ds")
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n', encoding="utf-8")
    result = _run("--input", str(good), "--output-prefix", target)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--output-prefix" in result.stderr
