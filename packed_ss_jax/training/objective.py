"""The Nemotron-Labs-Diffusion objective at small scale, on a doubled sequence.

One training row is `[x_t | x_0]`, a noised copy of a clean window and the window itself,
both at positions 0..L-1, cut into blocks under the block-diffusion mask: a noised block
sees itself bidirectionally (M_BD) and the clean copy strictly before it (M_OBC); the
clean copy is causal (M_FC) and never sees the noised one. Loss: `ar_weight` x the clean
copy's shifted AR CE + `diff_weight` x the CE on the noised copy's masked positions
(unshifted: the MASK row at p predicts x_0[p]), each divided by its block's mask rate.
Most blocks are `[x, MASK^(B-1)]`, the layout Packed-SS and Linear-SS draft with; the
kinds of block and their shares: packed_ss_jax/embedded/nld-tiny/README.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import model as model_lib
from ..config import ModelConfig


@dataclasses.dataclass(frozen=True)
class NoiseConfig:
    block_sizes: tuple[int, ...] = (4, 8, 9, 16)
    block_probs: tuple[float, ...] = (0.1, 0.5, 0.2, 0.2)
    p_whole: float = 0.15     # block masked whole: [MASK^B] after the prefix (first call)
    p_draft: float = 0.45     # [x, MASK^(B-1)]: the Packed-SS / Linear-SS draft layout
    min_rate: float = 0.1     # the rest: [x, tokens masked at rate t ~ U(min_rate, 1)]


def noise_batch(rng: np.random.Generator, clean: np.ndarray, mask_id: int,
                nc: NoiseConfig = NoiseConfig()):
    """clean [N, L] int -> (tokens [N, 2L], mask [N, 2L, 2L] bool, diff_w [N, L] float32).

    `diff_w[n, p]` is 1 / (mask rate) where the noised copy holds a MASK, else 0.
    """
    N, L = clean.shape
    noised = clean.copy()
    diff_w = np.zeros((N, L), np.float32)
    start = np.zeros((N, L), np.int64)   # first position of each position's block
    for n in range(N):
        p = 0
        while p < L:
            B = int(rng.choice(nc.block_sizes, p=nc.block_probs))
            end = min(p + B, L)
            start[n, p:end] = p
            u = rng.random()
            if u < nc.p_whole:
                masked, rate = np.ones(end - p, bool), 1.0
            elif u < nc.p_whole + nc.p_draft:
                masked, rate = np.arange(end - p) > 0, 1.0
            else:
                rate = rng.uniform(nc.min_rate, 1.0)
                masked = (rng.random(end - p) < rate) & (np.arange(end - p) > 0)
            noised[n, p:end][masked] = mask_id
            diff_w[n, p:end][masked] = 1.0 / rate
            p = end
    idx = np.arange(L)
    same_block = start[:, :, None] == start[:, None, :]               # M_BD
    earlier_clean = idx[None, None, :] < start[:, :, None]            # M_OBC
    causal = np.broadcast_to(idx[None, :] <= idx[:, None], (N, L, L))  # M_FC
    top = np.concatenate([same_block, earlier_clean], axis=2)
    bottom = np.concatenate([np.zeros((N, L, L), bool), causal], axis=2)
    mask = np.concatenate([top, bottom], axis=1)
    tokens = np.concatenate([noised, clean], axis=1).astype(np.int32)
    return tokens, mask, diff_w


def losses(c: ModelConfig, params, tokens, mask, diff_w):
    """(ar_loss, diff_loss) for a batch built by `noise_batch`.

    ar_loss: mean CE of the clean copy predicting its next token.
    diff_loss: sum of CE / rate over masked positions, over the N * L noised positions.
    """
    N, T = tokens.shape
    L = T // 2
    pos = jnp.concatenate([jnp.arange(L), jnp.arange(L)]).astype(jnp.int32)
    cache = model_lib.empty_cache(c, 0)

    def one(t, m):
        return model_lib.forward(c, params, t, pos, m, cache, jnp.int32(0))[0]

    logits = jax.vmap(one)(tokens, mask)                      # [N, 2L, V] float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    clean = tokens[:, L:]
    ar_ce = -jnp.take_along_axis(logp[:, L:-1], clean[:, 1:, None], axis=-1)[..., 0]
    diff_ce = -jnp.take_along_axis(logp[:, :L], clean[:, :, None], axis=-1)[..., 0]
    ar = jnp.mean(ar_ce)
    diff = jnp.sum(diff_ce * diff_w) / (N * L)
    return ar, diff
