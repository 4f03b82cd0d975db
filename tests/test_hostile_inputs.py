"""Hostile request arguments: every integer at and past its bound, text with lone
surrogates, tiny top_p, odd containers, one-shot iterables, and slots / every / cache
sizes that would not fit in memory. Each is refused with a clear InputError naming the
argument (never an OverflowError from NumPy, a hang, a silent misreading), or decoded
as it should be.

Almost every check comes before anything is compiled, so the decode entry points are
run "dry" here (`dry`): they check their arguments and return what they would run.
Only the top_p decodes compile (one greedy and one sampled program per family).
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import packed_ss_jax as ps
from packed_ss_jax import continuous, memory, sampling, scheduler, validate
from packed_ss_jax.validate import INT32_MAX, MAX_CACHE, SEED_LIMIT, InputError
from packed_ss_jax.sampling import Sampler
from tiny import tiny_config

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Argument checks come before any computation: these models need no weights.
MODELS = {
    "nemotron": ps.Model(config=tiny_config(), params=None),
    "setdlm": ps.Model(config=ps.ModelConfig(
        family="setdlm", vocab_size=12, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-6,
        mask_token_id=11, eos_token_id=1, bos_token_id=0, block_size=3,
        max_position_embeddings=256, rope_theta=10000.0, qk_norm=True,
        tie_embeddings=True), params=None),
}
VOCAB = 12
PROMPT = [1, 2, 3]
CACHE = 32
MAX_NEW = 4
WIDTH = {"nemotron": ("block_size", 2), "setdlm": ("window", 1)}  # name, least
ENTRIES = ("decode", "batch", "stream", "continuous")
# Past every bound that a NumPy or int32 conversion could trip on.
HUGE = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**70, -2**63 - 1, -2**70]


@contextlib.contextmanager
def dry():
    """decode, stream and decode_continuous check their arguments and return what they
    would run (a Request, a Batch, (Batch, slots, every); stream: its chunks, which compile
    nothing until the first is asked for) instead of compiling it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ps.Engine, "decode", lambda engine, request: request)
        mp.setattr(scheduler, "decode_batch", lambda engine, batch: batch)
        mp.setattr(continuous, "decode_queue",
                   lambda engine, batch, slots, every: (batch, slots, every))
        mp.setattr(ps.Engine, "compile", _no_compile)
        yield


def _no_compile(engine, key, *args, **kwargs):
    raise AssertionError(f"a dry call compiled {key[0]!r}")


def call(entry: str, family: str, prompt=PROMPT, **kw):
    """One entry point, dry, with small valid defaults for what `kw` does not set."""
    model = MODELS[family]
    kw = {"max_new_tokens": MAX_NEW, "cache_size": CACHE, "eos_id": None, **kw}
    if "top_k" in kw:
        kw["temperature"] = 1.0
    with dry():
        if entry == "decode":
            return ps.decode(model, prompt, **kw)
        if entry == "batch":
            return ps.decode(model, [prompt, PROMPT], **kw)
        if entry == "stream":
            return ps.stream(model, prompt, **kw)
        return ps.decode_continuous(model, [prompt, PROMPT], **kw)


# --- integers -------------------------------------------------------------------------------

def _bounds(family: str, entry: str) -> dict:
    """argument -> (kwargs of a value, the valid range [lo, hi], what a refusal names).
    With prompt length 3, max_new_tokens 4 and cache_size 32."""
    width, least = WIDTH[family]
    table = {
        "prompt id": (lambda v: {"prompt": [1, v]}, 0, VOCAB - 1, "outside the vocabulary"),
        "stop id": (lambda v: {"stop_sequences": [[v]]}, 0, VOCAB - 1,
                    "outside the vocabulary"),
        "eos_id": (lambda v: {"eos_id": v}, 0, VOCAB - 1, "eos_id"),
        "max_new_tokens": (lambda v: {"max_new_tokens": v}, 1, CACHE - len(PROMPT),
                           "max_new_tokens"),
        "top_k": (lambda v: {"top_k": v}, 1, INT32_MAX, "top_k"),
        width: (lambda v: {width: v}, least, CACHE, width),
        "cache_size": (lambda v: {"cache_size": v}, len(PROMPT) + MAX_NEW, 2**16,
                       "cache_size|exceeds the cache|does not fit"),
        "seed": (lambda v: {"seed": v}, 0, SEED_LIMIT - 1, "seed"),
    }
    if entry in ("batch", "continuous"):
        table["seed list"] = (lambda v: {"seed": [0, v]}, 0, SEED_LIMIT - 1, r"seed\[1\]")
    if entry == "continuous":
        table["slots"] = (lambda v: {"slots": v}, 1, INT32_MAX, "slots")
        table["every"] = (lambda v: {"every": v}, 1, INT32_MAX, "every")
    if entry == "stream":
        table["chunk"] = (lambda v: {"chunk": v}, 1, INT32_MAX, "chunk")
    return table


