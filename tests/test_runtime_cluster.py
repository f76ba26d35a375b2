"""labkit.Cluster: real ranks driven from the test process, and what goes wrong."""

import os
import signal
import socket
import threading
import time

import pytest
import torch

import labkit
from labkit import CollectiveTimeout, RankError
from labkit.runtime.backend import gpu_count, resolve_backend
from labkit.runtime.forkserver import shared as forkserver
from labkit.runtime.forkserver_process import IDLE_BEFORE_SPARES
from tests.conftest import FORK_ONLY, alive, descendants_of, wait_gone


def _rank_and_size(rank, world_size):
    return rank, world_size


def test_run_returns_one_value_per_rank(cluster):
    res = cluster.run(_rank_and_size)
    assert res.values == [(r, 4) for r in range(4)]
    assert res.ranks == [0, 1, 2, 3]
    assert res[2] == (2, 4)
    assert len(res) == 4 and list(res) == res.values
    assert "rank 3: (3, 4)" in repr(res)
    assert res._repr_html_().count("<tr>") == 5  # header + one row per rank


def test_tensors_closures_and_local_classes_travel(cluster):
    offset = 10.0  # captured by the closure

    class Box:  # defined here, like a class in a notebook cell
        def __init__(self, t):
            self.t = t

    def work(rank, world_size, x, *, scale):
        import torch.distributed as dist

        y = (x + rank) * scale + offset
        dist.all_reduce(y)
        return Box(y)

    res = cluster.run(work, torch.arange(4.0), scale=2.0)
    # sum over ranks of (x + r) * 2 + 10 = 2 * (4x + 6) + 40
    expected = 2 * (4 * torch.arange(4.0) + 6) + 40
    for box in res:
        assert type(box).__name__ == "Box"
        torch.testing.assert_close(box.t, expected)


def test_course_example_all_reduce(cluster):
    def work(rank, world_size):
        import torch
        import torch.distributed as dist

        x = torch.tensor([0.0, 1, 2, 3]) + rank
        dist.all_reduce(x)
        return x

    for x in cluster.run(work):
        assert x.tolist() == [6, 10, 14, 18]


def test_subset_of_ranks(cluster):
    res = cluster.run(_rank_and_size, ranks=[1, 3])
    assert res.ranks == [1, 3] and res.values == [(1, 4), (3, 4)]
    with pytest.raises(IndexError, match="ranks \\[1, 3\\]"):
        res[0]


def test_prints_are_prefixed_and_in_rank_order(cluster, capsys):
    def talk(rank, world_size):
        import sys
        import time

        time.sleep(0.05 * (world_size - rank))  # rank 0 finishes last
        print(f"hello from {rank}")
        print(f"note {rank}", file=sys.stderr)

    res = cluster.run(talk)
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(4)]
    assert err.splitlines() == [f"[rank {r}] note {r}" for r in range(4)]
    assert res.outputs[2] == "hello from 2\n"


def test_exception_names_rank_and_shows_traceback_and_others(cluster):
    def bad(rank, world_size):
        import torch
        import torch.distributed as dist

        if rank == 1:
            raise ValueError("rank one is unhappy")
        dist.all_reduce(torch.ones(1))

    pids = cluster.pids
    t = time.monotonic()
    with pytest.raises(RankError) as ei:
        cluster.run(bad)
    assert time.monotonic() - t < 5
    msg = str(ei.value)
    assert "rank 1 raised ValueError: rank one is unhappy" in msg
    assert 'raise ValueError("rank one is unhappy")' in msg  # the source line
    assert isinstance(ei.value.exceptions[1], ValueError)
    for r in (0, 2, 3):  # what the others were doing
        assert "all_reduce" in ei.value.busy[r]
    assert not wait_gone(pids.values(), 2.0)
    assert cluster.run(_rank_and_size).values == [(r, 4) for r in range(4)]


def test_traceback_shows_source_that_only_the_kernel_has(cluster):
    # IPython keeps a cell's source in linecache only; the ranks never see it.
    import linecache

    src = "def from_cell(rank, world_size):\n    raise KeyError('only in the cell')\n"
    fname = "<labkit-test-cell>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    ns = {}
    exec(compile(src, fname, "exec"), ns)
    with pytest.raises(RankError) as ei:
        cluster.run(ns["from_cell"])
    assert "raise KeyError('only in the cell')" in ei.value.failures[0]
    assert sorted(ei.value.failures) == [0, 1, 2, 3]


