"""`python -m labkit bench strategies`: labkit's data parallelism, ZeRO-1 and FSDP
next to PyTorch's own (DDP, ZeroRedundancyOptimizer, FSDP2's fully_shard) on the
same model (a 4-layer MLP, and a GPT whose head is tied to its embedding), the
same ranks and the same run, interleaved so machine noise hits both alike. Step
times are timings; optimizer state (the memory ledger's holdings) and FSDP's peak
memory per rank (the memory ledger's peak total over one untimed step a round,
each rank's median over the rounds) are bytes, not timings. A step's peak varies a
little with timing (now and then a rank holds a collective's buffer a moment
longer, ~1 MiB here, FSDP2's as ours), hence the median."""

from __future__ import annotations

import dataclasses
import os
import statistics

from labkit.cli.bench import Row, exit_code, median_step, table

TARGETS = {"DataParallel / DDP": 1.05,
           "ShardedOptimizer / ZeroRedundancyOptimizer": 1.1,
           "FullyShardedDataParallel / FSDP2": 1.0,
           "FullyShardedDataParallel / FSDP2: peak memory per rank": 1.0}
PAIRS = (("DataParallel", "DDP"), ("ShardedOptimizer", "ZeroRedundancyOptimizer"),
         ("FullyShardedDataParallel", "FSDP2"))
MEASURED = ("FullyShardedDataParallel", "FSDP2")  # peak memory: one ledger step
WIDTH, LAYERS, BATCH = 1024, 4, 16  # Ψ = 4 × (1024² + 1024) ≈ 4.2 M parameters
# a GPT (labkit.parallel.models.TinyGPT) whose output head is the token embedding
# (tied, as GPT-2's): Ψ ≈ 12·h²·layers + vocab·h + seq·h ≈ 5.2 M parameters
GPT = {"vocab": 8192, "seq": 64, "hidden": 256, "heads": 4, "layers": 4}
GPT_BATCH = 8
MODELS = {"MLP": f"{LAYERS} x Linear({WIDTH}, {WIDTH})",
          "GPT": "a {layers}-block GPT, width {hidden}, vocab {vocab}, tied "
                 "embedding and head".format(**GPT)}


def _model(kind: str = "MLP"):
    import torch

    torch.manual_seed(0)
    if kind == "GPT":
        from labkit.parallel import TinyGPT

        model = TinyGPT(**GPT)
        model[-1].out.weight = model[0].tok.weight  # tied
        return model
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _units(model) -> list:
    """The modules each FSDP shards on its own (the root takes the rest): the
    MLP's Linears, the GPT's blocks (FSDP2's usual recipe)."""
    import torch

    from labkit.parallel import GPTBlock

    kind = GPTBlock if any(isinstance(m, GPTBlock) for m in model) else torch.nn.Linear
    return [m for m in model if isinstance(m, kind)]


