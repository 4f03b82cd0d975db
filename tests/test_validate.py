"""Careless decode arguments get a clear error (naming the argument) before anything is
allocated or compiled, for both families; NumPy scalars work wherever Python ones do."""

from pathlib import Path

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import Model, ModelConfig
from packed_ss_jax.sampling import Sampling
from tiny import tiny_config

# Argument checks come before any computation, so most cases need no weights at all.
NEMOTRON = Model(config=tiny_config(), params=None)
SETDLM = Model(config=ModelConfig(
    family="setdlm", vocab_size=12, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=48, rms_norm_eps=1e-6, mask_token_id=11, eos_token_id=1,
    bos_token_id=0, block_size=3, max_position_embeddings=256, rope_theta=10000.0,
    qk_norm=True, tie_embeddings=True), params=None)
PROMPT = [1, 2, 3]

# Integer arguments of each family, with a valid value for each (for the other arguments).
INTEGER_ARGS = {
    "nemotron": dict(block_size=4, max_new_tokens=4, cache_size=32, seed=0, eos_id=1, top_k=2),
    "setdlm": dict(window=3, max_new_tokens=4, cache_size=32, seed=0, eos_id=1, top_k=2),
}
NOT_INTEGERS = [True, False, 2.5, 4.0, "4", np.float64(4.0), [4], np.bool_(True)]
NULLABLE = {"block_size", "window", "cache_size", "eos_id", "top_k"}


def _cases():
    for family, args in INTEGER_ARGS.items():
        for name in args:
            for bad in NOT_INTEGERS + ([] if name in NULLABLE else [None]):
                yield family, name, bad


def _decode(family, **kw):
    model = NEMOTRON if family == "nemotron" else SETDLM
    kw = {"max_new_tokens": 4, "cache_size": 32, "eos_id": None, **kw}
    if "top_k" in kw:
        kw["temperature"] = 1.0
    return ps.decode(model, PROMPT, **kw)


def test_non_integers_are_refused_by_name():
    """Every integer argument of both families, given a bool, a float (even 4.0), a
    string, a list, a NumPy float or None where None means nothing: a ValueError naming
    the argument, never a TypeError from deep inside, never a silent conversion."""
    wrong = []
    for family, name, bad in _cases():
        try:
            _decode(family, **{name: bad})
            wrong.append(f"{family} {name}={bad!r}: accepted")
        except ValueError as e:
            if name not in str(e):
                wrong.append(f"{family} {name}={bad!r}: message does not name it: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{family} {name}={bad!r}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("not_a_model", [None, {"params": {}}, "/path/to/checkpoint",
                                         Path("/path/to/checkpoint"), 42, [1, 2]])
def test_decode_needs_a_model(not_a_model):
    with pytest.raises(TypeError, match=r"expected a packed_ss_jax.Model \(from "
                                        r"packed_ss_jax.load\), got"):
        ps.decode(not_a_model, PROMPT)
    with pytest.raises(TypeError, match="expected a packed_ss_jax.Model"):
        ps.logits(not_a_model, [1], [0], [[True]])


def test_decode_given_a_path_says_to_load_it():
    with pytest.raises(TypeError, match=r"packed_ss_jax.load\('ckpt/dir'\)"):
        ps.decode("ckpt/dir", "hello")


def _refusals(cases, call, exc, match):
    """The cases `call` does not refuse with `exc` matching `match` (regex), described."""
    import re

    wrong = []
    for case in cases:
        try:
            call(case)
            wrong.append(f"{case!r}: accepted")
        except exc as e:
            if not re.search(match, str(e)):
                wrong.append(f"{case!r}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{case!r}: {type(e).__name__}: {e}")
    return wrong


# (A 2-D array is a batch of prompts: tests/test_batched.py.)
BAD_PROMPTS = [None, 7, np.int64(7), b"ab", {1, 2}, {"ids": [1]}, np.array(5), [1, None],
               [np.float32(1)], [True, 2]]


@pytest.mark.parametrize("model", [NEMOTRON, SETDLM], ids=["nemotron", "setdlm"])
def test_bad_prompt_types(model):
    """Not a sequence of ids (None, a number, bytes that would pass as ids, a set with no
    order, a dict, a 0-d array, non-integer items): one clear TypeError."""
    wrong = _refusals(BAD_PROMPTS, lambda p: ps.decode(model, p, max_new_tokens=4,
                                                       cache_size=32),
                      TypeError, "prompt must be a string or a sequence of integer token ids")
    assert not wrong, "\n".join(wrong)


