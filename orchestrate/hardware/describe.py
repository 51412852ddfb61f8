"""A human-readable view of a hardware profile for `orchestrate profile`."""

from __future__ import annotations

from rich.table import Table

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import format_bytes


def profile_table(profile: HardwareProfile) -> Table:
    table = Table(title=f"hardware profile: {profile.name}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("nodes", str(profile.nodes))
    if profile.has_gpu:
        gpu = profile.gpu
        table.add_row("GPUs per node", f"{profile.gpus_per_node} x {gpu.name}")
        table.add_row("GPU memory", format_bytes(gpu.memory_bytes))
        table.add_row("compute capability", "{}.{}".format(*gpu.compute_capability)
                      + ("" if gpu.supports_bf16 else "  (no bf16: fp16 with dynamic loss scaling)"))
        table.add_row("peak TFLOPS fp16 / bf16 / fp32",
                      f"{gpu.peak_tflops_fp16:g} / {gpu.peak_tflops_bf16:g} / {gpu.peak_tflops_fp32:g}")
        table.add_row("interconnect", f"PCIe {gpu.pcie_gen}.0 x{gpu.pcie_lanes}"
                      f"{', NVLink' if gpu.nvlink else ''}{', P2P' if gpu.p2p else ', no P2P'}")
        if profile.driver_version:
            table.add_row("driver", profile.driver_version)
    else:
        table.add_row("GPUs", f"none: CPU-only, {profile.cpu_processes} worker process(es) per node (gloo)")
    table.add_row("CPU RAM per node", format_bytes(profile.cpu_memory_bytes))
    table.add_row("CPU cores per node", str(profile.cpu_cores))
    if profile.nvme_path:
        table.add_row("NVMe", f"{profile.nvme_path} ({format_bytes(profile.nvme_free_bytes)} free)")
    else:
        table.add_row("NVMe", "none (pass --nvme DIR to allow NVMe offload)")
    if profile.nodes > 1:
        table.add_row("network between nodes", f"{profile.inter_node_bandwidth / 1e9:g} GB/s")
    return table