def test_mismatched_collective_times_out_and_names_busy_ranks():
    def hang(rank, world_size):
        import torch
        import torch.distributed as dist

        if rank == 0:
            dist.all_reduce(torch.ones(1))

    with labkit.Cluster(2, timeout=2) as c:
        t = time.monotonic()
        with pytest.raises(CollectiveTimeout) as ei:
            c.run(hang)
        elapsed = time.monotonic() - t
        assert 2 <= elapsed < 6
        assert list(ei.value.busy) == [0]
        assert "all_reduce" in ei.value.busy[0]
        assert "dist.all_reduce(torch.ones(1))" in ei.value.busy[0]
        assert ei.value.finished == [1]
        assert isinstance(ei.value, TimeoutError)
        assert c.run(_rank_and_size).values == [(0, 2), (1, 2)]


def test_per_call_timeout_overrides_default():
    def nap(rank, world_size):
        import time

        time.sleep(30)

    with labkit.Cluster(2, timeout=60) as c:
        t = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="time.sleep"):
            c.run(nap, timeout=1)
        assert time.monotonic() - t < 4


def test_rank_killed_mid_call_is_reported_and_recovered():
    def nap(rank, world_size):
        import time

        time.sleep(30 if rank == 1 else 0)

    with labkit.Cluster(2, timeout=20) as c:
        victim = c.pids[1]
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(RankError, match="rank 1 died: killed by SIGKILL"):
            c.run(nap)
        assert c.run(_rank_and_size).values == [(0, 2), (1, 2)]
        assert victim not in c.pids.values()


