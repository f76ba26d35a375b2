"""`python -m labkit bench roofline`: chapter 14's roofline against the GPU it
describes. Times bf16 matrix products of the shapes one GPU gets from a Llama 3
405B layer under TP 8 (QKV at 8192, 1024, 256 and 32 tokens, the MLP's down
projection at 8192) and sets each beside the calculator's price for it,
`gemm_time` (max of FLOPs over the calibrated peak and bytes over HBM bandwidth).

The roofline is a bound: no product may beat it by more than timing noise
(ceiling 1.1), and a calculator that prices training by it must not be far off
either (floor 0.6). All numbers here are timings, on CUDA only."""

from __future__ import annotations

import statistics

from labkit.cli.bench import Row

FLOOR, CEILING = 0.6, 1.1  # measured speed / roofline speed
TOKENS = (8192, 1024, 256, 32)
COPIES = 6  # operand sets cycled through, so that no product finds its operands
#             still in the L2 cache from the call before (50 MB on an H100)


def cluster_for(device_name: str):
    """The calculator's cluster constants for this GPU, or None if it has none."""
    from labkit.theory import A100_SELENE, H100_NODE

    name = device_name.upper()
    if "H100" in name or "H800" in name:
        return H100_NODE
    if "A100" in name:
        return A100_SELENE
    return None


def shapes() -> dict[str, tuple[float, float, float]]:
    """{label: (m, n, k)}: the products chapter 14's roofline chart places."""
    from labkit.theory import layer_gemms
    from labkit.theory import MODELS

    out = {}
    for tokens in TOKENS:
        qkv, _, _, down = layer_gemms(MODELS["llama3-405b"], tokens, 8, 1, moe=False)
        out[f"QKV, {tokens} tokens"] = qkv[1:]
        if tokens == 8192:
            out["MLP down, 8192 tokens"] = down[1:]
    return out


def time_gemm(m: int, n: int, k: int, reps: int = 20) -> float:
    """Median seconds of one bf16 (m x k) @ (k x n) product on the GPU, by CUDA
    events, each call on a different set of operands."""
    import torch

    ops = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
           for _ in range(COPIES)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for a, b in ops:  # warm-up: cuBLAS picks its kernel
        torch.matmul(a, b, out=out)
    times = []
    for i in range(reps):
        a, b = ops[i % COPIES]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def roofline_rows(measured: dict[str, float], cluster) -> list[Row]:
    """Rows of measured speed / roofline speed, each with its floor and ceiling;
    `measured` is {label: seconds} for the labels of `shapes()`."""
    from labkit.theory import gemm_time

    rows = []
    for label, (m, n, k) in shapes().items():
        ratio = gemm_time(m, n, k, cluster) / measured[label]
        tflops = 2 * m * n * k / measured[label] / 1e12
        rows.append(Row(f"{label}: {tflops:,.0f} TFLOPS; measured / roofline",
                        ratio, FLOOR, unit="x", at_least=True))
        rows.append(Row(f"{label}: no faster than the roof", ratio, CEILING,
                        unit="x"))
    return rows


def bench_roofline() -> int:
    """Time the matrix products chapter 14's calculator prices on this CUDA GPU,
    each against its roofline; exit_code of the rows, or 2 without a CUDA GPU
    or without roofline constants for it."""
    import torch

    from labkit.cli.bench import exit_code, table

    if not torch.cuda.is_available():
        print("bench roofline times matrix products on a CUDA GPU, and this machine "
              "has none: run it where chapter 14's GPUs are (an H100 or A100).")
        return 2
    name = torch.cuda.get_device_name()
    cluster = cluster_for(name)
    if cluster is None:
        print(f"bench roofline: no roofline constants for {name} in "
              "labkit.theory.layout (it has the H100/H800 and the A100)")
        return 2
    print(f"labkit bench roofline: {name}, torch {torch.__version__}, against "
          f"{cluster.name}'s constants (all timings)")
    measured = {label: time_gemm(*map(int, mnk)) for label, mnk in shapes().items()}
    rows = roofline_rows(measured, cluster)
    print(table(rows))
    return exit_code(rows)
