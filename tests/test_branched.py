"""Branched-SS (nemotron/schedules/branched.py): Packed-SS plus pre-drafted branches for
the most accepted outcomes. Greedy output is AR's for every number of branches k = 1..B,
batched too; k = 1 is Packed-SS itself; the layout's branches see what Quadratic-SS's do;
bad `branches` values are refused. (The sampling law: test_sampling.py.)"""

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.nemotron import layouts
from tiny import tiny_model

B = 4


@pytest.mark.parametrize("branches", range(1, B + 1))
def test_greedy_is_the_reference_continuation(nemotron, nemotron_ref, branches):
    want = nemotron_ref["greedy_continuation"].tolist()
    r = ps.decode(nemotron, nemotron_ref["greedy_prompt"].tolist(), schedule="branched",
                  block_size=B, branches=branches, max_new_tokens=len(want), eos_id=None)
    assert r.tokens == want
    assert int((np.arange(len(r.accept_hist)) * r.accept_hist).sum()) == len(want)


def test_one_branch_is_packed_ss_greedy_and_sampled():
    model = tiny_model(3)
    for kw in (dict(), dict(temperature=1.0, seed=4)):
        a = ps.decode(model, [1, 2, 3], schedule="branched", branches=1, block_size=B,
                      max_new_tokens=20, eos_id=None, **kw)
        b = ps.decode(model, [1, 2, 3], schedule="packed", block_size=B, max_new_tokens=20,
                      eos_id=None, **kw)
        assert (a.tokens, a.nfe) == (b.tokens, b.nfe)
        np.testing.assert_array_equal(a.accept_hist, b.accept_hist)


def test_a_batch_gives_each_prompt_its_tokens():
    model = tiny_model(5)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4]]
    kw = dict(schedule="branched", branches=3, block_size=B, max_new_tokens=16, eos_id=None)
    batch = ps.decode(model, prompts, **kw)
    ar = [ps.decode(model, p, schedule="ar", max_new_tokens=16, eos_id=None) for p in prompts]
    alone = [ps.decode(model, p, **kw) for p in prompts]
    assert [r.tokens for r in batch] == [r.tokens for r in alone] == [r.tokens for r in ar]
    assert [r.nfe for r in batch] == [r.nfe for r in alone]


@pytest.mark.parametrize("draft_len,outcomes", [(B - 1, (3, 2, 1)), (1, (1, 0, -1))])
def test_the_branches_see_the_accepted_prefix(draft_len, outcomes):
    """Branch h's MASK rows sit after x, d_1..d_h and see exactly those verify rows (and
    each other): what Quadratic-SS's branch h sees. The outcomes count down from the
    draft's length (a shortened draft's whole acceptance first)."""
    assert tuple(np.asarray(layouts.branch_outcomes(draft_len, B)).tolist()) == outcomes
    call = layouts.branched(np.int32(5), np.arange(B - 1, dtype=np.int32), np.int32(draft_len),
                            np.int32(10), 0, B)
    mask, pos = np.asarray(call.mask), np.asarray(call.positions)
    assert mask.shape == (2 * B + 3 * B,) * 2
    np.testing.assert_array_equal(mask[: 2 * B, : 2 * B], layouts.packed_mask(B))
    for j, h in enumerate(outcomes):
        h = max(h, 0)   # an outcome below 0 is never selected; its rows sit anywhere
        rows = 2 * B + j * B + np.arange(B)
        np.testing.assert_array_equal(pos[rows], 10 + h + 1 + np.arange(B))
        seen = np.flatnonzero(mask[rows[0]])
        np.testing.assert_array_equal(seen, np.concatenate([np.arange(h + 1), rows]))
    assert np.asarray(call.draft_rows).tolist() == [False] * B + [True] * (B + 3 * B)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="packed", branches=2), "branches applies to schedule 'branched' only"),
    (dict(schedule="branched", branches=B + 1), "at most one per acceptance outcome"),
    (dict(schedule="branched", branches=0), "branches must be an integer >= 1"),
    (dict(schedule="branched", branches=1.5), "branches must be an integer"),
])
def test_bad_branches_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.decode(tiny_model(0), [1, 2], block_size=B, max_new_tokens=2, **kwargs)


def test_the_command_line_takes_branches(capsys):
    from packed_ss_jax import cli

    argv = ["generate", "12+34=", "--max-new-tokens", "6", "--block-size", "4"]
    assert cli.main(argv + ["--schedule", "branched", "--branches", "3"]) == 0
    assert "| branched (B=4, k=3) |" in capsys.readouterr().out
    assert cli.main(argv + ["--schedule", "packed", "--branches", "3"]) == 2
    assert "branches applies to schedule 'branched' only" in capsys.readouterr().err
    # --schedule all: checked before any schedule decodes
    assert cli.main(argv + ["--schedule", "all", "--branches", "5"]) == 2
    err = capsys.readouterr()
    assert "branches 5 is too large" in err.err and "|" not in err.out
    # SetDLM: --branches goes to its Branched-SS alone, whose k is at most W
    assert cli.main(["generate", "12+34=", "--model", "setdlm-tiny", "--schedule", "all",
                     "--window", "4", "--max-new-tokens", "6", "--branches", "2"]) == 0
    assert "| branched (W=4, k=2) |" in capsys.readouterr().out
    assert cli.main(["generate", "12+34=", "--model", "setdlm-tiny", "--schedule", "branched",
                     "--window", "4", "--branches", "5"]) == 2
    assert "at most one per acceptance outcome: window 4" in capsys.readouterr().err