def _edges(lo: int, hi: int) -> list[int]:
    return sorted({lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, *HUGE})


def _outcome(entry, family, name, value):
    """None when `value` is treated as it should be, else what went wrong."""
    make, lo, hi, names = _bounds(family, entry)[name]
    valid = lo <= value <= hi or (name == "eos_id" and value == -1)
    try:
        out = call(entry, family, **make(value))
    except InputError as e:
        if valid:
            return f"refused: {e}"
        if name == "cache_size" and value > hi and "decode state" in str(e) \
                and value <= MAX_CACHE:
            return None  # a cache that fits no memory here
        return None if re.search(names, str(e)) else f"message does not name it: {e}"
    except Exception as e:  # noqa: BLE001 - any other exception is the defect
        return f"{type(e).__name__}: {e}"
    if name == "cache_size" and hi < value <= MAX_CACHE:
        return None  # fits this machine's memory
    if not valid:
        return "accepted"
    if name == "slots" and out[1] != min(value, 2):
        return f"{out[1]} slots for 2 prompts"
    if name == "every" and out[2] != min(value, MAX_NEW + 1):
        return f"every={out[2]}: no request runs more than {MAX_NEW + 1} iterations"
    return None


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_integer_at_and_past_its_bounds(entry, family):
    """Every integer argument of every entry point, at its bounds, one past them, and
    at sizes past int32, uint32, int64 and uint64 (as Python ints and, where they fit,
    NumPy ones): accepted inside its range, else an InputError naming it."""
    wrong = []
    for name, (_, lo, hi, _) in _bounds(family, entry).items():
        for v in _edges(lo, hi):
            values = [v] + [t(v) for t in (np.int64, np.uint64)
                            if np.iinfo(t).min <= v <= np.iinfo(t).max]
            for value in values:
                problem = _outcome(entry, family, name, value)
                if problem:
                    wrong.append(f"{entry} {family} {name}={value!r}: {problem}")
    assert not wrong, "\n".join(wrong)


@settings(SETTINGS, max_examples=300)  # dry calls: about a millisecond each
@given(data=st.data(), value=st.one_of(st.integers(), st.integers(-2**80, 2**80)))
def test_random_integers(data, value):
    entry = data.draw(st.sampled_from(ENTRIES))
    family = data.draw(st.sampled_from(["nemotron", "setdlm"]))
    name = data.draw(st.sampled_from(sorted(_bounds(family, entry))))
    problem = _outcome(entry, family, name, value)
    assert problem is None, f"{entry} {family} {name}={value!r}: {problem}"


def test_slots_and_every_are_bounded_by_what_can_matter():
    """A slot past the prompts never holds one, and no request runs more than
    max_new_tokens + 1 iterations: larger values are those (slots=10**6 blocked for
    ever; every=2**40 overflowed int32)."""
    _, slots, every = call("continuous", "nemotron", slots=10**6, every=2**31 - 1)
    assert (slots, every) == (2, MAX_NEW + 1)
    for bad, match in [(dict(slots=2**40), "slots .* at most 2147483647"),
                       (dict(every=2**40), "every .* at most 2147483647"),
                       (dict(slots=0), "slots must be an integer >= 1"),
                       (dict(every=-1), "every must be an integer >= 1")]:
        with pytest.raises(InputError, match=match):
            call("continuous", "nemotron", **bad)


def test_slots_that_cannot_fit_in_memory_are_refused_with_the_figures(monkeypatch):
    """The slots' decode state (their KV caches and rows) is checked against the free
    memory before anything is allocated: refused with the figures."""
    m = MODELS["nemotron"]
    monkeypatch.setattr(memory, "free_memory", lambda model: (2**20, "(a stated maximum)"))
    with dry(), pytest.raises(InputError, match=r"needs at least .* \(1000 sequence\(s\) x .*"
                                                r"KV cache for 128 positions.*more than the 1.0 "
                                                r"MiB \(a stated maximum\); use .*fewer slots"):
        ps.decode_continuous(m, [[1, 2]] * 1000, slots=10**6, max_new_tokens=4)
    with dry(), pytest.raises(InputError, match="fewer prompts per call"):
        ps.decode(m, [[1, 2]] * 1000, max_new_tokens=4)
    monkeypatch.undo()
    # Past any machine's memory: a cache of 2**30 positions holds 2**30 x 512 bytes.
    with pytest.raises(InputError, match=r"needs at least 5\d\d\.\d GiB .*512\.0 GiB of KV "
                                         r"cache for 1073741824 positions"):
        call("decode", "nemotron", cache_size=2**30)
    with pytest.raises(InputError, match=r"\(2 sequence\(s\) x"):
        call("continuous", "setdlm", cache_size=2**30, slots=10**6)


