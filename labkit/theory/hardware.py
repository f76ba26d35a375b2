"""Published hardware figures, each with its source. Nothing here is measured;
chapter 03 draws them and the layout calculator (labkit.theory.layout, its
cluster.py) prices its clusters with them: each figure is written here once.

Bandwidths are bytes per second (GB = 1e9 B), per direction unless `direction`
says otherwise. Where no vendor figure exists the entry says so instead of
guessing (NVIDIA publishes no register-file or L1 bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.units import GB, MB, TB

HOPPER_BLOG = "https://developer.nvidia.com/blog/nvidia-hopper-architecture-in-depth/"
H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
H100_WHITEPAPER = ("https://resources.nvidia.com/en-us-hopper-architecture/"
                   "nvidia-h100-tensor-c")
SCALING_BOOK_GPU = "https://jax-ml.github.io/scaling-book/gpus"
SCALING_BOOK_TPU = "https://jax-ml.github.io/scaling-book/tpus"
NDR = "https://docs.nvidia.com/networking/display/800GMMA4Z00NS/Overview"
TPU_V5P = "https://docs.cloud.google.com/tpu/docs/v5p-training"
TPU_V4 = "https://cloud.google.com/tpu/docs/v4"
MEGATRON_2021 = "https://arxiv.org/abs/2104.04473"  # Narayanan et al., sec. 5
A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
                  "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")


@dataclass(frozen=True)
class Level:
    name: str
    bandwidth: float | None  # bytes/s; None: no published figure
    direction: str  # "per direction", "bidirectional", "-"
    capacity: float | None  # bytes, where it is storage
    note: str
    source: str


HBM3_H100 = Level("HBM3", 3.35 * TB, "-", 80 * GB, "H100 SXM: 3.35 TB/s", H100_PAGE)
NVLINK4_GPU = Level("NVLink 4 (per GPU)", 450 * GB, "per direction", None,
                    "18 links x 25 GB/s each way; 900 GB/s bidirectional",
                    HOPPER_BLOG)
IB_NDR_GPU = Level("InfiniBand NDR (per NIC)", 50 * GB, "per direction", None,
                   "400 Gb/s line rate; DGX H100 has 8 such NICs, one per GPU", NDR)

H100_HIERARCHY = (
    Level("registers (per SM)", None, "-", 256 * 1024,
          "256 KB register file per SM; no published bandwidth", HOPPER_BLOG),
    Level("L1 / shared memory (per SM)", None, "-", 256 * 1024,
          "256 KB per SM (shared up to 228 KB); 32 banks x 4 B per clock, "
          "no published TB/s", HOPPER_BLOG),
    Level("L2 cache", 5.5 * TB, "-", 50 * MB,
          "50 MB; about 5.5 TB/s as measured (NVIDIA publishes none)",
          SCALING_BOOK_GPU),
    HBM3_H100,
    NVLINK4_GPU,
    Level("NVSwitch (any GPU pair, DGX H100)", 450 * GB, "per direction", None,
          "full 900 GB/s (bidirectional) between any pair of 8 GPUs",
          H100_WHITEPAPER),
    Level("PCIe Gen5 x16", 64 * GB, "per direction", None,
          "128 GB/s total, 64 GB/s each way", HOPPER_BLOG),
    IB_NDR_GPU,
)
# dense bf16 peak of an H100 SXM, FLOP/s (without sparsity; the page's 1,979 is
# with it)
H100_BF16_DENSE = 989e12

# A100 80 GB SXM (Selene, the 2021 Megatron-LM runs): HBM2e 2,039 GB/s, NVLink 3
# 600 GB/s bidirectional (300 each way), 8 x 200 Gb/s HDR InfiniBand per node of
# 8 (25 GB/s per GPU), dense bf16 312 TFLOPS
HBM2E_A100 = Level("HBM2e (A100 80 GB)", 2039 * GB, "-", 80 * GB,
                   "A100 80 GB SXM: 2,039 GB/s", A100_DATASHEET)
NVLINK3_GPU = Level("NVLink 3 (per GPU)", 300 * GB, "per direction", None,
                    "12 links; 600 GB/s bidirectional", A100_DATASHEET)
IB_HDR_GPU = Level("InfiniBand HDR (per NIC)", 25 * GB, "per direction", None,
                   "200 Gb/s line rate, 8 per DGX A100 node of 8 GPUs",
                   MEGATRON_2021)
A100_BF16_DENSE = 312e12

# one link of each kind, to compare like with like: an H100's 450 GB/s is 18 links
NVLINK4_LINK = Level("NVLink 4 (one link)", 25 * GB, "per direction", None,
                     "one of an H100's 18 NVLink 4 links", HOPPER_BLOG)

TPU_FIGURES = (
    Level("TPU v4 ICI link", 45 * GB, "per direction", None,
          "45 GB/s one way per link (90 bidirectional); 6 links per chip, 3D torus",
          SCALING_BOOK_TPU),
    Level("TPU v4 ICI (per chip, 6 links)", 6 * 45 * GB, "per direction", None,
          "6 links x 45 GB/s each way: +-x, +-y, +-z of the 3D torus",
          SCALING_BOOK_TPU),
    Level("TPU v5p ICI (per chip)", 600 * GB, "per direction", None,
          "1200 GB/s bidirectional per chip; pods of 8960 chips in a 3D torus",
          TPU_V5P),
    Level("TPU v4 HBM", 1200 * GB, "-", 32 * 2**30, "32 GiB at 1200 GB/s", TPU_V4),
)
