"""Seeded fuzzing of the torch `.bin` reader (`packed_ss_jax.checkpoints.torch_bin`).

Every case is a file derived from a real `torch.save` checkpoint: bytes flipped in the
pickle or in the zip, truncations, zip header fields rewritten, opcodes inserted
(BUILD, SETITEM(S), APPEND(S), INST, OBJ, NEWOBJ(_EX), REDUCE of code-running globals,
memo tricks), tensor records re-emitted with swapped shapes and strides, out-of-range
or negative offsets, huge numels, other dtypes, and storage entries cut, padded,
dropped, compressed or declared huge. Case `i` of seed `s` is always the same file.

A case passes when the reader refuses it with a CheckpointError, or loads it and every
tensor lies inside its storage: checked here independently, before the tensor is read,
from the record's shape/stride/offset and the storage's real byte length in the zip,
and then by reading the tensor and comparing it with the bytes it must come from. Any
other exception, a case over the time limit, or a side effect of the smuggled globals
(a sentinel file) is a failure.

    python -m tools.fuzz_torch_bin --cases 100000 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import os
import pickle
import pickletools
import random
import signal
import struct
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np

from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.checkpoints.torch_bin import TorchBin

# --- the fixture, taken apart -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rec:
    """One state-dict entry as torch writes it; any field may be raw opcodes (bytes)."""

    name: object
    kind: object              # "FloatStorage", ...
    key: object
    location: object
    numel: object
    offset: object
    size: object
    stride: object
    requires_grad: object = False
    hooks: bytes | None = None   # None: an empty OrderedDict, as torch writes
    extra: bytes | None = None   # a 7th (metadata) argument
    alias: int | None = None     # reuse record #alias through the memo (a tied head)
    after: bytes = b""           # opcodes right after the record (and its memo put)


class _Record(list):
    pass


class _FixtureUnpickler(pickle.Unpickler):
    """Reads the trusted fixture's records (never used on a fuzzed file)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: _Record(args)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch":
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


class Base:
    """The fixture checkpoint: its zip entries, pickle, records and opcode boundaries."""

    def __init__(self, blob: bytes):
        self.blob = blob
        z = zipfile.ZipFile(io.BytesIO(blob))
        self.entries = [(i.filename, z.read(i)) for i in z.infolist()]
        self.pkl_name = next(n for n, _ in self.entries if n.endswith("data.pkl"))
        self.prefix = self.pkl_name[: -len("data.pkl")]
        self.pickle = dict(self.entries)[self.pkl_name]
        state = _FixtureUnpickler(io.BytesIO(self.pickle)).load()
        self.recs, seen = [], {}
        for name, r in state.items():
            if id(r) in seen:
                self.recs.append(dataclasses.replace(self.recs[seen[id(r)]], name=name,
                                                     alias=seen[id(r)]))
                continue
            (_, kind, key, location, numel), offset, size, stride = r[:4]
            seen[id(r)] = len(self.recs)
            self.recs.append(Rec(name, kind, key, location, numel, offset, tuple(size),
                                 tuple(stride)))
        ops = list(pickletools.genops(self.pickle))
        self.boundaries = [pos for _, _, pos in ops[1:]]  # before every opcode after PROTO
        # Just after each REDUCE's memo put: a freshly built record (or hooks dict) is on
        # top of the stack there, which is where state-changing opcodes do harm.
        self.after_reduce = [ops[i + 2][2] for i in range(len(ops) - 2)
                             if ops[i][0].name == "REDUCE" and ops[i + 1][0].name == "BINPUT"]


# --- writing pickles and zips --------------------------------------------------------------

def p_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -2**31 <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    b = pickle.encode_long(n)
    return b"\x8a" + bytes([len(b)]) + b


def p_str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def p_global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def p_tuple(items: list[bytes]) -> bytes:
    if len(items) <= 3:
        return b"".join(items) + {0: b")", 1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)]
    return b"(" + b"".join(items) + b"t"


def p_value(v) -> bytes:
    if isinstance(v, bytes):
        return v  # raw opcodes
    if isinstance(v, bool):
        return b"\x88" if v else b"\x89"
    if isinstance(v, int):
        return p_int(v)
    if isinstance(v, str):
        return p_str(v)
    if v is None:
        return b"N"
    if isinstance(v, tuple):
        return p_tuple([p_value(x) for x in v])
    if isinstance(v, dict):
        return b"}" + b"".join(p_value(k) + p_value(x) + b"s" for k, x in v.items())
    raise TypeError(type(v))


ORDERED_DICT = p_global("collections", "OrderedDict") + b")R"
REBUILD = p_global("torch._utils", "_rebuild_tensor_v2")
METADATA = {"": {"version": 1}, "backbone": {"version": 1}}


