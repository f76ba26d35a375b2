"""`python -m labkit bench expert`: one mixture-of-experts layer, forward and
backward, under expert parallelism (ExpertParallelMoE), against the one-process
MoELayer it replaces and a dense MLP of the same active width (h -> k·ffn -> h).

Imports labkit.cli.bench; labkit, labkit.parallel and torch inside functions.

The three run on the same ranks, interleaved round by round so machine noise hits
all alike. The time ratio against one process measures our overhead on this
machine (ranks that share cores cannot beat the bound printed beside it), not a
speed-up one would see on a cluster.
"""

from __future__ import annotations

import os
import statistics

from labkit.cli.bench import Row, exit_code, median_step, progress, table

# ExpertParallelMoE / one-process MoELayer, step time: a ceiling. Where the ranks
# together have more cores than the loop's one rank (4 ranks on 2 cores: twice),
# spreading the experts must not be slower than running them all in one
# process; where they have not (one core), no target: there is nothing to gain.
# Like every timing target here it holds on a machine the bench has to itself:
# the ranks wait for each other at every all-to-all, so a rank that another
# program pushes off its core stalls all of them, and the loop does not wait.
TARGET_VS_ONE_PROCESS = 1.0
# bytes: the ledger's whole bytes against the closed form's, which multiplies
# fractions in floating point and so lands within a rounding error of a whole
# number: any disagreement of a real byte is > 0.5.
TARGET_BYTES = 0.5
# ExpertParallelMoE / dense MLP has no target: what routing and the all-to-alls
# cost against the k·ffn compute depends on tokens·h bytes against h·ffn FLOPs
# and on the machine's network against its cores; no figure binds us to one.
SIZES = {"hidden": 256, "ffn": 512, "experts": 8, "k": 2, "tokens": 512}
NAMES = ("ExpertParallelMoE", "one-process MoELayer", "dense MLP")


def _layer(s: dict):
    import torch

    from labkit.parallel import MoELayer

    torch.manual_seed(0)  # the same weights on every rank and in the loop
    return MoELayer(s["hidden"], s["ffn"], s["experts"], s["k"])


def _tokens(rank: int, s: dict):
    """Rank `rank`'s tokens and the gradient that comes back to its outputs."""
    import torch

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(s["tokens"], s["hidden"], generator=g)  # (T, h)
    return x, torch.randn(s["tokens"], s["hidden"], generator=g)  # (T, h)


def _step(rank: int, world_size: int, name: str, s: dict):
    """One forward and backward of `name` on this rank (the loop: rank 0 only,
    on every rank's tokens; the others wait). No gradient all-reduce in any of
    them: that is data parallelism's price, not routing's."""
    import torch

    from labkit.parallel import MLP, ExpertParallelMoE

    if name == "one-process MoELayer":
        if rank:
            return lambda: None
        module = _layer(s)
        x, dy = (torch.cat(t) for t in zip(*(_tokens(r, s)
                                              for r in range(world_size))))
    elif name == "dense MLP":
        torch.manual_seed(0)
        module = MLP(s["hidden"], s["k"] * s["ffn"])  # h -> k·ffn -> h
        x, dy = _tokens(rank, s)
    else:
        module = ExpertParallelMoE.from_moe(_layer(s))
        x, dy = _tokens(rank, s)
    x.requires_grad_(True)  # a layer in a model passes gradients on

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).backward(dy)

    return step


def _time_steps(rank, world_size, name: str, steps: int, s: dict) -> float:
    """Median seconds of one forward and backward of `name` on this rank."""
    return median_step(_step(rank, world_size, name, s), steps)


def _layer_bytes(rank, world_size, s: dict) -> dict:
    """One forward and backward of ExpertParallelMoE under the traffic ledger:
    its all-to-alls' bus bytes (for an all-to-all, exactly what leaves the
    rank), and the rows this rank's router sent away and received (MoEStats)."""
    from labkit import ledger
    from labkit.parallel import ExpertParallelMoE

    ep = ExpertParallelMoE.from_moe(_layer(s))
    x, dy = _tokens(rank, s)
    x.requires_grad_(True)
    with ledger.traffic() as t:
        ep(x).backward(dy)
    st = ep.stats
    return {"ledger": t.sum("bus_bytes", op="all_to_all"), "tokens": st.tokens,
            "sent_away": sum(st.sent) - st.sent[st.ep_rank],
            "received_away": sum(st.received) - st.received[st.ep_rank],
            "element_size": st.element_size}


