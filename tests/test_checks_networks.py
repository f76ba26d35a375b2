"""labkit.checks.networks (chapter 03): the MoE combine check (real ranks) and the
two-rings check pass right answers, say "not written yet" for stubs, and fail
each shortcut with its own message: no communication, a collective other than
all-to-all, labkit's own exchange, answers written down for fixed inputs, split
sizes that do not match (named before gloo sees them), NaN."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.networks import _draw_moe, _tori, check_moe_combine, check_two_rings
from labkit.comm.topology import ring_order


def test_drawn_routing_is_uneven_and_fresh():
    n = 4
    rows, experts, mark = _draw_moe(1, n)
    counts = [[int((experts[r] == e).sum()) for e in range(n)] for r in range(n)]
    assert any(counts[r][e] != counts[e][r] for r in range(n) for e in range(n)), (
        f"the counts are symmetric: {counts}")
    assert all(sum(row) - row[r] > 0 for r, row in enumerate(counts)), (
        f"a rank sends no token away: {counts}")
    values = torch.cat(rows).reshape(-1)
    assert len(values.unique()) == len(values), "token values repeat"
    other = _draw_moe(2, n)
    assert not all(torch.equal(a, b) for a, b in zip(experts, other[1])), (
        "two seeds, one routing")


def _back(y, send_counts, recv_counts, swap=False):
    out_split, in_split = send_counts.tolist(), recv_counts.tolist()
    if swap:
        out_split, in_split = in_split, out_split
    back = y.new_empty(sum(out_split), y.shape[1])
    dist.all_to_all_single(back, y, output_split_sizes=out_split,
                           input_split_sizes=in_split)
    return back


def _good(y, send_counts, recv_counts, order):
    back = _back(y, send_counts, recv_counts)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _good_isend(y, send_counts, recv_counts, order):
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = list(y.split(recv_counts.tolist()))
    back = [y.new_empty(int(c), y.shape[1]) for c in send_counts]
    back[rank] = parts[rank]
    reqs = []
    for q in range(n):
        if q != rank:
            if len(parts[q]):
                reqs.append(dist.isend(parts[q].contiguous(), q))
            if len(back[q]):
                reqs.append(dist.irecv(back[q], q))
    for r in reqs:
        r.wait()
    back = torch.cat(back)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _unsorted(y, send_counts, recv_counts, order):
    return _back(y, send_counts, recv_counts)  # still grouped by expert


def _swapped(y, send_counts, recv_counts, order):
    back = _back(y, send_counts, recv_counts, swap=True)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _output_splits_reversed(y, send_counts, recv_counts, order):
    """Each rank's sizes add up, but do not match the other ranks': gloo itself
    would abort the ranks (SIGABRT) on this."""
    out_split = send_counts.tolist()[::-1]
    back = y.new_empty(sum(out_split), y.shape[1])
    dist.all_to_all_single(back, y, output_split_sizes=out_split,
                           input_split_sizes=recv_counts.tolist())
    return back


def _no_splits(y, send_counts, recv_counts, order):
    back = torch.empty_like(y)
    dist.all_to_all_single(back, y)  # equal parts: the counts never used
    return back


def _gathered(y, send_counts, recv_counts, order):
    """Right rows, by an all-gather of every rank's y: everything everywhere."""
    n, rank = dist.get_world_size(), dist.get_rank()
    pad = y.new_zeros(64, y.shape[1])  # gloo gathers equal sizes: pad to a bound
    pad[:len(y)] = y
    ys = [torch.empty_like(pad) for _ in range(n)]
    dist.all_gather(ys, pad)
    counts = [torch.empty_like(recv_counts) for _ in range(n)]
    dist.all_gather(counts, recv_counts)
    back = torch.cat([ys[q][:int(counts[q].sum())].split(counts[q].tolist())[rank]
                      for q in range(n)])
    out = torch.empty_like(back)
    out[order] = back
    return out


def _padded(y, send_counts, recv_counts, order):
    """Right rows, but every block padded to the largest: more bytes than needed."""
    n = dist.get_world_size()
    most = torch.tensor([int(max(recv_counts.max(), send_counts.max()))])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    k = int(most)
    pad = y.new_zeros(n * k, y.shape[1])
    for q, part in enumerate(y.split(recv_counts.tolist())):
        pad[q * k:q * k + len(part)] = part
    got = torch.empty_like(pad)
    dist.all_to_all_single(got, pad)
    back = torch.cat([got[q * k:q * k + int(c)] for q, c in enumerate(send_counts)])
    out = torch.empty_like(back)
    out[order] = back
    return out


