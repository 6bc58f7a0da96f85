"""Checkpoints of sharded parameters reshard on load: routed experts (and their Adam moments) split along dim 0 over
the EP ranks, saved by 4 ranks, load into 1 rank (whole) or 2 (halves) with the very values of the full tensors;
saved by 1 or 2, load into 4. `resume_point` picks the newest step complete on every rank that saved it (a rank
beyond the saving run's gets rank 0's folder). A missing rank folder, a slice no rank holds or ranks that disagree
are one CheckpointError naming the folder and the tensor, with nothing loaded; a checkpoint without the layout
fields loads as before. Single process: each "rank" is one call with that rank's slice."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from telechat_moe.checkpoint import (TRAINER_STATE, Shard, checkpoint_layout, latest_checkpoint, load_checkpoint,
                                     resume_point, save_checkpoint)
from telechat_moe.errors import CheckpointError

E = 8
STATE = {"step": 3, "data": {"epoch": 0, "index": 3}, "loss_scale": 1.0, "loss_scale_good_steps": 3}
EXPERTS = ("w1", "w2", "adam_m.w1", "adam_m.w2", "adam_v.w1")
SHAPES = {"dense": (3, 4), "adam_m.dense": (3, 4), "w1": (E, 2, 3), "w2": (E, 3, 2), "adam_m.w1": (E, 2, 3),
          "adam_m.w2": (E, 3, 2), "adam_v.w1": (E, 2, 3)}


def full_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def layout(rank: int, ep: int) -> dict[str, Shard]:
    """The shards of `rank` when the experts are split over `ep` ranks (ep=1: nothing sharded)."""
    per = E // ep
    return {} if ep == 1 else {name: Shard(0, (rank % ep) * per, E) for name in EXPERTS}


def _slice(arr: np.ndarray, s: Shard | None, local: tuple) -> np.ndarray:
    if s is None:
        return arr.copy()
    index = [slice(None)] * arr.ndim
    index[s.dim] = slice(s.offset, s.offset + local[s.dim])
    return arr[tuple(index)].copy()


def params_for(rank: int, ep: int, full: dict[str, np.ndarray] | None) -> tuple[list[Parameter], dict[str, Shard]]:
    """Rank `rank`'s parameters with the experts split over `ep` ranks: its slice of `full` (zeros if None)."""
    shards, out = layout(rank, ep), []
    for name, shape in SHAPES.items():
        local = shape if name not in shards else (E // ep,) + shape[1:]
        value = np.zeros(local, np.float32) if full is None else _slice(full[name], shards.get(name), local)
        out.append(Parameter(Tensor(value), name=name))
    return out, shards


def save_run(root, world: int, full: dict[str, np.ndarray], step: int = 3, ep: int | None = None) -> None:
    """Every rank of a run of `world` ranks (experts split over `ep`, default all of them) saves its checkpoint."""
    for r in range(world):
        params, shards = params_for(r, ep or world, full)
        save_checkpoint(root, r, step, params, {**STATE, "step": step}, keep=3, shards=shards, world=world)


def values(params: list[Parameter]) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def assert_holds(params: list[Parameter], shards: dict[str, Shard], full: dict[str, np.ndarray]) -> None:
    for p in params:
        s = shards.get(p.name)
        want = _slice(full[p.name], s, tuple(p.shape))
        np.testing.assert_array_equal(p.asnumpy(), want, err_msg=p.name)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ---- what a save records --------------------------------------------------------------------------------------
def test_state_records_the_layout_and_load_returns_the_trainer_state(tmp_path):
    full = full_tensors()
    save_run(tmp_path, 4, full)
    path = tmp_path / "rank_2" / "step_00000003"
    state = json.loads((path / "state.json").read_text())
    assert state["world"] == 4 and state["shards"] == {n: [0, 4, E] for n in EXPERTS}
    assert checkpoint_layout(path) == (4, {n: Shard(0, 4, E) for n in EXPERTS})
    params, shards = params_for(2, 4, None)
    assert load_checkpoint(path, params, TRAINER_STATE, shards=shards) == STATE   # layout fields not returned
    assert_holds(params, shards, full)


def test_bad_shards_are_refused_before_writing(tmp_path):
    params, _ = params_for(0, 4, full_tensors())
    for bad in ({"w1": Shard(0, 7, E)}, {"w1": Shard(3, 0, E)}, {"nope": Shard(0, 0, E)}):
        with pytest.raises(ValueError):
            save_checkpoint(tmp_path, 0, 1, params, STATE, keep=1, shards=bad, world=4)
    assert not (tmp_path / "rank_0").exists()


# ---- resharding -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved,loaded", [(4, 1), (4, 2), (1, 4), (2, 4), (4, 4)])
def test_reshard_gives_the_full_tensors_exactly(tmp_path, saved, loaded):
    full = full_tensors(saved * 10 + loaded)
    save_run(tmp_path, saved, full)
    for r in range(loaded):
        path = resume_point(tmp_path, r)
        own = tmp_path / f"rank_{r}" / "step_00000003"
        assert path == (own if r < saved else tmp_path / "rank_0" / "step_00000003"), (r, path)
        params, shards = params_for(r, loaded, None)
        assert load_checkpoint(path, params, TRAINER_STATE, shards=shards) == STATE
        assert_holds(params, shards, full)


def test_expert_parallel_inside_data_parallel(tmp_path):
    """4 ranks = DP 2 x EP 2 (ranks 0 and 2 hold experts 0-3): into EP 4 and into one rank."""
    full = full_tensors(5)
    save_run(tmp_path, 4, full, ep=2)
    for r in range(4):
        params, shards = params_for(r, 4, None)
        load_checkpoint(resume_point(tmp_path, r), params, shards=shards)
        assert_holds(params, shards, full)
    params, shards = params_for(0, 1, None)
    load_checkpoint(resume_point(tmp_path, 0), params, shards=shards)
    assert_holds(params, shards, full)


def test_only_the_files_holding_a_needed_slice_are_read(tmp_path):
    """Rank 1 of 2 needs experts 4-7: ranks 2 and 3 hold them; rank 0's weights (here torn) are never opened."""
    full = full_tensors(4)
    save_run(tmp_path, 4, full)
    (tmp_path / "rank_0" / "step_00000003" / "weights.safetensors").write_bytes(b"torn")
    params, shards = params_for(1, 2, None)
    load_checkpoint(resume_point(tmp_path, 1), params, shards=shards)
    assert_holds(params, shards, full)
    params, shards = params_for(0, 2, None)   # rank 0 needs its own file: one line naming it
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(resume_point(tmp_path, 0), params, shards=shards)
    assert one_line(e).startswith(f"{tmp_path / 'rank_0' / 'step_00000003' / 'weights.safetensors'}: not a readable")


def test_a_shard_along_another_dim(tmp_path):
    """Saved split along dim 0 over 4 ranks, loaded split along dim 2 (tensor-parallel style) over 3."""
    full = full_tensors(7)
    save_run(tmp_path, 4, full)
    path = resume_point(tmp_path, 1)
    target = [Parameter(Tensor(np.zeros((E, 2, 1), np.float32)), name="w1")]
    load_checkpoint(path, target, shards={"w1": Shard(2, 1, 3)})
    np.testing.assert_array_equal(target[0].asnumpy(), full["w1"][:, :, 1:2])


# ---- which step to resume from --------------------------------------------------------------------------------
def test_resume_point_is_the_newest_step_complete_on_every_rank(tmp_path):
    save_run(tmp_path, 4, full_tensors(1), step=1)
    save_run(tmp_path, 4, full_tensors(2), step=2)
    shutil.rmtree(tmp_path / "rank_2" / "step_00000002")      # rank 2 died before its newest save was in place
    (tmp_path / "rank_2" / ".tmp_step_00000002").mkdir()
    for r in range(4):
        assert resume_point(tmp_path, r) == tmp_path / f"rank_{r}" / "step_00000001"
    assert latest_checkpoint(tmp_path, 0) == tmp_path / "rank_0" / "step_00000002"   # unchanged
    assert resume_point(tmp_path, 5) == tmp_path / "rank_0" / "step_00000001"
    shutil.rmtree(tmp_path / "rank_2" / "step_00000001")
    assert resume_point(tmp_path, 0) is None and resume_point(tmp_path, 3) is None
    assert resume_point(tmp_path / "nothing", 0) is None


def test_resume_point_skips_a_folder_left_by_a_bigger_run(tmp_path):
    """A 4-rank run saved step 3; a 2-rank run in the same folder saved step 3 again: rank 3's step 3 is stale."""
    save_run(tmp_path, 4, full_tensors(1))
    full = full_tensors(2)
    save_run(tmp_path, 2, full)
    assert resume_point(tmp_path, 1) == tmp_path / "rank_1" / "step_00000003"
    assert resume_point(tmp_path, 3) == tmp_path / "rank_0" / "step_00000003"
    for r in range(4):
        params, shards = params_for(r, 4, None)
        load_checkpoint(resume_point(tmp_path, r), params, shards=shards)
        assert_holds(params, shards, full)


# ---- what cannot be loaded -------------------------------------------------------------------------------------
def test_a_missing_rank_folder_is_one_line_and_loads_nothing(tmp_path):
    save_run(tmp_path, 4, full_tensors())
    shutil.rmtree(tmp_path / "rank_3")
    params, shards = params_for(0, 1, None)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "rank_0" / "step_00000003", params, TRAINER_STATE, shards=shards)
    text = one_line(e)
    assert text.startswith(f"{tmp_path / 'rank_3' / 'step_00000003'}: missing") and "slice of w1" in text, text
    assert not any(v.any() for v in values(params).values())    # the dense weight too: nothing loaded
    # a rank that needs only its own slice still loads
    params, shards = params_for(1, 4, None)
    load_checkpoint(tmp_path / "rank_1" / "step_00000003", params, shards=shards)


