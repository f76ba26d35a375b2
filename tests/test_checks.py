"""labkit.checks: the exercise checks say what is wrong, and where."""

import inspect
import time

import pytest

from labkit import checks
from labkit.checks.common import SHORT_TIMEOUT
from tests.test_checks_ring import _good  # a right ring reduce-scatter phase


# -- what run_answer makes of answers that crash, hang or return the wrong thing --


def _recv_first(rank, world_size, chunks):
    import torch.distributed as dist

    left = (rank - 1) % world_size
    buf = chunks[0].clone()
    dist.recv(buf, left)  # every rank waits here: nobody has sent yet


def _raises_on_rank_2(rank, world_size, chunks):
    import torch.distributed as dist

    if rank == 2:
        chunks[rank + world_size] += 1  # IndexError on rank 2 only
    dist.recv(chunks[0].clone(), (rank - 1) % world_size)


def _rebinds_to_a_list(rank, world_size, chunks):
    chunks[(rank + 1) % world_size] = [15.0, 15.0, 15.0]


def _line_of(fn, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_a_deadlock_is_named_within_seconds(cluster):
    start = time.monotonic()
    with pytest.raises(checks.ExerciseError) as e:
        checks.check_ring_reduce_scatter(cluster, _recv_first, timeout=2)
    took = time.monotonic() - start
    msg = str(e.value)
    assert msg.startswith("deadlock: every rank is waiting in recv from its left "
                          "neighbour")
    line = _line_of(_recv_first, "dist.recv(buf, left)")
    assert (f"rank 0: recv from rank 3 at line {line} of test_checks.py, in "
            "_recv_first: `dist.recv(buf, left)  # every rank waits here: nobody has "
            "sent yet`") in msg
    assert "Traceback" not in msg
    # the 2 s asked for plus a restart, not the cluster's 20 s
    assert took < 2 + 10, f"the deadlock was told after {took:.1f} s, under 12 expected"
    checks.check_ring_reduce_scatter(cluster, _good)  # the ranks came back


def test_every_check_on_the_ranks_takes_a_timeout_the_short_one_by_default():
    # a student's hang is a deadlock after SHORT_TIMEOUT s, whichever check runs
    # it; timeout= gives a slow machine longer (and these tests' deadlocks 2 s).
    # The 3D check's default is its own: 8 ranks build their groups first; so
    # are DiLoCo's (fresh ranks train two models: AdamW's first step imports
    # torch._dynamo) and the resume check's (its ranks are killed and started
    # again, then train and load from the student's files)
    on_ranks = {name: inspect.signature(getattr(checks, name)).parameters
                for name in dir(checks) if name.startswith("check_")
                and next(iter(inspect.signature(getattr(checks, name)).parameters),
                         None) == "cluster"}
    assert len(on_ranks) >= 19, sorted(on_ranks)
    defaults = {name: p["timeout"].default if "timeout" in p else None
                for name, p in on_ranks.items()}
    longer = {"check_dp_bytes", "check_diloco_bytes", "check_resume"}
    assert {n for n, d in defaults.items() if d != SHORT_TIMEOUT} == longer, defaults
    assert all(on_ranks[n]["timeout"].kind is inspect.Parameter.KEYWORD_ONLY
               for n in on_ranks), "timeout= is keyword-only everywhere"


def test_an_exception_on_one_rank_is_one_message_with_the_students_line(cluster):
    with pytest.raises(checks.ExerciseError) as e:
        checks.check_ring_reduce_scatter(cluster, _raises_on_rank_2)
    msg = str(e.value)
    line = _line_of(_raises_on_rank_2, "chunks[rank + world_size] += 1")
    assert msg.splitlines()[0] == (
        "rank 2: your ring steps raised IndexError: list index out of range at line "
        f"{line} of test_checks.py, in _raises_on_rank_2: "
        "`chunks[rank + world_size] += 1  # IndexError on rank 2 only`. Hint: an "
        "index past the end: indices run from 0 to len - 1 (chunks and ranks: 0 to "
        "world_size - 1; wrap around with % world_size)")
    assert "Traceback" not in msg and "--- rank" not in msg


def test_a_result_of_the_wrong_type_is_said_precisely(cluster):
    with pytest.raises(checks.ExerciseError, match=r"rank 0, chunk 1: expected a "
                                                   r"tensor of shape \(3,\), got "
                                                   r"list \[15.0, 15.0, 15.0\]"):
        checks.check_ring_reduce_scatter(cluster, _rebinds_to_a_list)


def test_check_answer(capsys):
    assert checks.check_answer("x", None, 3) is None
    assert "not answered yet" in capsys.readouterr().out
    checks.check_answer("x", 3.0, 3)
    assert "x: 3 is right" in capsys.readouterr().out
    with pytest.raises(checks.ExerciseError, match="Hint: think"):
        checks.check_answer("x", 4, 3, hint="think")
    with pytest.raises(checks.ExerciseError, match="number"):
        checks.check_answer("x", "3", 3)
    # numpy's numbers are numbers (a student's np.int64 from an array); a bool
    # or a tensor is not an answer
    import numpy as np
    import torch

    checks.check_answer("x", np.int64(3), 3)
    checks.check_answer("x", np.float32(3.0), 3)
    assert capsys.readouterr().out == "x: 3 is right\nx: 3 is right\n"
    with pytest.raises(checks.ExerciseError, match="number"):
        checks.check_answer("x", True, 1)
    with pytest.raises(checks.ExerciseError, match="number"):
        checks.check_answer("x", torch.tensor(3), 3)
    # bytes as bytes, whole numbers whole: never 3.52322e+08
    checks.check_answer("bytes per GPU per layer", 352_321_536.0, 352_321_536)
    assert capsys.readouterr().out == ("bytes per GPU per layer: 352,321,536 B "
                                       "(336.0 MiB) is right\n")
    checks.check_answer("tokens", 2.5e9, 2.5e9)
    assert capsys.readouterr().out == "tokens: 2,500,000,000 is right\n"


def test_rounding_tolerance_is_the_references_own_rounding():
    import torch

    from labkit.checks.common import rounding_tolerance, wrong_element
    from labkit.numerics import FACTOR

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 30, generator=g), torch.randn(30, 20, generator=g)
    want, exact = a @ b, a.double() @ b.double()
    tol = rounding_tolerance(want, exact)
    own = (want.double() - exact).abs().max().item()
    unit = torch.finfo(torch.float32).eps / 2
    floor = checks.common.ROUNDING_UNITS * unit * exact.abs().max().item()
    assert tol == FACTOR * max(own, floor), (tol, own, floor)
    # the same product summed in another order (three partial sums, as three
    # ranks would): within it; a bias or a partial sum more: far outside
    parts = sum(a[:, i:i + 10] @ b[i:i + 10] for i in (0, 10, 20))
    assert wrong_element(parts, want, exact) is None, (
        f"3 partial sums off by {(parts.double() - exact).abs().max():.1e}, "
        f"{tol:.1e} allowed")
    bad = parts.clone()
    bad[3, 4] += 1e-3 * exact.abs().max().item()
    assert wrong_element(bad, want, exact)[0] == (3, 4), "a wrong element passed"
    # a float32 reference that happens to be exact still allows a few roundings
    ones = torch.ones(3)
    least = FACTOR * checks.common.ROUNDING_UNITS * unit
    assert rounding_tolerance(ones, ones.double()) == least, "no floor when exact"


