"""The hardware a plan is made for: GPUs per node, nodes, memory, links, disks.

Profiles come from detection (`detect.py`) or presets and profile files in `launch_configs/profiles/`
(`presets.py`), with CLI flags on top (`resolve.py`). Sizes are bytes, bandwidths bytes/s, so no unit is
ever guessed.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from orchestrate.hardware.software import SoftwareStack

MAX_MEMORY_BYTES = 2**50
"""1 PiB: more than any GPU or node has (the largest GPUs hold a few hundred GB, the largest nodes
tens of TB); a bigger number is a typo, and planning with it would accept any strategy."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class GPUSpec(_Spec):
    name: str
    """Marketing name, e.g. "NVIDIA GeForce RTX 3070"."""
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    """Total device memory per GPU."""
    compute_capability: tuple[int, int] = (8, 6)
    """CUDA compute capability; bf16 needs 8.0 or newer (Turing, 7.5, has none)."""
    peak_tflops_fp16: float = Field(gt=0)
    """Dense fp16 tensor-core peak with fp32 accumulate, from the vendor's spec sheet."""
    peak_tflops_bf16: float = Field(ge=0)
    """Dense bf16 tensor-core peak; 0 where the card has no bf16."""
    peak_tflops_fp32: float = Field(gt=0)
    """Non-tensor fp32 peak."""
    memory_bandwidth: float = Field(default=448e9, gt=0)
    """Device memory bandwidth, bytes/s."""
    pcie_gen: int = 4
    """PCIe generation of the GPU's link (host <-> GPU, and GPU <-> GPU without NVLink)."""
    pcie_lanes: int = 16
    """PCIe lanes the card uses (many 8 GB cards, e.g. the RTX 4060, are x8)."""
    nvlink: bool = False
    """An NVLink bridge joins the GPUs of a node."""
    p2p: bool = True
    """GPU peer-to-peer copies work (often disabled on consumer cards)."""

    @property
    def supports_bf16(self) -> bool:
        return tuple(self.compute_capability) >= (8, 0) and self.peak_tflops_bf16 > 0

    @property
    def pcie_bandwidth(self) -> float:
        """Usable one-direction host<->device bandwidth, bytes/s: ~0.8 of the raw link rate
        (why: docs/measurements.md#hardwareprofilepy)."""
        per_lane_gbps = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9}.get(self.pcie_gen, 0.985e9)
        return 0.8 * per_lane_gbps * self.pcie_lanes


class MemoryCorrection(_Spec):
    """A measured correction of the per-rank memory prediction on this machine: an out-of-memory
    error's shortfall (launch/oom_replan.py) or a calibration entry (hardware/calibration.py). The planner
    adds `(ratio - 1) x` the analytical per-rank total as the breakdown's `measured_correction`."""

    ratio: float = Field(ge=1.0)
    """measured / predicted; at least 1: a correction only ever raises a prediction (an
    over-prediction costs speed, an under-prediction an OOM on the user's card)."""
    family: str | None = None
    """The strategy family it applies to (`Strategy.family`, e.g. "fsdp-z3"); None: every family."""
    source: str
    """Where it came from, for the plan's note: "out-of-memory at step 3" or the calibration file."""
    reason: str = ""
    """One line: what was measured against what."""

    def applies_to(self, family: str) -> bool:
        return self.family is None or self.family == family


class HardwareProfile(_Spec):
    name: str = "custom"
    """Where the profile came from: a preset name or profile file stem, "detected:<preset that gave the
    throughputs>" or "custom", with "+flags" when CLI flags changed it."""
    nodes: int = Field(default=1, gt=0)
    """Machines in the job."""
    gpus_per_node: int = Field(default=0, ge=0)
    """GPUs per machine; 0 means CPU-only (gloo, one process per `--gpus`)."""
    gpu: GPUSpec | None = None
    """The GPU model (all GPUs are assumed identical); None on CPU-only machines."""
    cpu_memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    """CPU RAM per node."""
    cpu_cores: int = Field(default=8, gt=0)
    """Physical CPU cores per node (CPU Adam and data loading share them)."""
    cpu_processes: int = Field(default=1, gt=0)
    """CPU-only profiles: worker processes per node (the `--gpus N` of a machine without GPUs)."""
    nvme_path: str | None = None
    """Directory on an NVMe disk usable for offload; None if there is none."""
    nvme_free_bytes: int = 0
    """Free space at `nvme_path`."""
    nvme_read_bandwidth: float = 3.0e9
    """Sequential read bandwidth of the NVMe disk, bytes/s."""
    nvme_write_bandwidth: float = 2.0e9
    """Sequential write bandwidth of the NVMe disk, bytes/s."""
    inter_node_bandwidth: float = 1.25e9
    """Per-node network bandwidth between machines, bytes/s (default: 10 GbE)."""
    driver_version: str | None = None
    """NVIDIA driver version, when detected (some NCCL quirks depend on it)."""
    expandable_segments: bool = True
    """The CUDA caching allocator maps pages into one growing segment per stream
    (`expandable_segments:True`, what orchestrate sets on GPU launches); `resolve_hardware` takes it
    from the user's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF when set (hardware/alloc_conf.py).
    The memory model's allocator reserve depends on it."""
    software: SoftwareStack = Field(default_factory=SoftwareStack)
    """Library versions the plan is for (what each keeps on the GPU differs): this interpreter's, read
    when the profile is resolved, or pinned by a profile file."""
    memory_corrections: list[MemoryCorrection] = Field(default_factory=list)
    """Measured corrections of the memory model on this machine (the planner multiplies their ratios
    for a candidate of their family); resolved with the profile, never inside the planner."""

    def memory_correction(self, family: str) -> float:
        """The product of the ratios of the corrections that apply to `family` (1.0: none)."""
        ratio = 1.0
        for correction in self.memory_corrections:
            if correction.applies_to(family):
                ratio *= correction.ratio
        return ratio

    @property
    def has_gpu(self) -> bool:
        return self.gpus_per_node > 0 and self.gpu is not None

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.has_gpu else self.cpu_processes

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node
