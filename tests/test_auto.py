"""`schedule="auto"` (planner.py, acceptance.py): the rows each schedule's calls hold, the
acceptance model's running tally and its file, the choice (the fastest predicted
candidate; batch-aware; kept within a margin; only what fits; the request's own errors),
and decodes through it: exact (greedy equals the reference, sampled equals the chosen
schedule with the same seed), the choice in the result, the decodes fed back."""

import json
import logging
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import families, planner as planner_lib
from packed_ss_jax.acceptance import AcceptanceModel, Candidate, Tally
from packed_ss_jax.cost import CostModel
from packed_ss_jax.engine import Engine
from packed_ss_jax.nemotron import layouts
from packed_ss_jax.options import DecodeOptions
from packed_ss_jax.setdlm import layouts as setdlm_layouts
from packed_ss_jax.setdlm.state import Window
from packed_ss_jax.validate import InputError
from tiny import tiny_model

NEMOTRON = families.FAMILIES["nemotron"]
SETDLM = families.FAMILIES["setdlm"]
AR, LINEAR, PACKED = Candidate("ar", 1), Candidate("linear", 4), Candidate("packed", 4)
BRANCHED = Candidate("branched", 4, 2)
SMALL = (AR, LINEAR, PACKED, BRANCHED)
PROMPTS = [[3, 5, 7, 2, 9], [4, 4, 6], [8, 2, 3, 5, 5, 6, 7]]


@pytest.mark.parametrize("B", [2, 4, 7])
def test_nemotron_iteration_rows_are_the_layouts(B):
    x, c, draft = jnp.int32(0), jnp.int32(0), jnp.zeros(B - 1, jnp.int32)
    built = {"ar": [layouts.single(x, c)],
             "linear": [layouts.draft_block(x, c, B, 0), layouts.verify(x, draft, c)],
             "packed": [layouts.packed(x, draft, c, 0)],
             "quadratic": [layouts.quadratic(x, draft, c, 0)],
             "branched": [layouts.branched(x, draft, jnp.int32(B - 1), c, 0, 2)]}
    for schedule, calls in built.items():
        rows = tuple(int(call.tokens.shape[0]) for call in calls)
        assert NEMOTRON.iteration_rows(schedule, B, 2) == rows, schedule


@pytest.mark.parametrize("W", [1, 3, 4])
def test_setdlm_iteration_rows_are_the_layouts(W):
    w = Window(jnp.arange(W, dtype=jnp.int32), jnp.ones(W, bool), jnp.zeros(W, bool))
    pend = (jnp.int32(0), jnp.int32(0), jnp.int32(1))
    n, drafts, c_tok = jnp.int32(5), jnp.zeros(W, jnp.int32), jnp.zeros(W, jnp.int32)
    built = {"serial": [setdlm_layouts.serial(n, *pend, w, 9)],
             "native": [setdlm_layouts.native(n, c_tok, c_tok, jnp.int32(1), w, 9)],
             "linear": [setdlm_layouts.draft(n, *pend, w, 9), setdlm_layouts.verify(n, w, drafts, 9)],
             "packed": [setdlm_layouts.packed(n, *pend, w, drafts, 9)],
             "quadratic": [setdlm_layouts.quadratic(n, *pend, w, drafts, 9)],
             "branched": [setdlm_layouts.branched(n, *pend, w, drafts, 9, 2)]}
    for schedule, calls in built.items():
        rows = tuple(int(call.tokens.shape[0]) for call in calls)
        assert SETDLM.iteration_rows(schedule, W, 2) == rows, schedule


# --- the acceptance model ------------------------------------------------------------------

class _Result:   # what the acceptance model reads of a DecodeResult
    def __init__(self, tokens, iterations, hist):
        self.tokens, self.iterations, self.accept_hist = [0] * tokens, iterations, hist


def test_the_prior_weighs_as_its_iterations_and_running_decodes_join_it():
    m = AcceptanceModel({PACKED: Tally(300.0, 100.0, np.array([0, 50, 50]))},
                        prior_iterations=100)
    assert m.tokens_per_iteration(PACKED) == 3.0
    m.observe(PACKED, False, [_Result(100, 100, [0, 100])])   # a decode at 1 per iteration
    assert m.tokens_per_iteration(PACKED) == pytest.approx((300 + 100) / 200)
    assert m.tokens_per_iteration(PACKED, sampled=True) == 3.0   # sampled decodes apart
    row = next(r for r in m.table() if not r["sampled"])
    assert row["iterations"] == 100 and row["accept_hist"] == [0, 100]
    with pytest.raises(KeyError):
        m.tokens_per_iteration(LINEAR)


