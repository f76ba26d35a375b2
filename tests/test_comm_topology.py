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


def test_cables_switch_ports_and_wraparound():
    t = torus((4, 4), 1.0)
    assert len(t.cables) == 32 and t.switches == [] and t.switch_ports == 0
    # one wraparound cable closes each of the 4 rows and 4 columns
    assert t.wraparound == {tuple(sorted((f"d3,{y}", f"d0,{y}"))) for y in range(4)} | {
        tuple(sorted((f"d{x},3", f"d{x},0"))) for x in range(4)}
    assert torus((2, 4), 1.0).wraparound == {("d0,0", "d0,3"), ("d1,0", "d1,3")}
    assert len(torus((4, 4, 4), 1.0).wraparound) == 3 * 16
    s = switch(16, 1.0)
    assert len(s.cables) == 16 and s.switches == ["switch"] and s.switch_ports == 16
    ft = fat_tree(2, 8, 1.0, 1.0)
    assert sorted(ft.switches) == ["nvsw0", "nvsw1", "spine"]
    assert len(ft.cables) == 32 and ft.switch_ports == 32
    # NVSwitches under their nodes, the spine above everything
    assert ft.pos["nvsw0"][1] < ft.pos["n0g0"][1] < ft.pos["spine"][1]


@pytest.mark.parametrize("k", [4, 8])
def test_chips_on_a_torus_relay_what_is_not_theirs(k):
    # every byte crosses mean_hops links and leaves its source on one of them, so
    # the chips forward bytes * (hops - 1): a share 1 - 1/mean_hops of all link bytes
    t = torus((k, k), 1.0)
    r = route(t, all_to_all_transfers(t.devices, M))
    n = k * k
    assert sum(r.relayed.values()) == pytest.approx(
        sum(M / n * (h - 1) for h in r.hops))
    share = sum(r.relayed.values()) / sum(r.link_bytes.values())
    assert share == pytest.approx(1 - 1 / r.mean_hops)
    assert len(set(round(v, 6) for v in r.relayed.values())) == 1   # symmetric
    # on a switch the switch forwards; no GPU relays anything
    s = switch(n, 1.0)
    assert set(route(s, all_to_all_transfers(s.devices, M)).relayed.values()) == {0.0}


def test_ring_all_reduce_relays_nothing_on_a_torus():
    t = torus((4, 4), 1.0)
    r = route(t, ring_all_reduce_transfers(ring_order(t), M))
    assert set(r.relayed.values()) == {0.0}