def _setups():
    """name -> (make(model) -> (module, optimizer, after_backward, after_step))."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.parallel import DataParallel, ShardedOptimizer
    from labkit.parallel import FullyShardedDataParallel

    def labkit_dp(model):
        dp = DataParallel(model, bucket_mib=25, first_bucket_mib=1)  # DDP's defaults
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return dp, opt, dp.finish_gradient_synchronization

    def torch_ddp(model):
        ddp = DDP(model)  # 25 MiB buckets, the first 1 MiB: as ours above
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3), None

    def labkit_zero1(model):  # ZeRO-1 on data parallelism, as PyTorch's below
        dp = DataParallel(model, bucket_mib=25, first_bucket_mib=1)
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        return dp, opt, dp.finish_gradient_synchronization

    def torch_zero1(model):
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
        return ddp, opt, None

    def labkit_fsdp(model):
        units = {id(m) for m in _units(model)}  # as FSDP2's below, prefetch on
        fsdp = FullyShardedDataParallel(model, wrap=lambda m: id(m) in units)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
        return fsdp, opt, fsdp.finish_gradient_synchronization

    def torch_fsdp2(model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for unit in _units(model):  # each unit, then the root: as ours above
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), None

    return {"DataParallel": labkit_dp, "DDP": torch_ddp,
            "ShardedOptimizer": labkit_zero1, "ZeroRedundancyOptimizer": torch_zero1,
            "FullyShardedDataParallel": labkit_fsdp, "FSDP2": torch_fsdp2}


def _time_steps(rank, world_size, name: str, steps: int,
                kind: str = "MLP") -> tuple[float, int, int | None]:
    """Median seconds per training step of `name` on this rank, the bytes of
    optimizer state it holds after them, and (FSDP's two only) the peak total
    bytes of one more, untimed, step under the memory ledger."""

    import torch

    from labkit import ledger

    module, opt, sync = _setups()[name](_model(kind))
    torch.manual_seed(rank)
    if kind == "GPT":
        from labkit.parallel import lm_loss

        x = torch.randint(GPT["vocab"], (GPT_BATCH, GPT["seq"]))
        y, loss_fn = x.roll(-1, 1), lm_loss
    else:
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        loss_fn = torch.nn.functional.mse_loss

    def step():
        loss_fn(module(x), y).backward()
        if sync is not None:
            sync()
        opt.step()
        opt.zero_grad()

    seconds = median_step(step, steps)  # the first step builds state and buckets
    peak = None
    if name in MEASURED:
        with ledger.memory(module, opt) as m:
            step()
        peak = m.steps[-1].peak_total
    # ZeroRedundancyOptimizer keeps its shard's state in the optimizer it wraps
    held = ledger.holdings(module, getattr(opt, "optim", opt))
    return seconds, held.optstate, peak


def bench_strategies(world_size: int = 4, rounds: int = 5, steps: int = 10) -> int:
    """Each strategy's Adam step time (median over interleaved rounds of the
    slowest rank), optimizer state per rank and, where measured, peak memory,
    for each model; print the table and return exit_code of its rows."""
    import labkit

    n = world_size
    print(f"labkit bench strategies: {n} ranks, {os.cpu_count()} cores, Adam "
          "(step times are timings)")
    names, rows = list(_setups()), []
    with labkit.Cluster(n, timeout=600) as c:
        for kind, what in MODELS.items():
            print(f"{kind}: {what}")
            seconds = {k: [] for k in names}
            state, peak = {}, {k: [] for k in MEASURED}
            for r in range(rounds):  # interleaved: each round runs each strategy once
                print(f"  … round {r + 1} of {rounds}", flush=True)
                for name in names:
                    res = c.run(_time_steps, name, steps, kind)
                    seconds[name].append(max(s for s, _, _ in res))  # slowest rank
                    state[name] = [b for _, b, _ in res]
                    if name in MEASURED:
                        peak[name].append([p for _, _, p in res])
            peak = {k: [statistics.median(p) for p in zip(*v)]  # a rank's median
                    for k, v in peak.items()}
            rows += strategy_rows({k: statistics.median(v)
                                   for k, v in seconds.items()}, state, n, peak,
                                  model="" if kind == "MLP" else kind)
    print()
    print(table(rows))
    return exit_code(rows)


def strategy_rows(step_s: dict[str, float], state: dict[str, list[int]],
                  n: int, peak: dict[str, list[int]] | None = None,
                  model: str = "") -> list[Row]:
    """Rows: each step time, the step-time ratios with targets (a pair whose two
    strategies both ran), optimizer state, and FSDP's peak memory per rank; each
    name followed by `model` in brackets when one is given."""
    rows = [Row(f"{k} step, median of rounds", v) for k, v in step_s.items()]
    for ours, theirs in PAIRS:
        if ours in step_s and theirs in step_s:
            rows.append(Row(f"{ours} / {theirs}", step_s[ours] / step_s[theirs],
                            TARGETS[f"{ours} / {theirs}"], unit="x"))
    full = max(state["DDP"])
    for k in ("ShardedOptimizer", "ZeroRedundancyOptimizer"):
        worst = max(state[k])
        rows.append(Row(f"{k}: optimizer state, largest rank / DDP's", worst / full,
                        unit="x"))
    rows.append(Row("ShardedOptimizer: largest rank's state x N / DDP's",
                    max(state["ShardedOptimizer"]) * n / full, 1.001, unit="x"))
    if peak and all(k in peak for k in MEASURED):
        ours, theirs = (max(peak[k]) for k in MEASURED)  # the fullest rank of each
        rows.append(Row("FullyShardedDataParallel peak memory, fullest rank",
                        ours / 2**20, unit="MiB"))
        rows.append(Row("FSDP2 peak memory, fullest rank", theirs / 2**20,
                        unit="MiB"))
        name = "FullyShardedDataParallel / FSDP2: peak memory per rank"
        rows.append(Row(name, ours / theirs, TARGETS[name], unit="x"))
    if model:
        rows = [dataclasses.replace(r, name=f"{r.name} [{model}]") for r in rows]
    return rows
