"""Split decoder wall time into model execution and non-model decoder work (paper F.3).

The decode runs as one XLA program, so no host-side timer can stop around a forward
pass. The split is measured inside the program instead, by difference: the same decode
is run once as it is and once with every forward pass done twice (`Doubled`). The
doubled decode makes the same calls in the same order with the same shapes and takes
the same decisions, so its extra wall time is the time of the model calls as they run
in the loop; the rest of the wall time (acceptance, sampling, cache commits, stopping,
loop control, launching the program) is the non-model decoder work.

The second pass is decorrelated from the first (its token ids, positions, mask and
cache length carry a zero computed from the first pass's logits), so XLA cannot share
any part of it with the first: it repeats all of the model's work, from the embedding
lookup on. The estimate's resolution on a shared 2-core CPU is a few percent of wall
time (a doubled pass can also cost a little more than a single one: it evicts more
cache), so a small negative non-model share means "below resolution".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class Doubled:
    """`model` with every forward pass run twice. Decoding with it follows exactly the
    same trajectory: the second pass's outputs enter the results only multiplied by zero
    (logits are finite), so every decision is the first pass's."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    @property
    def key(self):
        return ("doubled", self._model.key)

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        f = self._model.forward
        logits, kv = f(params, tokens, positions, mask, cache, cache_len, draft_rows, out_rows)
        zero = (logits[0, 0] > jnp.finfo(jnp.float32).max).astype(jnp.int32)  # 0, data-dependent
        logits2, kv2 = f(params, tokens + zero, positions + zero, mask ^ (zero > 0), cache,
                         cache_len + zero, draft_rows, out_rows)
        keep = lambda a, b: a + (0 * b).astype(a.dtype)
        return keep(logits, logits2), jax.tree.map(keep, kv, kv2)
