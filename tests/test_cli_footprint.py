"""`python -m labkit footprint` and doctor's class size: /proc parsing and the
arithmetic without processes; a cluster's idle timeout and one small measured
run with real ranks (marked `ranks` by conftest)."""

import json
import os
import time

import pytest

from labkit.cli import class_size as cs
from labkit.cli import footprint as fp
from labkit.cli import footprint_proc as pr
from tests.conftest import wait_gone

MIB = 2**20

ROLLUP = """55a2e0c2d000-7fffba261000 ---p 00000000 00:00 0   [rollup]
Rss:                1600 kB
Pss:                 412 kB
Pss_Anon:            112 kB
Pss_File:            300 kB
Pss_Shmem:             0 kB
Shared_Clean:       1444 kB
Private_Clean:        44 kB
Private_Dirty:       112 kB
Anonymous:           112 kB
"""



def _table(*rows):
    """/proc/net/tcp's layout: a header, then sl local remote st ... inode."""
    return "  sl  local_address rem_address   st ... uid  timeout inode\n" + "".join(
        f"   {i}: {local} {remote} {st} 00000000:00000000 00:00000000 00000000  "
        f"1000        0 {inode} 1\n" for i, (local, remote, st, inode) in
        enumerate(rows))


TCP = _table(("0100007F:1F90", "00000000:0000", "0A", 111),
             ("00000000:0016", "00000000:0000", "0A", 222),
             ("0100007F:1F90", "0100007F:D431", "01", 333))
ANY6 = "0" * 32 + ":0000"
TCP6 = _table(("00000000000000000000000001000000:0050", ANY6, "0A", 444),
              ("0000000000000000FFFF00000100007F:0051", ANY6, "0A", 555))


def test_smaps_rollup_threads_and_stat_are_read_in_bytes_and_seconds():
    got = pr.parse_smaps_rollup(ROLLUP)
    assert got == {"Rss": 1600 * 1024, "Pss": 412 * 1024, "Pss_File": 300 * 1024,
                   "Rss_File": (1600 - 112) * 1024, "USS": (44 + 112) * 1024}
    # an older Linux without Pss_File: every page counts as the student's own
    assert pr.parse_smaps_rollup("Rss: 8 kB\nPss: 4 kB\n")["Pss_File"] == 0
    assert pr.parse_threads("Name:\tpython\nThreads:\t17\n") == 17
    with pytest.raises(ValueError):
        pr.parse_threads("Name:\tpython\n")
    ticks = os.sysconf("SC_CLK_TCK")
    stat = ("42 (a (strange) name) S 7 42 42 0 -1 0 0 0 0 0 "
            f"{3 * ticks} {ticks} 0 0 20 0 1")
    assert pr.parse_stat(stat) == (7, 4.0)


def test_tcp_tables_map_inodes_to_addresses_and_loopback_is_told_apart():
    v4, v6 = pr.parse_net_tcp(TCP), pr.parse_net_tcp(TCP6)
    assert v4 == {111: ("127.0.0.1:8080", pr.LISTEN), 222: ("0.0.0.0:22", pr.LISTEN),
                  333: ("127.0.0.1:8080", pr.ESTABLISHED)}
    assert v6 == {444: ("[::1]:80", pr.LISTEN), 555: ("[::ffff:7f00:1]:81", "0A")}
    assert [pr.is_loopback(a) for a, _ in [*v4.values(), *v6.values()]] == \
        [True, False, True, True, True]
    assert not pr.is_loopback("[::]:80") and not pr.is_loopback("10.0.0.5:80")
    assert pr.socket_inodes(["pipe:[9]", "socket:[111]", "/dev/null",
                             "socket:[444]"]) == {111, 444}


def test_the_tree_lists_parents_before_children():
    parent_of = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 30: 2}
    assert pr.tree(10, parent_of) == [10, 11, 12, 13]


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
    {"stage": "ch13: 8-rank cluster after a 3D step", "wall_s": 4.0, "cpu_s": 4.0,
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
    assert cs.meminfo("MemTotal:  2048 kB\nMemAvailable: 1024 kB\nHuge: 0\n") == \
        {"MemTotal": 2 * MIB, "MemAvailable": MIB}


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
