"""A streamed decode's output as chunks: the ids that became final in each launch and
the text that became stable with them, held back where a stop text could still begin,
ending where one is found (stops.py). `stream` feeds it from one request's launches, the
server from each slot of its batched launches.

Text is stable up to its last complete character: a byte-level tokenizer splits one
character over several tokens, and a prefix that ends inside it decodes to U+FFFD
replacement characters that a later token turns into the real one. The ids are decoded
whole each time, so the streamed text is exactly the decode's text.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import stops
from .results import DecodeResult

REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of a growing list of ids, handed out only once it is stable."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""        # the text handed out so far

    def stable(self) -> str:
        """The decoded text of every id so far, less an unfinished trailing character."""
        return self.decode(self.ids).rstrip(REPLACEMENT)

    def add(self, ids) -> str:
        """Adds ids; returns the text that became stable (may be "")."""
        self.ids.extend(int(i) for i in ids)
        text = self.stable()
        if not text.startswith(self.text):  # a decoder that rewrote earlier text
            return ""
        new, self.text = text[len(self.text):], text
        return new


@dataclasses.dataclass
class StreamChunk:
    """What one launch of a streamed decode produced."""

    tokens: list[int]               # ids that became final (in order; all chunks: the output)
    text: str | None                # text that became stable (None without a tokenizer)
    result: DecodeResult | None = None  # on the last chunk: the whole decode, as `decode`'s


class Chunker:
    """Turns the ids of one decode, as they become final, into StreamChunks:

        chunker = Chunker(tokenizer, stop_texts)
        chunk = chunker.add(new_ids, done)   # None: nothing to hand out yet
        if chunker.ended: ...                # a stop text was found: decode no further
        last = chunker.last(result)          # the final chunk, with the DecodeResult
    """

    def __init__(self, tokenizer, stop_texts=()):
        self.text = Detokenizer(tokenizer.decode) if tokenizer is not None else None
        self.stop_texts = stop_texts
        self.sent_ids, self.sent_text = 0, ""
        self.ended = False   # a stop text is in the output: it ends there

    def add(self, new: list[int], done: bool) -> StreamChunk | None:
        """The chunk of a launch that made `new` final (None on the last launch, `done`:
        its ids come with the result, or once a stop text has been found)."""
        if self.text is None:
            if done:
                return None
            self.sent_ids += len(new)
            return StreamChunk(new, None)
        self.text.add(new)
        stable = self.text.text
        shown = stops.shown(stable, self.stop_texts)
        if shown is None:
            self.ended = True
            return None
        if done:
            return None
        visible = stable[:shown]
        piece, self.sent_text = visible[len(self.sent_text):], visible
        self.sent_ids += len(new)
        return StreamChunk(new, piece)

    def last(self, result: DecodeResult) -> StreamChunk:
        """The final chunk: the ids and text not handed out yet (the text cut where a
        stop text starts is the result's), and the result."""
        text = None
        if result.text is not None:
            text = (result.text[len(self.sent_text):]
                    if result.text.startswith(self.sent_text) else "")
        return StreamChunk(result.tokens[self.sent_ids:], text, result)
