"""Status lines in the student's terms: their own line, the collective, or what
the rank does before any of their code runs; never Python's machinery."""

import linecache
import os

import labkit
from labkit.runtime.messages import Status
from labkit.runtime.status import describe_busy, describe_live, is_users

CELL = "/tmp/ipykernel_77/123.py"
LABKIT = os.path.dirname(labkit.__file__)
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
STDLIB = os.path.dirname(os.__file__)


def setup_module():
    lines = ["def step(rank, world_size):\n", "    import torch.distributed.tensor\n",
             "    loss = pipe.step(x)  # the pipeline\n", "    dist.all_reduce(x)\n"]
    linecache.cache[CELL] = (sum(map(len, lines)), None, lines, CELL)


def test_whose_code_is_whose():
    assert is_users(CELL) and is_users("<ipython-input-3-abc>")
    assert is_users("/home/me/my_workers.py")
    for machinery in ("<frozen importlib._bootstrap>", "<string>", "<dynamic-code>",
                      os.path.join(STDLIB, "inspect.py"), TORCH,
                      os.path.join(LABKIT, "parallel", "pipeline_parallel.py"),
                      os.path.join(LABKIT, "runtime", "wire.py")):
        assert not is_users(machinery), machinery


def test_inside_labkit_the_line_is_the_students():
    stack = ((CELL, 3, "step"),
             (os.path.join(LABKIT, "parallel", "pipeline_parallel.py"), 226, "step"),
             (os.path.join(LABKIT, "ledger", "traffic_ledger.py"), 155, "wait"))
    line = describe_live(Status(5, None, stack, 3.2))
    assert line == "in step (labkit), line 3 of your cell: loss = pipe.step(x), 3.2 s"


def test_in_a_collective_its_size_and_the_students_line():
    stack = ((CELL, 4, "step"), (TORCH, 2800, "all_reduce"))
    line = describe_live(Status(5, "all_reduce of 1.0 MiB (group of 4)", stack, 2.0))
    assert line == ("in all_reduce of 1.0 MiB (group of 4), line 4 of your cell: "
                    "dist.all_reduce(x), 2.0 s")
    busy = describe_busy(Status(5, "all_reduce of 1.0 MiB (group of 4)", stack, 2.0))
    assert busy.startswith("in all_reduce of 1.0 MiB (group of 4) (torch.distributed)"
                           f', called at File "{CELL}", line 4, in step')


def test_an_import_in_the_students_function_says_what_it_imports():
    stack = ((CELL, 2, "step"),
             ("<frozen importlib._bootstrap>", 1176, "_find_and_load"),
             ("/venv/site-packages/torch/distributed/tensor/__init__.py", 4,
              "<module>"), (os.path.join(STDLIB, "inspect.py"), 992, "getmodule"))
    line = describe_live(Status(5, None, stack, 2.5,
                                importing="torch.distributed.tensor"))
    assert line == ("importing torch.distributed.tensor, line 2 of your cell: "
                    "import torch.distributed.tensor, 2.5 s")


def test_before_the_students_code_runs_the_phase():
    frozen = (("<frozen importlib._bootstrap_external>", 147, "<module>"),
              ("<string>", 0, "__init__"))
    unpickling = Status(None, None, frozen, 2.1, phase="unpickling your function",
                        importing="torch.distributed.fsdp")
    assert describe_live(unpickling) == ("unpickling your function (importing "
                                         "torch.distributed.fsdp), 2.1 s")
    joining = Status(None, None, frozen, 0.0, phase="joining the process group")
    assert describe_busy(joining) == "joining the process group"
    idle = Status(None, None, ((os.path.join(LABKIT, "runtime", "wire.py"), 40,
                                "recv_bytes"),), 0.0)
    assert describe_busy(idle) == "idle"