def test_rank_killed_while_idle_is_restarted(capsys):
    with labkit.Cluster(2) as c:
        old = c.pids
        os.kill(old[0], signal.SIGKILL)
        assert not wait_gone([old[0]], 2.0, until_reaped=True)  # reaped
        assert c.run(_rank_and_size).values == [(0, 2), (1, 2)]
        assert "rank 0 killed by SIGKILL" in capsys.readouterr().err
        assert set(c.pids.values()).isdisjoint(old.values())


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt here, as in a kernel, even where pytest
    inherited SIGINT ignored (a shell's background job), which would leave the
    call below waiting forever."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_interrupt_stops_ranks_quickly_and_cluster_recovers(sigint_raises):
    def forever(rank, world_size):
        import time

        while True:
            time.sleep(0.1)

    with labkit.Cluster(4, timeout=None) as c:
        pids = list(c.pids.values())
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            c.run(forever)
        assert not wait_gone(pids, 2.0)
        assert c.run(_rank_and_size).values == [(r, 4) for r in range(4)]


def _threads(rank, world_size):
    return torch.get_num_threads()


def test_threads_per_rank_come_from_the_argument_the_server_or_the_cores(monkeypatch):
    from labkit.runtime.backend import rank_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LABKIT_THREADS", raising=False)
    assert rank_threads(None, 4) == max(1, cores // 4)
    assert rank_threads(3, 4) == 3
    monkeypatch.setenv("LABKIT_THREADS", "1")  # a lecturer's server-wide setting
    assert rank_threads(None, 4) == 1 and rank_threads(2, 4) == 2
    for bad in ("two", "0"):
        monkeypatch.setenv("LABKIT_THREADS", bad)
        with pytest.raises(ValueError, match="LABKIT_THREADS"):
            rank_threads(None, 4)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads must be"):
            rank_threads(bad, 4)
    monkeypatch.setenv("LABKIT_THREADS", "1")
    with labkit.Cluster(2, threads=None) as c:
        assert c.threads == 1 and c.run(_threads).values == [1, 1]


def test_ranks_live_in_their_own_session():
    with labkit.Cluster(2) as c:
        for pid in [*c.pids.values(), *forkserver().pids]:
            assert os.getsid(pid) != os.getsid(0)
            assert os.getpgid(pid) != os.getpgid(0)


def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets this pid is listening on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr = cols[1].split(":")[0]
                    if v6:
                        raw = bytes.fromhex(addr)
                        found.append(socket.inet_ntop(socket.AF_INET6, raw))
                    else:
                        found.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def test_rendezvous_and_gloo_listen_on_loopback_only(cluster):
    addrs = _listening(os.getpid())
    for pid in cluster.pids.values():
        addrs += _listening(pid)
    assert addrs, "expected the store and gloo to listen somewhere"
    assert all(a in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for a in addrs), addrs


def test_two_clusters_at_once_have_their_own_ports():
    with labkit.Cluster(2) as a, labkit.Cluster(2) as b:
        assert a.port != b.port
        assert a.run(_rank_and_size).values == b.run(_rank_and_size).values


def test_default_cluster_is_reused_per_world_size():
    r1 = labkit.run(_rank_and_size, world_size=2)
    pids = labkit.default_cluster(2).pids
    r2 = labkit.run(_rank_and_size, world_size=2)
    assert r1.values == r2.values == [(0, 2), (1, 2)]
    assert labkit.default_cluster(2).pids == pids
    assert labkit.default_cluster(3) is not labkit.default_cluster(2)


def test_close_and_context_manager_end_every_rank():
    with labkit.Cluster(3) as c:
        pids = list(c.pids.values())
        assert all(alive(p) for p in pids)
    assert not wait_gone(pids, 2.0)
    with pytest.raises(labkit.ClusterClosed,
                       match=r"closed .* cluster = labkit\.Cluster\(3\)"):
        c.run(_rank_and_size)
    c.close()  # twice is fine
    # a check re-run after a chapter's last cell closed its cluster says so
    from labkit.checks import ExerciseError
    from labkit.checks.common import run_answer

    with pytest.raises(ExerciseError, match=r"needs running ranks, but this Cluster"):
        run_answer(c, _rank_and_size)


@pytest.mark.parametrize("backend, world_size, gpus, chosen", [
    ("auto", 4, 0, "gloo"), ("auto", 4, 2, "gloo"),  # fewer GPUs than ranks: CPU
    ("auto", 4, 4, "nccl"), ("auto", 2, 8, "nccl"), ("gloo", 4, 8, "gloo"),
    ("nccl", 2, 2, "nccl"),
])
def test_backend_choice(backend, world_size, gpus, chosen):
    assert resolve_backend(backend, world_size, gpus=gpus) == chosen


def test_backend_errors_and_the_cpu_default():
    with pytest.raises(ValueError, match="one GPU per rank: world_size=4 but 2"):
        resolve_backend("nccl", 4, gpus=2)
    with pytest.raises(ValueError, match="backend"):
        labkit.Cluster(2, backend="mpi")
    if gpu_count() == 0:
        with labkit.Cluster(1) as c:
            assert c.backend == "gloo"
            assert c.run(_rank_and_size).values == [(0, 1)]
    assert not torch.cuda.is_initialized()  # the kernel never touches CUDA


@pytest.mark.skipif(gpu_count() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="one GPU per rank"):
        labkit.Cluster(2, backend="nccl")


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"world_size": 0}, ValueError, r"world_size must be an integer in \[1, 64\]"),
        ({"world_size": 65}, ValueError, r"world_size must be an integer in \[1, 64\]"),
        ({"world_size": 2.0}, TypeError, "must be an int"),
        ({"world_size": "4"}, TypeError, "must be an int"),
        ({"world_size": 2, "timeout": -1}, ValueError, "timeout"),
        ({"world_size": 2, "timeout": "soon"}, TypeError, "timeout"),
    ],
)
def test_bad_cluster_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        labkit.Cluster(**kwargs)


def test_bad_run_arguments(cluster):
    with pytest.raises(TypeError, match="needs a function"):
        cluster.run(42)
    with pytest.raises(TypeError, match="argument 1 \\(lock\\) cannot be sent"):
        cluster.run(_rank_and_size, 1, threading.Lock())
    with pytest.raises(TypeError, match="keyword argument 'gen'"):
        cluster.run(_rank_and_size, gen=(i for i in range(3)))
    with pytest.raises(ValueError, match="ranks must be"):
        cluster.run(_rank_and_size, ranks=[4])
    with pytest.raises(ValueError, match="ranks must be"):
        cluster.run(_rank_and_size, ranks=[1, 1])
    # nothing was sent: the cluster is untouched
    assert cluster.run(_rank_and_size).values == [(r, 4) for r in range(4)]