def test_an_uncovered_slice_is_one_line_and_loads_nothing(tmp_path):
    save_run(tmp_path, 4, full_tensors())
    state_file = tmp_path / "rank_2" / "step_00000003" / "state.json"
    state = json.loads(state_file.read_text())
    state["shards"]["w2"] = [0, 0, E]              # rank 2 says it holds experts 0-1 of w2: nobody has 4-5
    state_file.write_text(json.dumps(state))
    params, shards = params_for(0, 2, None)
    load_checkpoint(tmp_path / "rank_0" / "step_00000003", params, shards=shards)   # experts 0-3: still there
    params, shards = params_for(1, 2, None)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "rank_1" / "step_00000003", params, shards=shards)
    assert one_line(e) == (f"{tmp_path}: indices 4..6 of dim 0 of w2 are in none of the 4 ranks' step_00000003 "
                           f"checkpoints")
    assert not any(v.any() for v in values(params).values())


def test_ranks_that_disagree_are_one_line(tmp_path):
    save_run(tmp_path, 4, full_tensors())
    state_file = tmp_path / "rank_1" / "step_00000003" / "state.json"
    state = json.loads(state_file.read_text())
    state["shards"]["w1"] = [0, 2, 16]
    state_file.write_text(json.dumps(state))
    params, shards = params_for(0, 1, None)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "rank_0" / "step_00000003", params, shards=shards)
    text = one_line(e)
    assert text.startswith(f"{state_file}: w1 is [dim 0, offset 2, full 16]") and "disagree" in text, text
    state["shards"]["w1"] = [0, 2, E]
    state["world"] = 2
    state_file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "rank_0" / "step_00000003", params, shards=shards)
    assert one_line(e).startswith(f"{state_file}: saved by 2 ranks")
    assert not any(v.any() for v in values(params).values())


