"""Two hosts with two network stacks: torchrun agents in two network namespaces
joined by a veth pair (examples/two_hosts.py builds them), running chapters 05 and
07 exported, unchanged. Their traffic goes over the veth, byte for byte as the
traffic ledger counts it; their results, merged from two folders, equal one host's;
a rank lost on one host stops both."""

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.runtime.results_io import ResultsError, load_results

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("two_hosts",
                                               ROOT / "examples" / "two_hosts.py")
two_hosts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(two_hosts)
sys.path.insert(0, str(ROOT / "examples"))
from two_hosts_probe import OPTIONS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
SECONDS = 240  # a run of both chapters takes about 40 s on 2 loaded cores


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Chapters 05 and 07 exported once, for both tests (two processes each)."""
    if two_hosts.cannot_make_namespaces():
        pytest.skip("no network namespaces here")  # the hosts fixture says why
    return two_hosts.export_chapters(tmp_path_factory.mktemp("workers"))


@pytest.fixture
def hosts(request):
    why = two_hosts.cannot_make_namespaces()
    if why:
        pytest.skip(f"no network namespaces here: {why}")
    made = two_hosts.TwoHosts(tag=f"{request.node.name[5:9]}{id(request) % 10**5}")
    with made:  # removed on the way out, processes first, whatever happened
        yield made
    assert made.remove() == [], "namespaces left behind"


def _run(hosts, tmp_path, name, jobs, n_hosts=2, kill_rank=None):
    results = [tmp_path / name / h for h in hosts.hostnames[:n_hosts]]
    probes = [tmp_path / name / f"probe-{h}" for h in hosts.hostnames[:n_hosts]]
    agents = [hosts.agent(i, two_hosts.probe_args(jobs, kill_rank), results[i],
                          probes[i], nnodes=n_hosts, nproc=4 // n_hosts,
                          rdzv_id=f"{name}-{tmp_path.name}")
              for i in range(n_hosts)]
    return two_hosts.wait_all(agents, SECONDS), results, probes


def _check_traffic(rows):
    for a in rows:
        where = f"{a['host']}, window {a['window']}"
        for r in a["ranks"]:  # the kernel's bytes_sent counts retransmissions too
            s = a["sockets"][r]
            assert s["veth0"] + s["lo"] - s["retrans"] == a["ledger"][r], (
                f"{where}: rank {r} handed TCP {s['veth0'] + s['lo'] - s['retrans']:,}"
                f" B (ss), its traffic ledger counted {a['ledger'][r]:,} B")
        v = a["veth0"]
        ranks_veth = sum(a["sockets"][r]["veth0"] for r in a["ranks"])
        assert ranks_veth > 0, f"{where}: no rank sent over veth0"
        # payload = tx_bytes - 66 B x packets; a packet may also carry up to
        # OPTIONS bytes of SACK blocks, so the payload may exceed what was sent
        extra = v["payload"] - a["store"]["veth0"] - ranks_veth
        assert 0 <= extra <= OPTIONS * v["packets"], (
            f"{where}: veth0 carried {v['payload']:,} B of TCP payload in "
            f"{v['packets']} packets ({v['bytes']:,} B with 66 B of headers each); "
            f"the ranks sent {ranks_veth:,} B across (ss) and the stores "
            f"{a['store']['veth0']:,} B; allowed: 0 to {OPTIONS} B of TCP options "
            f"per packet = {OPTIONS * v['packets']:,} B, measured {extra:,} B")
        wire = sum(a["ledger"].values())
        both = v["payload"] + a["lo"]["payload"] - sum(
            a["store"][i] for i in ("veth0", "lo")) - a["retrans"]
        packets = v["packets"] + a["lo"]["packets"]
        assert 0 <= both - wire <= OPTIONS * packets, (
            f"{where}: veth0 and lo carried {both:,} B of the ranks' TCP payload "
            f"(less {a['retrans']:,} B retransmitted and the stores'), their "
            f"ledgers {wire:,} B; allowed 0 to {OPTIONS} B of options x {packets} "
            f"packets = {OPTIONS * packets:,} B")


def _same(got, want, what):
    """Two runs' values: tensors bit for bit, traffic ledgers by their calls'
    payloads; timelines (timings) and memory ledgers (not about the network) are
    left out."""
    if isinstance(got, torch.Tensor):
        assert torch.equal(got, want), f"{what}: differs from one host's run"
    elif isinstance(got, dict):
        assert got.keys() == want.keys(), what
        for k in set(got) - {"timeline"}:
            _same(got[k], want[k], f"{what}[{k!r}]")
    elif isinstance(got, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{what}[{i}]")
    elif type(got).__name__ == "TrafficLedger":
        calls = [[(c.op, c.payload_bytes) for c in t.records] for t in (got, want)]
        assert calls[0] == calls[1], f"{what}: other calls than one host's"
    elif isinstance(got, (int, float, str)):
        assert got == want, f"{what}: {got!r}, one host {want!r}"


def test_two_hosts_over_a_veth_equal_one_host(hosts, jobs, tmp_path):
    t0 = time.monotonic()
    runs, results, _ = _run(hosts, tmp_path, "two", jobs)
    assert [rc for rc, _, _ in runs] == [0, 0], "\n---\n".join(o for _, o, _ in runs)
    two = load_results(*results)
    assert two.ranks == [0, 1, 2, 3]
    where = [(v["netns"], v["hostname"]) for v in two.values]
    assert sorted(where) == sorted(2 * list(zip(hosts.names, hosts.hostnames))), (
        f"ranks ran at {where}: 2 per namespace expected")
    cmd = subprocess.run([sys.executable, "-m", "labkit", "results",
                          *map(str, results)], capture_output=True, text=True,
                         timeout=120)
    assert cmd.returncode == 0 and "on 4 ranks, 2 host(s): host-a, host-b" in (
        cmd.stdout), cmd.stdout + cmd.stderr

    rows = two_hosts.accounting(two.values)
    print(two_hosts.report(rows))
    _check_traffic(rows)

    # the same worker on 4 ranks of one host: where a rank runs changes no sum
    # (the same gloo algorithms add in the same order), so bit for bit
    runs, results, _ = _run(hosts, tmp_path, "one", jobs, n_hosts=1)
    assert runs[0][0] == 0, runs[0][1]
    one = load_results(*results)
    for r in range(4):
        _same(two[r]["values"], one[r]["values"], f"rank {r}")
    print(f"two hosts and one, both chapters: {time.monotonic() - t0:.0f} s "
          "(a timing)")


def test_a_rank_lost_on_one_host_stops_both(hosts, jobs, tmp_path):
    start = time.time()
    runs, results, probes = _run(hosts, tmp_path, "fault", jobs, kill_rank=3)
    text = "\n---\n".join(o for _, o, _ in runs)
    assert all(rc != 0 for rc, _, _ in runs), f"an agent succeeded:\n{text}"
    assert all(end - start < SECONDS for _, _, end in runs), (
        f"the agents were still running after {SECONDS} s:\n{text}")
    left = {ns: hosts.pids(ns) for ns in hosts.names}
    assert left == {ns: [] for ns in hosts.names}, f"processes left: {left}"
    lost = [i for i, p in enumerate(probes) if (p / "killed_at").exists()]
    assert len(lost) == 1, f"rank 3 did not kill itself:\n{text}"
    killed = float((probes[lost[0]] / "killed_at").read_text())
    other = results[1 - lost[0]]  # the host whose ranks saw their peer vanish
    with pytest.raises(ResultsError) as failed:
        load_results(other)
    error = str(failed.value)
    lost_peer = re.compile(r"Connection (closed|reset) by peer|[Bb]roken pipe")
    assert re.search(r"rank \d failed", error) and lost_peer.search(error), (
        f"the other host's ranks should fail naming the lost connection:\n{error}")
    raised = min(p.stat().st_mtime for p in other.glob("rank*.pt"))
    print(f"\nrank 3 killed on {hosts.hostnames[lost[0]]}; the other host's ranks "
          f"raised after {raised - killed:.2f} s, both agents gone after "
          f"{max(end for _, _, end in runs) - killed:.2f} s (timings)\n"
          + next(ln for ln in error.splitlines() if lost_peer.search(ln)))
