"""`python -m labkit footprint`: what one student costs a shared server.

Imports labkit.cli.class_size; jupyter_client, labkit.cli.footprint_proc and (on
the ranks) torch, labkit.ledger and labkit.parallel inside functions.

It runs a chapter's typical work stage by stage in a real Jupyter kernel with a
4-rank cluster and reads every process under it from /proc. A student's memory is
what no other student shares: the anonymous Pss (Pss - Pss_File) of kernel,
forkserver and ranks; torch's library files count once per machine (`summary`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

from labkit.cli.class_size import meminfo, mib, saved_path

IDLE_S = 3.0  # the idle timeout the "left idle" stage sets, in seconds


# -- what the ranks run: each chapter's typical work, small -------------------------


def _mlp(width, depth, classes=None):
    import torch

    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width),
                                                 torch.nn.ReLU())]
    last = [torch.nn.Linear(width, classes)] if classes else []
    return torch.nn.Sequential(*layers[:-1] if not classes else layers, *last)


def data_parallel_step(rank, world_size, steps=3):
    """Chapter 05: its 3 x 512 MLP under DataParallel, Adam, the ledgers."""
    import torch
    import torch.nn.functional as F

    from labkit import ledger
    from labkit.parallel import DataParallel

    model = _mlp(512, 3, classes=10)
    dp, opt = DataParallel(model), torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    with ledger.memory(model, opt) as held, ledger.traffic():
        for _ in range(steps):
            x = torch.randn(64, 512, generator=g)  # (64, 512): a quarter of 256
            opt.zero_grad()
            F.cross_entropy(dp(x), torch.randint(10, (64,), generator=g)).backward()
            dp.finish_gradient_synchronization()
            opt.step()
    return held.peak


def fsdp_steps(rank, world_size, steps=3):
    """Chapter 07: four Linear(512, 512) under labkit's FSDP, then FSDP2."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from labkit import ledger
    from labkit.parallel import FullyShardedDataParallel

    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))  # (8, 512)
    for how in ("labkit", "FSDP2"):
        model = _mlp(512, 4)
        if how == "labkit":
            w = FullyShardedDataParallel(model)
        else:
            mesh = dist.device_mesh.init_device_mesh("cpu", (world_size,))
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            w = fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(w.parameters(), lr=0.05, momentum=0.9)
        with ledger.memory(w, opt):
            for _ in range(steps):
                opt.zero_grad()
                F.mse_loss(w(x), x).backward()
                if how == "labkit":
                    w.finish_gradient_synchronization()
                opt.step()
    return True