def test_another_global_shape_is_refused(tmp_path):
    save_run(tmp_path, 4, full_tensors())
    target = [Parameter(Tensor(np.zeros((8, 2, 3), np.float32)), name="w1")]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "rank_0" / "step_00000003", target, shards={"w1": Shard(0, 8, 16)})
    assert one_line(e) == (f"{tmp_path / 'rank_0' / 'step_00000003' / 'weights.safetensors'}: w1 has shape "
                           f"(8, 2, 3), this model expects (16, 2, 3); it was written by a model of another shape")


# ---- checkpoints from before the layout fields ------------------------------------------------------------------
def test_an_old_checkpoint_still_loads(tmp_path):
    full = full_tensors(3)
    save_run(tmp_path, 1, full)
    path = tmp_path / "rank_0" / "step_00000003"
    state = json.loads((path / "state.json").read_text())
    del state["shards"], state["world"]
    (path / "state.json").write_text(json.dumps(state))
    params, shards = params_for(0, 1, None)
    assert load_checkpoint(path, params, TRAINER_STATE) == STATE
    assert_holds(params, shards, full)
    for r in range(2):                               # and splits into a 2-rank run
        assert resume_point(tmp_path, r) == path
        params, shards = params_for(r, 2, None)
        assert load_checkpoint(path, params, TRAINER_STATE, shards=shards) == STATE
        assert_holds(params, shards, full)


