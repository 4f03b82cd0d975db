"""Reading compiled decode programs: the `lax.while_loop`'s state and what its body makes.

Works on `Compiled.as_text()` (optimised HLO): computations are split at their headers,
the decode loop is the entry computation's `while` with the largest state, and its body
is that computation plus every computation it calls (fusions, nested loops).
"""

from __future__ import annotations

import re

import numpy as np

_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)")
_RESULT = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([0-9,]*)\]\S* ([\w\-]+)\(")
# XLA options that give a compiled program the code generation of a user's process: the
# test run's XLA_FLAGS turn XLA's CPU fusion emitters off to compile faster, which moves
# its fusion decisions (conftest.py). Programs whose HLO a test reads are compiled with
# these (the `user_codegen` fixture, or `compile(USER_CODEGEN)`).
USER_CODEGEN = {"xla_cpu_use_fusion_emitters": True}
HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "uint16": "u16", "float16": "f16"}


def hlo_dtype(dtype) -> str:
    return HLO_DTYPES[np.dtype(dtype).name]


def computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
        elif current is not None and line.strip() != "}":
            current.append(line)
    return comps


def _entry(hlo: str) -> str:
    return re.search(r"^ENTRY %(\S+) ", hlo, re.M).group(1)


def decode_loop(hlo: str) -> tuple[str, str]:
    """(the decode loop's `while` instruction, the name of its body computation): the
    entry computation's loop with the largest state (it carries the cache)."""
    comps = computations(hlo)
    loops = [line for line in comps[_entry(hlo)] if " while(" in line]
    assert loops, "no while loop in the entry computation"
    line = max(loops, key=lambda x: len(x.split(" while(")[0]))
    return line, re.search(r"body=%([\w.\-]+)", line).group(1)


def loop_state(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every buffer the decode loop carries from one step to the next."""
    line, _ = decode_loop(hlo)
    tuple_type = line.split(" while(")[0].split(" = ", 1)[1]
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in re.findall(r"(\w+)\[([0-9,]*)\]", tuple_type)]


def reachable(comps: dict[str, list[str]], root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _CALLS.findall(line)
    return seen


def _updates_in_place(comps, line: str) -> bool:
    """A fusion whose root is a dynamic-update-slice or a scatter (a batch of sequences
    each writing its own slots) of one of its parameters: XLA writes only the update into
    the operand's buffer. (A root that converts or bitcasts the updated buffer makes the
    fusion rewrite the whole buffer.)"""
    called = _CALLS.search(line)
    if not called:
        return False
    lines = comps.get(called.group(1), [])
    root = next((x for x in lines if x.strip().startswith("ROOT ")), "")
    m = re.search(r"(?:dynamic-update-slice|scatter)\(%([\w.\-]+)", root)
    return bool(m) and any(re.match(r"\s*%" + re.escape(m.group(1)) + r" = .* parameter\(", x)
                           for x in lines)


def body_results(hlo: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(instruction, dtype, shape, opcode) of every instruction in the decode loop's body
    (nested computations included); opcode "update-in-place" for a fusion that only
    writes into one of its operands (see `_updates_in_place`)."""
    comps = computations(hlo)
    _, body = decode_loop(hlo)
    out = []
    for name in reachable(comps, body):
        for line in comps[name]:
            m = _RESULT.match(line)
            if m:
                dims = tuple(int(d) for d in m.group(3).split(",") if d)
                opcode = m.group(4)
                if opcode == "fusion" and _updates_in_place(comps, line):
                    opcode = "update-in-place"
                out.append((m.group(1), m.group(2), dims, opcode))
    return out


def rebuilt(results, shape: tuple[int, ...]) -> list[str]:
    """Instructions of `results` that make a buffer of `shape` (any dtype) other than by an
    in-place update: a copy, a convert, a transpose or a rewrite of the whole buffer.
    (XLA updates the operand of a dynamic-update-slice or scatter in place: where it could
    not, copy insertion puts an explicit copy in front, which this reports.)"""
    keep = ("parameter", "get-tuple-element", "dynamic-update-slice", "scatter",
            "update-in-place")
    return [f"{name} ({dtype}, {opcode})" for name, dtype, dims, opcode in results
            if dims == shape and opcode not in keep]
