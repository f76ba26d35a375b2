"""Two hosts on one Linux machine: two network namespaces joined by one veth pair,
optionally shaped (tc's token bucket, `tbf`), ranks 0..r-1 in A and r..2r-1 in B,
and the bytes that crossed between them. Needs root and iproute2 (`ip`, `tc`).

Imports labkit.runtime (the ranks are `python -m labkit.launch` processes) and the
standard library; cloudpickle ships the worker. veth0 counts whole frames: the
namespaces carry only the ranks' TCP (static ARP, no IPv6), so a window's TCP
payload is its bytes less HEADER per frame (a GSO frame counts once).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.runtime import ResultsError, load_results

ADDRS = ("10.77.0.1", "10.77.0.2")
IFACE = "veth0"
PORT = 29500  # rank 0's store, in A; a fresh namespace has every port free
PREFIX = "lk-"  # our namespaces: lk-<pid of the process that made them>-<tag>a|b
ENV = "LABKIT_TWO_HOSTS"  # set in the ranks: the namespace a rank runs in
# bytes of header per frame on veth0: Ethernet 14, IPv4 20, TCP 20 and the
# timestamp option 12 that Linux puts on every segment of a connection
HEADER = 14 + 20 + 20 + 12
OPTIONS = 40 - 12  # TCP option bytes a frame may carry beyond the timestamp (SACK)
_OURS = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
_SOCKET = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+):\d+\s+(\S+):\d+")  # ss -tinH


@dataclass(frozen=True)
class Crossed:
    """What crossed the veth, both directions together: frames and their bytes."""

    bytes: int
    packets: int

    @property
    def payload(self) -> int:
        """TCP payload: the bytes less HEADER a frame (up to OPTIONS more a frame
        when SACK blocks ride along, after a loss)."""
        return self.bytes - HEADER * self.packets

    def __sub__(self, other: Crossed) -> Crossed:
        return Crossed(self.bytes - other.bytes, self.packets - other.packets)


@dataclass(frozen=True)
class TwoHostRun:
    """One run of a worker on two hosts."""

    values: list  # what the worker returned on each rank, in rank order
    seconds: float  # wall-clock, from starting the ranks until the last one exited
    crossed: Crossed  # everything over the veth in that time, start-up included
    rate_mbit: float | None  # the shaping of each direction, or None


def cannot_make_namespaces(tools=("ip", "tc", "ss")) -> str | None:
    """Why two namespaces cannot be made here (one line), or None."""
    absent = [t for t in tools if shutil.which(t) is None]
    if absent:
        return (f"the command(s) {', '.join(absent)} are missing (Debian and "
                "Ubuntu: apt-get install iproute2)")
    if os.geteuid() != 0:
        return (f"network namespaces need root (CAP_NET_ADMIN); this process runs "
                f"as uid {os.geteuid()}")
    name = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True,
                          text=True)
    if made.returncode:
        return f"`ip netns add` refused: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def sh(*cmd, ns: str | None = None, check: bool = True) -> str:
    """Run a command (inside namespace `ns`), return its stdout; raise on failure."""
    if ns is not None:
        cmd = ("ip", "netns", "exec", ns, *cmd)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if check and run.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {run.stderr.strip()}")
    return run.stdout


def remove_stale() -> list[str]:
    """Delete our namespaces whose maker is gone (a run killed before its clean-up);
    returns their names. Namespaces of a process still alive are left alone."""
    gone = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = _OURS.match(name)
        if m and not _alive(int(m.group(1))):
            _delete(name)
            gone.append(name)
    return gone


def veth_counters() -> Crossed | None:
    """In a rank on two hosts: veth0's counters in its own namespace so far, both
    directions (`ip netns exec` mounts the namespace's own /sys); else None."""
    if ENV not in os.environ:
        return None
    d = Path("/sys/class/net", IFACE, "statistics")
    read = lambda f: int((d / f).read_text())
    return Crossed(read("rx_bytes") + read("tx_bytes"),
                   read("rx_packets") + read("tx_packets"))


def retransmitted() -> int | None:
    """In a rank on two hosts: the TCP payload its namespace has sent a second time
    to the other host so far (every socket's bytes_retrans, from `ss`); else
    None. On a busy machine a tail-loss probe resends a segment whose ACK came
    late: it crosses twice."""
    if ENV not in os.environ:
        return None
    total, across = 0, False
    for line in sh("ss", "-tinH").splitlines():
        m = _SOCKET.match(line)
        if m:  # a socket; its tcp_info follows on the next line
            across = m.group(1) != m.group(2)
        elif across and (r := re.search(r"bytes_retrans:(\d+)", line)):
            total += int(r.group(1))
    return total


def call_pickled(rank, world_size, path):
    """What each rank runs (`python -m labkit.launch` calls it): the worker and its
    arguments, cloudpickled into `path` by TwoHosts.run."""
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(Path(path).read_bytes())
    return fn(rank, world_size, *args, **kwargs)


class TwoHosts:
    """`with TwoHosts() as hosts:` namespaces hosts.names (A, B) at ADDRS, joined by
    a veth pair (veth0 in each). `hosts.shape(100)` limits each direction to
    100 Mbit/s; `hosts.run(fn, ...)` runs fn(rank, world_size, ...) on 2 ranks a
    host. Leaving the block (an error and Ctrl-C too) kills what runs in them and
    deletes them, qdiscs with them."""

    def __init__(self, tag: str = ""):
        self.names = [f"{PREFIX}{os.getpid()}-{tag}{side}" for side in "ab"]
        self.hostnames = ["host-a", "host-b"]
        self.rate_mbit: float | None = None
        self._runs = 0

    def __enter__(self):
        remove_stale()
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()

    def _make(self) -> None:
        a, b = self.names
        for ns in self.names:
            sh("ip", "netns", "add", ns)
            etc = Path("/etc/netns", ns)  # `ip netns exec` mounts it over /etc
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{addr} {name}\n" for addr, name in zip(ADDRS, self.hostnames)))
            sh("sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
               "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6", ns=ns)
        sh("ip", "-n", a, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE,
           "netns", b)
        for ns, addr in zip(self.names, ADDRS):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", IFACE, "up")
        macs = [sh("cat", f"/sys/class/net/{IFACE}/address", ns=ns).strip()
                for ns in self.names]
        for ns, addr, mac in ((a, ADDRS[1], macs[1]), (b, ADDRS[0], macs[0])):
            sh("ip", "-n", ns, "neigh", "replace", addr, "lladdr", mac, "dev", IFACE,
               "nud", "permanent")

    # -- the link ----------------------------------------------------------------

    def shape(self, rate_mbit: float, *, burst_kib: int = 32,
              latency_ms: int = 500) -> None:
        """A token bucket on both ends: each direction carries at most rate_mbit
        Mbit/s (after a first burst_kib KiB); packets wait up to latency_ms in its
        queue. Bandwidth only: this kernel has no netem for delay or loss."""
        for ns in self.names:
            sh("tc", "-n", ns, "qdisc", "replace", "dev", IFACE, "root", "tbf",
               "rate", f"{rate_mbit}mbit", "burst", f"{burst_kib}kb", "latency",
               f"{latency_ms}ms")
        self.rate_mbit = rate_mbit

    def unshape(self) -> None:
        """The link back at full speed (both qdiscs deleted)."""
        for ns in self.names:
            sh("tc", "-n", ns, "qdisc", "del", "dev", IFACE, "root", check=False)
        self.rate_mbit = None

    def counters(self) -> Crossed:
        """veth0's counters so far, both directions, read from outside (A's end)."""
        link = json.loads(sh("ip", "-n", self.names[0], "-s", "-j", "link", "show",
                             "dev", IFACE))[0]["stats64"]
        return Crossed(link["rx"]["bytes"] + link["tx"]["bytes"],
                       link["rx"]["packets"] + link["tx"]["packets"])

    # -- ranks -------------------------------------------------------------------

    def run(self, fn, *args, ranks_per_host: int = 2, timeout: float = 300.0,
            **kwargs) -> TwoHostRun:
        """fn(rank, world_size, *args, **kwargs) on ranks_per_host ranks in each
        namespace (gloo over veth0, rank 0's store in A), as `python -m
        labkit.launch` processes; fn goes by cloudpickle, so a notebook's own
        function works. Returns what each rank returned, the wall-clock and what
        crossed the veth meanwhile. A rank that fails, or a run past `timeout`
        seconds, stops every rank and raises, with the ranks' last output."""
        import cloudpickle

        n = 2 * ranks_per_host
        self._runs += 1
        with tempfile.TemporaryDirectory(prefix="labkit-two-hosts-") as work:
            job, results = Path(work, "job.pkl"), Path(work, "results")
            job.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
            logs = [Path(work, f"rank{r}.log") for r in range(n)]
            before, t0 = self.counters(), time.perf_counter()
            procs = []
            try:
                for r in range(n):
                    procs.append(self._start(r, n, ranks_per_host, job, results,
                                             logs[r]))
                failed = _wait(procs, timeout)
            finally:
                for p in procs:  # Ctrl-C or an error here: no rank outlives us
                    if p.poll() is None:
                        p.kill()
                    p.wait()
            seconds = time.perf_counter() - t0
            crossed = self.counters() - before
            try:  # a rank that raised left its traceback in its result file
                values = load_results(results).values
            except ResultsError as e:  # no tracebacks: the ranks' output says more
                more = "" if e.kind == "failed" else "\n" + _tails(logs)
                raise RuntimeError(f"two hosts: {failed or 'no result'}: {e}"
                                   + more) from None
            if failed:
                raise RuntimeError(f"two hosts: {failed}\n" + _tails(logs))
        return TwoHostRun(list(values), seconds, crossed, self.rate_mbit)

    def _start(self, rank, n, per_host, job, results, log) -> subprocess.Popen:
        host = rank // per_host
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n),
                   LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host),
                   MASTER_ADDR=ADDRS[0], MASTER_PORT=str(PORT + self._runs),
                   GLOO_SOCKET_IFNAME=IFACE, TORCHELASTIC_RUN_ID=f"two-hosts-"
                   f"{os.getpid()}-{self._runs}", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)),
                   # the caller's sys.path: fn's module imports in the ranks too
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   **{ENV: self.names[host]})
        cmd = ["ip", "netns", "exec", self.names[host], sys.executable, "-m",
               "labkit.launch", f"{__name__}:call_pickled", str(job), "--results",
               str(results)]
        with open(log, "w") as out:  # ip execs python: this pid is the rank's
            return subprocess.Popen(cmd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    def pids(self, ns: str) -> list[int]:
        return namespace_pids(ns)

    def remove(self) -> list[str]:
        """Kill what runs in each namespace, then delete it; returns what is left."""
        for ns in self.names:
            _delete(ns)
        self.rate_mbit = None
        listed = sh("ip", "netns", "list", check=False)
        return [ns for ns in self.names if ns in listed.split()]


def run_on_two_hosts(fn, *args, rate_mbit: float | None = None,
                     **kwargs) -> TwoHostRun:
    """TwoHosts.run in namespaces of its own, made for this run, shaped to
    rate_mbit Mbit/s a direction if given, and always removed afterwards."""
    with TwoHosts() as hosts:
        if rate_mbit is not None:
            hosts.shape(rate_mbit)
        return hosts.run(fn, *args, **kwargs)


def _wait(procs, timeout: float, grace: float = 10.0) -> str | None:
    """None when every rank exited 0 within `timeout`; else what went wrong. After
    a first failure the others get `grace` seconds to fail too (their peer's
    sockets close), so their errors are in the logs."""
    end, first = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad and first is None:
            first = now
        if now > end or (first is not None and now > first + grace):
            break
        time.sleep(0.02)
    codes = [p.poll() for p in procs]
    if all(c == 0 for c in codes):
        return None
    if first is None and any(c is None for c in codes):
        running = [r for r, c in enumerate(codes) if c is None]
        return f"still running after {timeout:g} s: ranks {running}"
    return "rank(s) " + ", ".join(f"{r} exited {c}" for r, c in enumerate(codes)
                                  if c not in (0, None))


def _tails(logs, lines: int = 15) -> str:
    out = []
    for r, log in enumerate(logs):
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        out.append(f"--- rank {r}, last lines:\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(ns: str) -> list[int]:
    """The processes running in network namespace `ns`."""
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]


def _delete(ns: str) -> None:
    """Kill every process in namespace `ns`, then delete it and its /etc/netns."""
    for pid in namespace_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while namespace_pids(ns) and time.monotonic() < end:
        time.sleep(0.05)
    sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)
