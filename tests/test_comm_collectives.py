"""labkit.comm.collectives: the definitions, the ring simulation, the real ring."""

import pytest
import torch

from labkit import theory
from labkit.numerics import Oracle
from labkit.comm.collectives import (
    OPS,
    course_example,
    ring_all_reduce,
    ring_steps,
    simulate,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels


def test_course_example_numbers():
    # small whole numbers: every sum is exact, so the results are compared exactly
    ex = course_example(4)
    assert ex[2] == [2, 3, 4, 5], ex
    got = simulate("all_reduce", ex)
    assert got == [[6, 10, 14, 18]] * 4, f"all_reduce: {got}"
    rs = simulate("reduce_scatter", ex)
    assert rs == [[6.0], [10.0], [14.0], [18.0]], f"reduce_scatter: {rs}, 6 + 4r"
    got = simulate("all_gather", rs)
    assert got == [[6, 10, 14, 18]] * 4, f"all_gather: {got}"


# One example per collective, worked by hand on 2 ranks: op -> (inputs, root, after)
BY_HAND = {
    "broadcast": ([[0, 1], [1, 2]], 1, [[1, 2], [1, 2]]),
    "reduce": ([[0, 1], [1, 2]], 1, [None, [1, 3]]),
    "all_reduce": ([[0, 1], [1, 2]], 0, [[1, 3], [1, 3]]),
    "all_gather": ([[5], [7]], 0, [[5, 7], [5, 7]]),  # rank r holds its shard
    "reduce_scatter": ([[0, 1], [1, 2]], 0, [[1], [3]]),
    "scatter": ([[0, 1], [1, 2]], 1, [[1], [2]]),  # root's array, chunk r to r
    "gather": ([[0, 1], [1, 2]], 0, [[0, 1, 1, 2], None]),
    "all_to_all": ([[1, 2, 3, 4], [5, 6, 7, 8]], 0, [[1, 2, 5, 6], [3, 4, 7, 8]]),
}


@pytest.mark.parametrize("op", OPS)
def test_every_collective_against_a_hand_worked_example(op):
    assert op in BY_HAND, f"{op} is in OPS but has no hand-worked example here"
    data, root, after = BY_HAND[op]
    got = simulate(op, data, root=root)
    assert got == after, f"{op} of {data}: {got}, {after} worked by hand"


def test_ops_are_what_simulate_accepts_and_the_cost_model_knows():
    # every hand-worked collective is in OPS (and so simulated and drawn) ...
    assert sorted(BY_HAND) == sorted(OPS), sorted(OPS)
    # ... and has a bus factor and latency steps in labkit.theory
    assert sorted(OPS) == sorted(theory.COLLECTIVES), sorted(theory.COLLECTIVES)
    for op in ("allreduce", "send", "ring_all_reduce"):
        with pytest.raises(ValueError, match="unknown collective"):
            simulate(op, course_example(2))


def test_all_to_all_is_its_own_inverse():
    # transposing the n x n grid of chunks twice gives back what each rank held
    ex = course_example(4)
    got = simulate("all_to_all", simulate("all_to_all", ex))
    assert got == ex, f"all_to_all twice: {got}, {ex} expected"


def test_bad_input():
    with pytest.raises(ValueError, match="unknown collective"):
        simulate("allreduce", course_example(2))
    with pytest.raises(ValueError, match="divisible"):
        simulate("reduce_scatter", [[1, 2, 3], [1, 2, 3]])
    with pytest.raises(ValueError, match="root"):
        simulate("broadcast", course_example(2), root=5)
    with pytest.raises(ValueError, match="same number"):
        simulate("all_reduce", [[1], [1, 2]])
    with pytest.raises(ValueError):
        ring_steps(0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_ring_steps_end_with_every_sum_everywhere(n):
    steps = ring_steps(n)
    assert len(steps) == 1 + 2 * (n - 1), f"{len(steps)} steps, 1 + 2(n-1) expected"
    everyone = frozenset(range(n))
    assert all(c == everyone for row in steps[-1].holds for c in row), (
        f"n={n}: a chunk is not summed over every rank")
    if n > 1:
        # after the reduce-scatter phase rank r holds the full chunk (r + 1) % n
        rs_end = steps[n - 1]
        assert all(rs_end.holds[r][(r + 1) % n] == everyone for r in range(n)), (
            f"n={n}: the reduce-scatter phase left a chunk unsummed")
        # every step every rank sends exactly one chunk to its right neighbour
        for st in steps[1:]:
            sends = sorted((s, d) for s, d, _ in st.sends)
            assert sends == [(r, (r + 1) % n) for r in range(n)], (
                f"n={n}: sends {sends}, each rank to its right neighbour expected")


def _ring_vs_builtin(rank, world_size, numel):
    import torch.distributed as dist

    torch.manual_seed(rank)
    x = torch.randn(numel)
    y = x.clone()
    ring_all_reduce(x)
    dist.all_reduce(y)
    return x, y


@pytest.mark.parametrize("numel", [4, 10, 1 << 16])  # divisible or not by 4
def test_ring_all_reduce_matches_the_single_process_sum(cluster, numel):
    res = cluster.run(_ring_vs_builtin, numel)
    # the oracle: one process summing every rank's tensor, in rank order; the ring
    # adds them in another order for each chunk, so it is as far from the float64
    # sum as one process is (labkit.numerics), not bit for bit the same
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r))
          for r in range(4)]
    oracle = Oracle(sum(x.double() for x in xs), {"one process": sum(xs)})
    oracle.resolves(xs[0], "rank 0's own tensor")
    for rank, (ring, builtin) in enumerate(res):
        oracle.check(ring, f"{numel} elements, rank {rank}: ring_all_reduce")
        oracle.check(builtin, f"{numel} elements, rank {rank}: dist.all_reduce")


def test_ring_all_reduce_on_a_subgroup(cluster):
    def sub(rank, world_size):
        import torch.distributed as dist

        group = dist.new_group([1, 3])
        if rank in (1, 3):
            x = torch.full((6,), float(rank))
            ring_all_reduce(x, group=group)
            return x.tolist()

    res = cluster.run(sub)
    # whole numbers: 1 + 3 is exact
    assert res[1] == res[3] == [4.0] * 6, f"ranks 1 and 3: {res[1]}, {res[3]}"
    assert res[0] is None, res[0]