def test_histograms_of_several_lengths_add_up():
    t = Tally()
    t.add(3, 2, [1, 1])
    t.add(5, 2, [0, 1, 1, 1])
    assert t.accept_hist.tolist() == [1, 2, 1, 1] and (t.tokens, t.iterations) == (8, 4)


def test_the_prior_goes_to_json_and_back_and_broken_data_is_refused():
    m = AcceptanceModel({PACKED: Tally(30.0, 10.0, np.array([1, 2])), AR: Tally(5.0, 5.0)})
    back = AcceptanceModel.from_prior_json(json.loads(json.dumps(m.prior_json())))
    assert back.tokens_per_iteration(PACKED) == 3.0 and back.knows(AR)
    for bad in ([[["packed", 4, 1], 3, 0, []]], [[["packed", -4, 1], 3, 1, []]],
                [[["packed", 4, True], 3, 1, []]], [[7, 3, 1, []]], "x", [[1, 2]]):
        with pytest.raises(ValueError, match="malformed acceptance"):
            AcceptanceModel.from_prior_json(bad)


def test_a_batch_is_expected_to_idle_as_its_calibration_lengths_say():
    assert Tally(lengths=(10, 10, 10)).busy(8) == 1.0
    assert Tally(lengths=(5, 10)).busy(1) == 1.0 and Tally().busy(8) == 1.0
    # two draws of {5, 10}: the longer is 10 unless both are 5 (a quarter): 8.75 on average
    assert Tally(lengths=(5, 10)).busy(2) == pytest.approx(7.5 / 8.75)
    assert Tally(lengths=(1, 1, 1, 97)).busy(64) == pytest.approx(25 / 97, rel=1e-4)


def test_a_candidate_s_idling_follows_the_lengths_of_its_own_decodes():
    """The prompts a candidate is given decide how far apart a batch's rows finish: its
    decodes' iterations join the calibration's, the last LENGTHS_KEPT of them."""
    from packed_ss_jax import acceptance

    m = AcceptanceModel({PACKED: Tally(30.0, 10.0, lengths=(10, 10))})
    assert m.busy(PACKED, 8) == 1.0 and m.busy(AR, 8) == 1.0   # AR: never calibrated
    m.observe(PACKED, False, [_Result(15, 5, [0, 5]), _Result(60, 20, [0, 20])])
    assert m.busy(PACKED, 2) == pytest.approx(acceptance.busy((10, 10, 5, 20), 2))
    assert m.busy(PACKED, 2) < 1.0
    m.observe(PACKED, True, [_Result(30, 10, [0, 10])] * acceptance.LENGTHS_KEPT)
    assert m.busy(PACKED, 8) == pytest.approx(acceptance.busy((10, 10), 8)) == 1.0


