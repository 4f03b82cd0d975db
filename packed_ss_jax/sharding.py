"""Device meshes: where every weight, sequence and cache buffer lives.

One table (`RULES`) maps the logical axes of the arrays to the axes of a
`jax.sharding.Mesh` with axes ("data", "model"): sequences of a batch on "data";
tensor parallelism on "model" over attention heads, KV heads, the MLP hidden units and
the vocabulary. `PARAM_AXES` names the logical axes of every weight, `CACHE_AXES` those
of a batched cache buffer. A logical axis whose size the mesh axis does not divide is
replicated instead: in particular a "model" axis larger than the number of KV heads
replicates the KV heads (and their cache), as tensor-parallel servers do, while the
query heads stay split. Shardings only place data: XLA (GSPMD) inserts the collectives,
so every program computes what it computes on one device.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelConfig

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated)
RULES = {
    "batch": "data",
    "heads": "model",       # query heads (q_proj's outputs, o_proj's inputs)
    "kv_heads": "model",    # k_proj / v_proj outputs and the cache's head axis
    "mlp": "model",         # the MLP hidden units
    "vocab": "model",       # embedding rows and the head's outputs
    "embed": None,
    "head_dim": None,
    "positions": None,
    "rank": None,           # the draft-only adapter's rank
}

# weight name (the last key of its path) -> logical axes of its dimensions; norms
# ("scale") and anything not named here are replicated.
PARAM_AXES = {
    "q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"), "o_proj": ("heads", "embed"),
    "lora_a": ("heads", "rank"), "lora_b": ("rank", "embed"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed"),
    "embed": ("vocab", "embed"), "head": ("embed", "vocab"),
}

CACHE_AXES = ("batch", "kv_heads", "positions", "head_dim")


class MeshError(ValueError):
    """A mesh specification that cannot describe a mesh of these devices."""


def _shown(text: str, limit: int = 40) -> str:
    """`text` as an error message quotes it: a hostile one is cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse(spec: str) -> dict[str, int]:
    """'data=2,model=4' -> {"data": 2, "model": 4} (an axis left out has size 1)."""
    sizes = {a: 1 for a in MESH_AXES}
    seen = set()
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        # ASCII digits, at most 9 (int() takes other digits, and fails past 4300 of them)
        if not eq or name not in MESH_AXES or not re.fullmatch(r"[0-9]{1,9}", value) \
                or int(value) < 1:
            raise MeshError(f"mesh {_shown(spec)}: {_shown(part)} is not AXIS=SIZE with AXIS "
                            f"one of {MESH_AXES} and SIZE an integer >= 1")
        if name in seen:
            raise MeshError(f"mesh {_shown(spec)} names {name!r} twice")
        seen.add(name)
        sizes[name] = int(value)
    return sizes


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    if data * model != len(devices):
        raise MeshError(f"a mesh of data={data} x model={model} needs {data * model} devices; "
                        f"there are {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, model), MESH_AXES)


def _sizes(c: ModelConfig) -> dict[str, int]:
    """The size of each logical axis in units that must stay whole on a device."""
    return {"heads": c.num_heads, "kv_heads": c.num_kv_heads, "mlp": c.intermediate_size,
            "vocab": c.vocab_size}


def spec(axes, mesh: Mesh, sizes: dict[str, int]) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes: each mapped by `RULES`,
    replicated where the mesh axis is 1 or does not divide the logical size."""
    out = []
    for a in axes:
        m = RULES.get(a)
        n = mesh.shape.get(m, 1) if m else 1
        out.append(m if n > 1 and sizes.get(a, 0) % n == 0 else None)
    return PartitionSpec(*out)


def param_spec(c: ModelConfig, mesh: Mesh, path: tuple[str, ...], ndim: int) -> PartitionSpec:
    axes = PARAM_AXES.get(path[-1]) if path else None
    if axes is None or len(axes) != ndim:
        return PartitionSpec()
    return spec(axes, mesh, _sizes(c))


def local_slices(sharding: jax.sharding.Sharding, shape) -> list[tuple[slice, ...]]:
    """The distinct slices of an array of `shape` that this process's devices hold under
    `sharding`, each once (replicas share one), in device order. On a mesh spanning
    several processes this is the part of a weight the process has to read."""
    shape = tuple(shape)
    distinct: dict = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        # Slices are not hashable before Python 3.12: key them by (start, stop, step).
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        distinct.setdefault(key, tuple(slice(*k) for k in key))
    return list(distinct.values())


class Placer:
    """`place` for the checkpoint readers: each weight goes straight onto its shards, no
    device ever holding the whole of a split weight.

    `placer(host, path)` places a whole host array (each device receives its slice);
    `placer.lazy(shape, path, read)` places a weight read slice by slice, calling
    `read(index)` once for each distinct slice this process's devices hold
    (`local_slices`), so a process never reads the slices only other processes hold.
    """

    with_path = True  # see checkpoints.assemble.read

    def __init__(self, c: ModelConfig, mesh: Mesh):
        self.config, self.mesh = c, mesh

    def sharding(self, path, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, param_spec(self.config, self.mesh, tuple(path), ndim))

    def slices(self, shape, path) -> list[tuple[slice, ...]]:
        """The distinct slices of the weight at `path` this process's devices hold."""
        return local_slices(self.sharding(path, len(shape)), shape)

    def __call__(self, host, path):
        return jax.make_array_from_callback(host.shape, self.sharding(path, host.ndim),
                                            lambda index: host[index])

    def lazy(self, shape, path, read):
        shape = tuple(shape)
        parts: dict = {}

        def part(index):
            key = tuple(s.indices(n) for s, n in zip(index, shape))
            if key not in parts:  # replicas of a slice are read once
                parts[key] = read(tuple(slice(*k) for k in key))
            return parts[key]

        return jax.make_array_from_callback(shape, self.sharding(path, len(shape)), part)


def placer(c: ModelConfig, mesh: Mesh) -> Placer:
    """The `place` of the checkpoint readers for `mesh` (see `Placer`)."""
    return Placer(c, mesh)


def cache_spec(c: ModelConfig, mesh: Mesh, batch: int) -> PartitionSpec:
    """The PartitionSpec of a batched cache buffer [batch, kv_heads, positions, head_dim]."""
    return spec(CACHE_AXES, mesh, dict(_sizes(c), batch=batch))


def batch_spec(mesh: Mesh, batch: int) -> PartitionSpec:
    """Leading batch axis on "data" (replicated when "data" does not divide it)."""
    return spec(("batch",), mesh, {"batch": batch})


def mesh_of(params) -> Mesh | None:
    """The mesh the params are placed on (None: one device, or not a named sharding)."""
    for x in jax.tree.leaves(params):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and math.prod(s.mesh.shape.values()) > 1:
            return s.mesh
    return None
