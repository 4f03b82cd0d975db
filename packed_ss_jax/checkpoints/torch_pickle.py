"""The `data.pkl` of a `torch.save` zip, read as data: a state dict of tensor records.

Not `pickle.Unpickler` with an allow-list: opcodes such as BUILD and SETITEM change
objects after they were built, so a record that passed its checks could come out with
another shape, stride or offset. This is a small interpreter of its own: it knows the few
opcodes `torch.save` emits for a state dict (protocol 2, and the protocol 4/5 forms),
every value it builds is one of a handful of checked types (records are immutable tuples
of ints), and anything else is refused before it has any effect. Exactly what it
accepts: docs/checkpoints.md#torch-bin-without-torch. Bounds against the storage bytes
are checked by the reader (torch_bin.py) when a tensor is read.
"""

from __future__ import annotations

import math
import pickletools
import re
import struct
from typing import NamedTuple

import numpy as np

from .errors import CheckpointError


def _bf16():
    import ml_dtypes  # a jax dependency

    return np.dtype(ml_dtypes.bfloat16)


# torch storage class name -> NumPy dtype (bf16 resolved lazily).
STORAGES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.dtype(np.float64),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}

MAX_INT = 2**63 - 1  # torch sizes, strides, offsets and numels are int64
MAX_DIMS = 32        # NumPy's limit on every version we support
_KEY = re.compile(r"[0-9A-Za-z_\-]{1,64}")  # torch names storages "0", "1", ...


class Storage(NamedTuple):
    key: str
    dtype: np.dtype
    numel: int


