"""Two hosts on one Linux machine: a chapter's workers under torchrun on two network
stacks, as on two nodes of a cluster (`make two-hosts`; needs root).

Two network namespaces, A (10.77.0.1) and B (10.77.0.2), are joined by a veth pair
(`veth0` in each); each runs one torchrun agent with 2 ranks, meeting at A's
address. What a real cluster needs is set here the same way:

  GLOO_SOCKET_IFNAME=veth0   the interface gloo listens and connects on; without
                             it gloo takes the address the hostname resolves to
                             (often 127.0.1.1, or the wrong network)
  --local-addr 10.77.0.X     the address the other node reaches this one at: the
                             workers' store (MASTER_ADDR) is on node rank 0's
                             agent, under this address (else the hostname's)
  --rdzv-endpoint A:29500    the rendezvous, on the first node
  --results DIR              each node writes its own ranks' files

Each namespace gets its own hostname (a UTS namespace) and /etc/hosts naming both
(/etc/netns/NAME/hosts, which `ip netns exec` mounts), addresses only inside the
namespaces, static ARP entries and no IPv6 (so every packet on veth0 is the
ranks' TCP); everything is removed again, processes first, even on failure. The
namespaces themselves are labkit.comm.two_hosts's; `agent` is this file's.

Then chapter 13's comparison (labkit/cli/diloco_vs_ddp.py): DDP against DiLoCo
(H = 1, 8, 64) at equal tokens, the bytes a step sends across the veth next to
theory.bytes_across_hosts, and their step times with the link shaped to
100 Mbit/s each way (tc tbf). Without root it runs the same workers on one host
under the traffic ledger instead, and exits 1.

    python examples/two_hosts.py          # chapters 05 and 07, then DiLoCo
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from labkit.cli import diloco_vs_ddp  # noqa: E402
from labkit.comm import two_hosts  # noqa: E402
from labkit.comm.two_hosts import ADDRS, PORT, cannot_make_namespaces, sh  # noqa: E402

PROBE = Path(__file__).resolve().parent / "two_hosts_probe.py"
JOBS = [("05_data_parallel", "one_step", ("overlap",)),
        ("07_fsdp", "train", ("FSDP",))]


class TwoHosts(two_hosts.TwoHosts):
    """`with TwoHosts() as hosts:` two namespaces, hosts.names[0] and [1], with a
    torchrun agent for each."""

    def agent(self, i: int, worker_args: list[str], results, probe_dir, *,
              nnodes: int = 2, nproc: int = 2, rdzv_id: str = "two-hosts"):
        """torchrun's agent in namespace i (its own hostname), as a Popen."""
        os.makedirs(probe_dir, exist_ok=True)
        env = dict(os.environ, GLOO_SOCKET_IFNAME="veth0", LABKIT_RDZV_PORT=str(PORT),
                   LABKIT_PROBE_DIR=str(probe_dir), PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(ROOT))
        torchrun = [sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRS[0]}:{PORT}",
                    "--rdzv-id", rdzv_id, "--local-addr", ADDRS[i],
                    "--max-restarts", "0", "-m", "labkit.launch", *worker_args,
                    "--results", str(results)]
        cmd = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
               f'hostname {self.hostnames[i]} && exec "$@"', "sh", *torchrun]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)


def wait_all(agents, seconds: float, echo=None) -> list[tuple[int, str, float]]:
    """(returncode, output, time.time() when it exited) per agent; after `seconds`
    the agents left are killed."""
    t0 = time.monotonic()
    outs: list[list[str]] = [[] for _ in agents]
    ended = [None] * len(agents)

    def read(i, a):
        for line in a.stdout:
            outs[i].append(line)
            if echo:
                echo(f"[{'AB'[i]}] {line.rstrip()}")
        a.wait()
        ended[i] = time.time()

    threads = [threading.Thread(target=read, args=(i, a), daemon=True)
               for i, a in enumerate(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, seconds - (time.monotonic() - t0)))
    for a in agents:
        if a.poll() is None:
            a.kill()
    for t in threads:
        t.join(5)
    return [(a.returncode, "".join(o), e if e is not None else time.time())
            for a, o, e in zip(agents, outs, ended)]


