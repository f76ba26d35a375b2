"""The worker `examples/two_hosts.py` runs under torchrun: chapter workers, unchanged,
with this host's network counters read around every traffic ledger they open.

    torchrun ... -m labkit.launch examples/two_hosts_probe.py:probed \\
        "[('build/workers/05_data_parallel.py:one_step', ('overlap',))]" --results DIR

`probed` calls each (FILE.py:FUNCTION, args) in turn and returns their values with
where the rank ran (its network namespace and hostname) and, per traffic-ledger
window, the ledger's wire bytes and, on the host's local rank 0, what the host's
interfaces sent in the same window:

  * the ranks of one host meet before and after the window through files in
    $LABKIT_PROBE_DIR (no network: nothing extra on the counters), and local rank 0
    waits until no socket of the host has unacknowledged bytes, so everything a
    ledger counted has left the host;
  * `tx_bytes - HEADER * tx_packets` of veth0 and lo is the TCP payload they
    carried (retransmissions included), plus at most OPTIONS bytes per packet
    (SACK blocks): every packet is then an established TCP segment (the namespaces
    have static ARP entries and no IPv6); a GSO segment counts one header;
  * the rendezvous' and the workers' TCPStore traffic is told apart by port with
    `ss` (the kernel's bytes_sent of every socket), as are each rank's own bytes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from labkit.runtime.launch import load

# bytes of header per packet: IPv4 (20), TCP (20) and its timestamp option (12),
# plus Ethernet's 14 on veth0 (lo counts a packet after taking its Ethernet header
# off: drivers/net/loopback.c reads skb->len after eth_type_trans)
HEADER = {"veth0": 14 + 20 + 20 + 12, "lo": 20 + 20 + 12}
OPTIONS = 40 - 12  # TCP option bytes a packet may carry beyond the timestamp (SACK)
IFACES = tuple(HEADER)
_SOCK = re.compile(r"^\S+\s+\d+\s+(\d+)\s+(\S+):(\d+)\s+(\S+):(\d+)\s*(.*)$")


def probed(rank, world_size, jobs, kill_rank=None):
    """Run every (target, args) of `jobs`; rank `kill_rank` kills itself (SIGKILL)
    as its first traffic window closes, a host lost in the middle of a run."""
    host = Host()
    values = []
    for target, args in jobs:
        fn = load(target)
        fn.__globals__["ledger"] = ProbedLedger(fn.__globals__["ledger"], host,
                                                kill=rank == kill_rank)
        values.append(fn(rank, world_size, *args))
    return {"values": values, "netns": host.netns, "hostname": socket.gethostname(),
            "pid": os.getpid(), "windows": host.windows}


class ProbedLedger:
    """The chapter's `ledger` module, with `traffic()` inside a counted window."""

    def __init__(self, real, host, kill=False):
        self._real, self._host, self._kill = real, host, kill

    def __getattr__(self, name):
        return getattr(self._real, name)

    def traffic(self, *args, **kwargs):
        return Window(self._real.traffic(*args, **kwargs), self._host, self._kill)


class Window:
    def __init__(self, ledger, host, kill):
        self.ledger, self.host, self.kill = ledger, host, kill

    def __enter__(self):
        self.host.open()
        return self.ledger.__enter__()

    def __exit__(self, *exc):
        out = self.ledger.__exit__(*exc)
        if self.kill:  # a host lost mid-run: no result, no goodbye
            Path(os.environ["LABKIT_PROBE_DIR"], "killed_at").write_text(
                repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        self.host.close(self.ledger)
        return out


class Host:
    """This rank's host: its local ranks, its counters, its traffic windows."""

    def __init__(self):
        self.local = int(os.environ["LOCAL_RANK"])
        self.n_local = int(os.environ["LOCAL_WORLD_SIZE"])
        self.dir = Path(os.environ["LABKIT_PROBE_DIR"])
        self.stores = {int(os.environ["MASTER_PORT"]),
                       int(os.environ["LABKIT_RDZV_PORT"])}
        self.netns = subprocess.run(["ip", "netns", "identify", str(os.getpid())],
                                    capture_output=True, text=True).stdout.strip()
        self.windows: list[dict] = []
        self._c0 = None

    def _meet(self, stage: str) -> dict | None:
        """Every local rank reaches `stage`; local rank 0 reads the counters
        (when every byte has left) before any of them goes on."""
        k = len(self.windows)
        (self.dir / f"w{k}.{stage}.{self.local}").touch()
        if self.local == 0:
            _wait([self.dir / f"w{k}.{stage}.{r}" for r in range(self.n_local)])
            _wait_acked(self.stores)
            counters = read_counters()
            (self.dir / f"w{k}.{stage}.read").touch()
            return counters
        _wait([self.dir / f"w{k}.{stage}.read"])
        return None

    def open(self) -> None:
        self._c0 = self._meet("open")

    def close(self, ledger) -> None:
        c1 = self._meet("close")
        row = {"wire": int(ledger.total), "calls": len(ledger.records),
               "payload": int(ledger.sum("payload_bytes"))}
        if c1 is not None:
            row["host"] = difference(self._c0, c1, self.stores)
        self.windows.append(row)


def _wait(paths, seconds: float = 120.0) -> None:
    end = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if time.monotonic() > end:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"local ranks never reached {missing} in {seconds} s")
        time.sleep(0.002)


