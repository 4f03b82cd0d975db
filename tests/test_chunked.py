"""The decode loop in chunks (`Streaming`: prefill, insert into a one-slot decode state,
then generate k iterations at a time, the state donated between launches) returns
`decode`'s tokens for every schedule of both families, greedy and sampled; the generate
and insert programs update the cache in place."""

import re

import pytest

import packed_ss_jax as ps
from packed_ss_jax import families
from packed_ss_jax.scheduler import Streaming
from hlo import body_results, rebuilt
from test_setdlm_decode import tiny_setdlm
from tiny import tiny_model

PROMPT = [1, 5, 7, 9, 2]
LENGTH = 23
CACHE = 64

MODELS = {"nemotron": lambda: tiny_model(0), "setdlm": lambda: tiny_setdlm(0)}
# The widths, cache and prompt bucket of test_one_engine / test_setdlm_decode, so that in
# one test session the one-shot programs are compiled once for all of them.
WIDTH = {"nemotron": 4, "setdlm": 3}


def _cases():
    """Every schedule greedy; sampled and any-order on Packed-SS (the same loop code)."""
    out = []
    for f in families.FAMILIES.values():
        out += [(f.name, s, 0.0, "ltr") for s in f.schedules]
        out.append((f.name, "packed", 1.0, "ltr"))
        if "confidence" in f.orders:
            out.append((f.name, "packed", 0.0, "confidence"))
    return out


def _request(engine, schedule, temperature=0.0, order="ltr", **kw):
    family = engine.family
    options = ps.DecodeOptions(schedule=schedule, order=order, temperature=temperature,
                               max_new_tokens=LENGTH, cache_size=CACHE,
                               width=WIDTH[family.name], **kw)
    return engine.request(PROMPT, options, seed=7)


@pytest.mark.parametrize("family,schedule,temperature,order", _cases())
def test_chunks_are_the_one_shot_decode(family, schedule, temperature, order):
    engine = ps.Engine.of(MODELS[family]())
    request = _request(engine, schedule, temperature, order, eos_id=None)
    want = engine.decode(request)
    for k in (1, 5):
        streaming = Streaming(engine, request, k)
        pieces = list(streaming)
        got = streaming.result()
        assert [t for p in pieces for t in p] == want.tokens, (k, pieces)
        assert got.tokens == want.tokens
        assert (got.nfe, got.iterations) == (want.nfe, want.iterations)
        assert (got.accept_hist == want.accept_hist).all()
        assert got.finish_reason == want.finish_reason
        if k == 1 and want.iterations > 2:
            assert len(pieces) > 2  # it did stream: several launches gave tokens


@pytest.mark.usefixtures("user_codegen")  # reads the compiled HLO
@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
def test_generate_donates_the_state_and_keeps_the_cache_in_place(family):
    m = MODELS[family]()
    engine = ps.Engine(m)  # its programs: this stream's alone
    request = _request(engine, "packed", eos_id=None)
    list(Streaming(engine, request, 4))   # a one-slot state made by its prefill
    engine.insert(engine.slots(request.program, 2), engine.prefill([request]), [1])
    programs = engine.executables()
    (generate,) = [e for k, e in programs.items() if k.kind == "generate"]
    (insert,) = [e for k, e in programs.items() if k.kind == "insert"]
    fam = engine.family
    c = m.config
    p = request.program
    slots = p.capacity + (p.width if fam.width_counts_x else 2 * p.width + 2)
    shape = (1, c.num_kv_heads, slots, c.head_dim)  # the stream's state of one slot
    for name, exe, n in (("generate", generate, 1), ("insert", insert, 2)):
        layer = (n, c.num_kv_heads, slots, c.head_dim)   # a state of n slots
        hlo = exe.as_text()
        # Every cache layer buffer is an input aliased to an output (donated, reused).
        layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
        params = [tuple(int(d) for d in dims.split(",") if d)
                  for dims in re.findall(r"\w+\[([0-9,]*)\]", layout)]
        cache_params = {i for i, dims in enumerate(params) if dims == layer}
        assert len(cache_params) == 2 * c.num_layers, name  # K and V of every layer
        aliases = re.search(r"input_output_alias=\{(.*?)\s\}", hlo)
        aliased = set() if aliases is None else {
            int(i) for i in re.findall(r"\((\d+), \{\}, may-alias\)", aliases.group(1))}
        # Every cache buffer is donated: the output state is written into it.
        assert cache_params <= aliased, f"{name} does not reuse the donated cache buffers"
    # And the loop never copies, converts or rewrites a whole cache layer.
    assert rebuilt(body_results(generate.as_text()), shape) == []