def test_unpicklable_return_value_is_a_rank_error(cluster):
    def give_lock(rank, world_size):
        import threading

        return threading.Lock()

    with pytest.raises(RankError, match="cannot be pickled"):
        cluster.run(give_lock)


def test_many_runs_leak_no_processes_threads_or_files():
    with labkit.Cluster(4) as c:
        for _ in range(10):
            c.run(_rank_and_size)
        server = forkserver().pid
        # steady state: a hand-over to a successor that imports what the layers
        # asked for (a process more) is not a leak
        assert forkserver().wait_preloaded(timeout=90)
        time.sleep(IDLE_BEFORE_SPARES[c.start] + 0.5)  # spares, once idle

        def counts():
            return (
                len(descendants_of(server)),
                threading.active_count(),
                len(os.listdir("/proc/self/task")),
                len(os.listdir("/proc/self/fd")),
            )

        before = counts()
        for _ in range(200):
            c.run(_rank_and_size)
        assert counts() == before
        assert before[0] >= 4  # the ranks are counted


def test_import_starts_the_forkserver_only_where_ranks_will_follow():
    import subprocess
    import sys

    code = "import labkit.runtime.forkserver as f; print(bool(f.started()))"
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_PREWARM"}
    plain = subprocess.run([sys.executable, "-c", "import labkit; " + code],
                           capture_output=True, text=True, env=env, timeout=120)
    assert plain.stdout.strip() == "False"  # a script or CLI: nothing started
    forced = subprocess.run([sys.executable, "-c", "import labkit; " + code],
                            capture_output=True, text=True, timeout=120,
                            env=env | {"LABKIT_PREWARM": "1"})
    assert forced.stdout.strip() == "True"


def _preloaded_here(rank, world_size, asked):
    import sys

    return {m: m in sys.modules for m in asked}


@FORK_ONLY
def test_a_successor_forkserver_takes_over_with_more_imported():
    """Ranks of a cluster started before the hand-over import on first use; after
    it, new ranks come with the memory ledger and torch._dynamo already in. The
    ledger asks for itself (the runtime names no layer above it), and a module
    asked for after the forkserver started reaches ranks too."""
    import labkit.ledger
    from labkit.runtime.forkserver import PRELOAD_WHEN_IDLE, preload_when_idle

    asked = (*PRELOAD_WHEN_IDLE, "labkit.ledger", "wave")
    with labkit.Cluster(2) as c:
        preload_when_idle("wave")  # the forkserver runs already: a message
        first = forkserver().pid
        # idle after serving: the forkserver forks a successor that imports more
        assert forkserver().wait_preloaded(timeout=90)
        c.restart()
        got = c.run(_preloaded_here, asked).values
        assert got == [dict.fromkeys(asked, True)] * 2, f"imported on the ranks: {got}"
        parents = {int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
                   for p in c.pids.values()}
        assert parents == {forkserver().pid} != {first}, "forked by the successor"


# in a fresh interpreter: here, ranks of other tests' clusters (children of this
# process's forkserver) would keep a retired forkserver running, as they should
_RETIRE = """
import time, labkit
from labkit.runtime.forkserver import preload_when_idle, shared

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False

def gone_within(pids, seconds):
    end = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < end:
        time.sleep(0.02)
    return not any(map(alive, pids))

with labkit.Cluster(2) as c:
    first, old = shared().pid, list(c.pids.values())
    preload_when_idle("wave")  # asked for after the start: a successor imports it
    assert shared().wait_preloaded(timeout=90), "no hand-over within 90 s"
    assert shared().pid != first, "the successor forks from now on"
    time.sleep(0.5)
    assert alive(first), "retired while its ranks run: it must stay to reap them"
    c.restart()
    assert gone_within(old, 10.0), "the old ranks still run 10 s after a restart"
    assert gone_within([first], 10.0), (
        "the retired forkserver still runs 10 s after its last rank exited")
    c.run(lambda rank, world_size: rank)  # the kernel takes in its exit
    assert shared().pids == [shared().pid], f"forkservers left: {shared().pids}"
print("ok")
"""


