"""One decode over two processes (2 x 4 simulated CPU devices, gloo collectives, a
data=2 x model=4 mesh): each process runs `packed-ss generate` with its own
--process-id and gets the tokens one process gets. Bounded in time; both processes are
killed at the end whatever happens."""

import os
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


def test_two_processes_give_one_process_tokens(nemotron_dir):
    want = ps.decode(ps.load(nemotron_dir), IDS, schedule="packed", max_new_tokens=12,
                     eos_id=None).tokens
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PACKED_SS_COMPILE_CACHE="off", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "packed_ss_jax", "generate", "--model", str(nemotron_dir),
            "--ids", ",".join(map(str, IDS)), "--schedule", "packed", "--max-new-tokens", "12",
            "--no-eos", "--mesh", "data=2,model=4", "--coordinator", f"127.0.0.1:{port}",
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
