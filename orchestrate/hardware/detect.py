"""Detect this machine's hardware: GPUs through NVML (else `nvidia-smi`), CPU RAM and cores through psutil.

No CUDA context is created (torch.cuda is never imported): NVML and nvidia-smi read the driver only.
Reading and interpreting are split, so the parsers and the profile builder are tested on captured
outputs without a GPU. Peak throughputs cannot be read from a card: a detected GPU takes them from the
preset of the same name, or from `generic-8gb` when no preset names it. NVMe bandwidth is not measured
(a read-back test would mostly time the page cache); profiles keep their defaults.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import psutil

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.presets import load_preset, preset_for_gpu
from orchestrate.hardware.profile import GPUSpec, HardwareProfile

NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=name,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max,driver_version",
    "--format=csv,noheader,nounits",
]
# What nvidia-smi prints for a field it cannot read on this card or platform (WSL, vGPU).
_UNKNOWN = {"", "[n/a]", "[not supported]", "n/a"}


@dataclass(frozen=True)
class DetectedGPU:
    """One GPU as the driver reports it; None where the driver could not say."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_lanes: int | None = None


@dataclass(frozen=True)
class GPUInventory:
    gpus: tuple[DetectedGPU, ...] = ()
    driver_version: str | None = None
    nvlink: bool = False
    """An NVLink link is active on some GPU (NVML only)."""
    p2p: bool | None = None
    """Every GPU pair can do peer-to-peer reads (NVML only, with 2+ GPUs); None: unknown."""


# --- parsing (pure) -------------------------------------------------------------------------------

def parse_nvidia_smi(text: str) -> GPUInventory:
    """Parse the CSV of `NVIDIA_SMI_QUERY`: one line per GPU, memory in MiB."""
    gpus, driver = [], ""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            raise _smi_error(f"line {lineno}: expected 6 comma-separated fields, got {line!r}")
        name, memory_mib, cc, gen, width, driver = fields
        try:
            gpus.append(DetectedGPU(
                name=name,
                memory_bytes=int(float(memory_mib) * 2**20),
                compute_capability=_known(cc, lambda s: tuple(int(p) for p in s.split(".")[:2])),
                pcie_gen=_known(gen, int),
                pcie_lanes=_known(width, int),
            ))
        except ValueError as exc:
            raise _smi_error(f"line {lineno}: {exc} in {line!r}") from exc
    return GPUInventory(tuple(gpus), _known(driver, str))


def _known(text: str, convert: Callable):
    return None if text.lower() in _UNKNOWN else convert(text)


def _smi_error(message: str) -> UserError:
    return UserError("cannot read the GPUs from nvidia-smi", [Problem(
        "nvidia-smi", message, "pass --profile <preset> or --profile <file.yaml> to skip detection")])