def test_flat_optimizer_slices_reshard_between_data_parallel_degrees(tmp_path):
    """The distributed optimizer's moments: each rank's slice of the flattened tensor (unequal, one rank holding
    none of one tensor, as the bucket plan cuts them), saved by 4 ranks, load whole in the tensor's shape (the
    one-process optimizer), as 2 ranks' flat slices, and a whole checkpoint loads as flat slices again."""
    full = full_tensors(5)
    names = ("adam_m.dense", "adam_m.w1")
    cuts = {"adam_m.dense": [0, 5, 5, 9, 12], "adam_m.w1": [0, 13, 20, 30, 48]}   # rank r: [cut[r], cut[r+1])

    def flat_params(r, bounds, source):
        params, shards = [], {}
        for n in names:
            lo, hi = bounds[n][r], bounds[n][r + 1]
            if hi == lo:
                continue
            value = np.zeros(hi - lo, np.float32) if source is None else source[n].reshape(-1)[lo:hi].copy()
            params.append(Parameter(Tensor(value), name=n))
            shards[n] = Shard(0, lo, full[n].size)
        return params, shards

    for r in range(4):
        params, shards = flat_params(r, cuts, full)
        save_checkpoint(tmp_path / "dp4", r, 3, params, STATE, keep=1, shards=shards, world=4)
    whole = [Parameter(Tensor(np.zeros(full[n].shape, np.float32)), name=n) for n in names]
    load_checkpoint(resume_point(tmp_path / "dp4", 0), whole, TRAINER_STATE)
    assert all(np.array_equal(p.asnumpy(), full[p.name]) for p in whole)
    halves = {n: [0, full[n].size // 2, full[n].size] for n in names}
    for r in range(2):
        params, shards = flat_params(r, halves, None)
        load_checkpoint(resume_point(tmp_path / "dp4", r), params, TRAINER_STATE, shards=shards)
        assert all(np.array_equal(p.asnumpy(), full[p.name].reshape(-1)[halves[p.name][r]:halves[p.name][r + 1]])
                   for p in params)
    save_checkpoint(tmp_path / "dp1", 0, 3, [Parameter(Tensor(full[n]), name=n) for n in names], STATE, keep=1)
    params, shards = flat_params(1, halves, None)
    load_checkpoint(resume_point(tmp_path / "dp1", 0), params, TRAINER_STATE, shards=shards)
    assert all(np.array_equal(p.asnumpy(), full[p.name].reshape(-1)[halves[p.name][1]:]) for p in params)
