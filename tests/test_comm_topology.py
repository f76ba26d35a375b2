"""labkit.comm.topology: routes, hops and link loads against hand-derived numbers."""

import pytest

from labkit.comm.topology import (
    all_to_all_transfers,
    fat_tree,
    ring,
    ring_all_reduce_transfers,
    ring_order,
    route,
    switch,
    torus,
)

M = 1000.0


@pytest.mark.parametrize("dims", [(4,), (4, 4), (2, 4), (4, 4, 4), (6, 4)])
def test_snake_ring_is_one_hop_everywhere_on_even_tori(dims):
    t = torus(dims, 1.0)
    r = route(t, ring_all_reduce_transfers(ring_order(t), M))
    n = len(t.devices)
    assert sorted(ring_order(t)) == sorted(t.devices)
    assert r.max_hops == 1
    assert r.max_link_bytes == pytest.approx(2 * (n - 1) / n * M)


@pytest.mark.parametrize("k", [4, 6, 8])
def test_all_to_all_on_a_torus(k):
    t = torus((k, k), 1.0)
    r = route(t, all_to_all_transfers(t.devices, M))
    # mean shortest distance on a k x k torus, over the k^2 - 1 other nodes
    assert r.mean_hops == pytest.approx(k**3 / (2 * (k * k - 1)))
    assert r.max_hops == k  # k/2 in each of two dimensions
    assert r.max_link_bytes >= k * M / 8  # bisection: N M / 4 over 2k links


def test_all_to_all_on_a_ring_by_hand():
    # 4 nodes, M/4 to each other node: to the opposite node the tie goes forward,
    # so each forward link carries 1 (neighbour) + 1 (opposite, first hop) +
    # 1 (opposite of the node behind, second hop) quarters = 3M/4
    r = route(ring(4, 1.0), all_to_all_transfers(ring(4, 1.0).devices, M))
    assert r.max_link_bytes == pytest.approx(0.75 * M)
    assert sorted(r.hops) == [1] * 8 + [2] * 4


def test_switch_and_fat_tree():
    s = switch(8, 10.0)
    r = route(s, all_to_all_transfers(s.devices, M))
    assert r.max_hops == 2 and r.max_link_bytes == pytest.approx(7 / 8 * M)
    assert r.seconds() == pytest.approx(7 / 8 * M / 10.0)
    ft = fat_tree(2, 4, nvlink_bw=100.0, ib_bw=10.0)
    a = route(ft, all_to_all_transfers(ft.devices, M))
    link, load = a.busiest
    assert "spine" in link and load == pytest.approx(4 * M / 8)  # 4 remote GPUs
    assert ft.path("n0g1", "n0g2") == ["n0g1", "nvsw0", "n0g2"]


def test_bad_input():
    with pytest.raises(ValueError):
        torus((1, 4), 1.0)
    with pytest.raises(ValueError):
        switch(1, 1.0)
    with pytest.raises(ValueError):
        ring(1, 1.0)
