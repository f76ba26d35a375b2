"""What a process tree holds, through psutil (footprint.py's measuring half).

Imports psutil and the standard library.

Per process: Rss, Pss (a page k processes share counts 1/k in each: forked ranks'
shared pages count once over the tree), USS, threads, CPU seconds, TCP sockets.
psutil has no Pss_File (Pss's file-backed part: libraries other students share),
so that one line is read from /proc/PID/smaps_rollup: Linux only.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import psutil

# a process that exits, or turns zombie, while it is measured: left out
GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


@dataclass
class Proc:
    """One process at one moment: bytes, threads, CPU seconds, TCP sockets."""

    pid: int
    role: str
    rss: int
    pss: int
    pss_file: int
    rss_file: int  # resident pages not anonymous: files' (and shared memory's)
    uss: int
    threads: int
    cpu_s: float
    listening: list[str] = field(default_factory=list)  # "127.0.0.1:29500"
    connections: int = 0  # established TCP connections


def pss_file(pid: int) -> int:
    """Pss_File of /proc/PID/smaps_rollup, in bytes. A Linux older than 5.7 has
    none: then it reads 0, and every page counts as the student's own (an upper
    bound)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss_File:"):
                return int(line.split()[1]) * 1024
    return 0


def _address(ip: str, port: int) -> str:
    """('::1', 80) -> '[::1]:80'; ('127.0.0.1', 80) -> '127.0.0.1:80'."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def is_loopback(address: str) -> bool:
    """'127.0.0.1:5' or '[::1]:5' (also an IPv4-mapped ::ffff:127.x) -> True."""
    host = address.rsplit(":", 1)[0].strip("[]")
    ip = ipaddress.ip_address(host)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def measure(pid: int, role: str) -> Proc | None:
    """`pid` now (None if it has gone)."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            mem = p.memory_full_info()
            cpu = p.cpu_times()
            threads = p.num_threads()
            tcp = p.net_connections(kind="tcp")
        file_pss = pss_file(pid)
    except (*GONE, OSError):
        return None
    return Proc(pid, role, mem.rss, mem.pss, file_pss,
                mem.shared,  # Rss less the anonymous pages (Linux's meaning)
                mem.uss, threads, cpu.user + cpu.system,
                sorted(_address(*c.laddr) for c in tcp
                       if c.status == psutil.CONN_LISTEN),
                sum(c.status == psutil.CONN_ESTABLISHED for c in tcp))


def tree(root: int) -> list[psutil.Process]:
    """`root` and its descendants, each after its parent ([] if `root` has gone)."""
    try:
        p = psutil.Process(root)
        return [p, *p.children(recursive=True)]
    except GONE:
        return []


def measure_tree(root: int, roles: dict[int, str]) -> list[Proc]:
    """The kernel `root` and every process below it, and below each pid `roles`
    names (a forkserver that took over from the one before it has left the
    kernel's tree: its parent exited); `roles` names known pids, the rest are
    named by their parent's role."""
    procs = tree(root)
    for other in roles:
        seen = {p.pid for p in procs}
        if other not in seen:
            procs += [p for p in tree(other) if p.pid not in seen]
    out, named = [], dict(roles)
    for p in procs:
        if p.pid not in named:
            try:
                up = named.get(p.ppid(), "process")
            except GONE:
                continue
            named[p.pid] = "forkserver (successor)" if up.startswith("forkserver") \
                else f"child of {up}"
        m = measure(p.pid, named[p.pid])
        if m is not None:
            out.append(m)
    return out
