"""The decode loop reads and writes the KV cache where it lies.

Each layer's cache buffer must never be copied, transposed or sliced into a new
buffer by the compiled decode program: the only instructions allowed to produce a
buffer of the cache's shape are the commit's in-place dynamic-update-slice and the
initial padding. (A copy of the whole cache per step cost more than the forward
itself on small models.)
"""

import re

import pytest

from packed_ss_jax import engine, families
from packed_ss_jax.sampling import Sampler
from tiny import tiny_model

CAPACITY = 96


def cache_producers(hlo: str, shape: str) -> set[str]:
    """Opcodes (or fusion names) of every instruction whose result is a `shape` buffer."""
    pattern = re.compile(r"%(\S+) = " + re.escape(shape) + r"\{[0-9,]*\} ([a-z-]+)\(")
    found = set()
    for name, opcode in pattern.findall(hlo):
        found.add(re.sub(r"\.\d+$", "", name) if opcode == "fusion" else opcode)
    return found


@pytest.mark.parametrize("schedule", ["ar", "linear", "quadratic", "packed"])
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "t1"])
def test_decode_loop_never_copies_the_cache(schedule, sampler):
    m = tiny_model(0)
    c = m.config
    B = 4
    family = families.of(c)
    request = engine.prepare(m, family, [1, 2, 3], schedule=schedule, width=B,
                             cache_size=CAPACITY, max_new_tokens=8,
                             temperature=sampler.temperature)
    exe, _ = engine.compiled(m, family, request)
    # The cache holds capacity + B slots (one block of headroom, see cache.py; B = 1 for AR).
    shape = f"f32[{c.num_kv_heads},{CAPACITY + request.program.width},{c.head_dim}]"
    _check(exe.as_text(), shape, schedule)


def _check(hlo: str, shape: str, schedule: str) -> None:
    producers = cache_producers(hlo, shape)
    assert producers, "no cache-shaped buffer found: the check is looking at the wrong shape"
    bad = {op for op in producers
           if not ("dynamic-update-slice" in op or op.endswith("pad_fusion")
                   or op in ("parameter", "get-tuple-element", "pad"))}
    assert not bad, f"{schedule}: the cache is rebuilt by {sorted(bad)}"


SETDLM_CASES = [("serial", "ltr", 0.0), ("native", "ltr", 0.0), ("linear", "confidence", 0.0),
                ("quadratic", "confidence", 0.0), ("packed", "confidence", 0.0),
                ("linear", "ltr", 1.0), ("packed", "ltr", 1.0)]


@pytest.mark.parametrize("schedule,order,temperature", SETDLM_CASES)
def test_setdlm_loop_never_copies_the_cache(schedule, order, temperature):
    from test_setdlm_decode import tiny_setdlm

    m = tiny_setdlm(0)
    family = families.of(m.config)
    request = engine.prepare(m, family, [3, 4, 5, 6], schedule=schedule, order=order, width=3,
                             max_new_tokens=20, cache_size=64, temperature=temperature)
    exe, _ = engine.compiled(m, family, request)
    p, c = request.program, m.config
    # The buffer holds capacity + 2W + 2 slots (see setdlm/program.py; serial runs W = 1).
    shape = f"f32[{c.num_kv_heads},{p.capacity + 2 * p.width + 2},{c.head_dim}]"
    _check(exe.as_text(), shape, schedule)
