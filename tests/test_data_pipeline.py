"""Corpus, tokenizer, packing and loader: determinism, exactness, resume, and one-line errors on bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data_sched.default_corpus import default_corpus
from data_sched.errors import DataError
from data_sched.loader import BatchLoader, split_holdout
from data_sched.packing import doc_lens_to_segment_ids, pack_documents
from data_sched.sources import load_texts
from data_sched.tokenizer import Tokenizer, train_tokenizer

SHARED_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / "corpus.jsonl"


def _one_line(err: Exception) -> str:
    msg = str(err)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def stdlib_docs():
    return default_corpus()


@pytest.fixture(scope="module")
def tokenizer(stdlib_docs, tmp_path_factory):
    return Tokenizer.load(train_tokenizer(stdlib_docs, 4096, str(tmp_path_factory.mktemp("tok") / "spm")))


def _shared_lines(n: int) -> list[str]:
    if not SHARED_CORPUS.is_file():
        pytest.skip(f"sample corpus {SHARED_CORPUS} is absent")
    with open(SHARED_CORPUS, encoding="utf-8") as f:
        return [json.loads(next(f))["text"] for _ in range(n)]


# ---- default corpus ---------------------------------------------------------------------------------------------

def test_default_corpus_is_real_long_tailed_and_deterministic(stdlib_docs):
    lens = np.array([len(d) for d in stdlib_docs])
    assert len(stdlib_docs) > 2000
    assert lens.max() > 20 * np.median(lens)  # a long tail, not uniform snippets
    assert len(set(stdlib_docs)) == len(stdlib_docs)
    assert sum(" the " in d for d in stdlib_docs) > len(stdlib_docs) // 3  # English prose, not identifiers
    assert default_corpus() == stdlib_docs


def test_default_corpus_is_cached_by_its_sources(tmp_path, monkeypatch):
    """Parsed once, read back equal from the cache; an edited source is parsed again, never served stale."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "pkg" / "a.py").write_text('"""The first module says what it does, at some length."""\n')
    (lib / "b.py").write_text('def f():\n    """A function that returns nothing at all, as its name says."""\n')
    first = default_corpus(str(lib))
    assert first == ["A function that returns nothing at all, as its name says.",     # a folder's files first
                     "The first module says what it does, at some length."]
    assert len(list((tmp_path / "cache" / "telechat_moe").glob("default_corpus-*.json"))) == 1
    assert default_corpus(str(lib)) == first
    (lib / "b.py").write_text('"""Another text, long enough to be kept in the corpus."""\n')
    assert default_corpus(str(lib))[0] == "Another text, long enough to be kept in the corpus."


# ---- sources ----------------------------------------------------------------------------------------------------

def test_load_texts_jsonl_and_plain_text(tmp_path):
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "first"}\n\n{"text": "第二", "id": 2}\n', encoding="utf-8")
    t = tmp_path / "b.txt"
    t.write_text("para one\nstill one\n\n  \n\npara two\n", encoding="utf-8")
    lines = tmp_path / "c.txt"
    lines.write_text("甲\n乙\n", encoding="utf-8")
    assert load_texts([str(j), str(t), str(lines)]) == ["first", "第二", "para one\nstill one", "para two", "甲", "乙"]


@pytest.mark.parametrize("content, name, expected", [
    (None, "missing.jsonl", "not found"),
    ('{"text": "ok"}\n{"text": broken\n', "c.jsonl", "c.jsonl:2: corrupt JSONL"),
    ('{"body": "x"}\n', "m.jsonl", 'm.jsonl:1: expected a JSON object with a "text" field'),
    ('{"text": 5}\n', "n.jsonl", "must be a string"),
    ("\n\n  \n", "e.txt", "corpus is empty"),
    ("x", "d.csv", "expected a .jsonl or .txt"),
])
def test_bad_corpus_files_raise_one_line(tmp_path, content, name, expected):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_texts([str(path)])
    assert expected in _one_line(e.value)


# ---- tokenizer --------------------------------------------------------------------------------------------------

def test_tokenizer_training_is_deterministic(stdlib_docs, tmp_path):
    a = train_tokenizer(stdlib_docs[:1500], 1024, str(tmp_path / "a"))
    b = train_tokenizer(stdlib_docs[:1500], 1024, str(tmp_path / "b"))
    assert Path(a).read_bytes() == Path(b).read_bytes()


def test_tokenizer_round_trips_english_and_chinese(tokenizer):
    texts = _shared_lines(40)
    assert any("\u4e00" <= ch <= "\u9fff" for t in texts for ch in t), "sample should hold Chinese"
    assert any("the" in t for t in texts)
    for text in texts + ["  indented\tcode()\n\n红楼梦 第一回\u3000甄士隐", "emoji \U0001F600 ok"]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    assert tokenizer.vocab_size == 4096 and tokenizer.eod_id != tokenizer.pad_id


def test_tokenizer_learns_chinese_pieces(tmp_path):
    texts = _shared_lines(200)
    tok = Tokenizer.load(train_tokenizer(texts, 2000, str(tmp_path / "zh")))
    zh = next(t for t in texts if sum("\u4e00" <= c <= "\u9fff" for c in t) > 200)
    assert len(tok.encode(zh)) < len(zh.encode("utf-8")) / 2  # real pieces, not byte fallback
    assert tok.decode(tok.encode(zh)) == zh


def test_tokenizer_bad_files_raise_one_line(tmp_path):
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(DataError, match="bogus.model: not a SentencePiece"):
        Tokenizer.load(str(bogus))
    with pytest.raises(DataError, match="not found"):
        Tokenizer.load(str(tmp_path / "absent.model"))
    with pytest.raises(DataError) as e:
        train_tokenizer(["tiny corpus"], 4096, str(tmp_path / "small"))
    assert "tokenizer.vocab_size=4096" in _one_line(e.value)


# ---- packing ----------------------------------------------------------------------------------------------------

docs_strategy = st.lists(st.lists(st.integers(4, 50), max_size=40), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, seq=st.integers(1, 33))
def test_packing_keeps_every_token_once_and_lengths_add_up(docs, seq):
    arrays = [np.asarray(d, dtype=np.int32) for d in docs]
    stream = np.concatenate([np.append(a, 0) for a in arrays]).astype(np.int32)
    if len(stream) <= seq:
        with pytest.raises(DataError):
            pack_documents(arrays, seq, eod_id=0)
        return
    p = pack_documents(arrays, seq, eod_id=0)
    n = len(p)
    assert p.tokens.shape == (n, seq + 1) and p.tokens.dtype == np.int32
    # Inputs tile the stream exactly once; labels are the inputs shifted by one; only a short tail is dropped.
    assert np.array_equal(p.tokens[:, :-1].ravel(), stream[:n * seq])
    assert np.array_equal(p.tokens[:, 1:].ravel(), stream[1:n * seq + 1])
    assert p.dropped_tokens == len(stream) - n * seq - 1 and 0 <= p.dropped_tokens < seq
    # Every piece lies inside one document segment (which ends at its EOD), and pieces sum to seq_length.
    seg_of_pos = np.repeat(np.arange(len(arrays)), [len(a) + 1 for a in arrays])
    for i in range(n):
        lens = p.sample_doc_lens(i)
        assert lens.sum() == seq and (lens > 0).all()
        seg = doc_lens_to_segment_ids(lens, seq)
        docs_here = seg_of_pos[i * seq:(i + 1) * seq]
        assert np.array_equal(np.diff(seg) != 0, np.diff(docs_here) != 0)


def test_actual_seq_len_matches_mindformers_compressed_eod_mask():
    import os
    os.environ.setdefault("LOG_MF_PATH", "/tmp/telechat_mf_log")
    from mindformers.dataset.blended_datasets.gpt_dataset import _get_eod_attention_mask
    from data_sched.packing import doc_lens_to_actual_seq_len

    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 50, n).astype(np.int32) for n in rng.integers(1, 12, 40)]
    packed = pack_documents(docs, 24, eod_id=2)
    for i in range(len(packed)):
        inputs = packed.tokens[i, :-1]
        want = _get_eod_attention_mask(inputs, 2, 16)
        assert np.array_equal(doc_lens_to_actual_seq_len(packed.sample_doc_lens(i), 24, 16), want)
    with pytest.raises(ValueError, match="exceed"):
        doc_lens_to_actual_seq_len([1] * 8, 8, 4)


def test_segment_ids_reject_lengths_that_do_not_fill_the_sample():
    assert doc_lens_to_segment_ids([2, 1, 3], 6).tolist() == [0, 0, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        doc_lens_to_segment_ids([2, 3], 6)


# ---- loader -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def packed():
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 1000, rng.integers(1, 90)).astype(np.int32) for _ in range(400)]
    return pack_documents(docs, 32, eod_id=2)


def _take(loader, k):
    return [next(loader) for _ in range(k)]


def test_loader_is_deterministic_and_epochs_reshuffle(packed):
    a = _take(BatchLoader(packed, 8, seed=3), 5)
    b = _take(BatchLoader(packed, 8, seed=3), 5)
    c = _take(BatchLoader(packed, 8, seed=4), 5)
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert not all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    loader = BatchLoader(packed, 8, seed=3)
    e0 = np.concatenate([loader.global_batch_indices(0, k) for k in range(loader.batches_per_epoch)])
    e1 = np.concatenate([loader.global_batch_indices(1, k) for k in range(loader.batches_per_epoch)])
    assert len(set(e0.tolist())) == len(e0) and not np.array_equal(e0, e1)


def test_loader_dp_shares_make_up_the_global_batch(packed):
    full = BatchLoader(packed, 8, seed=1).batch_at(2, 3)
    shares = [BatchLoader(packed, 8, seed=1, dp_rank=r, dp_size=4).batch_at(2, 3) for r in range(4)]
    for key in full:
        assert np.array_equal(np.concatenate([s[key] for s in shares]), full[key])
    assert np.array_equal(full["labels"][:, :-1], full["input_ids"][:, 1:])


def test_loader_resume_continues_with_exactly_the_next_batch(packed):
    straight = BatchLoader(packed, 64, seed=7)
    expected = _take(straight, 30)  # crosses epoch boundaries (batches_per_epoch is smaller)
    assert straight.batches_per_epoch < 30
    first = BatchLoader(packed, 64, seed=7)
    _take(first, 13)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = BatchLoader(packed, 64, seed=7)
    resumed.load_state_dict(state)
    for want, got in zip(expected[13:], _take(resumed, 17)):
        for key in want:
            assert np.array_equal(want[key], got[key])


def test_loader_state_of_another_run_is_refused(packed):
    state = BatchLoader(packed, 8, seed=7).state_dict()
    with pytest.raises(DataError, match="seed"):
        BatchLoader(packed, 8, seed=8).load_state_dict(state)
    with pytest.raises(DataError, match="global batch"):
        BatchLoader(packed, 10_000, seed=1)
    with pytest.raises(DataError, match="multiple of data_parallel"):
        BatchLoader(packed, 6, seed=1, dp_size=4)


def test_mindspore_dataset_feeds_the_same_batches_without_moving_the_position(packed):
    loader = BatchLoader(packed, 8, seed=5, dp_rank=1, dp_size=2)
    loader.advance(3)
    ds = loader.as_mindspore_dataset(4)
    got = list(ds.create_dict_iterator(num_epochs=1, output_numpy=True))
    assert loader.state_dict()["index"] == 3
    want = _take(loader, 4)
    assert len(got) == 4
    for g, w in zip(got, want):
        for key in w:
            assert g[key].dtype == np.int32 and np.array_equal(g[key], w[key])


def test_split_holdout_is_disjoint_deterministic_and_seeded():
    docs = [f"doc{i}" for i in range(100)]
    train, held = split_holdout(docs, 0.1, seed=0)
    assert len(held) == 10 and sorted(train + held) == sorted(docs) and not set(train) & set(held)
    assert split_holdout(docs, 0.1, seed=0) == (train, held)
    assert split_holdout(docs, 0.1, seed=1)[1] != held
    assert train == [d for d in docs if d in set(train)]  # corpus order kept
    with pytest.raises(DataError, match="eval_fraction"):
        split_holdout(docs, 1.0, seed=0)


# ---- the trainer's entry ----------------------------------------------------------------------------------------

def test_prepare_data_trains_a_tokenizer_on_training_docs_only_and_packs_both_splits(tmp_path):
    from data_sched.prepare import prepare_data

    corpus = tmp_path / "c.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "水浒", "红楼"]
    docs = [" ".join(rng.choice(words, rng.integers(5, 80))) for _ in range(60)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    data = prepare_data([str(corpus)], 16, seed=0, eval_fraction=0.1, vocab_size=300,
                        tokenizer_out=str(tmp_path / "tok" / "spm"))
    assert (tmp_path / "tok" / "spm.model").is_file()
    assert data.train.seq_length == 16 and len(data.held_out) > 0
    again = prepare_data([str(corpus)], 16, seed=0, eval_fraction=0.1, tokenizer_path=data.tokenizer.path)
    assert np.array_equal(again.train.tokens, data.train.tokens)
    assert np.array_equal(again.held_out.tokens, data.held_out.tokens)
