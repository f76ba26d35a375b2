"""labkit.checks.expert_parallel: chapter 12's three checks pass a right answer,
say "not written yet" for a stub, and name each kind of wrong answer: the
dispatch's split sizes, counts not exchanged, an unsorted or broken `order`,
rows sent in the wrong order; a capacity factor that drops too much, wastes
room, or is a capacity in pairs; and a layer's bytes off by each usual factor."""

import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.expert_parallel import (
    check_capacity_factor,
    check_dispatch,
    check_layer_bytes,
)
from labkit.parallel import all_to_all_rows

# -- exercise 1: the dispatch --------------------------------------------------------


def _splits(experts, num_experts, group, exchange=True):
    ep = dist.get_world_size(group)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(ep, -1).sum(1).tolist()
    return counts, send, got.view(ep, -1).sum(1).tolist() if exchange else send


def _good(x, experts, num_experts, group):
    k = experts.shape[1]
    order = experts.reshape(-1).argsort(stable=True)
    _, send, receive = _splits(experts, num_experts, group)
    return all_to_all_rows(x[order // k], send, receive, group), send, receive, order


def _unstable(x, experts, num_experts, group):  # any order grouped by expert is fine
    k = experts.shape[1]
    order = experts.reshape(-1).flip(0).argsort(stable=True)
    order = experts.numel() - 1 - order
    pe = experts.reshape(-1)
    order = order[pe[order].argsort(stable=True)]
    _, send, receive = _splits(experts, num_experts, group)
    return all_to_all_rows(x[order // k], send, receive, group), send, receive, order


def _per_expert_counts(x, experts, num_experts, group):
    rows, send, receive, order = _good(x, experts, num_experts, group)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    return rows, counts.tolist(), receive, order


def _send_is_receive(x, experts, num_experts, group):
    rows, send, receive, order = _good(x, experts, num_experts, group)
    return rows, receive, send, order


def _no_exchange(x, experts, num_experts, group):
    rows, send, receive, order = _good(x, experts, num_experts, group)
    return rows, send, send, order


def _token_order(x, experts, num_experts, group):
    rows, send, receive, order = _good(x, experts, num_experts, group)
    return rows, send, receive, torch.arange(experts.numel())


def _repeats(x, experts, num_experts, group):
    rows, send, receive, order = _good(x, experts, num_experts, group)
    order = order.clone()
    order[1] = order[0]
    return rows, send, receive, order


def _rows_by_token(x, experts, num_experts, group):  # splits right, rows unsorted
    k = experts.shape[1]
    order = experts.reshape(-1).argsort(stable=True)
    _, send, receive = _splits(experts, num_experts, group)
    rows = all_to_all_rows(x.repeat_interleave(k, 0), send, receive, group)
    return rows, send, receive, order


def _todo(*args):
    raise NotImplementedError("exercise: dispatch")


def test_dispatch_check_passes_right_answers(cluster, capsys):
    assert not check_dispatch(cluster, _todo)
    assert "not written yet" in capsys.readouterr().out
    assert check_dispatch(cluster, _good)
    assert "correct" in capsys.readouterr().out
    assert check_dispatch(cluster, _unstable)


@pytest.mark.parametrize("fn,match", [
    (_per_expert_counts, r"rank 0: send should be 4 whole numbers.*one count per "
                         "expert"),
    (_send_is_receive, r"rank \d: send = .* that is what this rank receives"),
    (_no_exchange, r"rank \d: receive = .* this rank's own send.* exchange the "
                   "counts first"),
    (_token_order, r"rank 0: order is not sorted by expert.*tokens' own order"),
    (_repeats, r"rank 0: order is not a permutation"),
    (_rows_by_token, r"rank 0, received row \d+: token \d+ of rank \d, expected"),
])
def test_dispatch_check_names_the_mistake(cluster, fn, match):
    with pytest.raises(ExerciseError, match=match):
        check_dispatch(cluster, fn)


# -- exercise 2: a capacity factor -----------------------------------------------------

# two ranks, 4 tokens each, k = 1 of 4 experts: rank 0 sends 3 pairs to expert 0
ROUTED = [torch.tensor([[0], [0], [0], [1]]), torch.tensor([[1], [2], [3], [0]])]


def test_capacity_factor_check(capsys):
    # k T / E = 1 pair per expert a rank; the busiest takes 3: c = 3 drops none,
    # c = 2 drops 1 of 8 pairs (12.5%), c = 1 drops 2 (25%)
    assert not check_capacity_factor("c", None, ROUTED, 4, 0.2)
    assert check_capacity_factor("c", 2, ROUTED, 4, 0.2)
    assert "12.5%" in capsys.readouterr().out
    assert check_capacity_factor("c", 3.0, ROUTED, 4, 0.01)
    with pytest.raises(ExerciseError, match=r"c = 1 drops 25\.0% .* raise it"):
        check_capacity_factor("c", 1, ROUTED, 4, 0.2)
    with pytest.raises(ExerciseError, match=r"already c = 3 fits the busiest"):
        check_capacity_factor("c", 3.5, ROUTED, 4, 0.2)
    with pytest.raises(ExerciseError, match=r"is it a capacity in pairs"):
        check_capacity_factor("c", 12, ROUTED, 4, 0.2)
    for bad in (0, -1, "2", True):
        with pytest.raises(ExerciseError, match="a number > 0"):
            check_capacity_factor("c", bad, ROUTED, 4, 0.2)


# -- exercise 3: a layer's bytes -----------------------------------------------------

LAYER = {"tokens": 4096, "k": 8, "hidden": 7168, "ep": 64, "dtype_bytes": 2}
ROWS = 4096 * 8 * 7168 * 2


def test_layer_bytes_check(capsys):
    assert not check_layer_bytes("b", None, **LAYER)
    assert check_layer_bytes("b", 4 * ROWS * 63 / 64, **LAYER)
    assert "is right" in capsys.readouterr().out
    wrong = {2 * ROWS * 63 / 64: "the forward only",
             ROWS * 63 / 64: "that is one all-to-all",
             4 * ROWS: "every row counted as sent",
             4 * ROWS * 63 / 64 / 8: "a row per token",
             8 * ROWS * 63 / 64: "2 bytes an element",
             32 * ROWS * 63 / 64: "bits, not bytes",
             4 * ROWS * 63: "the whole group's bytes",
             12345.0: r"6\.67e-06 x the answer"}
    for value, match in wrong.items():
        with pytest.raises(ExerciseError, match=match):
            check_layer_bytes("b", value, **LAYER)
    with pytest.raises(ExerciseError, match="expected a number of bytes"):
        check_layer_bytes("b", "lots", **LAYER)
