"""The planner against published numbers (bench/planner_published.py states each run's assumptions): DeepSeek-V3's
pre-training throughput on 2048 H800 GPUs, Llama 3 405B's on 8192 H100 and TeleChat3 36B's on 2048 Ascend NPUs;
and the calibration script that writes the CPU cluster."""
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.planner.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Llama 3 405B", "TeleChat3 36B"])
def test_published_runs_within_15_percent(name):
    from bench.planner_published import predict, runs

    run = next(r for r in runs() if r.name.startswith(name))
    r = predict(run)
    assert r.memory_gib <= run.workload.cluster.usable_memory / 2 ** 30
    assert abs(r.error) <= 0.15, r
    assert r.compute + r.exposed_comm + r.imbalance + r.bubble + r.update == pytest.approx(r.step_time, rel=1e-9)
    assert r.rank is not None and 1 <= r.rank <= r.searched


def test_calibration_writes_a_loadable_cpu_cluster(tmp_path):
    out = tmp_path / "cpu.yaml"
    r = subprocess.run([sys.executable, "-m", "scripts.calibrate_cluster", "--no-mindspore", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    c = load_cluster(str(out))
    assert 1e8 < c.flops("fp32") < 1e13 and 1e8 < c.memory_bandwidth < 1e12
    assert c.flash_attention and "measured" in c.sources["device"]
    # the host link (activation offload) is a memcpy rate: the bytes one copy moves, half the read + write rate
    assert 0.2 * c.memory_bandwidth < c.host_link_bandwidth < 2 * c.memory_bandwidth
    assert "measured" in c.sources["host_link"]


def test_calibration_rejects_a_missing_folder(tmp_path):
    r = subprocess.run([sys.executable, "-m", "scripts.calibrate_cluster", "--out", str(tmp_path / "no" / "x.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr


def test_runtime_fit_recovers_known_constants():
    """Probe 'measurements' made by the planner with known runtime constants are fitted back to those constants
    (the fit evaluates the planner at unit constants, so the two share one formula)."""
    import dataclasses

    from parallel.planner.calibrate import fit_runtime
    from parallel.planner.cluster import Runtime
    from telechat_moe.calibration import MEMORY_PROBES, PROBES, predict_step, probe_workload

    cpu = load_cluster("cpu")
    truth = Runtime(compute_scale=0.8, expert_compute_scale=3.0, update_scale=12.0, accumulate_scale=9.0,
                    step_overhead=0.2, devices_share_cores=True, keeps_op_outputs=True, rendezvous_transfers=True,
                    activation_outputs=7.0, recompute_outputs=2.0, weight_outputs=4.0, graph_memory=3e8,
                    communicator_memory=2e8)
    made = dataclasses.replace(cpu, runtime=truth)
    measured = []
    for name, recipe, o in MEMORY_PROBES:
        w, lay = probe_workload(recipe, o, cpu)
        measured.append({"name": name, "workload": w, "layouts": lay, **predict_step(recipe, o, made)})
    for m in measured[len(PROBES):]:  # as measured: memory only
        del m["step_time"]
    fitted, report = fit_runtime(cpu, measured)
    for f in dataclasses.fields(Runtime):
        assert getattr(fitted, f.name) == pytest.approx(getattr(truth, f.name), rel=1e-6), f.name
    assert all(r["predicted"][k] == pytest.approx(r[k]) for r in report for k in ("step_time", "step_memory") if k in r)


def test_probe_steps_are_timed_beside_the_reference(tmp_path):
    """The calibration's and the accuracy bench's worker: a probe's memory over its first steps alone, then its
    steps in rounds with the reference probe's, both real trainers in one process."""
    from telechat_moe.calibration import PROBES, REFERENCE, measure_steps

    name, recipe, overrides = next(p for p in PROBES if p[0] == "micro2")
    r = measure_steps(recipe, overrides, tmp_path, name, memory_steps=1, rounds=3, beside=[REFERENCE])
    assert 0 < r["step_time"] < 60 and 0 < r["beside"][REFERENCE[0]] < 60 and 1e7 < r["step_memory"] < 1e10
    assert [len(t) for t in r["times"].values()] == [3, 3]
