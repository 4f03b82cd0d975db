"""A synthetic model, satisfying the forward contract, built to control drafter correctness.

The verifier (rows holding a real token) is a Markov chain over positions: the row
with token t at position p predicts `chain(t, p)`. So the AR greedy continuation
x_1, x_2, ... is fixed by the prompt.

A drafter row (a MASK token) at position k reads its context from what it can see:
the visible real token with the highest position (t, p), i.e. c = p - n0 + 1 verified
output tokens for a prompt of n0 tokens. It rolls the chain forward from (t, p) to k,
which gives the true x_k, and outputs it when `correct[k_out, c]` holds, a wrong
token otherwise. `correct` is passed as the params, so one compiled program serves
every pattern. With `correct[k, c] = c >= c*_k` this is exactly Assumption 3.1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from packed_ss_jax import ModelConfig

MAX_ROLL = 64


@dataclasses.dataclass(frozen=True, eq=False)
class ThresholdModel:
    vocab_size: int
    prompt_len: int
    params: dict
    max_out: int = 64

    @property
    def mask_id(self) -> int:
        return self.vocab_size - 1

    @property
    def config(self) -> ModelConfig:
        """What the decoder reads of a config: the family and the token ids (the layer
        dimensions are placeholders: this model has no layers)."""
        return ModelConfig(family="nemotron", vocab_size=self.vocab_size, hidden_size=1,
                           num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                           intermediate_size=1, rms_norm_eps=1e-5, mask_token_id=self.mask_id,
                           block_size=4)

    @property
    def program_key(self):
        return ("threshold", self.vocab_size, self.prompt_len, self.max_out)


    def chain(self, t, p):
        return (t * 5 + p * 3 + 1) % (self.vocab_size - 1)  # never the MASK id

    def empty_cache(self, size):
        return {"tok": jnp.zeros((1, size), jnp.int32), "pos": jnp.zeros((1, size), jnp.int32)}

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        V, n0 = self.vocab_size, self.prompt_len
        real = tokens != self.mask_id
        # Latest visible real token among the new rows and the committed cache.
        vis_pos = jnp.where(mask & real[None, :], positions[None, :], -1)
        S = cache["tok"].shape[1]
        cache_ok = jnp.arange(S) < cache_len
        c_pos = jnp.where(cache_ok, cache["pos"][0], -1)
        best_new = jnp.max(vis_pos, axis=1)
        best_cache = jnp.max(c_pos) if S else jnp.int32(-1)
        new_tok = tokens[jnp.argmax(vis_pos, axis=1)]
        cache_tok = cache["tok"][0, jnp.argmax(c_pos)] if S else jnp.int32(0)
        use_new = best_new >= best_cache
        p = jnp.where(use_new, best_new, best_cache)
        t = jnp.where(use_new, new_tok, cache_tok)

        def roll(i, tt):
            return jnp.where(p + i < positions, self.chain(tt, p + i), tt)

        truth = jax.lax.fori_loop(0, MAX_ROLL, roll, t)
        c = jnp.clip(p - n0 + 1, 0, self.max_out)
        k_out = jnp.clip(positions - n0 + 1, 0, self.max_out)
        ok = params["correct"][k_out, c]
        draft = jnp.where(ok, truth, (truth + 1) % (V - 1))
        verify = self.chain(tokens, positions)
        pred = jnp.where(real, verify, draft)
        logits = 10.0 * jax.nn.one_hot(pred, V)
        if out_rows is not None:
            logits = logits[out_rows]
        return logits, {"tok": tokens[None, :], "pos": positions[None, :]}


def monotone_table(rng: np.random.Generator, max_out: int) -> np.ndarray:
    """correct[k, c] = c >= c*_k with random thresholds c*_k <= k (Assumption 3.1)."""
    k = np.arange(max_out + 1)
    cstar = np.array([rng.integers(0, kk + 1) for kk in k])
    return k[None, :] >= cstar[:, None]  # rows k, columns c


def arbitrary_table(rng: np.random.Generator, max_out: int, p: float = 0.5) -> np.ndarray:
    """Correctness that may switch off with more context: Assumption 3.1 broken."""
    return rng.random((max_out + 1, max_out + 1)) < p


def model_for(table: np.ndarray, vocab: int, prompt_len: int) -> ThresholdModel:
    return ThresholdModel(vocab, prompt_len, {"correct": jnp.asarray(table)}, table.shape[0] - 1)
