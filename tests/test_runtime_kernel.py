"""Ranks never outlive the Jupyter kernel that started them, and %%ranks works."""

import json
import signal

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from tests.conftest import wait_gone

START = """
import json, labkit
from labkit.runtime.forkserver import shared
c = labkit.Cluster(2)
print(json.dumps(list(c.pids.values()) + shared().pids))  # every forkserver too
"""


def _pids_from(outputs) -> list[int]:
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def test_kernel_shutdown_through_nbclient_leaves_no_process():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(START)])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    pids = _pids_from(nb.cells[0].outputs)
    assert len(pids) >= 3  # 2 ranks, the forkserver (and a successor, if it came)
    assert not wait_gone(pids, 5.0)


def test_killed_kernel_leaves_no_process():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        outputs = []
        reply = kc.execute_interactive(
            START, timeout=120, output_hook=lambda m: outputs.append(m["content"])
        )
        assert reply["content"]["status"] == "ok"
        pids = _pids_from(outputs)
        km.signal_kernel(signal.SIGKILL)  # no atexit, no cleanup: only the lifeline
        assert not wait_gone(pids, 5.0)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture()
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "labkit")
    yield ip


def test_ranks_magic_runs_the_cell_on_every_rank(shell, capsys):
    shell.run_cell_magic("ranks", "-n 2", "x = torch.ones(2) * (rank + 1)\n"
                                          "dist.all_reduce(x)\n")
    shell.run_cell_magic("ranks", "-n 2", "print(rank, world_size, x.tolist())\n")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] 0 2 [3.0, 3.0]",
        "[rank 1] 1 2 [3.0, 3.0]",
    ]


def test_ranks_magic_errors_show_the_cell_line(shell):
    import labkit

    with pytest.raises(labkit.RankError) as ei:
        shell.run_cell_magic("ranks", "-n 2 -t 10",
                             "y = 1\nraise OSError('cell says no')\n")
    assert "raise OSError('cell says no')" in ei.value.failures[0]
    from IPython.core.error import UsageError

    # IPython shows a UsageError as its one line, without a traceback
    with pytest.raises(UsageError, match=r"^usage: %%ranks \[-n WORLD_SIZE\] .*, "
                                         r"got '--bogus' \(unrecognized arguments"):
        shell.run_cell_magic("ranks", "--bogus", "pass\n")
    with pytest.raises(UsageError, match="invalid int value: 'four'"):
        shell.run_cell_magic("ranks", "-n four", "pass\n")


def test_ranks_magic_on_a_named_cluster(shell, capsys):
    import labkit

    with labkit.Cluster(3) as c:
        shell.user_ns["mine"] = c
        shell.run_cell_magic("ranks", "-c mine", "print(world_size)\n")
        lines = capsys.readouterr().out.splitlines()
        assert lines == [f"[rank {r}] 3" for r in range(3)]
    with pytest.raises(ValueError, match="no labkit.Cluster named 'nothing'"):
        shell.run_cell_magic("ranks", "-c nothing", "pass\n")


def test_interrupting_the_kernel_stops_the_ranks_and_keeps_the_cluster():
    import time

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        outputs = []
        hook = lambda m: outputs.append(m["content"])
        kc.execute_interactive(START, timeout=120, output_hook=hook)
        pids = _pids_from(outputs)[:2]
        # stop_on_error=False: else ipykernel aborts a request that reaches it
        # while it still handles this cell's KeyboardInterrupt (status
        # "aborted", its code never run: seen once on 2 busy cores); what is
        # tested here is that the cluster is usable after, not the kernel's queue
        msg_id = kc.execute("import time\nc.run(lambda r, w: time.sleep(60))",
                            stop_on_error=False)
        time.sleep(1.5)  # the ranks are sleeping now
        t0 = time.monotonic()
        km.interrupt_kernel()  # what the notebook's stop button does
        reply = kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert not wait_gone(pids, 2.0 - (time.monotonic() - t0) + 0.5)
        again = kc.execute_interactive("print(c.run(lambda r, w: r).values)",
                                       timeout=60, output_hook=hook)
        assert again["content"]["status"] == "ok"
        assert any("[0, 1]" in o.get("text", "") for o in outputs)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
