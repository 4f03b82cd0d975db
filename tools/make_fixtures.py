"""Writes the project's reference fixtures: tiny random float32 checkpoints in the released
on-disk layouts of Nemotron-Labs-Diffusion and SetDLM, with reference logits.

    python -m tools.make_fixtures --out tests/fixtures

Weights and token ids come from NumPy generators with fixed seeds (never torch's RNG), so
the checkpoints do not depend on the torch build. The reference logits are computed by
Hugging Face transformers (`Ministral3ForCausalLM`, `Qwen3ForCausalLM`) on CPU in float32
with eager attention, explicit position ids and 4-D additive masks, and every logits
array is recomputed by an independent float64 NumPy model written here: the run fails
if the two disagree by more than TOLERANCE anywhere. Cached-prefix layouts are run both
through a `DynamicCache` and as one square-mask pass.

Everything is written to a temporary folder beside --out and moved into place at the
end, so an interrupted run leaves either the previous set or the new one. The output is
byte-for-byte deterministic for a given software stack (see `manifest.json`).
Needs the `reference` extra: `pip install -e ".[reference]"`.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

GENERATOR = "tools/make_fixtures.py"
GENERATOR_VERSION = 1
TOLERANCE = 1e-4
# The greedy continuation must survive float32 noise and reduced-precision ports with
# room to spare (float32 rounding moves these logits by ~1e-6), and must not be a short
# loop, which would make every speculative schedule trivially right.
MIN_GREEDY_MARGIN = 1e-2
MIN_GREEDY_DISTINCT = 20
MAX_GREEDY_ATTEMPTS = 5000
# A token picked by argmax (the seed, the drafts) must be the same token in float64.
MIN_PICK_MARGIN = 1e-3

NEMOTRON = "nemotron_tiny"
SETDLM = "setdlm_tiny"
SETDLM_ST = "setdlm_tiny_safetensors"
LORA_DIR = "linear_spec_lora"

PARAMS = {
    "nemotron": {
        "seed": 2718, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32,
        "inter": 160, "vocab": 320, "eps": 1e-05, "mask_id": 100, "bos_id": 1, "eos_id": 2,
        "block": 8, "prefix": 16, "n_drafts": 3, "ar_len": 20, "long_len": 100,
        "greedy_prompt_len": 12, "greedy_new": 40,
        "rope": {"theta": 1000000.0, "factor": 4.0, "orig": 32, "beta_fast": 32.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama4_beta": 0.1},
        "max_pos": 128, "lora_r": 4, "lora_alpha": 16,
        "std": 0.05, "qk_std": 0.2, "vo_std": 0.08, "lora_std": 0.05, "norm_std": 0.1,
    },
    "setdlm": {
        "seed": 3141, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
        "inter": 128, "rows": 300, "tok_vocab": 300, "mask_id": 299, "eos_id": 290,
        "eps": 1e-06, "theta": 1000000.0, "max_pos": 512, "length": 64, "train_len": 12,
        "prefix": 10, "window": 4, "n_new": 2,
        "std": 0.05, "vo_std": 0.1, "norm_std": 0.1,
    },
}

# Independent random streams per purpose, so adding a draw to one never shifts another.
WEIGHTS, IDS, GREEDY = 0, 1, 2


class FixtureError(Exception):
    """A problem reported as one line (bad --out, missing packages, a failed check)."""


# --- weights ------------------------------------------------------------------------------

def _matrix(rng, std, shape):
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _norm(rng, std, n):
    # Away from 1 so that a port computing `(1 + w) * x` is visibly wrong.
    return (1.0 + rng.standard_normal(n) * std).astype(np.float32)


def nemotron_weights(p: dict) -> tuple[dict, dict]:
    """(checkpoint tensors, adapter tensors), in the release's names, drawn in a fixed order."""
    rng = np.random.default_rng([p["seed"], WEIGHTS])
    H, F, V, d = p["hidden"], p["inter"], p["vocab"], p["head_dim"]
    nq, nkv = p["heads"] * d, p["kv_heads"] * d
    w = {"encoder.embed_tokens.weight": _matrix(rng, p["std"], (V, H))}
    for i in range(p["layers"]):
        pre = f"encoder.layers.{i}."
        w[pre + "input_layernorm.weight"] = _norm(rng, p["norm_std"], H)
        w[pre + "self_attn.q_proj.weight"] = _matrix(rng, p["qk_std"], (nq, H))
        w[pre + "self_attn.k_proj.weight"] = _matrix(rng, p["qk_std"], (nkv, H))
        w[pre + "self_attn.v_proj.weight"] = _matrix(rng, p["vo_std"], (nkv, H))
        w[pre + "self_attn.o_proj.weight"] = _matrix(rng, p["vo_std"], (H, nq))
        w[pre + "post_attention_layernorm.weight"] = _norm(rng, p["norm_std"], H)
        w[pre + "mlp.gate_proj.weight"] = _matrix(rng, p["std"], (F, H))
        w[pre + "mlp.up_proj.weight"] = _matrix(rng, p["std"], (F, H))
        w[pre + "mlp.down_proj.weight"] = _matrix(rng, p["std"], (H, F))
    w["encoder.norm.weight"] = _norm(rng, p["norm_std"], H)
    w["diffusion_head.weight"] = _matrix(rng, p["std"], (V, H))
    lora = {}
    for i in range(p["layers"]):
        pre = f"base_model.model.encoder.layers.{i}.self_attn.o_proj."
        lora[pre + "lora_A.weight"] = _matrix(rng, p["lora_std"], (p["lora_r"], nq))
        lora[pre + "lora_B.weight"] = _matrix(rng, p["lora_std"], (H, p["lora_r"]))
    return w, lora


SETDLM_EMBED = "backbone.model.model.embed_tokens.weight"
SETDLM_HEAD = "backbone.model.lm_head.weight"


def setdlm_weights(p: dict) -> dict:
    """Checkpoint tensors in the release's names and in Qwen3's state-dict order, head last."""
    rng = np.random.default_rng([p["seed"], WEIGHTS])
    H, F, V, d = p["hidden"], p["inter"], p["rows"], p["head_dim"]
    nq, nkv = p["heads"] * d, p["kv_heads"] * d
    w = {SETDLM_EMBED: _matrix(rng, p["std"], (V, H))}
    for i in range(p["layers"]):
        pre = f"backbone.model.model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = _matrix(rng, p["std"], (nq, H))
        w[pre + "self_attn.k_proj.weight"] = _matrix(rng, p["std"], (nkv, H))
        w[pre + "self_attn.v_proj.weight"] = _matrix(rng, p["vo_std"], (nkv, H))
        w[pre + "self_attn.o_proj.weight"] = _matrix(rng, p["vo_std"], (H, nq))
        w[pre + "self_attn.q_norm.weight"] = _norm(rng, p["norm_std"], d)
        w[pre + "self_attn.k_norm.weight"] = _norm(rng, p["norm_std"], d)
        w[pre + "mlp.gate_proj.weight"] = _matrix(rng, p["std"], (F, H))
        w[pre + "mlp.up_proj.weight"] = _matrix(rng, p["std"], (F, H))
        w[pre + "mlp.down_proj.weight"] = _matrix(rng, p["std"], (H, F))
        w[pre + "input_layernorm.weight"] = _norm(rng, p["norm_std"], H)
        w[pre + "post_attention_layernorm.weight"] = _norm(rng, p["norm_std"], H)
    w["backbone.model.model.norm.weight"] = _norm(rng, p["norm_std"], H)
    w[SETDLM_HEAD] = w[SETDLM_EMBED]
    return w