def _passes_in_a_fresh_interpreter(code: str) -> None:
    """Run `code` in a new Python; it must exit 0 having printed "ok" last."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (
        f"exit {r.returncode}:\n{r.stderr[-3000:]}")


@FORK_ONLY
def test_a_forkserver_that_handed_over_exits_once_its_ranks_have():
    _passes_in_a_fresh_interpreter(_RETIRE)


# importing a layer above the runtime changes nothing in it: the runtime looks
# for PRELOAD_IN_RANKS among what was imported when it starts ranks
_IMPORT_ASKS_NOTHING = """
import labkit.ledger
from labkit.runtime import forkserver
assert forkserver.started() == [], f"a forkserver started: {forkserver.started()}"
assert forkserver._WANTED == list(forkserver.PRELOAD_WHEN_IDLE), forkserver._WANTED
assert forkserver.wanted() == (*forkserver.PRELOAD_WHEN_IDLE, "labkit.ledger"), (
    forkserver.wanted())
print("ok")
"""


def test_importing_the_ledger_starts_and_asks_nothing(monkeypatch):
    monkeypatch.setenv("LABKIT_PREWARM", "0")
    _passes_in_a_fresh_interpreter(_IMPORT_ASKS_NOTHING)


# in a notebook, what a cell imported that ranks should start with is passed on
# once the cell ends, before any cluster, so a successor imports it meanwhile
_CELL_PASSES_IT_ON = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("import labkit, torch", store_history=True).raise_error()
from labkit.runtime import forkserver
asked = forkserver.shared().asked
assert "labkit.ledger" not in asked, asked
shell.run_cell("from labkit import ledger", store_history=True).raise_error()
asked = forkserver.shared().asked
assert "labkit.ledger" in asked, f"after the ledger's cell the runtime asked {asked}"
print("ok")
"""


def test_in_a_notebook_a_cell_that_imports_the_ledger_has_it_preloaded(
        monkeypatch):
    monkeypatch.delenv("LABKIT_PREWARM", raising=False)
    _passes_in_a_fresh_interpreter(_CELL_PASSES_IT_ON)


# in a fresh interpreter, so that a successor forks: the answer to a start
# arrives while the kernel looks away (its wait timed out, as under load), and
# the successor's liveness check then reads it: the start must still return
_LOOKED_AWAY = """
import time, labkit
from labkit.runtime import forkserver
from labkit.runtime.forkserver import preload_when_idle, shared
from labkit.runtime.timeouts import Timeouts

with labkit.Cluster(2, timeouts=Timeouts(start=20)) as c:
    first = shared().pid
    preload_when_idle("wave")  # asked for after the start: a successor imports it
    assert shared().wait_preloaded(timeout=90), "no hand-over within 90 s"
    assert shared().pid != first, "no successor: this test needs one"
    real, calls = forkserver.select_one, []

    def late(sock, timeout):  # the first wait: nothing read, the answer sent
        calls.append(timeout)
        if len(calls) == 1:
            time.sleep(1.0)
            return [], [], []
        return real(sock, timeout)

    forkserver.select_one = late
    t = time.monotonic()
    c.restart()
    took = time.monotonic() - t
    assert len(calls) >= 1, "spawn did not wait through select_one"
    assert took < 10, f"the restart took {took:.1f} s: its answer was lost"
    assert c.run(lambda rank, world_size: rank).values == [0, 1]
print("ok")
"""


@FORK_ONLY
def test_a_start_whose_answer_the_liveness_check_read_returns():
    _passes_in_a_fresh_interpreter(_LOOKED_AWAY)


def test_an_optimizer_class_made_here_uses_the_ranks_hooks(cluster):
    """A notebook's Optimizer subclass, once instantiated in the kernel, has a
    `step` PyTorch wrapped with the kernel's hook registry; on the ranks it must
    call the ranks' hooks (the memory ledger files optimizer state by them)."""

    class MySGD(torch.optim.SGD):  # defined locally: travels by value, as in a cell
        pass

    MySGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # wraps MySGD.step here

    def step_fires_hooks(rank, world_size):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        seen = []
        handle = register_optimizer_step_pre_hook(lambda opt, a, k: seen.append(1))
        p = torch.zeros(1, requires_grad=True)
        opt = MySGD([p], lr=0.1)
        p.sum().backward()
        opt.step()
        handle.remove()
        return len(seen)

    assert cluster.run(step_fires_hooks).values == [1] * cluster.world_size