def emit(recs: list[Rec], ordered: bool = False, metadata: dict | None = None) -> bytes:
    """A `data.pkl` laid out exactly as `torch.save` writes a state dict (protocol 2)."""
    out = [b"\x80\x02", ORDERED_DICT if ordered else b"}", b"q\x00("]
    memo = {}
    for i, r in enumerate(recs):
        out.append(p_value(r.name))
        if r.alias is not None:
            out.append(b"j" + struct.pack("<I", memo.get(r.alias, 10**6)))
            continue
        pid = p_tuple([p_str("storage"), p_global("torch", r.kind) if isinstance(r.kind, str)
                       else p_value(r.kind), p_value(r.key), p_value(r.location),
                       p_value(r.numel)])
        args = [pid + b"Q", p_value(r.offset), p_value(r.size), p_value(r.stride),
                p_value(r.requires_grad), ORDERED_DICT if r.hooks is None else r.hooks]
        if r.extra is not None:
            args.append(r.extra)
        memo[i] = 1000 + i
        out += [REBUILD, p_tuple(args), b"R", b"r" + struct.pack("<I", memo[i]), r.after]
    out.append(b"u")
    if metadata is not None:
        meta = ORDERED_DICT + b"(" + b"".join(p_str(k) + p_value(v) for k, v in
                                              metadata.items()) + b"u"
        out.append(b"}" + p_str("_metadata") + meta + b"sb")
    return b"".join(out) + b"."


def rezip(entries: list[tuple[str, bytes]], deflate: frozenset = frozenset()) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z, warnings_off():
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED
            z.writestr(info, data)
    return buf.getvalue()


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate names we write
        yield


def with_pickle(base: Base, pkl: bytes, **changes) -> bytes:
    entries = [(n, pkl if n == base.pkl_name else d) for n, d in base.entries]
    return rezip(entries, **changes)


def headers(blob: bytes) -> list[tuple[int, bytes]]:
    """(offset, signature) of every local (PK\\3\\4) and central (PK\\1\\2) header."""
    out = []
    for sig in (b"PK\x03\x04", b"PK\x01\x02"):
        i = blob.find(sig)
        while i >= 0:
            out.append((i, sig))
            i = blob.find(sig, i + 1)
    return out


def patch_sizes(blob: bytes, entry: str, size: int) -> bytes:
    """Declares `size` bytes (compressed and not) for `entry` in every header of it."""
    b = bytearray(blob)
    name = entry.encode()
    for at, sig in headers(blob):
        csize_at, name_at = (18, 30) if sig == b"PK\x03\x04" else (20, 46)
        n = struct.unpack_from("<H", b, at + name_at - 4 if sig == b"PK\x03\x04" else at + 28)[0]
        if bytes(b[at + name_at: at + name_at + n]) == name:
            struct.pack_into("<II", b, at + csize_at, size, size)
    return bytes(b)


# --- the mutations ------------------------------------------------------------------------

KINDS = ["FloatStorage", "HalfStorage", "BFloat16Storage", "DoubleStorage", "LongStorage",
         "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage"]
ITEMSIZE = {"FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "DoubleStorage": 8,
            "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1,
            "ByteStorage": 1, "BoolStorage": 1}
HUGE = [2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64 + 1,
        2**100, -1, -2, -2**31, -2**63]


@dataclasses.dataclass
class Ctx:
    rng: random.Random
    base: Base
    sentinel: str  # a folder; code that runs leaves a file there

    def pick(self, xs):
        return xs[self.rng.randrange(len(xs))]


