"""The live view of a call, through a real Jupyter kernel: lines arrive while the
call runs, stay in their own cell, and leave the plain transcript behind."""

import os
import threading
import time

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

import labkit
from tests.conftest import wait_gone

SETUP = """
import time, labkit, torch, torch.distributed as dist
c = labkit.Cluster(2)
def chatty(rank, world_size, first=0.2, last=2.0, tag="a"):
    time.sleep(first)
    print(f"{tag} first line")
    time.sleep(last - first)
    print(f"{tag} last line")
    return rank
"""


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _run(kc, SETUP, live=False)
        kc.km = km
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kc, code: str, live: bool = True, timeout: float = 120):
    """Execute `code` as JupyterLab would (it sends the cell's id; nbclient sends
    nothing); [(seconds since sent, msg_type, content)] of the cell's iopub."""
    meta = {"cellId": "test-cell", "deletedCells": [], "recordTiming": False}
    msg = kc.session.msg("execute_request",
                         {"code": code, "silent": False, "store_history": True,
                          "user_expressions": {}, "allow_stdin": False,
                          "stop_on_error": True}, metadata=meta if live else {})
    kc.shell_channel.send(msg)
    t0, got = time.monotonic(), []
    while True:
        m = kc.get_iopub_msg(timeout=timeout)
        if m["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            got.append((None, m["msg_type"], m["content"], "other cell"))
            continue
        if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return [g for g in got if g[3] != "other cell"], got
        got.append((time.monotonic() - t0, m["msg_type"], m["content"], "this"))


def _shown(msgs):
    """(time, text) of what the live view showed, in order."""
    return [(t, c["data"]["text/plain"]) for t, k, c, _ in msgs
            if k in ("display_data", "update_display_data")]


def test_lines_arrive_before_the_call_ends_then_the_transcript(kernel):
    msgs, _ = _run(kernel, "r = c.run(chatty)")
    shown = _shown(msgs)
    first = [t for t, text in shown if "[rank 1] a first line" in text]
    final = shown[-1]
    # seen while the call still slept (1.8 s between the two prints): order, not speed
    assert first and first[0] < final[0] - 1.0, shown
    assert final[0] >= 2.0
    assert final[1] == ("[rank 0] a first line\n[rank 0] a last line\n"
                        "[rank 1] a first line\n[rank 1] a last line")
    assert not [m for m in msgs if m[1] == "stream"]  # nothing printed twice


def test_consecutive_cells_never_mix(kernel):
    one, _ = _run(kernel, "c.run(chatty, 0.1, 0.6, tag='one')")
    two, everything = _run(kernel, "c.run(chatty, 0.1, 0.6, tag='two')")
    assert all("two" not in str(c) for _, _, c, _ in one)
    assert all("one" not in str(c) for _, _, c, _ in two)
    assert not [m for m in everything if m[3] == "other cell"
                and m[1] in ("display_data", "update_display_data", "stream")]


def test_status_lines_show_a_stuck_rank_then_vanish(kernel):
    code = """
def stuck(rank, world_size):
    if rank == 0:
        x = torch.ones(1 << 18)
        dist.all_reduce(x)
try:
    c.run(stuck, timeout=4)
except labkit.CollectiveTimeout as e:
    print("timed out")
"""
    msgs, _ = _run(kernel, code)
    updates = _shown(msgs)
    status = [(t, s) for t, s in updates if s.startswith("rank 0: in all_reduce")]
    assert status, updates
    t, line = status[0]
    assert t < updates[-1][0] - 1.0  # well before the timeout ended the call
    assert "all_reduce of 1.0 MiB (group of 2)" in line
    assert "of your cell: dist.all_reduce(x)" in line
    left = _outputs_left(msgs)  # gone when the call ended: only the print is left
    assert [v for _, v in left] == ["timed out\n"], left


def test_progress_bars_are_drawn_and_the_finished_ones_stay(kernel):
    code = """
def loop(rank, world_size):
    for _ in labkit.progress(range(10), desc="steps"):
        time.sleep(0.05)
c.run(loop)
"""
    msgs, _ = _run(kernel, code)
    updates = _shown(msgs)
    assert any("steps |" in s and "10/10" not in s for _, s in updates[:-1])
    final = updates[-1][1].splitlines()
    assert [ln.split("|")[0] for ln in final] == ["[rank 0] steps ", "[rank 1] steps "]
    assert all("|" + "#" * 20 + "| 10/10" in ln for ln in final)


def test_without_a_live_frontend_only_the_transcript_is_written(kernel):
    code = """
def quiet_loop(rank, world_size):
    for _ in labkit.progress(range(3)):
        pass
c.run(chatty, 0.05, 2.5)
_ = c.run(quiet_loop)
"""
    msgs, _ = _run(kernel, code, live=False)
    assert {k for _, k, _, _ in msgs} <= {"status", "execute_input", "stream"}
    stream = "".join(c["text"] for _, k, c, _ in msgs if k == "stream")
    assert stream == ("[rank 0] a first line\n[rank 0] a last line\n"
                      "[rank 1] a first line\n[rank 1] a last line\n")


def test_nbval_style_execution_keeps_the_transcript_only():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(SETUP + "_ = c.run(chatty, 0.05, 0.3)")])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outs = nb.cells[0].outputs
    assert [o["output_type"] for o in outs] == ["stream"]
    assert outs[0]["text"] == ("[rank 0] a first line\n[rank 0] a last line\n"
                               "[rank 1] a first line\n[rank 1] a last line\n")


