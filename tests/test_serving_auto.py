"""A server on schedule "auto" learns between launches and moves to another choice while
serving (serving_auto.py, client.py): every request, before, during and after the move,
gets the reference's greedy tokens, or with a seed the tokens its reported schedule
gives with that seed; /metrics names the schedule in use."""

import concurrent.futures
import time

import pytest

import packed_ss_jax as ps
from packed_ss_jax import feedback, planner as planner_lib, serving_auto
from packed_ss_jax.acceptance import AcceptanceModel, Candidate, Tally
from packed_ss_jax.cost import CostModel
from packed_ss_jax.engine import Engine
from packed_ss_jax.server import create_app
from servers import in_process, request

AR, PACKED = Candidate("ar", 1), Candidate("packed", 8)
PROMPTS = [f"Question: Ava has {i} apples. She gets 3 more. How many?\nAnswer:"
           for i in range(2, 8)]


def _ask(url: str, i: int) -> dict:
    body = {"model": "nld-tiny", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8,
            "temperature": 0 if i % 2 == 0 else 0.8, "seed": i}
    code, reply = request(url, "POST", "/v1/completions", body, timeout=300)
    assert code == 200, reply
    return {"i": i, **body, **reply["packed_ss"]}


def _wanted(model, r: dict) -> list[int]:
    shape = {"schedule": "ar"} if r["schedule"] == "ar" else {"schedule": "packed",
                                                               "block_size": 8}
    return ps.decode(model, r["prompt"], max_new_tokens=8, temperature=r["temperature"],
                     seed=r["seed"], **shape).tokens


def test_a_server_moves_to_a_better_choice_and_every_request_stays_exact(monkeypatch):
    monkeypatch.setattr(serving_auto, "REPLAN_EVERY", 2)
    monkeypatch.setattr(feedback, "EXPLORE_EVERY", 10**6)   # one move, the one asked for
    monkeypatch.setattr(feedback, "EARLY", ())
    model = ps.load("nld-tiny")
    flat = CostModel("k", (1, 64), (64,), ((1e-3, 1e-3),))   # rows cost nothing here
    # The priors outweigh what the server's own requests add (they decide the move).
    planner = planner_lib.Planner(
        Engine.of(model), cost=flat, candidates=(AR, PACKED),
        acceptance=AcceptanceModel({AR: Tally(10.0, 10.0), PACKED: Tally(30.0, 10.0)},
                                   prior_iterations=10**9)).attach()
    try:
        app = create_app(model, "nld-tiny", schedule="auto", max_model_len=48, slots=2,
                         steps=1)
        assert app.app.state.auto["label"] == "packed B=8"
        decoder = app.app.state.decoder
        with in_process(app) as url, concurrent.futures.ThreadPoolExecutor(3) as pool:
            before = [_ask(url, i) for i in range(2)]
            # The server's requests turn out to accept few drafts: AR now wins.
            planner.acceptance.add_prior(PACKED, Tally(4.0, 10.0))
            during, i, deadline = [], 2, time.monotonic() + 240
            while decoder.label != "ar":
                assert time.monotonic() < deadline, "auto never moved"
                during += pool.map(lambda j: _ask(url, j), range(i, i + 3))
                i += 3
            after = list(pool.map(lambda j: _ask(url, j), range(i, i + 3)))
            metrics = request(url, "GET", "/metrics")[1]
    finally:
        planner.detach()
    assert {r["schedule"] for r in before} == {"packed"}
    assert {r["schedule"] for r in after} == {"ar"}
    assert 'packed_ss_schedule{schedule="ar"} 1.0' in metrics
    assert 'schedule="packed B=8"' not in metrics
    for r in before + during + after:
        assert r["token_ids"] == _wanted(model, r), r
    greedy = [r for r in before + during + after if r["temperature"] == 0]
    assert {tuple(r["token_ids"]) for r in greedy} == {
        tuple(ps.decode(model, r["prompt"], schedule="ar", max_new_tokens=8).tokens)
        for r in greedy}
    # What the server learnt: its launches' seconds per iteration beside the cost
    # model's, those of each choice under its own name.
    table = {row["candidate"]: row for row in planner.feedback.table()}
    assert table[PACKED]["observations"] >= 2 and table[AR]["observations"] >= 1


def _flat_planner(model):
    """A planner of AR and Packed-SS B=8 whose calls cost 1 ms whatever their size."""
    flat = CostModel("k", (1, 64), (64,), ((1e-3, 1e-3),))
    return planner_lib.Planner(
        Engine.of(model), cost=flat, candidates=(AR, PACKED),
        acceptance=AcceptanceModel({AR: Tally(10.0, 10.0), PACKED: Tally(30.0, 10.0)})).attach()


@pytest.mark.parametrize("seconds", [0.0, float("nan"), -1.0])
def test_nonsense_timings_of_a_launch_change_nothing(seconds):
    model = ps.load("nld-tiny")
    planner = _flat_planner(model)
    try:
        auto = serving_auto.ServingAuto(model, 48, None, 2)
        for _ in range(serving_auto.REPLAN_EVERY - 1):
            assert auto.launched(seconds, 4) is None
        assert auto.launched(seconds, 4).candidate == PACKED   # chosen again: the same
        assert planner.feedback.ticks == 0 and auto.choice.candidate == PACKED
    finally:
        planner.detach()


def test_the_first_timed_launch_of_an_explored_choice_places_it():
    """A server's explored choice moves its candidate's offset once (its first timed
    launch); its later launches, and those of a kept choice, move the machine's drift."""
    model = ps.load("nld-tiny")
    planner = _flat_planner(model)
    try:
        auto = serving_auto.ServingAuto(model, 48, None, 2)
        size = auto.choice.size
        assert size == (2, True) and not auto.choice.explored
        base = auto.choice.prediction.base_iteration_s
        auto.launched(4 * base * 2, 4)             # PACKED, kept: the drift is 2x
        auto.moved(planner_lib.Choice(AR, 1.0, 2, True, auto.choice.predictions,
                                      explored=True, refilled=True))
        ar = auto.choice.prediction.base_iteration_s
        auto.launched(4 * ar * 2, 4)               # AR's first: its place, 1x the drift
        auto.moved(planner_lib.Choice(AR, 1.0, 2, True, auto.choice.predictions,
                                      explored=True, refilled=True))
        auto.launched(4 * ar * 6, 4)               # explored again at 3x: the mean of
        # the calibration's (none), the first's (none) and this one's
        assert planner.feedback.factor(AR, size) == pytest.approx(2 * 3 ** (1 / 3))
        auto.launched(4 * ar * 6, 4)               # its second launch: the drift moves
        assert planner.feedback.factor(PACKED, size) > 2.0
    finally:
        planner.detach()
