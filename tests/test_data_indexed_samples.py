"""Indexed datasets served memory-mapped: the same samples as packing in memory, indexes cached once, blends by weight,
and loaders whose ranks split each global batch."""
from __future__ import annotations

import numpy as np
import pytest

from data_sched import indexed_samples
from data_sched.blend import SOURCE_SHIFT, blend, parse_paths
from data_sched.errors import DataError
from data_sched.indexed_dataset import open_indexed_dataset, read_documents, write_indexed_dataset
from data_sched.loader import BatchLoader, split_holdout
from data_sched.packing import pack_documents
from data_sched.prepare import prepare_data

EOD = 2


def _corpus(path, seed=0, docs=400, vocab=50):
    rng = np.random.default_rng(seed)
    found = [rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(docs)]
    for d in found[::7]:             # some documents end with their own EOD (Megatron's --append-eod)
        if len(d):
            d[-1] = EOD
    write_indexed_dataset(str(path), found, vocab)
    return str(path) + ".bin"


@pytest.mark.parametrize("seq, fraction", [(8, 0.0), (16, 0.1), (33, 0.05)])
def test_memory_mapped_samples_equal_packing_in_memory(tmp_path, seq, fraction):
    path = _corpus(tmp_path / "ds")
    sets = indexed_samples.open_indexed_samples(path, seq, 3, fraction, EOD, 50, str(tmp_path / "cache"))
    train, held = split_holdout(read_documents(path, eod_id=EOD), fraction, 3)
    rng = np.random.default_rng(1)
    for name, docs in (("train", train), ("held_out", held)):
        if not docs:
            assert len(sets[name]) == 0
            continue
        packed, mapped = pack_documents(docs, seq, EOD), sets[name]
        assert len(mapped) == len(packed)
        ids = rng.permutation(len(packed))
        assert np.array_equal(mapped.take(ids), packed.tokens[ids])
        a, b = mapped.doc_lengths(ids), packed.doc_lengths(ids)
        assert np.array_equal(a.lengths, b.lengths) and np.array_equal(a.offsets, b.offsets)
        for epoch in (0, 1):
            assert np.array_equal(mapped.ids_at(3, epoch, 0, len(packed)), packed.ids_at(3, epoch, 0, len(packed)))


def test_files_written_here_read_through_mindformers(tmp_path):
    from mindformers.dataset.blended_datasets.indexed_dataset import IndexedDataset

    path = _corpus(tmp_path / "ds", docs=30)
    theirs, ours = IndexedDataset(str(tmp_path / "ds")), open_indexed_dataset(path)
    starts, lengths = ours.documents()
    assert len(theirs) == len(starts)
    for d, (start, length) in enumerate(zip(starts, lengths)):
        assert np.array_equal(theirs[d], ours.tokens[start:start + length])


def test_indexes_are_built_once_and_keyed_by_what_determines_them(tmp_path, monkeypatch):
    path = _corpus(tmp_path / "ds")
    cache = str(tmp_path / "cache")
    first = indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 50, cache)["train"]
    first.ids_at(0, 0, 0, 4)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert not [f for f in files if ".tmp" in f]

    def no_rebuild(*_):
        raise AssertionError("the cached indexes were rebuilt")
    monkeypatch.setattr(indexed_samples, "scan_tokens", no_rebuild)
    again = indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 50, cache)["train"]
    assert np.array_equal(again.take(again.ids_at(0, 0, 0, 20)), first.take(first.ids_at(0, 0, 0, 20)))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == files
    for changed in ((32, 0, 0.1), (16, 1, 0.1), (16, 0, 0.2)):     # seq_length, seed, split: new indexes
        with pytest.raises(AssertionError, match="rebuilt"):
            indexed_samples.open_indexed_samples(path, *changed, EOD, 50, cache)
    _corpus(tmp_path / "ds", seed=5)                                 # the data changed: new indexes
    with pytest.raises(AssertionError, match="rebuilt"):
        indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 50, cache)


