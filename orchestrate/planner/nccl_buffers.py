"""NCCL's own device memory per communicator (not a torch allocation: the caching allocator never sees
it), read from NCCL's code at NVIDIA/nccl@5067397c, plus a margin for what that reading does not size.

- One connection: the receiving rank holds a FIFO per protocol (src/init.cc `computeBuffSizes`): LL,
  NCCL_LL_LINES_PER_THREAD 8 x NCCL_LL_MAX_NTHREADS 512 x NCCL_STEPS 8 x 16 B = 512 KiB; LL128,
  NCCL_LL128_ELEMS_PER_THREAD 120 x NCCL_LL128_MAX_NTHREADS 640 x 8 x 8 B = 4.69 MiB; Simple, NCCL_BUFFSIZE
  4 MiB (src/include/device.h), in one block rounded up to CUDA_IPC_MIN, 2 MiB (src/transport/p2p.cc
  `p2pRecvSetup`): 10 MiB; the sender's ncclSendMem block is rounded the same way, 2 MiB (with P2P read
  the Simple FIFO moves to the sender: the same 12 MiB). NVIDIA/nccl#1685's ALLOC log shows exactly these
  10485760- and 2097152-byte blocks, one pair per channel and peer.
- Per channel a rank receives and sends once on the ring and, once an all-reduce picks the tree, up and
  down its chain (src/graph/connect.cc `connectTrees`): 3 connections, 36 MiB. The tree is counted
  always: every backend all-reduces, the gradient norm at least, and NCCL may pick the tree for it.
- Channels: the topology search's rings, doubled (connect.cc: "Duplication should be complete now",
  `nChannels * 2`): 2 over PCIe (NCCL_DEBUG=INFO on PCIe machines: `Channel 00/02`, `Channel 01/02`),
  24 over NVLink ("24 coll channels" on A100-SXM4 and H100 nodes).
- Without peer-to-peer (GeForce drivers), the SHM transport keeps the FIFOs in host memory
  (src/transport/shm.cc `ncclShmAllocateShareableBuffer`): none on the device. Across nodes the NET
  transport puts them on the GPU only with GPUDirect RDMA (src/transport/net.cc `useGdr`), which
  GeForce cards lack: counted on the device where the card has peer-to-peer or NVLink.
"""

from __future__ import annotations

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import MiB

CONNECTION_BYTES = 12 * MiB
"""Receiver's FIFOs (LL + LL128 + Simple, 9.19 MiB, rounded to 2 MiB: 10 MiB) + the sender's 2 MiB block."""
CONNECTIONS_PER_CHANNEL = 3
"""Ring (one each way per rank) + tree (up and down the chain inside a node)."""
CROSS_NODE_TREE_CONNECTIONS = 2
"""Across nodes a node's head rank also links to up to two child nodes (NCCL_MAX_TREE_ARITY 3 counts the
parent too, src/include/device.h): counted on every rank."""
CHANNELS_PCIE = 2
CHANNELS_NVLINK = 24
UNSIZED_MARGIN = 128 * MiB
"""What the code reading above does not size: NCCL's device code loaded into the CUDA context, its
device-side communicator and channel structures, NVLS buffers on NVSwitch machines. A margin (the old
flat 200 MiB less the two PCIe channels' 72 MiB), not measured: README, Known gaps."""


def nccl_buffer_bytes(hw: HardwareProfile) -> int:
    """Device bytes one rank's NCCL communicator holds; 0 for a single rank (no communicator)."""
    if not hw.has_gpu or hw.world_size <= 1:
        return 0
    gpu = hw.gpu
    if not (gpu.p2p or gpu.nvlink):
        return UNSIZED_MARGIN
    channels = CHANNELS_NVLINK if gpu.nvlink else CHANNELS_PCIE
    connections = CONNECTIONS_PER_CHANNEL + (CROSS_NODE_TREE_CONNECTIONS if hw.nodes > 1 else 0)
    return UNSIZED_MARGIN + channels * connections * CONNECTION_BYTES
