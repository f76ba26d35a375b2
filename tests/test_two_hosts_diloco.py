"""DiLoCo against DDP on 2 hosts x 2 ranks (labkit/cli/diloco_vs_ddp.py) over two
network namespaces joined by a veth (labkit/comm/two_hosts.py): the bytes a step
sends across, measured on the veth, against theory.bytes_across_hosts; step
times on a link shaped to 100 Mbit/s; the one-host fallback with the traffic
ledger; and that namespaces, qdiscs and ranks never outlive a run."""

import math
import os
import subprocess

import pytest

from labkit import theory
from labkit.cli import diloco_vs_ddp as dvd
from labkit.comm import two_hosts

SYNC_EVERY = (1, 8, 64)
N = dvd.HOSTS * dvd.PER_HOST
# the ranks whose successor in gloo's ring (0 → 1 → 2 → 3 → 0) is on the other
# host: what they write to their sockets in a world all-reduce crosses the veth
CROSSING = [r for r in range(N) if (r + 1) % N // dvd.PER_HOST != r // dvd.PER_HOST]


@pytest.fixture(scope="module")
def one_host(cluster):
    rows = dvd.measure_one_host(cluster, sync_every=SYNC_EVERY)
    print("\n" + dvd.report_one_host(rows))
    return {r.name: r for r in rows}


@pytest.fixture(scope="module")
def hosts():
    why = two_hosts.cannot_make_namespaces()
    if why:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    made = two_hosts.TwoHosts(tag="t")
    with made:  # deleted on the way out, whatever happened
        yield made
    assert made.remove() == [], f"namespaces {made.names} left behind"


@pytest.fixture(scope="module")
def two(hosts):
    c = dvd.measure_two_hosts(hosts=hosts, sync_every=SYNC_EVERY)
    print("\n" + dvd.report_two_hosts(c))
    return c


# ---------------------------------------------------------------- one host


def test_one_host_bytes_per_step_are_the_closed_forms(one_host):
    p = dvd.payload_bytes()
    assert one_host["DDP"].bus == {"ddp": theory.ddp_traffic(p, N).average}
    ddp_wire = one_host["DDP"].wire["ddp"]
    for h in SYNC_EVERY:
        row = one_host[f"DiLoCo H={h}"]
        # bus bytes are the payload times nccl-tests' factor: exact
        assert row.bus == row.closed_form, (
            f"DiLoCo H={h}, rank 0: ledger's bus bytes a step {row.bus}, closed "
            f"forms (ddp_traffic over a host, diloco_traffic) {row.closed_form}")
        # the outer step is DDP's all-reduce, once every H steps: gloo writes
        # the same bytes to the sockets for it, framing and all
        assert row.wire["outer"] * h == ddp_wire, (
            f"DiLoCo H={h}, rank 0: wrote {row.wire['outer'] * h:,.0f} B to its "
            f"sockets per outer step, DDP {ddp_wire:,.0f} B per step; equal expected")
        assert all(math.isfinite(x) for ls in row.losses for x in ls), (
            f"DiLoCo H={h}: a loss that is not finite")


# ---------------------------------------------------------------- two hosts


@pytest.mark.slow
@pytest.mark.ranks
def test_bytes_across_hosts_match_the_closed_form(two, one_host):
    ddp = two.rows[0]
    assert [r.name for r in two.rows] == ["DDP"] + [f"DiLoCo H={h}"
                                                   for h in SYNC_EVERY]
    across = theory.bytes_across_hosts(two.payload, dvd.HOSTS, dvd.PER_HOST)
    # gloo's framing, measured two ways: on the veth (payload = frames less
    # HEADER each, so up to OPTIONS bytes a frame of SACK blocks may hide in it)
    # and by the ledger on one host (bytes the crossing ranks wrote, less bus)
    framing = two.framing
    ledger_framing = sum(one_host["DDP"].wire_by_rank[r]["ddp"] for r in CROSSING) \
        - len(CROSSING) * theory.ddp_traffic(two.payload, N).average
    slack = two_hosts.OPTIONS * (ddp.crossed.packets + two.idle.packets) / ddp.steps
    print(f"\ngloo's framing a DDP step: {framing:,.0f} B on the veth, "
          f"{ledger_framing:,.0f} B by the ledger (± {slack:,.0f} B allowed)")
    assert abs(framing - ledger_framing) <= slack, (
        f"DDP: {across:,.0f} B a step across by the closed form; the veth carried "
        f"{framing:,.0f} B more a step, the crossing ranks {CROSSING} wrote "
        f"{ledger_framing:,.0f} B more (ledger, one host); allowed {slack:,.0f} B "
        f"({two_hosts.OPTIONS} B of TCP options a frame)")
    for name, run in two.runs.items():  # read from outside, around each run
        inside = sum(w.crossed.bytes for w in run.values[0])
        print(f"{name} run: {run.crossed.bytes:,} B in {run.crossed.packets:,} "
              f"frames crossed in {run.seconds:.1f} s, start-up included")
        assert run.crossed.bytes >= inside, (
            f"{name} run: the veth's counters read from outside grew by "
            f"{run.crossed.bytes:,} B, less than its windows' {inside:,} B inside")
    for row in two.rows[1:]:
        h, syncs = row.sync_every, row.steps // row.sync_every
        # DiLoCo's outer step is DDP's all-reduce, once per H steps; its inner
        # all-reduces stay in the host (over lo), so add nothing across
        want = syncs * (across + framing)
        got = row.sent * row.steps  # TCP payload sent once, less the empty window's
        allowed = two_hosts.OPTIONS * (row.crossed.packets + two.idle.packets
                                       + ddp.crossed.packets * syncs / ddp.steps)
        print(f"{row.name}: {got:,.0f} B across in {row.steps} steps, expected "
              f"{want:,.0f} B ± {allowed:,.0f} B")
        assert abs(got - want) <= allowed, (
            f"{row.name}, {row.steps} steps: {got:,.0f} B of TCP payload crossed "
            f"(frames less {two_hosts.HEADER} B each, less {row.retransmitted:,} B "
            f"retransmitted and the empty window's); expected {syncs} x "
            f"(bytes_across_hosts {across:,.0f} + DDP's measured framing "
            f"{framing:,.0f}) = {want:,.0f} B, allowed ±{allowed:,.0f} B "
            f"({two_hosts.OPTIONS} B of TCP options a frame)")
        assert row.closed_form == across / h


@pytest.mark.slow
@pytest.mark.ranks
def test_two_hosts_train_as_one_host(two, one_host):
    """Where a rank runs changes no sum: gloo adds in the same order."""
    fast = two.runs["fast"].values
    for k, row in enumerate(two.rows, start=1):  # window 0 is the empty one
        got = [fast[r][k].losses for r in range(N)]
        assert got == one_host[row.name].losses, (
            f"{row.name}: losses on two hosts differ from one host's (same batches, "
            "same ring): bit for bit expected")


@pytest.mark.slow
@pytest.mark.ranks
def test_a_shaped_link_slows_ddp_more_than_diloco(two):
    ddp, dl = "DDP", f"DiLoCo H={two.timed_h}"
    rate = two.rate_mbit * 1e6 / 8  # bytes/s, each direction
    for name in (ddp, dl):
        # a token bucket passes at most rate·t + burst bytes in t seconds, each way
        frames = two.timed[name, True].bytes - two.idle.bytes
        floor = (frames - 2 * two.burst) / (2 * rate) / two.timed_steps
        assert two.seconds[name, True] >= floor, (
            f"{name} on the shaped link: {two.seconds[name, True] * 1e3:.1f} ms a "
            f"step, yet {frames:,} B crossed: at {two.rate_mbit:g} Mbit/s each way "
            f"that takes at least {floor * 1e3:.1f} ms a step")
    assert two.seconds[dl, True] < two.seconds[ddp, True], (
        f"shaped link: {dl} {two.seconds[dl, True] * 1e3:.1f} ms a step, DDP "
        f"{two.seconds[ddp, True] * 1e3:.1f} ms; DiLoCo sends 1/{two.timed_h} of it")


# ---------------------------------------------------------------- clean-up


def _raise_on_rank_3(rank, world_size):
    if rank == 3:
        raise ValueError("rank 3 gives up")
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
@pytest.mark.ranks
def test_a_failing_rank_stops_every_rank(hosts):
    with pytest.raises(RuntimeError, match="rank 3 gives up"):
        hosts.run(_raise_on_rank_3, timeout=120)
    left = {ns: hosts.pids(ns) for ns in hosts.names}
    assert left == {ns: [] for ns in hosts.names}, f"processes left: {left}"


@pytest.mark.ranks
def test_ctrl_c_kills_the_ranks_and_removes_namespaces_and_qdiscs(monkeypatch):
    why = two_hosts.cannot_make_namespaces()
    if why:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    started = []

    def interrupted(procs, timeout):
        started.extend(p.pid for p in procs)
        raise KeyboardInterrupt

    monkeypatch.setattr(two_hosts, "_wait", interrupted)
    hosts = two_hosts.TwoHosts(tag="int")
    with pytest.raises(KeyboardInterrupt), hosts:
        hosts.shape(50)
        hosts.run(_raise_on_rank_3)
    assert len(started) == N and not any(_alive(p) for p in started), (
        f"ranks {started} still running after Ctrl-C")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                            text=True).stdout
    assert not set(hosts.names) & set(listed.split()), (
        f"namespaces {hosts.names} left after Ctrl-C:\n{listed}")


