"""The flight recorder after a hang (labkit/runtime/flight.py): the rank that did
not enter a collective is named with where it was, on real ranks; the mismatch
finder on records made by hand, so each case is known exactly."""

import pytest

import labkit
from labkit.runtime.flight import Entry, GroupLog, find_mismatch


def _log(entered, *ops, name="default group"):
    last = tuple(Entry(i + 1, op, ((8,),), ("Float",)) for i, op in enumerate(ops))
    return {"0": GroupLog(name, entered, entered, last)}


def test_the_rank_behind_is_named_with_the_collective_it_did_not_enter():
    logs = {0: _log(4, *["all_reduce"] * 4), 1: _log(3, *["all_reduce"] * 3),
            2: _log(4, *["all_reduce"] * 4)}
    found = find_mismatch(logs, {1: "at line 9: time.sleep(30)"})
    assert found == ["rank 1 did not enter all_reduce #4 of [8] float32 of the "
                     "default group, which ranks 0 and 2 entered; rank 1 was at "
                     "line 9: time.sleep(30)"], found


def test_different_collectives_under_one_number_are_named():
    logs = {0: _log(2, "all_reduce", "all_reduce"),
            1: _log(2, "all_reduce", "broadcast")}
    found = find_mismatch(logs)
    assert len(found) == 1 and "collective #2 of the default group differs" in \
        found[0] and "rank 1 broadcast #2" in found[0], found


def test_records_that_agree_say_nothing():
    logs = {r: _log(3, *["all_reduce"] * 3) for r in range(4)}
    assert find_mismatch(logs) == []
    assert find_mismatch({0: None, 1: None}) == []  # nothing recorded


def _skips(rank, world_size, skipper, sleep):
    import time

    import torch
    import torch.distributed as dist

    x = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(x)
    if rank == skipper:
        time.sleep(sleep)  # the line the diagnosis should name
    else:
        dist.all_reduce(x)


@pytest.fixture(scope="module")
def cluster():
    with labkit.Cluster(4, timeout=3) as c:
        yield c


def test_a_hang_names_the_rank_that_skipped_and_its_line(cluster):
    with pytest.raises(labkit.RankError) as e:
        cluster.run(_skips, 2, 60)
    mismatch = e.value.mismatch
    assert len(mismatch) == 1, f"the flight recorders' mismatch: {mismatch}"
    assert mismatch[0].startswith(
        "rank 2 did not enter all_reduce #4 of [8] float32 of the default group, "
        "which ranks 0, 1 and 3 entered; rank 2 was at File"), mismatch[0]
    assert "time.sleep(sleep)" in mismatch[0], mismatch[0]
    assert "--- the flight recorders" in str(e.value), str(e.value)
    # each rank's record: three all-reduces everywhere, the fourth on three ranks
    entered = {r: log["0"].entered for r, log in e.value.collectives.items()}
    assert entered == {0: 4, 1: 4, 2: 3, 3: 4}, entered


def test_a_rank_that_returned_early_is_named_too(cluster):
    with pytest.raises(labkit.RankError) as e:
        cluster.run(_skips, 0, 0)  # rank 0 returns instead of the fourth
    assert any(m.startswith("rank 0 did not enter all_reduce #4") and
               "done with the call" in m for m in e.value.mismatch), e.value.mismatch


def _skips_in_a_subgroup(rank, world_size):
    import time

    import torch
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    x = torch.ones(4)
    dist.all_reduce(x, group=mine)
    if rank == 3:
        time.sleep(60)  # rank 3 skips its pair's second all-reduce
    else:
        dist.all_reduce(x, group=mine)


def test_a_hang_in_a_subgroup_is_named_by_the_groups_name(cluster):
    # each rank numbers only the groups it belongs to: ranks 2 and 3 call their
    # pair the process's group 1, named "2" everywhere; no phantom groups
    cluster.restart()  # fresh ranks: group names from 1
    with pytest.raises(labkit.RankError) as e:
        cluster.run(_skips_in_a_subgroup)
    mismatch = e.value.mismatch
    assert len(mismatch) == 1 and mismatch[0].startswith(
        "rank 3 did not enter all_reduce #2 of [4] float32 of the group 2 (ranks "
        "[2, 3]), which rank 2 entered"), mismatch
    entered = {r: {g: log.entered for g, log in logs.items()}
               for r, logs in e.value.collectives.items()}
    assert entered == {0: {"1": 2}, 1: {"1": 2}, 2: {"2": 2}, 3: {"2": 1}}, entered
