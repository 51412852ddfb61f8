"""Hardware profiles: size parsing, presets, detection parsers (on captured outputs), flag resolution.

Nothing here reads this machine's hardware: detection is fed captured nvidia-smi text, a fake NVML
module and fake readers, and resolution gets a fake `detect`.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from types import SimpleNamespace

import pytest

from orchestrate.errors import UserError
from orchestrate.hardware.detect import (
    NVIDIA_SMI_QUERY,
    DetectedGPU,
    GPUInventory,
    cgroup_memory_limit,
    detect_hardware,
    parse_nvidia_smi,
    profile_from_inventory,
    read_gpus_nvidia_smi,
    read_gpus_nvml,
    visible_gpus,
)
from orchestrate.hardware.presets import list_presets, load_preset, load_profile, preset_for_gpu
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.resolve import profile_to_yaml, resolve_hardware
from orchestrate.hardware.software import SoftwareStack, cuda_of_torch, installed_software
from orchestrate.hardware.units import format_bytes, parse_size

GiB = 2**30


def _wheres(exc: pytest.ExceptionInfo[UserError]) -> list[str]:
    return [p.where for p in exc.value.problems]


# --- units ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * GiB), ("8GB", 8 * 10**9), ("64 GiB", 64 * GiB), ("512MiB", 512 * 2**20),
    ("8589934592", 8589934592), (4096, 4096), ("1.5GiB", 3 * GiB // 2), ("8gib", 8 * GiB), (" 2 TB ", 2 * 10**12),
])
def test_parse_size(text, expected):
    assert parse_size(text, "--gpu-mem") == expected


@pytest.mark.parametrize("text", ["8G", "lots", "-1GiB", "1.5", "8 XB", "", -5, "GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError) as exc:
        parse_size(text, "--cpu-mem")
    assert _wheres(exc) == ["--cpu-mem"]


def test_ambiguous_unit_suggests_both():
    with pytest.raises(UserError) as exc:
        parse_size("8G", "--gpu-mem")
    assert "8GiB" in exc.value.problems[0].fix and "8GB" in exc.value.problems[0].fix


@pytest.mark.parametrize("n, text", [(8 * 10**9, "7.45 GiB"), (8 * GiB, "8.00 GiB"), (512, "512 B"),
                                     (1536 * 2**20, "1.50 GiB"), (3 * 2**40, "3.00 TiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --- presets --------------------------------------------------------------------------------------

# name: (compute capability, bf16, PCIe gen, lanes, memory bandwidth GB/s) from the cited spec sheets.
EXPECTED = {
    "rtx2070": ((7, 5), False, 3, 16, 448), "rtx2080": ((7, 5), False, 3, 16, 448),
    "rtx3060ti": ((8, 6), True, 4, 16, 448), "rtx3070": ((8, 6), True, 4, 16, 448),
    "rtx4060": ((8, 9), True, 4, 8, 272), "rtx4060ti-8gb": ((8, 9), True, 4, 8, 288),
    "generic-8gb": ((8, 6), True, 4, 8, 272),
}


def test_preset_list():
    assert list_presets() == sorted([*EXPECTED, "cpu-only"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gpu_preset(name):
    profile = load_preset(name)
    cc, bf16, gen, lanes, bandwidth = EXPECTED[name]
    gpu = profile.gpu
    assert profile.name == name and profile.has_gpu and profile.gpus_per_node == 1 and profile.world_size == 1
    assert gpu.memory_bytes == 8192 * 2**20
    assert (gpu.compute_capability, gpu.supports_bf16, gpu.pcie_gen, gpu.pcie_lanes) == (cc, bf16, gen, lanes)
    assert gpu.memory_bandwidth == bandwidth * 1e9
    assert gpu.peak_tflops_bf16 == (gpu.peak_tflops_fp16 if bf16 else 0.0)
    assert gpu.peak_tflops_fp32 < gpu.peak_tflops_fp16 < 50  # fp32-accumulate figure, not the doubled one
    assert not gpu.nvlink and not gpu.p2p


def test_generic_is_the_floor_of_ampere_and_ada():
    generic = load_preset("generic-8gb").gpu
    for name in ("rtx3060ti", "rtx3070", "rtx4060", "rtx4060ti-8gb"):
        gpu = load_preset(name).gpu
        assert generic.peak_tflops_fp16 <= gpu.peak_tflops_fp16
        assert generic.peak_tflops_fp32 <= gpu.peak_tflops_fp32
        assert generic.memory_bandwidth <= gpu.memory_bandwidth
        assert generic.pcie_bandwidth <= gpu.pcie_bandwidth


def test_cpu_only_preset():
    profile = load_preset("cpu-only")
    assert (profile.gpus_per_node, profile.gpu, profile.has_gpu, profile.world_size) == (0, None, False, 1)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(UserError) as exc:
        load_preset("rtx307")
    problem = exc.value.problems[0]
    assert problem.where == "--profile" and "did you mean rtx3070" in problem.fix
    assert all(name in problem.fix for name in list_presets())


@pytest.mark.parametrize("gpu_name, preset", [
    ("NVIDIA GeForce RTX 3070", "rtx3070"), ("GeForce RTX 2080", "rtx2080"),
    ("NVIDIA GeForce RTX 4060", "rtx4060"), ("NVIDIA GeForce RTX 4060 Ti", "rtx4060ti-8gb"),
    ("NVIDIA GeForce RTX 3060 Ti", "rtx3060ti"),
    ("NVIDIA GeForce RTX 3070 Laptop GPU", None), ("NVIDIA GeForce RTX 2070 SUPER", None), ("NVIDIA H100", None),
])
def test_preset_for_gpu(gpu_name, preset):
    assert preset_for_gpu(gpu_name) == preset


def test_profile_yaml_round_trip(tmp_path):
    profile = resolve_hardware(profile="rtx3060ti", gpus=2, cpu_mem="32GiB", nvme=str(tmp_path))
    path = tmp_path / "rig.yaml"
    path.write_text(profile_to_yaml(profile))
    assert load_profile(str(path)) == profile
    assert resolve_hardware(profile=str(path), detect=_no_detect) == profile


def test_profile_file_without_name_takes_its_stem(tmp_path):
    path = tmp_path / "box.yml"
    path.write_text("gpus_per_node: 0\ncpu_memory_bytes: 17179869184\n")
    assert load_profile(str(path)).name == "box"


def test_invalid_profile_file_reports_every_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gpus_per_node: 1\ngpu: {name: x, memory_bytes: 0, peak_tflops_fp16: 1, peak_tflops_bf16: 0}\n"
                    "cpu_memory_bytes: 1024\nspeed: fast\n")
    with pytest.raises(UserError) as exc:
        load_profile(str(path))
    wheres = " ".join(_wheres(exc))
    assert "gpu.memory_bytes" in wheres and "gpu.peak_tflops_fp32" in wheres and "speed" in wheres
    assert str(path) in wheres


@pytest.mark.parametrize("text", ["gpus: [", "- a list"])
def test_profile_file_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError):
        load_profile(str(path))


# --- detection: parsers and builders --------------------------------------------------------------

SMI_TWO_3070 = """\
NVIDIA GeForce RTX 3070, 8192, 8.6, 4, 16, 550.54.14
NVIDIA GeForce RTX 3070, 8192, 8.6, 4, 16, 550.54.14
"""
# WSL 2 prints [N/A] for the PCIe link; the 16 GB 4060 Ti reports 16380 MiB.
SMI_WSL_4060TI = "NVIDIA GeForce RTX 4060 Ti, 16380, 8.9, [N/A], [N/A], 552.22\n"


def test_parse_nvidia_smi():
    inventory = parse_nvidia_smi(SMI_TWO_3070)
    assert inventory.driver_version == "550.54.14"
    assert inventory.gpus == (DetectedGPU("NVIDIA GeForce RTX 3070", 8 * GiB, (8, 6), 4, 16),) * 2
    profile = profile_from_inventory(inventory, cpu_memory_bytes=32 * GiB, cpu_cores=6)
    assert profile.name == "detected:rtx3070" and profile.gpus_per_node == 2 and profile.world_size == 2
    assert profile.gpu == load_preset("rtx3070").gpu
    assert (profile.cpu_memory_bytes, profile.cpu_cores, profile.driver_version) == (32 * GiB, 6, "550.54.14")


def test_unreadable_fields_keep_the_preset():
    profile = profile_from_inventory(parse_nvidia_smi(SMI_WSL_4060TI), 16 * GiB, 8)
    assert profile.gpu.memory_bytes == 16380 * 2**20
    assert (profile.gpu.pcie_gen, profile.gpu.pcie_lanes, profile.gpu.peak_tflops_bf16) == (4, 8, 44.1)


def test_measured_link_overrides_the_preset():
    # An RTX 4060 in a PCIe 3.0 board links at gen 3.
    profile = profile_from_inventory(parse_nvidia_smi("NVIDIA GeForce RTX 4060, 8188, 8.9, 3, 8, 535.1"), GiB, 1)
    assert (profile.gpu.pcie_gen, profile.gpu.pcie_lanes, profile.gpu.memory_bytes) == (3, 8, 8188 * 2**20)


def test_unknown_gpu_gets_generic_throughput_and_its_own_capability():
    profile = profile_from_inventory(parse_nvidia_smi("NVIDIA GeForce RTX 2060 SUPER, 8192, 7.5, 3, 16, 535.1"),
                                     GiB, 1)
    generic = load_preset("generic-8gb").gpu
    assert profile.name == "detected:generic-8gb"
    assert profile.gpu.name == "NVIDIA GeForce RTX 2060 SUPER"
    assert profile.gpu.peak_tflops_fp16 == generic.peak_tflops_fp16
    assert profile.gpu.compute_capability == (7, 5) and profile.gpu.peak_tflops_bf16 == 0.0


def test_mixed_gpus_plan_for_the_weakest():
    text = "NVIDIA GeForce RTX 3070, 8192, 8.6, 4, 16, 550.1\nNVIDIA GeForce RTX 2070, 7982, 7.5, 3, 16, 550.1\n"
    profile = profile_from_inventory(parse_nvidia_smi(text), GiB, 1)
    gpu = profile.gpu
    assert profile.name == "detected:rtx3070+rtx2070" and profile.gpus_per_node == 2
    assert gpu.name == "NVIDIA GeForce RTX 3070 + NVIDIA GeForce RTX 2070"
    assert gpu.memory_bytes == 7982 * 2**20 and not gpu.supports_bf16
    assert (gpu.peak_tflops_fp16, gpu.peak_tflops_fp32, gpu.pcie_gen) == (29.9, 7.5, 3)


def test_no_gpus_gives_a_cpu_profile():
    profile = profile_from_inventory(parse_nvidia_smi(""), 8 * GiB, 4)
    assert (profile.name, profile.has_gpu, profile.gpu, profile.cpu_processes) == ("detected:cpu", False, None, 1)


@pytest.mark.parametrize("text", ["NVIDIA GeForce RTX 3070, 8192, 8.6", "RTX 3070, [N/A], 8.6, 4, 16, 550.1"])
def test_malformed_nvidia_smi(text):
    with pytest.raises(UserError) as exc:
        parse_nvidia_smi(text)
    assert _wheres(exc) == ["nvidia-smi"] and "--profile" in exc.value.problems[0].fix


def _inventory(*names: str) -> GPUInventory:
    return GPUInventory(tuple(DetectedGPU(n, 8 * GiB) for n in names), "550.1", p2p=True)


@pytest.mark.parametrize("env, kept", [
    (None, 3), ("1", 1), ("0,2", 2), ("-1", 0), ("", 0), ("0,7,1", 1), ("GPU-6a2f, GPU-0b1c", 2),
])
def test_cuda_visible_devices(env, kept):
    visible = visible_gpus(_inventory("a", "a", "a"), env)
    assert len(visible.gpus) == kept
    assert visible.p2p is (True if kept > 1 else None)


def test_visible_subset_of_mixed_gpus_needs_pci_order():
    inventory = _inventory("NVIDIA GeForce RTX 3070", "NVIDIA GeForce RTX 2070")
    with pytest.raises(UserError) as exc:
        visible_gpus(inventory, "1")
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in exc.value.problems[0].fix
    assert visible_gpus(inventory, "1", "PCI_BUS_ID").gpus[0].name == "NVIDIA GeForce RTX 2070"
    assert len(visible_gpus(inventory, "1,0").gpus) == 2  # every GPU: the order does not matter


def test_cgroup_memory_limit(tmp_path):
    assert cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(tmp_path) is None
    (tmp_path / "memory.max").write_text("17179869184\n")
    assert cgroup_memory_limit(tmp_path) == 16 * GiB
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("8589934592\n")
    assert cgroup_memory_limit(tmp_path) == 8 * GiB


def test_detect_hardware_uses_its_readers():
    profile = detect_hardware(read_gpus=lambda: parse_nvidia_smi(SMI_TWO_3070),
                              read_cpu_memory=lambda: 48 * GiB, read_cpu_cores=lambda: 12)
    assert (profile.gpus_per_node, profile.cpu_memory_bytes, profile.cpu_cores) == (2, 48 * GiB, 12)


# --- detection: running nvidia-smi and NVML -------------------------------------------------------

def test_nvidia_smi_runner():
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, SMI_WSL_4060TI, "")

    assert read_gpus_nvidia_smi(run).gpus[0].memory_bytes == 16380 * 2**20
    assert calls == [NVIDIA_SMI_QUERY]


@pytest.mark.parametrize("failure", [
    FileNotFoundError(2, "No such file or directory: 'nvidia-smi'"),
    subprocess.TimeoutExpired(NVIDIA_SMI_QUERY, 20),
    subprocess.CompletedProcess(NVIDIA_SMI_QUERY, 9, "NVIDIA-SMI has failed because it couldn't communicate "
                                "with the NVIDIA driver.", ""),
])
def test_nvidia_smi_unavailable(failure):
    def run(cmd, **kwargs):
        if isinstance(failure, Exception):
            raise failure
        return failure

    assert read_gpus_nvidia_smi(run) is None


class _NVMLError(Exception):
    pass


def _fake_nvml(names: list[str], nvlink_up: bool = False, p2p_status: int = 0, init_fails: bool = False):
    """The slice of pynvml that detection calls; a card without NVLink raises NotSupported."""
    state = {"shut_down": False}

    def init():
        if init_fails:
            raise _NVMLError("Driver Not Loaded")

    def nvlink_state(handle, link):
        if not nvlink_up:
            raise _NVMLError("Not Supported")
        return 1 if link == 0 else 0

    def shutdown():
        state["shut_down"] = True

    return state, SimpleNamespace(
        NVMLError=_NVMLError, NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=4,
        NVML_P2P_CAPS_INDEX_READ=0, NVML_P2P_STATUS_OK=0,
        nvmlInit=init, nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(names),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h].encode(),  # old bindings return bytes
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=8 * GiB, free=7 * GiB, used=GiB),
        nvmlDeviceGetCudaComputeCapability=lambda h: (7, 5),
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 3,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlSystemGetDriverVersion=lambda: "535.183.01",
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetP2PStatus=lambda a, b, index: p2p_status,
    )


def test_nvml_with_an_nvlink_bridge():
    state, nvml = _fake_nvml(["NVIDIA GeForce RTX 2080"] * 2, nvlink_up=True, p2p_status=0)
    inventory = read_gpus_nvml(nvml)
    assert state["shut_down"]
    assert inventory.gpus == (DetectedGPU("NVIDIA GeForce RTX 2080", 8 * GiB, (7, 5), 3, 16),) * 2
    assert (inventory.driver_version, inventory.nvlink, inventory.p2p) == ("535.183.01", True, True)
    gpu = profile_from_inventory(inventory, GiB, 1).gpu
    assert gpu.nvlink and gpu.p2p and gpu.peak_tflops_fp16 == 40.3


def test_nvml_without_nvlink_or_p2p():
    _, nvml = _fake_nvml(["NVIDIA GeForce RTX 2080"] * 2, nvlink_up=False, p2p_status=2)
    inventory = read_gpus_nvml(nvml)
    assert (inventory.nvlink, inventory.p2p) == (False, False)


def test_nvml_single_gpu_keeps_preset_p2p():
    _, nvml = _fake_nvml(["NVIDIA GeForce RTX 2080"])
    assert read_gpus_nvml(nvml).p2p is None


def test_nvml_without_driver():
    _, nvml = _fake_nvml(["NVIDIA GeForce RTX 2080"], init_fails=True)
    assert read_gpus_nvml(nvml) is None


# --- resolution -----------------------------------------------------------------------------------

def _cpu_box() -> HardwareProfile:
    return HardwareProfile(name="fake-cpu", gpus_per_node=0, cpu_memory_bytes=16 * GiB, cpu_cores=4)


def _no_detect() -> HardwareProfile:
    raise AssertionError("detection must not run when --profile is given or a flag is bad")


def test_no_flags_is_the_detected_profile():
    resolved = resolve_hardware(detect=_cpu_box)
    assert resolved.model_copy(update={"software": SoftwareStack()}) == _cpu_box()


def test_resolution_records_the_installed_versions_unless_the_profile_pins_them():
    # The memory model depends on what each library version keeps (planner/software_terms.py).
    assert resolve_hardware(detect=_cpu_box).software == installed_software()
    assert installed_software().torch == importlib.metadata.version("torch")
    pinned = _cpu_box().model_copy(update={"software": SoftwareStack(torch="1.10.1+cu113")})
    assert resolve_hardware(detect=lambda: pinned).software == SoftwareStack(torch="1.10.1+cu113")


def test_cuda_version_comes_from_torch_local_tag():
    assert [cuda_of_torch(v) for v in ("2.13.0+cu130", "1.10.1+cu113", "2.13.0+cpu", "2.1.0", None)] == \
        ["13.0", "11.3", None, None, None]


def test_gpus_on_cpu_only_means_worker_processes():
    profile = resolve_hardware(gpus=4, detect=_cpu_box)
    assert (profile.has_gpu, profile.cpu_processes, profile.world_size) == (False, 4, 4)
    assert profile.name == "fake-cpu+flags"


@pytest.mark.parametrize("flags, gpus_per_node, memory", [
    ({"gpus": 2, "gpu_mem": "12GiB"}, 2, 12 * GiB),
    ({"gpu_mem": "6GiB"}, 1, 6 * GiB),
    ({"gpus_per_node": 3}, 3, 8 * GiB),
])
def test_gpu_flags_on_cpu_only_plan_a_gpu_machine(flags, gpus_per_node, memory):
    profile = resolve_hardware(detect=_cpu_box, **flags)
    generic = load_preset("generic-8gb").gpu
    assert profile.has_gpu and profile.gpus_per_node == gpus_per_node and profile.world_size == gpus_per_node
    assert profile.gpu == generic.model_copy(update={"memory_bytes": memory})


def test_flags_override_a_preset(tmp_path):
    (tmp_path / "offload" / "not-yet").mkdir(parents=True)  # --nvme must exist (test_hardware_flags.py)
    profile = resolve_hardware(profile="rtx3070", gpus=2, gpu_mem="7GiB", cpu_mem="32GiB", nodes=2,
                               nvme=str(tmp_path / "offload" / "not-yet"), detect=_no_detect)
    assert profile.name == "rtx3070+flags"
    assert (profile.gpus_per_node, profile.nodes, profile.world_size) == (2, 2, 4)
    assert (profile.gpu.memory_bytes, profile.cpu_memory_bytes) == (7 * GiB, 32 * GiB)
    assert profile.gpu.peak_tflops_fp16 == 40.6
    assert profile.nvme_path == str(tmp_path / "offload" / "not-yet") and profile.nvme_free_bytes > 0


def test_gpus_on_a_gpu_machine_sets_gpus_per_node():
    profile = resolve_hardware(gpus=3, detect=lambda: load_preset("rtx4060"))
    assert (profile.gpus_per_node, profile.cpu_processes, profile.name) == (3, 1, "rtx4060+flags")


def test_every_bad_flag_in_one_error(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(UserError) as exc:
        resolve_hardware(profile="nope", gpus=0, gpu_mem="8G", cpu_mem="lots", nodes=0,
                         nvme=str(a_file / "sub"), gpus_per_node=-1, detect=_no_detect)
    assert sorted(_wheres(exc)) == sorted(["--profile", "--gpus", "--gpu-mem", "--cpu-mem", "--nodes", "--nvme",
                                           "--gpus-per-node", "--gpus-per-node"])
    assert all(flag in str(exc.value) for flag in ("--gpus", "--nodes", "--nvme", "--profile"))


def test_size_without_unit_is_caught():
    with pytest.raises(UserError) as exc:
        resolve_hardware(gpu_mem="8", detect=_cpu_box)
    assert _wheres(exc) == ["--gpu-mem"] and "8GiB" in exc.value.problems[0].fix


def test_nvme_path_that_is_a_file(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(UserError) as exc:
        resolve_hardware(nvme=str(a_file), detect=_cpu_box)
    assert _wheres(exc) == ["--nvme"]
