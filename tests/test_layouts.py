"""Masks and positions of every call, spelled out by hand for small B."""

import numpy as np

from packed_ss_jax.nemotron import layouts

M = 99  # MASK id in these tests


def test_packed_B3():
    call = layouts.packed(7, np.array([5, M], np.int32), 10, M)
    np.testing.assert_array_equal(call.tokens, [7, 5, M, 7, M, M])
    np.testing.assert_array_equal(call.positions, [10, 11, 12, 10, 11, 12])
    np.testing.assert_array_equal(call.mask, np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1, 1],
    ], bool))
    np.testing.assert_array_equal(call.draft_rows, [0, 0, 0, 1, 1, 1])


def test_quadratic_B2():
    # groups [d0, M, M] at 4,5,6 and [d1, M, M] at 5,6,7
    call = layouts.quadratic(7, np.array([5], np.int32), 4, M)
    np.testing.assert_array_equal(call.tokens, [7, M, M, 5, M, M])
    np.testing.assert_array_equal(call.positions, [4, 5, 6, 5, 6, 7])
    np.testing.assert_array_equal(call.mask, np.array([
        [1, 0, 0, 0, 0, 0],  # d0
        [1, 1, 1, 0, 0, 0],  # group 0 masks: own group
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],  # d1: d0, d1
        [1, 0, 0, 1, 1, 1],  # group 1 masks: d0 and own group
        [1, 0, 0, 1, 1, 1],
    ], bool))
    np.testing.assert_array_equal(call.draft_rows, [0, 1, 1, 0, 1, 1])


def test_linear_calls_B3():
    d = layouts.draft_block(7, 10, 3, M)
    np.testing.assert_array_equal(d.tokens, [7, M, M])
    np.testing.assert_array_equal(d.positions, [10, 11, 12])
    assert d.mask.all() and d.draft_rows.all()
    v = layouts.verify(7, np.array([5, 6], np.int32), 10)
    np.testing.assert_array_equal(v.tokens, [7, 5, 6])
    np.testing.assert_array_equal(v.mask, np.tril(np.ones((3, 3), bool)))
    assert not v.draft_rows.any()


def test_first_call_padded_prompt():
    # prompt of 2 real tokens padded to 4, B = 2 masks at positions 2, 3
    call = layouts.first_call(np.array([3, 4, 0, 0], np.int32), 2, 2, M)
    np.testing.assert_array_equal(call.tokens, [3, 4, 0, 0, M, M])
    np.testing.assert_array_equal(call.positions, [0, 1, 2, 3, 2, 3])
    np.testing.assert_array_equal(call.mask, np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # padding rows: causal, seen by nobody
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 1],  # masks: the real prompt and each other
        [1, 1, 0, 0, 1, 1],
    ], bool))
    np.testing.assert_array_equal(call.draft_rows, [0, 0, 0, 0, 1, 1])
