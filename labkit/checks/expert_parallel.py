"""Chapter 12's checks: a dispatch with a capacity (on the ranks), DeepSeek-V3's
loss-free balancing bias (on the ranks), and the InfiniBand bytes of one MoE
layer under node-limited routing.

The two on the ranks draw their routing fresh each run, run the answer under
the traffic ledger with labkit's own MoE layer and routing refused, and hold
it to the collectives the exercise asks for. An all-to-all whose sizes do not
pair up across the ranks (a receive that was never exchanged) is stopped
before gloo sees it, which would abort every rank, and explained.
"""

from __future__ import annotations

from fractions import Fraction

from labkit.checks.common import (
    NOT_WRITTEN,
    NOT_YET,
    PASSED,
    SHORT_TIMEOUT,
    ExerciseError,
    call_answer,
    finite,
    is_number,
    number_text,
    run_answer,
    wrong_element,
)
from labkit.checks.verify import (
    SizesDisagree,
    fresh_seed,
    own_calls,
    refuse_own,
    sizes_agree,
)

E, K, T, H = 8, 2, 12, 3  # experts, choices per token, tokens per rank, row width
# labkit's own MoE layer and routing (capacity, priority, bias), and this
# module's references: never an answer. all_to_all_rows, the chapter's
# collective, is allowed.
_OWN = ("labkit.parallel.expert_routing",
        "labkit.parallel.expert_parallel:_moe_forward",
        "labkit.parallel.expert_parallel:MoELayer",
        "labkit.parallel.expert_parallel:ExpertParallelMoE",
        "labkit.parallel.expert_parallel:_run_experts",
        "labkit.checks.expert_parallel:_kept",
        "labkit.checks.expert_parallel:_bias_reference",
        "labkit.checks.expert_parallel:_ib_bytes")


