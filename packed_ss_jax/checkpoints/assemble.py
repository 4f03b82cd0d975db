"""Checkpoint name table -> params tree in the decoding layout, with a completeness check first.

A table maps each param path to a checkpoint tensor name (with `{i}` for per-layer
tensors) and says whether the tensor is stored PyTorch-style `[out, in]` and so needs a
transpose. The expected shapes come from `model.abstract_params`, so they are written
down in one place. All problems are collected and reported together before any tensor
is read; tensors holding NaN or Inf are reported together after reading, naming each one.

Tensors are read one at a time and each becomes its own param array at once: a layer's
tensor goes to `layer_{i}/...` (the layout a Model decodes with, see model.py), never
into a weight stacked over the layers, and `place` (e.g. `jax.device_put`) can move it
to the device before the next one is read. The source array (a memory-mapped view for
safetensors) is dropped as soon as it has been copied, so reading holds at most one
tensor besides the params built so far. The copy is aligned so that on the CPU the
device array adopts it instead of copying it again.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Callable, Iterable, Protocol

import numpy as np

from .errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]     # param path, e.g. ("layers", "attn", "q_proj")
    name: str                 # checkpoint name, "{i}" for the layer index
    transpose: bool = False   # stored [out, in]; params are [in, out]
    layer: bool = False       # one tensor per layer: `layer_{i}/...` in the params


# Llama-style per-layer names shared by the Ministral-3 and Qwen3 backbones:
# (param path, checkpoint name after the layer prefix, stored [out, in]).
DECODER_LAYER = [
    (("input_norm", "scale"), "input_layernorm.weight", False),
    (("attn", "q_proj"), "self_attn.q_proj.weight", True),
    (("attn", "k_proj"), "self_attn.k_proj.weight", True),
    (("attn", "v_proj"), "self_attn.v_proj.weight", True),
    (("attn", "o_proj"), "self_attn.o_proj.weight", True),
    (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp", "gate_proj"), "mlp.gate_proj.weight", True),
    (("mlp", "up_proj"), "mlp.up_proj.weight", True),
    (("mlp", "down_proj"), "mlp.down_proj.weight", True),
]
QK_NORM = [
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
]


def decoder_table(c, embed: str, layer_prefix: str, final_norm: str, head: str) -> list[Entry]:
    """The name table of a decoder-only checkpoint: embedding, stacked layers (`{i}` in
    `layer_prefix`), final norm, and the head unless it is tied to the embedding."""
    layer = DECODER_LAYER + (QK_NORM if c.qk_norm else [])
    entries = [Entry(("embed",), embed)]
    entries += [Entry(("layers",) + path, layer_prefix + name, t, layer=True)
                for path, name, t in layer]
    entries.append(Entry(("final_norm", "scale"), final_norm))
    if not c.tie_embeddings:
        entries.append(Entry(("head",), head, transpose=True))
    return entries


class Source(Protocol):
    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Read:
    """One tensor to read: its checkpoint name, where it goes in the decoding layout,
    whether it is transposed on the way, and its param shape."""

    name: str
    path: tuple[str, ...]
    transpose: bool
    shape: tuple[int, ...]


def layer_path(path: tuple[str, ...], i: int) -> tuple[str, ...]:
    """("layers", "attn", "q_proj"), 3 -> ("layer_3", "attn", "q_proj") (model.unstack_layers)."""
    return (f"layer_{i}",) + tuple(path[1:])


def _get_path(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set_path(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _expand(entry: Entry, num_layers: int) -> list[str]:
    return [entry.name.format(i=i) for i in range(num_layers)] if entry.layer else [entry.name]


_CHUNK = 1 << 20  # elements: the scratch buffer stays in cache, no large temporaries


def _bf16_all_finite(a: np.ndarray) -> bool:
    bits = a.ravel(order="K").view(np.uint16)  # a view whenever a is contiguous in any order
    scratch = np.empty(min(bits.size, _CHUNK), np.uint16)
    for i in range(0, bits.size, _CHUNK):
        part = bits[i:i + _CHUNK]
        out = scratch[:part.size]
        np.bitwise_and(part, 0x7FFF, out=out)
        if out.max() >= 0x7F80:
            return False
    return True


def count_non_finite(a: np.ndarray) -> int:
    """How many entries of a float array are NaN or +-Inf.

    The common all-finite case costs one vectorised pass: the float32 sum (NaN and Inf
    propagate through it; an overflow of huge finite values only sends it to the exact
    count below) or, for bfloat16, the largest exponent-and-mantissa bit pattern (all
    exponent bits set means Inf or NaN), in cache-sized chunks. Measured here: ~0.15 s/GiB
    for float32, ~0.2 s/GiB for bfloat16.
    """
    if a.dtype.itemsize == 2 and a.dtype.name == "bfloat16":
        if _bf16_all_finite(a):
            return 0
    elif np.issubdtype(a.dtype, np.floating):
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.sum(a)):
                return 0
    else:
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


class _NonFinite:
    """NaN/Inf found in a tensor, summed over the slices of it that were read."""

    def __init__(self):
        self.count = self.nan = self.size = 0

    def check(self, a: np.ndarray):
        self.size += a.size
        if bad := count_non_finite(a):
            self.count += bad
            self.nan += int(np.count_nonzero(np.isnan(a)))

    def report(self, name: str, where: str = "") -> str:
        return (f"{name}: {self.count} of {self.size} values{where} ({self.nan} NaN, "
                f"{self.count - self.nan} Inf)")


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale or unit == "MB":
            return f"{n / scale:.2f} {unit}"


class Progress:
    """A plain stderr progress line (items, bytes, elapsed time, rate); silent when
    disabled. Redrawn at most every `every` seconds, and once more at the end."""

    def __init__(self, total: int, label: str, enabled: bool, total_bytes: int = 0,
                 every: float = 0.2, noun: str = "tensors", note: str = ""):
        self.total, self.label, self.enabled = total, label, enabled
        self.total_bytes, self.every, self.noun = total_bytes, every, noun
        self.note = note  # appended to the last line
        self.done = self.bytes = 0
        self.start = self.shown = time.monotonic()

    def step(self, n: int = 1, nbytes: int = 0):
        self.done += n
        self.bytes += nbytes
        self._show()

    def set_bytes(self, nbytes: int):
        """Bytes done so far, measured rather than counted (e.g. a growing output)."""
        self.bytes = nbytes
        self._show()

    def finish(self):
        self.done, self.bytes = self.total, max(self.bytes, self.total_bytes)
        self._show()

    def _show(self):
        if not self.enabled:
            return
        now = time.monotonic()
        last = self.done >= self.total
        if not last and now - self.shown < self.every:
            return
        self.shown = now
        elapsed = now - self.start
        line = f"\r{self.label}: {self.done}/{self.total} {self.noun}"
        if self.total_bytes:
            pct = 100.0 * self.bytes / self.total_bytes
            rate = self.bytes / elapsed if elapsed > 0 else 0.0
            line += (f", {_size(self.bytes)} of {_size(self.total_bytes)} ({pct:5.1f}%), "
                     f"{elapsed:6.1f}s, {_size(rate)}/s")
        else:
            pct = 100.0 * self.done / max(self.total, 1)
            line += f" ({pct:5.1f}%) {elapsed:6.1f}s"
        sys.stderr.write(line + (f"{self.note}\n" if last else ""))
        sys.stderr.flush()


def plan(table: Iterable[Entry], abstract, num_layers: int, source: Source,
         ignore: Callable[[str], bool] = lambda name: False,
         allow_unexpected: Iterable[str] = ()) -> list[Read]:
    """The tensors to read, in checkpoint order (the whole-model tensors before the
    layers stay first, then layer by layer), or a CheckpointError listing every missing,
    misshaped and unexpected tensor."""
    table = list(table)
    available = set(source.names())
    missing, misshaped, used = [], [], set()
    before, layers, after = [], [[] for _ in range(num_layers)], []
    for e in table:
        want = tuple(_get_path(abstract, e.path).shape)
        per = want[1:] if e.layer else want
        stored = tuple(reversed(per)) if e.transpose else per
        for i, name in enumerate(_expand(e, num_layers)):
            if name not in available:
                missing.append(f"{name} {list(stored)}")
                continue
            used.add(name)
            got = source.shape(name)
            if tuple(got) != stored:
                misshaped.append(f"{name}: expected {list(stored)}, found {list(got)}")
        if e.layer:
            for i, name in enumerate(_expand(e, num_layers)):
                layers[i].append(Read(name, layer_path(e.path, i), e.transpose, per))
        else:
            (after if any(layers) else before).append(Read(e.name, e.path, e.transpose, per))
    unexpected = sorted(n for n in available - used - set(allow_unexpected) if not ignore(n))
    if missing or misshaped or unexpected:
        lines = ["checkpoint does not match its config:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if misshaped:
            lines.append(f"  misshaped ({len(misshaped)}): " + "; ".join(misshaped))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        raise CheckpointError("\n".join(lines))
    return before + [r for layer in layers for r in layer] + after


_TILE = 256  # rows and columns per block of a transposing copy
# XLA's CPU client adopts a host buffer aligned to 64 bytes instead of copying it:
# `jax.device_put` of such an array costs neither time nor memory.
_ALIGN = 64


def empty_aligned(shape, dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on a `_ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    buf = np.empty(n + _ALIGN, np.uint8)
    start = -buf.ctypes.data % _ALIGN
    return buf[start:start + n].view(dtype).reshape(shape)


def host_array(a: np.ndarray, transpose: bool, dtype) -> np.ndarray:
    """A new aligned, C-ordered array of `dtype` holding `a` (transposed): one copy, the
    cast done during it. A transpose is copied in square tiles that stay in cache (2.4x
    faster here than numpy's strided copy of the whole matrix)."""
    if not transpose or a.ndim != 2:
        out = empty_aligned(a.T.shape if transpose else a.shape, dtype)
        np.copyto(out, a.T if transpose else a, casting="unsafe")
        return out
    rows, cols = a.shape
    out = empty_aligned((cols, rows), dtype)
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            np.copyto(out[j:j + _TILE, i:i + _TILE], a[i:i + _TILE, j:j + _TILE].T,
                      casting="unsafe")
    return out


def slice_shape(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of `array[index]` for an array of `shape` and a tuple of slices."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def read(reads: list[Read], source: Source, dtype, place: Callable | None = None,
         label: str = "converting", progress: bool = False) -> dict:
    """Reads `reads` one tensor at a time into a params tree (decoding layout), each
    array cast to `dtype`, checked for NaN/Inf after the cast (so a float32 value too
    large for bfloat16 counts too) and passed through `place` when given.

    A placer that reads lazily (`sharding.Placer`, on a device mesh) gets each tensor
    slice by slice: only the distinct slices this process's devices hold are read from
    the stored tensor, transposed, cast and checked, so on a mesh spanning several
    processes each reads only its own shards: from safetensors only the file pages that
    hold them (`get_slice`); a torch `.bin` storage is still read whole, since zipfile
    checks its CRC over the whole entry, and only sliced in memory. NaN/Inf are then
    reported for the slices this process read, and the progress line ends with how many
    bytes of the weights (in `dtype`) that was."""
    dtype = np.dtype(dtype)
    lazy = getattr(place, "lazy", None)
    share = {r.name: _elements(r, place) for r in reads}
    local = sum(share.values()) * dtype.itemsize
    whole_bytes = sum(math.prod(r.shape) for r in reads) * dtype.itemsize
    note = (f" (this process read the slices its devices hold: {local} of {whole_bytes} "
            "bytes)" if local < whole_bytes else "")
    bar = Progress(len(reads), label, progress, total_bytes=local, note=note)
    params: dict = {}
    non_finite = []
    for r in reads:
        found = _NonFinite()
        if lazy is None:
            host = _read_whole(r, source, dtype, place, found)
        else:
            by_slice = local < whole_bytes and hasattr(source, "get_slice")
            host = _read_by_slices(r, source, dtype, lazy, found, by_slice)
        if found.count:
            sliced = share[r.name] < math.prod(r.shape)
            non_finite.append(found.report(r.name, " read by this process" if sliced else ""))
        _set_path(params, r.path, host)
        del host
        bar.step(nbytes=share[r.name] * dtype.itemsize)
    if non_finite:
        raise CheckpointError(f"non-finite weights (NaN/Inf) in {len(non_finite)} tensor(s):\n  "
                              + "\n  ".join(non_finite))
    return params


def _elements(r: Read, place) -> int:
    """How many elements of the tensor this process reads: all of them, or with a lazy
    placer the sum over the distinct slices its devices hold."""
    if getattr(place, "lazy", None) is None:
        return math.prod(r.shape)
    return sum(math.prod(slice_shape(i, r.shape)) for i in place.slices(r.shape, r.path))


def _read_whole(r: Read, source: Source, dtype: np.dtype, place: Callable | None,
                found: _NonFinite):
    """One tensor read whole, transposed and cast into a new host array, checked for
    NaN/Inf into `found`, then passed through `place` when given."""
    a = np.asarray(source.get(r.name))
    host = host_array(a, r.transpose, dtype)
    del a  # a memory-mapped view: unmapped here
    assert host.shape == r.shape, (r.name, host.shape, r.shape)
    found.check(host)
    if place is not None:
        # A placer that takes the param's path (sharding.placer) puts each slice
        # on its own device.
        host = place(host, r.path) if getattr(place, "with_path", False) else place(host)
    return host


def _read_by_slices(r: Read, source: Source, dtype: np.dtype, lazy: Callable,
                    found: _NonFinite, by_slice: bool):
    """One tensor handed to a lazy placer, which asks for the slices its devices hold:
    each is read (`by_slice`: from the source's pages alone; otherwise cut from the
    tensor read once), transposed, cast and checked for NaN/Inf into `found`."""
    # When this process reads part of the checkpoint, every tensor is read slice
    # by slice (only their pages, see SafetensorsDir.get_slice), even one it
    # holds whole: a fault in a memory mapping also reads the pages around it
    # (the device's read-ahead, megabytes), the neighbouring tensors' slices of
    # other processes. Otherwise, or from a source that reads whole tensors
    # anyway (a torch .bin), the tensor is read once and sliced in memory.
    whole = None if by_slice else np.asarray(source.get(r.name))

    def part(index):
        # `index` is in the params layout; a transposed tensor is stored the
        # other way round, so it is sliced with the index reversed.
        stored = index[::-1] if r.transpose else index
        a = whole[stored] if whole is not None else source.get_slice(r.name, stored)
        out = host_array(a, r.transpose, dtype)
        assert out.shape == slice_shape(index, r.shape), (r.name, index, out.shape)
        found.check(out)
        return out

    return lazy(r.shape, r.path, part)


def assemble(table: Iterable[Entry], abstract, num_layers: int, source: Source, dtype,
             ignore: Callable[[str], bool] = lambda name: False, label: str = "converting",
             progress: bool = False, allow_unexpected: Iterable[str] = (),
             place: Callable | None = None) -> dict:
    """The params tree in the decoding layout (`layer_{i}` per layer), or a
    CheckpointError listing every problem. `place` (e.g. `jax.device_put`) receives each
    host array as soon as it is read; without it the tree holds NumPy arrays."""
    reads = plan(table, abstract, num_layers, source, ignore, allow_unexpected)
    return read(reads, source, dtype, place, label, progress)


def merge(tree: dict, other: dict) -> dict:
    """`other`'s leaves added into `tree` (nested dicts), in place; returns `tree`."""
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict):
            merge(tree[k], v)
        else:
            tree[k] = v
    return tree