def gadgets(c: Ctx) -> list[bytes]:
    """Pickled calls that would leave a file in the sentinel folder if anything ran them."""
    path = os.path.join(c.sentinel, f"ran-{c.rng.randrange(10**6)}")
    touch = p_str(f"touch {path}")
    py = p_str(f"open({path!r}, 'w').close()")
    call = lambda g, args: p_global(*g) + p_tuple(args) + b"R"  # noqa: E731
    return [
        call(("os", "system"), [touch]),
        call(("posix", "system"), [touch]),
        call(("builtins", "eval"), [py]),
        call(("__builtin__", "eval"), [py]),
        call(("builtins", "exec"), [py]),
        call(("subprocess", "Popen"), [p_tuple([p_str("touch"), p_str(path)])]),
        call(("subprocess", "check_call"), [p_tuple([p_str("touch"), p_str(path)])]),
        p_str("os") + p_str("system") + b"\x93" + p_tuple([touch]) + b"R",
        p_str("builtins") + p_str("eval") + b"\x94\x93" + p_tuple([py]) + b"R",
        # getattr(__import__('os'), 'system')(cmd)
        p_global("builtins", "getattr") + p_tuple(
            [p_global("builtins", "__import__") + p_tuple([p_str("os")]) + b"R",
             p_str("system")]) + b"R" + p_tuple([touch]) + b"R",
        b"(" + touch + b"ios\nsystem\n",                       # INST
        b"(" + p_global("os", "system") + touch + b"o",         # OBJ
        p_global("subprocess", "Popen") + p_tuple([p_tuple([p_str("touch"), p_str(path)])])
        + b"\x81",                                              # NEWOBJ
        p_global("subprocess", "Popen") + p_tuple([p_tuple([p_str("touch"), p_str(path)])])
        + b"}\x92",                                             # NEWOBJ_EX
        call(("torch._utils", "_rebuild_parameter"), [p_int(0), b"\x89", ORDERED_DICT]),
        call(("numpy.core.multiarray", "_reconstruct"), [p_int(0)]),
        call(("torch", "load"), [p_str(path)]),
        b"(" + REBUILD + b"o",                                  # OBJ of an allowed callable
        b"(ctorch._utils\n_rebuild_tensor_v2\n",                # INST of it (missing args)
        b"(" + b"icollections\nOrderedDict\n",                  # INST of OrderedDict
        p_global("collections", "OrderedDict") + b")\x81",      # NEWOBJ of OrderedDict
        p_global("torch", "FloatStorage") + p_tuple([p_int(10**9)]) + b"R",
    ]


def state_value(c: Ctx) -> bytes:
    """A value an attacker would set on a record: bigger shapes, strides, offsets."""
    r = c.pick([r for r in c.base.recs if r.alias is None])
    n = r.numel
    shape = tuple(d * c.pick([2, 10, 1000]) for d in r.size)
    return c.pick([
        p_value({"shape": shape}),
        p_value({"stride": tuple(s * c.pick([2, 64, 10**6]) + 1 for s in r.stride)}),
        p_value({"offset": c.pick([n, n * 4, 2**40, -n])}),
        p_value({"shape": (2**31, 2**31), "stride": (1, 1)}),
        p_value({"storage": p_value(("storage", ))}),
        b"N" + p_value({"shape": shape}) + b"\x86",          # (None, slotstate)
        p_value({"shape": b"]"}),  # a list, which the record would keep a reference to
        p_value({"__class__": p_global("builtins", "list")}),
        p_value(shape),
    ])


def snippet(c: Ctx, kind: str | None = None) -> bytes:
    """Opcodes to insert somewhere; mostly ones a state dict never contains."""
    kind = kind or c.pick(["build", "build", "setitem", "setitems", "append", "appends",
                           "list_memo", "gadget", "gadget", "persid", "stack", "binget",
                           "random", "data_ops"])
    r = c.rng
    if kind == "build":
        return state_value(c) + b"b"
    if kind == "setitem":
        return c.pick([p_str("shape"), p_int(0), b"N"]) + p_value(
            c.pick([(300, 6400), 10**9, "x"])) + b"s"
    if kind == "setitems":
        return b"(" + p_str("shape") + p_value((10**6,)) + p_str("offset") + p_int(
            c.pick(HUGE)) + b"u"
    if kind == "append":
        return p_int(c.pick([1, 10**6])) + b"a"
    if kind == "appends":
        return b"(" + p_int(10**6) + p_int(2) + b"e"
    if kind == "list_memo":  # a mutable list put where the memo later hands it out
        return b"]" + c.pick([b"q", b"h"]) + bytes([r.randrange(256)]) + c.pick([b"", b"0"])
    if kind == "gadget":
        return c.pick(gadgets(c)) + c.pick([b"", b"0"])
    if kind == "persid":
        return c.pick([b"P0\n", b"Pstorage\n", p_tuple([p_str("storage")]) + b"Q",
                       p_global("os", "system") + b"Q"])
    if kind == "stack":
        return c.pick([b"0", b"1", b"2", b"(", b")", b"t", b"\x85", b"\x86", b"\x87", b"u",
                       b"s", b"R", b"b", b"."])
    if kind == "binget":
        return c.pick([b"h", b"q"]) + bytes([r.randrange(256)])
    if kind == "data_ops":
        return c.pick([b"G" + struct.pack(">d", 1e300), b"C\x03abc", b"B\x03\x00\x00\x00abc",
                       b"\x82\x01", b"\x8e" + struct.pack("<Q", 3) + b"abc",
                       b"\x8d" + struct.pack("<Q", 2**62) + b"x", b"\x96\x00", b"\x97",
                       b"I123\n", b"L99999999999999999999\n", b"V\\u0041\n", b"S'x'\n",
                       b"\x8b\x08\x00\x00\x00\x00\x00\x00\x00\x01", b"]", b"\x8f", b"\x90",
                       b"\x91", b"\x98\x00"])
    return bytes([r.randrange(256)]) + bytes(r.randrange(256) for _ in range(r.randrange(9)))


