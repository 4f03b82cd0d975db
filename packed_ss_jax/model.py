"""The shared-weight transformer: one forward for verifier and drafter rows.

Verifier (causal) and drafter (masked-diffusion) rows differ only in the attention mask,
so the forward takes the mask as data:

    forward(params, tokens[T], positions[T], mask[T, T], cache, cache_len, draft_rows[T])
        -> logits[T, V] float32, kv rows {"k", "v": per layer [kv_heads, T, head_dim]}

Rows see the first `cache_len` cache positions (or those a [S] bool `cache_len` marks) and
each other as `mask` says; their keys and values (RoPE applied) are returned, never
written: the decoder commits the accepted ones (cache.py). Params come stacked over the
layers (stored, `nn.scan`) or per layer (decoding, unrolled), and `forward` takes either;
why, and each operation's precision: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import cache as cache_lib
from . import rope
from .config import ConfigError, ModelConfig

Params = Any
KV = dict[str, Any]  # {"k", "v"}: a list of per-layer buffers (see cache.py)

_NEG = float(jnp.finfo(jnp.float32).min)  # what the reference adds for masked entries
_TINY = float(jnp.finfo(jnp.float32).tiny)


def param_dtype(c: ModelConfig):
    return jnp.bfloat16 if c.dtype == "bfloat16" else jnp.float32


# `ModelConfig.matmul_precision` -> the `precision` of every matmul. "default" defers to
# `jax.default_matmul_precision` (on GPUs, float32 operands then run as TF32); "highest"
# gives full float32 products, as the paper's float32 SetDLM runs need.
MATMUL_PRECISIONS = {"default": None, "high": jax.lax.Precision.HIGH,
                     "highest": jax.lax.Precision.HIGHEST}


def matmul_precision(c: ModelConfig):
    if c.matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError(f"unknown matmul_precision {c.matmul_precision!r}; expected one of "
                          f"{tuple(MATMUL_PRECISIONS)}")
    return MATMUL_PRECISIONS[c.matmul_precision]


def _in_loop(w, x):
    """`w` tied to the activation `x`, for a weight stored below float32.

    A backend that computes an operation on bf16 operands in float32 (XLA's CPU does for
    row lookups, norms and some dots) widens `w` in front of it. Inside the decode loop
    the widened copy depends on nothing the loop changes, so loop-invariant code motion
    hoists it out of the `while_loop`, and the loop carries a float32 copy of every
    weight (15 GB for the 3B model, twice its bf16 weights). Passing `w` through an
    optimization barrier together with `x`, which the loop computes, makes the widening
    depend on loop-carried data: it stays next to its use (fused into it where XLA can,
    as in a row lookup). Where bf16 is read directly (GPU, TPU) nothing is widened and
    the barrier moves no data.
    """
    if w.dtype == jnp.float32:
        return w, x
    return jax.lax.optimization_barrier((w, x))


def dense(x, w, precision):
    """x [rows, in] @ w with float32 accumulation; x is cast to the weight's dtype (bf16
    operands on bf16 weights), the result is float32."""
    w, x = _in_loop(w, x)
    x = x.astype(w.dtype)
    # XLA's CPU dot library multiplies bf16 operands of two rows or more; a single row
    # goes to a matrix-vector path that widens the whole weight to float32 first.
    single = x.shape[0] == 1 and w.dtype != jnp.float32 and cache_lib.widens_16bit()
    if single:
        x = jnp.concatenate([x, x])
    y = jnp.dot(x, w, preferred_element_type=jnp.float32, precision=precision)
    return y[:1] if single else y


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w, y = _in_loop(w, y)  # the widened weight stays in the loop (see `_in_loop`)
        return w.astype(jnp.float32) * y.astype(x.dtype)  # weight as stored (not 1 + w)


def _dense_init(std: float = 0.02):
    return nn.initializers.normal(stddev=std)


class Attention(nn.Module):
    c: ModelConfig

    @nn.compact
    def __call__(self, x, cache_kv: KV, cos, sin, q_scale, seen, mask, draft_rows):
        c, dt, prec = self.c, param_dtype(self.c), matmul_precision(self.c)
        T = x.shape[0]
        wq = self.param("q_proj", _dense_init(), (c.hidden_size, c.num_heads * c.head_dim), dt)
        wk = self.param("k_proj", _dense_init(), (c.hidden_size, c.num_kv_heads * c.head_dim), dt)
        wv = self.param("v_proj", _dense_init(), (c.hidden_size, c.num_kv_heads * c.head_dim), dt)
        wo = self.param("o_proj", _dense_init(), (c.num_heads * c.head_dim, c.hidden_size), dt)
        q = dense(x, wq, prec).reshape(T, c.num_heads, c.head_dim)
        k = dense(x, wk, prec).reshape(T, c.num_kv_heads, c.head_dim)
        v = dense(x, wv, prec).reshape(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
            q = RMSNorm(c.rms_norm_eps, dt, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, dt, name="k_norm")(k)
        q = rope.apply(q, cos, sin) * q_scale[:, None, None]  # Llama-4 scale, after RoPE

        # The new rows' keys/values are rounded to the cache's dtype here, once: the rows
        # attend to these values now and read the same values from the cache in later
        # calls, and the commit writes them without converting the buffer.
        k = rope.apply(k, cos, sin).astype(dt)
        v = v.astype(dt)

        # Head-major [kv_heads, rows, head_dim], as the cache is stored: the kv head is the
        # batch axis of both attention products, so the cache is read where it lies.
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        qg = q.reshape(T, c.num_kv_heads, c.num_groups, c.head_dim).transpose(1, 0, 2, 3)
        qg = qg.astype(dt)  # both products take operands in the weights' dtype, float32 sums
        out = attend(qg, k, v, cache_kv, seen, mask, dt, prec)
        out = out.transpose(1, 0, 2, 3).reshape(T, c.num_heads * c.head_dim)

        y = dense(out, wo, prec)
        if c.lora_rank:
            # Draft-only adapter (paper App. F.2): a per-row switch, so verifier rows
            # in the same packed call stay the base model.
            a = self.param("lora_a", _dense_init(), (c.num_heads * c.head_dim, c.lora_rank), dt)
            b = self.param("lora_b", nn.initializers.zeros, (c.lora_rank, c.hidden_size), dt)
            delta = dense(dense(out, a, prec), b, prec) * jnp.float32(c.lora_scale)
            y = jnp.where(draft_rows[:, None], y + delta, y)
        return y, {"k": cache_lib.stored(k), "v": cache_lib.stored(v)}


# Live-length attention (see `attend`): the backends that use it, the shortest cache it
# is used for, and the positions it reads per step.
#
# On a CPU, reading only the live chunks pays for a large cache that is mostly empty, and
# costs more for a full one (every chunk is copied out of the buffer before its product)
# or a small one (`python -m benchmarks.attention_timing`; docs/performance.md). It is
# off on GPUs: an XLA while loop there waits for the host on each trip unless it runs as
# a CUDA graph, layers x chunks waits per call, where reading the whole cache takes a
# fraction of a millisecond at HBM bandwidth.
LIVE_ATTENTION = ("cpu",)
LIVE_MIN_POSITIONS = 1024
CHUNK = 256


def attend(qg, k, v, cache_kv: KV, seen, mask, dt, prec):
    """Softmax attention of the queries `qg` [kv_heads, T, G, D] over the cache positions
    marked by `seen` [S] and the call's own rows `k`, `v` [kv_heads, T, D] (as `mask`
    [T, T] allows), as one softmax; returns [kv_heads, T, G, D] float32.

    The cache and the new rows are two key blocks: concatenating the keys would copy the
    whole cache buffer in every layer. The cache block is read whole, or, on the
    LIVE_ATTENTION backends and caches of LIVE_MIN_POSITIONS positions or more, only up to
    its last marked position, a chunk at a time under an online softmax (`_attend_live`): the
    cost of a call then follows the sequence, not the buffer. (On the CPU this also
    keeps a bf16 cache, stored as bits, from being bitcast whole for every read.)
    """
    scale = 1.0 / jnp.sqrt(jnp.float32(qg.shape[-1]))

    def scores_over(keys):  # query head h reads kv head h // G
        return jnp.einsum("ktgd,ksd->ktgs", qg, keys, preferred_element_type=jnp.float32,
                          precision=prec) * scale

    def mix(p, values):
        return jnp.einsum("ktgs,ksd->ktgd", p.astype(values.dtype), values,
                          preferred_element_type=jnp.float32, precision=prec)

    S = cache_kv["k"].shape[cache_lib.POSITION_AXIS]
    new = jnp.where(mask[None, :, None, :], scores_over(k), _NEG)
    if S >= LIVE_MIN_POSITIONS and jax.default_backend() in LIVE_ATTENTION:
        m, l, acc = _attend_live(scores_over, mix, cache_kv, seen, dt, qg.shape[:3])
        top = jnp.maximum(m, jnp.max(new, axis=-1))
        p = jnp.where(mask[None, :, None, :], jnp.exp(new - top[..., None]), 0.0)
        fix = jnp.exp(m - top)
        total = l * fix + jnp.sum(p, axis=-1)  # > 0 for any row that sees some key
        return (acc * fix[..., None] + mix(p, v)) / jnp.maximum(total, _TINY)[..., None]
    cache_k, cache_v = (cache_lib.loaded(cache_kv[n], dt) for n in ("k", "v"))
    old = jnp.where(seen[None, None, None, :], scores_over(cache_k), _NEG)
    probs = jax.nn.softmax(jnp.concatenate([old, new], axis=-1), axis=-1)
    return mix(probs[..., :S], cache_v) + mix(probs[..., S:], v)


def chunk_size(positions: int) -> int:
    """Positions per read of the live-length attention over a `positions`-position cache: at most
    CHUNK, and equal chunks that tile the buffer with little overlap."""
    chunks = -(-positions // CHUNK)
    return -(-positions // chunks)


def _attend_live(scores_over, mix, cache_kv: KV, seen, dt, lead):
    """The cache block of `attend`, read CHUNK positions at a time up to the last seen one
    (an online softmax): returns the running max, sum and weighted values."""
    S = cache_kv["k"].shape[cache_lib.POSITION_AXIS]
    chunk = chunk_size(S)
    live = jnp.max(jnp.where(seen, jnp.arange(1, S + 1), 0))
    offset = jnp.arange(chunk)

    def step(i, carry):
        m, l, acc = carry
        # The last chunk is moved back to end at S (a slice must stay in the buffer); the
        # positions it shares with the chunk before were counted there already.
        start = jnp.minimum(i * chunk, S - chunk)
        keys, values = (cache_lib.loaded(
            jax.lax.dynamic_slice_in_dim(cache_kv[n], start, chunk,
                                         axis=cache_lib.POSITION_AXIS), dt)
            for n in ("k", "v"))
        ok = jax.lax.dynamic_slice_in_dim(seen, start, chunk) & (start + offset >= i * chunk)
        s = jnp.where(ok, scores_over(keys), _NEG)
        top = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(ok, jnp.exp(s - top[..., None]), 0.0)
        fix = jnp.exp(m - top)
        return top, l * fix + jnp.sum(p, axis=-1), acc * fix[..., None] + mix(p, values)

    D = cache_kv["k"].shape[-1]
    init = (jnp.full(lead, _NEG, jnp.float32), jnp.zeros(lead, jnp.float32),
            jnp.zeros(lead + (D,), jnp.float32))
    return jax.lax.fori_loop(0, (live + chunk - 1) // chunk, step, init)


class MLP(nn.Module):
    c: ModelConfig

    @nn.compact
    def __call__(self, x):
        c, dt, prec = self.c, param_dtype(self.c), matmul_precision(self.c)
        gate = self.param("gate_proj", _dense_init(), (c.hidden_size, c.intermediate_size), dt)
        up = self.param("up_proj", _dense_init(), (c.hidden_size, c.intermediate_size), dt)
        down = self.param("down_proj", _dense_init(), (c.intermediate_size, c.hidden_size), dt)
        return dense(jax.nn.silu(dense(x, gate, prec)) * dense(x, up, prec), down, prec)


class DecoderLayer(nn.Module):
    c: ModelConfig

    @nn.compact
    def __call__(self, h, cache_kv, cos, sin, q_scale, seen, mask, draft_rows):
        c, dt = self.c, param_dtype(self.c)
        a, kv = Attention(c, name="attn")(
            RMSNorm(c.rms_norm_eps, dt, name="input_norm")(h), cache_kv, cos, sin, q_scale, seen,
            mask, draft_rows)
        h = h + a
        h = h + MLP(c, name="mlp")(RMSNorm(c.rms_norm_eps, dt, name="post_attn_norm")(h))
        return h, kv


class Transformer(nn.Module):
    c: ModelConfig
    unrolled: bool = False  # the decoding params layout (see module doc)

    @nn.compact
    def __call__(self, tokens, positions, mask, cache: KV, cache_len, draft_rows, out_rows=None):
        c, dt = self.c, param_dtype(self.c)
        embed = self.param("embed", _dense_init(), (c.vocab_size, c.hidden_size), dt)
        # The residual stream is float32 whatever the weights' dtype (it is a few rows);
        # each matmul casts its input to the weight dtype (see `dense`).
        table, tokens_ = _in_loop(embed, tokens)  # a lookup that widens only its rows
        h = table[tokens_].astype(jnp.float32)
        cos, sin = rope.cos_sin(c, positions)
        q_scale = rope.query_scale(c, positions)
        S = cache["k"][0].shape[cache_lib.POSITION_AXIS]
        seen = jnp.asarray(cache_len)
        if seen.ndim == 0:  # a count: the committed prefix
            seen = jnp.arange(S) < seen
        shared = (cos, sin, q_scale, seen, mask, draft_rows)
        if self.unrolled:
            kv = {"k": [], "v": []}
            for i in range(c.num_layers):
                layer_cache = {"k": cache["k"][i], "v": cache["v"][i]}
                h, kv_i = DecoderLayer(c, name=f"layer_{i}")(h, layer_cache, *shared)
                kv["k"].append(kv_i["k"])
                kv["v"].append(kv_i["v"])
        else:  # training: the per-layer buffers are stacked for the scan (S is 0 there)
            cache = jax.tree.map(lambda *a: jnp.stack(a), *_layers_of(cache))
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0,) + (nn.broadcast,) * 6,
                length=c.num_layers,
            )(c, name="layers")
            h, stacked = layers(h, cache, *shared)
            kv = {name: list(stacked[name]) for name in ("k", "v")}
        if out_rows is not None:  # the head is the largest matmul: run it only where read
            h = h[out_rows]
        h = RMSNorm(c.rms_norm_eps, dt, name="final_norm")(h)
        if c.tie_embeddings:
            head = embed.T
        else:
            head = self.param("head", _dense_init(), (c.hidden_size, c.vocab_size), dt)
        logits = dense(h, head, matmul_precision(c))
        return logits, kv


def empty_cache(c: ModelConfig, size: int) -> KV:
    """A cache of `size` positions: per layer, `[kv_heads, positions, head_dim]` (see cache.py)."""
    shape = (c.num_kv_heads, size, c.head_dim)
    return {name: [cache_lib.empty(shape, param_dtype(c)) for _ in range(c.num_layers)]
            for name in ("k", "v")}


def _layers_of(cache: KV) -> list[KV]:
    return [{"k": k, "v": v} for k, v in zip(cache["k"], cache["v"])]


def forward(c: ModelConfig, params: Params, tokens, positions, mask, cache: KV, cache_len,
            draft_rows=None, out_rows=None):
    """The forward contract the schedules are written against (see module doc).

    `out_rows` (optional int array) selects the rows whose logits are returned.
    """
    if draft_rows is None:
        draft_rows = jnp.zeros(tokens.shape, bool)
    module = Transformer(c, unrolled=is_unstacked(params))
    return module.apply({"params": params}, tokens, positions, mask, cache, cache_len,
                        draft_rows, out_rows)


def is_unstacked(params) -> bool:
    return "layers" not in params


def unstack_layers(params: Params) -> Params:
    """Stored layout -> decoding layout: `layers` (stacked) becomes `layer_0 .. layer_{L-1}`.
    A params tree already in the decoding layout is returned as it is."""
    if is_unstacked(params):
        return params
    rest = {k: v for k, v in params.items() if k != "layers"}
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return rest | {f"layer_{i}": jax.tree.map(lambda a: a[i], stacked) for i in range(n)}


def stack_layers(params: Params) -> Params:
    """Decoding layout -> stored layout (the inverse of `unstack_layers`)."""
    if not is_unstacked(params):
        return params
    names = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    rest = {k: v for k, v in params.items() if k not in names}
    return rest | {"layers": jax.tree.map(lambda *a: jnp.stack(a), *(params[k] for k in names))}


@functools.lru_cache(maxsize=None)
def abstract_params(c: ModelConfig):
    """Shapes and dtypes of the params tree, derived from the module (written down once)."""
    t = 2
    return jax.eval_shape(
        lambda: Transformer(c).init(
            jax.random.PRNGKey(0), jnp.zeros(t, jnp.int32), jnp.arange(t), jnp.ones((t, t), bool),
            empty_cache(c, 0), jnp.int32(0), jnp.zeros(t, bool))["params"])


@functools.partial(jax.jit, static_argnums=0)
def init_params(c: ModelConfig, key: jax.Array) -> Params:
    """Random params (std 0.02 matrices, unit norms); for tests and training from scratch."""
    t = 2
    return Transformer(c).init(
        key, jnp.zeros(t, jnp.int32), jnp.arange(t), jnp.ones((t, t), bool), empty_cache(c, 0),
        jnp.int32(0), jnp.zeros(t, bool))["params"]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A config, its params and (optionally) a tokenizer: what `decode` and `logits` take.

    A JAX pytree: the params are its leaves and the config, tokenizer and source its static
    structure, so a model goes through `jax.jit`, `jax.device_put`, sharding and tree
    utilities like any params tree (`jax.tree.map(f, model)` is a Model again).
    """

    config: ModelConfig
    params: Any             # kept in the decoding layout (see `unstack_layers`)
    tokenizer: Any = None
    source: str | None = None

    def __post_init__(self):
        # Params arrive in the stored layout (checkpoints, training); the decode programs
        # read each layer's weights from their own buffers, so split them once, here.
        if self.params is not None:
            object.__setattr__(self, "params", unstack_layers(self.params))

    @property
    def stored_params(self):
        """The params in the stored layout (`layers` stacked), as checkpoints hold them."""
        return stack_layers(self.params)

    @property
    def program_key(self):
        """What its compiled programs are stored under: they depend on the config, not on
        the weights (not a PRNG key)."""
        return ("transformer", self.config)


    @property
    def mask_id(self) -> int:
        return self.config.mask_token_id

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        return forward(self.config, params, tokens, positions, mask, cache, cache_len,
                       draft_rows, out_rows)

    def empty_cache(self, size: int):
        return empty_cache(self.config, size)

    def __repr__(self):
        c = self.config
        n = sum(getattr(x, "size", 0) for x in jax.tree.leaves(self.params))
        return (f"Model({c.family}, {n / 1e6:.2f}M params, {c.num_layers} layers, "
                f"vocab {c.vocab_size}, {c.dtype}, lora={'on' if c.lora_rank else 'off'}, "
                f"source={self.source!r})")


def _model_children(m: Model):
    return ((jax.tree_util.GetAttrKey("params"), m.params),), (m.config, m.tokenizer, m.source)


def _model_unflatten(static, children) -> Model:
    # Not through __init__: a transformation may hand back leaves of any kind (tracers,
    # shapes, shardings), which must not be re-split into layers.
    m = object.__new__(Model)
    for name, value in zip(("config", "tokenizer", "source"), static):
        object.__setattr__(m, name, value)
    object.__setattr__(m, "params", children[0])
    return m


jax.tree_util.register_pytree_with_keys(
    Model, _model_children, _model_unflatten,
    flatten_func=lambda m: ((m.params,), (m.config, m.tokenizer, m.source)))
