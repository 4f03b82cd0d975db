"""One decode over two processes (2 x 2 simulated CPU devices, gloo collectives, a
data=1 x model=4 mesh, so the tensor-parallel axis spans the processes): each process
runs `packed-ss generate` with its own --process-id, reads only the slices of the
weights its own devices hold, and gets the tokens one process gets. Bounded in time;
both processes are killed at the end whatever happens."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import packed_ss_jax as ps

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
IDS = [5, 9, 14, 3, 7]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The progress line each process prints once its weights are read (checkpoints.assemble).
READ = re.compile(r"this process read the slices its devices hold: (\d+) of (\d+) bytes")


def test_two_processes_read_their_own_slices_and_give_one_process_tokens(nemotron_dir):
    want = ps.decode(ps.load(nemotron_dir), IDS, schedule="packed", max_new_tokens=12,
                     eos_id=None).tokens
    port = _free_port()
    devices = "--xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {devices}",
               JAX_PLATFORMS="cpu", PACKED_SS_COMPILE_CACHE="off", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "packed_ss_jax", "generate", "--model", str(nemotron_dir),
            "--ids", ",".join(map(str, IDS)), "--schedule", "packed", "--max-new-tokens", "12",
            "--no-eos", "--mesh", "data=1,model=4", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2"]
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(argv + ["--process-id", str(i)], env=env, cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        deadline = time.monotonic() + TIMEOUT_S
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        # gloo announces itself on stdout; the tokens are generate's first line of ids
        line = next(x for x in out.splitlines() if x.split() and all(
            t.isdigit() for t in x.split()))
        assert [int(t) for t in line.split()] == want
    # Weights and adapter: each process read its two of the four slices of every split
    # tensor and the whole of the replicated ones (norms, the 2 KV heads), never all.
    reads = [[tuple(map(int, m)) for m in READ.findall(err)] for _, err in outs]
    for r in reads:
        assert len(r) == 2, outs
        read, whole = map(sum, zip(*r))
        assert whole // 2 <= read < whole, r
    assert reads[0] == reads[1]


def test_bench_joins_the_processes_before_anything_starts_jax(monkeypatch):
    """`bench --coordinator ...` records the devices in its provenance, which starts JAX,
    and `jax.distributed.initialize` must come before that (it raised otherwise)."""
    from packed_ss_jax.bench import harness, provenance

    order = []

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        order.append("record")
        raise Stop

    monkeypatch.setattr(harness, "distributed", lambda args: order.append("join"))
    monkeypatch.setattr(provenance, "record", record)
    argv = ["--limit", "2", "--schedules", "ar", "--coordinator", "127.0.0.1:1",
            "--num-processes", "2", "--process-id", "0"]
    try:
        harness.main(argv)
    except Stop:
        pass
    assert order == ["join", "record"]