# -- the messages themselves, from what the runtime reports (no ranks needed) ------

_CELL = "/tmp/ipykernel_1/123.py"


def _p2p(op, peer, line=6):
    return (f'in {op} rank {peer}, at File "{_CELL}", line {line}, in my_ring '
            f'(torch.distributed), called at File "/x/labkit/checks/watch.py", line '
            f'62, in wait_for: return work.wait()')


def test_deadlock_messages_name_the_pattern():
    from labkit.checks.explain import deadlock_message
    from labkit.runtime.results import CollectiveTimeout

    def timeout(busy, finished=()):
        return CollectiveTimeout("x", busy=busy, finished=list(finished))

    sends = {r: _p2p("send to", (r + 1) % 4) for r in range(4)}
    msg = deadlock_message(timeout(sends), 4, 5)
    assert msg.startswith("deadlock: every rank is waiting in send to its right "
                          "neighbour\n  rank 0: send to rank 1 at line 6 of your cell")
    pair = {0: _p2p("recv from", 1), 1: _p2p("wait for irecv from", 0)}
    msg = deadlock_message(timeout(pair, [2, 3]), 4, 5)
    assert msg.startswith("deadlock: ranks wait for each other in a cycle, rank 0 -> "
                          "rank 1 -> rank 0")
    assert "rank 2: finished" in msg
    early = {1: _p2p("recv from", 0)}
    msg = deadlock_message(timeout(early, [0, 2, 3]), 4, 5)
    assert msg.startswith("deadlock: rank 1 waits in recv from rank 0, which has "
                          "already returned")
    collective = {0: 'in all_reduce of 4 B (group of 4) (torch.distributed), called '
                     f'at File "{_CELL}", line 3, in f: dist.all_reduce(x)'}
    msg = deadlock_message(timeout(collective, [1, 2, 3]), 4, 5)
    assert msg.startswith("deadlock: rank 0 still waiting after 5 s; a collective")
    assert "rank 0: in all_reduce of 4 B (group of 4) at line 3 of your cell" in msg
    assert "same collectives, in the same order" in msg
    spinning = {r: f'at File "{_CELL}", line 2, in f: while True: pass'
                for r in range(4)}
    msg = deadlock_message(timeout(spinning), 4, 5)
    assert msg.startswith("ranks 0, 1, 2 and 3 still running after 5 s without "
                          "waiting on another rank")


