"""The one safetensors reader/writer (telechat_moe.safetensors_io): what it writes is what safetensors itself reads,
bfloat16 is widened exactly and rounded to nearest even, a torn or foreign file is one line naming it, and a
write is all or nothing. The trainer's checkpoints and the HF converter's files are tested where they are used
(test_training.py, test_hf_adapter.py)."""
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from telechat_moe.errors import CheckpointError
from telechat_moe.safetensors_io import bf16_bits_to_f32, f32_to_bf16_bits, read_safetensors, write_safetensors

TENSORS = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "step": np.array(3, np.int32),
           "mask": np.array([True, False]), "empty": np.zeros((0, 5), np.float16), "ids": np.arange(4, dtype=np.int64)}


def test_written_files_are_safetensors_and_read_back_exactly(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, TENSORS, {"format": "ms"})
    for stored in (load_file(str(path)), read_safetensors(path)[0]):
        assert stored.keys() == TENSORS.keys()
        for name, arr in TENSORS.items():
            assert stored[name].dtype == arr.dtype and stored[name].shape == arr.shape, name
            assert np.array_equal(stored[name], arr), name
    assert read_safetensors(path)[1] == {"format": "ms"}
    assert not list(tmp_path.glob("*.partial"))
    other = tmp_path / "theirs.safetensors"
    save_file(TENSORS, str(other), metadata={"format": "pt"})
    assert all(np.array_equal(read_safetensors(other)[0][n], a) for n, a in TENSORS.items())


def test_bfloat16_rounds_to_nearest_even_and_widens_exactly(tmp_path):
    one_ulp = 2.0 ** -7  # bfloat16 keeps 7 fraction bits
    x = np.array([1.0, 1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 2 + 2 ** -20, -2.5, np.inf, 0.0],
                 np.float32)
    expected = np.array([1.0, 1.0, 1 + 2 * one_ulp, 1 + one_ulp, -2.5, np.inf, 0.0], np.float32)  # ties to even
    assert np.array_equal(bf16_bits_to_f32(f32_to_bf16_bits(x)), expected)
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32)))).all()
    path = tmp_path / "b.safetensors"
    write_safetensors(path, {"x": x, "n": np.arange(3, dtype=np.int32)}, dtype="bfloat16")
    back, _ = read_safetensors(path)
    assert back["x"].dtype == np.float32 and np.array_equal(back["x"], expected)
    assert back["n"].dtype == np.int32  # only floating tensors are cast
    write_safetensors(path, back, dtype="bfloat16")
    assert np.array_equal(read_safetensors(path)[0]["x"], expected)  # values from bfloat16 stay exact


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "huge header", "empty"])
def test_unreadable_files_are_one_line_naming_the_file(tmp_path, damage):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, TENSORS)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-5], "garbage header": b"\x05\x00\x00\x00\x00\x00\x00\x00{nope",
                      "huge header": b"\xff" * 8, "empty": b""}[damage])
    with pytest.raises(CheckpointError) as err:
        read_safetensors(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "keep.safetensors"
    write_safetensors(path, TENSORS)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="complex"):
        write_safetensors(path, {"w": TENSORS["w"], "z": np.zeros(2, np.complex64)})
    assert path.read_bytes() == before


WRITE_PAST_SIZE_LIMIT = """
import errno, resource, signal, sys
import numpy as np
from telechat_moe.safetensors_io import write_safetensors
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_safetensors(sys.argv[1], {"w": np.ones((64, 64), np.float32)})
except OSError as e:
    sys.exit(0 if e.errno == errno.EFBIG else 1)
sys.exit(1)
"""


def test_a_write_that_fails_midway_keeps_the_previous_file_and_leaves_no_partial(tmp_path):
    """A full disk or a file-size limit: the OSError reaches the caller, the old file is whole, no .partial stays."""
    from tests.helpers import run_cli
    path = tmp_path / "keep.safetensors"
    write_safetensors(path, TENSORS)
    before = path.read_bytes()
    proc = run_cli("-c", WRITE_PAST_SIZE_LIMIT, str(path), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]
