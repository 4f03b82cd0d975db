"""What `auto` learns from its own decodes (feedback.py, planner.py): corrections of the
predicted seconds per iteration (bounded; the machine's drift shared with the candidates
not run, each candidate's place against it), re-planning when the observed best
changes, and bounded exploration; predictions that meet what decodes then take."""

import math

import pytest

from packed_ss_jax import families, feedback, planner as planner_lib
from packed_ss_jax.acceptance import AcceptanceModel, Candidate, Tally
from packed_ss_jax.cost import CostModel
from packed_ss_jax.engine import Engine
from packed_ss_jax.feedback import Feedback
from packed_ss_jax.options import DecodeOptions
from tiny import tiny_model

AR, LINEAR, PACKED = Candidate("ar", 1), Candidate("linear", 4), Candidate("packed", 4)
BRANCHED = Candidate("branched", 4, 2)
SMALL = (AR, LINEAR, PACKED, BRANCHED)
AUTO = DecodeOptions(schedule="auto")


def test_a_candidate_s_correction_follows_its_decodes_within_bounds():
    f = Feedback()
    assert f.factor(PACKED, 1) == 1.0   # nothing seen
    for _ in range(30):
        f.observe(PACKED, 1, 1e-3, 3e-3)
    assert f.factor(PACKED, 1) == pytest.approx(3.0)
    f.observe(PACKED, 1, 1e-3, 1e3)   # one wild timing moves it a bounded step
    assert f.factor(PACKED, 1) == pytest.approx(3.0 ** 0.75 * feedback.BOUND ** 0.25)
    for bad in (0.0, -1.0, math.nan, math.inf):   # never breaks the planner
        f.observe(PACKED, 1, 1e-3, bad)
        f.observe(PACKED, 1, bad, 1e-3)
    assert math.isfinite(f.factor(PACKED, 1)) and f.ticks == 31


def test_a_candidate_not_run_follows_the_machine_and_keeps_its_place():
    f = Feedback()
    for _ in range(30):
        f.observe(PACKED, 1, 1e-3, 2e-3)   # the machine runs twice as slow
    assert f.factor(LINEAR, 1) == pytest.approx(2.0)   # never run: the drift alone
    assert f.factor(LINEAR, 8) == 1.0                  # another batch size: its own
    # Run once at twice the machine: the calibration, which saw no offset, counts as
    # PRIOR decodes beside it.
    f.observe(LINEAR, 1, 1e-3, 4e-3)
    own = 1 / (1 + feedback.PRIOR)
    assert f.factor(LINEAR, 1) == pytest.approx(2.0 * 2.0 ** own)
    assert f.factor(PACKED, 1) == pytest.approx(2.0)   # a candidate's own level
    for _ in range(60):                                # the machine slows by half again,
        f.observe(PACKED, 1, 1e-3, 3e-3)               # as Packed-SS sees it
    assert f.factor(PACKED, 1) == pytest.approx(3.0, rel=1e-6)
    assert f.factor(LINEAR, 1) == pytest.approx(3.0 * 2.0 ** own, rel=1e-6)   # its place
    # Tried again at 1.5x the machine: its offset is the mean of the calibration's and
    # its two decodes'.
    f.observe(LINEAR, 1, 1e-3, 4.5e-3, explored=True)
    mean = (math.log(2.0) + math.log(1.5)) / (2 + feedback.PRIOR)
    assert f.factor(LINEAR, 1) == pytest.approx(3.0 * math.exp(mean), rel=1e-6)
    assert f.factor(PACKED, 1) == pytest.approx(3.0, rel=1e-6)   # the machine unmoved


def test_the_fastest_predicted_candidate_not_run_lately_is_explored():
    f = Feedback()
    close = [BRANCHED, LINEAR, AR]   # fastest predicted first
    assert f.to_explore(close, 1) == BRANCHED                  # never run
    f.observe(BRANCHED, 1, 1e-3, 1e-3)
    assert f.to_explore(close, 1) == LINEAR                    # Branched-SS ran just now
    assert f.to_explore(close, 8) == BRANCHED                  # at another size it did not
    f.observe(LINEAR, 1, 1e-3, 1e-3)
    f.observe(AR, 1, 1e-3, 1e-3)
    assert f.to_explore(close, 1) is None                      # every one ran lately
    for _ in range(feedback.FRESH - 1):
        f.observe(PACKED, 1, 1e-3, 1e-3)
    assert f.to_explore(close, 1) == BRANCHED                  # FRESH decodes ago
    assert f.to_explore([], 1) is None


