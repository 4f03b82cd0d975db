"""Hugging Face checkpoint directory -> converted directory (orbax params + config)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .checkpoints import store
from .config import DTYPES, ConfigError
from .loading import TOKENIZER_FILES, hf_config, read_weights


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", lora: bool | None = None,
            overwrite: bool = False, progress: bool = True, base_config=None) -> Path:
    """Converts `src` (config.json, safetensors shards, optional linear_spec_lora/; or a
    SetDLM directory with pytorch_model.bin or safetensors) to `dst`.

    base_config: SetDLM only, the Qwen3 base model's config.json (see `load`).

    The checkpoint is checked against the expected param shapes first; any missing,
    unexpected or misshaped tensor stops the conversion with the full list. The output
    appears only when complete.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint {src} is not a directory")
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --overwrite to replace it)")
    t0 = time.monotonic()
    config = hf_config(src, dtype, lora, base_config)
    params = read_weights(src, config, progress=progress)
    copies = [src / "config.json"] + [src / f for f in TOKENIZER_FILES if (src / f).exists()]
    out = store.save(dst, config, params, copies, overwrite=overwrite)
    if progress:
        sys.stderr.write(f"wrote {out} ({config.dtype}, lora={'on' if config.lora_rank else 'off'}) "
                         f"in {time.monotonic() - t0:.1f}s\n")
    return out