def m_pickle_flip(c: Ctx) -> bytes:
    b = bytearray(c.base.pickle)
    for _ in range(c.rng.randint(1, 4)):
        i = c.rng.randrange(len(b))
        b[i] = c.rng.randrange(256) if c.rng.random() < 0.5 else b[i] ^ (1 << c.rng.randrange(8))
    return with_pickle(c.base, bytes(b))


def m_pickle_truncate(c: Ctx) -> bytes:
    p = c.base.pickle
    cut = c.rng.randrange(len(p))
    return with_pickle(c.base, p[:cut] + c.pick([b"", b".", b"u.", b"N."]))


def m_zip_flip(c: Ctx) -> bytes:
    b = bytearray(c.base.blob)
    hs = headers(c.base.blob)
    for _ in range(c.rng.randint(1, 8)):
        if c.rng.random() < 0.5:  # aim at the headers, where the sizes and offsets are
            at, _ = c.pick(hs)
            i = min(len(b) - 1, at + c.rng.randrange(46))
        else:
            i = c.rng.randrange(len(b))
        b[i] = c.rng.randrange(256)
    return bytes(b)


def m_zip_header(c: Ctx) -> bytes:
    b = bytearray(c.base.blob)
    at, sig = c.pick(headers(c.base.blob))
    # (field offset, width) of method, sizes, name/extra lengths and header offsets.
    fields = ([(8, 2), (6, 2), (18, 4), (22, 4), (26, 2), (28, 2)] if sig == b"PK\x03\x04"
              else [(10, 2), (8, 2), (20, 4), (24, 4), (28, 2), (30, 2), (42, 4)])
    off, width = c.pick(fields)
    old = int.from_bytes(b[at + off: at + off + width], "little")
    top = 2 ** (8 * width) - 1
    new = c.pick([0, 1, top, top // 2 + 1, old + 1, max(old - 1, 0), c.rng.randrange(top + 1),
                  old * 2 % (top + 1), 8, 12, 14, 99])
    b[at + off: at + off + width] = (new & top).to_bytes(width, "little")
    return bytes(b)


def m_zip_truncate(c: Ctx) -> bytes:
    blob = c.base.blob
    cut = c.rng.randrange(len(blob))
    return c.pick([blob[:cut], blob[:cut] + blob[cut + c.rng.randrange(1, 4096):],
                   blob + bytes(c.rng.randrange(256) for _ in range(64)),
                   blob[:-c.rng.randrange(1, 100)], b"\x80\x02" + blob[:cut], blob[cut:]])


def m_insert(c: Ctx) -> bytes:
    p = c.base.pickle
    at = c.pick(c.base.boundaries)
    return with_pickle(c.base, p[:at] + snippet(c) + p[at:])


def m_after_record(c: Ctx) -> bytes:
    """State-changing opcodes right after a record is built: the BUILD attack and kin."""
    p = c.base.pickle
    at = c.pick(c.base.after_reduce)
    kind = c.pick(["build", "build", "build", "setitem", "setitems", "append", "appends",
                   "gadget", "list_memo"])
    return with_pickle(c.base, p[:at] + snippet(c, kind) + p[at:])


def _mutate_rec(c: Ctx, r: Rec, o: Rec, recs: list[Rec]) -> Rec:
    """`r` with one field changed; new values derive from `o`, the fixture's record, as an
    earlier mutation may have left any type in `r`."""
    what = c.pick(["swap", "offset", "size", "stride", "dims", "numel", "kind", "key",
                   "location", "grad", "hooks", "extra", "transpose", "raw", "name", "alias"])
    # Each helper knows a few `what`s and answers None for the rest (or where the record
    # cannot take that change), so the fallback below draws nothing before it is reached.
    for mutate in (_mutate_layout, _mutate_storage_ref, _mutate_other):
        changed = mutate(c, r, o, recs, what)
        if changed is not None:
            return changed
    return dataclasses.replace(r, offset=c.pick(HUGE))


