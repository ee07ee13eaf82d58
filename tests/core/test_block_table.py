"""BlockTable's slot mapping: ``block_ids[p // block_size] * block_size + p % block_size``, in range only."""

import pytest

from rawpaged.core.block_table import BlockTable


def test_slots_map_positions_through_the_table():
    t = BlockTable(0, 4, [7, 2, 5], 10)
    assert t.slots(0, 10) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert t.slots(3, 5) == [31, 8] and t.slots(10, 10) == [] and t.slots(4, 4) == []


@pytest.mark.parametrize("start, end", [(-1, 2), (0, 11), (5, 4), (11, 11)])
def test_slots_outside_the_reserved_range_raise(start, end):
    t = BlockTable(0, 4, [7, 2, 5], 10)
    with pytest.raises(IndexError) as e:
        t.slots(start, end)
    assert str(e.value) == f"slot range [{start}, {end}) outside reserved slots [0, 10)"
