"""Cluster YAMLs: every shipped file loads and cites its sources; broken files are rejected by field."""
import pytest
import yaml

from parallel.planner.cluster import CLUSTER_DIR, ClusterError, available_clusters, load_cluster


def test_shipped_clusters_load_with_sources():
    names = available_clusters()
    assert {"ascend910b", "h800", "h100", "cpu"} <= set(names)
    for name in names:
        c = load_cluster(name)
        assert c.devices_per_node >= 1 and c.memory_bytes > 0 and 0 < c.usable_memory <= c.memory_bytes
        assert {"device", "intra_node", "inter_node"} <= set(c.sources), name


def test_published_figures():
    h800, h100 = load_cluster("h800"), load_cluster("h100")
    assert h800.flops("bf16") == h100.flops("bf16") == 989e12  # same GH100 die
    assert h800.intra_bandwidth < h100.intra_bandwidth  # the export-limited NVLink
    assert load_cluster("ascend910b").memory_bytes == 64 * 2 ** 30


def _write(tmp_path, mutate):
    doc = yaml.safe_load((CLUSTER_DIR / "h100.yaml").read_text())
    mutate(doc)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["device"].pop("memory_bandwidth"), "device.memory_bandwidth"),
    (lambda d: d["inter_node"].update(bandwidth=-1), "inter_node.bandwidth"),
    (lambda d: d["efficiency"].update(matmul=1.5), "efficiency.matmul"),
    (lambda d: d.update(flash_attention="yes"), "flash_attention"),
    (lambda d: d["device"].update(peak_flops={}), "device.peak_flops"),
    (lambda d: d.update(devices_per_node="eight"), "devices_per_node"),
    (lambda d: d.update(runtime={"compute_scale": 0}), "compute_scale"),
    (lambda d: d.update(runtime={"keeps_op_outputs": "yes"}), "keeps_op_outputs"),
    (lambda d: d.update(runtime={"graph_memory": -1.0}), "graph_memory"),
    (lambda d: d.update(runtime={"kernel_overhead": 1.0}), "runtime.kernel_overhead"),
    (lambda d: d.update(host_link={"bandwidth": 0}), "host_link.bandwidth"),
    (lambda d: d.update(runtime={"fixed_memory_in_pool": "no"}), "fixed_memory_in_pool"),
])
def test_bad_cluster_file_names_the_field(tmp_path, mutate, field):
    path = _write(tmp_path, mutate)
    with pytest.raises(ClusterError, match=field.replace(".", r"\.")) as e:
        load_cluster(path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_unknown_cluster_lists_the_known_ones():
    with pytest.raises(ClusterError, match="available: ascend910b, cpu, h100, h800"):
        load_cluster("tpu9000")


def test_runtime_section_defaults_to_an_accelerator_runtime():
    assert load_cluster("h100").runtime.compute_scale == 1.0
    assert not load_cluster("ascend910b").runtime.keeps_op_outputs
    cpu = load_cluster("cpu").runtime  # fitted by the calibration on real training steps
    assert cpu.keeps_op_outputs and cpu.devices_share_cores and cpu.activation_outputs > 1 and cpu.update_scale > 1


def test_every_shipped_cluster_states_its_host_link_and_fixed_memory():
    """The host link (activation offload), the collective library's buffers per communicator and the runtime's
    working memory, each with a source; accelerators hold the last two beside the framework's memory pool."""
    for name in available_clusters():
        c = load_cluster(name)
        assert c.host_link_bandwidth > 0 and c.runtime.communicator_memory > 0 and c.runtime.graph_memory > 0, name
        assert "host_link" in c.sources and ("runtime" in c.sources), name
        assert c.runtime.fixed_memory_in_pool == (name == "cpu"), name
    assert load_cluster("ascend910b").runtime.communicator_memory == 2 * 200 * 2 ** 20  # 2 x HCCL_BUFFSIZE
