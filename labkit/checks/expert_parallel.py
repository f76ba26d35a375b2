"""Chapter 12's checks: an MoE dispatch written on the ranks (split sizes, the
counts exchanged first, the rows and the permutation that brings them back), a
capacity factor that drops fewer than a given share of pairs, and the bytes a
rank sends for one MoE layer. Each names what is wrong: the rank, the split or
the row, and the likely mistake."""

from __future__ import annotations

import math

from labkit.checks.common import (
    NOT_YET,
    not_yet,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    is_number,
    run_answer,
)

E, K, T = 8, 2, 12  # experts, choices per token, tokens per rank (h = 3 marks)

# -- exercise 1: the dispatch --------------------------------------------------------


def _choices(rank: int):
    """(T, k) experts for rank `rank`'s tokens: uneven, different on every rank,
    some experts chosen by no token of a rank, never one expert twice a token."""
    import torch

    g = torch.Generator().manual_seed(200 + rank)
    scores = torch.rand(T, E, generator=g)
    scores[:, rank % E] += 0.6  # each rank leans to one expert: uneven splits
    return scores.topk(K, dim=-1).indices  # (T, k)


def _marked(rank: int):
    """Rank `rank`'s tokens: row t is (rank, t, 0): a row says where it came from."""
    import torch

    x = torch.zeros(T, 3)
    x[:, 0], x[:, 1] = rank, torch.arange(T)
    return x


def _as_list(v):
    import torch

    if isinstance(v, torch.Tensor):
        v = v.reshape(-1).tolist()
    try:
        v = [int(a) for a in v]
    except (TypeError, ValueError):
        return None
    return v


def _dispatch_worker(rank, world_size, fn):
    import torch
    import torch.distributed as dist

    from labkit.parallel import all_to_all_rows

    x, chosen = _marked(rank), _choices(rank)
    out = fn(x.clone(), chosen.clone(), E, None)
    res = {"chosen": chosen, "out": None, "back": None}
    if not isinstance(out, tuple) or len(out) != 4:
        res["out"] = repr(type(out).__name__)
        return res
    rows, send, receive, order = out
    send, receive = _as_list(send), _as_list(receive)
    ok = (send is not None and receive is not None and len(send) == world_size
          == len(receive) and isinstance(rows, torch.Tensor)
          and tuple(rows.shape) == (sum(receive), 3))
    # all ranks agree on whether to try the way back (a collective: all or none)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        back = all_to_all_rows(rows.detach().float(), receive, send)  # (T k, 3)
        res["back"] = back
    res["out"] = (rows.detach().clone() if isinstance(rows, torch.Tensor) else rows,
                  send, receive,
                  order.detach().clone() if isinstance(order, torch.Tensor) else order)
    return res


def _expected_send(chosen_by_rank, n):
    """send[r][q]: the pairs of rank r whose expert lives on rank q."""
    local = E // n
    return [[sum(int((c == e).sum()) for e in range(q * local, (q + 1) * local))
             for q in range(n)] for c in chosen_by_rank]


