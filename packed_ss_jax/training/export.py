"""Params -> a Nemotron-Labs-Diffusion Hugging Face directory.

Writes `config.json` (model_type "nemotron_labs_diffusion"), `model.safetensors` with the
real tensor names (Linear weights `[out, in]`, as PyTorch stores them) and
`tokenizer.json`, so `packed_ss_jax.load(dir)` reads it like a real checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ..checkpoints import nemotron
from ..config import NEMOTRON_MODEL_TYPE, ModelConfig


def hf_config(c: ModelConfig) -> dict:
    return {
        "architectures": ["NemotronLabsDiffusionModel"],
        "model_type": NEMOTRON_MODEL_TYPE,
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
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
        "mask_token_id": c.mask_token_id,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "block_size": c.block_size,
        "torch_dtype": "float32",
    }


def tensors(c: ModelConfig, params) -> dict[str, np.ndarray]:
    """The params tree under the checkpoint's names and layouts."""
    out = {}
    for e in nemotron.table(c):
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
           extra: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(c), indent=2) + "\n")
    save_file(tensors(c, params), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
    if extra:
        (out / "training.json").write_text(json.dumps(extra, indent=2) + "\n")
    return out
