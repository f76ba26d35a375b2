"""The cluster a layout runs on: memory, links, latencies and the GPU's speed,
each constant with its source."""

from __future__ import annotations

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
class Cluster:
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
        for d in ("gpu_memory", "intra_bw", "inter_bw", "flops", "hbm_bw"):
            if getattr(self, d) <= 0:
                raise ValueError(f"{d} must be > 0, got {getattr(self, d)!r}")
        for d in ("alpha_intra", "alpha_inter"):
            if getattr(self, d) < 0:
                raise ValueError(f"{d} must be >= 0 s, got {getattr(self, d)!r}")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"gemm_efficiency must be in (0, 1], got "
                             f"{self.gemm_efficiency!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes
