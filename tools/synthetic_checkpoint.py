"""Random bf16 checkpoints in the layout of the Nemotron-Labs-Diffusion releases.

The released 3B and 8B weights cannot be downloaded here, but what the engine does with
them (loading, memory, timing) only needs their shapes, names and dtype. This writes a
directory `packed_ss_jax.load` reads as it would a release: `config.json`, sharded
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`, and the draft-only
adapter in `linear_spec_lora/` (PEFT `adapter_config.json` + `adapter_model.safetensors`).
Tensor names and stored shapes come from the loader's own name table
(`nemotron.checkpoint`), so the two cannot drift apart.

Weights are seeded normals, scaled so that a forward pass gives finite logits of a few
units' spread: projections into a layer keep unit scale (std 1/sqrt(fan_in)), the two
projections back into the residual stream are shrunk by sqrt(2 * layers), and the head
is sized for logits of standard deviation about 4. Files are written tensor by tensor
in row blocks (memory stays near BLOCK_BYTES whatever the model size), into a temporary
directory renamed to `--out` once complete.

    python -m tools.synthetic_checkpoint --shape 3B --out /tmp/nld-3b   # 7.7 GB
    python -m tools.synthetic_checkpoint --shape tiny --out /tmp/nld-tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from packed_ss_jax import model as model_lib
from packed_ss_jax.nemotron import checkpoint as nemotron
from packed_ss_jax.families import parse_hf_config

# Dimensions from the released config.json files (3B: hidden 3072, q_proj 3072 -> 4096;
# 8B: hidden 4096); the tiny shape keeps the 3B's decoupled head_dim (heads * head_dim
# != hidden) at a size a test writes in a blink.
SHAPES = {
    "3B": dict(hidden_size=3072, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=9216,
               vocab_size=131072, eos_token_id=2),
    "8B": dict(hidden_size=4096, num_hidden_layers=34, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=14336,
               vocab_size=131072, eos_token_id=11),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=128,
                 vocab_size=512, eos_token_id=2),
}
# The released adapter: PEFT LoRA on o_proj, r 128, alpha 512 (tiny: r 4, alpha 16).
LORA = {"3B": (128, 512), "8B": (128, 512), "tiny": (4, 16)}
# transformers' default max_shard_size; the tiny shape shards small to have several files.
SHARD_BYTES = {"3B": 5 * 10**9, "8B": 5 * 10**9, "tiny": 100_000}
BLOCK_BYTES = 64 * 2**20
LOGIT_STD = 4.0


def hf_config(shape: str) -> dict:
    """The config.json of a Nemotron-Labs-Diffusion release of this shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    return {
        "architectures": ["NemotronLabsDiffusionModel"],
        "auto_map": {
            "AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
            "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
        "model_type": "nemotron_labs_diffusion",
        "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "sdpa",
        "hidden_act": "silu", "initializer_range": 0.02, "mlp_bias": False,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "sliding_window": None,
        "max_position_embeddings": 262144, "bos_token_id": 1, "mask_token_id": 100,
        "block_size": 32, "dlm_paradigm": "bidirectional", "ar_loss_weight": 1.0,
        "dlm_loss_weight": None, "dp_varying_mask_ratio": False, "use_cache": False,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
        "torch_dtype": "bfloat16", "transformers_version": "5.0.0",
        **SHAPES[shape],
    }


def adapter_config(shape: str) -> dict:
    r, alpha = LORA[shape]
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
            "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": ["o_proj"],
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_dora": False, "use_rslora": False,
            "layers_to_transform": None, "layers_pattern": None, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def model_config(shape: str, dtype: str = "bfloat16", lora: bool = False):
    """The ModelConfig `load` derives from this shape's files."""
    c = parse_hf_config(hf_config(shape), dtype)
    return c.replace(lora_rank=LORA[shape][0], lora_alpha=float(LORA[shape][1])) if lora else c


# Order of a decoder layer's tensors in a PyTorch state dict (module registration order).
LAYER_ORDER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
               "post_attention_layernorm")


def tensors(c, entries) -> list[tuple[str, tuple[int, ...], float]]:
    """(checkpoint name, stored shape, std) of every tensor of a name table, in the order
    a PyTorch state dict has them: the embedding, the layers one after another, then the
    final norm and the head.

    The std keeps a forward pass of the random model well scaled (see module doc)."""
    abstract = model_lib.abstract_params(c)
    shrink = math.sqrt(2 * c.num_layers)
    first, layers, last = [], [[] for _ in range(c.num_layers)], []
    for e in entries:
        leaf = abstract
        for key in e.path:
            leaf = leaf[key]
        per = leaf.shape[1:] if e.layer else leaf.shape
        stored = tuple(reversed(per)) if e.transpose else tuple(per)
        name = e.path[-2] if e.path[-1] == "scale" else e.path[-1]
        fan_in = stored[-1] if len(stored) == 2 else 1  # stored [out, in]
        if e.path[-1] == "scale":
            std = 0.0  # RMSNorm weights: ones
        elif name == "embed":
            std = 1.0
        elif name == "head":
            std = LOGIT_STD / math.sqrt(fan_in)
        elif name in ("o_proj", "down_proj"):
            std = 1.0 / math.sqrt(fan_in) / shrink
        elif name == "lora_b":
            std = 0.1 / math.sqrt(fan_in) / shrink
        else:
            std = 1.0 / math.sqrt(fan_in)
        if e.layer:
            for i in range(c.num_layers):
                layers[i].append((e.name.format(i=i), stored, std))
        else:
            (first if name == "embed" else last).append((e.name, stored, std))

    def rank(spec):
        return next((k for k, part in enumerate(LAYER_ORDER) if f".{part}." in spec[0]),
                    len(LAYER_ORDER))

    return first + [spec for layer in layers for spec in sorted(layer, key=rank)] + last


def shard_plan(specs, max_bytes: int) -> list[list[tuple[str, tuple[int, ...], float]]]:
    """Tensors grouped into shards in order, each shard under `max_bytes` (or one tensor),
    as `save_pretrained(max_shard_size=...)` does."""
    shards, size = [[]], 0
    for spec in specs:
        n = 2 * math.prod(spec[1])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _values(name: str, shape, std: float, seed: int, rows: slice) -> np.ndarray:
    """Rows `rows` of one tensor: depends only on (seed, name, rows), so tensors can be
    made in any order and in blocks."""
    if std == 0.0:
        return np.ones((rows.stop - rows.start,) + tuple(shape[1:]), ml_dtypes.bfloat16)
    key = [seed, zlib.crc32(name.encode()), rows.start]
    rng = np.random.default_rng(key)
    block = rng.standard_normal((rows.stop - rows.start,) + tuple(shape[1:]), np.float32)
    return (block * np.float32(std)).astype(ml_dtypes.bfloat16)


def write_safetensors(path: Path, specs, seed: int) -> int:
    """One safetensors file written tensor by tensor, in row blocks; returns data bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape, std in specs:
            row_bytes = 2 * math.prod(shape[1:])
            step = max(1, BLOCK_BYTES // row_bytes)
            for start in range(0, shape[0], step):
                rows = slice(start, min(start + step, shape[0]))
                f.write(np.ascontiguousarray(_values(name, shape, std, seed, rows)).tobytes())
    return offset


def write(shape: str, out: str | Path, *, seed: int = 0, lora: bool = True,
          max_shard_bytes: int | None = None, progress: bool = False) -> Path:
    """Writes a checkpoint directory at `out` (which must not exist yet); returns it."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new directory")
    c = model_config(shape, lora=lora)
    shards = shard_plan(tensors(c, nemotron.table(c)), max_shard_bytes or SHARD_BYTES[shape])
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written in a temporary sibling and renamed when complete: an interrupted run never
    # leaves something at `out` that looks like a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a checkpoint is not
        (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
        weight_map, total = {}, 0
        for i, specs in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(tmp / file, specs, seed)
            weight_map.update({name: file for name, _, _ in specs})
            if progress:
                print(f"{file}: {len(specs)} tensors", file=sys.stderr, flush=True)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if lora:
            adapter = tmp / nemotron.LORA_DIR
            adapter.mkdir()
            (adapter / "adapter_config.json").write_text(
                json.dumps(adapter_config(shape), indent=2) + "\n")
            write_safetensors(adapter / "adapter_model.safetensors",
                              tensors(c, nemotron._lora_table()), seed + 1)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only ever the temporary directory we made
        raise
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.synthetic_checkpoint",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-lora", action="store_true", help="leave out linear_spec_lora/")
    p.add_argument("--max-shard-bytes", type=int, default=None)
    args = p.parse_args(argv)
    try:
        out = write(args.shape, args.out, seed=args.seed, lora=not args.no_lora,
                    max_shard_bytes=args.max_shard_bytes, progress=True)
    except (FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