def test_a_timed_prior_goes_to_json_and_back_and_broken_timing_is_refused():
    t = Tally(30.0, 10.0, np.array([1, 2]), seconds=0.5, positions=64, lengths=(4, 6),
              batch_s=0.3)
    back = AcceptanceModel.from_prior_json(json.loads(json.dumps(
        AcceptanceModel({PACKED: t}).prior_json()))).prior[PACKED]
    assert (back.seconds, back.positions, back.lengths, back.iteration_s) == (0.5, 64, (4, 6), 0.05)
    assert back.batch_iteration_s == pytest.approx(0.05)   # the batch ran the longest's 6
    assert Tally(30.0, 10.0).iteration_s is None and Tally(30.0, 10.0).batch_iteration_s is None
    # Files written before the KV positions had their own name called them "slots".
    legacy = [[["packed", 4, 1], 30.0, 10.0, [1, 2],
               {"seconds": 0.5, "slots": 64, "lengths": [4, 6], "batch_s": 0.3}]]
    assert AcceptanceModel.from_prior_json(legacy).prior[PACKED].positions == 64
    for timing in ({"seconds": -1, "positions": 1, "lengths": [], "batch_s": 0},
                   {"seconds": 1, "positions": 10 ** 400, "lengths": [], "batch_s": 0},
                   {"seconds": 1, "positions": 1, "lengths": [10 ** 400], "batch_s": 0},
                   {"seconds": 1, "positions": 1, "lengths": "12", "batch_s": 0},
                   {"seconds": "nan", "positions": 1, "lengths": [], "batch_s": 0},
                   {"seconds": 1, "positions": 1, "lengths": [-2], "batch_s": 0},
                   {"seconds": 1, "positions": 1, "lengths": [2], "batch_s": "inf"},
                   {"seconds": 1, "positions": 1, "lengths": []}, [1, 2, 3]):
        with pytest.raises(ValueError, match="malformed acceptance"):
            AcceptanceModel.from_prior_json([[["packed", 4, 1], 3, 1, [], timing]])
    with pytest.raises(ValueError, match="malformed acceptance"):
        AcceptanceModel.from_prior_json([[["packed", 4, 1], 3, 1, [], None, None]])


# --- choosing ----------------------------------------------------------------------------

def _cost():
    # 1 ms + 0.1 ms per row, whatever the cache size
    return CostModel("k", (1, 64), (64, 256), ((1.1e-3, 7.4e-3), (1.1e-3, 7.4e-3)))


def _acceptance(**rates):
    rates = {AR: 1.0, LINEAR: 3.0, PACKED: 2.5, BRANCHED: 2.6, **rates}
    return AcceptanceModel({c: Tally(100.0 * r, 100.0) for c, r in rates.items()})


def _planner(model, tmp_path, **rates):
    return planner_lib.Planner(Engine(model), cost=_cost(), acceptance=_acceptance(**rates),
                               candidates=SMALL, directory=tmp_path)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_the_fastest_predicted_candidate_is_chosen_and_batches_turn_speculation_off(
        model, tmp_path):
    p = _planner(model, tmp_path)
    one = p.choose(DecodeOptions(schedule="auto"), 8)
    # per iteration: AR 1 row (1.1 ms), Linear two of 4 (2.8 ms), Packed 8 (1.8 ms),
    # Branched 12 (2.2 ms)
    assert one.candidate == PACKED and one.predicted_tokens_per_s == pytest.approx(2.5 / 1.8e-3)
    assert [q.candidate for q in one.predictions] == [PACKED, BRANCHED, LINEAR, AR]
    eight = p.choose(DecodeOptions(schedule="auto"), 8, sequences=8)
    assert eight.candidate == AR and eight.predicted_tokens_per_s == pytest.approx(8 / 1.8e-3)
    assert one.summary(NEMOTRON)["label"] == "packed B=4" and eight.summary(NEMOTRON)["sequences"] == 8


def test_a_kept_choice_yields_only_past_the_margin(model, tmp_path):
    p = _planner(model, tmp_path)
    auto = DecodeOptions(schedule="auto")
    assert p.choose(auto, 8, explore=False).candidate == PACKED
    # Packed-SS's decodes accept less: Branched-SS now predicted 2-3 % faster: kept.
    p.observe([_auto_result(PACKED, tokens=2410, iterations=1000)])
    assert p.acceptance.tokens_per_iteration(PACKED) < 2.45
    assert p.choose(auto, 8, explore=False).candidate == PACKED
    p.observe([_auto_result(PACKED, tokens=1000, iterations=1000)])   # far slower: switch
    assert p.choose(auto, 8, explore=False).candidate == BRANCHED


def _auto_result(c, tokens, iterations, iteration_s=1e-3, base_s=1e-3, sequences=1):
    """A decode through auto of `c` that took `iteration_s` seconds per iteration where
    `base_s` was predicted."""
    r = _Result(tokens, iterations, [0, iterations])
    r.schedule, r.width, r.branches = c.schedule, c.width, c.branches
    r.wall_s, r.compile_s = iteration_s * iterations, 0.0
    r.auto = {"sampled": False, "sequences": sequences, "base_iteration_s": base_s,
              "busy": 1.0, "explored": False, "refilled": False}
    return r