def _planner(model, tmp_path):
    # 1 ms + 0.1 ms per row whatever the cache: per iteration AR 1.1 ms, Linear 2.8 ms,
    # Packed 1.8 ms, Branched 2.2 ms; tokens per iteration 1, 3, 2.5, 2.6.
    cost = CostModel("k", (1, 64), (64, 256), ((1.1e-3, 7.4e-3), (1.1e-3, 7.4e-3)))
    acceptance = AcceptanceModel({c: Tally(100.0 * r, 100.0) for c, r in
                                  {AR: 1.0, LINEAR: 3.0, PACKED: 2.5, BRANCHED: 2.6}.items()})
    return planner_lib.Planner(Engine(model), cost=cost, acceptance=acceptance,
                               candidates=SMALL, directory=tmp_path)


class _Decoded:   # what the planner reads of a DecodeResult
    def __init__(self, choice, iteration_s, iterations=100):
        p = choice.prediction
        c = p.candidate
        self.schedule, self.width, self.branches = c.schedule, c.width, c.branches
        self.tokens = [0] * round(p.tokens_per_iteration * iterations)
        self.iterations, self.accept_hist = iterations, [0, iterations]
        self.wall_s, self.compile_s = iteration_s * iterations, 0.0
        self.auto = choice.summary(families.FAMILIES["nemotron"])


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_the_choice_moves_when_decodes_show_another_is_faster(model, tmp_path):
    p = _planner(model, tmp_path)
    # Packed-SS, predicted fastest, runs at 1.5x its predicted seconds, the others as
    # predicted. Its decodes alone cannot tell a slow schedule from a slow machine (every
    # candidate is then predicted slower alike); exploring Branched-SS tells them apart.
    chosen = []
    for _ in range(4 * feedback.EXPLORE_EVERY):
        choice = p.choose(AUTO, 8)
        chosen.append((choice.candidate, choice.explored))
        slow = 1.5 if choice.candidate == PACKED else 1.0
        p.observe([_Decoded(choice, slow * choice.prediction.base_iteration_s)])
    n = feedback.EXPLORE_EVERY
    assert feedback.EARLY[0] == 2 and chosen[0] == (PACKED, False)
    # Explored early (a kind's first choices rest on the calibration alone): its offset
    # goes halfway (the calibration, which saw none, counts as one decode), which leaves
    # it inside the margin of Packed-SS. The other early choices and the 16th find it
    # run within FRESH decodes, and no other candidate close: Packed-SS is kept until the
    # next exploration of it.
    assert chosen[1] == (BRANCHED, True)
    assert chosen[2: 2 * n - 1] == [(PACKED, False)] * (2 * n - 3)
    assert chosen[2 * n - 1] == (BRANCHED, True)   # two thirds of the way: chosen from
    assert chosen[2 * n: 3 * n - 1] == [(BRANCHED, False)] * (n - 1)   # then on (2.6 /
    # 2.2 ms > 2.5 / 2.7 ms), and Packed-SS, still close, is explored in turn.
    assert chosen[3 * n - 1] == (PACKED, True)
    table = {row["candidate"]: row for row in p.feedback.table()}
    assert table[BRANCHED]["factor"] == pytest.approx(1.0, rel=0.05)
    assert table[PACKED]["factor"] == pytest.approx(1.5, rel=0.1)


def test_exploration_is_rare_close_and_the_runner_up_first(model, tmp_path):
    p = _planner(model, tmp_path)
    picks = [p.choose(AUTO, 8) for _ in range(4 * feedback.EXPLORE_EVERY)]
    explored = [c for c in picks if c.explored]   # the EARLY choices, then 1 in 16
    assert len(explored) == 4 + len(feedback.EARLY)
    assert [i + 1 for i, c in enumerate(picks) if c.explored][:4] == [2, 4, 8, 16]
    assert all(c.candidate != PACKED for c in explored)
    best = picks[0].predicted_tokens_per_s
    # Only candidates predicted within EXPLORE_WITHIN of the best (Branched-SS at 0.85x;
    # Linear-SS at 0.77x and AR at 0.65x are not).
    assert {c.candidate for c in explored} == {BRANCHED}
    assert all(c.predicted_tokens_per_s >= feedback.EXPLORE_WITHIN * best for c in explored)
    # Observed recently: no need to explore it again yet.
    p.observe([_Decoded(explored[0], explored[0].prediction.base_iteration_s)])
    picks = [p.choose(AUTO, 8) for _ in range(feedback.EXPLORE_EVERY)]
    assert not any(c.explored for c in picks)


