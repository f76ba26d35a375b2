"""labkit.checks.networks: the MoE combine check (real ranks) and the two-rings check
pass right answers, say "not written yet" for stubs, and name what is wrong."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.networks import _experts, check_moe_combine, check_two_rings
from labkit.comm.topology import ring_order


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


def _unsorted(y, send_counts, recv_counts, order):
    return _back(y, send_counts, recv_counts)  # still grouped by expert


def _swapped(y, send_counts, recv_counts, order):
    back = _back(y, send_counts, recv_counts, swap=True)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _short(y, send_counts, recv_counts, order):
    return _good(y, send_counts, recv_counts, order)[:-1]


def _todo(y, send_counts, recv_counts, order):
    raise NotImplementedError("exercise: combine")


def test_experts_are_uneven_both_ways_with_equal_totals():
    n = 4
    counts = [[_experts(r, n).count(e) for e in range(n)] for r in range(n)]
    sent, received = [sum(row) for row in counts], [sum(c) for c in zip(*counts)]
    assert sent == received == [10] * n, f"sent {sent}, received {received}: 10 each"
    assert any(counts[r][e] != counts[e][r] for r in range(n) for e in range(n)), (
        f"the counts are symmetric: {counts}")
    assert _experts(1, n) != sorted(_experts(1, n)), "not shuffled"


def test_moe_combine_check(cluster, capsys):
    assert not check_moe_combine(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_moe_combine(cluster, _good)
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"rank 0, row (\d+): expected token \1 of "
                       r"rank 0 .* got token \d+ of rank 0.*out\[order\] = back"):
        check_moe_combine(cluster, _unsorted)
    with pytest.raises(ExerciseError, match=r"rank 0, row \d+: .* of rank [123],.*"
                       r"input_split_sizes are recv_counts"):
        check_moe_combine(cluster, _swapped)
    with pytest.raises(ExerciseError, match=r"rank 0: combine returned shape \(9, 3\)"
                       r", expected \(10, 3\)"):
        check_moe_combine(cluster, _short)


def _two(topo):
    ring = ring_order(topo)
    return ring, ring[::-1]  # the same cables, the other direction


def _same_twice(topo):
    return ring_order(topo), ring_order(topo)


def _jumps(topo):
    return sorted(topo.devices), ring_order(topo)[::-1]


def _misses(topo):
    return ring_order(topo)[:-1], ring_order(topo)[::-1]


def _raises(topo):
    return [topo.devices[99]], []


def _rings_todo(topo):
    raise NotImplementedError("exercise: two rings")


def test_two_rings_check(capsys):
    assert not check_two_rings(_rings_todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_two_rings(_two)
    assert "half of one ring's" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match=r"4x4 torus: link d\S+ -> d\S+ carries "
                       r"both rings .* and 16 links do"):
        check_two_rings(_same_twice)
    with pytest.raises(ExerciseError, match=r"ring A goes d0,3 -> d1,0, which are 2 "
                       r"hops apart"):
        check_two_rings(_jumps)
    with pytest.raises(ExerciseError, match=r"ring A misses 1 of 16 devices, e\.g\. "
                       r"d0,3"):
        check_two_rings(_misses)
    with pytest.raises(ExerciseError, match=r"on the 4x4 torus: your two_rings raised "
                       r"IndexError: .* in _raises: `return \[topo\.devices\[99\]\], "
                       r"\[\]`"):
        check_two_rings(_raises)
