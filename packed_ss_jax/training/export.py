"""Params -> a Hugging Face directory in the release layout of the model's family.

Nemotron-Labs-Diffusion: `config.json` (model_type "nemotron_labs_diffusion") and
`model.safetensors` under the `encoder.` names with the untied `diffusion_head`.
SetDLM: the BD3LM-style `config.json` of the release (model_type "bd3lm", architectures
["SetDLM"], `backbone_config`, `noise_config`, `tokenization_config`) carrying the Qwen3
dimensions in an embedded `qwen3_config`, so no base model config is needed, and
`model.safetensors` under the release's `backbone.model.` names (the tied head is not
stored: a safetensors export drops tied duplicates, and the reader ties it back).
Both: Linear weights `[out, in]`, as PyTorch stores them, plus `tokenizer.json`, so
`packed_ss_jax.load(dir)` reads the directory like a real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..config import ModelConfig
from ..nemotron import checkpoint as nemotron
from ..nemotron.config import MODEL_TYPE as NEMOTRON_MODEL_TYPE
from ..setdlm import checkpoint as setdlm
from ..setdlm.config import MODEL_TYPE as SETDLM_MODEL_TYPE
from .tokenizer import PAD


def hf_config(c: ModelConfig, length: int = 128, pad_id: int | None = None) -> dict:
    """The family's config.json; SetDLM's also records its training window `length` and
    the PAD id (default: EOS, as the release sets it for Qwen3 tokenizers)."""
    if c.family == "setdlm":
        return setdlm_hf_config(c, length, c.eos_token_id if pad_id is None else pad_id)
    return nemotron_hf_config(c)


def _backbone(c: ModelConfig) -> dict:
    """The transformer's dimensions, named as both families' Hugging Face configs name them."""
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
    }


def nemotron_hf_config(c: ModelConfig) -> dict:
    return {
        "architectures": ["NemotronLabsDiffusionModel"],
        "model_type": NEMOTRON_MODEL_TYPE,
        **_backbone(c),
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
        "mask_token_id": c.mask_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "block_size": c.block_size,
        "torch_dtype": "float32",
    }


def setdlm_hf_config(c: ModelConfig, length: int, pad_id: int | None) -> dict:
    """The release's BD3LMConfig fields; the window W the model was trained for is the
    noise schedule's desired block size (twice that is its maximal horizon, smax)."""
    if not (c.qk_norm and c.tie_embeddings):
        raise ValueError("a SetDLM export needs the Qwen3 backbone: qk_norm and tied embeddings")
    tokens = {"vocab_size": c.vocab_size, "mask_token_id": c.mask_token_id,
              "bos_token_id": c.bos_token_id, "pad_token_id": pad_id,
              "eos_token_id": c.eos_token_id, "pad_vocab_size_multiple": 1}
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_backbone(c),
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
    }
    return {
        "architectures": ["SetDLM"],
        "model_type": SETDLM_MODEL_TYPE,
        "length": length,
        "block_size": length,
        "eval_block_size": length,
        "attn_backend": "sdpa",
        "backbone_config": {
            "_target_": "backbone_automodel.AutoModelFromPreTrained",
            "automodel_cls": "AutoModelForCausalLM",
            "pretrained_model_name_or_path": None,  # trained from scratch: see qwen3_config
            "num_layers": c.num_layers,
            "keep_top_layers": False,
            "reinit_model": True,
            "attn_implementation": "sdpa",
            "use_causal_mask": False,
        },
        "noise_config": {
            "_target_": "noise_schedule_noise_schedules.StaggeredNoise",
            "block_size": length,
            "desired_block_size": c.block_size,
            "max_block_size": 2 * c.block_size,
            "length": length,
        },
        "tokenization_config": tokens,
        **tokens,
        "torch_dtype": "float32",
        "qwen3_config": qwen3,
    }


def tensors(c: ModelConfig, params) -> dict[str, np.ndarray]:
    """The params tree under the checkpoint's names and layouts."""
    out = {}
    reader = setdlm if c.family == "setdlm" else nemotron
    for e in reader.table(c):
        leaf = params
        for k in e.path:
            leaf = leaf[k]
        leaf = np.asarray(leaf, np.float32)
        for i, name in enumerate([e.name.format(i=i) for i in range(c.num_layers)]
                                 if e.layer else [e.name]):
            w = leaf[i] if e.layer else leaf
            out[name] = np.ascontiguousarray(w.T if e.transpose else w)
    return out


def export(out_dir: str | Path, c: ModelConfig, params, tokenizer=None,
           extra: dict | None = None, length: int = 128) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pad_id = tokenizer.token_to_id(PAD) if tokenizer is not None else None
    (out / "config.json").write_text(json.dumps(hf_config(c, length, pad_id), indent=2) + "\n")
    save_file(tensors(c, params), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
    if extra:
        (out / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    return out