class LazyTensor(NamedTuple):
    """A strided view into one storage; nothing is read until `TorchBin.get`."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Global(NamedTuple):
    module: str
    name: str


# The two callables, as singletons compared by identity (a plain tuple of the same
# strings is data, not a global).
_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = _Global("collections", "OrderedDict")


class _StorageType(NamedTuple):
    name: str

    @property
    def dtype(self) -> np.dtype:
        d = STORAGES[self.name]
        return _bf16() if d == "bfloat16" else d


class _Dict:
    """A dict being filled by SETITEM(S): the state dict, hooks or `_metadata` parts."""

    __slots__ = ("items", "ordered", "closed")

    def __init__(self, ordered: bool):
        self.items: dict = {}
        self.ordered = ordered
        self.closed = False  # after the top-level BUILD nothing may be added


class _Truncated(Exception):
    pass


_SCALARS = (int, bool, str, type(None))
_OPNAMES = {ord(op.code): op.name for op in pickletools.opcodes}


def _describe(v) -> str:
    """A short type name for error messages; never the repr of hostile data."""
    if isinstance(v, _Dict):
        return "OrderedDict" if v.ordered else "dict"
    if isinstance(v, (_Global, _StorageType)):
        return "global " + (f"{v.module}.{v.name}" if isinstance(v, _Global) else f"torch.{v.name}")
    if isinstance(v, LazyTensor):
        return "tensor record"
    if isinstance(v, Storage):
        return "storage"
    return type(v).__name__


def _is_int(v) -> bool:
    return type(v) is int and 0 <= v <= MAX_INT  # bool is not an int here


def _refusal_text(module: str, name: str) -> str:
    return (f"the pickle references {module:.60}.{name:.60}, which is not a tensor-rebuild "
            "record (only torch._utils._rebuild_tensor_v2, torch.*Storage and "
            "collections.OrderedDict are accepted)")


class RecordReader:
    """Runs the allowed opcodes of one `data.pkl` and returns {name: LazyTensor}."""

    def __init__(self, data: bytes, file):
        self.data = bytes(data)
        self.file = file
        self.pos = 0
        self.stack: list = []
        self.frames: list[list] = []  # stacks saved by MARK
        self.memo: dict[int, object] = {}
        self.storages: dict[str, Storage] = {}
        dispatch = {
            b"\x80": self.proto, b"\x95": self.frame, b"(": self.mark,
            b"}": self.empty_dict, b")": self.empty_tuple, b"t": self.tuple,
            b"\x85": lambda: self.tuple_n(1), b"\x86": lambda: self.tuple_n(2),
            b"\x87": lambda: self.tuple_n(3),
            b"X": lambda: self.unicode(4), b"\x8c": lambda: self.unicode(1),
            b"K": lambda: self.push(self.take(1)[0]),
            b"M": lambda: self.push(struct.unpack("<H", self.take(2))[0]),
            b"J": lambda: self.push(struct.unpack("<i", self.take(4))[0]),
            b"\x8a": self.long1, b"\x88": lambda: self.push(True),
            b"\x89": lambda: self.push(False), b"N": lambda: self.push(None),
            b"c": self.global_, b"\x93": self.stack_global, b"Q": self.persid,
            b"R": self.reduce,
            b"q": lambda: self.put(self.take(1)[0]),
            b"r": lambda: self.put(struct.unpack("<I", self.take(4))[0]),
            b"\x94": lambda: self.put(len(self.memo)),
            b"h": lambda: self.get(self.take(1)[0]),
            b"j": lambda: self.get(struct.unpack("<I", self.take(4))[0]),
            b"s": self.setitem, b"u": self.setitems, b"b": self.build,
        }
        self.dispatch = {code[0]: op for code, op in dispatch.items()}

    # --- errors ------------------------------------------------------------------------

    def _tensor_name(self) -> str | None:
        """The state-dict key of the record being read, when torch's layout shows it."""
        for frame in reversed(self.frames + [self.stack]):
            if len(frame) >= 2 and frame[-1] is _REBUILD and isinstance(frame[-2], str):
                return frame[-2]
        # A finished record on top, its key below: what a state-changing opcode would hit.
        if len(self.stack) >= 2 and isinstance(self.stack[-1], LazyTensor) and isinstance(
                self.stack[-2], str):
            return self.stack[-2]
        return None

    def refuse(self, why: str, name: str | None = None) -> CheckpointError:
        name = name if name is not None else self._tensor_name()
        where = f" (tensor {name!r:.120})" if name is not None else ""
        return CheckpointError(f"{self.file}: refusing to load{where}: {why}; nothing from it "
                               "was executed")

    # --- reading the stream --------------------------------------------------------------

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise _Truncated(f"a {n}-byte field at byte {self.pos} runs past the end")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + 256) - self.pos
        if end < 0:  # not found
            raise _Truncated(f"no end of line within 256 bytes at byte {self.pos}")
        s = self.take(end + 1)[:-1]
        try:
            return s.decode("ascii")
        except UnicodeDecodeError:
            raise self.refuse(f"a global name at byte {self.pos} is not ASCII") from None

    def load(self) -> dict[str, LazyTensor]:
        data, dispatch = self.data, self.dispatch
        while True:
            if self.pos >= len(data):
                raise _Truncated("the pickle ends without STOP")
            code = data[self.pos]
            self.pos += 1
            if code == 0x2E:  # STOP
                break
            op = dispatch.get(code)
            if op is None:
                raise self.refuse(f"the pickle uses {_OPNAMES.get(code, 'an unknown opcode')} "
                                  f"({bytes([code])!r}) at byte {self.pos - 1}, which a state "
                                  "dict of tensors never contains")
            op()
        if self.pos != len(self.data) or self.frames or len(self.stack) != 1:
            raise self.refuse("the pickle does not end with its one top-level object at STOP")
        top = self.stack[0]
        if not isinstance(top, _Dict) or not all(
                isinstance(k, str) and isinstance(v, LazyTensor) for k, v in top.items.items()):
            raise CheckpointError(f"{self.file}: expected a state dict of tensors, found a "
                                  f"{_describe(top)}" + ("" if not isinstance(top, _Dict) else
                                                         " holding other values"))
        return dict(top.items)

    # --- the opcodes -----------------------------------------------------------------------

    def push(self, v):
        self.stack.append(v)

    def pop(self):
        if not self.stack:
            raise self.refuse(f"the pickle pops an empty stack at byte {self.pos - 1}")
        return self.stack.pop()

    def pop_mark(self) -> list:
        if not self.frames:
            raise self.refuse(f"the pickle closes a MARK it never opened at byte {self.pos - 1}")
        items, self.stack = self.stack, self.frames.pop()
        return items

    def proto(self):
        v = self.take(1)[0]
        if self.pos != 2 or not 2 <= v <= 5:
            raise self.refuse(f"pickle protocol {v} at byte {self.pos - 2}")

    def frame(self):
        n = struct.unpack("<Q", self.take(8))[0]
        if n > len(self.data) - self.pos:
            raise _Truncated(f"a frame of {n} bytes runs past the end")

    def mark(self):
        self.frames.append(self.stack)
        self.stack = []

    def empty_dict(self):
        self.push(_Dict(ordered=False))

    def empty_tuple(self):
        self.push(())

    def tuple(self):
        self.push(tuple(self.pop_mark()))

    def tuple_n(self, n: int):
        if len(self.stack) < n:
            raise self.refuse(f"a TUPLE{n} at byte {self.pos - 1} has too few items")
        items = tuple(self.stack[-n:])
        del self.stack[-n:]
        self.push(items)

    def unicode(self, width: int):
        n = int.from_bytes(self.take(width), "little")
        try:
            self.push(self.take(n).decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError:
            raise self.refuse(f"a string at byte {self.pos - n} is not UTF-8") from None

    def long1(self):
        n = self.take(1)[0]
        self.push(int.from_bytes(self.take(n), "little", signed=True))

    def _global(self, module: str, name: str):
        if (module, name) == _REBUILD:
            self.push(_REBUILD)
        elif (module, name) == _ORDERED_DICT:
            self.push(_ORDERED_DICT)
        elif module == "torch" and name in STORAGES:
            self.push(_StorageType(name))
        else:
            raise self.refuse(_refusal_text(module, name))

    def global_(self):
        module = self.line()
        self._global(module, self.line())

    def stack_global(self):
        name, module = self.pop(), self.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise self.refuse(f"STACK_GLOBAL of a {_describe(module)} and a {_describe(name)}")
        self._global(module, name)

    def put(self, i: int):
        if not self.stack:
            raise self.refuse(f"the pickle memoizes an empty stack at byte {self.pos - 1}")
        self.memo[i] = self.stack[-1]

    def get(self, i: int):
        if i not in self.memo:
            raise self.refuse(f"the pickle fetches memo entry {i}, which was never stored")
        self.push(self.memo[i])

    def persid(self):
        pid = self.pop()
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
                and isinstance(pid[3], str) and _is_int(pid[4])):
            raise self.refuse("a persistent id is not ('storage', torch.<X>Storage, key, "
                              "location, numel)")
        _, kind, key, location, numel = pid
        if not _KEY.fullmatch(key) or len(location) > 64:
            raise self.refuse(f"storage key {key!r:.80} / location {location!r:.80} is not "
                              "one torch writes")
        s = Storage(key, kind.dtype, numel)
        if self.storages.setdefault(key, s) != s:
            raise self.refuse(f"storage {key} is declared twice with different types or sizes")
        self.push(s)

    def reduce(self):
        args, func = self.pop(), self.pop()
        if func is _ORDERED_DICT and args == ():
            self.push(_Dict(ordered=True))
        elif func is _REBUILD and isinstance(args, tuple):
            name = self.stack[-1] if self.stack and isinstance(self.stack[-1], str) else None
            self.push(self.tensor_record(args, name))
        else:
            raise self.refuse(f"REDUCE calls a {_describe(func)} with a {_describe(args)}; "
                              "only _rebuild_tensor_v2(...) and OrderedDict() are accepted")

    def tensor_record(self, args: tuple, name: str | None) -> LazyTensor:
        if len(args) not in (6, 7):
            raise self.refuse(f"_rebuild_tensor_v2 takes 6 or 7 arguments, found {len(args)}",
                              name)
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        fields = [("storage", isinstance(storage, Storage)), ("offset", _is_int(offset)),
                  ("size", isinstance(size, tuple) and len(size) <= MAX_DIMS
                   and all(_is_int(n) for n in size)),
                  ("stride", isinstance(stride, tuple) and all(_is_int(n) for n in stride)),
                  ("requires_grad", isinstance(requires_grad, bool)),
                  ("backward_hooks", isinstance(hooks, _Dict) and not hooks.items)]
        if len(args) == 7:
            # Metadata (e.g. set by tensor subclasses) would change what the data means.
            fields.append(("metadata", isinstance(args[6], _Dict) and not args[6].items))
        bad = [f for f, ok in fields if not ok]
        if bad:
            raise self.refuse(f"tensor record has a malformed {', '.join(bad)} (only plain "
                              "tensors with non-negative int64 sizes, strides and offsets, no "
                              "hooks and no metadata are accepted)", name)
        if len(size) != len(stride):
            raise self.refuse(f"tensor record has inconsistent size {list(size)} / stride "
                              f"{list(stride)}", name)
        why = view_error(offset, size, stride, storage.numel)
        if why:
            raise CheckpointError(f"{self.file}: tensor {name!r:.120}: {why} (storage "
                                  f"{storage.key} of {storage.numel} elements)")
        return LazyTensor(storage, offset, size, stride)

    def _target(self, what: str) -> _Dict:
        target = self.stack[-1] if self.stack else None
        if not isinstance(target, _Dict) or target.closed:
            raise self.refuse(f"{what} at byte {self.pos - 1} stores into a "
                              f"{_describe(target)}, not into an open dict")
        return target

    def _store(self, target: _Dict, key, value):
        if not isinstance(key, str):
            raise self.refuse(f"a dict key is a {_describe(key)}, not a str")
        # Inert values only (what the top level and `_metadata` hold are checked at the end).
        if not isinstance(value, (LazyTensor, _Dict, tuple) + _SCALARS):
            raise self.refuse(f"dict value {key!r:.120} is a {_describe(value)}")
        if key in target.items:
            raise self.refuse(f"key {key!r:.120} appears twice")
        target.items[key] = value

    def setitem(self):
        value, key = self.pop(), self.pop()
        self._store(self._target("SETITEM"), key, value)

    def setitems(self):
        items = self.pop_mark()
        target = self._target("SETITEMS")
        if len(items) % 2:
            raise self.refuse(f"SETITEMS at byte {self.pos - 1} has an odd number of items")
        for i in range(0, len(items), 2):
            self._store(target, items[i], items[i + 1])

    def build(self):
        # Only `module.state_dict()`'s OrderedDict sets state: its `_metadata`, which holds
        # module versions and is dropped here. Nothing is ever assigned to an object.
        state = self.pop()
        if not (not self.frames and len(self.stack) == 1 and isinstance(self.stack[0], _Dict)
                and self.stack[0].ordered and not self.stack[0].closed
                and _is_metadata_state(state)):
            target = _describe(self.stack[-1] if self.stack else None)
            raise self.refuse(f"the pickle uses BUILD at byte {self.pos - 1} to set the state of "
                              f"an object ({target}); only the _metadata of a top-level "
                              "OrderedDict state dict is accepted")
        self.stack[0].closed = True