def _mutate_layout(c: Ctx, r: Rec, o: Rec, recs: list[Rec], what: str) -> Rec | None:
    """The "swap", "size", "stride", "dims" and "transpose" changes: the tensor's shape and
    strides."""
    n, rng = o.numel, c.rng
    if what == "swap":
        return dataclasses.replace(r, size=r.stride, stride=r.size)
    if what == "size" and o.size:
        i = rng.randrange(len(o.size))
        d = o.size[i]
        v = c.pick([d * 2, d + 1, 0, 1, rng.randrange(1, 1000), -d, 2**64 + d, c.pick(HUGE)])
        return dataclasses.replace(r, size=o.size[:i] + (v,) + o.size[i + 1:])
    if what == "stride" and o.stride:
        i = rng.randrange(len(o.stride))
        s = o.stride[i]
        v = c.pick([0, s * 2, s + 1, n, rng.randrange(1, 1000), c.pick(HUGE)])
        return dataclasses.replace(r, stride=o.stride[:i] + (v,) + o.stride[i + 1:])
    if what == "dims":
        return c.pick([dataclasses.replace(r, size=o.size + (1,), stride=o.stride + (1,)),
                       dataclasses.replace(r, size=o.size + (2,), stride=o.stride + (1,)),
                       dataclasses.replace(r, size=o.size[1:], stride=o.stride[1:]),
                       dataclasses.replace(r, size=o.size + (1,)),
                       dataclasses.replace(r, size=(1,) * 40, stride=(1,) * 40),
                       dataclasses.replace(r, size=(), stride=())])
    if what == "transpose" and len(o.size) == 2:  # a valid view of the same bytes
        return dataclasses.replace(r, size=o.size[::-1], stride=o.stride[::-1])
    return None