def sockets() -> dict[tuple, dict]:
    """(local addr, port, peer addr, port) -> {"sent", "queued", "pid"} for every
    TCP socket of this namespace, from `ss` (the kernel's tcp_info)."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                          check=True).stdout
    out, key = {}, None
    for line in text.splitlines():
        m = _SOCK.match(line)
        if m:
            queued, la, lp, pa, pp, users = m.groups()
            key = (la, int(lp), pa, int(pp))
            pid = re.search(r"pid=(\d+)", users)
            out[key] = {"queued": int(queued), "sent": 0, "retrans": 0,
                        "pid": int(pid.group(1)) if pid else None}
        elif key is not None:
            for field in ("sent", "retrans"):
                m = re.search(rf"bytes_{field}:(\d+)", line)
                out[key][field] = int(m.group(1)) if m else 0
    return out


def _wait_acked(stores, seconds: float = 10.0) -> None:
    """Until no socket but the stores' holds bytes not yet acknowledged."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(s["queued"] for k, s in sockets().items()
                   if not stores & {k[1], k[3]}):
            return
        time.sleep(0.005)


def read_counters(tries: int = 200) -> dict:
    """The interfaces' counters and every socket's, as of one moment: sockets,
    interfaces, sockets again, until no socket sent a byte in between (a store's
    heartbeat between the two readings would count on one side only: once, on a
    busy machine, 717 B short)."""
    before = sockets()
    for _ in range(tries):
        stats = {}
        for i in IFACES:
            d = Path("/sys/class/net", i, "statistics")
            stats[i] = [int((d / f).read_text()) for f in ("tx_bytes", "tx_packets")]
        after = sockets()
        if ({k: s["sent"] for k, s in after.items()}
                == {k: s["sent"] for k, s in before.items()}):
            return {"ifaces": stats, "sockets": after}
        before = after
    raise RuntimeError(f"the sockets kept sending through {tries} readings of the "
                       "interfaces' counters")


def difference(c0: dict, c1: dict, stores: set[int]) -> dict:
    """What the host sent between two readings: per interface the bytes, packets and
    TCP payload (bytes less HEADER per packet); per socket owner (a pid, or
    "store") the bytes sent over each and those that were retransmissions."""
    out = {}
    for i in IFACES:
        nbytes, packets = (b - a for a, b in zip(c0["ifaces"][i], c1["ifaces"][i]))
        out[i] = {"bytes": nbytes, "packets": packets,
                  "payload": nbytes - HEADER[i] * packets}
    local = {k[0] for k in c1["sockets"]}  # this host's addresses
    by = {"store": {"lo": 0, "veth0": 0, "retrans": 0}}
    for key, s in c1["sockets"].items():
        s0 = c0["sockets"].get(key, {"sent": 0, "retrans": 0})
        who = "store" if stores & {key[1], key[3]} else s["pid"]
        row = by.setdefault(who, {"lo": 0, "veth0": 0, "retrans": 0})
        row["lo" if key[2] in local else "veth0"] += s["sent"] - s0["sent"]
        row["retrans"] += s["retrans"] - s0["retrans"]
    out["sent_by"] = by
    return out
