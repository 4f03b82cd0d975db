"""A streamed decode's output as chunks: the ids that became final in each launch and
the text that became stable with them, held back where a stop text could still begin,
ending where one is found (stops.py). `stream` feeds it from one request's launches, the
server from each slot of its batched launches."""

from __future__ import annotations

import dataclasses

from . import stops
from .detokenize import Detokenizer
from .results import DecodeResult


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
        if stops.find_text(stable, self.stop_texts) is not None:
            self.ended = True
            return None
        visible = stable[: len(stable) - stops.holdback(stable, self.stop_texts)]
        if done:
            return None
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