# --- the float64 NumPy model -----------------------------------------------------------------
# Written from the documented math alone (no code shared with transformers or the package),
# so that agreement with transformers is evidence that both are right.

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def yarn(head_dim, r: dict) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention factor) of YaRN, float64."""
    d, theta = head_dim, r["theta"]
    i = np.arange(d // 2, dtype=np.float64)
    base = theta ** (-2.0 * i / d)
    low = max(math.floor(d * math.log(r["orig"] / (r["beta_fast"] * 2 * math.pi))
                         / (2 * math.log(theta))), 0)
    high = min(math.ceil(d * math.log(r["orig"] / (r["beta_slow"] * 2 * math.pi))
                         / (2 * math.log(theta))), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    inv = base / r["factor"] * ramp + base * (1.0 - ramp)
    lf = math.log(r["factor"])
    factor = (0.1 * r["mscale"] * lf + 1.0) / (0.1 * r["mscale_all_dim"] * lf + 1.0)
    return inv, factor


def llama4_scale(positions, r: dict) -> np.ndarray:
    return 1.0 + r["llama4_beta"] * np.log1p(np.floor(np.asarray(positions) / r["orig"]))


class NumpyModel:
    """Decoder-only transformer in float64 over a full square mask (no cache needed: a
    cached prefix is the same forward over [prefix ; rows], prefix rows never seeing the
    rows after them)."""

    def __init__(self, *, layers, embed, norm, head, heads, kv_heads, head_dim, eps,
                 inv_freq, rope_factor=1.0, q_scale=None, lora=None):
        self.layers, self.embed, self.norm, self.head = layers, embed, norm, head
        self.heads, self.kv_heads, self.d, self.eps = heads, kv_heads, head_dim, eps
        self.inv_freq, self.rope_factor, self.q_scale = inv_freq, rope_factor, q_scale
        self.lora = lora  # (scale, [(A, B)] per layer) or None

    def _rope(self, x, positions):
        ang = np.asarray(positions, np.float64)[:, None] * self.inv_freq[None, :]
        cos = (np.cos(ang) * self.rope_factor)[:, None, :]
        sin = (np.sin(ang) * self.rope_factor)[:, None, :]
        h = self.d // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def logits(self, tokens, positions, mask, lora_rows=None) -> np.ndarray:
        tokens = np.asarray(tokens)
        mask = np.asarray(mask, bool)
        T = len(tokens)
        assert mask.shape == (T, T) and mask[np.arange(T), np.arange(T)].all()
        x = self.embed[tokens]
        group = self.heads // self.kv_heads
        kv_of = np.arange(self.heads) // group
        for li, L in enumerate(self.layers):
            h = _rms(x, L["ln1"], self.eps)
            q = (h @ L["q"].T).reshape(T, self.heads, self.d)
            k = (h @ L["k"].T).reshape(T, self.kv_heads, self.d)
            v = (h @ L["v"].T).reshape(T, self.kv_heads, self.d)
            if "qn" in L:
                q, k = _rms(q, L["qn"], self.eps), _rms(k, L["kn"], self.eps)
            q, k = self._rope(q, positions), self._rope(k, positions)
            if self.q_scale is not None:
                q = q * self.q_scale(positions)[:, None, None]
            k, v = k[:, kv_of], v[:, kv_of]
            s = np.einsum("thd,shd->hts", q, k) / math.sqrt(self.d)
            s = np.where(mask[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = s / s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", a, v).reshape(T, self.heads * self.d)
            y = o @ L["o"].T
            if lora_rows is not None and self.lora is not None:
                scale, ab = self.lora
                A, B = ab[li]
                y[lora_rows] += scale * (o[lora_rows] @ A.T) @ B.T
            x = x + y
            n = _rms(x, L["ln2"], self.eps)
            g = n @ L["gate"].T
            x = x + (g / (1.0 + np.exp(-g)) * (n @ L["up"].T)) @ L["down"].T
        return _rms(x, self.norm, self.eps) @ self.head.T


def numpy_nemotron(w: dict, lora: dict, p: dict) -> NumpyModel:
    f = {k: v.astype(np.float64) for k, v in w.items()}
    layers = []
    for i in range(p["layers"]):
        pre = f"encoder.layers.{i}."
        layers.append({"ln1": f[pre + "input_layernorm.weight"],
                       "q": f[pre + "self_attn.q_proj.weight"],
                       "k": f[pre + "self_attn.k_proj.weight"],
                       "v": f[pre + "self_attn.v_proj.weight"],
                       "o": f[pre + "self_attn.o_proj.weight"],
                       "ln2": f[pre + "post_attention_layernorm.weight"],
                       "gate": f[pre + "mlp.gate_proj.weight"],
                       "up": f[pre + "mlp.up_proj.weight"],
                       "down": f[pre + "mlp.down_proj.weight"]})
    ab = [(lora[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_A.weight"]
           .astype(np.float64),
           lora[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_B.weight"]
           .astype(np.float64)) for i in range(p["layers"])]
    inv, factor = yarn(p["head_dim"], p["rope"])
    return NumpyModel(layers=layers, embed=f["encoder.embed_tokens.weight"],
                      norm=f["encoder.norm.weight"], head=f["diffusion_head.weight"],
                      heads=p["heads"], kv_heads=p["kv_heads"], head_dim=p["head_dim"],
                      eps=p["eps"], inv_freq=inv, rope_factor=factor,
                      q_scale=lambda pos: llama4_scale(pos, p["rope"]),
                      lora=(p["lora_alpha"] / p["lora_r"], ab))


def numpy_setdlm(w: dict, p: dict) -> NumpyModel:
    f = {k: v.astype(np.float64) for k, v in w.items()}
    layers = []
    for i in range(p["layers"]):
        pre = f"backbone.model.model.layers.{i}."
        layers.append({"ln1": f[pre + "input_layernorm.weight"],
                       "q": f[pre + "self_attn.q_proj.weight"],
                       "k": f[pre + "self_attn.k_proj.weight"],
                       "v": f[pre + "self_attn.v_proj.weight"],
                       "o": f[pre + "self_attn.o_proj.weight"],
                       "qn": f[pre + "self_attn.q_norm.weight"],
                       "kn": f[pre + "self_attn.k_norm.weight"],
                       "ln2": f[pre + "post_attention_layernorm.weight"],
                       "gate": f[pre + "mlp.gate_proj.weight"],
                       "up": f[pre + "mlp.up_proj.weight"],
                       "down": f[pre + "mlp.down_proj.weight"]})
    d = p["head_dim"]
    inv = p["theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    return NumpyModel(layers=layers, embed=f[SETDLM_EMBED],
                      norm=f["backbone.model.model.norm.weight"], head=f[SETDLM_EMBED],
                      heads=p["heads"], kv_heads=p["kv_heads"], head_dim=d, eps=p["eps"],
                      inv_freq=inv)


# --- transformers ----------------------------------------------------------------------------

def import_reference():
    """(torch, transformers), or a one-line FixtureError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise FixtureError(f"{e.name or 'torch/transformers'} is not installed; the generator "
                           "needs the reference extra: pip install -e \".[reference]\"") from None
    if not hasattr(transformers, "Ministral3ForCausalLM"):
        raise FixtureError(f"transformers {transformers.__version__} has no "
                           "Ministral3ForCausalLM; install transformers>=5.0")
    return torch, transformers