def _padded_a2a_only(y, send_counts, recv_counts, order):
    """The padded exchange with a bound known in advance (no all-reduce)."""
    n = dist.get_world_size()
    k = 64  # more than any split
    pad = y.new_zeros(n * k, y.shape[1])
    for q, part in enumerate(y.split(recv_counts.tolist())):
        pad[q * k:q * k + len(part)] = part
    got = torch.empty_like(pad)
    dist.all_to_all_single(got, pad)
    back = torch.cat([got[q * k:q * k + int(c)] for q, c in enumerate(send_counts)])
    out = torch.empty_like(back)
    out[order] = back
    return out


def _labkits(y, send_counts, recv_counts, order):
    from labkit.parallel import all_to_all_rows

    back = all_to_all_rows(y, recv_counts, send_counts)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _local(y, send_counts, recv_counts, order):
    """No communication: this rank's own y, as if every token had stayed."""
    out = y.new_zeros(int(send_counts.sum()), y.shape[1])
    keep = min(len(out), len(y))
    out[:keep] = y[:keep]
    return out


def _old_marks(y, send_counts, recv_counts, order):
    """The rows the check's fixed inputs used to give, computed locally: (source
    rank, token index, 10 + expert), the expert read off `order` and the counts."""
    rank = dist.get_rank()
    expert = torch.repeat_interleave(torch.arange(len(send_counts)), send_counts)
    out = torch.zeros(int(send_counts.sum()), y.shape[1])
    out[order, 2] = 10.0 + expert.float()
    out[:, 0], out[:, 1] = float(rank), torch.arange(len(out)).float()
    return out


def _short(y, send_counts, recv_counts, order):
    return _good(y, send_counts, recv_counts, order)[:-1]


def _todo(y, send_counts, recv_counts, order):
    raise NotImplementedError("exercise: combine")


