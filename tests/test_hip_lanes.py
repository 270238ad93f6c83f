"""CPU checks of HipBackend's host-side logic (pure functions, no GPU needed):
which lane holds which row, what each lane may see, the block-table width, and that
the backend module imports without a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4ref.backend import Row
from ds4ref.backend import check_rows
from ds4ref.hip.device_state import (LANE_FIELDS, lane_fields, lane_order,
                                     max_pages_per_slot)

F = {name: i for i, name in enumerate(LANE_FIELDS)}


def test_lane_order_groups_each_slot_keeping_order():
    slots = [3, 1, 3, 2, 1, 3]
    order = lane_order(slots)
    assert [slots[i] for i in order] == [3, 3, 3, 1, 1, 2]
    assert order == [0, 2, 5, 1, 4, 3]  # rows of a slot keep their plan order


@given(st.lists(st.integers(0, 5), max_size=16))
def test_lane_order_is_a_permutation_with_contiguous_slots(slots):
    order = lane_order(slots)
    assert sorted(order) == list(range(len(slots)))
    seq = [slots[i] for i in order]
    seen = []
    for s in seq:  # each slot appears as one run
        if not seen or seen[-1] != s:
            assert s not in seen
            seen.append(s)


def test_lane_fields_values():
    rows = [Row(2, 10, 5), Row(2, 11, 6), Row(2, 12, 7), Row(0, 3, 9)]
    f = lane_fields(rows, ratios=[4, 128])
    assert f.shape == (len(LANE_FIELDS) + 2, 16) and f.dtype == np.int32
    assert f[F["slot"], :5].tolist() == [2, 2, 2, 0, -1]
    assert f[F["pos"], :4].tolist() == [10, 11, 12, 3]
    assert f[F["tok"], :4].tolist() == [5, 6, 7, 9]
    assert f[F["pstart"], :4].tolist() == [10, 10, 10, 3]
    assert f[F["flane"], :4].tolist() == [0, 0, 0, 3]
    assert f[F["last"], :4].tolist() == [12, 12, 12, 3]
    nvis4, nvis128 = f[len(LANE_FIELDS)], f[len(LANE_FIELDS) + 1]
    assert nvis4[:4].tolist() == [2, 3, 3, 1]      # (pos + 1) // 4
    assert nvis128[:4].tolist() == [0, 0, 0, 0]
    assert (f[F["slot"], 4:] == -1).all() and (nvis4[4:] == 0).all()  # padding sees nothing
    assert f[F["flane"], 4:].tolist() == list(range(4, 16))
    assert f[F["hsrc"], :5].tolist() == [0, 1, 2, 3, -1]  # every row emits (Row's default)


def test_head_rows_are_the_emitting_lanes_in_lane_order():
    rows = [Row(2, 10, 5, False, False), Row(2, 11, 6), Row(0, 3, 9, False, True), Row(1, 0, 4, False, False)]
    f = lane_fields(rows, ratios=[4], n_lanes=256)
    assert f.shape == (len(LANE_FIELDS) + 1, 256)
    assert f[F["hsrc"], :3].tolist() == [1, 2, -1] and (f[F["hsrc"], 2:] == -1).all()


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=4, unique_by=lambda t: t[0]))
def test_lane_of_position_formula(spec):
    """The kernels find the lane of a slot's position q as flane + q - pstart."""
    rows, starts = [], {}
    for slot, n in spec:
        starts[slot] = 7 * slot
        rows += [Row(slot, starts[slot] + j, 1) for j in range(n)]
    rows = rows[:16]
    f = lane_fields(rows, ratios=[4])
    for lane, r in enumerate(rows):
        q_lane = f[F["flane"], lane] + r.position - f[F["pstart"], lane]
        assert q_lane == lane


def test_check_rows_refuses_bad_plans():
    nxt = np.array([0, 5])
    check_rows([Row(1, 5, 1), Row(1, 6, 1)], nxt, [1, 1], 128, 512)
    with pytest.raises(ValueError, match="state is at 5"):
        check_rows([Row(1, 6, 1)], nxt, [1, 1], 128, 512)
    with pytest.raises(ValueError, match="mapped pages"):
        check_rows([Row(0, 0, 1)], nxt, [0, 1], 128, 512)
    with pytest.raises(ValueError, match="token id"):
        check_rows([Row(0, 0, 512)], nxt, [1, 1], 128, 512)
    with pytest.raises(ValueError, match="out of range"):
        check_rows([Row(2, 0, 1)], nxt, [1, 1], 128, 512)
    with pytest.raises(ValueError, match="at most 16"):
        check_rows([Row(0, i, 1) for i in range(17)], np.array([0]), [1], 128, 512)


def test_block_table_width():
    assert max_pages_per_slot(1000, 128, 4096) == 32
    assert max_pages_per_slot(8, 128, 4096) == 8
    assert max_pages_per_slot(0, 128, 4096) == 1


def test_backend_imports_without_gpu():
    import ds4ref.hip.backend as b
    assert b.HipBackend.name == "hip"