# --- containers -----------------------------------------------------------------------------

@pytest.mark.parametrize("prompts", ["abc", b"abc", bytearray(b"ab"), {"a", "b"},
                                     {"a": 1}, [1, 2, 3], np.array([1, 2, 3]), [], 7, None])
def test_a_queue_of_prompts_must_be_a_list(prompts):
    """A string would be decoded one character at a time; a set or dict has no order; a
    list of ids is one prompt: refused, saying what to pass."""
    with pytest.raises(InputError, match="prompts must be a .*list"):
        _continuous(prompts)


def _continuous(prompts):
    with dry():
        return ps.decode_continuous(MODELS["nemotron"], prompts, max_new_tokens=4)


def test_a_queue_may_be_any_iterable_read_once():
    batch, slots, _ = _continuous(p for p in ([1, 2], [3]))
    assert [r.prompt.tolist() for r in batch.members] == [[1, 2], [3]] and slots == 2
    batch, _, _ = _continuous(np.array([[1, 2], [3, 4]]))
    assert len(batch.members) == 2


@pytest.mark.parametrize("prompt", [{"a", "b"}, {"a": 1}, (p for p in ["a", "b"]),
                                    {1, 2}, b"ab"])
def test_decode_refuses_odd_containers_of_prompts(prompt):
    with dry(), pytest.raises(TypeError, match="prompt must be a string or a sequence of "
                                               "integer token ids"):
        ps.decode(MODELS["nemotron"], prompt, max_new_tokens=4)


def test_stop_sequences_read_once():
    """A generator of stops is read once: its text stops are still searched for in the
    decoded text (they were skipped: the generator was empty on the second reading)."""
    m = ps.load()
    markers = ["ab", [5, 6]]
    with dry():
        a = ps.decode(m, "Hi", max_new_tokens=4, stop_sequences=markers)
        b = ps.decode(m, "Hi", max_new_tokens=4, stop_sequences=iter(markers))
        c = ps.decode(m, "Hi", max_new_tokens=4, stop_sequences=(s for s in markers))
        d = ps.decode_continuous(m, ["Hi"], max_new_tokens=4,
                                 stop_sequences=(s for s in markers))[0].members[0]
    for r in (b, c, d):
        assert r.stop_texts == a.stop_texts == ("ab",)
        for name in a.limits:
            np.testing.assert_array_equal(a.limits[name], r.limits[name])
    with dry(), pytest.raises(InputError, match="more than 8 stop markers"):
        ps.decode(m, "Hi", max_new_tokens=4, stop_sequences=iter(lambda: [5], None))


# --- text -----------------------------------------------------------------------------------

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
TEXT = st.lists(st.one_of(st.characters(), SURROGATES), min_size=1, max_size=24).map("".join)