def test_a_rank_that_died_is_said_to_have_died():
    from labkit.checks.explain import failure_message
    from labkit.runtime.results import RankError

    err = RankError("x", failures={1: "rank 1 died: killed by SIGKILL"},
                    exceptions={1: None}, busy={0: "in recv", 2: "in recv"})
    assert failure_message(err, "ring steps") == (
        "rank 1 died (killed by SIGKILL) while running your ring steps\n"
        "(ranks 0 and 2 had not finished and were stopped; the next run starts the "
        "ranks again)")


def test_the_cause_comes_before_a_peers_broken_connection():
    from labkit.checks.explain import failure_message
    from labkit.checks.watch import AnswerRaised
    from labkit.runtime.results import RankError

    frame = [(_CELL, 4, "my_ring")]
    err = RankError("x", failures={0: "...", 2: "..."}, exceptions={
        0: AnswerRaised("RuntimeError", "[gloo] Connection closed by peer", frame),
        2: AnswerRaised("IndexError", "list index out of range", frame)})
    first, second = failure_message(err, "ring steps").splitlines()
    assert first.startswith("rank 2: your ring steps raised IndexError")
    assert second.startswith("rank 0: your ring steps raised RuntimeError: [gloo] "
                             "Connection closed by peer")


def test_a_check_result_shows_nothing_in_a_notebook():
    # no stray True/False under a check cell: IPython calls _ipython_display_
    from labkit.checks.common import NOT_YET, PASSED, Checked

    assert PASSED and not NOT_YET
    assert isinstance(PASSED, Checked) and PASSED._ipython_display_() is None
    assert repr(NOT_YET) == "Checked(passed=False)"


def _misspelt_mode():
    from labkit.theory.placement import Placement

    return Placement("Replicated", "sharded")  # ValueError, raised in __post_init__