def export_chapters(out_dir) -> list[tuple[str, tuple]]:
    """Chapters 05 and 07 exported (`python -m labkit export`): the probe's jobs."""
    jobs = []
    for chapter, fn, args in JOBS:
        path = Path(out_dir, f"{chapter}.py")
        sh(sys.executable, "-m", "labkit", "export",
           str(ROOT / "notebooks" / f"{chapter}.ipynb"), "--out", str(path))
        jobs.append((f"{path}:{fn}", args))
    return jobs


def probe_args(jobs, kill_rank=None) -> list[str]:
    return [f"{PROBE}:probed", repr(list(jobs)), repr(kill_rank)]


def accounting(values) -> list[dict]:
    """Per host and traffic window: the ledger's wire bytes of the host's ranks and
    what its interfaces carried (see two_hosts_probe.py)."""
    rows = []
    for ns in sorted({v["netns"] for v in values}):
        ranks = [r for r, v in enumerate(values) if v["netns"] == ns]
        head = next(values[r] for r in ranks if "host" in values[r]["windows"][0])
        for k, w in enumerate(head["windows"]):
            h, by = w["host"], w["host"]["sent_by"]
            mine = {r: by.get(values[r]["pid"], {"lo": 0, "veth0": 0, "retrans": 0})
                    for r in ranks}
            rows.append({
                "host": ns, "window": k, "ranks": ranks,
                "ledger": {r: values[r]["windows"][k]["wire"] for r in ranks},
                "sockets": mine, "store": by["store"],
                "veth0": h["veth0"], "lo": h["lo"],
                "retrans": sum(b["retrans"] for b in by.values())})
    return rows


def report(rows) -> str:
    lines = []
    for a in rows:
        per = ", ".join(f"rank {r}: {a['ledger'][r]:,} (ledger) = "
                        f"{a['sockets'][r]['veth0']:,} over veth0 + "
                        f"{a['sockets'][r]['lo']:,} over lo" for r in a["ranks"])
        lines.append(
            f"{a['host']}, traffic window {a['window']}: veth0 sent "
            f"{a['veth0']['bytes']:,} B in {a['veth0']['packets']} packets, "
            f"{a['veth0']['payload']:,} B of TCP payload; lo "
            f"{a['lo']['payload']:,} B; stores {a['store']['veth0']:,} B over "
            f"veth0 and {a['store']['lo']:,} B over lo; retransmitted "
            f"{a['retrans']:,} B\n    {per}")
    return "\n".join(lines)


def diloco() -> None:
    """DDP against DiLoCo on two hosts: bytes across, then the shaped link."""
    print("\nDiLoCo against DDP, 2 hosts x 2 ranks, the same 64 steps and batches")
    print(diloco_vs_ddp.report_two_hosts(diloco_vs_ddp.measure_two_hosts()))


def main() -> int:
    why = cannot_make_namespaces()
    if why:
        print(f"two hosts: cannot run here: {why}\nthe DiLoCo comparison on one "
              "host instead (no bytes across hosts):")
        print(diloco_vs_ddp.report_one_host(diloco_vs_ddp.measure_one_host()))
        return 1
    work = ROOT / "build" / "two-hosts"
    shutil.rmtree(work, ignore_errors=True)
    jobs = export_chapters(work / "workers")
    with TwoHosts() as hosts:
        print(f"namespaces {hosts.names[0]} ({ADDRS[0]}) and {hosts.names[1]} "
              f"({ADDRS[1]}), joined by veth0")
        results = [work / "runs" / h for h in hosts.hostnames]
        agents = [hosts.agent(i, probe_args(jobs), results[i], work / "probe" / h)
                  for i, h in enumerate(hosts.hostnames)]
        runs = wait_all(agents, 300, echo=print)
        if any(rc for rc, _, _ in runs):
            print("an agent failed")
            return 1
    sh_out = subprocess.run([sys.executable, "-m", "labkit", "results",
                             *map(str, results)], capture_output=True, text=True)
    print(sh_out.stdout)
    sys.path.insert(0, str(ROOT))
    from labkit.runtime import load_results

    print(report(accounting(load_results(*results).values)))
    diloco()
    return 0


if __name__ == "__main__":
    sys.exit(main())