def test_a_decode_that_compiled_is_not_timed(model, tmp_path):
    """A program's first run is slower than the rest by its setup: a decode that
    compiled (or read) its program teaches acceptance, never seconds."""
    p = _planner(model, tmp_path)
    choice = p.choose(AUTO, 8)
    first = _Decoded(choice, 30 * choice.prediction.base_iteration_s)
    first.compile_s = 4.0
    p.observe([first])
    assert p.feedback.ticks == 0 and p.feedback.factor(choice.candidate, choice.size) == 1.0
    assert p.acceptance.running[(choice.candidate, False)].iterations == first.iterations


def test_a_queue_refills_slots_only_when_it_has_more_prompts_than_slots(model, tmp_path):
    """decode_continuous with more prompts than slots refills them (every slot busy); with
    no more prompts than slots it is one batch whose rows idle (calibration's `busy`)."""
    import packed_ss_jax as ps

    p = _planner(model, tmp_path).attach()
    try:
        few = ps.decode_continuous(model, PROMPTS, slots=3, schedule="auto",
                                   max_new_tokens=4)[0]
        many = ps.decode_continuous(model, PROMPTS, slots=2, schedule="auto",
                                    max_new_tokens=4)[0]
        assert few[0].auto["refilled"] is False and few[0].auto["sequences"] == 3
        assert many[0].auto["refilled"] is True and many[0].auto["sequences"] == 2
    finally:
        p.detach()


def test_predictions_meet_what_decodes_then_take(model, tmp_path):
    """A machine 2.5x slower than at calibration, Packed-SS 3x: after 20 decodes the
    chosen candidate's predicted tokens/s is within 25 % of what its decodes make."""
    p = _planner(model, tmp_path)
    slower = {PACKED: 3.0}
    for _ in range(20):
        choice = p.choose(AUTO, 8)
        iteration_s = slower.get(choice.candidate, 2.5) * choice.prediction.base_iteration_s
        p.observe([_Decoded(choice, iteration_s)])
    choice = p.choose(AUTO, 8, explore=False)
    observed = choice.prediction.tokens_per_iteration / (
        slower.get(choice.candidate, 2.5) * choice.prediction.base_iteration_s)
    assert choice.predicted_tokens_per_s == pytest.approx(observed, rel=0.25)


PROMPTS = [[3, 5, 7, 2, 9], [4, 4, 6], [8, 2, 3, 5, 5, 6, 7]]


def _decodes(model, path: str, i: int, **sampling):
    """One call of `path` through auto: its results."""
    import packed_ss_jax as ps

    kw = dict(schedule="auto", max_new_tokens=8, **sampling)
    if path == "decode":
        return [ps.decode(model, PROMPTS[i % 3], **kw)]
    if path == "stream":
        return [list(ps.stream(model, PROMPTS[i % 3], chunk=3, **kw))[-1].result]
    if path == "batch":
        return ps.decode(model, PROMPTS, **kw)
    return ps.decode_continuous(model, PROMPTS, slots=2, **kw)[0]


@pytest.mark.parametrize("path", ["decode", "stream", "batch", "continuous"])
def test_every_path_stays_exact_while_the_choice_changes(model, tmp_path, path):
    """Exploration changes the candidate every 16th call of a kind: greedy output stays the
    reference's, and sampled output is the chosen schedule's with the same seed."""
    import packed_ss_jax as ps

    p = _planner(model, tmp_path).attach()
    try:
        want = {i: ps.decode(model, PROMPTS[i], schedule="ar", max_new_tokens=8).tokens
                for i in range(3)}
        used = set()
        for i in range(feedback.EXPLORE_EVERY + 1):
            results = _decodes(model, path, i)
            prompts = [i % 3] if len(results) == 1 else range(3)
            assert [r.tokens for r in results] == [want[k] for k in prompts]
            used.add(results[0].auto["label"])
        assert len(used) >= 2, used   # the best, and one explored
        for i in range(feedback.EXPLORE_EVERY + 1):
            results = _decodes(model, path, i, temperature=1.0, seed=i)
            r = results[0]
            shape = Candidate(r.schedule, r.width, r.branches).options(
                families.FAMILIES["nemotron"])
            fixed = _decodes_fixed(model, path, i, shape)
            assert [x.tokens for x in results] == [x.tokens for x in fixed]
    finally:
        p.detach()


def _decodes_fixed(model, path: str, i: int, shape: dict):
    import packed_ss_jax as ps

    options = DecodeOptions(max_new_tokens=8, temperature=1.0, seed=i, **shape)
    if path in ("decode", "stream"):
        return [ps.decode(model, PROMPTS[i % 3], options=options)]
    if path == "batch":
        return ps.decode(model, PROMPTS, options=options)
    return ps.decode_continuous(model, PROMPTS, slots=2, options=options)[0]