class HFRunner:
    """A transformers causal LM called with explicit position ids and 4-D additive masks,
    with an optional LoRA on every o_proj applied through forward hooks."""

    def __init__(self, torch, transformers, model):
        if model.config._attn_implementation != "eager":
            raise FixtureError(f"{type(model).__name__} runs "
                               f"{model.config._attn_implementation} attention, not eager")
        self.torch, self.tf, self.model = torch, transformers, model
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` during 5.x.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.lora_on = False
        self._hooks = []

    def add_lora(self, ab, scale):
        torch = self.torch

        def hook_for(A, B):
            A, B = torch.from_numpy(A), torch.from_numpy(B)

            def hook(module, args, out):
                if not self.lora_on:
                    return out
                return out + scale * ((args[0] @ A.T) @ B.T)
            return hook

        for layer, (A, B) in zip(self.model.model.layers, ab, strict=True):
            self._hooks.append(layer.self_attn.o_proj.register_forward_hook(hook_for(A, B)))

    def _additive(self, mask):
        torch = self.torch
        m = torch.from_numpy(np.asarray(mask, bool))
        neg = torch.finfo(torch.float32).min
        return torch.where(m, 0.0, neg).to(torch.float32)[None, None]

    def _new_cache(self):
        try:
            return self.tf.DynamicCache(config=self.model.config)
        except TypeError:
            return self.tf.DynamicCache()

    def _call(self, tokens, positions, mask, cache=None):
        torch = self.torch
        kw = {self.cache_arg: cache, "use_cache": cache is not None}
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)[None],
                             position_ids=torch.tensor(np.asarray(positions),
                                                       dtype=torch.long)[None],
                             attention_mask=self._additive(mask), **kw)
        return out.logits[0].to(torch.float32).numpy().copy()

    def logits(self, tokens, positions, mask):
        return self._call(tokens, positions, mask)

    def cached(self, prefix, tokens, positions, mask, lora_prefix=False, lora_rows=False):
        """Prefix as a causal pass at 0..P-1 into a DynamicCache, then the rows at their
        positions over the cache with `mask` [rows, P + rows]."""
        P = len(prefix)
        cache = self._new_cache()
        try:
            self.lora_on = lora_prefix
            self._call(prefix, np.arange(P), np.tril(np.ones((P, P), bool)), cache)
            self.lora_on = lora_rows
            return self._call(tokens, positions, mask, cache)
        finally:
            self.lora_on = False


def hf_nemotron(torch, tf, w, p) -> HFRunner:
    r = p["rope"]
    cfg = tf.Ministral3Config(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
        max_position_embeddings=p["max_pos"], rms_norm_eps=p["eps"], tie_word_embeddings=False,
        bos_token_id=p["bos_id"], eos_token_id=p["eos_id"], pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": r["theta"], "factor": r["factor"],
                         "original_max_position_embeddings": r["orig"],
                         "beta_fast": r["beta_fast"], "beta_slow": r["beta_slow"],
                         "mscale": r["mscale"], "mscale_all_dim": r["mscale_all_dim"],
                         "llama_4_scaling_beta": r["llama4_beta"]},
        attn_implementation="eager")
    model = tf.Ministral3ForCausalLM(cfg).eval()
    renamed = {}
    for k, v in w.items():
        k = "lm_head.weight" if k == "diffusion_head.weight" else "model." + k[len("encoder."):]
        renamed[k] = torch.from_numpy(v.copy())
    model.load_state_dict(renamed, strict=True)
    return HFRunner(torch, tf, model)


def hf_setdlm(torch, tf, w, p) -> HFRunner:
    cfg = tf.Qwen3Config(
        vocab_size=p["rows"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], head_dim=p["head_dim"],
        max_position_embeddings=p["max_pos"], rms_norm_eps=p["eps"],
        rope_parameters={"rope_type": "default", "rope_theta": p["theta"]},
        tie_word_embeddings=True, bos_token_id=p["eos_id"], eos_token_id=p["eos_id"],
        attn_implementation="eager")
    model = tf.Qwen3ForCausalLM(cfg).eval()
    sd = {k[len("backbone.model."):]: torch.from_numpy(v.copy()) for k, v in w.items()}
    model.load_state_dict(sd, strict=True)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise FixtureError("Qwen3ForCausalLM did not tie its head to the embedding")
    return HFRunner(torch, tf, model)


# --- layouts -------------------------------------------------------------------------------

def causal(n):
    return np.tril(np.ones((n, n), bool))


def full_form(prefix_len, mask):
    """The square mask over [prefix ; rows]: prefix rows causal, then `mask`."""
    P, R = prefix_len, mask.shape[0]
    full = np.zeros((P + R, P + R), bool)
    full[:P, :P] = causal(P)
    full[P:] = mask
    return full


def pick(row, exclude=()):
    """argmax of a logits row (ids in `exclude` left out) and its margin over the runner-up."""
    row = np.asarray(row, np.float64).copy()
    row[list(exclude)] = -np.inf
    order = np.argsort(row)
    return int(order[-1]), float(row[order[-1]] - row[order[-2]])


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


class Record:
    """The diffs and facts one family reports; a diff over its limit is a failure."""

    def __init__(self, family):
        self.family = family
        self.diffs, self.routes, self.identities, self.facts = {}, {}, {}, {}
        self.failures = []

    def _keep(self, table, name, value, limit):
        table[name] = float(f"{value:.3e}")  # rounded: BLAS order changes the last digits
        if not value <= limit:
            self.failures.append(f"{self.family} {name}: {value:.3g} > {limit:g}")

    def diff(self, name, hf, ref, limit=TOLERANCE):
        self._keep(self.diffs, name, max_diff(hf, ref), limit)

    def route(self, name, cached, single):
        self._keep(self.routes, name, max_diff(cached, single), TOLERANCE)

    def identity(self, name, value, limit=TOLERANCE):
        self._keep(self.identities, name, value, limit)

    def fact(self, name, value):
        self.facts[name] = value

    def as_json(self):
        return {"diffs": self.diffs, "route_diffs": self.routes,
                "identities": self.identities, "facts": self.facts}


def _ids(rng, n, allowed):
    return rng.choice(allowed, size=n).astype(np.int32)


def _with_full_forms(arrays, name, prefix, tokens, positions, mask):
    P = len(prefix)
    arrays[f"{name}_full_tokens"] = np.concatenate([prefix, tokens]).astype(np.int32)
    arrays[f"{name}_full_positions"] = np.concatenate([np.arange(P), positions]).astype(np.int32)
    arrays[f"{name}_full_mask"] = full_form(P, mask)
    arrays[f"{name}_rows"] = np.arange(P, P + len(tokens), dtype=np.int32)


# --- Nemotron-Labs-Diffusion ---------------------------------------------------------------------

def nemotron_arrays(hf: HFRunner, npm: NumpyModel, p: dict, rec: Record) -> dict:
    V, MASK, BOS, EOS = p["vocab"], p["mask_id"], p["bos_id"], p["eos_id"]
    B, P, nd = p["block"], p["prefix"], p["n_drafts"]
    allowed = np.array([t for t in range(V) if t not in (MASK, BOS, EOS)])
    rng = np.random.default_rng([p["seed"], IDS])
    a: dict[str, np.ndarray] = {}

    emb = hf.model.model.rotary_emb
    inv, factor = yarn(p["head_dim"], p["rope"])
    a["rope_inv_freq"] = emb.inv_freq.detach().to(hf.torch.float32).numpy().copy()
    a["rope_attention_scaling"] = np.array(emb.attention_scaling, np.float32)
    rec.diff("rope_inv_freq (relative)", a["rope_inv_freq"] / inv, np.ones_like(inv), 1e-6)
    rec.diff("rope_attention_scaling", a["rope_attention_scaling"], factor, 1e-7)

    for name, n in (("ar", p["ar_len"]), ("long", p["long_len"])):
        toks = np.concatenate([[BOS], _ids(rng, n - 1, allowed)]).astype(np.int32)
        a[f"{name}_tokens"] = toks
        a[f"{name}_logits"] = hf.logits(toks, np.arange(n), causal(n))
        rec.diff(f"{name}_logits", a[f"{name}_logits"], npm.logits(toks, np.arange(n), causal(n)))
    pos = hf.torch.arange(p["long_len"])[None]
    module = sys.modules[type(hf.model).__module__]
    scale_fn = getattr(module, "get_llama_4_attn_scale", None) or module._get_llama_4_attn_scale
    a["long_llama4_q_scale"] = scale_fn(pos, p["rope"]["llama4_beta"], p["rope"]["orig"]).reshape(
        -1).to(hf.torch.float32).numpy().copy()
    rec.diff("long_llama4_q_scale", a["long_llama4_q_scale"],
             llama4_scale(np.arange(p["long_len"]), p["rope"]), 1e-6)

    # The prefix is redrawn until the seed and drafts it leads to are clear argmaxes, so
    # that a float32 port picks the same tokens.
    for attempt in range(100):
        prefix = np.concatenate([[BOS], _ids(rng, P - 1, allowed)]).astype(np.int32)
        prefix_logits = hf.logits(prefix, np.arange(P), causal(P))
        seed, m_seed = pick(prefix_logits[-1])
        if seed in (MASK, BOS, EOS) or m_seed < MIN_PICK_MARGIN:
            continue
        block_tokens = np.array([seed] + [MASK] * (B - 1), np.int32)
        block_positions = np.arange(P, P + B, dtype=np.int32)
        block_mask = np.ones((B, P + B), bool)
        block = hf.cached(prefix, block_tokens, block_positions, block_mask)
        picks = [pick(block[j], exclude=[MASK]) for j in range(1, nd + 1)]
        # Distinct drafts, so that a port which reorders or shifts them is caught.
        distinct = len({seed} | {t for t, _ in picks}) == nd + 1
        if distinct and min(m for _, m in picks) >= MIN_PICK_MARGIN:
            break
    else:
        raise FixtureError("nemotron: no prefix with clear, distinct seed and draft argmaxes")
    rec.fact("prefix attempt", attempt)
    rec.fact("seed token", seed)
    rec.fact("seed margin", float(f"{m_seed:.3e}"))
    drafts = [t for t, _ in picks]
    rec.fact("drafts", drafts)
    rec.fact("draft margins", [float(f"{m:.3e}") for _, m in picks])
    a["prefix_tokens"] = prefix
    a["prefix_logits"] = prefix_logits
    rec.diff("prefix_logits", prefix_logits, npm.logits(prefix, np.arange(P), causal(P)))

    a["block_tokens"], a["block_positions"], a["block_mask"] = block_tokens, block_positions, \
        block_mask
    a["block_logits"] = block
    _with_full_forms(a, "block", prefix, block_tokens, block_positions, block_mask)

    packed_tokens = np.array([seed] + drafts + [MASK] * (B - 1 - nd) + [seed] + [MASK] * (B - 1),
                             np.int32)
    packed_positions = np.concatenate([block_positions, block_positions]).astype(np.int32)
    packed_mask = np.zeros((2 * B, P + 2 * B), bool)
    packed_mask[:, :P] = True
    packed_mask[:B, P:P + B] = causal(B)
    packed_mask[B:, P + B:] = True
    a["packed_tokens"], a["packed_positions"], a["packed_mask"] = packed_tokens, \
        packed_positions, packed_mask
    a["packed_half"] = np.repeat(np.arange(2, dtype=np.int32), B)
    a["packed_logits"] = hf.cached(prefix, packed_tokens, packed_positions, packed_mask)
    _with_full_forms(a, "packed", prefix, packed_tokens, packed_positions, packed_mask)

    for name in ("block", "packed"):
        args = (a[f"{name}_full_tokens"], a[f"{name}_full_positions"], a[f"{name}_full_mask"])
        rows = a[f"{name}_rows"]
        rec.route(f"{name}_logits", a[f"{name}_logits"], hf.logits(*args)[rows])
        rec.diff(f"{name}_logits", a[f"{name}_logits"], npm.logits(*args)[rows])
    rec.identity("packed second half == block_logits (transformers)",
                 max_diff(a["packed_logits"][B:], a["block_logits"]))
    verify = np.concatenate([prefix, [seed], drafts]).astype(np.int32)
    n = len(verify)
    rec.identity("packed first-half rows 0..n_drafts == causal prefix+seed+drafts (numpy)",
                 max_diff(a["packed_logits"][:nd + 1],
                          npm.logits(verify, np.arange(n), causal(n))[P:]))

    # LoRA: the released decoder uses the adapter for the bidirectional draft only, so the
    # prefix K/V stay the base model's; the `all` variant tells the two apart.
    full = (a["block_full_tokens"], a["block_full_positions"], a["block_full_mask"])
    rows = a["block_rows"]
    a["lora_block_logits"] = hf.cached(prefix, block_tokens, block_positions, block_mask,
                                       lora_prefix=False, lora_rows=True)
    a["lora_all_block_logits"] = hf.cached(prefix, block_tokens, block_positions, block_mask,
                                           lora_prefix=True, lora_rows=True)
    draft_rows = np.zeros(P + B, bool)
    draft_rows[rows] = True
    rec.diff("lora_block_logits", a["lora_block_logits"],
             npm.logits(*full, lora_rows=draft_rows)[rows])
    rec.diff("lora_all_block_logits", a["lora_all_block_logits"],
             npm.logits(*full, lora_rows=np.ones(P + B, bool))[rows])
    moved = max_diff(a["lora_block_logits"], a["block_logits"])
    rec.fact("|lora_block_logits - block_logits| (must be large)", float(f"{moved:.3e}"))
    if moved < 0.05:
        rec.failures.append(f"nemotron: the adapter barely moves the logits ({moved:.3g})")
    moved = max_diff(a["lora_block_logits"], a["lora_all_block_logits"])
    rec.fact("|lora_block_logits - lora_all_block_logits| (must be large)", float(f"{moved:.3e}"))
    if moved < 0.05:
        rec.failures.append(f"nemotron: adapter on the prefix barely matters ({moved:.3g})")

    a.update(nemotron_greedy(hf, npm, p, rec, allowed))
    return a


def nemotron_greedy(hf, npm, p, rec, allowed) -> dict:
    """Plain AR greedy over the full vocabulary; the prompt is redrawn (deterministically)
    until the continuation has no MASK/EOS, clear margins and some variety."""
    MASK, EOS, BOS = p["mask_id"], p["eos_id"], p["bos_id"]
    n0, new = p["greedy_prompt_len"], p["greedy_new"]
    for attempt in range(MAX_GREEDY_ATTEMPTS):
        rng = np.random.default_rng([p["seed"], GREEDY, attempt])
        prompt = np.concatenate([[BOS], _ids(rng, n0 - 1, allowed)]).astype(np.int32)
        seq, margins, steps = list(prompt), [], []
        for _ in range(new):
            T = len(seq)
            row = hf.logits(np.array(seq), np.arange(T), causal(T))[-1]
            tok, margin = pick(row)
            if tok in (MASK, EOS) or margin < MIN_GREEDY_MARGIN:
                break
            seq.append(tok)
            margins.append(margin)
            steps.append(row)
        else:
            if len(set(seq[n0:])) >= MIN_GREEDY_DISTINCT:
                break
    else:
        raise FixtureError("nemotron: no greedy prompt met the margin and variety conditions")
    cont = np.array(seq[n0:], np.int32)
    T = len(seq)
    ref = npm.logits(np.array(seq), np.arange(T), causal(T))[n0 - 1:T - 1]
    rec.diff("greedy step logits (last rows)", np.stack(steps), ref)
    if not np.array_equal(ref.argmax(-1), cont):
        rec.failures.append("nemotron: the float64 greedy tokens differ from transformers'")
    rec.fact("greedy prompt attempt", attempt)
    rec.fact("greedy min margin", float(f"{min(margins):.3e}"))
    rec.fact("greedy distinct tokens", len(set(cont.tolist())))
    return {"greedy_prompt": prompt, "greedy_continuation": cont,
            "greedy_margins": np.array(margins, np.float32)}


def peft_crosscheck(torch, hf: HFRunner, adapter_dir: Path, a: dict, rec: Record):
    """lora_block_logits again through peft.PeftModel on the written adapter files."""
    try:
        import peft
    except ImportError:
        rec.fact("peft cross-check", "skipped: peft not installed")
        return None
    model = copy.deepcopy(hf.model)

    class Release(torch.nn.Module):
        # The release's module names, which the adapter's tensor names refer to.
        def __init__(self, lm):
            super().__init__()
            self.encoder, self.diffusion_head = lm.model, lm.lm_head

    wrapped = peft.PeftModel.from_pretrained(Release(model), str(adapter_dir))
    runner = HFRunner(hf.torch, hf.tf, model)
    P = len(a["prefix_tokens"])
    cache = runner._new_cache()
    with wrapped.disable_adapter():
        runner._call(a["prefix_tokens"], np.arange(P), causal(P), cache)
    got = runner._call(a["block_tokens"], a["block_positions"], a["block_mask"], cache)
    rec.identity("lora_block_logits: hooks vs peft.PeftModel",
                 max_diff(got, a["lora_block_logits"]))
    return peft.__version__


# --- SetDLM ---------------------------------------------------------------------------------------

def setdlm_arrays(hf: HFRunner, npm: NumpyModel, p: dict, rec: Record) -> dict:
    V, MASK, EOS = p["rows"], p["mask_id"], p["eos_id"]
    L, P, W, n = p["train_len"], p["prefix"], p["window"], p["n_new"]
    allowed = np.array([t for t in range(V) if t not in (MASK, EOS)])
    rng = np.random.default_rng([p["seed"], IDS])
    a: dict[str, np.ndarray] = {}

    # Two-stream training input: clean tokens in decode order, then one MASK query per rank.
    x0 = _ids(rng, L, allowed)
    order = rng.permutation(L).astype(np.int32)
    rank = np.arange(2 * L) % L
    clean = np.arange(2 * L) < L
    both_clean = clean[:, None] & clean[None, :] & (rank[None, :] <= rank[:, None])
    query_sees_clean = ~clean[:, None] & clean[None, :] & (rank[None, :] < rank[:, None])
    itself = np.eye(2 * L, dtype=bool)
    train_mask = both_clean | query_sees_clean | itself
    a["train_tokens"], a["train_order"] = x0, order
    a["train_input_tokens"] = np.concatenate([x0[order], np.full(L, MASK)]).astype(np.int32)
    a["train_positions"] = np.concatenate([order, order]).astype(np.int32)
    a["train_mask"] = train_mask
    a["train_targets"] = x0[order].astype(np.int32)
    train = hf.logits(a["train_input_tokens"], a["train_positions"], train_mask)
    ref = npm.logits(a["train_input_tokens"], a["train_positions"], train_mask)
    a["train_logits"], a["train_logits_clean"] = train[L:], train[:L]
    rec.diff("train_logits", train[L:], ref[L:])
    rec.diff("train_logits_clean", train[:L], ref[:L])
    a["train_full_tokens"] = a["train_input_tokens"].copy()
    a["train_full_positions"] = a["train_positions"].copy()
    a["train_full_mask"] = train_mask.copy()
    a["train_rows"] = np.arange(L, 2 * L, dtype=np.int32)

    prefix = _ids(rng, P, allowed)
    a["prefix_tokens"] = prefix
    a["prefix_logits"] = hf.logits(prefix, np.arange(P), causal(P))
    rec.diff("prefix_logits", a["prefix_logits"], npm.logits(prefix, np.arange(P), causal(P)))

    # Window: W MASK queries, each seeing the cache and itself.
    win_mask = np.zeros((W, P + W), bool)
    win_mask[:, :P] = True
    win_mask[:, P:] = np.eye(W, dtype=bool)
    a["window_tokens"] = np.full(W, MASK, np.int32)
    a["window_positions"] = np.arange(P, P + W, dtype=np.int32)
    a["window_mask"] = win_mask

    # Step: n newly committed clean tokens (causal), then the W queries over them.
    new = _ids(rng, n, allowed)
    step_mask = np.zeros((n + W, P + n + W), bool)
    step_mask[:, :P] = True
    step_mask[:n, P:P + n] = causal(n)
    step_mask[n:, P:P + n] = True
    step_mask[n:, P + n:] = np.eye(W, dtype=bool)
    a["step_tokens"] = np.concatenate([new, np.full(W, MASK)]).astype(np.int32)
    a["step_positions"] = np.arange(P, P + n + W, dtype=np.int32)
    a["step_mask"] = step_mask
    rec.fact("step new clean tokens", new.tolist())

    # Verification: [N | O_0..O_{W-1} | M x W | R x W].
    no = rng.choice(allowed, size=W + 1, replace=False).astype(np.int32)
    R = 1 + 3 * W
    seg = np.array([0] + [1] * W + [2] * W + [3] * W, np.int32)
    pk = np.zeros((R, P + R), bool)
    pk[:, :P] = True
    pk[:, P] = True  # every row sees N
    for r in range(W):
        o, m, d = 1 + r, 1 + W + r, 1 + 2 * W + r
        pk[o, P + 1:P + 1 + r + 1] = True    # O_r <- O_0..O_r
        pk[m, P + 1:P + 1 + r] = True        # M_r <- O_0..O_{r-1}
        pk[m, P + m] = True
        pk[d, P + d] = True                  # R_r <- itself only
    a["packed_tokens"] = np.concatenate([no, np.full(2 * W, MASK)]).astype(np.int32)
    a["packed_positions"] = np.concatenate(
        [[P], np.tile(np.arange(P + 1, P + 1 + W), 3)]).astype(np.int32)
    a["packed_segments"] = seg
    a["packed_mask"] = pk
    rec.fact("correction token", int(no[0]))
    rec.fact("drafts (O tokens)", no[1:].tolist())

    for name in ("window", "step", "packed"):
        toks, pos, mask = a[f"{name}_tokens"], a[f"{name}_positions"], a[f"{name}_mask"]
        a[f"{name}_logits"] = hf.cached(prefix, toks, pos, mask)
        _with_full_forms(a, name, prefix, toks, pos, mask)
        full = (a[f"{name}_full_tokens"], a[f"{name}_full_positions"], a[f"{name}_full_mask"])
        rows = a[f"{name}_rows"]
        rec.route(f"{name}_logits", a[f"{name}_logits"], hf.logits(*full)[rows])
        rec.diff(f"{name}_logits", a[f"{name}_logits"], npm.logits(*full)[rows])

    seq = np.concatenate([prefix, new])
    rec.identity("step clean rows == causal logits of prefix+new tokens (transformers)",
                 max_diff(a["step_logits"][:n],
                          hf.logits(seq, np.arange(P + n), causal(P + n))[P:]))
    rec.identity("packed M_0 row == R_0 row", max_diff(a["packed_logits"][1 + W],
                                                       a["packed_logits"][1 + 2 * W]))
    # The same R rows in a draft-only pass [N | R x W] see exactly the same inputs.
    dmask = np.zeros((1 + W, P + 1 + W), bool)
    dmask[:, :P + 1] = True
    dmask[1:, P + 1:] = np.eye(W, dtype=bool)
    dpos = np.concatenate([[P], np.arange(P + 1, P + 1 + W)])
    draft = hf.cached(prefix, np.concatenate([[no[0]], np.full(W, MASK)]), dpos, dmask)
    rec.identity("packed R rows == R rows of a draft-only pass",
                 max_diff(a["packed_logits"][1 + 2 * W:], draft[1:]))
    verifier = [pick(a["packed_logits"][1 + W + r], exclude=[MASK])[0] for r in range(W)]
    rec.fact("packed verifier argmax (M rows, MASK excluded)", verifier)
    return a


# --- files ----------------------------------------------------------------------------------

def write_json(path: Path, obj, sort_keys=False):
    path.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def write_npz(path: Path, arrays: dict):
    # Sorted names and numpy's fixed zip timestamps keep the archive byte-stable.
    with open(path, "wb") as f:
        np.savez(f, **{k: arrays[k] for k in sorted(arrays)})


def nemotron_config(p, tf_version):
    r = p["rope"]
    return {
        "ar_loss_weight": 1.0,
        "architectures": ["NemotronLabsDiffusionModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "sdpa",
        "auto_map": {
            "AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
            "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel",
        },
        "block_size": p["block"],
        "bos_token_id": p["bos_id"],
        "dlm_loss_weight": None,
        "dlm_paradigm": "bidirectional",
        "dp_varying_mask_ratio": False,
        "eos_token_id": p["eos_id"],
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "hidden_size": p["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": p["inter"],
        "mask_token_id": p["mask_id"],
        "max_position_embeddings": p["max_pos"],
        "mlp_bias": False,
        "model_type": "nemotron_labs_diffusion",
        "num_attention_heads": p["heads"],
        "num_hidden_layers": p["layers"],
        "num_key_value_heads": p["kv_heads"],
        "rms_norm_eps": p["eps"],
        "rope_parameters": {
            "beta_fast": r["beta_fast"], "beta_slow": r["beta_slow"], "factor": r["factor"],
            "llama_4_scaling_beta": r["llama4_beta"], "mscale": r["mscale"],
            "mscale_all_dim": r["mscale_all_dim"], "original_max_position_embeddings": r["orig"],
            "rope_theta": r["theta"], "rope_type": "yarn",
        },
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": tf_version,
        "use_cache": False,
        "vocab_size": p["vocab"],
    }


def adapter_config(p):
    return {
        "alpha_pattern": {}, "base_model_name_or_path": None, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "layers_pattern": None, "layers_to_transform": None, "lora_alpha": p["lora_alpha"],
        "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": p["lora_r"],
        "rank_pattern": {}, "revision": None, "target_modules": ["o_proj"], "task_type": None,
        "use_dora": False, "use_rslora": False,
    }


def setdlm_config(p, tf_version):
    ids = {"vocab_size": p["tok_vocab"], "mask_token_id": p["mask_id"],
           "bos_token_id": p["eos_id"], "pad_token_id": p["eos_id"],
           "eos_token_id": p["eos_id"], "pad_vocab_size_multiple": 1}
    base = "Qwen/Qwen3-1.7B-Base"
    return {
        "architectures": ["SetDLM"],
        "model_type": "bd3lm",
        "auto_map": {"AutoConfig": "diffusion.BD3LMConfig", "AutoModel": "diffusion.BD3LM",
                     "AutoModelForMaskedLM": "diffusion.BD3LM"},
        "length": p["length"],
        "block_size": p["length"],
        "eval_block_size": p["length"],
        "setdlm_eos_last_in_target_order": False,
        "setdlm_fht_cache_order": False,
        "keep_clean_bos": False,
        "attn_backend": "sdpa",
        "train_on_context": False,
        "tokenizer_name": base,
        "backbone_config": {
            "_target_": "backbone_automodel.AutoModelFromPreTrained",
            "automodel_cls": "AutoModelForCausalLM",
            "pretrained_model_name_or_path": base,
            "revision": None,
            "trust_remote_code": True,
            "num_layers": p["layers"],
            "keep_top_layers": False,
            "reinit_model": False,
            "attn_implementation": "sdpa",
            "use_causal_mask": False,
        },
        "noise_config": {
            "_target_": "noise_schedule_noise_schedules.StaggeredNoise",
            "eps": 0.001, "block_size": p["length"], "desired_block_size": 4,
            "max_block_size": 8, "length": p["length"],
        },
        "tokenization_config": dict(ids),
        **ids,
        "torch_dtype": "float32",
        "transformers_version": tf_version,
        # The release downloads its backbone's config; a fixture must be self-contained.
        "qwen3_config": {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": p["eos_id"],
            "eos_token_id": p["eos_id"],
            "head_dim": p["head_dim"],
            "hidden_act": "silu",
            "hidden_size": p["hidden"],
            "initializer_range": 0.02,
            "intermediate_size": p["inter"],
            "max_position_embeddings": p["max_pos"],
            "max_window_layers": p["layers"],
            "model_type": "qwen3",
            "num_attention_heads": p["heads"],
            "num_hidden_layers": p["layers"],
            "num_key_value_heads": p["kv_heads"],
            "rms_norm_eps": p["eps"],
            "rope_scaling": None,
            "rope_theta": p["theta"],
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": p["rows"],
        },
    }


def write_nemotron(d: Path, w, lora, p, tf_version):
    from safetensors.numpy import save_file

    d.mkdir()
    write_json(d / "config.json", nemotron_config(p, tf_version), sort_keys=True)
    half = (p["layers"] + 1) // 2
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]

    def shard_of(name):
        if name.startswith("encoder.layers."):
            return 0 if int(name.split(".")[2]) < half else 1
        return 0 if name == "encoder.embed_tokens.weight" else 1

    parts = [{}, {}]
    for name, t in w.items():
        parts[shard_of(name)][name] = t
    for file, part in zip(shards, parts, strict=True):
        save_file(part, str(d / file), metadata={"format": "pt"})
    write_json(d / "model.safetensors.index.json", {
        "metadata": {"total_size": int(sum(t.nbytes for t in w.values()))},
        "weight_map": {name: shards[shard_of(name)] for name in sorted(w)},
    })
    (d / LORA_DIR).mkdir()
    write_json(d / LORA_DIR / "adapter_config.json", adapter_config(p), sort_keys=True)
    save_file(lora, str(d / LORA_DIR / "adapter_model.safetensors"), metadata={"format": "pt"})


def write_setdlm(root: Path, w, p, tf_version, torch):
    from safetensors.numpy import save_file

    cfg = setdlm_config(p, tf_version)
    d = root / SETDLM
    d.mkdir()
    write_json(d / "config.json", cfg)
    tensors = {name: torch.from_numpy(t.copy()) for name, t in w.items() if name != SETDLM_HEAD}
    # One tensor object under both names: torch.save stores a single shared storage, as a
    # tied state dict is saved by the release.
    tensors[SETDLM_HEAD] = tensors[SETDLM_EMBED]
    # torch.save's zip entries carry a fixed 1980 timestamp, and its
    # `.data/serialization_id` is a hash of the record names and CRCs, not a random id:
    # the archive is a function of the tensors. A second save in memory checks that
    # this torch keeps it so, rather than trusting it.
    torch.save(tensors, str(d / "pytorch_model.bin"))
    with tempfile.TemporaryDirectory(dir=root) as other:
        # Same file name: torch.save names the archive's top folder after it.
        torch.save(tensors, os.path.join(other, "pytorch_model.bin"))
        again = Path(other, "pytorch_model.bin").read_bytes()
    if again != (d / "pytorch_model.bin").read_bytes():
        raise FixtureError(f"torch {torch.__version__}: torch.save output differs between two "
                           "saves of the same tensors; the .bin would not be reproducible")
    s = root / SETDLM_ST
    s.mkdir()
    write_json(s / "config.json", cfg)
    # Safetensors cannot alias: the head is an identical copy there.
    save_file({k: v.copy() for k, v in w.items()}, str(s / "model.safetensors"),
              metadata={"format": "pt"})


def check_torch_bin(torch, file: Path, w: dict):
    """The written `.bin` loads with torch (weights_only) and with the package's pickle-free
    reader, and both see the head sharing the embedding's storage."""
    from packed_ss_jax.checkpoints.torch_bin import TorchBin

    t = TorchBin(file)
    if sorted(t.names()) != sorted(w):
        raise FixtureError(f"{file.name}: the package's reader sees other tensor names")
    for name in w:
        if not np.array_equal(np.asarray(t.get(name)), w[name]):
            raise FixtureError(f"{file.name}: the package's reader reads {name} differently")
    if not t.shares_storage(SETDLM_HEAD, SETDLM_EMBED):
        raise FixtureError(f"{file.name}: the package's reader sees no shared head storage")
    sd = torch.load(str(file), weights_only=True)
    if list(sd) != list(w):
        raise FixtureError(f"{file.name}: tensor names or order differ from the weights")
    for name, t in sd.items():
        if not np.array_equal(t.numpy(), w[name]):
            raise FixtureError(f"{file.name}: {name} differs from the drawn weights")
    if sd[SETDLM_HEAD].untyped_storage().data_ptr() != \
            sd[SETDLM_EMBED].untyped_storage().data_ptr():
        raise FixtureError(f"{file.name}: the head does not share the embedding's storage")


FIXTURE_CONFTEST = '''"""Data only: nothing under this folder is a test module."""

collect_ignore_glob = ["*"]
'''


README = """# Reference fixtures

Tiny random float32 checkpoints of the two model families in their released on-disk
layouts, with reference logits for every decoding layout the project implements. The
tests load these folders with the project's own loaders and compare its forward passes
with the stored logits (float32, matmul precision "highest", atol {tol:g}).

Generated by `{generator}` (version {version}); regenerate with

    pip install -e ".[reference]"
    python -m tools.make_fixtures --out tests/fixtures

`manifest.json` records the software versions, every generation parameter (seeds
included), the shape and dtype of every array, every measured difference and the size
and SHA-256 of every file. The output is byte-for-byte reproducible with the versions
recorded there.

## Folders

- `nemotron_tiny/`: Nemotron-Labs-Diffusion. `config.json` shaped like the release
  (YaRN `rope_parameters` with the Llama-4 query scale), weights in two safetensors
  shards with `model.safetensors.index.json` (`encoder.*` names, untied
  `diffusion_head.weight`), a PEFT LoRA adapter on every `o_proj` in
  `linear_spec_lora/`, and `reference.npz`.
- `setdlm_tiny/`: SetDLM. A `BD3LMConfig`-shaped `config.json` that also embeds its
  Qwen3 backbone's config as `qwen3_config` (the release downloads it instead), the
  weights as a `torch.save` archive whose `lm_head` shares the embedding's storage, and
  `reference.npz`.
- `setdlm_tiny_safetensors/`: the same SetDLM weights as `model.safetensors` (the head
  stored as an identical copy).
- `conftest.py` keeps pytest from collecting anything here.

## How the reference was computed

transformers `Ministral3ForCausalLM` (Nemotron weights renamed `encoder.` -> `model.`,
`diffusion_head` -> `lm_head`) and `Qwen3ForCausalLM` (SetDLM names without
`backbone.model.`), CPU, float32, eager attention, explicit position ids and custom 4-D
additive masks. Every logits array was recomputed by a float64 NumPy model in the
generator; the largest difference is {worst:.1e} (limit {tol:g}). Layouts with a cached
prefix were run both through a `DynamicCache` and as one pass with a square mask.

## Conventions of `reference.npz`

- Logits: raw float32 LM-head outputs `[rows, vocab]`. Tokens, positions and row
  indices: int32. Masks: bool, `True` where a row may attend to a column.
- Position ids are explicit; packed layouts repeat them.
- A `X_mask` has a row per query row; its columns are the cached prefix (positions
  `0..P-1`) and then the query rows themselves. `train_mask` and every `X_full_mask`
  are square over their own tokens.
- Any logits array `X_logits` can be checked with one forward over `X_full_tokens`,
  `X_full_positions` and `X_full_mask`, keeping rows `X_rows`; arrays without full
  forms are causal passes over `X_tokens` at positions `0..T-1`. The `lora_*` arrays
  use the `block_full_*` inputs with the adapter on for the block rows only
  (`lora_block_logits`) or for every row (`lora_all_block_logits`).
- Nemotron: `block` is `[seed, MASK x 7]` after the 16-token prefix, bidirectional;
  `packed` is the causal half `[seed, 3 drafts, MASK x 4]` and the bidirectional half
  `[seed, MASK x 7]` at the same positions, neither seeing the other. `greedy_*` is a
  plain AR greedy run of the base model (no MASK/EOS, smallest top-2 gap recorded).
- SetDLM: `train` is the two-stream input `[clean tokens in decode order ; MASK x L]`
  at positions `[order ; order]`; `window`, `step` and `packed` follow the decoder's
  window, commit step and `[N | O | M | R]` verification layouts after a 10-token
  prefix. The MASK logit is not suppressed in the stored logits.
- Linear weights are stored `[out_features, in_features]`; RoPE is the rotate-half
  form; RMSNorm multiplies by the stored weight.
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe(arrays: dict) -> dict:
    return {k: {"shape": list(arrays[k].shape), "dtype": str(arrays[k].dtype)}
            for k in sorted(arrays)}


# --- the output folder ----------------------------------------------------------------------

def is_fixture_folder(path: Path) -> bool:
    try:
        m = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("generator") == GENERATOR


def check_out(out: Path):
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise FixtureError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()) and not is_fixture_folder(out):
            raise FixtureError(f"--out {out} exists and is not a fixture folder written by "
                               f"{GENERATOR}; refusing to replace it")
    if not out.parent.is_dir():
        raise FixtureError(f"--out {out}: the parent folder {out.parent} does not exist")


def replace_folder(tmp: Path, out: Path):
    """Moves the finished folder into place; the old one is removed only afterwards."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / out.name)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old / out.name, out)
        raise
    finally:
        if not (old / out.name).exists() or out.exists():
            shutil.rmtree(old, ignore_errors=True)


def versions(torch, tf) -> dict:
    import safetensors

    return {"python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "transformers": tf.__version__,
            "safetensors": safetensors.__version__}


def generate(out: Path, log=print) -> dict:
    """Writes the whole fixture set to `out` (atomically) and returns the manifest."""
    check_out(out)
    torch, tf = import_reference()
    torch.manual_seed(0)  # model construction draws initial weights; all are overwritten
    torch.set_num_threads(1)  # one reduction order, whatever the machine's core count
    torch.use_deterministic_algorithms(True)
    tf.logging.set_verbosity_error()

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        root = tmp / "fixtures"
        root.mkdir(mode=0o755)
        manifest = build(root, torch, tf, log)
        replace_folder(root, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def build(root: Path, torch, tf, log) -> dict:
    pn, ps = PARAMS["nemotron"], PARAMS["setdlm"]
    ver = versions(torch, tf)
    failures = []

    log("nemotron: weights and checkpoint")
    w, lora = nemotron_weights(pn)
    write_nemotron(root / NEMOTRON, w, lora, pn, tf.__version__)
    hf = hf_nemotron(torch, tf, w, pn)
    ab = [(lora[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_A.weight"],
           lora[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_B.weight"])
          for i in range(pn["layers"])]
    hf.add_lora(ab, pn["lora_alpha"] / pn["lora_r"])
    rn = Record("nemotron")
    log("nemotron: reference logits")
    na = nemotron_arrays(hf, numpy_nemotron(w, lora, pn), pn, rn)
    peft_version = peft_crosscheck(torch, hf, root / NEMOTRON / LORA_DIR, na, rn)
    if peft_version:
        ver["peft"] = peft_version
    write_npz(root / NEMOTRON / "reference.npz", na)
    failures += rn.failures

    log("setdlm: weights and checkpoints")
    sw = setdlm_weights(ps)
    write_setdlm(root, sw, ps, tf.__version__, torch)
    check_torch_bin(torch, root / SETDLM / "pytorch_model.bin", sw)
    rs = Record("setdlm")
    log("setdlm: reference logits")
    sa = setdlm_arrays(hf_setdlm(torch, tf, sw, ps), numpy_setdlm(sw, ps), ps, rs)
    write_npz(root / SETDLM / "reference.npz", sa)
    failures += rs.failures

    if failures:
        raise FixtureError("checks failed: " + "; ".join(failures))

    worst = max(list(rn.diffs.values()) + list(rs.diffs.values()))
    (root / "conftest.py").write_text(FIXTURE_CONFTEST)
    (root / "README.md").write_text(README.format(tol=TOLERANCE, generator=GENERATOR,
                                                  version=GENERATOR_VERSION, worst=worst))
    files = {}
    for f in sorted(root.rglob("*")):
        # safetensors writes owner-only files; the set is data for everyone.
        f.chmod(0o755 if f.is_dir() else 0o644)
        if f.is_file():
            files[f.relative_to(root).as_posix()] = {"bytes": f.stat().st_size,
                                                     "sha256": sha256(f)}
    manifest = {
        "generator": GENERATOR,
        "generator_version": GENERATOR_VERSION,
        "command": "python -m tools.make_fixtures --out tests/fixtures",
        "versions": ver,
        "tolerance": TOLERANCE,
        "params": PARAMS,
        "selection": {"min_greedy_margin": MIN_GREEDY_MARGIN,
                      "min_greedy_distinct": MIN_GREEDY_DISTINCT,
                      "min_pick_margin": MIN_PICK_MARGIN},
        "nemotron": {"arrays": describe(na), **rn.as_json()},
        "setdlm": {"arrays": describe(sa), **rs.as_json()},
        "worst_diff": worst,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files.values()),
    }
    write_json(root / "manifest.json", manifest)
    log(f"largest |transformers - numpy|: nemotron {max(rn.diffs.values()):.2e}, "
        f"setdlm {max(rs.diffs.values()):.2e}")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_fixtures",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="fixture folder to write (replaced only if it is one already)")
    ap.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = ap.parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    try:
        m = generate(args.out.absolute(), log)
    except FixtureError as e:
        print(f"make_fixtures: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("make_fixtures: interrupted; nothing was replaced", file=sys.stderr)
        return 130
    log(f"wrote {len(m['files']) + 1} files ({m['total_bytes']} bytes) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
