"""labkit.checks.expert_parallel (chapter 12): each check passes a right answer,
says "not written yet" for a stub, names each usual wrong answer, and fails
every shortcut: no communication, another collective doing the job, labkit's
own MoE layer or routing, an answer fitted to fixed inputs, NaN. A dispatch
whose all-to-all sizes do not pair up is explained, not aborted by gloo."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.expert_parallel import (
    check_balance,
    check_dispatch,
    check_ib_bytes,
)
from labkit.parallel import all_to_all_rows

# -- exercise 1: a dispatch with a capacity -------------------------------------------


def _kept(experts, num_experts, cap, token_major=False):
    t, k = experts.shape
    taken, keep = [0] * num_experts, []
    pairs = ([(i, j) for i in range(t) for j in range(k)] if token_major else
             [(i, j) for j in range(k) for i in range(t)])
    for i, j in pairs:
        e = int(experts[i, j])
        if taken[e] < cap:
            taken[e] += 1
            keep.append(i * k + j)
    keep = torch.tensor(sorted(keep), dtype=torch.long)
    return keep[experts.reshape(-1)[keep].argsort(stable=True)]


def _dispatch(x, experts, num_experts, cap, group, *, order=None, exchange=True,
              rows_of=None):
    ep, k = dist.get_world_size(group), experts.shape[1]
    order = _kept(experts, num_experts, cap) if order is None else order
    counts = torch.bincount(experts.reshape(-1)[order], minlength=num_experts)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(ep, -1).sum(1).tolist()
    receive = got.view(ep, -1).sum(1).tolist() if exchange else send
    rows = x[order // k] if rows_of is None else rows_of
    return all_to_all_rows(rows, send, receive, group), send, receive, order


def _good(x, experts, num_experts, cap, group):
    return _dispatch(x, experts, num_experts, cap, group)


def _reversed_within_expert(x, experts, num_experts, cap, group):
    order = _kept(experts, num_experts, cap).flip(0)  # grouped, experts descending
    e = experts.reshape(-1)[order]
    order = order[e.argsort(stable=True)]  # experts ascending, pairs reversed
    return _dispatch(x, experts, num_experts, cap, group, order=order)


def _todo(*args):
    raise NotImplementedError("exercise: a dispatch with a capacity")


def test_dispatch_check_passes_right_answers_and_says_what_it_measured(
        cluster, capsys):
    assert not check_dispatch(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_dispatch(cluster, _good)
    out = capsys.readouterr().out
    assert "correct: on 4 ranks, " in out and "pairs per expert from each rank" in out
    assert "measured on every rank: the counts exchanged first, then one " \
           "all-to-all of its kept rows" in out
    assert check_dispatch(cluster, _reversed_within_expert)  # any order by expert


def test_receive_never_exchanged_is_explained_before_gloo_aborts(cluster):
    # receive = this rank's own send: the rows' all-to-all would not pair up
    with pytest.raises(ExerciseError, match=r"rank \d, its 2nd all-to-all in your "
                       r"dispatch: it expects \[.*\] rows from ranks 0 to 3, but "
                       r"they send it \[.*\]; those are its own send sizes.*"
                       r"Exchange the counts first.*stopped this all-to-all "
                       r"before it ran"):
        check_dispatch(cluster, lambda *a: _dispatch(*a, exchange=False))
    assert cluster.run(lambda r, w: r).values == [0, 1, 2, 3]  # no rank died


def _no_capacity(x, experts, num_experts, cap, group):
    return _dispatch(x, experts, num_experts, cap, group,
                     order=experts.reshape(-1).argsort(stable=True))


def _token_major(x, experts, num_experts, cap, group):
    return _dispatch(x, experts, num_experts, cap, group,
                     order=_kept(experts, num_experts, cap, token_major=True))


def _one_more(x, experts, num_experts, cap, group):
    return _dispatch(x, experts, num_experts, cap + 1, group)


def _not_grouped(x, experts, num_experts, cap, group):
    order = _kept(experts, num_experts, cap).sort().values  # pair order
    return _dispatch(x, experts, num_experts, cap, group, order=order)


def _per_expert_counts(x, experts, num_experts, cap, group):
    rows, send, receive, order = _good(x, experts, num_experts, cap, group)
    counts = torch.bincount(experts.reshape(-1)[order], minlength=num_experts)
    return rows, counts.tolist(), receive, order


def _send_is_receive(x, experts, num_experts, cap, group):
    rows, send, receive, order = _good(x, experts, num_experts, cap, group)
    return rows, receive, send, order


def _rows_by_token(x, experts, num_experts, cap, group):  # splits right, rows not
    k = experts.shape[1]
    order = _kept(experts, num_experts, cap)
    return _dispatch(x, experts, num_experts, cap, group,
                     rows_of=x[order.sort().values // k])


@pytest.mark.parametrize("fn,match", [
    (_no_capacity, r"rank 0: order does not hold the kept pairs \(24 of them, \d+ "
                   r"kept\): no pair dropped"),
    (_token_major, r"rank \d: order does not hold the kept pairs.*pair order "
                   r"t·k \+ j; first choices come first"),
    (_one_more, r"rank \d: order does not hold the kept pairs.*those are \d pairs "
                r"per expert: each takes cap = \d"),
    (_not_grouped, r"rank 0: order is not grouped by expert"),
    (_per_expert_counts, r"rank 0: send should be 4 whole numbers.*one count per "
                         r"expert"),
    (_send_is_receive, r"rank \d: send = .* that is what this rank receives"),
    (_rows_by_token, r"rank \d, received row \d+: token \d+ of rank \d, expected"),
])
def test_dispatch_check_names_the_mistake(cluster, fn, match):
    with pytest.raises(ExerciseError, match=match):
        check_dispatch(cluster, fn)


def _no_communication(x, experts, num_experts, cap, group):
    # keeps what stays home and pretends the rest arrived: no collective at all
    ep, k = dist.get_world_size(group), experts.shape[1]
    order = _kept(experts, num_experts, cap)
    counts = torch.bincount(experts.reshape(-1)[order], minlength=num_experts)
    send = counts.view(ep, -1).sum(1).tolist()
    return x[order // k][:send[dist.get_rank()]], send, send, order


def _all_gathered(x, experts, num_experts, cap, group):
    # every rank's tokens and routing gathered, each rank picks its own rows:
    # the right values, without the dispatch's all-to-alls
    ep, rank, k = dist.get_world_size(group), dist.get_rank(group), experts.shape[1]
    xs = [torch.empty_like(x) for _ in range(ep)]
    es = [torch.empty_like(experts) for _ in range(ep)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(es, experts, group=group)
    local = num_experts // ep
    rows, receive = [], []
    for xq, eq in zip(xs, es):
        o = _kept(eq, num_experts, cap)
        mine = o[eq.reshape(-1)[o] // local == rank]
        rows.append(xq[mine // k])
        receive.append(len(mine))
    order = _kept(experts, num_experts, cap)
    counts = torch.bincount(experts.reshape(-1)[order], minlength=num_experts)
    return torch.cat(rows), counts.view(ep, -1).sum(1).tolist(), receive, order


def _all_reduced_counts(x, experts, num_experts, cap, group):
    flag = torch.zeros(1)
    dist.all_reduce(flag, group=group)
    return _good(x, experts, num_experts, cap, group)


def _labkits_capacity(x, experts, num_experts, cap, group):
    from labkit.parallel import within_capacity

    keep = within_capacity(experts, num_experts, cap).reshape(-1).nonzero()[:, 0]
    order = keep[experts.reshape(-1)[keep].argsort(stable=True)]
    return _dispatch(x, experts, num_experts, cap, group, order=order)


def _fixed_routing(x, experts, num_experts, cap, group):
    # the old check's routing (seeded 200 + rank), not the one it was given
    g = torch.Generator().manual_seed(200 + dist.get_rank())
    scores = torch.rand(experts.shape[0], num_experts, generator=g)
    scores[:, dist.get_rank() % num_experts] += 0.6
    fixed = scores.topk(experts.shape[1], dim=-1).indices
    return _dispatch(x, fixed, num_experts, 3, group)


@pytest.mark.parametrize("fn,match", [
    (_no_communication, r"rank \d: receive = .* this rank's own send"),
    (_all_gathered, r"rank 0, the values are right, but its last collective is "
                    r"not the all-to-all of its kept rows"),
    (_all_reduced_counts, r"rank 0: it called \['all_reduce'\]; the dispatch is "
                          r"all-to-alls"),
    (_labkits_capacity, r"rank 0: your answer calls labkit\.parallel\."
                        r"expert_routing\.within_capacity, labkit's own MoE layer"),
    (_fixed_routing, r"rank \d: order does not hold the kept pairs|"
                     r"its 2nd all-to-all"),
])
def test_dispatch_shortcuts_fail(cluster, fn, match):
    with pytest.raises(ExerciseError, match=match):
        check_dispatch(cluster, fn)


# -- exercise 2: the loss-free bias ---------------------------------------------------


def _balance(scores, bias, k, gamma, group, *, own=False, sign=1, gate_bias=False,
             pick_bias=True, steps=None, detach=False, op="all_reduce"):
    experts = ((scores + bias) if pick_bias else scores).topk(k, dim=-1).indices
    src = scores + bias if gate_bias else scores
    chosen = (src.detach() if detach else src).gather(1, experts)
    gates = chosen / chosen.sum(-1, keepdim=True)
    load = torch.bincount(experts.reshape(-1), minlength=scores.shape[1]).float()
    if op == "all_gather":
        parts = [torch.empty_like(load) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, load, group=group)
        load = sum(parts)
    elif not own:
        dist.all_reduce(load, group=group)
    step = (load.mean() - load) if steps == "plain" else torch.sign(load.mean() - load)
    return experts, gates, bias.detach() + sign * gamma * step


def _balance_todo(*args):
    raise NotImplementedError("exercise: the loss-free bias")


def test_balance_check_passes_and_says_what_it_measured(cluster, capsys):
    assert not check_balance(cluster, _balance_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_balance(cluster, _balance)
    out = capsys.readouterr().out
    assert ("backward through your gates put no gradient on it, and one all-reduce "
            "of 8 loads") in out


def _labkits_update(scores, bias, k, gamma, group):
    from labkit.parallel import Router, update_bias

    router = Router(1, scores.shape[1], k)
    router.bias.copy_(bias.detach())
    experts = router.choose(scores.detach())
    chosen = scores.gather(1, experts)
    load = torch.bincount(experts.reshape(-1), minlength=scores.shape[1])
    new = update_bias(router, load, gamma, sum_over=dist.group.WORLD)
    return experts, chosen / chosen.sum(-1, keepdim=True), new


@pytest.mark.parametrize("kw,match", [
    ({"own": True}, r"rank \d, new_bias\[\d\]: .* each rank moved the bias by its "
                    r"own tokens' load"),
    ({"sign": -1}, r"the busy experts' bias went up"),
    ({"steps": "plain"}, r"moved by γ·\(mean - load\)"),
    ({"gate_bias": True}, r"rank 0: backward through your gates put a gradient on "
                          r"the bias"),
    ({"pick_bias": False}, r"rank 0, token \d+: experts .* chosen without the bias"),
    ({"detach": True}, r"rank 0: your gates carry no gradient"),
    ({"op": "all_gather"}, r"rank 0, the values are right, but its collectives were "
                           r"\[\('all_gather', 32\)\]: .* one all-reduce of E = 8"),
])
def test_balance_check_names_the_mistake(cluster, kw, match):
    with pytest.raises(ExerciseError, match=match):
        check_balance(cluster, lambda *a: _balance(*a, **kw))


def test_balance_shortcuts_fail(cluster):
    with pytest.raises(ExerciseError, match=r"labkit\.parallel\.expert_routing\."
                       r".*labkit's own router and bias update"):
        check_balance(cluster, _labkits_update)

    def nan_bias(*a):
        experts, gates, new = _balance(*a)
        return experts, gates, new * float("nan")

    with pytest.raises(ExerciseError, match=r"new_bias\[0\]: got nan"):
        check_balance(cluster, nan_bias)


# -- exercise 3: InfiniBand bytes with node-limited routing ---------------------------


def _ib(tokens, k, hidden, ep, nodes, m, e):
    return 4 * tokens * m * (nodes - 1) / nodes * hidden * e


def _ib_todo(*args):
    raise NotImplementedError("exercise: InfiniBand bytes, node-limited")


def test_ib_bytes_check_passes_and_waits(capsys):
    assert check_ib_bytes(_ib)
    assert "DeepSeek-V3's layer: 822 MB over InfiniBand" in capsys.readouterr().out
    assert not check_ib_bytes(_ib_todo)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn,says", [
    # the chapter's calculator count: 924,844,032 B at DeepSeek-V3's layer
    (lambda t, k, h, ep, n, m, e: 4 * t * m * h * e * (ep - 1) / ep,
     r"got 924,844,032 B .* that counts a copy to a GPU in the token's own node"),
    (lambda t, k, h, ep, n, m, e: 4 * t * m * h * e, r"all M copies crossing"),
    (lambda t, k, h, ep, n, m, e: 4 * t * (m - 1) * h * e, r"M - 1 copies"),
    (lambda t, k, h, ep, n, m, e: 4 * t * k * h * e * (n - 1) / n,
     r"a row per \(token, expert\) pair"),
    (lambda t, k, h, ep, n, m, e: 4 * t * k * h * e * (ep - 1) / ep,
     r"without the node limit"),
    (lambda *a: _ib(*a) / 2, r"the forward only"),
    (lambda *a: _ib(*a) / 4, r"one exchange"),
    (lambda *a: 8 * _ib(*a), r"bits, not bytes"),
    (lambda *a: a[3] * _ib(*a), r"the whole group's bytes"),
    (lambda *a: _ib(*a) + 1, r"got 822,083,585 B .*, expected 822,083,584 B .*"
                             r"within 1.2e-09 of it: rounded, or something small"),
    (lambda *a: float(f"{_ib(*a):.3g}"), r"got 822,000,000 B .*: rounded"),
    (lambda *a: float("nan"), r"not a number an answer can be"),
    (lambda *a: "784 MiB", r"expected a number of bytes, got str"),
])
def test_ib_bytes_check_names_the_mistake(fn, says):
    with pytest.raises(ExerciseError, match=says):
        check_ib_bytes(fn)


def test_ib_bytes_shortcuts_fail():
    def theirs(t, k, h, ep, n, m, e):
        from labkit.theory import expert_traffic

        return expert_traffic(t, m, h, ep, e).total * (n - 1) / n * ep / (ep - 1)

    with pytest.raises(ExerciseError, match=r"labkit\.theory\.moe\.expert_traffic"):
        check_ib_bytes(theirs)
    # DeepSeek-V3's answer written down: right once, wrong on the fresh cases
    with pytest.raises(ExerciseError, match=r"got 822,083,584 B"):
        check_ib_bytes(lambda *a: 822_083_584)