def test_moe_combine_check(cluster, capsys):
    assert not check_moe_combine(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_moe_combine(cluster, _good)
    out = capsys.readouterr().out
    assert "correct: on 4 ranks, with tokens and routing drawn this run" in out
    assert "measured: each rank sent exactly the rows it held for the others" in out
    assert check_moe_combine(cluster, _good_isend)
    with pytest.raises(ExerciseError, match=r"rank 0, row (\d+): expected token \1 of "
                       r"rank 0, through expert \d, got token \d+ of rank 0.*"
                       r"out\[order\] = back"):
        check_moe_combine(cluster, _unsorted)
    with pytest.raises(ExerciseError, match=r"rank 0: combine returned shape "
                       r"\(\d+, 4\), expected \(\d+, 4\)"):
        check_moe_combine(cluster, _short)


def test_moe_combine_names_mismatched_splits_before_gloo(cluster):
    # swapped split sizes: a rank that sends away as many rows as it receives
    # has sizes that add up; where every rank does (rarely), the sizes match
    # and the rows go to the wrong ranks
    with pytest.raises(ExerciseError, match=r"^(before the all-to-all: rank \d passed "
                       r"(input|output)_split_sizes \[[\d, ]+\], \d+ rows in all, for "
                       r"its (input|output) tensor of \d+ rows; |rank \d, row \d+: .*"
                       r"rows went back to the wrong rank: )the return trip is the "
                       r"dispatch reversed"):
        check_moe_combine(cluster, _swapped)
    with pytest.raises(ExerciseError, match=r"^before the all-to-all: rank \d sends "
                       r"\d+ rows? to rank \d, which expects \d+ from it \(gloo "
                       r"would abort every rank on this\); the return trip"):
        check_moe_combine(cluster, _output_splits_reversed)
    with pytest.raises(ExerciseError, match=r"^before the all-to-all: rank \d (called "
                       r"all_to_all_single without (input|output)_split_sizes|sends "
                       r".*passed no input_split_sizes)"):
        check_moe_combine(cluster, _no_splits)
    assert check_moe_combine(cluster, _good)  # the ranks are all still there


def test_moe_combine_refuses_shortcuts(cluster):
    with pytest.raises(ExerciseError, match=r"rank 0: it called \['all_gather'\]; the "
                       r"combine is an all-to-all"):
        check_moe_combine(cluster, _gathered)
    with pytest.raises(ExerciseError, match=r"rank 0: it called \['all_reduce'\]"):
        check_moe_combine(cluster, _padded)
    with pytest.raises(ExerciseError, match=r"rank \d, the rows are right, but it sent "
                       r"[\d,]+ bytes to other ranks; the rows it holds for them are "
                       r"\d+ rows? of 16 bytes"):
        check_moe_combine(cluster, _padded_a2a_only)
    with pytest.raises(ExerciseError, match=r"rank 0: your answer calls labkit\."
                       r"parallel\.expert_parallel\.all_to_all_rows, labkit's own"):
        check_moe_combine(cluster, _labkits)
    for no_messages in (_local, _old_marks):
        with pytest.raises(ExerciseError, match=r"rank 0 sent and received nothing, "
                           r"but \d+ tokens? of it went to experts on other ranks"):
            check_moe_combine(cluster, no_messages)
    with pytest.raises(ExerciseError, match=r"rank 0, row 0: expected token 0 of "
                       r"rank 0, .* got the values \[nan, nan, nan, nan\], which no "
                       r"token had"):
        check_moe_combine(cluster, lambda *a: _good(*a) * float("nan"))


# ---------------------------------------------------------------- two rings


def _two(topo):
    ring = ring_order(topo)
    return ring, ring[::-1]  # the same cables, the other direction


def _same_twice(topo):
    return ring_order(topo), ring_order(topo)


def _rotated(topo):
    ring = ring_order(topo)
    return ring, ring[3:] + ring[:3]


def _columns(topo):
    """The snake, and a snake down the columns: valid rings (with an even number
    of columns) that share some one-way links."""
    xs = 1 + max(int(d[1:].split(",")[0]) for d in topo.devices)
    ys = 1 + max(int(d.split(",")[1]) for d in topo.devices)
    cols = [f"d{x},{y if x % 2 == 0 else ys - 1 - y}" for x in range(xs)
            for y in range(ys)]
    return ring_order(topo), cols


def _jumps(topo):
    return sorted(topo.devices), ring_order(topo)[::-1]


def _misses(topo):
    return ring_order(topo)[:-1], ring_order(topo)[::-1]


def _raises(topo):
    return [topo.devices[99]], []


def _written_down(topo):
    """The 4x4 torus's answer, written down: wrong on any other torus."""
    from labkit.comm import torus

    return _two(torus((4, 4), 45e9))


def _rings_todo(topo):
    raise NotImplementedError("exercise: two rings")


def test_tori_are_drawn_afresh():
    drawn = {tuple(_tori(s)[1:]) for s in range(20)}
    assert len(drawn) > 10, f"20 seeds drew only {len(drawn)} pairs of tori"
    for s in range(20):
        dims = _tori(s)
        assert dims[0] == (4, 4) and len(set(dims)) == 3, dims
        assert all(3 <= a <= 8 and b in (4, 6, 8) for a, b in dims), dims


def test_two_rings_check(capsys):
    assert not check_two_rings(_rings_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_two_rings(_two)
    out = capsys.readouterr().out
    assert "correct on the 4x4 torus, the " in out and "half of one ring's" in out
    assert check_two_rings(_two, dims=[(6, 4)])
    assert ("your rings put 0.9583 GB on the busiest link for M = 1 GB on 24 chips"
            in capsys.readouterr().out)
    for same in (_same_twice, _rotated):
        with pytest.raises(ExerciseError, match=r"4x4 torus: ring B is ring A again"):
            check_two_rings(same)
    with pytest.raises(ExerciseError, match=r"4x4 torus: link d\S+ -> d\S+ carries "
                       r"both rings, and \d+ links do"):
        check_two_rings(_columns, dims=[(4, 4)])
    with pytest.raises(ExerciseError, match=r"ring A goes d0,3 -> d1,0, which are 2 "
                       r"hops apart"):
        check_two_rings(_jumps)
    with pytest.raises(ExerciseError, match=r"ring A misses 1 of 16 devices, e\.g\. "
                       r"d0,3"):
        check_two_rings(_misses)
    with pytest.raises(ExerciseError, match=r"on the \dx\d torus: ring A (misses \d+ "
                       r"of \d+ devices|names 'd\d,\d', which is not a device)"):
        check_two_rings(_written_down)
    with pytest.raises(ExerciseError, match=r"on the 4x4 torus: your two_rings raised "
                       r"IndexError: .* in _raises: `return \[topo\.devices\[99\]\], "
                       r"\[\]`"):
        check_two_rings(_raises)