def _is_metadata_state(state) -> bool:
    """`{'_metadata': {module_prefix: {key: scalar}}}`, as `module.state_dict()` writes it."""
    if not (isinstance(state, _Dict) and not state.ordered and list(state.items) == ["_metadata"]):
        return False
    meta = state.items["_metadata"]
    return isinstance(meta, _Dict) and all(
        isinstance(v, _Dict) and all(isinstance(x, _SCALARS) for x in v.items.values())
        for v in meta.items.values())


def view_error(offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
               numel: int) -> str | None:
    """Why a view does not lie inside a storage of `numel` elements (None when it does).

    All arithmetic is on Python ints, so huge values cannot wrap around. A view may not
    hold more elements than its storage: a checkpoint stores weights, and a stride-0
    view of a few bytes must not become gigabytes when it is made contiguous.
    """
    if not (_is_int(offset) and len(shape) == len(stride) <= MAX_DIMS
            and all(map(_is_int, shape + stride))):
        return "has a malformed size/stride/offset for its storage"
    if 0 in shape:  # an empty tensor touches no element
        return None if offset <= numel else f"has offset {offset} past the end of its storage"
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
    if last >= numel:
        return (f"size {list(shape)} and stride {list(stride)} at offset {offset} runs past "
                "its storage")
    if math.prod(shape) > numel:
        return f"size {list(shape)} holds more elements than its storage"
    return None


def read_records(data: bytes, file) -> dict[str, LazyTensor]:
    """The state dict in `data` (a `data.pkl`), or a CheckpointError naming `file`."""
    try:
        return RecordReader(data, file).load()
    except _Truncated as e:
        raise CheckpointError(f"{file} is not a readable PyTorch zip checkpoint (truncated or "
                              f"corrupt?): data.pkl: {e}") from None