def test_bad_ids_and_unwritable_cache_are_one_line_errors(tmp_path):
    path = _corpus(tmp_path / "ds")
    with pytest.raises(DataError, match=r"ds.bin: token id 49 does not fit the tokenizer \(vocab_size 40\)"):
        indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 40, str(tmp_path / "cache"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="data.cache_dir: cannot write indexes into"):
        indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 50, str(tmp_path / "file" / "sub"))


@pytest.mark.parametrize("paths, expected", [
    (["a.bin", "b.bin"], [("a.bin", None), ("b.bin", None)]),
    ("0.3 a.bin 0.7 b.bin", [("a.bin", 0.3), ("b.bin", 0.7)]),
    ([0.3, "a.bin", "0.7", "b.bin"], [("a.bin", 0.3), ("b.bin", 0.7)]),
    ([{"path": "a.bin", "weight": 1}, {"path": "b.bin", "weight": 3}], [("a.bin", 1.0), ("b.bin", 3.0)]),
])
def test_data_paths_forms(paths, expected):
    assert parse_paths(paths) == expected


@pytest.mark.parametrize("paths, message", [
    ("0.3 a.bin 0.7", "weight/path pairs"),
    ([0.3, "a.bin", -1, "b.bin"], "weight of b.bin must be a positive number"),
    ([{"path": "a.bin", "weight": 1}, {"path": "b.bin"}], "every source a weight, or none"),
    ([{"path": "a.bin", "share": 1}], "{path, weight} entries"),
    ({"a.bin": 1}, "data.paths: expected a list"),
])
def test_data_paths_errors_name_the_key(paths, message):
    with pytest.raises(DataError, match="data.paths") as e:
        parse_paths(paths)
    assert message in str(e.value)


def _two_sources(tmp_path, seq=16):
    a = indexed_samples.open_indexed_samples(_corpus(tmp_path / "a", seed=1, docs=600), seq, 0, 0.0, EOD, 50,
                                             str(tmp_path / "cache"))["train"]
    b = indexed_samples.open_indexed_samples(_corpus(tmp_path / "b", seed=2, docs=900), seq, 0, 0.0, EOD, 50,
                                             str(tmp_path / "cache"))["train"]
    return a, b