def _ordinal(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def _as_list(v):
    import torch

    if isinstance(v, torch.Tensor):
        v = v.reshape(-1).tolist()
    try:
        return [int(a) for a in v]
    except (TypeError, ValueError):
        return None


# -- an all-to-all whose sizes do not pair up (verify.sizes_agree stopped it) --------


def _mismatch_error(res, what: str, hint) -> ExerciseError:
    """The lowest rank whose all-to-all would have received other sizes than it
    expected, in rows, with `hint(rank, info)` saying what it likely missed."""
    for rank, r in enumerate(res):
        m = r["mismatch"]
        if m is None or (m["problem"] is None and m["theirs"] == m["expects"]):
            continue
        row = m["row"]
        whole = all(x % row == 0 for x in m["expects"] + m["theirs"])
        expects, theirs = ([x // row if whole else x for x in m[k]]
                           for k in ("expects", "theirs"))
        unit = "rows" if whole else "bytes"
        where = f"rank {rank}, its {_ordinal(m['call'])} all-to-all"
        if m["problem"] is not None:
            why = m["problem"]
        else:
            why = (f"it expects {expects} {unit} from ranks 0 to "
                   f"{len(expects) - 1}, but they send it {theirs}; "
                   + hint(rank, m))
        return ExerciseError(f"{where} in your {what}: {why} (the check stopped "
                             "this all-to-all before it ran: gloo aborts every "
                             "rank when the sizes of one collective do not pair "
                             "up)")
    return ExerciseError(f"an all-to-all's sizes did not pair up in your {what}")


# -- exercise 1: a dispatch with a capacity -------------------------------------------


def _routing(seed: int, n: int):
    """Each rank's (T, K) experts, drawn from `seed`: each rank leans to two
    experts, one mostly first choice, one often second, so a capacity drops pairs
    and which pairs it drops depends on serving first choices first; and the
    capacity, pairs per expert per rank."""
    import random

    import torch

    rng = random.Random(seed)
    for _ in range(100):
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        cap = rng.choice((2, 3, 4))
        chosen = []
        for _ in range(n):
            scores = torch.rand(T, E, generator=g)
            a, b = rng.sample(range(E), 2)
            scores[:, a] += 0.4
            scores[:, b] += 0.3
            chosen.append(scores.topk(K, dim=-1).indices)  # (T, K), never twice
        kept = [_kept(c, cap) for c in chosen]
        # every rank drops pairs, even at one more per expert (so that mistake
        # shows as the wrong pairs, not as nothing dropped), and serving first
        # choices first matters somewhere
        if all(len(_kept(c, cap + 1)) < T * K for c in chosen) and any(
                k != _kept(c, cap, token_major=True) for k, c in zip(kept, chosen)):
            return chosen, cap
    raise RuntimeError("no routing drawn where capacity and priority matter")


def _kept(chosen, cap: int, *, token_major: bool = False) -> set[int]:
    """The pairs t·K + j an expert takes, at most `cap` each: all first choices
    in token order, then all second ones (GShard's priority); token_major: in
    pair order t·K + j instead (a mistake the check names)."""
    t, k = chosen.shape
    taken, keep = [0] * E, set()
    order = ([(tok, j) for tok in range(t) for j in range(k)] if token_major else
             [(tok, j) for j in range(k) for tok in range(t)])
    for tok, j in order:
        e = int(chosen[tok, j])
        if taken[e] < cap:
            taken[e] += 1
            keep.add(tok * k + j)
    return keep


def _marked(rank: int):
    """Rank `rank`'s tokens: row t is (rank, t, 0), so a row says whose it is."""
    import torch

    x = torch.zeros(T, H)
    x[:, 0], x[:, 1] = rank, torch.arange(T)
    return x


def _dispatch_worker(rank, world_size, fn, chosen_all, cap, token):
    import torch
    import torch.distributed as dist

    from labkit.ledger import traffic
    from labkit.parallel import all_to_all_rows

    x, chosen = _marked(rank), chosen_all[rank]
    res = {"out": None, "back": None, "mismatch": None}
    with traffic() as led, own_calls(*_OWN) as own:
        with sizes_agree(token):
            try:
                out = fn(x.clone(), chosen.clone(), E, cap, None)
            except SizesDisagree as m:  # every rank raised it at the same call
                res["mismatch"], out = m.info(), None
    res["own"], res["records"] = list(own), list(led.records)
    if res["mismatch"] is not None:
        return res
    if not isinstance(out, tuple) or len(out) != 4:
        res["out"] = type(out).__name__
        return res
    rows, send, receive, order = out
    send, receive = _as_list(send), _as_list(receive)
    rows = rows.detach().clone() if isinstance(rows, torch.Tensor) else rows
    order = order.detach().clone() if isinstance(order, torch.Tensor) else order
    res["out"] = (rows, send, receive, order)
    ok = (send is not None and receive is not None and len(send) == world_size
          == len(receive) and isinstance(rows, torch.Tensor)
          and tuple(rows.shape) == (sum(receive), H))
    flag = torch.tensor([int(ok)])  # all ranks try the way back, or none
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        try:
            with sizes_agree(token + "/back"):
                res["back"] = all_to_all_rows(rows.float(), receive, send)
        except SizesDisagree:
            pass  # the splits it returned do not pair up: told in the kernel
    return res


def _send_of(chosen, keep: set[int], n: int) -> list[int]:
    """Rows to each rank: the kept pairs whose expert lives there."""
    local = E // n
    flat = chosen.reshape(-1).tolist()
    out = [0] * n
    for p in keep:
        out[flat[p] // local] += 1
    return out


def _dispatch_hint(n: int):
    def hint(rank, m):
        row = m["row"]
        expects, sends, theirs = ([x // row for x in m[k]]
                                  for k in ("expects", "sends", "theirs"))
        if expects == sends:
            return ("those are its own send sizes: a rank cannot know what the "
                    "others will send it. Exchange the counts first (an "
                    "all-to-all of its counts per expert), then receive[q] is "
                    "the sum of what rank q counted for this rank's experts")
        if sum(theirs) == sum(expects):
            return ("the totals agree but not the split by rank: receive[q] is "
                    "rank q's count for this rank's experts, in rank order")
        return ("receive[q] must be what rank q sends this rank: its kept pairs "
                f"for experts q·{E // n} to q·{E // n}+{E // n - 1}, exchanged "
                "first")
    return hint


def check_dispatch(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's MoE dispatch with a capacity, on the ranks.

    `fn(x, experts, num_experts, cap, group)`: x (T, h) this rank's tokens,
    experts (T, k) the expert of each choice (experts [q·E/ep, (q+1)·E/ep) live
    on rank q), cap the pairs each expert takes from this rank's tokens: all
    first choices in token order, then the second ones, the rest dropped and not
    sent. Returns (rows, send, receive, order): order the kept pairs t·k + j
    grouped by expert, send[q] / receive[q] the rows to / from rank q (the
    counts exchanged first), rows (sum(receive), h) what arrived, in rank order.
    The routing is drawn fresh each run; a token row is (rank, token, 0), so a
    wrong row says whose it is. The check sends the rows back (the splits
    swapped) and holds the rows' all-to-all to the kept pairs' bytes."""
    import torch

    n = cluster.world_size
    if E % n:
        raise ValueError(f"this check spreads {E} experts: it needs 1, 2, 4 or 8 "
                         f"ranks, not {n}")
    chosen, cap = _routing(fresh_seed(), n)
    res = run_answer(cluster, _dispatch_worker, fn, chosen, cap,
                     f"labkit-dispatch-{fresh_seed()}", what="dispatch",
                     timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "MoE layer or capacity")
    if any(r["mismatch"] for r in res):
        raise _mismatch_error(res, "dispatch", _dispatch_hint(n))
    for rank, r in enumerate(res):
        other = sorted({rec.op for rec in r["records"]} - {"all_to_all", "all_gather"})
        if other:
            raise ExerciseError(
                f"rank {rank}: it called {other}; the dispatch is all-to-alls: "
                "the counts first, then the rows (all_to_all_rows or "
                "dist.all_to_all_single)")
    keep = [_kept(c, cap) for c in chosen]
    send_want = [_send_of(c, k, n) for c, k in zip(chosen, keep)]
    for rank, r in enumerate(res):
        if not isinstance(r["out"], tuple):
            raise ExerciseError(f"rank {rank}: dispatch returned {r['out']}; return "
                                "the tuple (rows, send, receive, order)")
        _check_order(rank, r["out"][3], chosen[rank], cap, keep[rank])
    for rank, r in enumerate(res):  # every rank's pairs first: a receive is wrong
        _, send, receive, _ = r["out"]  # when another rank's kept pairs are
        _check_splits(rank, n, send, receive, send_want, chosen[rank])
    outs = [r["out"] for r in res]
    for rank, r in enumerate(res):
        rows, send, receive, order = r["out"]
        _check_rows(rank, rows, _arrivals(outs, rank))
        back = r["back"]
        want = _marked(rank)[order.long() // K]  # (kept, 3): pair order[i]'s token
        if back is None or not torch.equal(back, want):
            i = 0 if back is None or back.shape != want.shape else int(
                (back != want).any(1).nonzero()[0])
            raise ExerciseError(
                f"rank {rank}: sent back with the splits swapped, row {i} should be "
                f"token {int(order[i]) // K}'s (pair {int(order[i])} = order[{i}]), "
                "but is not: the rows you send must be x[order // k], in `order`")
    moved = _rows_moved(res)
    dropped = sum(T * K - len(k) for k in keep)
    print(f"correct: on {n} ranks, {cap} pairs per expert from each rank, first "
          f"choices first: {dropped} of {n * T * K} pairs dropped and not sent; "
          "measured on every rank: the counts exchanged first, then one "
          f"all-to-all of its kept rows ({moved} bytes to other ranks, all ranks "
          "together), each row back to its pair through `order`")
    return PASSED


def _rows_moved(res) -> str:
    """Hold each rank's last all-to-all (the rows) to its kept rows that leave
    it; the bytes every rank sent, in words."""
    total = 0
    for rank, r in enumerate(res):
        rows, send, _, _ = r["out"]
        a2a = [rec for rec in r["records"] if rec.op == "all_to_all"]
        away = (sum(send) - send[rank]) * H * 4
        if len(r["records"]) < 2:
            raise ExerciseError(
                f"rank {rank}, the values are right, but it made "
                f"{len(r['records'])} collective call: the counts go first, in a "
                "call of their own, then the rows")
        if not a2a or a2a[-1] is not r["records"][-1] or a2a[-1].elements != \
                sum(send) * H:
            raise ExerciseError(
                f"rank {rank}, the values are right, but its last collective is "
                "not the all-to-all of its kept rows (sum(send) rows of h): "
                "exchange the counts first, then the rows, once")
        if a2a[-1].bus_bytes != away:
            raise ExerciseError(
                f"rank {rank}, the values are right, but its rows' all-to-all sent "
                f"{a2a[-1].bus_bytes:,.0f} bytes to other ranks; its kept rows for "
                f"other ranks' experts are {away:,} bytes")
        total += away
    return f"{total:,}"


def _check_order(rank, order, chosen, cap, keep) -> None:
    import torch

    tk = chosen.numel()
    if not isinstance(order, torch.Tensor) or order.dtype.is_floating_point \
            or order.dim() != 1:
        got = (f"{order.dtype} of shape {tuple(order.shape)}"
               if isinstance(order, torch.Tensor) else type(order).__name__)
        raise ExerciseError(f"rank {rank}: order should be a 1-D integer tensor, "
                            f"the kept pairs t·k + j grouped by expert; got {got}")
    got = order.tolist()
    if len(set(got)) != len(got) or not set(got) <= set(range(tk)):
        raise ExerciseError(f"rank {rank}: order holds {len(got)} entries that are "
                            f"not distinct pairs of 0..{tk - 1}: each kept pair is "
                            "sent exactly once")
    if set(got) != keep:
        counts = ("" if len(got) == len(keep) else
                  f" ({len(got)} of them, {len(keep)} kept)")
        raise ExerciseError(f"rank {rank}: order does not hold the kept pairs"
                            f"{counts}: " + _keep_hint(set(got), chosen, cap, keep))
    experts = chosen.reshape(-1)[order]
    if not bool((experts[1:] >= experts[:-1]).all()):
        i = int((experts[1:] < experts[:-1]).nonzero()[0])
        raise ExerciseError(f"rank {rank}: order is not grouped by expert: pair "
                            f"{got[i]} (expert {int(experts[i])}) comes before pair "
                            f"{got[i + 1]} (expert {int(experts[i + 1])}); sort the "
                            "kept pairs by expert (argsort(stable=True))")


def _keep_hint(got: set[int], chosen, cap, keep) -> str:
    tk = chosen.numel()
    if got == set(range(tk)):
        return (f"no pair dropped: each expert takes at most cap = {cap} pairs of "
                "this rank's tokens; the rest are not sent (their output is 0)")
    if got == _kept(chosen, cap, token_major=True):
        return ("those are the first cap pairs of each expert in pair order "
                "t·k + j; first choices come first (GShard's priority): every "
                "token's first choice is served before any token's second")
    for c in (cap + 1, cap - 1):
        if c >= 0 and got == _kept(chosen, c):
            return f"those are {c} pairs per expert: each takes cap = {cap}"
    firsts = {p for p in keep if p % chosen.shape[1] == 0}
    if got == firsts:
        return ("those are the kept first choices only: a second choice is "
                "kept too while its expert has room")
    missing = sorted(keep - got)[:3]
    extra = sorted(got - keep)[:3]
    return (f"pairs {missing} should be kept, {extra} dropped (expert of pair p: "
            "experts.reshape(-1)[p]); each expert takes its first cap pairs, all "
            "first choices in token order, then second ones")


def _check_splits(rank, n, send, receive, send_want, chosen) -> None:
    import torch

    per_expert = torch.bincount(chosen.reshape(-1), minlength=E).tolist()
    mine = send_want[rank]
    theirs = [send_want[q][rank] for q in range(n)]
    if send is None or len(send) != n:
        hint = (" — that is one count per expert; the all-to-all wants one per "
                "rank: add up the E/ep experts each rank holds"
                if send is not None and len(send) == E else "")
        raise ExerciseError(f"rank {rank}: send should be {n} whole numbers, rows to "
                            f"each rank, got {send}{hint}")
    if send != mine:
        local = E // n
        all_pairs = [sum(per_expert[q * local:(q + 1) * local]) for q in range(n)]
        hint = ("that is what this rank receives, not what it sends"
                if send == theirs else
                "those count every pair, the dropped ones too: send only the kept"
                if send == all_pairs else
                f"send[q] counts the kept pairs whose expert lives on rank q, "
                f"experts q·{local} to q·{local}+{local - 1}")
        raise ExerciseError(f"rank {rank}: send = {send}, expected {mine}: {hint}")
    if receive is None or len(receive) != n:
        raise ExerciseError(f"rank {rank}: receive should be {n} whole numbers, rows "
                            f"from each rank, got {receive}")
    if receive != theirs:
        hint = ("that is this rank's own send: a rank cannot know what the others "
                "send it; exchange the counts first" if receive == mine else
                "receive[q] is rank q's send[this rank]: exchange the counts first")
        raise ExerciseError(f"rank {rank}: receive = {receive}, expected {theirs}: "
                            f"{hint}")


def _arrivals(outs, rank):
    """(source, token) of each row `rank` must receive, by the senders' own
    `order`: rank q's block for it, pairs order_q[start:start + send_q[rank]]."""
    want = []
    for q, (_, send, _, order) in enumerate(outs):
        start = sum(send[:rank])
        want += [(q, int(o) // K) for o in order[start:start + send[rank]]]
    return want


def _check_rows(rank, rows, want) -> None:
    import torch

    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (len(want), H):
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows)
        raise ExerciseError(f"rank {rank}: rows should have shape ({len(want)}, "
                            f"{H}), sum(receive) rows of h, got {got}")
    got = [(int(a), int(b)) for a, b, _ in rows.tolist()]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise ExerciseError(
                f"rank {rank}, received row {i}: token {g[1]} of rank {g[0]}, "
                f"expected token {w[1]} of rank {w[0]}: rows arrive from rank 0, "
                "then 1, ..., each sender's rows in its `order`; send x[order // k]")


# -- exercise 2: the loss-free balancing bias -----------------------------------------

BIAS_K = 2  # choices per token in exercise 2


def _bias_draw(seed: int, n: int):
    """Each rank's (T_r, E) router scores (softmax rows; T_r differs by rank, and
    all ranks' pairs are not a multiple of E, so no load equals the mean), the
    bias (the same on every rank), the weights (T_r, E) the check backpropagates
    through the gates with, and γ. Drawn so that the bias changes some choices,
    a rank's own load moves the bias otherwise than all ranks' load does, and no
    top-k is a near tie."""
    import random

    import torch

    rng = random.Random(seed)
    for _ in range(200):
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        tokens = [rng.randint(9, 16) for _ in range(n)]
        if sum(tokens) * BIAS_K % E == 0:
            continue
        scores = [(2 * torch.randn(t, E, generator=g)).softmax(-1) for t in tokens]
        bias = (torch.rand(E, generator=g) - 0.5) * 0.2
        weights = [torch.randn(t, E, generator=g) for t in tokens]
        gamma = round(rng.uniform(1e-3, 1e-2), 4)
        if not all(_clear(s + bias) and _clear(s) for s in scores):
            continue
        ref = _bias_reference(scores, bias, gamma)
        changed = any(not torch.equal(_topk_sets(s + bias), _topk_sets(s))
                      for s in scores)
        own = any(not torch.equal(o, ref["new"]) for o in ref["own"])
        if changed and own:
            return scores, bias, weights, gamma
    raise RuntimeError("no scores drawn where the bias and the sum over ranks matter")


def _clear(s) -> bool:
    """No token's k-th and (k+1)-th values within 1e-4: its top k is no near tie."""
    top = s.topk(BIAS_K + 1, dim=-1).values
    return bool((top[:, BIAS_K - 1] - top[:, BIAS_K] > 1e-4).all())


def _topk_sets(s):
    """(T, k) the top-k experts of each row, sorted by expert number."""
    return s.topk(BIAS_K, dim=-1).indices.sort(-1).values


def _bias_reference(scores, bias, gamma):
    """The update from first principles: the load (pairs per expert) over all
    ranks' tokens, chosen by scores + bias; bias + γ·sign(mean - load); and, for
    the diagnoses, the same with each rank's own load."""
    import torch

    def step(load):
        load = load.double()
        return (bias.double() + gamma * torch.sign(load.mean() - load)).float()

    loads = [torch.bincount(_topk_sets(s + bias).reshape(-1), minlength=E)
             for s in scores]
    total = sum(loads)
    return {"load": total, "new": step(total), "own": [step(x) for x in loads]}


def _balance_worker(rank, world_size, fn, scores_all, bias0, weights, gamma):
    import torch

    from labkit.ledger import traffic

    scores = scores_all[rank].clone().requires_grad_()
    bias = bias0.clone().requires_grad_()  # a gradient reaching it is shown
    with traffic() as led, own_calls(*_OWN) as own:
        out = fn(scores, bias, BIAS_K, gamma, None)
    res = {"own": list(own), "records": list(led.records), "out": None}
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        res["out"] = type(out).__name__
        return res
    experts, gates, new = out
    t = scores.shape[0]
    ok = (isinstance(experts, torch.Tensor) and not experts.dtype.is_floating_point
          and tuple(experts.shape) == (t, BIAS_K) and bool(
              ((experts >= 0) & (experts < E)).all())
          and isinstance(gates, torch.Tensor) and tuple(gates.shape) == (t, BIAS_K))
    res["grads"] = None
    if ok and gates.requires_grad:
        (gates * weights[rank].gather(1, experts.long())).sum().backward()
        res["grads"] = (scores.grad, bias.grad)
    res["out"] = tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v
                       for v in (experts, gates, new))
    return res


def check_balance(cluster, fn, *, timeout: float = SHORT_TIMEOUT) -> bool:
    """Check a student's DeepSeek-V3 loss-free balancing, on the ranks.

    `fn(scores, bias, k, gamma, group)`: scores (T, E) this rank's router scores
    (softmax), bias (E,) the balancing bias, the same on every rank. Returns
    (experts, gates, new_bias): experts (T, k) the top k of scores + bias; gates
    (T, k) those experts' scores, normalised to sum to 1 — from the scores
    alone, so the bias adds no gradient; new_bias = bias + γ·sign(mean - load),
    the load (pairs per expert) summed over all ranks with one all-reduce. The
    scores are drawn fresh each run; the check backpropagates through the gates
    and holds the bias to no gradient at all."""
    n = cluster.world_size
    scores, bias, weights, gamma = _bias_draw(fresh_seed(), n)
    res = run_answer(cluster, _balance_worker, fn, scores, bias, weights, gamma,
                     what="balancing", timeout=timeout)
    if res is None:
        return NOT_YET
    for rank, r in enumerate(res):
        refuse_own(f"rank {rank}", r["own"], "router and bias update")
    ref = _bias_reference(scores, bias, gamma)
    for rank, r in enumerate(res):
        if not isinstance(r["out"], tuple):
            raise ExerciseError(f"rank {rank}: it returned {r['out']}; return the "
                                "tuple (experts, gates, new_bias)")
        experts, gates, new = r["out"]
        s = scores[rank]
        _check_experts(rank, experts, s, bias)
        _check_gates(rank, experts, gates, r["grads"], s, bias, weights[rank])
        _check_new_bias(rank, new, ref, bias, gamma, scores)
    for rank, r in enumerate(res):
        ops = [(rec.op, rec.elements) for rec in r["records"]]
        if ops != [("all_reduce", E)]:
            raise ExerciseError(
                f"rank {rank}, the values are right, but its collectives were "
                f"{ops or 'none'}: the load's sum over the ranks is one all-reduce "
                f"of E = {E} numbers, the same update on every rank")
    load = ref["load"].tolist()
    print(f"correct on {n} ranks, scores drawn this run: the bias picked the "
          f"experts, backward through your gates put no gradient on it, and one "
          f"all-reduce of {E} loads ({load}, mean {sum(load) / E:g}) moved every "
          f"rank's bias by the same ±γ = {gamma:g}")
    return PASSED


def _check_experts(rank, experts, s, bias) -> None:
    import torch

    t = s.shape[0]
    if not isinstance(experts, torch.Tensor) or experts.dtype.is_floating_point \
            or tuple(experts.shape) != (t, BIAS_K):
        got = (f"{experts.dtype} of shape {tuple(experts.shape)}"
               if isinstance(experts, torch.Tensor) else type(experts).__name__)
        raise ExerciseError(f"rank {rank}: experts should be an integer tensor of "
                            f"shape ({t}, {BIAS_K}), got {got}")
    mine = experts.long().sort(-1).values
    want = _topk_sets(s + bias)
    bad = (mine != want).any(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        hint = ("chosen without the bias: the bias picks the experts, the top k "
                "of scores + bias" if torch.equal(mine, _topk_sets(s)) else
                "chosen with the bias subtracted: add it" if torch.equal(
                    mine, _topk_sets(s - bias)) else
                "the top k of scores + bias, k distinct experts a token")
        raise ExerciseError(f"rank {rank}, token {i}: experts {mine[i].tolist()}, "
                            f"expected {want[i].tolist()}: {hint}")


def _check_gates(rank, experts, gates, grads, s, bias, w) -> None:
    import torch

    t = s.shape[0]
    if not isinstance(gates, torch.Tensor) or tuple(gates.shape) != (t, BIAS_K):
        got = (tuple(gates.shape) if isinstance(gates, torch.Tensor)
               else type(gates).__name__)
        raise ExerciseError(f"rank {rank}: gates should be a tensor of shape "
                            f"({t}, {BIAS_K}), got {got}")
    if grads is None:
        raise ExerciseError(
            f"rank {rank}: your gates carry no gradient (detached, or made "
            "without the scores): the router learns through its gates, so they "
            "are the chosen scores themselves, normalised")
    sgrad, bgrad = grads
    if bgrad is not None and bool((bgrad != 0).any()):
        raise ExerciseError(
            f"rank {rank}: backward through your gates put a gradient on the bias "
            f"({bgrad.abs().max().item():.3g} at most): the gates depend on it. "
            "The bias only picks the experts; the gates are their scores without "
            "it, so it adds no gradient and leaves the model's function alone")
    ex = experts.long()
    exact = {}
    for dtype in (torch.float32, torch.float64):
        sd = s.to(dtype).clone().requires_grad_()
        chosen = sd.gather(1, ex)
        g = chosen / chosen.sum(-1, keepdim=True)
        (g * w.to(dtype).gather(1, ex)).sum().backward()
        exact[dtype] = (g.detach(), sd.grad)
    want, wgrad = exact[torch.float32]
    bad = wrong_element(gates.float(), want, exact[torch.float64][0])
    if bad is not None:
        (i, j), x, y, _ = bad
        raw, biased = s.gather(1, ex), (s + bias).gather(1, ex)
        hint = ("the scores themselves: normalise the k chosen to sum to 1"
                if torch.allclose(gates.float(), raw, rtol=1e-4) else
                "the gates include the bias: it picks the experts, it never "
                "weighs them (a detached bias in the gates still changes the "
                "model's function)" if torch.allclose(
                    gates.float(), biased / biased.sum(-1, keepdim=True),
                    rtol=1e-4) else
                "the k chosen scores, divided by their sum")
        raise ExerciseError(f"rank {rank}, gate [{i}, {j}] (expert {int(ex[i, j])})"
                            f": got {x:.6g}, expected {y:.6g}: {hint}")
    if sgrad is None or wrong_element(sgrad, wgrad,
                                      exact[torch.float64][1]) is not None:
        raise ExerciseError(
            f"rank {rank}: your gates have the right values but not the right "
            "gradient with respect to the scores: compute them from the scores "
            "(gather, divide by the sum), not from a detached copy")


def _check_new_bias(rank, new, ref, bias, gamma, scores) -> None:
    import torch

    if not isinstance(new, torch.Tensor) or tuple(new.shape) != (E,):
        got = (tuple(new.shape) if isinstance(new, torch.Tensor)
               else type(new).__name__)
        raise ExerciseError(f"rank {rank}: new_bias should be a tensor of shape "
                            f"({E},), got {got}")
    new = new.float()
    finite_all = bool(torch.isfinite(new).all())
    if finite_all and torch.allclose(new, ref["new"], rtol=0, atol=1e-6):
        return
    load = ref["load"].double()
    step = torch.sign(load.mean() - load)
    b = bias.double()
    near = (
        (ref["own"][rank], "each rank moved the bias by its own tokens' load: sum "
                           "the load over the ranks first (one all-reduce), so "
                           "that every rank makes the same update"),
        ((b - gamma * step).float(), "the busy experts' bias went up: it goes "
                                     "down when the load is above the mean"),
        ((b + gamma * (load.mean() - load)).float(), "moved by γ·(mean - load): "
         "the step is γ·sign(mean - load), the same size for every expert"),
        (bias.float(), "that is the old bias: move it"),
    )
    firsts = sum(torch.bincount((s + bias).argmax(-1), minlength=E)
                 for s in scores).double()
    near += (((b + gamma * torch.sign(firsts.mean() - firsts)).float(),
              "the load counts first choices only: each of the k choices is a "
              "pair"),)
    unbiased = sum(torch.bincount(_topk_sets(s).reshape(-1), minlength=E)
                   for s in scores).double()
    near += (((b + gamma * torch.sign(unbiased.mean() - unbiased)).float(),
              "the load of the experts chosen without the bias: count the pairs "
              "the bias chose"),)
    # every slip the answer equals: on a small draw two can give the same bias
    why = "; or: ".join(dict.fromkeys(
        w for v, w in near if finite_all and torch.allclose(new, v, rtol=0, atol=1e-6)
    )) or "bias + γ·sign(mean - load), the load summed over all ranks"
    i = int((~torch.isclose(new, ref["new"], rtol=0, atol=1e-6)).nonzero()[0])
    raise ExerciseError(f"rank {rank}, new_bias[{i}]: got {new[i].item():.6g}, "
                        f"expected {ref['new'][i].item():.6g} (expert {i}'s load "
                        f"over all ranks {int(ref['load'][i])}, mean "
                        f"{ref['load'].double().mean().item():g}): {why}")


# -- exercise 3: InfiniBand bytes with node-limited routing ---------------------------

# DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.1, 3.2.2, 4.2): 4,096 tokens a micro-batch
# per GPU, k = 8, h = 7,168, bf16, EP 64 over 8 nodes, M = 4 nodes a token
DEEPSEEK = (4096, 8, 7168, 64, 8, 4, 2)


def _ib_bytes(tokens, k, hidden, ep, nodes, max_nodes, dtype_bytes) -> Fraction:
    """Bytes one GPU sends over InfiniBand per MoE layer, forward and backward:
    a token's M nodes are its own with probability M/nodes, so M(nodes-1)/nodes
    copies cross, each one row, in the dispatch and the combine, both ways."""
    crossing = Fraction(max_nodes * (nodes - 1), nodes)
    return 4 * tokens * crossing * hidden * dtype_bytes


def _ib_cases(seed: int) -> list[tuple[int, ...]]:
    import random

    rng = random.Random(seed)
    cases = [DEEPSEEK]
    while len(cases) < 6:
        nodes = rng.randint(2, 16)
        per_node = rng.choice((1, 2, 4, 8))
        m = rng.randint(1, min(nodes, 8))
        k = m * rng.randint(1, 3)  # node-limited: M divides k
        if k > 16:
            continue
        cases.append((rng.choice((1024, 2048, 4096, 8192)) + rng.randrange(0, 512, 8),
                      k, rng.choice((2048, 4096, 5120, 7168)), nodes * per_node,
                      nodes, m, rng.choice((1, 2, 4))))
    return cases


def _ib_hint(case, got: float) -> str:
    tokens, k, hidden, ep, nodes, m, e = case
    rows = tokens * hidden * e
    near = (
        (4 * rows * m * (ep - 1) / ep, "M copies, (ep-1)/ep of them away: that "
         "counts a copy to a GPU in the token's own node as crossing; a copy "
         "stays inside whenever the token's own node is one of its M"),
        (4 * rows * m, "all M copies crossing: the token's own node is one of its "
         "M as often as any other node (M/nodes of the copies stay on NVLink)"),
        (4 * rows * (m - 1), "M - 1 copies: the token's own node is not always "
         "one of its M; with routing spread evenly it is, M/nodes of the time"),
        (4 * rows * k * (nodes - 1) / nodes, "a row per (token, expert) pair: "
         "with one copy per node a token crosses once per node, whatever k"),
        (4 * rows * k * (ep - 1) / ep, "a row per pair to every other GPU: "
         "that is expert parallelism without the node limit"),
        (2 * rows * m * (nodes - 1) / nodes, "the forward only: backward sends "
         "the same two exchanges again, the other way"),
        (rows * m * (nodes - 1) / nodes, "one exchange: a layer has the dispatch "
         "and the combine, forward and backward"),
        (32 * rows * m * (nodes - 1) / nodes, "bits, not bytes"),
        (4 * rows * m * (nodes - 1) / nodes * ep, "the whole group's bytes: the "
         "question is one GPU's"),
    )
    for v, why in near:
        if abs(got - v) <= 1e-9 * abs(v):
            return f"; that is {why}"
    want = float(_ib_bytes(*case))
    if abs(got - want) <= 1e-3 * want:
        return (f"; within {abs(got - want) / want:.2g} of it: rounded, or "
                "something small added (the counts?); the question is the rows "
                "alone, exactly")
    return ""


def check_ib_bytes(fn) -> bool:
    """Check a student's `fn(tokens, k, hidden, ep, nodes, max_nodes,
    dtype_bytes)`: the bytes one GPU sends over InfiniBand for one MoE layer,
    forward and backward, with node-limited routing (a token's experts on
    max_nodes nodes, routing spread evenly over the nodes) and one copy of a
    token per node. Tried on DeepSeek-V3's layer and on cases drawn fresh each
    run; labkit's MoE closed forms are refused, NaN is no answer."""
    cases = _ib_cases(fresh_seed())
    for case in cases:
        with own_calls("labkit.theory.moe", "labkit.theory.collective_cost",
                       *_OWN) as own:
            got = call_answer(fn, *case, what="ib_bytes")
        tokens, k, hidden, ep, nodes, m, e = case
        where = (f"T = {tokens}, k = {k}, h = {hidden}, EP {ep} on {nodes} nodes, "
                 f"M = {m}, {e} bytes an element")
        refuse_own(where, own, "MoE traffic formula (or this check's reference)")
        if got is NOT_WRITTEN:
            return NOT_YET
        if not is_number(got):
            raise ExerciseError(f"{where}: expected a number of bytes, got "
                                f"{type(got).__name__} {got!r}")
        finite(where, got)
        want = float(_ib_bytes(*case))
        # float64 against the exact Fraction: another order of the same
        # operations differs in the 16th digit; 1e-9 relative absorbs only that
        if not abs(got - want) <= 1e-9 * want:
            raise ExerciseError(f"{where}: got {number_text(got, 'bytes')}, "
                                f"expected {number_text(want, 'bytes')}"
                                + _ib_hint(case, float(got)))
    want = float(_ib_bytes(*DEEPSEEK))
    print(f"correct on {len(cases)} cases drawn this run; DeepSeek-V3's layer: "
          f"{want / 1e6:,.0f} MB over InfiniBand per GPU, forward and backward: "
          f"{4 * 7 / 8:g} copies of each token cross, not {DEEPSEEK[1]}")
    return PASSED
