"""What a process tree holds, read from Linux's /proc (footprint.py's measuring half).

Per process: resident memory from /proc/PID/smaps_rollup (Rss; Pss, where a page
shared by k processes counts 1/k in each, so that forked ranks' shared pages are
counted once over the tree; Pss_File, the part backed by files (libraries),
which other students' processes share; USS, the pages this process alone maps),
threads from /proc/PID/status, CPU seconds from /proc/PID/stat, and its TCP
sockets: the inodes of its descriptors (/proc/PID/fd) looked up in
/proc/PID/net/tcp and tcp6. Linux only.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

LISTEN = "0A"  # /proc/net/tcp's st column for a listening socket
ESTABLISHED = "01"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Proc:
    """One process at one moment: bytes, threads, CPU seconds, TCP sockets."""

    pid: int
    role: str
    rss: int
    pss: int
    pss_file: int
    rss_file: int  # resident pages backed by files: Rss - Anonymous
    uss: int
    threads: int
    cpu_s: float
    listening: list[str] = field(default_factory=list)  # "127.0.0.1:29500"
    connections: int = 0  # established TCP connections


def parse_smaps_rollup(text: str) -> dict[str, int]:
    """{"Rss": bytes, "Pss", "Pss_File", "Rss_File", "USS"} from smaps_rollup.

    USS = Private_Clean + Private_Dirty. A Linux older than 5.7 has no Pss_File:
    then it reads 0, and every page counts as the student's own (an upper bound)."""
    kb = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[name.strip()] = int(parts[0]) * 1024
    return {"Rss": kb.get("Rss", 0), "Pss": kb.get("Pss", 0),
            "Pss_File": kb.get("Pss_File", 0),
            "Rss_File": kb.get("Rss", 0) - kb.get("Anonymous", 0),
            "USS": kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)}


def parse_threads(status_text: str) -> int:
    """The Threads: line of /proc/PID/status."""
    for line in status_text.splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError("no Threads: line in /proc/PID/status")


def parse_stat(stat_text: str) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) from /proc/PID/stat."""
    fields = stat_text.rsplit(")", 1)[1].split()  # the name may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _address(hex_addr: str) -> str:
    """'0100007F:1F90' -> '127.0.0.1:8080'; IPv6 words are in host (little) order."""
    host, port = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    return f"[{ip}]:{int(port, 16)}" if ip.version == 6 else f"{ip}:{int(port, 16)}"


def parse_net_tcp(text: str) -> dict[int, tuple[str, str]]:
    """/proc/net/tcp or tcp6: {socket inode: (local 'address:port', state hex)}."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 10:
            out[int(f[9])] = (_address(f[1]), f[3])
    return out


def is_loopback(address: str) -> bool:
    """'127.0.0.1:5' or '[::1]:5' (also an IPv4-mapped ::ffff:127.x) -> True."""
    host = address.rsplit(":", 1)[0].strip("[]")
    ip = ipaddress.ip_address(host)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def socket_inodes(fd_targets) -> set[int]:
    """Inodes of the 'socket:[12345]' links among a process's descriptors."""
    return {int(t[8:-1]) for t in fd_targets
            if t.startswith("socket:[") and t.endswith("]")}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _fd_targets(pid: int) -> list[str]:
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            pass  # closed meanwhile
    return out


def tcp_table(pid: int) -> dict[int, tuple[str, str]]:
    """Every TCP socket in `pid`'s network namespace, IPv4 and IPv6."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            table.update(parse_net_tcp(_read(f"/proc/{pid}/net/{name}")))
        except OSError:
            pass
    return table


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = parse_stat(_read(f"/proc/{d}/stat"))[0]
            except (OSError, IndexError, ValueError):
                pass
    return out


def tree(root: int, parent_of: dict[int, int]) -> list[int]:
    """`root` and its descendants, root first, parents before their children."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(p for p, pp in parent_of.items() if pp == pid)
    return out


def measure(pid: int, role: str, table: dict[int, tuple[str, str]]) -> Proc | None:
    """`pid` now (None if it has gone)."""
    try:
        mem = parse_smaps_rollup(_read(f"/proc/{pid}/smaps_rollup"))
        threads = parse_threads(_read(f"/proc/{pid}/status"))
        cpu = parse_stat(_read(f"/proc/{pid}/stat"))[1]
    except (OSError, ValueError):
        return None
    mine = [table[i] for i in socket_inodes(_fd_targets(pid)) if i in table]
    return Proc(pid, role, mem["Rss"], mem["Pss"], mem["Pss_File"],
                mem["Rss_File"], mem["USS"],
                threads, cpu, sorted(a for a, st in mine if st == LISTEN),
                sum(st == ESTABLISHED for _, st in mine))


def measure_tree(root: int, roles: dict[int, str]) -> list[Proc]:
    """The kernel `root` and every process below it, and below each pid `roles`
    names (a forkserver that took over from the one before it has left the
    kernel's tree: its parent exited); `roles` names known pids, the rest are
    named by their parent's role."""
    parent_of = parents()
    table = tcp_table(root)
    out, named = [], dict(roles)
    pids = tree(root, parent_of)
    for other in roles:
        if other not in pids and other in parent_of:
            pids += [p for p in tree(other, parent_of) if p not in pids]
    for pid in pids:
        if pid not in named:
            up = named.get(parent_of.get(pid), "process")
            named[pid] = "forkserver (successor)" if up.startswith("forkserver") \
                else f"child of {up}"
        p = measure(pid, named[pid], table)
        if p is not None:
            out.append(p)
    return out
