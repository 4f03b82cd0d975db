"""Batched decoding: per prompt, a batch gives what that prompt decoded alone gives.

Every schedule of both families, greedy and sampled (each prompt its own seed), in
batches that mix prompt lengths and where sequences stop at different times (EOS, stop
markers) or run to the length limit. The prompts share one bucket and one cache size
with the alone decodes, and the single-sequence programs are those of
tests/test_cache_in_place.py and tests/test_setdlm_decode.py (same config, width, cache
size and bucket), so in one test process each case compiles only its batched program;
one test per family mixes buckets.
"""

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import families
from packed_ss_jax.validate import InputError
from test_setdlm_decode import tiny_setdlm
from tiny import tiny_model

MAX_NEW = 12
SEEDS = [11, 12, 13, 14]

# Prompts of 2, 5, 9 and 13 tokens and stop rules under which, on these fixtures, some
# sequences stop early, at different iterations, and others run to MAX_NEW (checked by
# `_ragged` for the greedy cases, so a fixture change cannot quietly test less).
NEMOTRON = dict(
    model=lambda: tiny_model(0),
    prompts=[[9, 7], [6, 4, 4, 2, 2], [2, 3, 9, 7, 10, 6, 7, 10, 8],
             [7, 6, 7, 10, 4, 9, 8, 2, 5, 9, 6, 2, 8]],
    options=dict(block_size=4, eos_id=8, cache_size=96))
SETDLM = dict(
    model=lambda: tiny_setdlm(0),
    prompts=[[8, 9], [3, 2, 9, 2, 6], [2, 4, 6, 5, 5, 2, 2, 3, 2],
             [8, 6, 7, 4, 7, 8, 5, 6, 10, 9, 10, 5, 8]],
    options=dict(window=3, eos_id=10, stop_sequences=[[4, 4]], cache_size=64))
SETUPS = {"nemotron": NEMOTRON, "setdlm": SETDLM}


def _cases():
    out = []
    for f in families.FAMILIES.values():
        for s in f.schedules:
            out.append((f.name, s, "ltr", 0.0))
            if s in f.sampled:
                out.append((f.name, s, "ltr", 1.0))
    # Any-order verification (greedy only): once, it shares the batched machinery.
    out += [(f.name, "packed", o, 0.0) for f in families.FAMILIES.values() for o in f.orders[1:]]
    return out


def _same(alone, batched):
    assert batched.tokens == alone.tokens
    assert (batched.nfe, batched.iterations, batched.prompt_len) == (
        alone.nfe, alone.iterations, alone.prompt_len)
    np.testing.assert_array_equal(batched.accept_hist, alone.accept_hist)
    assert (batched.rows, batched.max_rows, batched.orders, batched.accepted, batched.fed) == (
        alone.rows, alone.max_rows, alone.orders, alone.accepted, alone.fed)


def _ragged(results):
    lengths = [len(r.tokens) for r in results]
    assert MAX_NEW in lengths and min(lengths) < MAX_NEW, lengths
    assert len(set(r.iterations for r in results)) > 1


@pytest.mark.parametrize("family,schedule,order,temperature", _cases())
def test_batch_equals_each_prompt_alone(family, schedule, order, temperature):
    setup = SETUPS[family]
    m = setup["model"]()
    kw = dict(schedule=schedule, max_new_tokens=MAX_NEW, order=order,
              temperature=temperature, **setup["options"])
    prompts = setup["prompts"]
    alone = [ps.decode(m, p, seed=s, **kw) for p, s in zip(prompts, SEEDS)]
    batch = ps.decode(m, prompts, seed=SEEDS, **kw)
    assert isinstance(batch, list) and len(batch) == len(prompts)
    for a, b in zip(alone, batch):
        _same(a, b)
    if temperature == 0.0 and schedule != "native":
        _ragged(alone)


@pytest.mark.parametrize("family", sorted(SETUPS))
def test_batch_mixes_prompt_buckets(family):
    """A 20-token prompt (bucket 32) in a batch with short ones (bucket 16): the short
    ones are padded further than alone, and the cache is sized for the longest."""
    setup = SETUPS[family]
    m = setup["model"]()
    long = (setup["prompts"][3] * 2)[:20]
    prompts = [setup["prompts"][0], long, setup["prompts"][1]]
    kw = dict(schedule="packed", max_new_tokens=MAX_NEW, **setup["options"])
    alone = [ps.decode(m, p, **kw) for p in prompts]
    batch = ps.decode(m, prompts, **kw)
    for a, b in zip(alone, batch):
        _same(a, b)


def test_one_seed_for_every_prompt_and_checked_arguments():
    m = NEMOTRON["model"]()
    kw = dict(schedule="packed", max_new_tokens=MAX_NEW, temperature=1.0, **NEMOTRON["options"])
    prompts = [p[:2] for p in NEMOTRON["prompts"]]  # a 2-D array of ids is a batch too
    batch = ps.decode(m, np.asarray(prompts), seed=SEEDS[0], **kw)
    for p, b in zip(prompts, batch):
        _same(ps.decode(m, p, seed=SEEDS[0], **kw), b)
    with pytest.raises(InputError, match="2 seeds for 3 prompts"):
        ps.decode(m, [[2], [3], [4]], seed=[1, 2], **kw)
    with pytest.raises(InputError, match="prompt"):
        ps.decode(m, [[2], []], **kw)
    with pytest.raises(InputError, match="prompts must be a non-empty list"):
        ps.Engine.of(m).batch([], ps.DecodeOptions(schedule="packed"))