def test_the_status_thread_lets_go_of_the_frame_it_read():
    # a status request read the stack while `step` held a tensor; once `step`
    # returns, nothing of the status thread may keep that tensor alive
    import weakref

    from labkit.runtime import rank, wire
    from labkit.runtime.messages import Status, StatusRequest

    ours, theirs = socket.socketpair()
    server = threading.Thread(target=rank._serve_status,
                              args=(theirs, threading.get_ident()), daemon=True)
    server.start()
    refs = []

    def step():
        big = torch.ones(1000)
        refs.append(weakref.ref(big))
        wire.send(ours, StatusRequest())
        assert isinstance(wire.recv(ours), Status)  # read while `big` is alive

    step()
    try:
        assert refs[0]() is None
    finally:
        ours.close()
        server.join(timeout=5)


# ------------------------------------------- threads, bounded sends, bad values
# (issue 36: one locking contract for run/close/restart, a send that gives up,
# one Timeouts record, and errors that name the value that was wrong)


def _mark_then_sleep(rank, world_size, marker):
    import pathlib
    import time

    pathlib.Path(f"{marker}.{rank}").touch()  # the call runs on this rank now
    time.sleep(60)


def _in_thread(fn, *args, **kwargs):
    """Start fn(*args, **kwargs) in a thread: (the thread, a dict that gets
    'value' or 'error')."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def _wait_for(paths, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"never appeared: {paths}"
        time.sleep(0.01)


def test_close_from_another_thread_interrupts_the_call_and_says_so(tmp_path):
    marker = str(tmp_path / "running")
    with labkit.Cluster(2, timeout=None) as c:
        pids = list(c.pids.values())
        t, out = _in_thread(c.run, _mark_then_sleep, marker)
        _wait_for([f"{marker}.{r}" for r in range(2)])
        c.close()
        t.join(10)
        assert not t.is_alive(), "the call still runs 10 s after close()"
        err = out.get("error")
        assert isinstance(err, labkit.ClusterClosed), out
        assert "interrupted: cluster.close() was called from another thread" in \
            str(err)
        assert "the next run starts them again" not in str(err)  # it would not
        assert not wait_gone(pids, 2.0)
        with pytest.raises(labkit.ClusterClosed, match="is closed"):
            c.run(_rank_and_size)


def test_restart_from_another_thread_interrupts_the_call_and_keeps_its_ranks(
        tmp_path, monkeypatch):
    marker = str(tmp_path / "running")
    with labkit.Cluster(2, timeout=None) as c:
        old = c.pids
        restarted = threading.Event()
        how_ended = c._how_ended

        def after_the_restart(rank):  # the call saw a rank go: let restart() end
            restarted.wait(5)  # first, as it may (deterministic, not a race)
            return how_ended(rank)

        monkeypatch.setattr(c, "_how_ended", after_the_restart)
        t, out = _in_thread(c.run, _mark_then_sleep, marker)
        _wait_for([f"{marker}.{r}" for r in range(2)])
        c.restart()
        restarted.set()
        new = c.pids
        t.join(10)
        assert not t.is_alive(), "the call still runs 10 s after restart()"
        err = out.get("error")
        assert isinstance(err, labkit.runtime.CallInterrupted), out
        assert "cluster.restart() was called from another thread" in str(err)
        assert set(new.values()).isdisjoint(old.values())
        assert not wait_gone(old.values(), 2.0)
        assert all(alive(p) for p in new.values()), (
            "the interrupted call's cleanup killed the ranks restart() started")
        assert c.run(_rank_and_size).values == [(0, 2), (1, 2)]
        assert c.pids == new  # no second restart was needed


def test_two_threads_stopping_the_ranks_never_use_a_closed_pidfd(monkeypatch):
    """restart() in one thread is paused just before it signals a rank's pidfd;
    close() in another would close that descriptor meanwhile, and the signal
    then went to a closed (or reused: another process's) descriptor. Every
    descriptor signalled must still be the pidfd of one of this cluster's ranks."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfds here")
    real = signal.pidfd_send_signal
    paused, go_on = threading.Event(), threading.Event()
    seen = []  # (fd, the pid it was the pidfd of, or None)

    def pidfd_of(fd):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                pid = [ln.split()[1] for ln in f if ln.startswith("Pid:")]
        except OSError:
            return None
        return int(pid[0]) if pid else None

    def send_signal(fd, sig, *args):
        if threading.current_thread().name == "restarter" and not paused.is_set():
            paused.set()
            go_on.wait(1.0)  # until close() ran, or 1 s if it waits for us
        seen.append((fd, pidfd_of(fd)))
        return real(fd, sig, *args)

    with labkit.Cluster(2) as c:
        if not c._pidfds:
            pytest.skip("no pidfds here")
        started = set(c.pids.values())
        monkeypatch.setattr(signal, "pidfd_send_signal", send_signal)

        def restart():
            c.restart()
            return set(c.pids.values())  # the ranks it started

        restarter = threading.Thread(
            target=lambda: out.update(zip(("new", "error"), _returned(restart))),
            name="restarter", daemon=True)
        out = {}
        restarter.start()
        assert paused.wait(10)
        t, closed = _in_thread(c.close)
        t.join(0.5)
        go_on.set()
        restarter.join(30)
        t.join(30)
    assert "error" not in closed, closed
    assert out["error"] is None, f"restart() raised {out['error']!r}"
    assert [fd for fd, pid in seen if pid is None] == [], (
        f"a signal went to a descriptor that was no process's pidfd: {seen}")
    assert not wait_gone(started | out["new"], 2.0)


def _returned(fn):
    """(what fn() returned, None), or (None, what it raised)."""
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001
        return None, e


def test_default_cluster_is_made_once_when_two_threads_ask_at_once(monkeypatch):
    from labkit.runtime import cluster as cluster_module

    made = []
    both = threading.Barrier(2, timeout=0.5)

    class Slow:  # a Cluster that takes a while to start (no ranks here)
        _closed = False

        def __init__(self, world_size):
            made.append(self)
            try:
                both.wait()  # both threads in here at once, unless one waits
            except threading.BrokenBarrierError:
                pass

    monkeypatch.setattr(cluster_module, "Cluster", Slow)
    monkeypatch.setattr(cluster_module, "_DEFAULT_CLUSTERS", {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(
        cluster_module.default_cluster(3))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(made) == 1 and got[0] is got[1], f"{len(made)} clusters made"


def _size_of(rank, world_size, t):
    return t.numel()


def test_a_rank_that_does_not_read_its_call_fails_the_send_in_bounded_time():
    """A large argument to a rank that is alive but not reading (here: stopped)
    blocked the kernel forever, outside `timeout`."""
    big = torch.zeros(4 << 20)  # 16 MiB: far more than a socket buffer holds
    with labkit.Cluster(2) as c:
        victim = c.pids[1]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        t, out = _in_thread(c.run, _size_of, big, timeout=1)
        t.join(15)
        assert not t.is_alive(), "sending the call still blocks after 15 s"
        assert time.monotonic() - t0 < 6
        err = out.get("error")
        assert isinstance(err, RankError) and isinstance(err, TimeoutError), out
        assert "rank 1 did not take the call within 1 s (the call's timeout)" in \
            str(err)
        assert "alive but not reading" in str(err)
        assert not wait_gone([victim], 2.0)  # stopped like after any fault
        assert c.run(_size_of, big).values == [big.numel()] * 2
        # with no call timeout, Timeouts.send bounds it
        c.timeouts = labkit.runtime.Timeouts(send=0.5)
        os.kill(c.pids[0], signal.SIGSTOP)
        with pytest.raises(labkit.runtime.SendTimeout,
                           match=r"rank 0 .* within 0.5 s \(Timeouts.send\)"):
            c.run(_size_of, big, timeout=None)
        assert c.run(_rank_and_size).values == [(0, 2), (1, 2)]


def test_send_bytes_by_gives_up_at_its_deadline_and_wakes_on_request():
    from labkit.runtime import wire

    ours, theirs = socket.socketpair()  # `theirs` never reads
    r, w = os.pipe()
    try:
        t0 = time.monotonic()
        with pytest.raises(wire.Stalled) as ei:
            wire.send_bytes_by(ours, bytes(8 << 20), time.monotonic() + 0.3)
        assert 0.3 <= time.monotonic() - t0 < 2
        assert 0 < ei.value.sent < ei.value.total == 8 + (8 << 20)

        class Woken(Exception):
            pass

        def woken():
            raise Woken

        threading.Timer(0.1, os.write, (w, b"!")).start()
        with pytest.raises(Woken):
            wire.send_bytes_by(ours, bytes(8 << 20), time.monotonic() + 10, r,
                               woken)
    finally:
        for s in (ours, theirs):
            s.close()
        os.close(r)
        os.close(w)


def _fails_or_sleeps(rank, world_size):
    import time

    if rank == 1:
        raise ValueError("rank 1 fails at once")
    time.sleep(1.0)
    return rank


def test_the_timeouts_record_is_what_the_cluster_waits_by():
    from labkit.runtime import Timeouts

    with labkit.Cluster(2, timeouts=Timeouts(grace=5.0)) as c:
        assert c.timeouts.grace == 5.0 and c.timeouts.send == Timeouts().send
        with pytest.raises(RankError) as ei:  # rank 0 may finish in the grace
            c.run(_fails_or_sleeps)
        assert ei.value.finished == [0]
        c.timeouts = Timeouts(grace=0.1)  # and then it may not
        with pytest.raises(RankError) as ei:
            c.run(_fails_or_sleeps)
        assert ei.value.finished == [] and 0 in ei.value.busy
        with pytest.raises(TypeError, match="timeouts must be a labkit.runtime"):
            c.timeouts = {"grace": 1}


@pytest.mark.parametrize("field, value", [("send", float("inf")), ("grace", 0),
                                          ("start", float("nan")), ("stop", -1),
                                          ("poll", "fast"), ("collective", 10**400)])
def test_bad_timeouts_fields_name_the_field(field, value):
    from labkit.runtime import Timeouts

    with pytest.raises((TypeError, ValueError),
                       match=rf"Timeouts\.{field} must be a number > 0 seconds, "
                             r"at most 31536000 \(a year\); got"):
        Timeouts(**{field: value})


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"timeout": float("inf")}, ValueError,
     r"^timeout must be a number > 0 seconds, at most 31536000 \(a year\), or None "
     r"for no limit; got inf$"),
    ({"timeout": float("nan")}, ValueError, r"^timeout must be .*; got nan$"),
    ({"timeout": 1e300}, ValueError, r"^timeout must be .*; got 1e\+300$"),
    ({"idle_timeout": float("inf")}, ValueError,
     r"^idle_timeout must be a number > 0 seconds, at most 31536000 \(a year\), or "
     r"None for never; got inf$"),
    ({"idle_timeout": -5}, ValueError, r"^idle_timeout must be .*; got -5$"),
    ({"idle_timeout": "soon"}, TypeError, r"^idle_timeout must be .*; got 'soon'$"),
    ({"threads": 10**400}, ValueError,
     r"^threads must be an integer in \[1, 1024\], got an integer of 1329 bits$"),
    ({"timeouts": "fast"}, TypeError, r"^timeouts must be a labkit.runtime.Timeouts"),
])
def test_bad_numbers_for_a_cluster_name_the_argument(kwargs, exc, pattern):
    t0 = time.monotonic()
    with pytest.raises(exc, match=pattern):
        labkit.Cluster(2, **kwargs)
    assert time.monotonic() - t0 < 1, "refused only after starting the ranks"


@pytest.mark.parametrize("value", ["-5", "abc", "inf", "nan", "1e400"])
def test_a_bad_labkit_idle_timeout_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("LABKIT_IDLE_TIMEOUT", value)
    with pytest.raises(ValueError,
                       match=r"^\$LABKIT_IDLE_TIMEOUT must be a number > 0 seconds, "
                             r"at most 31536000 \(a year\), or 0 or unset for "
                             rf"never; got '{value}'$"):
        labkit.Cluster(2)


def test_idle_timeout_and_run_timeout_set_later_are_checked_too(cluster):
    for bad in (float("inf"), float("nan"), 0):
        with pytest.raises(ValueError, match="^idle_timeout must be"):
            cluster.idle_timeout = bad
        with pytest.raises(ValueError, match="^timeout must be"):
            cluster.run(_rank_and_size, timeout=bad)
    assert cluster.idle_timeout is None
    assert cluster.run(_rank_and_size, timeout=1e6).values[0] == (0, 4)
