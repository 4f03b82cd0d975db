"""A copy of the embedded nld-tiny with a draft-only adapter whose update is zero.

`packed-ss bench --lora on,off` on it measures what evaluating the adapter costs each
schedule (App. F.2, Tables 4-5) with the trajectories held fixed: lora_B is zero, so the
drafts, the accepted tokens and the NFE are those of the model without it, and only the
extra products differ. The adapter has the release's layout (`linear_spec_lora/`, PEFT
keys, o_proj, scale alpha / r = 4).

    python -m tools.zero_adapter OUT [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import packed_ss_jax as ps


def build(out: Path, rank: int = 16, seed: int = 0) -> Path:
    src = Path(ps.__file__).parent / "embedded" / "nld-tiny"
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new directory")
    out.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    inner = cfg["num_attention_heads"] * cfg["head_dim"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        key = f"base_model.model.encoder.layers.{i}.self_attn.o_proj"
        a = 0.02 * rng.standard_normal((rank, inner))
        tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = np.zeros((cfg["hidden_size"], rank), np.float32)
    (out / "linear_spec_lora").mkdir()
    save_file(tensors, str(out / "linear_spec_lora" / "adapter_model.safetensors"))
    (out / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 4 * rank, "target_modules": ["o_proj"],
        "lora_dropout": 0.0, "bias": "none", "inference_mode": True}, indent=1) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.zero_adapter",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to create (must not exist)")
    p.add_argument("--rank", type=int, default=16, help="the adapter's rank r")
    args = p.parse_args(argv)
    if args.rank < 1:
        p.error(f"--rank must be at least 1, got {args.rank}")
    try:
        build(args.out, args.rank)
    except OSError as e:  # FileExistsError among them
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"written {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
