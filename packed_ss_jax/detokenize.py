"""Text for a growing list of token ids, handed out only once it is stable.

A byte-level tokenizer splits one character over several tokens (an accented letter, a
CJK character, an emoji); decoding a prefix that ends inside such a character gives
U+FFFD replacement characters that a later token turns into the real character. Text is
handed out only up to the last complete character, so a stream never shows (and never
has to take back) a replacement character that the whole decode would not hold. The ids
are decoded whole each time, so the streamed text is exactly the decode's text.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


class Detokenizer:
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