def test_only_what_the_request_allows_and_fits_is_a_candidate(model, tmp_path):
    p = _planner(model, tmp_path)
    # A given width keeps that width (and the reference); given branches, Branched-SS.
    assert p.choose(DecodeOptions(schedule="auto", width=4, branches=2), 8).candidate \
        == BRANCHED
    with pytest.raises(InputError, match="no speculative candidate has block_size 8"):
        p.choose(DecodeOptions(schedule="auto", width=8), 8)   # not among its own
    # Sampling keeps the sampled schedules; a cache of 3 slots fits no B = 4 block.
    assert p.choose(DecodeOptions(schedule="auto", temperature=0.5), 8).sampled
    assert p.choose(DecodeOptions(schedule="auto", cache_size=3, max_new_tokens=2),
                    1).candidate == AR


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1.0), "temperature"), (dict(cache_size=0), "cache_size"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_p=2.0), "top_p")])
def test_the_request_s_own_errors_are_its_own(model, tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        _planner(model, tmp_path).choose(DecodeOptions(schedule="auto", **options), 8)


def test_nothing_fits_is_said(model, tmp_path):
    p = planner_lib.Planner(Engine(model), cost=_cost(), acceptance=_acceptance(),
                            candidates=(PACKED,), directory=tmp_path)
    with pytest.raises(InputError, match="no candidate schedule fits"):
        p.choose(DecodeOptions(schedule="auto", cache_size=3, max_new_tokens=2), 1)


def test_the_candidates_are_exact_and_follow_the_request():
    every = planner_lib.default_candidates(NEMOTRON)
    assert every[0] == AR and {c.schedule for c in every} == set(NEMOTRON.schedules)
    assert {c.schedule for c in planner_lib.default_candidates(SETDLM)} == {
        "serial", "linear", "packed", "quadratic", "branched"}   # not native
    assert planner_lib.default_candidates(NEMOTRON, width=16) == (
        AR, Candidate("linear", 16), Candidate("quadratic", 16), Candidate("packed", 16),
        Candidate("branched", 16, 2))
    assert planner_lib.default_candidates(NEMOTRON, branches=3) == (
        AR, Candidate("branched", 8, 3), Candidate("branched", 16, 3))


# --- decoding through it --------------------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated(model, tmp_path_factory):
    """The tiny model's engine with a planner calibrated on a few prompts (the real
    measurement: the cost model's forwards, then each candidate's decodes)."""
    engine = Engine.of(model)
    folder = tmp_path_factory.mktemp("calibration")
    p = planner_lib.Planner(engine, candidates=SMALL, directory=folder).attach()
    p.calibrate(PROMPTS, max_new_tokens=12)
    yield p
    p.detach()


def test_timed_calibrations_scale_one_sequence_and_batches_idle(model, tmp_path):
    """A candidate's calibration decodes took 3x the cost model's calls per iteration:
    one sequence is predicted at that; a batch keeps the cost model, at the share of
    row-iterations its lengths leave busy; refilled slots are all busy."""
    p = _planner(model, tmp_path)
    base = p.predict(PACKED, 1, 64, False)
    # Timings too small to divide by predict as the cost model does, never break it.
    p.acceptance.add_prior(PACKED, Tally(250.0, 100.0, seconds=5e-324, positions=64,
                                         lengths=(50, 50, 100), batch_s=5e-324))
    for n in (1, 8):
        assert p.predict(PACKED, n, 64, False).base_iteration_s == pytest.approx(
            p._iteration_s(PACKED, n, 64))
    p.acceptance.add_prior(PACKED, Tally(250.0, 100.0, seconds=100 * 3 * 1.8e-3, positions=64,
                                         lengths=(50, 50, 100)))
    one = p.predict(PACKED, 1, 64, False)
    assert one.base_iteration_s == pytest.approx(3 * base.base_iteration_s)
    assert one.tokens_per_s == pytest.approx(base.tokens_per_s / 3) and one.busy == 1.0
    eight = p.predict(PACKED, 8, 64, False)
    busy = Tally(lengths=(50, 50, 100)).busy(8)
    assert eight.busy == busy < 0.7 and eight.base_iteration_s == pytest.approx(
        p._iteration_s(PACKED, 8, 64))
    assert eight.tokens_per_s == pytest.approx(8 * 2.5 * busy / eight.iteration_s)
    assert p.predict(PACKED, 8, 64, False, refilled=True).busy == 1.0
    # Timed as one batch of its three too, at 2x the cost model's calls: three sequences
    # and more predicted at that, two between the two (log-linearly in the number).
    p.acceptance.add_prior(PACKED, Tally(250.0, 100.0, seconds=100 * 3 * 1.8e-3, positions=64,
                                         lengths=(50, 50, 100),
                                         batch_s=100 * 2 * p._iteration_s(PACKED, 3, 64)))
    for n in (3, 8):
        assert p.predict(PACKED, n, 64, False).base_iteration_s == pytest.approx(
            2 * p._iteration_s(PACKED, n, 64))
    assert p.predict(PACKED, 2, 64, False).base_iteration_s == pytest.approx(
        3 * (2 / 3) ** (math.log(2) / math.log(3)) * p._iteration_s(PACKED, 2, 64))
    p.acceptance.add_prior(PACKED, Tally(250.0, 100.0, seconds=100 * 3 * 1.8e-3, positions=64,
                                         lengths=(50, 50, 100)))
    # What a batch's rows then idle corrects the prediction beside its seconds.
    choice = planner_lib.Choice(PACKED, eight.tokens_per_s, 8, False, (eight,))
    rows = [_Batched(choice, n, eight.base_iteration_s) for n in (50, 50, 100, 100)]
    p.observe(rows)   # busier (75 of 100) than predicted: faster per row by that
    assert p.feedback.factor(PACKED, (8, False)) == pytest.approx(busy / 0.75)
    p.feedback = type(p.feedback)()
    p.observe([_Batched(choice, n, eight.base_iteration_s) for n in (10, 100)])
    assert p.feedback.factor(PACKED, (8, False)) == pytest.approx(busy / 0.55)


class _Batched:   # what the planner reads of one row of a batched DecodeResult
    def __init__(self, choice, iterations, iteration_s, longest=100):
        c = choice.candidate
        self.schedule, self.width, self.branches = c.schedule, c.width, c.branches
        self.tokens, self.iterations, self.accept_hist = [0] * iterations, iterations, [0]
        self.wall_s = iteration_s * longest   # the batch's: its longest row's iterations
        self.compile_s = 0.0
        self.auto = choice.summary(NEMOTRON)


def test_calibration_is_kept_on_disk_and_read_back(model, calibrated, monkeypatch):
    folder = calibrated.directory
    files = sorted(f.name for f in folder.iterdir() if f.name.startswith("acceptance-"))
    assert len(files) == len(SMALL) and len(list(folder.iterdir())) == len(SMALL) + 1  # + cost
    assert set(calibrated.acceptance.prior) == set(SMALL)
    assert all(t.iterations > 0 for t in calibrated.acceptance.prior.values())
    # Each prompt decoded alone and timed: one length per prompt, seconds, the positions read.
    assert all(len(t.lengths) == len(PROMPTS) and sum(t.lengths) == t.iterations
               and t.iteration_s > 0 and t.positions > 0 and t.batch_iteration_s > 0
               for t in calibrated.acceptance.prior.values())
    again = planner_lib.Planner(Engine(model), candidates=SMALL, directory=folder)
    monkeypatch.setattr(again, "_decode", lambda c: pytest.fail("decoded again"))
    again.calibrate(PROMPTS, max_new_tokens=12)
    assert again.acceptance.prior_json() == calibrated.acceptance.prior_json()
    # A broken file, another candidate's file, or other prompts: measured anew.
    decoded = []
    monkeypatch.setattr(again, "_decode", lambda c: decoded.append(c) or Tally(1.0, 1.0))
    (folder / files[0]).write_text("{not json")
    (folder / files[1]).write_text((folder / files[2]).read_text())
    again = planner_lib.Planner(Engine(model), candidates=SMALL, directory=folder)
    monkeypatch.setattr(again, "_decode", lambda c: decoded.append(c) or Tally(1.0, 1.0))
    again.calibrate(PROMPTS, max_new_tokens=12)
    assert len(decoded) == 2
    again.calibrate(PROMPTS[:1], max_new_tokens=12, candidates=[AR])
    assert len(decoded) == 3 and set(again.acceptance.prior) == {AR}


def test_a_request_calibrates_only_the_candidates_it_may_use(model, tmp_path, monkeypatch):
    p = planner_lib.Planner(Engine(model), cost=_cost(), candidates=SMALL, directory=tmp_path)
    decoded = []
    monkeypatch.setattr(p, "_decode", lambda c: decoded.append(c) or Tally(2.0, 1.0))
    p.choose(DecodeOptions(schedule="auto", width=4, branches=2), 8)
    assert sorted(decoded) == sorted([AR, BRANCHED])
    p.choose(DecodeOptions(schedule="auto"), 8)
    assert sorted(decoded) == sorted(SMALL)   # each once


def test_auto_decodes_exactly_and_says_what_it_chose(model, calibrated):
    want = ps.decode(model, PROMPTS[0], schedule="ar", max_new_tokens=20)
    got = ps.decode(model, PROMPTS[0], schedule="auto", max_new_tokens=20)
    assert got.tokens == want.tokens
    assert got.auto["schedule"] == got.schedule and got.auto["candidates"] == len(SMALL)
    assert got.auto["predicted_tokens_per_s"] > 0 and got.auto["sequences"] == 1
    chosen = Candidate(got.schedule, got.width, got.branches)
    assert chosen in SMALL and got.auto["label"] == chosen.label(NEMOTRON)
    seen = calibrated.acceptance.running[(chosen, False)]
    assert seen.iterations >= got.iterations   # fed back
    batch = ps.decode(model, PROMPTS, schedule="auto", max_new_tokens=20)
    assert [r.tokens for r in batch] == [r.tokens for r in ps.decode(
        model, PROMPTS, schedule="ar", max_new_tokens=20)]
    assert {r.auto["sequences"] for r in batch} == {3}
    streamed = list(ps.stream(model, PROMPTS[0], schedule="auto", max_new_tokens=20, chunk=3))
    assert sum((c.tokens for c in streamed), []) == want.tokens
    assert streamed[-1].result.auto is not None
    queued, _ = ps.decode_continuous(model, PROMPTS, slots=2, schedule="auto", max_new_tokens=20)
    assert [r.tokens for r in queued] == [r.tokens for r in batch]
    assert {r.auto["sequences"] for r in queued} == {2}


def test_sampled_auto_is_the_chosen_schedule_with_the_same_seed(model, calibrated):
    got = ps.decode(model, PROMPTS[1], schedule="auto", temperature=1.0, seed=7,
                    max_new_tokens=16)
    assert got.auto["sampled"]
    chosen = Candidate(got.schedule, got.width, got.branches)
    fixed = ps.decode(model, PROMPTS[1], options=DecodeOptions(
        temperature=1.0, seed=7, max_new_tokens=16, **chosen.options(NEMOTRON)))
    assert got.tokens == fixed.tokens


def test_a_decoder_function_names_its_schedule(model):
    with pytest.raises(InputError, match="auto"):
        ps.decoder(model, schedule="auto")


def test_a_server_on_auto_decodes_with_its_choice_and_reports_it():
    import openai

    from packed_ss_jax.server import create_app
    from servers import in_process, request

    model = ps.load("nld-tiny")
    packed8 = Candidate("packed", 8)
    flat = CostModel("k", (1, 64), (64,), ((1e-3, 1e-3),))   # rows cost nothing here
    planner_lib.Planner(Engine.of(model), cost=flat, candidates=(AR, packed8),
                        acceptance=AcceptanceModel({AR: Tally(10.0, 10.0),
                                                    packed8: Tally(30.0, 10.0)})).attach()
    app = create_app(model, "nld-tiny", schedule="auto", max_model_len=48, slots=2)
    assert app.app.state.auto["label"] == "packed B=8"
    assert app.app.state.auto["predicted_tokens_per_s"] == pytest.approx(2 * 3.0 / 1e-3)
    prompt = "Question: Ava has 4 apples. She gets 3 more. How many?\nAnswer:"
    with in_process(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120)
        got = client.completions.create(model="nld-tiny", prompt=prompt, max_tokens=8,
                                        temperature=0)
        code, metrics = request(url, "GET", "/metrics")
    want = ps.decode(model, prompt, schedule="packed", block_size=8, max_new_tokens=8)
    assert got.model_extra["packed_ss"]["token_ids"] == want.tokens
    assert code == 200
    assert 'packed_ss_schedule{schedule="packed B=8"} 1.0' in metrics
    assert "packed_ss_auto_predicted_tokens_per_second 6000.0" in metrics
    kept = {int(k): float(n) for k, n in re.findall(
        r'packed_ss_iterations_by_accepted_total\{tokens="(\d+)"\} ([\d.]+)', metrics)}
    assert kept and sum(k * n for k, n in kept.items()) == len(want.tokens)


def _kept_calibration(folder, model, rates: dict[Candidate, float]):
    """Calibration files for `model` in `folder`, as a run of `auto` with these rates
    (and calls of 1 ms + 0.1 ms per row) would have left them."""
    from packed_ss_jax import cost

    flat = CostModel(cost.calibration_id(model), (1, 64), (64, 256), ((1.1e-3, 7.4e-3),) * 2)
    cost.write_json(folder / f"{flat.calibration_id}.json", flat.to_json())
    p = planner_lib.Planner(Engine(model), directory=folder, cost=flat)
    p._decode = lambda c: Tally(10.0 * rates.get(c, 1.0), 10.0)
    p._ensure(p.candidates)


def test_generate_on_auto_reads_the_kept_calibration_and_says_its_choice(
        tmp_path, monkeypatch, capsys):
    from packed_ss_jax import cli

    _kept_calibration(tmp_path, ps.load(), {Candidate("packed", 8): 3.0})
    monkeypatch.setenv("PACKED_SS_COST_DIR", str(tmp_path))
    files = sorted(tmp_path.iterdir())
    assert cli.main(["generate", "--ids", "5,9,13,2", "--schedule", "auto",
                     "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert "auto chose packed B=8 (predicted " in out and "| packed (B=8) |" in out
    assert "calibrating auto" not in err   # every candidate read back, nothing decoded
    assert sorted(tmp_path.iterdir()) == files


def test_setdlm_on_auto_is_exact_and_refuses_another_order(tmp_path):
    from test_setdlm_decode import tiny_setdlm

    model = tiny_setdlm(3)
    serial, linear, branched = (Candidate("serial", 1), Candidate("linear", 3),
                                Candidate("branched", 3, 2))
    planner_lib.Planner(Engine.of(model), candidates=(serial, linear, branched),
                        directory=tmp_path).attach()
    prompt = [3, 5, 7, 2, 9, 4]
    want = ps.decode(model, prompt, schedule="serial", max_new_tokens=16).tokens
    got = ps.decode(model, prompt, schedule="auto", max_new_tokens=16)
    assert got.tokens == want and got.auto["candidates"] == 3
    sampled = ps.decode(model, prompt, schedule="auto", temperature=1.0, seed=3,
                        max_new_tokens=16)
    c = Candidate(sampled.schedule, sampled.width, sampled.branches)
    assert sampled.tokens == ps.decode(model, prompt, options=DecodeOptions(
        temperature=1.0, seed=3, max_new_tokens=16, **c.options(SETDLM))).tokens
    with pytest.raises(InputError, match="in order 'ltr' only"):
        ps.decode(model, prompt, schedule="auto", order="confidence")
    with pytest.raises(InputError, match="block_size"):
        ps.decode(model, prompt, schedule="auto", block_size=4)


@pytest.mark.parametrize("options, message", [
    (dict(width=1), "block_size"), (dict(width=-3), "block_size"),
    (dict(width="8"), "block_size"), (dict(branches=0), "branches"),
    (dict(width=4, branches=5), "branches"), (dict(order="confidence"), "'ltr' only")])
def test_a_width_or_branches_given_with_auto_are_checked_not_dropped(model, tmp_path, options,
                                                                     message):
    with pytest.raises((InputError, TypeError), match=message):
        _planner(model, tmp_path).choose(DecodeOptions(schedule="auto", **options), 8)


def test_auto_reads_stop_strings_with_the_model_s_tokenizer(tmp_path, monkeypatch):
    model = ps.load()
    _kept_calibration(tmp_path, model, {Candidate("packed", 8): 3.0})
    monkeypatch.setenv("PACKED_SS_COST_DIR", str(tmp_path))
    prompt = "Question: Ava has 12 apples. Ava gets 7 more apples. How many apples?\nAnswer:"
    got = ps.decode(model, prompt, schedule="auto", stop_sequences=["####"], max_new_tokens=64)
    want = ps.decode(model, prompt, schedule="packed", block_size=8, stop_sequences=["####"],
                     max_new_tokens=64)
    assert got.auto["label"] == "packed B=8" and got.finish_reason == "stop"
    assert (got.tokens, got.text, got.stop_at) == (want.tokens, want.text, want.stop_at)


def test_a_width_or_k_off_the_default_grid_gets_candidates_of_its_own(model, tmp_path,
                                                                       monkeypatch):
    p = planner_lib.Planner(Engine(model), cost=_cost(), directory=tmp_path)
    monkeypatch.setattr(p, "_decode", lambda c: Tally(2.0, 1.0))
    twelve = p.choose(DecodeOptions(schedule="auto", width=12), 8)
    assert {q.candidate for q in twelve.predictions} == {
        AR, Candidate("linear", 12), Candidate("quadratic", 12), Candidate("packed", 12),
        Candidate("branched", 12, 2)}
    three = p.choose(DecodeOptions(schedule="auto", branches=3), 8)
    assert {q.candidate for q in three.predictions} == {
        AR, Candidate("branched", 8, 3), Candidate("branched", 16, 3)}
    with pytest.raises(InputError, match="no speculative candidate has branches 20"):
        p.choose(DecodeOptions(schedule="auto", branches=20), 8)


@pytest.mark.parametrize("text", [
    '{"version": 1, "prior": [[["packed", 4, 1], 1e400, 1.0, []]]}',
    '{"version": 1, "prior": [[["packed", 4, 1], 3.0, 1.0, [100000000000000000000000000000]]]}',
    '{"version": 1, "prior": [[["packed", 4, 1], 3.0, 1.0, [-1]]]}',
    '{"version": 1, "prior": [[["packed", 4, 1], 1' + "0" * 400 + ', 1.0, []]]}',
    '{"version": 1, "prior": ' + "[" * 100000 + "]" * 100000 + '}'])
def test_a_hostile_acceptance_file_is_measured_anew(model, tmp_path, text):
    p = planner_lib.Planner(Engine(model), cost=_cost(), candidates=(AR, PACKED),
                            directory=tmp_path)
    p._decode = lambda c: Tally(2.0, 1.0)
    p.calibrate([[3, 4]], candidates=[PACKED])
    (path,) = tmp_path.iterdir()
    path.write_text(text)
    again = planner_lib.Planner(Engine(model), cost=_cost(), candidates=(AR, PACKED),
                                directory=tmp_path)
    again._decode = lambda c: Tally(5.0, 1.0)
    again.calibrate([[3, 4]], candidates=[PACKED])
    assert again.acceptance.tokens_per_iteration(PACKED) == 5.0   # measured, and kept
    assert json.loads(path.read_text())["prior"][0][1] == 5.0


@pytest.mark.parametrize("damage", ["oversized", "world-writable", "fifo"])
def test_an_oversized_or_open_acceptance_file_is_one_warning_and_measured_anew(
        model, tmp_path, caplog, damage):
    p = planner_lib.Planner(Engine(model), cost=_cost(), candidates=(AR, PACKED),
                            directory=tmp_path)
    p._decode = lambda c: Tally(2.0, 1.0)
    p.calibrate([[3, 4]], candidates=[PACKED])
    (path,) = tmp_path.iterdir()
    if damage == "world-writable":
        path.chmod(0o666)
    else:
        path.unlink()
        if damage == "fifo":
            os.mkfifo(path)
        else:   # 16 GB, sparse: read whole it would not fit in memory
            with open(path, "wb") as f:
                f.truncate(16 << 30)
    again = planner_lib.Planner(Engine(model), cost=_cost(), candidates=(AR, PACKED),
                                directory=tmp_path)
    again._decode = lambda c: Tally(5.0, 1.0)
    with caplog.at_level(logging.WARNING):
        again.calibrate([[3, 4]], candidates=[PACKED])
    assert again.acceptance.tokens_per_iteration(PACKED) == 5.0   # measured anew
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), caplog.text
