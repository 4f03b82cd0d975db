"""`stream` hands out `decode`'s tokens and text as they are produced; stop sequences and
stop strings end the output at the earliest stop for every schedule of both families."""

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import families, stops
from packed_ss_jax.chunks import Detokenizer
from packed_ss_jax.scheduler import Streaming
from test_chunked import CACHE, LENGTH, MODELS, PROMPT, WIDTH

EMBEDDED = ps.load()
QUESTION = "Question: Ava has 12 apples. Ava gets 7 more apples. How many apples does Ava have now?\nAnswer:"


def _joined(chunks):
    chunks = list(chunks)
    return [t for c in chunks for t in c.tokens], "".join(c.text for c in chunks)


def test_stream_is_decode():
    """Tokens and text (sampled streams: test_chunked)."""
    kw = dict(max_new_tokens=40, eos_id=None)
    want = ps.decode(EMBEDDED, QUESTION, **kw)
    chunks = list(ps.stream(EMBEDDED, QUESTION, chunk=2, **kw))
    tokens, text = _joined(chunks)
    assert tokens == want.tokens and text == want.text
    assert len(chunks) > 3 and chunks[-1].result.tokens == want.tokens
    assert all(c.result is None for c in chunks[:-1])


def test_chat_messages_stream_and_decode_alike():
    messages = [{"role": "user", "content": "Ava has 3 apples. She gets 4 more. How many?"}]
    want = ps.decode(EMBEDDED, messages=messages, max_new_tokens=24)
    tokens, text = _joined(ps.stream(EMBEDDED, messages=messages, max_new_tokens=24))
    assert (tokens, text) == (want.tokens, want.text)
    assert want.tokens == ps.decode(EMBEDDED, "Question: Ava has 3 apples. She gets 4 more. "
                                              "How many?\nAnswer:", max_new_tokens=24).tokens
    with pytest.raises(ps.InputError, match="not both"):
        ps.decode(EMBEDDED, "x", messages=messages)


def test_multibyte_characters_are_never_split():
    """The embedded byte-level tokenizer spells é, 日本 and the emoji with 2-4 tokens each."""
    tok = EMBEDDED.tokenizer
    text = "héllo 日本 wörld 🙂!"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split()) + 6  # characters do span tokens
    d = Detokenizer(tok.decode)
    pieces = [d.add([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) >= 6  # held while a character was unfinished


def _cut_at_marker(tokens, markers):
    """The reference: the free output cut after the earliest completed marker."""
    for end in range(1, len(tokens) + 1):
        if any(len(m) <= end and tokens[end - len(m): end] == list(m) for m in markers):
            return tokens[:end]
    return tokens


def _schedules():
    return [(f.name, s) for f in families.FAMILIES.values() for s in f.schedules]


@pytest.mark.parametrize("family,schedule", _schedules())
def test_stop_sequences_end_the_output_at_the_earliest(family, schedule):
    engine = ps.Engine.of(MODELS[family]())
    kw = dict(schedule=schedule, max_new_tokens=LENGTH, cache_size=CACHE,
              width=WIDTH[family])
    free = engine.decode(engine.request(PROMPT, ps.DecodeOptions(eos_id=None, **kw))).tokens
    # Markers taken from the free output: a two-token one late, a three-token one early
    # (it must win), and one that never occurs.
    late, early = free[12:14], free[4:7]
    markers = [late, early, [free[0], free[0], free[0], free[0]]]
    if free[:4] == markers[2]:
        markers.pop()
    want = _cut_at_marker(free, markers)
    assert len(want) <= 7
    request = engine.request(PROMPT, ps.DecodeOptions(eos_id=None, stop_sequences=markers,
                                                      **kw))
    got = engine.decode(request)
    assert got.tokens == want and got.finish_reason == "stop"
    streaming = Streaming(engine, request, 2)
    assert [t for c in streaming for t in c] == want
    assert streaming.stopped and streaming.result().finish_reason == "stop"


def test_stop_strings_across_token_boundaries():
    kw = dict(max_new_tokens=48, eos_id=None)
    free = ps.decode(EMBEDDED, QUESTION, **kw)
    tok = EMBEDDED.tokenizer
    # A stop string made of the end of one token and the start of the next: the tokenizer
    # spells it differently, so only the text search can find it.
    pieces = [tok.decode(free.tokens[:i]) for i in range(len(free.tokens) + 1)]
    i = next(i for i in range(3, len(free.tokens)) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[i][-1] + pieces[i + 1][len(pieces[i])]
    first = free.text.find(stop)
    assert 0 <= first
    got = ps.decode(EMBEDDED, QUESTION, stop_sequences=[stop], **kw)
    assert got.text == free.text[: first + len(stop)] and got.stop_at == first
    assert got.finish_reason == "stop"
    assert got.tokens == free.tokens[: len(got.tokens)]
    assert stop not in tok.decode(got.tokens[:-1])
    chunks = list(ps.stream(EMBEDDED, QUESTION, stop_sequences=[stop], chunk=1, **kw))
    tokens, text = _joined(chunks)
    assert (tokens, text) == (got.tokens, got.text)
    # The stop string arrives whole, in the last chunk: nothing before shows part of it.
    assert stop in chunks[-1].text and stop[0] not in "".join(c.text for c in chunks[:-1])[first:]


def test_shown_and_find():
    assert stops.shown("abc\n", ["\n\n"]) == 3       # the "\n" may begin a stop: held
    assert stops.shown("abc", ["\n\n", "bcd"]) == 1   # "bc" may begin "bcd"
    assert stops.shown("abc", ["x"]) == 3
    assert stops.shown("abc", []) == 3
    assert stops.shown("a\n\nb", ["\n\n"]) is None  # a stop is in it: the output ends there
    assert stops.find_text("a STOP b END", ["END", "STOP"]) == (2, 6)
    assert np.asarray(stops.table(None, 10, 1, [[2, 3]])["stop_len"]).tolist()[:3] == [2, 1, 0]


def test_generate_prints_the_chat_continuation(capsys):
    from packed_ss_jax import cli

    question = "Ava has 3 apples. She gets 4 more. How many?"
    want = ps.decode(EMBEDDED, messages=[{"role": "user", "content": question}],
                     max_new_tokens=24, stop_sequences=["="])
    assert cli.main(["generate", "--chat", question, "--max-new-tokens", "24",
                     "--stop", "="]) == 0
    out = capsys.readouterr().out
    assert out.startswith(want.text + "\n") and want.text.endswith("=")
    assert cli.main(["generate", "--system", "x", "hi"]) == 2


def test_stream_without_a_tokenizer_gives_the_ids():
    m = MODELS["nemotron"]()
    kw = dict(block_size=WIDTH["nemotron"], max_new_tokens=LENGTH, cache_size=CACHE,
              eos_id=None)
    chunks = list(ps.stream(m, PROMPT, chunk=2, **kw))
    assert [t for c in chunks for t in c.tokens] == ps.decode(m, PROMPT, **kw).tokens
    assert len(chunks) > 2 and all(c.text is None for c in chunks)