def _mutate_storage_ref(c: Ctx, r: Rec, o: Rec, recs: list[Rec], what: str) -> Rec | None:
    """The "offset", "numel", "kind", "key" and "location" changes: where the tensor's
    bytes are and how they are read."""
    n, rng = o.numel, c.rng
    if what == "offset":
        return dataclasses.replace(r, offset=c.pick([n, n - 1, n + 1, rng.randrange(2 * n + 1),
                                                     c.pick(HUGE)]))
    if what == "numel":
        return dataclasses.replace(r, numel=c.pick([n * 2, n - 1, n + 1, 0, 2**28, 2**40,
                                                    c.pick(HUGE)]))
    if what == "kind":  # another dtype; half the time with the numel matching the bytes
        kind = c.pick(KINDS + [7, "Complex64Storage", "UntypedStorage"])
        if isinstance(kind, str) and kind in ITEMSIZE and rng.random() < 0.5:
            return dataclasses.replace(r, kind=kind, numel=n * ITEMSIZE[o.kind] // ITEMSIZE[kind])
        return dataclasses.replace(r, kind=kind)
    if what == "key":
        other = c.pick([x.key for x in recs if x.alias is None])
        return dataclasses.replace(r, key=c.pick(["../data.pkl", "", "99", other, "0/../1",
                                                  "a" * 100, 5, None, "data.pkl", "..", "1\n"]))
    if what == "location":
        return dataclasses.replace(r, location=c.pick(["cuda:0", "x" * 1000, 7, None]))
    return None


def _mutate_other(c: Ctx, r: Rec, o: Rec, recs: list[Rec], what: str) -> Rec | None:
    """The "grad", "hooks", "extra", "raw", "name" and "alias" changes: the record's other
    arguments, raw opcodes in place of values, and the memo."""
    if what == "grad":
        return dataclasses.replace(r, requires_grad=c.pick([True, 1, None, "yes"]))
    if what == "hooks":
        return dataclasses.replace(r, hooks=c.pick([
            ORDERED_DICT + p_str("k") + p_int(1) + b"s", b"}", b"N", b"]", b")",
            ORDERED_DICT + b"(" + p_str("k") + ORDERED_DICT + b"u", c.pick(gadgets(c))]))
    if what == "extra":
        return dataclasses.replace(r, extra=c.pick([ORDERED_DICT, b"}", b"N", p_value(
            {"conj": True}), ORDERED_DICT + p_str("k") + p_int(1) + b"s", c.pick(gadgets(c))]))
    if what == "raw":  # sizes as lists, strings, nested tuples, a list mutated after use
        return c.pick([
            dataclasses.replace(r, size=b"]" + b"(" + b"".join(map(p_int, o.size)) + b"e"),
            dataclasses.replace(r, size=tuple(map(str, o.size))),
            dataclasses.replace(r, size=(o.size,)),
            dataclasses.replace(r, offset=b"]q\xf0", after=b"h\xf0" + p_int(10**6) + b"a"),
            dataclasses.replace(r, size=b"]q\xf1(" + b"".join(map(p_int, o.size)) + b"e",
                                after=b"h\xf1" + p_int(10**6) + b"a"),
            dataclasses.replace(r, offset=b"G" + struct.pack(">d", 0.0)),  # a float
            dataclasses.replace(r, size=o.size + o.size),
        ])
    if what == "name":
        return dataclasses.replace(r, name=c.pick([7, None, b"N", o.name + "\udcff", "",
                                                   c.pick(recs).name]))
    if what == "alias" and len(recs) > 1:
        return dataclasses.replace(r, alias=c.rng.randrange(len(recs) + 2))
    return None

def m_record(c: Ctx) -> bytes:
    recs = list(c.base.recs)
    for _ in range(c.rng.choice([1, 1, 1, 2, 3])):
        i = c.rng.randrange(len(recs))
        recs[i] = _mutate_rec(c, recs[i], c.base.recs[i], recs)
    return with_pickle(c.base, emit(recs, ordered=c.rng.random() < 0.3,
                                     metadata=METADATA if c.rng.random() < 0.2 else None))


def m_valid(c: Ctx) -> bytes:
    """Files that should load: torch's other layouts and legal views of the same bytes."""
    recs = list(c.base.recs)
    i = c.rng.randrange(len(recs))
    r = recs[i]
    if r.alias is None:
        w = c.pick(["transpose", "kind", "tail", "empty", "grad", "stride0", "tie"])
        if w == "transpose" and len(r.size) == 2:
            r = dataclasses.replace(r, size=r.size[::-1], stride=r.stride[::-1])
        elif w == "kind":  # as many or more, narrower, elements over the same bytes
            kind = c.pick([k for k in KINDS if ITEMSIZE[k] <= ITEMSIZE[r.kind]])
            numel = r.numel * ITEMSIZE[r.kind] // ITEMSIZE[kind]
            r = dataclasses.replace(r, kind=kind, numel=numel)
        elif w == "tail":  # the last row, or every other element
            r = dataclasses.replace(r, offset=r.numel - r.stride[0], size=(1,) + r.size[1:])
        elif w == "empty":
            r = dataclasses.replace(r, size=(0,) + r.size[1:], offset=c.rng.randrange(r.numel + 1))
        elif w == "grad":
            r = dataclasses.replace(r, requires_grad=True, extra=ORDERED_DICT)
        elif w == "stride0":
            r = dataclasses.replace(r, stride=(0,) + r.stride[1:])
        else:
            r = dataclasses.replace(r, alias=c.rng.randrange(i) if i else None)
        recs[i] = r
    ordered = c.rng.random() < 0.5
    pkl = emit(recs, ordered=ordered, metadata=METADATA if ordered and c.rng.random() < 0.7
               else None)
    entries = [(n, pkl if n == c.base.pkl_name else d) for n, d in c.base.entries]
    deflate = frozenset(n for n, _ in entries if c.rng.random() < 0.2)
    if c.rng.random() < 0.2:
        entries = [(n, b"big" if n.endswith("byteorder") else d) for n, d in entries]
    return rezip(entries, deflate=deflate)


def m_storage(c: Ctx) -> bytes:
    base, rng = c.base, c.rng
    keys = [n for n, _ in base.entries if n.startswith(base.prefix + "data/")]
    k = c.pick(keys)
    entries = list(base.entries)
    w = c.pick(["cut", "pad", "drop", "dup", "swap", "deflate", "byteorder", "rename", "bomb",
                "bomb_deflate", "extra", "pkl_deflate"])
    deflate = frozenset()
    if w == "cut":
        entries = [(n, d[:rng.randrange(len(d))] if n == k else d) for n, d in entries]
    elif w == "pad":
        entries = [(n, d + bytes(rng.randrange(1, 64)) if n == k else d) for n, d in entries]
    elif w == "drop":
        entries = [(n, d) for n, d in entries if n != k]
    elif w == "dup":
        entries.append((k, bytes(8)))
    elif w == "swap":
        k2 = c.pick(keys)
        data = dict(entries)
        entries = [(n, data[k2] if n == k else data[k] if n == k2 else d) for n, d in entries]
    elif w == "deflate":
        deflate = frozenset(rng.sample(keys, rng.randint(1, len(keys))))
    elif w == "byteorder":
        entries = [(n, c.pick([b"big", b"BIG", b"middle", b"big" * 100, b""]) if
                    n.endswith("byteorder") else d) for n, d in entries]
    elif w == "rename":
        entries = [(n + c.pick(["x", "/", ""]) if n == k else n, d) for n, d in entries]
    elif w == "bomb":  # a storage declared 2 GiB in the pickle and in the zip headers
        key = k[len(base.prefix + "data/"):]
        recs = [dataclasses.replace(r, numel=2**29) if r.key == key and r.alias is None else r
                for r in base.recs]
        blob = with_pickle(base, emit(recs))
        return patch_sizes(blob, k, 2**31)
    elif w == "bomb_deflate":  # highly compressible data declared far larger than it is
        key = k[len(base.prefix + "data/"):]
        recs = [dataclasses.replace(r, numel=2**20) if r.key == key and r.alias is None else r
                for r in base.recs]
        entries = [(n, bytes(2**20 * 4) if n == k else d) for n, d in entries]
        entries = [(n, emit(recs) if n == base.pkl_name else d) for n, d in entries]
        blob = rezip(entries, deflate=frozenset([k]))
        return patch_sizes(blob, k, 2**31) if rng.random() < 0.5 else blob
    elif w == "extra":
        entries.append((base.prefix + "data/99", bytes(16)))
    else:
        deflate = frozenset([base.pkl_name])
    return rezip(entries, deflate=deflate)


MUTATIONS = {  # name -> (weight, mutation)
    "pickle_flip": (14, m_pickle_flip),
    "pickle_truncate": (4, m_pickle_truncate),
    "zip_flip": (8, m_zip_flip),
    "zip_header": (6, m_zip_header),
    "zip_truncate": (4, m_zip_truncate),
    "insert_opcodes": (14, m_insert),
    "after_record": (14, m_after_record),
    "record": (20, m_record),
    "valid": (8, m_valid),
    "storage": (8, m_storage),
}


def make_case(base: Base, seed: int, index: int, sentinel: str) -> tuple[str, bytes]:
    """Case `index` of `seed`: (mutation name, file bytes), the same on every run."""
    rng = random.Random(f"torch-bin-fuzz/{seed}/{index}")
    names = list(MUTATIONS)
    name = rng.choices(names, weights=[MUTATIONS[n][0] for n in names])[0]
    return name, MUTATIONS[name][1](Ctx(rng, base, sentinel))


# --- checking one case --------------------------------------------------------------------

class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Interrupts the case after `seconds` (main thread only; elsewhere only measured)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(*_):
        raise CaseTimeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _Truth:
    """The zip as Python's zipfile sees it, independent of the reader under test."""

    def __init__(self, blob: bytes, prefix: str):
        self.z = zipfile.ZipFile(io.BytesIO(blob))
        self.prefix = prefix
        names = self.z.namelist()
        order = prefix + "byteorder"
        self.big = order in names and self._read(order) == b"big"

    def _read(self, name: str) -> bytes | None:
        """The bytes zipfile yields for `name` (whatever its headers declare), or None.

        The cases are built from a small file, so even a compressed entry stays small.
        """
        try:
            with warnings_off(), self.z.open(name) as f:
                data = f.read()
            return data.strip() if name.endswith("byteorder") else data
        except Exception:  # noqa: BLE001 - anything unreadable is "no bytes"
            return None

    def storage(self, key: str) -> bytes | None:
        return self._read(f"{self.prefix}data/{key}")


def outside(offset, shape, stride, n: int) -> str | None:
    """Why a view does not lie in `n` elements (an implementation separate from the reader's)."""
    if not (type(offset) is int and isinstance(shape, tuple) and isinstance(stride, tuple)
            and len(shape) == len(stride)
            and all(type(v) is int for v in shape + stride)):
        return f"record fields are not tuples of ints: {offset!r:.60} {shape!r:.60} {stride!r:.60}"
    if offset < 0 or min(shape + stride, default=0) < 0:
        return f"negative offset/size/stride {offset} {shape} {stride}"
    if 0 in shape:
        return None
    hi = offset + sum((d - 1) * s for d, s in zip(shape, stride))
    if hi >= n:
        return f"last element {hi} of size {shape} stride {stride} offset {offset} >= {n}"
    count = 1
    for d in shape:
        count *= d
    if count > n:
        return f"size {shape} has {count} elements from a storage of {n}"
    return None


def expected(raw: bytes, dtype: np.dtype, big: bool, offset: int, shape, stride) -> np.ndarray:
    d = dtype.newbyteorder(">" if big else "<") if dtype.itemsize > 1 else dtype
    flat = np.frombuffer(raw[: len(raw) // d.itemsize * d.itemsize], d)
    idx = np.full(shape, offset, np.int64)
    for ax, (n, s) in enumerate(zip(shape, stride)):
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(
            [-1 if a == ax else 1 for a in range(len(shape))])
    return np.asarray(flat[idx]).astype(d.newbyteorder("="))  # fancy indexing is bounds-checked


def check(blob: bytes, path: Path, sentinel: Path, limit_s: float = 10.0) -> tuple[str, str]:
    """('refused' | 'loaded' | 'FAIL', detail) for one file, written to `path` and removed."""
    # A fresh file each time: rewriting one in place is ~20x slower on some filesystems.
    path.write_bytes(blob)
    try:
        outcome = _check(blob, path, limit_s)
    finally:
        path.unlink()
    if any(sentinel.iterdir()):
        return "FAIL", f"code ran: {sorted(p.name for p in sentinel.iterdir())}"
    return outcome


def _check(blob: bytes, path: Path, limit_s: float) -> tuple[str, str]:
    try:
        with deadline(limit_s):
            try:
                t = TorchBin(path)
            except CheckpointError as e:
                return "refused", str(e)
            truth = _Truth(blob, t.prefix)
            refused = None
            for name in t.names():
                rec = t.tensors[name]
                itemsize = np.dtype(rec.storage.dtype).itemsize
                raw = truth.storage(rec.storage.key)
                if raw is not None:
                    why = outside(rec.offset, rec.shape, rec.stride, len(raw) // itemsize)
                    if why:  # never read it: on a broken reader that would leave the buffer
                        return "FAIL", f"tensor {name!r} lies outside its storage: {why}"
                try:
                    got = t.get(name)
                except CheckpointError as e:
                    refused = refused or f"{name}: {e}"
                    continue
                if raw is None:
                    return "FAIL", f"tensor {name!r} read from a storage zipfile cannot read"
                want = expected(raw, np.dtype(rec.storage.dtype), truth.big, rec.offset,
                                rec.shape, rec.stride)
                if got.shape != want.shape or got.dtype != want.dtype or \
                        got.tobytes() != want.tobytes():
                    return "FAIL", f"tensor {name!r} read back wrong values"
            return ("refused", refused) if refused else ("loaded", f"{len(t.names())} tensors")
    except CaseTimeout as e:
        return "FAIL", f"timeout: {e}"
    except Exception as e:  # noqa: BLE001 - any other exception is the failure we look for
        return "FAIL", f"{type(e).__name__}: {str(e)[:300]}"


@dataclasses.dataclass
class Summary:
    cases: int = 0
    refused: int = 0
    loaded: int = 0
    failures: list = dataclasses.field(default_factory=list)  # (index, mutation, detail)
    by_mutation: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    seconds: float = 0.0
    slowest: float = 0.0

    def line(self) -> str:
        return (f"{self.cases} cases: {self.refused} refused, {self.loaded} loaded, "
                f"{len(self.failures)} failures, {self.seconds:.1f} s "
                f"(slowest case {self.slowest * 1e3:.0f} ms)")


def run(base: Base, seed: int, cases: range, workdir: Path, limit_s: float = 10.0,
        progress=None, save: Path | None = None) -> Summary:
    sentinel = workdir / "sentinel"
    sentinel.mkdir(exist_ok=True)
    s = Summary()
    t0 = time.perf_counter()
    for i in cases:
        c0 = time.perf_counter()
        try:
            name, blob = make_case(base, seed, i, str(sentinel))
        except Exception as e:  # noqa: BLE001 - a fuzzer bug: reported, the run goes on
            name, blob, outcome, detail = "generator", b"", "FAIL", f"{type(e).__name__}: {e}"
        else:
            outcome, detail = check(blob, workdir / f"case-{i}.bin", sentinel, limit_s)
        s.slowest = max(s.slowest, time.perf_counter() - c0)
        s.cases += 1
        s.by_mutation[(name, outcome)] += 1
        if outcome == "FAIL":
            s.failures.append((i, name, detail))
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                (save / f"case-{seed}-{i}-{name}.bin").write_bytes(blob)
        else:
            setattr(s, outcome, getattr(s, outcome) + 1)
        s.seconds = time.perf_counter() - t0
        if progress:
            progress(s)
    time.sleep(0.05)  # a spawned process (Popen) would have touched its file by now
    if any(sentinel.iterdir()):
        s.failures.append((-1, "sentinel", f"code ran: {sorted(os.listdir(sentinel))}"))
    return s


def fixture_path() -> Path:
    """The project's fixture `.bin` (tests/fixtures, written by tools/fixtures)."""
    f = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "setdlm_tiny" / \
        "pytorch_model.bin"
    if not f.exists():
        raise SystemExit(f"fixture {f} not found (regenerate it with "
                         "python -m tools.fixtures --out tests/fixtures, or pass --fixture)")
    return f


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz_torch_bin",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first case index (to rerun one)")
    p.add_argument("--fixture", type=Path, default=None)
    p.add_argument("--limit-s", type=float, default=10.0, help="time limit per case")
    p.add_argument("--save-failures", type=Path, default=None, help="write failing files here")
    a = p.parse_args(argv)
    base = Base((a.fixture or fixture_path()).read_bytes())
    every = max(1, a.cases // 100)

    def progress(s: Summary):
        if s.cases % every == 0 or s.cases == a.cases:
            print(f"[{100 * s.cases // a.cases:3d}%] {s.line()}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        s = run(base, a.seed, range(a.start, a.start + a.cases), Path(tmp), a.limit_s,
                progress, a.save_failures)
    print("by mutation (outcome: count):")
    for m in MUTATIONS:
        counts = {o: s.by_mutation[(m, o)] for o in ("refused", "loaded", "FAIL")}
        print(f"  {m:16s} " + "  ".join(f"{o} {n}" for o, n in counts.items()))
    for i, m, d in s.failures[:20]:
        print(f"FAIL case {i} ({m}): {d}")
    print(f"summary: seed {a.seed}: {s.line()}")
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
