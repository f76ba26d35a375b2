"""labkit.arguments.whole: the one check that an argument is a whole number in
range, which every layer uses (a count of ranks, layers, micro-batches...)."""

import numpy as np
import pytest
import torch

from labkit.arguments import ArgumentError, whole


def test_whole_numbers_of_any_kind_pass_as_ints():
    for v in (3, np.int64(3), torch.tensor(3)):
        got = whole(v, "n")
        assert got == 3 and type(got) is int, (v, got)
    assert whole(0, "tokens", 0) == 0 and whole(64, "world_size", 1, 64) == 64


@pytest.mark.parametrize("v, says", [
    (True, "got True"), (2.0, "got 2.0"), ("4", "got '4'"), (None, "got None"),
    (torch.tensor(2.0), "got tensor(2.)"), (0, "got 0"), (-3, "got -3"),
    (-10 ** 400, "got an integer of 1329 bits"),
])
def test_anything_else_is_named_with_what_it_got(v, says):
    with pytest.raises(ArgumentError, match=r"n must be an integer >= 1, ") as e:
        whole(v, "n")
    assert says in str(e.value)
    # a wrong kind and a wrong value are both caught by either except clause
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)


def test_a_range_says_both_ends():
    with pytest.raises(ArgumentError, match=r"rank must be an integer in \[0, 3\], "
                                            r"got 4"):
        whole(4, "rank", 0, 3)