def bench_expert(world_size: int = 4, rounds: int = 5, steps: int = 5,
                 sizes: dict | None = None) -> list[Row]:
    """Rows: the three step times (median over rounds of the slowest rank's
    median), the two ratios, and each rank's all-to-all bytes against the
    closed form."""
    import labkit

    s = dict(SIZES, **(sizes or {}))
    n = world_size
    with labkit.Cluster(n, timeout=600) as c:
        print(f"labkit bench expert: {n} ranks, {os.cpu_count()} cores, "
              f"{c.threads} torch thread(s) a rank; an MoE layer of {s['experts']} "
              f"experts h {s['hidden']} -> ffn {s['ffn']} -> h, top-{s['k']}, "
              f"{s['tokens']} tokens a rank (step times are timings)")
        print(_note(n, os.cpu_count() or 1, c.threads))
        progress("the layer's bytes, under the traffic ledger")
        layer_bytes = list(c.run(_layer_bytes, s))
        seconds: dict[str, list[float]] = {k: [] for k in NAMES}
        for r in range(rounds):  # each round runs each layer once, order alternating
            progress(f"round {r + 1} of {rounds}")
            for name in NAMES[::-1] if r % 2 else NAMES:
                seconds[name].append(max(c.run(_time_steps, name, steps, s)))
        threads = c.threads
    return expert_rows({k: statistics.median(v) for k, v in seconds.items()},
                       layer_bytes, s, n, os.cpu_count() or 1, threads)


def _note(ranks: int, cores: int, threads: int) -> str:
    """What the time ratio against one process can show on this machine."""
    used = min(ranks * threads, cores)
    return (f"note: the loop has one rank's {threads} core(s), the {ranks} ranks "
            f"share {used}:\n  at best {threads / used:.2f}x of the loop's time; the "
            "ratio is our overhead here\n  (all-to-alls, permutations), not a "
            "cluster's speed-up. The ranks meet at every\n  all-to-all, so other "
            "programs' load slows them more than the loop.")


def expert_rows(step_s: dict[str, float], layer_bytes: list[dict], s: dict,
                ranks: int, cores: int, threads: int) -> list[Row]:
    """Rows from the medians (seconds by name) and each rank's _layer_bytes."""
    from labkit.theory import expert_traffic

    ours, loop, dense = NAMES
    # the loop has one rank's cores; the ranks together, at most `cores`
    best = threads / min(ranks * threads, cores)
    rows = [Row(f"{ours} forward + backward, median of rounds", step_s[ours]),
            Row(f"{loop} on all {ranks} ranks' tokens (rank 0)", step_s[loop]),
            Row(f"{dense} h -> k·ffn -> h, data-parallel", step_s[dense]),
            Row(f"{ours} / {loop}", step_s[ours] / step_s[loop],
                TARGET_VS_ONE_PROCESS if best < 1 else None, unit="x"),
            Row(f"  best cores allow: {threads} core(s) / the ranks' "
                f"{min(ranks * threads, cores)}", best, unit="x"),
            Row(f"{ours} / {dense} (routing + all-to-alls)",
                step_s[ours] / step_s[dense], unit="x")]
    worst, largest = 0.0, 0.0
    for r, b in enumerate(layer_bytes):
        pairs = b["tokens"] * s["k"]
        want = expert_traffic(b["tokens"], s["k"], s["hidden"], ranks,
                              b["element_size"], leave=b["sent_away"] / pairs,
                              arrive=b["received_away"] / pairs,
                              experts=s["experts"]).total
        rows.append(Row(f"all-to-all bytes per layer, rank {r} (ledger)",
                        b["ledger"] / 2**20, unit="MiB"))
        worst = max(worst, abs(b["ledger"] - want))
        largest = max(largest, b["ledger"])
    rows.append(Row("  |ledger - expert_traffic|, worst rank", worst, TARGET_BYTES,
                    unit="B"))
    b = layer_bytes[0]
    even = expert_traffic(b["tokens"], s["k"], s["hidden"], ranks, b["element_size"],
                          experts=s["experts"]).total  # leave = (ep-1)/ep
    rows.append(Row("  largest rank / balanced routing's closed form",
                    largest / even, unit="x"))
    return rows


def run(world_size: int = 4) -> int:
    """The bench as a command: the table and its exit status."""
    rows = bench_expert(world_size)
    print()
    print(table(rows))
    return exit_code(rows)
