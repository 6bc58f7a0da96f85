"""The MFU's denominator on CPU (telechat_moe.metrics.peak_gemm_flops): the best GEMM rate this CPU has shown at
this thread count, so that one measurement taken in a busy moment does not halve it."""
from __future__ import annotations

import json

from telechat_moe.metrics import peak_gemm_flops


def test_the_peak_is_the_best_measured_on_this_cpu_and_thread_count(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert peak_gemm_flops(lambda: 200e9) == 200e9                  # first measurement: kept
    assert peak_gemm_flops(lambda: 90e9) == 200e9                   # a busy moment does not lower it
    assert peak_gemm_flops(lambda: 230e9) == 230e9                  # a faster one raises it
    cache = tmp_path / "telechat_moe" / "peak_flops.json"
    assert list(json.loads(cache.read_text()).values()) == [230e9]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")                 # another thread count: its own peak
    assert peak_gemm_flops(lambda: 110e9) == 110e9
    assert sorted(json.loads(cache.read_text()).values()) == [110e9, 230e9]
    cache.write_text("{not json")                                   # a damaged cache: measured again, rewritten
    assert peak_gemm_flops(lambda: 100e9) == 100e9
    assert list(json.loads(cache.read_text()).values()) == [100e9]
    assert [p.name for p in cache.parent.iterdir()] == ["peak_flops.json"]


def test_the_measurement_is_the_large_gemm_of_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rate = peak_gemm_flops()
    assert 1e9 < rate < 1e14 and peak_gemm_flops(lambda: 1.0) == rate
