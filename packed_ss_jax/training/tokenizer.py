"""A byte-level BPE tokenizer in the Hugging Face `tokenizer.json` format.

Digits are split one per token (arithmetic is then learned digit by digit), a BOS
is prepended to every encoded text (as Nemotron's tokenizer does), and four special
tokens come first: BOS, EOS, MASK, PAD.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, MASK, PAD = "<s>", "</s>", "<|mask|>", "<pad>"
SPECIALS = [BOS, EOS, MASK, PAD]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS),
            "mask": tok.token_to_id(MASK), "pad": tok.token_to_id(PAD)}