@pytest.mark.ranks
def test_stale_namespaces_of_a_dead_run_are_removed():
    why = two_hosts.cannot_make_namespaces()
    if why:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody holds: the maker of the namespace below
    stale = f"{two_hosts.PREFIX}{gone.pid}-old"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    mine = two_hosts.TwoHosts(tag="alive")
    with mine:  # its start removed the stale ones
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                text=True).stdout.split()
        assert stale not in listed and set(mine.names) <= set(listed), (
            f"after the clean-up at start: {listed}; {stale} should be gone, "
            f"{mine.names} there")


def test_refusals_say_what_is_missing(monkeypatch):
    monkeypatch.delenv(two_hosts.ENV, raising=False)
    monkeypatch.setattr(two_hosts.shutil, "which",
                        lambda t: None if t == "tc" else f"/usr/sbin/{t}")
    assert "tc" in two_hosts.cannot_make_namespaces()
    monkeypatch.setattr(two_hosts.shutil, "which", lambda t: f"/usr/sbin/{t}")
    monkeypatch.setattr(two_hosts.os, "geteuid", lambda: 1000)
    why = two_hosts.cannot_make_namespaces()
    assert "root" in why and "1000" in why, why
    assert two_hosts.veth_counters() is None and two_hosts.retransmitted() is None, (
        "outside two hosts' ranks there is no veth to read")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