def test_blend_shares_follow_the_weights_over_1000_batches_and_repeat_exactly(tmp_path):
    a, b = _two_sources(tmp_path)
    mixed = blend([a, b], [0.3, 0.7])
    loader = BatchLoader(mixed, 8, seed=0)
    counts = np.zeros(2)
    for _ in range(1000):                     # 1000 batches cross several blend epochs of both sources
        shares = loader.source_shares(loader.epoch, loader.index)
        counts += [shares["a"], shares["b"]]
        loader.advance(1)
    assert np.abs(counts / 1000 - [0.3, 0.7]).max() < 0.01, counts / 1000
    assert loader.epoch >= 2
    # the samples are those of each source, in each source's own shuffled order, all of them used
    ids = mixed.ids_at(0, 0, 0, len(mixed))
    src, local = ids >> SOURCE_SHIFT, ids & ((1 << SOURCE_SHIFT) - 1)
    assert np.array_equal(mixed.take(ids[src == 1]), b.take(b.order(0, 0)[:int((src == 1).sum())]))
    assert len(np.unique(local[src == 0])) == (src == 0).sum()
    # a second blend over the same files (from the cache) gives the same batches
    again = blend(list(_two_sources(tmp_path)), [0.3, 0.7])
    for pos in (0, 500, 2 * len(mixed) + 3):
        e, i = divmod(pos, len(mixed) // 8)
        assert np.array_equal(BatchLoader(again, 8, seed=0).batch_at(e, i)["input_ids"], loader.batch_at(e, i)[
            "input_ids"])


@pytest.mark.parametrize("balance", ["off", "reorder", "repack"])
def test_ranks_read_disjoint_shares_whose_union_is_the_global_batch(tmp_path, balance, monkeypatch):
    a, b = _two_sources(tmp_path, seq=32)
    mixed = blend([a, b], [0.5, 0.5])
    one = BatchLoader(mixed, 8, seed=4)
    ranks = [BatchLoader(mixed, 8, seed=4, dp_rank=r, dp_size=2, micro_batch_num=2, attention_balance=balance)
             for r in range(2)]
    read = []
    real = type(mixed).take
    monkeypatch.setattr(type(mixed), "take", lambda self, ids: read.append(np.array(ids)) or real(self, ids))
    for index in range(3):
        whole = one.batch_at(0, index)
        read.clear()
        parts = [r.batch_at(0, index) for r in ranks]
        wanted = one.global_batch_indices(0, index)
        for rank, got in zip(ranks, read):    # what a rank says it reads (logged on dump steps) is what it read
            assert sorted(got.tolist()) == sorted(rank.samples_read(0, index).tolist())
        if balance == "off":       # the one-process batch, split in two
            for key in whole:
                assert np.array_equal(np.concatenate([p[key] for p in parts]), whole[key]), (index, key)
        if balance != "repack":    # whole samples per rank: each reads its own, none twice
            assert len(np.intersect1d(read[0], read[1])) == 0
            assert sorted(np.concatenate(read).tolist()) == sorted(wanted.tolist())
        else:                      # pieces: a rank reads only samples of the global batch it takes pieces of
            assert all(set(r.tolist()) <= set(wanted.tolist()) for r in read)
        tokens = sorted(np.concatenate([p["input_ids"].ravel() for p in parts]).tolist())
        if balance != "repack":
            assert tokens == sorted(whole["input_ids"].ravel().tolist())


def test_prepare_data_blends_indexed_paths_and_points_text_weights_to_preprocessing(tmp_path):
    from data_sched.tokenizer import train_tokenizer
    from data_sched.default_corpus import default_corpus

    model = train_tokenizer(default_corpus()[:200], 512, str(tmp_path / "tok"))
    paths = [_corpus(tmp_path / name, seed=s, docs=300, vocab=300) for name, s in (("a", 1), ("b", 2))]
    data = prepare_data(f"0.25 {paths[0]} 0.75 {paths[1]}", 16, 0, 0.05, tokenizer_path=model,
                        cache_dir=str(tmp_path / "cache"))
    assert data.train.source_names == ("a", "b") and data.held_out.source_names == ("a", "b")
    assert data.train.weights.tolist() == [0.25, 0.75]
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match="scripts.preprocess_data"):
        prepare_data([1, str(tmp_path / "c.jsonl")], 16, 0, 0.05, tokenizer_path=model)


def test_a_position_resumed_with_another_data_parallel_continues_the_same_global_batches(tmp_path):
    a, b = _two_sources(tmp_path)
    mixed = blend([a, b], [0.3, 0.7])
    one = BatchLoader(mixed, 8, seed=2)
    one.advance(len(mixed) // 8 + 5)                 # into the second epoch
    state = one.state_dict()
    halves = [BatchLoader(mixed, 8, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in halves:
        loader.load_state_dict(state)
    for _ in range(3):
        whole, parts = next(one), [next(h) for h in halves]
        assert np.array_equal(np.concatenate([p["input_ids"] for p in parts]), whole["input_ids"])


def _open_and_read(args):
    path, cache = args
    train = indexed_samples.open_indexed_samples(path, 16, 0, 0.1, EOD, 50, cache)["train"]
    return train.take(train.ids_at(0, 0, 0, 32)).tolist()


def test_ranks_building_the_same_indexes_at_once_publish_one_complete_set(tmp_path):
    """No rank waits for another: each builds what it finds missing and renames it into place."""
    import multiprocessing as mp
    path, cache = _corpus(tmp_path / "ds", docs=3000), str(tmp_path / "cache")
    with mp.get_context("fork").Pool(4) as pool:
        seen = pool.map(_open_and_read, [(path, cache)] * 4)
    assert all(s == seen[0] for s in seen)
    assert _open_and_read((path, cache)) == seen[0]
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name]
