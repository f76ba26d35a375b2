"""Networks as graphs: route a collective's transfers, count hops and link loads.

    t = torus((4, 4), link_bw=45e9)               # TPU-style: direct links, wraparound
    s = switch(16, link_bw=450e9)                  # GPU-style: every device to a switch
    route(t, ring_all_reduce_transfers(ring_order(t), M)).max_link_bytes

Standard library only. Bandwidths are bytes per second per direction: a link (a, b)
and (b, a) are the two directions of one cable. Routing is deterministic:
dimension-order on a torus (shortest way round each ring, x first), else through
the switch.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Topology:
    name: str
    devices: list[str]
    links: dict[tuple[str, str], float]  # (from, to) -> bytes/s, one direction
    pos: dict[str, tuple[float, float]] = field(default_factory=dict)
    _router: object = None
    # cables that close a torus ring (drawn as two stubs): sorted (a, b) pairs
    wraparound: frozenset = frozenset()

    def path(self, src: str, dst: str) -> list[str]:
        """The nodes a message from src to dst passes, src and dst included."""
        if src == dst:
            return [src]
        return self._router(src, dst)

    @property
    def cables(self) -> list[tuple[str, str]]:
        """Every cable once, as a sorted (a, b) pair, in the order of `links`."""
        return list(dict.fromkeys(tuple(sorted(k)) for k in self.links))

    @property
    def switches(self) -> list[str]:
        """Nodes that are not devices: the switches messages pass through."""
        devs = set(self.devices)
        return list(dict.fromkeys(n for k in self.links for n in k if n not in devs))

    @property
    def switch_ports(self) -> int:
        """Cable ends plugged into a switch (0 for a torus): a proxy for its cost."""
        sw = set(self.switches)
        return sum((a in sw) + (b in sw) for a, b in self.cables)


def _both(links, a, b, bw):
    links[(a, b)] = bw
    links[(b, a)] = bw


def ring(world_size: int, link_bw: float) -> Topology:
    """world_size devices in a cycle, each linked to its two neighbours."""
    if world_size < 2:
        raise ValueError(f"a ring needs at least 2 devices, got {world_size}")
    return torus((world_size,), link_bw, name=f"ring of {world_size}")


def torus(dims: tuple[int, ...], link_bw: float, name: str | None = None) -> Topology:
    """A 1-, 2- or 3-D torus: each device linked to ±1 in every dimension, with
    wraparound (TPU v4 pods are 3-D tori of 4x4x4 cubes)."""
    dims = tuple(dims)
    if not dims or any(d < 2 for d in dims) or len(dims) > 3:
        raise ValueError(f"torus dims must be 1 to 3 sizes >= 2, got {dims}")
    coords = list(itertools.product(*[range(d) for d in dims]))
    dev = {c: "d" + ",".join(map(str, c)) for c in coords}
    links: dict = {}
    wrap = set()
    for c in coords:
        for axis, size in enumerate(dims):
            nxt = list(c)
            nxt[axis] = (c[axis] + 1) % size
            if dev[tuple(nxt)] != dev[c]:
                _both(links, dev[c], dev[tuple(nxt)], link_bw)
                if nxt[axis] == 0 and size > 2:  # closes the ring of this axis
                    wrap.add(tuple(sorted((dev[c], dev[tuple(nxt)]))))
    pos = {dev[c]: ((c[0], 0.0) if len(dims) == 1 else
                    (c[0] + 0.25 * (c[2] if len(dims) > 2 else 0), c[1]
                     + 0.25 * (c[2] if len(dims) > 2 else 0))) for c in coords}
    back = {v: k for k, v in dev.items()}

    def router(src, dst):
        cur, goal, path = list(back[src]), back[dst], [src]
        for axis, size in enumerate(dims):
            forward = (goal[axis] - cur[axis]) % size
            step = 1 if forward <= size - forward else -1
            while cur[axis] != goal[axis]:
                cur[axis] = (cur[axis] + step) % size
                path.append(dev[tuple(cur)])
        return path

    label = name or ("x".join(map(str, dims)) + " torus")
    return Topology(label, [dev[c] for c in coords], links, pos, router,
                    frozenset(wrap))


def switch(world_size: int, link_bw: float, name: str | None = None) -> Topology:
    """world_size devices, each with one link to a single non-blocking switch
    (NVSwitch)."""
    if world_size < 2:
        raise ValueError(f"a switch needs at least 2 devices, got {world_size}")
    devs = [f"g{i}" for i in range(world_size)]
    links: dict = {}
    for d in devs:
        _both(links, d, "switch", link_bw)
    pos = {d: (i, 0.0) for i, d in enumerate(devs)}
    pos["switch"] = ((world_size - 1) / 2, 1.0)
    return Topology(name or f"switch, {world_size} devices", devs, links, pos,
                    lambda s, t: [s, "switch", t])


def fat_tree(nodes: int, per_node: int, nvlink_bw: float, ib_bw: float) -> Topology:
    """GPU cluster: in each node, GPUs share an NVSwitch; across nodes every GPU has
    its own NIC into a non-blocking InfiniBand "spine" (DGX H100: 8 GPUs, 8 NICs).
    The spine is one switch here; a real cluster builds it from tiers of leaf and
    spine switches with as much bandwidth up as down (a fat tree), so any half of
    the GPUs can send to the other half at full NIC speed."""
    if nodes < 1 or per_node < 1 or nodes * per_node < 2:
        raise ValueError("need at least 2 GPUs in all")
    devs, links, pos = [], {}, {}
    for m in range(nodes):
        sw = f"nvsw{m}"
        pos[sw] = (m * (per_node + 1) + (per_node - 1) / 2, -1.0)  # below its node
        for i in range(per_node):
            d = f"n{m}g{i}"
            devs.append(d)
            pos[d] = (m * (per_node + 1) + i, 0.0)
            _both(links, d, sw, nvlink_bw)
            _both(links, d, "spine", ib_bw)
    pos["spine"] = ((nodes * (per_node + 1) - 2) / 2, 1.5)  # above every node

    def router(s, t):
        same = s.split("g")[0] == t.split("g")[0]
        return [s, f"nvsw{s[1:].split('g')[0]}" if same else "spine", t]

    return Topology(f"{nodes} nodes x {per_node} GPUs", devs, links, pos, router)


def ring_order(topo: Topology) -> list[str]:
    """An order of the devices in which ring neighbours are as close as possible:
    a snake through a torus (every neighbour one hop away when sizes are even)."""
    if not topo.devices[0].startswith("d") or "," not in topo.devices[0] + ",":
        return list(topo.devices)
    coords = sorted(tuple(map(int, d[1:].split(","))) for d in topo.devices)
    dims = [max(c[a] for c in coords) + 1 for a in range(len(coords[0]))]
    if len(dims) == 1:
        return [f"d{i}" for i in range(dims[0])]
    if len(dims) == 2:
        order = [(x if y % 2 == 0 else dims[0] - 1 - x, y)
                 for y in range(dims[1]) for x in range(dims[0])]
        return ["d" + ",".join(map(str, c)) for c in order]
    plane = [(x if y % 2 == 0 else dims[0] - 1 - x, y)
             for y in range(dims[1]) for x in range(dims[0])]
    order = [(*(plane if z % 2 == 0 else plane[::-1])[i], z)
             for z in range(dims[2]) for i in range(len(plane))]
    return ["d" + ",".join(map(str, c)) for c in order]


# ------------------------------------------------------------------ transfers


Transfer = tuple[str, str, float]  # (from device, to device, bytes)


def ring_all_reduce_transfers(order: list[str], size: float) -> list[Transfer]:
    """Ring all-reduce of `size` bytes: 2(n-1) steps of size/n to the next device."""
    n = len(order)
    per = 2 * (n - 1) * size / n
    return [(order[i], order[(i + 1) % n], per) for i in range(n)]


def all_to_all_transfers(devices: list[str], size: float) -> list[Transfer]:
    """All-to-all of `size` bytes per device: size/n to every other device."""
    n = len(devices)
    return [(a, b, size / n) for a in devices for b in devices if a != b]


@dataclass
class Routed:
    topology: str
    link_bytes: dict[tuple[str, str], float]
    hops: list[int]  # per transfer
    link_bw: dict[tuple[str, str], float]
    # device -> bytes it passed on for others (it was neither source nor target):
    # on a torus the chips relay, on a switched network the switches do
    relayed: dict[str, float] = field(default_factory=dict)

    @property
    def max_hops(self) -> int:
        return max(self.hops, default=0)

    @property
    def mean_hops(self) -> float:
        return sum(self.hops) / len(self.hops) if self.hops else 0.0

    @property
    def busiest(self) -> tuple[tuple[str, str], float]:
        return max(self.link_bytes.items(), key=lambda kv: kv[1] / self.link_bw[kv[0]])

    @property
    def max_link_bytes(self) -> float:
        return self.busiest[1]

    def seconds(self, alpha_per_hop: float = 0.0) -> float:
        """Bandwidth time of the busiest link, plus α per hop of the longest route."""
        link, b = self.busiest
        return b / self.link_bw[link] + alpha_per_hop * self.max_hops


def route(topo: Topology, transfers) -> Routed:
    """Send every (src, dst, bytes) over its path; add up each link's bytes."""
    load: dict = defaultdict(float)
    relayed = {d: 0.0 for d in topo.devices}
    hops = []
    for src, dst, nbytes in transfers:
        path = topo.path(src, dst)
        for a, b in zip(path, path[1:]):
            if (a, b) not in topo.links:
                raise ValueError(f"{topo.name}: no link {a} -> {b}")
            load[(a, b)] += nbytes
        for mid in path[1:-1]:
            if mid in relayed:  # a device in the middle forwards; a switch is not one
                relayed[mid] += nbytes
        hops.append(len(path) - 1)
    return Routed(topo.name, dict(load), hops, topo.links, relayed)