def three_d_step(rank, world_size, steps=3):
    """Chapter 14: TinyGPT on DP(2) x PP(2) x TP(2), SGD, the ledgers."""
    import torch

    from labkit import ledger
    from labkit.parallel import ParallelGroups, ThreeD, TinyGPT

    cfg = dict(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    g = ParallelGroups.build(tp=2, pp=2, dp=2)
    torch.manual_seed(0)
    run = ThreeD(TinyGPT(**cfg), g, microbatches=2)
    opt = torch.optim.SGD(run.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100)
    with ledger.memory(run, opt), ledger.traffic():
        for _ in range(steps):
            t = torch.randint(0, 64, (8, 17), generator=gen)  # (8, seq + 1)
            opt.zero_grad()
            run.step(t[:, :-1], t[:, 1:])
            opt.step()
    return True


def roles(*clusters) -> str:
    """In the kernel: JSON {pid: role} of the kernel, its forkserver and ranks."""
    from labkit.runtime import forkserver

    fs = forkserver.shared()
    now = fs.pids.index(fs.pid) if fs.pid in fs.pids else len(fs.pids)
    out = {os.getpid(): "kernel"}
    for i, pid in enumerate(fs.pids):  # in the order they started
        out[pid] = ("forkserver" if i == now else "forkserver (successor)" if i > now
                    else "forkserver (retired: until its ranks exit)")
    for c in clusters:
        out |= {pid: f"rank {r} of {c.world_size}" for r, pid in c.pids.items()}
    return json.dumps(out)


# -- the stages, run in the kernel --------------------------------------------------

_SETUP = """
import json, time, labkit
from labkit.cli import footprint as _fp
from labkit.runtime import forkserver as _fs
_fs.shared().wait_preloaded(120)   # as a student's kernel is, a few seconds in
"""
STAGES = [  # (stage, code run in the kernel, clusters whose ranks it names)
    ("kernel + labkit, no cluster", "", ""),
    ("4-rank cluster started", "cluster = labkit.Cluster(4)", "cluster"),
    ("4-rank cluster idle for 5 s", "time.sleep(5)", "cluster"),
    ("after ch05's data-parallel step",
     "cluster.run(_fp.data_parallel_step)", "cluster"),
    ("after ch07's FSDP and FSDP2 steps", "cluster.run(_fp.fsdp_steps)", "cluster"),
    (f"left idle {IDLE_S:g} s with idle_timeout={IDLE_S:g}",
     f"cluster.idle_timeout = {IDLE_S}; cluster.run(_fp.noop); "
     f"time.sleep({IDLE_S} + 1)", "cluster"),
    ("next run after the idle stop", "cluster.run(_fp.noop)", "cluster"),
    ("cluster closed", "cluster.close()", ""),
    ("ch14: 8-rank cluster after a 3D step",
     "c8 = labkit.Cluster(8); c8.run(_fp.three_d_step)", "c8"),
]


def noop(rank, world_size):
    return rank


def _execute(kc, code: str, timeout: float) -> str:
    out: list[str] = []

    def hook(msg):
        c = msg["content"]
        if msg["msg_type"] == "stream" and c.get("name") == "stdout":
            out.append(c["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(c["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel failed running {code!r}:\n{''.join(out)}")
    return "".join(out)


def measure_stages(stages=STAGES, timeout: float = 300.0) -> list[dict]:
    """Run `stages` in a fresh kernel; each stage's processes, wall and CPU time."""
    from jupyter_client.manager import start_new_kernel

    from labkit.cli.footprint_proc import measure_tree

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _execute(kc, _SETUP, timeout)
        kernel = json.loads(_execute(kc, "print(_fp.roles())", timeout))
        kernel_pid = next(int(p) for p, r in kernel.items() if r == "kernel")
        out, before = [], measure_tree(kernel_pid, {})
        for name, code, named in stages:
            t0 = time.perf_counter()
            _execute(kc, code, timeout)
            wall = time.perf_counter() - t0
            who = json.loads(_execute(kc, f"print(_fp.roles({named}))", timeout))
            procs = measure_tree(kernel_pid, {int(p): r for p, r in who.items()})
            cpu = sum(p.cpu_s for p in procs) - sum(p.cpu_s for p in before)
            out.append({"stage": name, "wall_s": wall, "cpu_s": max(cpu, 0.0),
                        "procs": [asdict(p) for p in procs]})
            before = procs
        return out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def summary(stages: list[dict]) -> dict:
    """The per-student figures doctor uses: anonymous Pss at the heaviest 4-rank
    stage, the heaviest of all (chapter 14's 8 ranks) and once the idle timeout
    stopped the ranks; the library files once; the cores a step kept busy and an
    idle cluster used (CPU seconds / wall seconds)."""
    def total(s, key):
        return sum(p[key] for p in s["procs"])

    def anon(s):
        return total(s, "pss") - total(s, "pss_file")

    four = [s for s in stages if any("of 4" in p["role"] for p in s["procs"])]
    steps = [s for s in stages if "step" in s["stage"]]
    return {
        "per_student_bytes": max(anon(s) for s in stages),
        "per_student_4_ranks_bytes": max(anon(s) for s in four),
        "idle_stopped_bytes": max(anon(s) for s in stages if "left idle" in s["stage"]),
        # file-backed pages (torch's libraries): one copy per machine when every
        # kernel runs the same environment, so the most any one process maps
        "shared_files_bytes": max(p["rss_file"] for s in stages for p in s["procs"]),
        "busy_cores": max(s["cpu_s"] / s["wall_s"] for s in steps),
        "idle_cores": max(s["cpu_s"] / s["wall_s"] for s in stages
                          if "idle for" in s["stage"]),
        "cores": os.cpu_count() or 1,
        "measured": date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {meminfo()['MemTotal'] / 2**30:.0f} GiB",
    }


# -- the report ---------------------------------------------------------------------


def stage_table(s: dict) -> str:
    """One stage: a row per process (MiB, threads, TCP), and the total."""
    head = (f"{'process':<24}{'pid':>8}{'RSS':>7}{'PSS':>7}{'anon':>7}{'USS':>7}"
            f"{'thr':>5}  TCP listening (connections)")
    rows = [f"== {s['stage']} ({s['wall_s']:.1f} s, {s['cpu_s']:.1f} CPU s); MiB",
            head]
    for p in s["procs"]:
        tcp = ", ".join(p["listening"]) or "-"
        rows.append(f"{p['role']:<24}{p['pid']:>8}{mib(p['rss']):>7}"
                    f"{mib(p['pss']):>7}{mib(p['pss'] - p['pss_file']):>7}"
                    f"{mib(p['uss']):>7}{p['threads']:>5}  {tcp} "
                    f"({p['connections']})")
    t = {k: sum(p[k] for p in s["procs"]) for k in ("rss", "pss", "pss_file", "uss",
                                                    "threads", "connections")}
    rows.append(f"{'total':<24}{len(s['procs']):>8}{mib(t['rss']):>7}"
                f"{mib(t['pss']):>7}{mib(t['pss'] - t['pss_file']):>7}"
                f"{mib(t['uss']):>7}{t['threads']:>5}  ({t['connections']})")
    return "\n".join(rows)


def not_loopback(stages: list[dict]) -> list[str]:
    """'role: address' of every listening socket that is not on loopback."""
    from labkit.cli.footprint_proc import is_loopback

    return sorted({f"{p['role']}: {a}" for s in stages for p in s["procs"]
                   for a in p["listening"] if not is_loopback(a)})


def footprint(out: str | None = None) -> int:
    """Measure, print, save; exit status 1 if a socket listens off loopback."""
    stages = measure_stages()
    for s in stages:
        print(stage_table(s), end="\n\n")
    fig = summary(stages)
    print(f"per student  {mib(fig['per_student_bytes'])} MiB at the heaviest stage, "
          f"{mib(fig['per_student_4_ranks_bytes'])} MiB with 4 ranks (anonymous "
          f"PSS), plus {mib(fig['shared_files_bytes'])} MiB of library files once "
          "per machine")
    print(f"cores        a step kept {fig['busy_cores']:.1f} of {fig['cores']} cores "
          f"busy; an idle cluster {fig['idle_cores']:.3f}")
    bad = not_loopback(stages)
    print("sockets      " + ("every listening socket is on loopback" if not bad
                             else "NOT on loopback: " + "; ".join(bad)))
    path = Path(out) if out else saved_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": fig, "stages": stages}, indent=1))
    print(f"saved        {path} (python -m labkit doctor reads it)")
    return 1 if bad else 0
