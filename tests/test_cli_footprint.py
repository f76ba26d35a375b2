"""`python -m labkit footprint` and doctor's class size: this process and a small
tree measured, the arithmetic without processes; a cluster's idle timeout and one
small measured run with real ranks (marked `ranks` by conftest)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from labkit.cli import class_size as cs
from labkit.cli import footprint as fp
from labkit.cli import footprint_proc as pr
from tests.conftest import descendants_of, wait_gone

MIB = 2**20


def _listening(family, host):
    s = socket.socket(family)
    s.bind((host, 0))
    s.listen()
    return s


def test_this_process_is_measured_in_bytes_seconds_threads_and_sockets():
    end = time.process_time() + 0.1
    while time.process_time() < end:  # CPU seconds to see
        pass
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_listening(socket.AF_INET, "127.0.0.1"))
        try:
            server6 = stack.enter_context(_listening(socket.AF_INET6, "::1"))
        except OSError:  # no IPv6 loopback here
            server6 = None
        stack.enter_context(socket.create_connection(server.getsockname()))
        stack.enter_context(server.accept()[0])
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)
        worker.start()
        stack.callback(worker.join)
        stack.callback(stop.set)
        me = pr.measure(os.getpid(), "me")
        assert me.pid == os.getpid() and me.role == "me"
        assert 0 < me.uss <= me.rss and 0 < me.pss <= me.rss, me
        assert 0 <= me.pss_file <= me.pss and 0 < me.rss_file <= me.rss, me
        assert me.threads >= 2 and me.cpu_s >= 0.05, me
        assert "127.0.0.1:%d" % server.getsockname()[1] in me.listening, me
        if server6 is not None:
            assert "[::1]:%d" % server6.getsockname()[1] in me.listening, me
        assert me.connections >= 2, me  # both ends of the one connection are ours


def test_loopback_is_told_apart():
    assert [pr.is_loopback(a) for a in ("127.0.0.1:8080", "0.0.0.0:22", "[::1]:80",
                                        "[::ffff:127.0.0.1]:81", "[::ffff:7f00:1]:81",
                                        "[::]:80", "10.0.0.5:80")] == \
        [True, False, True, True, True, False, False]


def test_the_tree_names_each_process_by_its_parents_role():
    # a shell with a child of its own: the shell named, its child after it
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        end = time.monotonic() + 10
        while not descendants_of(sh.pid) and time.monotonic() < end:
            time.sleep(0.02)
        (sleep,) = descendants_of(sh.pid)
        procs = pr.measure_tree(os.getpid(), {sh.pid: "shell"})
        pids = [p.pid for p in procs]
        roles = {p.pid: p.role for p in procs}
        assert pids[0] == os.getpid() and pids.index(sh.pid) < pids.index(sleep)
        assert roles[sh.pid] == "shell" and roles[sleep] == "child of shell"
        # a pid `roles` names that has gone is left out, as is one measured gone
        gone = subprocess.Popen(["true"])
        gone.wait()
        assert [p.pid for p in pr.measure_tree(sh.pid, {gone.pid: "x"})] == \
            [sh.pid, sleep]
        assert pr.measure(gone.pid, "x") is None
    finally:
        os.killpg(sh.pid, signal.SIGKILL)  # the shell and its sleep
        sh.wait()


def _proc(role, pss, pss_file=0, rss_file=0, listening=()):
    return {"role": role, "pid": 1, "rss": pss, "pss": pss, "pss_file": pss_file,
            "rss_file": rss_file, "uss": pss, "threads": 1, "cpu_s": 0.0,
            "listening": list(listening), "connections": 0}


STAGES = [
    {"stage": "4-rank cluster idle for 5 s", "wall_s": 5.0, "cpu_s": 0.1,
     "procs": [_proc("kernel", 200 * MIB, 20 * MIB, 90 * MIB, ["127.0.0.1:5"]),
               *[_proc(f"rank {r} of 4", 50 * MIB, 5 * MIB) for r in range(4)]]},
    {"stage": "after ch05's data-parallel step", "wall_s": 2.0, "cpu_s": 3.0,
     "procs": [_proc("kernel", 200 * MIB, 20 * MIB),
               *[_proc(f"rank {r} of 4", 100 * MIB, 5 * MIB) for r in range(4)]]},
    {"stage": "left idle 3 s", "wall_s": 4.0, "cpu_s": 0.0,
     "procs": [_proc("kernel", 200 * MIB, 20 * MIB, listening=["0.0.0.0:9"])]},
    {"stage": "ch14: 8-rank cluster after a 3D step", "wall_s": 4.0, "cpu_s": 4.0,
     "procs": [_proc("kernel", 200 * MIB, 20 * MIB),
               *[_proc(f"rank {r} of 8", 60 * MIB, 5 * MIB) for r in range(8)]]},
]


def test_summary_counts_anonymous_pss_per_student_and_library_files_once():
    fig = fp.summary(STAGES)
    assert fig["per_student_bytes"] == 180 * MIB + 8 * 55 * MIB  # 8 ranks: heaviest
    assert fig["per_student_4_ranks_bytes"] == 180 * MIB + 4 * 95 * MIB
    assert fig["idle_stopped_bytes"] == 180 * MIB
    assert fig["shared_files_bytes"] == 90 * MIB
    assert fig["busy_cores"] == 1.5 and fig["idle_cores"] == 0.02
    assert fp.not_loopback(STAGES) == ["kernel: 0.0.0.0:9"]


def test_class_size_is_memory_less_the_libraries_over_the_per_student_figure():
    fig = {"per_student_bytes": 800 * MIB, "idle_stopped_bytes": 400 * MIB,
           "shared_files_bytes": 100 * MIB}
    # 64 GiB: (65536 - 100) MiB // 800 MiB = 81; // 400 MiB = 163; 16 cores // 4
    assert cs.class_size(64 * 2**30, 16, fig) == {
        "by_memory": 81, "idle_stopped": 163, "running_at_once": 4}
    assert cs.class_size(50 * MIB, 2, fig) == {
        "by_memory": 0, "idle_stopped": 0, "running_at_once": 0}
    lines = cs.class_lines(64 * 2**30, 16, fig, "a test")
    assert lines[0].startswith("81 students") and lines[-1] == "figures: a test"
    mem = cs.meminfo()  # this machine's, in bytes
    assert mem["MemTotal"] >= mem["MemAvailable"] > 0
    assert mem["MemTotal"] == psutil.virtual_memory().total


def test_doctor_prefers_this_machines_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fig, source = cs.load_figures()
    assert fig is cs.RECORDED and "recorded with labkit" in source
    saved = cs.saved_path()
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps({"summary": {"per_student_bytes": 1}, "stages": []}))
    assert cs.load_figures() == ({"per_student_bytes": 1}, str(saved))


def test_idle_timeout_gives_the_ranks_back_and_the_next_run_restarts_them(
        monkeypatch, capsys):
    import labkit

    monkeypatch.setenv("LABKIT_IDLE_TIMEOUT", "0.5")  # a server-wide setting
    with labkit.Cluster(2) as c:
        assert c.idle_timeout == 0.5
        # a call longer than the timeout is not cut short: the timer starts after it
        assert c.run(lambda r, n: time.sleep(1.0) or r).values == [0, 1]
        pids = list(c.pids.values())
        end = time.monotonic() + 10
        while c.running and time.monotonic() < end:
            time.sleep(0.05)
        assert not c.running, "ranks still running 10 s after a 0.5 s idle timeout"
        assert not wait_gone(pids, 5.0)
        assert c.run(lambda r, n: r + n).values == [2, 3]  # started again
        assert "stopped after 0.5 s idle" in capsys.readouterr().err
    monkeypatch.delenv("LABKIT_IDLE_TIMEOUT")
    with labkit.Cluster(2, idle_timeout=None) as c:
        assert c.idle_timeout is None
        with pytest.raises(ValueError, match="> 0 seconds"):
            c.idle_timeout = -1
        c.idle_timeout = 0.5  # on a running cluster: from the end of its next call
        pids = list(c.pids.values())
        c.run(lambda r, n: r)
        assert not wait_gone(pids, 10.0), (
            "ranks still running 10 s after idle_timeout = 0.5 was set and a call ran")


def test_a_measured_kernel_holds_its_ranks_on_loopback_only():
    stages = [("2-rank cluster, a step", "c = labkit.Cluster(2); c.run(_fp.noop)",
               "c")]
    (s,) = fp.measure_stages(stages, timeout=180)
    roles = sorted(p["role"] for p in s["procs"])
    assert {"kernel", "forkserver", "rank 0 of 2", "rank 1 of 2"} <= set(roles)
    for p in s["procs"]:
        assert p["pss"] > 0 and p["threads"] >= 1, p
    ranks = [p for p in s["procs"] if p["role"].startswith("rank")]
    assert all(p["listening"] for p in ranks), "gloo listens on each rank"
    assert fp.not_loopback([s]) == []
    print(fp.stage_table(s))
