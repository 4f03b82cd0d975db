"""Cost of the checkpoint integrity checks: checksum verification at load, NaN/Inf scan.

    python -m benchmarks.checkpoint_cost [--gib 1.0] [--dir /tmp]
    python -m benchmarks.checkpoint_cost --gib 0.001 --hidden-size 64   # seconds, for a check

Writes a random bfloat16 converted checkpoint of about `--gib` GiB, loads it with and
without verification, and times the per-array pieces alone (SHA-256 single-threaded and
in parallel, the non-finite scan). Prints seconds per GiB and the extrapolation to an
8B bfloat16 checkpoint (16 GB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from packed_ss_jax import ModelConfig
from packed_ss_jax import model as model_lib
from packed_ss_jax.checkpoints import marker, store
from packed_ss_jax.checkpoints.assemble import count_non_finite
from packed_ss_jax.loading import load

EIGHT_B_GIB = 16e9 / 2 ** 30


def _config(gib: float, hidden: int = 2048) -> ModelConfig:
    """As many layers of width `hidden` as make about `gib` GiB of bfloat16 (at least one):
    heads of 128 (fewer for narrow layers), half as many key/value heads, an MLP three
    times as wide and a vocabulary four times; 12 x hidden^2 params per layer."""
    heads = max(1, hidden // 128)
    layers = max(1, round(gib * 2 ** 30 / 2 / (12 * hidden ** 2)))
    return ModelConfig(family="nemotron", vocab_size=4 * hidden, hidden_size=hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                       head_dim=hidden // heads, intermediate_size=3 * hidden,
                       rms_norm_eps=1e-5, mask_token_id=4 * hidden - 1, dtype="bfloat16")


def _parallel_checksums(arrays: dict) -> list[str]:
    """SHA-256 of every array on as many threads as the loader hashes with."""
    with concurrent.futures.ThreadPoolExecutor(marker.hash_workers()) as pool:
        return list(pool.map(marker.checksum, arrays.values()))


def _best(fn, repeat=3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_cost",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB)")
    p.add_argument("--hidden-size", type=int, default=2048,
                   help="layer width; a small one (64) with a small --gib (0.001) makes a "
                        "checkpoint of a few MB, to check the script")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (a temp dir)")
    args = p.parse_args(argv)

    config = _config(args.gib, args.hidden_size)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16),
        model_lib.abstract_params(config))
    arrays = marker.array_names(params)
    gib = sum(a.nbytes for a in arrays.values()) / 2 ** 30
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        writer = store.Writer((root / "ckpt").absolute())
        writer.begin()
        writer.write(config, params)
        out = writer.commit()
        del params
        sha_1 = _best(lambda: [marker.checksum(a) for a in arrays.values()])
        sha_n = _best(lambda: _parallel_checksums(arrays))
        scan = _best(lambda: [count_non_finite(a) for a in arrays.values()])
        load(out, dtype="bfloat16", verify=False)  # warm: tracing, orbax imports
        plain = _best(lambda: load(out, dtype="bfloat16", verify=False), 2)
        verified = _best(lambda: load(out, dtype="bfloat16", verify=True), 2)
    finally:
        shutil.rmtree(root)
    rows = [("SHA-256, one thread", sha_1), (f"SHA-256, {marker.hash_workers()} threads", sha_n),
            ("NaN/Inf scan (bfloat16)", scan), ("load, verify=False", plain),
            ("load, verify=True", verified), ("verification overhead", verified - plain)]
    print(f"checkpoint: {gib:.2f} GiB bfloat16, {len(arrays)} arrays")
    print(f"{'':28s} {'s/GiB':>8s} {'8B (16 GB) s':>13s}")
    for name, t in rows:
        print(f"{name:28s} {t / gib:8.3f} {t / gib * EIGHT_B_GIB:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
