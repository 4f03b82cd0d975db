"""Whether a decode's state fits in memory, decided before anything is allocated.

A request's KV cache and row buffers are sized from its arguments (sequences x cache_size,
the schedule's rows per call); past the free memory the allocation would fail deep
inside XLA, or on a host swap for minutes. `check` estimates them (`state_bytes`) and
refuses the request with the figures: on accelerators against their allocator's limit
less what is in use, on the CPU against the host's available memory.
"""

from __future__ import annotations

import os

import jax

from .validate import InputError


def state_bytes(config, program, max_new: int) -> tuple[int, int]:
    """What one sequence's decode state needs at least, in bytes: its KV cache, and the
    rest (one call's rows: their hidden states, attention mask and the verified rows'
    logits; the output and, for SetDLM, the per-iteration traces). The largest calls are
    Quadratic-SS's, about (width + 1)^2 rows, and Branched-SS's, at most (branches + 2) x
    width + 1; the others' are about 3 x width."""
    c = config
    item = 2 if c.dtype == "bfloat16" else 4
    W, positions = program.width, program.capacity + program.width  # one block of headroom
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * positions * item
    rows = {"quadratic": (W + 1) ** 2,
            "branched": (program.branches + 2) * W + 1}.get(program.schedule, 3 * W + 2)
    call = rows * (4 * c.hidden_size + positions + rows) + 4 * (W + 1) * c.vocab_size
    out = 4 * positions + (4 * (max_new + 1) * (W + 2) if program.family == "setdlm" else 0)
    return kv, call + out


def _devices(params) -> list:
    arrays = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
    if not arrays:  # no weights yet (a config-only model): where they would go
        return jax.local_devices()[:1]
    return list({d for x in arrays for d in x.sharding.device_set})


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def free_memory(model) -> tuple[int, str] | None:
    """(bytes free for a decode's state, where): on the accelerators holding the weights,
    their allocator's limit less what is in use; on the CPU, the host's available
    memory. None when unknown (weights on devices of other processes, no allocator
    figures)."""
    devices = _devices(model.params)
    if any(d.process_index != jax.process_index() for d in devices):
        return None
    if all(d.platform == "cpu" for d in devices):
        host = _host_available()
        return None if host is None else (host, "of available host memory")
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in st for st in stats):
        return None
    free = sum(st["bytes_limit"] - st.get("bytes_in_use", 0) for st in stats)
    return free, f"free on the {len(devices)} {devices[0].platform} device(s) of the weights"


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check(model, program, max_new: int, sequences: int = 1,
                 hint: str = "a smaller cache_size") -> None:
    """Refuses a decode whose state (`sequences` sequences at once) cannot fit in the free
    memory, before anything is allocated: the allocation would fail deep inside XLA, or
    on the host swap for minutes."""
    kv, rest = state_bytes(model.config, program, max_new)
    need = sequences * (kv + rest)
    free = free_memory(model)
    if free is None or need <= free[0]:
        return
    raise InputError(f"the decode state needs at least {_size(need)} ({sequences} sequence(s) x "
                     f"({_size(kv)} of KV cache for {program.capacity} positions + {_size(rest)} "
                     f"of rows and outputs)), more than the {_size(free[0])} {free[1]}; use "
                     f"{hint}")
