"""Run by test_mesh.py in its own process, with 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts): decodes a
checkpoint on one device and on meshes of those devices (each weight read slice by
slice onto its shards, see checkpoints.assemble.read); prints one JSON line.

    python tests/mesh_child.py CHECKPOINT|embedded
"""

import dataclasses
import json
import sys

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

import packed_ss_jax as ps  # noqa: E402
from packed_ss_jax import sharding  # noqa: E402
from packed_ss_jax.programs import Key  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4)]


def main(path: str) -> dict:
    assert len(jax.devices()) == 8, jax.devices()
    path = None if path == "embedded" else path
    one = ps.load(path)
    c = one.config
    V = c.vocab_size
    # Eight prompts of different lengths (ids away from the special tokens).
    prompts = [[3 + (7 * i + 5 * j) % (V - 4) for j in range(2 + 3 * i)] for i in range(8)]
    kw = dict(schedule="packed", max_new_tokens=16, cache_size=64)
    out = {"devices": len(jax.devices()), "config": [c.num_heads, c.num_kv_heads]}
    out["one"] = [r.tokens for r in ps.decode(one, prompts, **kw)]
    out["one_sampled"] = [r.tokens for r in ps.decode(one, prompts, temperature=1.0,
                                                      seed=list(range(8)), **kw)]
    out["meshes"], out["sharded"], out["params_differ"] = {}, {}, {}
    for data, model in MESHES:
        mesh = sharding.make_mesh(data, model)
        m = ps.load(path, mesh=mesh)
        name = f"{data}x{model}"
        # The params gathered from their shards are those of one device, bit for bit.
        pairs = zip(jax.tree_util.tree_leaves_with_path(one.params), jax.tree.leaves(m.params))
        out["params_differ"][name] = [
            jax.tree_util.keystr(k) for (k, a), b in pairs
            if a.dtype != b.dtype or not np.array_equal(np.asarray(a), np.asarray(b))]
        out["meshes"][name] = [r.tokens for r in ps.decode(m, prompts, **kw)]
        if model > 1:
            # From the compiled program (the batched one `decode` ran above): where the q
            # projection of layer 0 is expected.
            engine = ps.Engine.of(m)
            batch = engine.batch(prompts, ps.DecodeOptions(**kw))
            slot_program = dataclasses.replace(batch.program, bucket=0)
            exe = engine.executables()[Key("generate", slot_program, len(batch.members))]
            w = m.params["layer_0"]["attn"]["q_proj"]
            i = next(i for i, x in enumerate(jax.tree.leaves(m.params)) if x is w)
            s = jax.tree.leaves(exe.input_shardings[0])[i]
            out["sharded"][name] = {
                "full": list(w.shape), "compiled_shard": list(s.shard_shape(w.shape)),
                "device_shards": sorted({tuple(x.data.shape) for x in w.addressable_shards}),
                "kv_spec": list(m.params["layer_0"]["attn"]["k_proj"].sharding.spec)}
            out["meshes"][name + "_sampled"] = [
                r.tokens for r in ps.decode(m, prompts, temperature=1.0, seed=list(range(8)),
                                            **kw)]
            out["meshes"][name + "_single"] = ps.decode(m, prompts[3], **kw).tokens
        if name == "4x2" and path is None:  # continuous batching: 4 slots over "data"
            results, _ = ps.decode_continuous(m, prompts, slots=4, **kw)
            out["meshes"][name + "_queue"] = [r.tokens for r in results]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
