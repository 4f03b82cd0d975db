"""Split decoder wall time into model execution and non-model decoder work (paper F.3).

The decode runs as one XLA program, so no host-side timer can stop around a forward
pass. Two in-program measurements:

`Null` (the default): the same decode program with a forward pass that computes
nothing (constant logits and keys/values of the right shapes). What it costs is the
decoder's own work: acceptance, argmax or sampling, cache commits, emitting,
stopping, loop control and the program launch. Every step has static shapes and no
data-dependent branches, so that work costs the same per iteration whatever was
accepted; the null decode accepts every draft and so runs fewer iterations, and its
wall time is scaled by (real iterations + 1) / (null iterations + 1), the first call
counted. Resolution: microseconds.

`Doubled`: the same decode with every forward pass done twice; the extra wall time is
the model's. The doubled decode makes the same calls with the same shapes and takes
the same decisions; the second pass is decorrelated from the first (its inputs carry
a zero computed from the first pass's logits), so XLA cannot share any of it. Being a
difference of two wall times, it moves by a few percent of wall time between runs on
a shared 2-core CPU (a second pass can also run a little faster or slower than the
first, with the caches it finds).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class _Replaced:
    """`model` with its forward replaced (subclasses define `forward`); everything else,
    the config included, is the model's. Its own `program_key` keeps its programs
    apart from the model's."""

    tag = ""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    @property
    def program_key(self):
        return (self.tag, self._model.program_key)



class Doubled(_Replaced):
    """`model` with every forward pass run twice. Decoding with it follows exactly the
    same trajectory: the second pass's outputs enter the results only multiplied by zero
    (logits are finite), so every decision is the first pass's."""

    tag = "doubled"

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        f = self._model.forward
        logits, kv = f(params, tokens, positions, mask, cache, cache_len, draft_rows, out_rows)
        zero = (logits[0, 0] > jnp.finfo(jnp.float32).max).astype(jnp.int32)  # 0, data-dependent
        logits2, kv2 = f(params, tokens + zero, positions + zero, mask ^ (zero > 0), cache,
                         cache_len + zero, draft_rows, out_rows)
        keep = lambda a, b: a + (0 * b).astype(a.dtype)
        return keep(logits, logits2), jax.tree.map(keep, kv, kv2)


class Null(_Replaced):
    """`model` with a forward that computes nothing: the logits put all their mass on one
    ordinary token (never EOS or MASK, so drafts are accepted and decoding runs to its
    length limit) and the keys/values are zeros. A zero computed from the input tokens
    keeps XLA from folding the decoder's work on them into constants."""

    tag = "null"

    def __init__(self, model):
        super().__init__(model)
        c = model.config
        self._token = next(i for i in range(c.vocab_size)
                           if i not in (c.eos_token_id, c.mask_token_id))

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        rows = tokens.shape[0] if out_rows is None else out_rows.shape[0]
        zero = (tokens[0] < 0).astype(jnp.float32)  # 0, data-dependent
        logits = jnp.zeros((rows, self._model.vocab_size), jnp.float32)
        logits = logits.at[:, self._token].set(1.0 + zero)
        kv = jax.tree.map(lambda a: a + zero.astype(a.dtype),
                          self._model.empty_cache(tokens.shape[0]))
        return logits, kv