def test_generated_code_is_never_the_students_line():
    from labkit.checks.common import call_answer
    from labkit.checks.explain import student_frame

    # a dataclass's __init__ is compiled from a string: "<string>", line 10
    import labkit.theory.placement as placement

    frames = [(_CELL, 3, "my_answer"), ("<string>", 10, "__init__"),
              (placement.__file__, 80, "__post_init__")]
    assert student_frame(frames) == (_CELL, 3, "my_answer")
    frozen = [(_CELL, 5, "f"), ("<frozen importlib._bootstrap>", 1360, "_load")]
    assert student_frame(frozen) == (_CELL, 5, "f")
    assert student_frame([("<string>", 10, "__init__")]) is None
    typed = [("<ipython-input-3-abc>", 2, "f"), ("<string>", 10, "__init__")]
    assert student_frame(typed) == ("<ipython-input-3-abc>", 2, "f")
    # the repro: a mode spelt in lower case, raised through the generated __init__
    line = _line_of(_misspelt_mode, 'Placement("Replicated", "sharded")')
    with pytest.raises(checks.ExerciseError) as e:
        call_answer(_misspelt_mode, what="placement")
    msg = str(e.value)
    assert msg.startswith("your placement raised ValueError: O must be one of")
    assert msg.endswith(f"at line {line} of test_checks.py, in _misspelt_mode: "
                        '`return Placement("Replicated", "sharded")  # ValueError, '
                        "raised in __post_init__`")
    assert "<string>" not in msg


def test_gloo_errors_that_differ_only_in_their_prefix_are_one_line():
    from labkit.checks.explain import failure_message
    from labkit.checks.watch import AnswerRaised
    from labkit.runtime.results import RankError

    frame = [(_CELL, 4, "my_step")]
    said = ("Check failed: tensors[0].scalar_type() == dtype (Float vs. Double) ")
    err = RankError("x", failures=dict.fromkeys(range(4), "..."), exceptions={
        r: AnswerRaised("RuntimeError", f"[rank{r}]:[F1122 17:12:3{r}.12345{r} "
                        f"ProcessGroupGloo.cpp:1536] {said}", frame) for r in range(4)})
    (line,) = failure_message(err, "ZeRO-1 step").splitlines()
    assert line.startswith("ranks 0, 1, 2 and 3: your ZeRO-1 step raised "
                           "RuntimeError: Check failed: tensors[0].scalar_type()")
    assert "[rank" not in line and "ProcessGroupGloo" not in line


def test_a_type_error_gets_the_signature_hint_only_when_about_arguments():
    from labkit.checks.explain import hint_for

    assert "signature" in hint_for("TypeError", "f() takes 2 positional arguments "
                                   "but 3 were given")
    assert hint_for("TypeError", "'float' object is not subscriptable") == ""


def _mismatched_dtypes(rank, world_size):
    import torch
    import torch.distributed as dist

    x = torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32)
    dist.all_reduce(x)  # gloo aborts the rank that receives 8-byte elements
    return x


def test_a_rank_that_dies_says_why_and_its_peers_are_consequences(cluster):
    """A collective called with different dtypes on different ranks kills a rank
    inside gloo: the message carries its last words and a hint, and the peers
    that lost their connection are marked as consequences, without gloo's paths,
    addresses and boilerplate."""
    from labkit.checks.common import run_answer

    with pytest.raises(checks.ExerciseError) as e:
        run_answer(cluster, _mismatched_dtypes, what="ZeRO-1 step")
    first, *rest = str(e.value).splitlines()
    assert "died (killed by SIGABRT, after writing:" in first
    assert "Received data size doesn't match expected size" in first
    assert first.endswith("Hint: the ranks called one collective with different "
                          "sizes or dtypes: compare what each rank passes")
    for line in rest:
        assert "/__w/" not in line and "127.0.0.1" not in line and "GLHF" not in line
        assert "consequence" in line or line.startswith("(")


def test_last_words_are_the_cpp_exceptions_what():
    from labkit.runtime.call import last_words

    err = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
           "  what():  [enforce fail at pair.cc:456] 8 vs 4. Mismatch\n")
    assert last_words(err) == "[enforce fail at pair.cc:456] 8 vs 4. Mismatch"
    assert last_words("one\ntwo\n\n") == "two" and last_words("") == ""