def test_a_call_from_a_thread_stays_in_the_cell_that_started_it(kernel):
    start, _ = _run(kernel, """
import threading
t = threading.Thread(target=lambda: c.run(chatty, 0.1, 1.5, tag="thread"))
t.start()
""")
    later, everything = _run(kernel, "time.sleep(0.6); c.run(chatty, 0.05, 0.3, "
                                     "tag='later'); t.join()")
    assert "thread" not in str([c for _, _, c, _ in later if "data" in c])
    # the thread's view went to the first cell (seen there, or while the later
    # cell ran, as messages whose parent is the first cell)
    elsewhere = [c for _, k, c, w in everything if w == "other cell"] + \
        [c for _, _, c, _ in start]
    assert "[rank 1] thread last line" in str(elsewhere)


def test_interrupting_a_watched_call_stops_the_ranks_and_keeps_its_lines(kernel):
    code = """
def forever(rank, world_size):
    print("started", flush=True)
    while True:
        time.sleep(0.05)
pids = list(c.pids.values())
print(pids)
c.run(forever, timeout=None)
"""
    threading.Timer(1.5, kernel.km.interrupt_kernel).start()
    msgs, _ = _run(kernel, code)
    pids = eval([c["text"] for _, k, c, _ in msgs if k == "stream"][0])
    errors = [c for _, k, c, _ in msgs if k == "error"]
    assert errors and errors[0]["ename"] == "KeyboardInterrupt"
    assert not wait_gone(pids, 2.0)
    assert _shown(msgs)[-1][1] == "[rank 0] started\n[rank 1] started"


class Sink:
    """A frontend that keeps every picture it is sent."""

    def __init__(self):
        self.frames = []

    def __call__(self, bundle, final=False):  # bundle None: nothing left to show
        self.frames.append((None if bundle is None else bundle["text/plain"], final))


@pytest.fixture()
def watched():
    return Sink()  # the live view's frontend: Cluster.run(..., publish=watched)


def test_ten_thousand_lines_all_arrive_in_order(watched):
    def many(rank, world_size):
        for i in range(10_000):
            print(f"line {i}")

    with labkit.Cluster(2) as c:
        res = c.run(many, publish=watched)
    for r in (0, 1):
        assert res.outputs[r] == "".join(f"line {i}\n" for i in range(10_000))
    final, is_final = watched.frames[-1]
    assert is_final and final.count("\n") == 20_000 - 1
    assert final.splitlines()[10_000] == "[rank 1] line 0"


def test_a_rank_that_dies_mid_print_keeps_its_last_lines(watched):
    def die(rank, world_size):
        print("before the end", flush=True)
        if rank == 1:
            os._exit(3)
        time.sleep(5)

    with labkit.Cluster(2, timeout=20) as c:
        with pytest.raises(labkit.RankError, match="rank 1 exited with code 3"):
            c.run(die, publish=watched)
    final, is_final = watched.frames[-1]
    assert is_final and "[rank 1] before the end" in final


def test_a_frontend_that_fails_never_breaks_the_call(capsys):
    def broken(bundle, final=False):
        raise RuntimeError("the frontend went away")

    def hello(rank, world_size):
        print("still here")
        return rank

    with labkit.Cluster(2) as c:
        assert c.run(hello, publish=broken).values == [0, 1]
    assert capsys.readouterr().out == "[rank 0] still here\n[rank 1] still here\n"


def _outputs_left(msgs):
    """The outputs a frontend keeps after applying the cell's iopub messages."""
    outs = []
    for _, kind, content, _ in msgs:
        did = (content.get("transient") or {}).get("display_id")
        if kind == "clear_output":
            outs = []
        elif kind in ("stream", "display_data", "execute_result", "error"):
            outs.append((did, content.get("data") or content.get("text")))
        elif kind == "update_display_data":
            outs = [(d, content["data"] if d == did else v) for d, v in outs]
    return outs


STRAGGLER = """\
c8 = labkit.Cluster(8)
def straggle(rank, world_size):
    import torch.distributed.tensor  # imported on the ranks, inside the call
    if rank == 3:
        time.sleep(6)
    x = torch.ones(4)
    dist.all_reduce(x)
c8.run(straggle)
c8.close()
"""


def test_status_lines_name_the_cells_line_and_nothing_empty_is_left(kernel):
    line = {text.strip(): n for n, text in enumerate(STRAGGLER.split("\n"), 1)}
    msgs, _ = _run(kernel, STRAGGLER, timeout=180)
    statuses = [s for _, text in _shown(msgs) for s in text.splitlines()
                if s.startswith("rank ")]
    waiting = [s for s in statuses if "in all_reduce of 16 B (group of 8)" in s]
    # the seven ranks that wait name the collective and the cell's own line ...
    assert {s.split(":")[0] for s in waiting} == {f"rank {r}" for r in
                                                  (0, 1, 2, 4, 5, 6, 7)}, statuses
    want = f"line {line['dist.all_reduce(x)']} of your cell: dist.all_reduce(x)"
    assert all(want in s for s in waiting), statuses
    # ... the straggler its own line; never Python's machinery or labkit's files
    sleeping = f"rank 3: line {line['time.sleep(6)']} of your cell: time.sleep(6)"
    assert any(s.startswith(sleeping) for s in statuses), statuses
    for bad in ("<frozen", "inspect.py", "<string>", "<dynamic-code>", "rank.py",
                "wire.py", "call.py"):
        assert not [s for s in statuses if bad in s], (bad, statuses)
    # the call printed nothing: the view is taken away, no empty output is left
    assert _outputs_left(msgs) == [], _outputs_left(msgs)


def test_a_quick_silent_call_draws_nothing(kernel):
    msgs, _ = _run(kernel, "c.run(lambda rank, world_size: rank)\nNone")
    assert [m for m in msgs if m[1] in ("display_data", "update_display_data",
                                        "clear_output")] == []