def _has_surrogate(s: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


@pytest.fixture(scope="module")
def embedded():
    return ps.load()


@SETTINGS
@given(text=TEXT, where=st.sampled_from(["prompt", "batch", "stop", "continuous"]))
def test_text_with_lone_surrogates_is_refused(embedded, text, where):
    """Random Unicode, lone surrogates included, as a prompt, a batch's prompt or a stop
    string: refused with the place and the character named, or accepted."""
    kw = dict(max_new_tokens=4)
    with dry():
        run = {"prompt": lambda: ps.decode(embedded, text, **kw),
               "batch": lambda: ps.decode(embedded, ["ok", text], **kw),
               "stop": lambda: ps.decode(embedded, "ok", stop_sequences=["x", text], **kw),
               "continuous": lambda: ps.decode_continuous(embedded, ["ok", text], **kw)}[where]
        place = {"prompt": "prompt", "batch": r"prompts\[1\]: prompt", "stop": "stop sequence 1",
                 "continuous": r"prompts\[1\]: prompt"}[where]
        if _has_surrogate(text):
            with pytest.raises(InputError, match=place + " is not valid Unicode text: a lone "
                                                         r"surrogate \(U\+D[89A-F]"):
                run()
        else:
            run()


# --- top_p ----------------------------------------------------------------------------------

TINY_P = [1e-300, 5e-324, 1e-45, 1e-38]  # 0 or subnormal in float32, and 1e-38 just below
V = 100  # more than Q_STORE: the drafter's Q is stored truncated


def _logits(n: int):
    # No subnormal logits: XLA's CPU code flushes them to zero (a tie NumPy's argmax would
    # break), and no model produces them.
    return hnp.arrays(np.float32, (n, V), elements=st.floats(-30, 30, width=32,
                                                             allow_subnormal=False))


@SETTINGS
@given(logits=_logits(1), p=st.one_of(st.sampled_from(TINY_P),
                                      st.floats(5e-324, 1.0, exclude_min=False)))
def test_top_p_keeps_the_most_likely_token(logits, p):
    """At any top_p > 0 (the Sampler itself, without requests' clamp): a valid law
    holding the argmax (ties: the lowest id), and the argmax alone once p is below
    1 / V."""
    logp = np.asarray(sampling.target(jnp.asarray(logits[0]), Sampler(1.0, None, p)))
    assert not np.isnan(logp).any()
    top = int(np.argmax(logits[0]))
    assert logp[top] > -np.inf
    assert abs(np.log(np.exp(logp.astype(np.float64)).sum())) < 1e-5
    if p < 0.5 / V:
        assert np.flatnonzero(logp > -np.inf).tolist() == [top]


@functools.partial(jax.jit, static_argnums=3)
def _speculate(draft_logits, verify_logits, key, p):
    """Drafts sampled from the stored Q, then Algorithm 2's acceptance: (drafts, Q's
    storage shape, h, C)."""
    s = Sampler(1.0, None, p)
    q = sampling.proposal(draft_logits, s, V - 1)
    k_draft, k_verify = jax.random.split(key)
    drafts = q.sample(k_draft)
    h, C = sampling.verify(k_verify, sampling.target(verify_logits, s), drafts, jnp.int32(3), q)
    return drafts, q.ids.shape, h, C


@settings(SETTINGS, max_examples=25)  # a program per p: fewer examples
@given(draft_logits=_logits(3), verify_logits=_logits(4), p=st.sampled_from(TINY_P),
       same=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_tiny_top_p_speculative_acceptance_is_greedy(draft_logits, verify_logits, p, same,
                                                     seed):
    """Drafts from the truncated stored Q and Algorithm 2's acceptance at a tiny top_p
    (the Sampler itself, without requests' clamp): the drafts are the drafter's argmax
    tokens and the accepted tokens the verifier's (greedy), ties and near-ties included."""
    verify_logits[:same] = draft_logits[:same]  # some drafts agree with the verifier
    drafts, stored, h, C = _speculate(draft_logits, verify_logits, jax.random.PRNGKey(seed), p)
    assert stored == (3, sampling.Q_STORE)
    greedy = np.argmax(np.where(np.arange(V) == V - 1, -np.inf, draft_logits), axis=1)
    assert np.asarray(drafts).tolist() == greedy.tolist()
    want = np.argmax(verify_logits, axis=1)
    h, C = int(h), np.asarray(C)
    assert h == ((greedy == want[:3]).tolist() + [False]).index(False)
    assert C[: h + 1].tolist() == want[: h + 1].tolist()


def test_tiny_top_p_values_share_one_program():
    """Every top_p below the smallest normal float32 keeps the argmax alone, as that one
    does: one Sampler (one compiled program) for them all."""
    samplers = {validate.sampler(1.0, None, p) for p in TINY_P + [np.float64(1e-300)]}
    assert samplers == {Sampler(1.0, None, validate.TOP_P_TINY)}
    assert validate.sampler(1.0, None, 1e-30).top_p == 1e-30


@pytest.mark.parametrize("name", ["nld-tiny", "setdlm-tiny"])
def test_tiny_top_p_decodes_the_greedy_tokens(name):
    """End to end, for both families' speculative sampling (Packed-SS; Nemotron's vocabulary
    is past Q_STORE, so Q is stored truncated): a tiny top_p gave BOS repeated and no
    text; it gives temperature 0's tokens."""
    m = ps.load(name)
    kw = dict(max_new_tokens=8, cache_size=128, eos_id=None)
    greedy = ps.decode(m, "Hello", **kw)
    for p, seed in zip(TINY_P, [0, 1, 2, 3]):
        r = ps.decode(m, "Hello", temperature=1.0, top_p=p, seed=seed, **kw)
        assert (r.tokens, r.text) == (greedy.tokens, greedy.text), p