def test_bench_batches_give_each_prompts_tokens():
    """`bench --batch-size`: prompts decoded in static batches, and in a continuous queue
    of slots, give the tokens and NFE they give one at a time; the batch size, the way of
    batching and each response's share of the batched forward calls are reported."""
    from packed_ss_jax.bench import harness, tasks

    model = ps.load()  # the embedded model: the task prompts need its tokenizer
    prompts = tasks.load("arithmetic", None, 4)
    assert harness.batches(prompts, 3) == [[0, 1, 2], [3]]
    # tests/test_benchmarks.py's single-prompt program (capacity, width).
    kw = dict(capacity=256, max_new_tokens=12, split=None, progress=False)
    one = harness.run(model, prompts, ["packed"], {"packed": 4}, **kw)["packed"]
    two = harness.run(model, prompts, ["packed"], {"packed": 4}, batch_size=2,
                      batching="static", **kw)["packed"]
    assert two["tokens"] == one["tokens"] and two["nfe"] == one["nfe"]
    assert sum(two["calls"]) == sum(max(two["nfe"][i:i + 2]) for i in (0, 2))
    queue = harness.run(model, prompts, ["packed"], {"packed": 4}, batch_size=2,
                        **kw)["packed"]
    assert queue["tokens"] == one["tokens"] and queue["nfe"] == one["nfe"]
    # Two slots: every batched call serves one or two sequences.
    assert sum(one["nfe"]) / 2 <= sum(queue["calls"]) <= sum(one["nfe"])
    for per, way in ((two, "static"), (queue, "continuous")):
        summary = harness.summarize("fixture", "arithmetic", {"packed": per}, {"packed": 4},
                                    4, resamples=10, batch_size=2, batching=way)
        assert summary["batch_size"] == 2 and summary["batching"] == way
        assert f"| packed | 4 | 2 {way} | - |" in harness.markdown(summary)
    with pytest.raises(ValueError, match="batch_size"):
        harness.run(model, prompts, ["packed"], {"packed": 4}, batch_size=0, **kw)
    with pytest.raises(ValueError, match="batching"):
        harness.run(model, prompts, ["packed"], {"packed": 4}, batching="dynamic", **kw)


@pytest.mark.usefixtures("user_codegen")  # reads the compiled HLO
@pytest.mark.parametrize("family,temperature", [("nemotron", 1.0), ("setdlm", 0.0)])
def test_continuous_batching_gives_each_prompts_tokens(family, temperature):
    """Nine prompts through four slots: each result is the prompt decoded alone. The
    first three are one prompt with one seed, so they stop together and one refill call
    starts three prompts (padded to four entries, one of which names no slot); the loop
    also hands control back every two iterations. The loop program writes the cache in
    place (its state is donated, so the refills write into the same buffers)."""
    from hlo import body_results, loop_state, rebuilt

    setup = SETUPS[family]
    m = setup["model"]()
    prompts = setup["prompts"][:1] * 3 + setup["prompts"][1:] + [[3, 4], [5, 5, 5], [8]]
    seeds = [20] * 3 + list(range(21, 27))
    kw = dict(schedule="packed", max_new_tokens=MAX_NEW, temperature=temperature,
              **setup["options"])
    results, stats = ps.decode_continuous(m, prompts, slots=4, every=2, seed=seeds, **kw)
    assert stats.refills == 5 and stats.refill_calls < stats.refills
    programs = ps.Engine.of(m).executables()
    # The refill of three prompts runs padded to four entries.
    assert any(k.kind == "prefill" and k.rows == 4 for k in programs)
    assert stats.round_trips > 1 and 0 <= stats.host_fraction < 1
    assert stats.steps >= max(r.iterations for r in results) - 1
    # Every batched call serves at least one sequence, and each sequence makes its own
    # calls in some batched call (a sampled first call of Packed-SS is two).
    assert max(r.nfe for r in results) <= stats.forward_calls <= sum(r.nfe for r in results)
    for p, s, b in zip(prompts, seeds, results):
        _same(ps.decode(m, p, seed=s, **kw), b)
    c = m.config
    (exe,) = [e for k, e in programs.items()
              if k.kind == "generate" and k.slots == 4
              and k[1].sampling.greedy == (temperature == 0.0) and k[1].schedule == "packed"]
    slots = {"nemotron": 96 + 4, "setdlm": 64 + 2 * 3 + 2}[family]
    shape = (4, c.num_kv_heads, slots, c.head_dim)
    hlo = exe.as_text()
    assert loop_state(hlo).count(("f32", shape)) == 2 * c.num_layers
    assert not rebuilt(body_results(hlo), shape)
    with pytest.raises(InputError, match="slots"):
        ps.decode_continuous(m, prompts, slots=0, **kw)