def _arrivals(outs, rank):
    """(source, token) of each row `rank` must receive, by the senders' own
    `order`: rank q's block for it, pairs order_q[start:start + send_q[rank]]."""
    want = []
    for q, (_, send, _, order) in enumerate(outs):
        start = sum(send[:rank])
        want += [(q, int(o) // K) for o in order[start:start + send[rank]]]
    return want


def check_dispatch(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's MoE dispatch on the ranks.

    `fn(x, experts, num_experts, group)`: x (T, h) this rank's tokens, experts
    (T, k) the expert of each of its k choices (experts [q·E/ep, (q+1)·E/ep) live
    on rank q), group None (all ranks). Returns (rows, send, receive, order):
    order (T·k,) the pairs t·k + j sorted by expert (stably), send[q] the rows
    this rank sends rank q, receive[q] the rows it gets from rank q (exchanged
    first: the receiver cannot know them), rows (sum(receive), h) what arrived,
    in rank order. A token row here is (rank, token, 0), so a wrong row says
    whose it is. The check also sends the rows back (the reverse all-to-all, the
    splits swapped) and puts row i at pair order[i]: every pair must get its own
    token back."""
    import torch

    n = cluster.world_size
    if E % n:
        raise ValueError(f"this check spreads {E} experts: it needs 1, 2, 4 or 8 "
                         f"ranks, not {n}")
    res = run_answer(cluster, _dispatch_worker, fn, what="dispatch", timeout=timeout)
    if res is None:
        return NOT_YET
    chosen = [r["chosen"] for r in res]
    send_want, local = _expected_send(chosen, n), E // n
    for rank, r in enumerate(res):
        if not isinstance(r["out"], tuple):
            raise ExerciseError(f"rank {rank}: dispatch returned {r['out']}; return "
                                "the tuple (rows, send, receive, order)")
        _, send, receive, order = r["out"]
        _check_splits(rank, n, local, send, receive, send_want, chosen[rank])
        _check_order(rank, order, chosen[rank])
    outs = [r["out"] for r in res]
    for rank, r in enumerate(res):
        rows, send, receive, order = r["out"]
        _check_rows(rank, rows, _arrivals(outs, rank))
        back = r["back"]
        want = _marked(rank)[order.long() // K]  # (T k, 3): pair order[i]'s token
        if back is None or not torch.equal(back, want):
            i = 0 if back is None else int((back != want).any(1).nonzero()[0])
            raise ExerciseError(
                f"rank {rank}: sent back with the splits swapped, row {i} should be "
                f"token {int(order[i]) // K}'s (pair {int(order[i])} = order[{i}]), "
                "but is not: the rows you send must be x[order // k], in `order`")
    print(f"correct: on {n} ranks every rank sent its {T}·{K} rows to the ranks of "
          "their experts, the counts went first, each rank received its experts' "
          "rows in rank order, and the reverse all-to-all brought every row back to "
          "its pair through `order`")
    return PASSED


def _check_splits(rank, n, local, send, receive, send_want, chosen) -> None:
    import torch

    per_expert = torch.bincount(chosen.reshape(-1), minlength=E).tolist()
    mine = send_want[rank]
    theirs = [send_want[q][rank] for q in range(n)]
    if send is None or len(send) != n:
        hint = (" — that is one count per expert; the all-to-all wants one per "
                "rank: add up the E/ep experts each rank holds"
                if send is not None and send == per_expert else "")
        raise ExerciseError(f"rank {rank}: send should be {n} whole numbers, rows to "
                            f"each rank, got {send}{hint}")
    if send != mine:
        hint = ("that is what this rank receives, not what it sends"
                if send == theirs else
                f"send[q] counts the pairs whose expert lives on rank q, experts "
                f"q·{local} to q·{local}+{local - 1}, over all {K} choices")
        raise ExerciseError(f"rank {rank}: send = {send}, expected {mine}: {hint}")
    if receive is None or len(receive) != n:
        raise ExerciseError(f"rank {rank}: receive should be {n} whole numbers, rows "
                            f"from each rank, got {receive}")
    if receive != theirs:
        hint = ("that is this rank's own send: a rank cannot know what the others "
                "send it; exchange the counts first (dist.all_to_all_single of the "
                "per-expert counts)" if receive == mine else
                "receive[q] is rank q's send[this rank]: exchange the counts first")
        raise ExerciseError(f"rank {rank}: receive = {receive}, expected {theirs}: "
                            f"{hint}")


def _check_order(rank, order, chosen) -> None:
    import torch

    tk = chosen.numel()
    if not isinstance(order, torch.Tensor) or order.dtype.is_floating_point \
            or tuple(order.shape) != (tk,):
        got = (f"{order.dtype} of shape {tuple(order.shape)}"
               if isinstance(order, torch.Tensor) else type(order).__name__)
        raise ExerciseError(f"rank {rank}: order should be an integer tensor of "
                            f"shape ({tk},), the pairs t·k + j sorted by expert; "
                            f"got {got}")
    if sorted(order.tolist()) != list(range(tk)):
        raise ExerciseError(f"rank {rank}: order is not a permutation of the {tk} "
                            "pairs 0..T·k-1: each pair is sent exactly once")
    experts = chosen.reshape(-1)[order]
    if not bool((experts[1:] >= experts[:-1]).all()):
        i = int((experts[1:] < experts[:-1]).nonzero()[0])
        hint = (" (order is the tokens' own order: sort the pairs by expert, e.g. "
                "argsort(stable=True))" if order.tolist() == list(range(tk)) else "")
        raise ExerciseError(f"rank {rank}: order is not sorted by expert: pair "
                            f"{int(order[i])} (expert {int(experts[i])}) comes before"
                            f" pair {int(order[i + 1])} (expert "
                            f"{int(experts[i + 1])}){hint}")


def _check_rows(rank, rows, want) -> None:
    import torch

    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (len(want), 3):
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows)
        raise ExerciseError(f"rank {rank}: rows should have shape ({len(want)}, 3), "
                            f"sum(receive) rows of h, got {got}")
    got = [(int(a), int(b)) for a, b, _ in rows.tolist()]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise ExerciseError(
                f"rank {rank}, received row {i}: token {g[1]} of rank {g[0]}, "
                f"expected token {w[1]} of rank {w[0]}: rows arrive from rank 0, "
                "then 1, ..., each sender's rows in its `order`; send x[order // k]")


# -- exercise 2: a capacity factor -----------------------------------------------------


def check_capacity_factor(what: str, cf, experts_by_rank, num_experts: int,
                          most_dropped: float) -> bool:
    """A capacity factor c under which the router's (token, expert) pairs
    (`experts_by_rank`: one (T, k) tensor per rank; capacity counts each rank's
    own T tokens) lose fewer than `most_dropped` (a fraction) to capacity, and no
    larger than the smallest factor that drops nothing: more is buffer that no
    pair fills. None: not answered yet."""
    from labkit.parallel import capacity, within_capacity

    if cf is None:
        not_yet(f"{what}: not answered yet (replace None with your factor)")
        return NOT_YET
    if not is_number(cf) or not cf > 0:
        raise ExerciseError(f"{what}: the capacity factor is a number > 0, not {cf!r}")
    k = experts_by_rank[0].shape[1]
    tk = sum(c.shape[0] * k for c in experts_by_rank)

    def dropped(c):
        return sum(int((~within_capacity(ex, num_experts, capacity(
            c, k, ex.shape[0], num_experts))).sum()) for ex in experts_by_rank) / tk

    # the factor at which the busiest expert of any rank fits: load / (k T / E)
    enough = max(int(ex.reshape(-1).bincount(minlength=num_experts).max())
                 * num_experts / (k * ex.shape[0]) for ex in experts_by_rank)
    share = dropped(cf)
    if cf > num_experts / k and cf > enough:
        raise ExerciseError(
            f"{what}: c = {cf:g} reserves room for more than all k·T pairs of a "
            f"rank in every expert (c > E/k = {num_experts / k:g}); is it a "
            "capacity in pairs? The factor c multiplies the balanced load k·T/E")
    if share >= most_dropped:
        raise ExerciseError(
            f"{what}: c = {cf:g} drops {share:.1%} of the pairs, not fewer than "
            f"{most_dropped:.1%}: raise it (the busiest expert needs the most room)")
    if cf > enough * (1 + 1e-9):
        raise ExerciseError(
            f"{what}: c = {cf:g} drops {share:.1%}, but already c = {enough:g} "
            "fits the busiest expert of every rank: beyond it every expert holds "
            "empty buffer, memory and compute no pair uses; pick a smaller c")
    print(f"{what}: c = {cf:g} drops {share:.1%} of the pairs (fewer than "
          f"{most_dropped:.1%}); each expert takes ⌈c·k·T/E⌉ pairs a rank, and "
          f"c = {enough:g} would drop none")
    return PASSED


# -- exercise 3: a layer's all-to-all bytes --------------------------------------------


def check_layer_bytes(what: str, yours, *, tokens: int, k: int, hidden: int, ep: int,
                      dtype_bytes: int) -> bool:
    """The bytes one rank sends for one MoE layer, forward and backward, with
    routing spread evenly (rows only, no counts): 4·T·k·h·b·(ep-1)/ep. Wrong
    answers are recognised by the factor they are off by. None: not answered."""
    if yours is None:
        not_yet(f"{what}: not answered yet (replace None with your bytes)")
        return NOT_YET
    if not is_number(yours):
        raise ExerciseError(f"{what}: expected a number of bytes, got {yours!r}")
    rows = tokens * k * hidden * dtype_bytes
    away = (ep - 1) / ep
    want = 4 * rows * away
    if math.isclose(yours, want, rel_tol=1e-9):
        print(f"{what}: {want:,.0f} B is right: 4 all-to-alls (dispatch and "
              f"combine, forward and backward) of T·k rows, {away:.4g} of them "
              "to other ranks")
        return PASSED
    mistakes = [
        (2 * rows * away, "that is the forward only: backward sends the same "
                          "two all-to-alls again, the other way"),
        (rows * away, "that is one all-to-all: a layer has the dispatch and the "
                      "combine, forward and backward"),
        (4 * rows, "every row counted as sent: with routing spread evenly "
                   f"1/ep of them stay on the rank, so (ep-1)/ep = {away:.4g} go"),
        (2 * rows, "the forward only, and the rows that stay home counted too"),
        (4 * rows * away / k, f"a row per token: each token is sent to k = {k} "
                              "experts, a row per (token, expert) pair"),
        (4 * rows * away * 4 / dtype_bytes, f"{dtype_bytes} bytes an element, "
                                            "not 4 (float32)"),
        (4 * rows * away * 8, "bits, not bytes"),
        (4 * rows * away * ep, "the whole group's bytes: the question asks for "
                               "one rank's"),
    ]
    for value, why in mistakes:
        if math.isclose(yours, value, rel_tol=1e-9):
            raise ExerciseError(f"{what}: {yours:,.0f} B is not right: {why}")
    ratio = yours / want if want else float("inf")
    raise ExerciseError(f"{what}: {yours:,.0f} B is not right ({ratio:.3g} x the "
                        "answer). Hint: the dispatch and the combine each move T·k "
                        "rows of h elements, (ep-1)/ep of them to other ranks, "
                        "forward and backward")