def test_bad_stop_sequences():
    """A bare string (one marker per character), a bare number, or markers of the wrong
    type: one clear TypeError."""
    cases = ["ab", 5, 2.5, [b"ab"], [[1.5]], [None], [{2: 3}]]
    wrong = _refusals(cases, lambda stops: ps.decode(SETDLM, PROMPT, stop_sequences=stops,
                                                     max_new_tokens=4, cache_size=32),
                      TypeError, "stop_sequences must be a list of markers|must be integer "
                                 "token ids")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("family,kw,match", [
    ("nemotron", dict(block_size=64, cache_size=32), r"block_size 64 does not fit the cache "
                                                    r"\(32 positions\)"),
    ("nemotron", dict(cache_size=3, max_new_tokens=1), "block_size 4 does not fit the cache"),
    ("nemotron", dict(cache_size=0), "cache_size must be an integer >= 1"),
    ("nemotron", dict(cache_size=-5), "cache_size must be an integer >= 1"),
    ("nemotron", dict(cache_size=2**40), "cache_size 1099511627776 is too large"),
    ("setdlm", dict(window=40, cache_size=32), r"window 40 does not fit the cache "
                                               r"\(32 positions\)"),
    ("setdlm", dict(cache_size=2, max_new_tokens=1), "window 3 does not fit the cache"),
    ("setdlm", dict(cache_size="64"), "cache_size must be an integer"),
])
def test_blocks_that_cannot_fit_the_cache(family, kw, match):
    """Refused before anything is compiled (the model's engine compiles nothing)."""
    engine = ps.Engine.of(NEMOTRON if family == "nemotron" else SETDLM)
    before = len(engine.executables())
    with pytest.raises(ValueError, match=match):
        _decode(family, **kw)
    assert len(engine.executables()) == before


def test_eos_outside_the_vocabulary_from_the_config_is_explained():
    model = Model(config=tiny_config(eos_token_id=40), params=None)
    with pytest.raises(ValueError, match="the config's eos_token_id 40 .* pass eos_id=None"):
        ps.decode(model, PROMPT, max_new_tokens=4, cache_size=32)


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
def test_numpy_arguments_prepare_the_same_request(family):
    """The program (the compile-cache key) and the traced arguments do not depend on
    NumPy vs Python scalars, and are made of Python values, so it is one program."""
    model = {"nemotron": NEMOTRON, "setdlm": SETDLM}[family]
    width = {"nemotron": 4, "setdlm": 3}[family]
    py = dict(schedule="packed", max_new_tokens=5, eos_id=1, cache_size=32,
              temperature=0.5, top_k=3, top_p=0.75, width=width)
    npy = dict(py, max_new_tokens=np.int32(5), eos_id=np.int64(1),
               cache_size=np.int32(32), temperature=np.float32(0.5),
               top_k=np.int64(3), top_p=np.float32(0.75), width=np.int64(width))
    if family == "setdlm":
        py["stop_sequences"] = [[2, 3], 4]
        npy["stop_sequences"] = [np.array([2, 3], np.int32), np.int64(4)]
    engine = ps.Engine.of(model)
    # The seed in the options, or given to the request in their place.
    a = engine.request(PROMPT, ps.DecodeOptions(**py, seed=3))
    b = engine.request(np.asarray(PROMPT, np.int64), ps.DecodeOptions(**npy), seed=np.uint32(3))
    assert a.program == b.program and hash(a.program) == hash(b.program)
    p = b.program
    assert all(type(v) is int for v in (p.width, p.bucket, p.capacity, b.seed, b.max_new))
    s = p.sampling
    assert s == Sampling(greedy=False, top_k=3)
    assert (type(s.greedy), type(s.top_k)) == (bool, int)
    np.testing.assert_array_equal(a.prompt, b.prompt)
    assert a.limits.keys() == b.limits.keys()
    for name in a.limits:
        np.testing.assert_array_equal(a.limits[name], b.limits[name])
        # The traced arguments have one dtype and shape (one program's arguments).
        assert np.asarray(a.limits[name]).dtype == np.asarray(b.limits[name]).dtype
        assert np.shape(a.limits[name]) == np.shape(b.limits[name])
    # The sampling values are traced, as float32 (the value the program holds).
    assert (a.limits["temperature"], a.limits["top_p"]) == (np.float32(0.5), np.float32(0.75))
    assert a.limits["temperature"].dtype == a.limits["top_p"].dtype == np.float32
