"""labkit.checks.ring (chapter 02): the ring checks pass a right answer, name
what a wrong one got wrong, and fail every shortcut: no communication, values
written down from an earlier run, a built-in collective, labkit's own ring,
messages that are not a ring's; the crossover check fails NaN, labkit's own
α-β model and a number written down for the chapter's case."""

import pytest

from labkit.checks import ExerciseError, check_crossover
from labkit.checks.ring import check_ring_all_gather, check_ring_reduce_scatter


def _ring_steps(rank, world_size, chunks, steps):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, steps + 1):
        into = chunks[(rank - s) % world_size]
        buf = into.clone()
        reqs = [dist.isend(chunks[(rank - s + 1) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        into += buf


def _good(rank, world_size, chunks):
    _ring_steps(rank, world_size, chunks, world_size - 1)


def _todo(rank, world_size, chunks):
    raise NotImplementedError("exercise: the reduce-scatter phase")


def test_a_right_reduce_scatter_passes_and_the_line_says_what_was_measured(
        cluster, capsys):
    assert check_ring_reduce_scatter(cluster, _todo) is None
    assert "not written yet" in capsys.readouterr().out
    check_ring_reduce_scatter(cluster, _good)
    out = capsys.readouterr().out
    assert ("correct: after 3 steps every rank r holds the full sum of chunk "
            "(r+1) % 4; measured on every rank: 3 messages of 12 bytes (M/4) to its "
            "right neighbour, as many from its left, no collective") in out


def test_a_step_short_names_the_ranks_missing(cluster):
    # rank 0's chunk 1 is completed at the last step: it never received
    wrong = (r"rank 0, chunk 1 should hold its sum over all 4 ranks, but holds "
             r"rank 0's copy only \(missing \[1, 2, 3\]\). After step s")
    with pytest.raises(ExerciseError, match=wrong):
        check_ring_reduce_scatter(
            cluster, lambda r, n, c: _ring_steps(r, n, c, n - 2))


def _all_reduce_the_chunk(rank, world_size, chunks):
    import torch.distributed as dist

    dist.all_reduce(chunks[(rank + 1) % world_size])


def _builtin_reduce_scatter(rank, world_size, chunks):
    import torch
    import torch.distributed as dist

    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, [chunks[(q + 1) % world_size].clone()
                              for q in range(world_size)])
    chunks[(rank + 1) % world_size].copy_(out)


def _labkits_ring(rank, world_size, chunks):
    import torch

    from labkit.comm.collectives import ring_reduce_scatter

    x = torch.cat(chunks)
    ring_reduce_scatter(x)
    for c, v in zip(chunks, x.chunk(world_size)):
        c.copy_(v)


def _straight_to_the_owner(rank, world_size, chunks):
    """Right values, no ring: every rank sends each chunk straight to the rank
    that must end with it, and adds up what arrives."""
    import torch
    import torch.distributed as dist

    mine = (rank + 1) % world_size
    bufs, reqs = [], []
    for peer in range(world_size):
        if peer != rank:
            reqs.append(dist.isend(chunks[(peer + 1) % world_size], peer))
            bufs.append(torch.empty_like(chunks[mine]))
            reqs.append(dist.irecv(bufs[-1], peer))
    for q in reqs:
        q.wait()
    for b in bufs:
        chunks[mine] += b


@pytest.mark.parametrize("answer, message", [
    (_all_reduce_the_chunk, r"rank 0: it called \['all_reduce'\]; a ring "
                            r"reduce-scatter is point-to-point messages alone"),
    (_builtin_reduce_scatter, r"rank 0: it called \['reduce_scatter'\]"),
    (_labkits_ring, r"rank 0: your answer calls labkit.comm.collectives."
                    r"ring_reduce_scatter, labkit's own ring; the exercise is to "
                    r"write it yourself"),
    (_straight_to_the_owner, r"rank 0, the values are right, but: its 1st message "
                             r"was sent to rank 1; in a ring each rank talks only "
                             r"to its neighbours, rank 0 to its right neighbour, "
                             r"rank 1|rank 0, the values are right, but: its 2nd "
                             r"message was sent to rank 2"),
])
def test_shortcuts_to_the_reduce_scatter_fail(cluster, answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_ring_reduce_scatter(cluster, answer)


def test_values_written_down_from_one_run_fail_the_next(cluster, tmp_path):
    """The old check's fixed inputs made every chunk 2**N - 1; and a student who
    saves one run's sums and writes them in next time sends nothing."""
    def save(rank, world_size, chunks):
        import torch

        _good(rank, world_size, chunks)
        torch.save(chunks[(rank + 1) % world_size], tmp_path / f"{rank}.pt")

    def replay(rank, world_size, chunks):
        import torch

        chunks[(rank + 1) % world_size].copy_(torch.load(tmp_path / f"{rank}.pt"))

    def old_answer(rank, world_size, chunks):
        chunks[(rank + 1) % world_size].fill_(2 ** world_size - 1)

    check_ring_reduce_scatter(cluster, save)
    for cheat in (replay, old_answer):
        with pytest.raises(ExerciseError, match=r"rank 0, chunk 1 should hold its "
                                                r"sum over all 4 ranks: got "):
            check_ring_reduce_scatter(cluster, cheat)


def test_nan_is_no_sum(cluster):
    with pytest.raises(ExerciseError, match=r"got \[nan, nan, nan\], expected"):
        check_ring_reduce_scatter(
            cluster, lambda r, n, c: c[(r + 1) % n].fill_(float("nan")))


# ------------------------------------------------------------------ all-gather


def _gather_steps(rank, world_size, chunks, steps, add=False):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, steps + 1):
        into = chunks[(rank - s + 1) % world_size]
        buf = into.clone() if add else into
        reqs = [dist.isend(chunks[(rank - s + 2) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        if add:
            into += buf


def _builtin_all_gather(rank, world_size, chunks):
    import torch
    import torch.distributed as dist

    mine = chunks[(rank + 1) % world_size].clone()
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    for q, part in enumerate(parts):
        chunks[(q + 1) % world_size].copy_(part)


def test_ring_all_gather_check(cluster, capsys):
    check_ring_all_gather(cluster, lambda r, n, c: _gather_steps(r, n, c, n - 1))
    assert ("every rank holds all 4 complete chunks; measured on every rank: 3 "
            "messages of 12 bytes (M/4)") in capsys.readouterr().out
    # one step short: chunk 2 (completed on rank 1) is 3 steps from rank 0
    short = (r"rank 0, chunk 2: expected chunk 2's complete sum; it still holds "
             r"its stale partial sum.* must travel 3 steps to reach rank 0")
    with pytest.raises(ExerciseError, match=short):
        check_ring_all_gather(cluster, lambda r, n, c: _gather_steps(r, n, c, n - 2))
    with pytest.raises(ExerciseError, match=r"rank 0, chunk 0: .* the stale partial "
                                            r"sum plus the complete one"):
        check_ring_all_gather(
            cluster, lambda r, n, c: _gather_steps(r, n, c, n - 1, add=True))
    # the reduce-scatter's chunk choice in the all-gather phase: rank 0 never
    # receives into chunk 0
    with pytest.raises(ExerciseError, match=r"rank 0, chunk 0: expected chunk 0's "
                                            r"complete sum; it still holds its "
                                            r"stale partial sum"):
        check_ring_all_gather(cluster, _good)
    with pytest.raises(ExerciseError, match=r"rank 0: it called \['all_gather'\]"):
        check_ring_all_gather(cluster, _builtin_all_gather)
    with pytest.raises(ExerciseError, match=r"labkit's own ring"):
        check_ring_all_gather(cluster, _labkits_gather)


def _labkits_gather(rank, world_size, chunks):
    import torch

    from labkit.comm.collectives import ring_all_gather

    x = torch.cat(chunks)
    ring_all_gather(x)
    for c, v in zip(chunks, x.chunk(world_size)):
        c.copy_(v)


def test_the_old_fixed_answer_fails_the_all_gather(cluster):
    def old(rank, world_size, chunks):  # chunk c's sum was always 10 (c + 1)
        for c, chunk in enumerate(chunks):
            chunk.fill_(10.0 * (c + 1))

    with pytest.raises(ExerciseError, match=r"expected chunk \d's complete sum"):
        check_ring_all_gather(cluster, old)


# ------------------------------------------------------------------ crossover


def _crossover(n, alpha, beta):
    return n * alpha * beta


def test_crossover_check(capsys):
    check_crossover(_crossover)
    assert ("at N = 1024, α = 5 µs, β = 50 GB/s, an all-reduce smaller than 256 MB "
            "spends longer in latency") in capsys.readouterr().out

    def todo(n, alpha, beta):
        raise NotImplementedError("exercise: the crossover")

    assert check_crossover(todo) is None
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (lambda n, a, b: a * b, r"N = 1024, .*: got 250,000 B \(244.1 KiB\), "
                            r"expected 256,000,000 B \(244.1 MiB\); that is α·β: "
                            r"the N is missing"),
    (lambda n, a, b: (n - 1) * a * b, r"that is \(N-1\)·α·β"),
    (lambda n, a, b: n * a * b / 2, r"the 2 cancels too"),
    (lambda n, a, b: n * a / b, r"β is bytes per second"),
    (lambda n, a, b: float("nan"), r"nan is not a number an answer can be"),
    (lambda n, a, b: float("inf"), r"inf is not a number an answer can be"),
    (lambda n, a, b: 256e6, r"N = \d+, .*: got 256,000,000 B \(244.1 MiB\), "
                             r"expected"),
    (lambda n, a, b: "256 MB", r"expected a number of bytes, got str"),
])
def test_wrong_crossovers_are_named(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_crossover(answer)


def test_labkits_own_alpha_beta_model_is_refused():
    def bisect(n, alpha, beta):  # search for S with labkit's own model
        from labkit import theory

        lo, hi = 0.0, 1e15
        for _ in range(200):
            s = (lo + hi) / 2
            latency = theory.alpha_beta_time("all_reduce", 0, n, alpha, beta)
            total = theory.alpha_beta_time("all_reduce", s, n, alpha, beta)
            lo, hi = (s, hi) if total - latency < latency else (lo, s)
        return lo

    with pytest.raises(ExerciseError, match=r"your answer calls labkit.theory."
                                            r"alpha_beta_time|calls labkit.theory."
                                            r"collective_cost.alpha_beta_time"):
        check_crossover(bisect)
