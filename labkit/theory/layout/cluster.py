"""The cluster a layout runs on, described (ClusterSpec: memory, links, latencies
and the GPU's speed, each constant with its source), and the clusters of the
published runs. Not labkit.Cluster, the pool of ranks a notebook runs code on.

Hardware figures (memory, bandwidths, peaks) come from labkit.theory.hardware,
where each is written once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.theory import hardware
from labkit.theory._validate import check_counts

# Per-step latency α of a ring collective, seconds. NCCL's own cost model
# (NVIDIA/nccl, src/graph/tuning.cc, table hwLat, Ring / Simple protocol, the
# protocol NCCL picks for the megabyte-sized messages of training): 3.4 us per
# step over NVLink, 14.0 us per step over the network (at commit b6475625; older
# releases had 9.6). NCCL charges a ring (nsteps - nInterSteps) x intra +
# nInterSteps x inter, nInterSteps being the ring's steps between nodes; its
# base latency per call (8.4 us, baseLat) is left out here.
ALPHA_NVLINK = 3.4e-6
ALPHA_NETWORK = 14.0e-6

# HBM bandwidth per GPU, bytes/s: hardware.py's datasheet figures. The H800 SXM
# is taken to have the H100 SXM's HBM3 (NVIDIA cut its NVLink, not its memory):
# an assumption, DeepSeek-AI 2024 gives no figure.
HBM_H100 = hardware.HBM3_H100.bandwidth
HBM_A100 = hardware.HBM2E_A100.bandwidth

# Achieved / peak of a large bf16 matrix product: the "maximum achievable matmul
# FLOPS" (Bekman, "Machine Learning Engineering", compute/accelerator/README.md,
# MAMF table, torch 2.6-2.7, best shape of a sweep): H100 SXM 794.5 of 989
# TFLOPS = 80.3 %, A100 SXM 271.2 of 312 = 86.9 %. The H800 is taken at the
# H100's (same SMs and clocks).
GEMM_EFFICIENCY_H100 = 794.5e12 / hardware.H100_BF16_DENSE
GEMM_EFFICIENCY_A100 = 271.2e12 / hardware.A100_BF16_DENSE


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs in nodes: memory per GPU (bytes), bandwidth per GPU per direction
    inside a node (intra_bw) and between nodes (inter_bw), bytes/s; flops: dense
    bf16 peak per GPU; hbm_bw: its memory bandwidth, bytes/s; gemm_efficiency:
    the fraction of the peak a large matrix product reaches; alpha_intra /
    alpha_inter: the latency of one step of a ring collective inside a node and
    between nodes, seconds (the H100 figures above by default)."""

    gpu_memory: float
    gpus_per_node: int
    nodes: int
    intra_bw: float
    inter_bw: float
    flops: float
    hbm_bw: float = HBM_H100
    gemm_efficiency: float = GEMM_EFFICIENCY_H100
    alpha_intra: float = ALPHA_NVLINK
    alpha_inter: float = ALPHA_NETWORK
    name: str = ""

    def __post_init__(self):
        check_counts(gpus_per_node=self.gpus_per_node, nodes=self.nodes)
        for field in ("gpu_memory", "intra_bw", "inter_bw", "flops", "hbm_bw"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("alpha_intra", "alpha_inter"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0 s, got "
                                 f"{getattr(self, field)!r}")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"gemm_efficiency must be in (0, 1], got "
                             f"{self.gemm_efficiency!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


# H100 SXM: 80 GB HBM3, dense bf16 peak, NVLink 4 per direction per GPU and one
# InfiniBand NDR NIC per GPU: hardware.py. HBM, GEMM efficiency and α: the
# defaults of ClusterSpec, each sourced above.
H100_NODE = ClusterSpec(80e9, 8, 1, hardware.NVLINK4_GPU.bandwidth,
                        hardware.IB_NDR_GPU.bandwidth, hardware.H100_BF16_DENSE,
                        name="one H100 node")
# Llama Team 2024, "The Llama 3 Herd of Models", sec. 3.3.1: up to 16K H100 80 GB
# (700 W) in Grand Teton servers of 8, NVLink inside a server, 400 Gb/s RoCE
# between GPUs; table 4: 38-43 % BF16 MFU (41 % at 16K GPUs and 8K tokens, 38 %
# at 131K). NCCL's α over RoCE is taken to be its network figure.
LLAMA3_CLUSTER = dataclasses.replace(H100_NODE, nodes=2048,
                                     name="Llama 3: 16,384 H100 80 GB")
# DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.1 and 3.2.2: 2048 H800
# GPUs, 8 per node; NVLink 160 GB/s and InfiniBand 50 GB/s per GPU. The H800's
# dense bf16 peak is the H100 SXM's (its NVLink is what was cut); DeepSeek-V3 ran
# its GEMMs in FP8, which this calculator does not model.
DEEPSEEK_V3_CLUSTER = ClusterSpec(80e9, 8, 256, 160e9,
                                  hardware.IB_NDR_GPU.bandwidth,
                                  hardware.H100_BF16_DENSE,
                                  name="DeepSeek-V3: 2048 H800 80 GB")
# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", sec. 5: Selene, DGX A100 80 GB nodes of 8 (the
# A100's figures: hardware.py); GEMMs at 86.9 % of the peak (above).
A100_SELENE = ClusterSpec(80e9, 8, 192, hardware.NVLINK3_GPU.bandwidth,
                          hardware.IB_HDR_GPU.bandwidth, hardware.A100_BF16_DENSE,
                          hbm_bw=HBM_A100, gemm_efficiency=GEMM_EFFICIENCY_A100,
                          alpha_intra=ALPHA_NVLINK, alpha_inter=ALPHA_NETWORK,
                          name="Selene: 1536 A100 80 GB")