def visible_gpus(inventory: GPUInventory, cuda_visible_devices: str | None,
                 cuda_device_order: str | None = None) -> GPUInventory:
    """The GPUs CUDA will expose under CUDA_VISIBLE_DEVICES (NVML and nvidia-smi ignore it).

    Indices follow CUDA's rule: the list stops at the first invalid entry ("-1" hides all). UUID or
    MIG entries cannot be mapped without the UUIDs, so they keep that many GPUs, in order.
    """
    if cuda_visible_devices is None:
        return inventory
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if entries and not entries[0].lstrip("-").isdigit():
        kept = list(inventory.gpus[:len(entries)])
    else:
        kept = []
        for entry in entries:
            if not entry.isdigit() or int(entry) >= len(inventory.gpus):
                break
            kept.append(inventory.gpus[int(entry)])
    # CUDA breaks ties by PCI bus, so only different models can be numbered differently.
    mixed = len({(g.name, g.compute_capability) for g in inventory.gpus}) > 1
    if mixed and 0 < len(kept) < len(inventory.gpus) and cuda_device_order != "PCI_BUS_ID":
        # CUDA numbers GPUs fastest first unless told otherwise; NVML and nvidia-smi by PCI bus, so with
        # different cards an index may name another card than the one detected under it.
        raise UserError("cannot tell which GPUs CUDA_VISIBLE_DEVICES selects", [Problem(
            "CUDA_VISIBLE_DEVICES", f"{cuda_visible_devices!r} selects some of several different GPUs, and "
            "CUDA's default order (fastest first) may differ from the driver's (PCI bus)",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers GPUs as nvidia-smi does")])
    return GPUInventory(tuple(kept), inventory.driver_version, inventory.nvlink,
                        inventory.p2p if len(kept) > 1 else None)


def gpu_spec(gpu: DetectedGPU, nvlink: bool = False, p2p: bool | None = None) -> tuple[GPUSpec, str]:
    """Spec of a detected GPU and the preset its throughputs came from: measured fields (memory,
    compute capability, PCIe link) override the preset's; unknown ones keep it."""
    preset = preset_for_gpu(gpu.name) or "generic-8gb"
    base = load_preset(preset).gpu
    if base is None:  # preset_for_gpu only names GPU presets; generic-8gb has one
        raise RuntimeError(f"hardware preset {preset} has no GPU")
    update: dict = {"name": gpu.name, "memory_bytes": gpu.memory_bytes, "nvlink": nvlink}
    if gpu.compute_capability is not None:
        update["compute_capability"] = gpu.compute_capability
        if gpu.compute_capability < (8, 0):
            update["peak_tflops_bf16"] = 0.0
    if gpu.pcie_gen is not None:
        update["pcie_gen"] = gpu.pcie_gen
    if gpu.pcie_lanes is not None:
        update["pcie_lanes"] = gpu.pcie_lanes
    if p2p is not None:
        update["p2p"] = p2p
    return GPUSpec.model_validate(base.model_dump() | update), preset


def common_spec(specs: list[GPUSpec]) -> GPUSpec:
    """One spec for GPUs that differ: each figure is the weakest card's, since a data-parallel step
    waits for the slowest rank and must fit in the smallest memory."""
    if all(s == specs[0] for s in specs):
        return specs[0]
    slowest_link = min(specs, key=lambda s: s.pcie_bandwidth)
    return GPUSpec(
        name=" + ".join(dict.fromkeys(s.name for s in specs)),
        memory_bytes=min(s.memory_bytes for s in specs),
        compute_capability=min(s.compute_capability for s in specs),
        peak_tflops_fp16=min(s.peak_tflops_fp16 for s in specs),
        peak_tflops_bf16=min(s.peak_tflops_bf16 for s in specs),
        peak_tflops_fp32=min(s.peak_tflops_fp32 for s in specs),
        memory_bandwidth=min(s.memory_bandwidth for s in specs),
        pcie_gen=slowest_link.pcie_gen,
        pcie_lanes=slowest_link.pcie_lanes,
        nvlink=all(s.nvlink for s in specs),
        p2p=all(s.p2p for s in specs),
    )


def profile_from_inventory(inventory: GPUInventory, cpu_memory_bytes: int, cpu_cores: int) -> HardwareProfile:
    """The profile of one detected node; `name` says which preset supplied the throughputs."""
    if not inventory.gpus:
        return HardwareProfile(name="detected:cpu", gpus_per_node=0, gpu=None, cpu_processes=1,
                               cpu_memory_bytes=cpu_memory_bytes, cpu_cores=cpu_cores)
    matched = [gpu_spec(g, inventory.nvlink, inventory.p2p) for g in inventory.gpus]
    presets = "+".join(dict.fromkeys(preset for _, preset in matched))
    return HardwareProfile(
        name=f"detected:{presets}", gpus_per_node=len(inventory.gpus),
        gpu=common_spec([spec for spec, _ in matched]),
        cpu_memory_bytes=cpu_memory_bytes, cpu_cores=cpu_cores,
        driver_version=inventory.driver_version,
    )


def cgroup_memory_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit (cgroup v2 `memory.max`, else v1 `memory.limit_in_bytes`), or None.

    psutil reports the host's RAM, but a container is killed at its own limit.
    """
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)  # v1 writes a huge number (about 2**63) when unlimited; min() drops it
    return None


# --- reading (I/O) --------------------------------------------------------------------------------

def read_gpus_nvml(nvml: ModuleType | None = None) -> GPUInventory | None:
    """GPUs through NVML (nvidia-ml-py); None when the library or the driver is missing."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = tuple(DetectedGPU(
            name=_text(nvml.nvmlDeviceGetName(h)),
            memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            compute_capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)),
            pcie_gen=_nvml_optional(nvml, nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_lanes=_nvml_optional(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
        ) for h in handles)
        return GPUInventory(gpus, _text(nvml.nvmlSystemGetDriverVersion()),
                            _nvlink_active(nvml, handles), _p2p_all_pairs(nvml, handles))
    except nvml.NVMLError:
        return None
    finally:
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # nvidia-ml-py < 11.5 returns bytes


def _nvml_optional(nvml: ModuleType, query: Callable, *args):
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


def _nvlink_active(nvml: ModuleType, handles: list) -> bool:
    """Cards without NVLink raise NotSupported for every link."""
    return any(_nvml_optional(nvml, nvml.nvmlDeviceGetNvLinkState, h, link) == nvml.NVML_FEATURE_ENABLED
               for h in handles for link in range(nvml.NVML_NVLINK_MAX_LINKS))


def _p2p_all_pairs(nvml: ModuleType, handles: list) -> bool | None:
    if len(handles) < 2:
        return None
    return all(_nvml_optional(nvml, nvml.nvmlDeviceGetP2PStatus, a, b, nvml.NVML_P2P_CAPS_INDEX_READ)
               == nvml.NVML_P2P_STATUS_OK
               for i, a in enumerate(handles) for b in handles[i + 1:])


def read_gpus_nvidia_smi(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> GPUInventory | None:
    """GPUs through `nvidia-smi`; None when it is missing, hangs or finds no working driver
    (drivers before 510 lack the compute_cap field and also land here)."""
    try:
        done = run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return parse_nvidia_smi(done.stdout)


def read_gpus() -> GPUInventory:
    """NVML first (no subprocess, also reads NVLink and P2P), then nvidia-smi, else no GPUs."""
    inventory = read_gpus_nvml() or read_gpus_nvidia_smi() or GPUInventory()
    return visible_gpus(inventory, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))


def read_cpu_memory() -> int:
    limit = cgroup_memory_limit()
    total = psutil.virtual_memory().total
    return min(total, limit) if limit else total


def read_cpu_cores() -> int:
    """Physical cores, capped by the CPUs this process may run on (a container's cpuset)."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    return cores


def detect_hardware(
    read_gpus: Callable[[], GPUInventory] = read_gpus,
    read_cpu_memory: Callable[[], int] = read_cpu_memory,
    read_cpu_cores: Callable[[], int] = read_cpu_cores,
) -> HardwareProfile:
    """This machine as a one-node profile."""
    return profile_from_inventory(read_gpus(), read_cpu_memory(), read_cpu_cores())


def free_space(path: str, where: str) -> tuple[str, int]:
    """The absolute form of `path` and the free bytes on its disk. The directory must exist and be
    writable: a missing one would report the free space of whatever disk its parent is on (`/`), and
    DeepSpeed's swapper would find out only at the first offload, mid-run."""
    target = Path(path).expanduser().absolute()
    fix = "pass an existing directory on an NVMe disk that you can write to (mkdir -p it first)"
    try:
        if not target.exists():
            raise UserError("invalid NVMe path", [Problem(where, f"{target} does not exist", fix)])
        if not target.is_dir():
            raise UserError("invalid NVMe path", [Problem(where, f"{target} is not a directory", fix)])
        if not os.access(target, os.W_OK | os.X_OK):
            raise UserError("invalid NVMe path", [Problem(where, f"{target} is not writable by this user", fix)])
        return str(target), shutil.disk_usage(target).free
    except OSError as exc:  # e.g. a parent this user may not list
        raise UserError("invalid NVMe path", [Problem(where, f"{exc.strerror}: {exc.filename}", fix)]) from exc
