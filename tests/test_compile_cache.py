"""The persistent compilation cache: a second process loads a decode program it compiled
before instead of compiling it again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import packed_ss_jax

# What the cache saves is XLA's compile (minutes at real size; tracing and lowering are
# paid by every process): the child reports JAX's own cache events and compile timings,
# and the checks count hits and misses, not seconds.
CHILD = """
import json, jax, packed_ss_jax as ps
from packed_ss_jax import compile_cache
events = {}
def count(name, **kw):
    events[name] = events.get(name, 0) + 1
def add(name, secs, **kw):
    events[name] = events.get(name, 0.0) + secs
jax.monitoring.register_event_listener(count)
jax.monitoring.register_event_duration_secs_listener(add)
model = ps.load()
events.clear()
r = ps.decode(model, "Question: Ava has 12 apples. How many apples does Ava have?",
              schedule="packed", block_size=8, max_new_tokens=8)
print(json.dumps({"compile_s": r.compile_s, "tokens": r.tokens,
                  "hits": events.get("/jax/compilation_cache/cache_hits", 0),
                  "misses": events.get("/jax/compilation_cache/cache_misses", 0),
                  "xla_s": events.get("/jax/core/compile/backend_compile_duration", 0.0),
                  "dir": str(compile_cache.ensure())}))
"""


def _run(env_value, tmp_path, child: str = CHILD, **env):
    """`child` run by a new Python process on this checkout's package, with the cache
    `env_value` and `env`; the JSON its last line prints."""
    root = str(Path(packed_ss_jax.__file__).resolve().parents[1])  # this checkout's package
    env = dict(os.environ, PACKED_SS_COMPILE_CACHE=env_value, **env,
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reuses_compiled_programs(tmp_path):
    cache = tmp_path / "xla"
    first = _run(str(cache), tmp_path)
    assert first["dir"] == str(cache) and any(cache.iterdir()), "nothing was cached"
    second = _run(str(cache), tmp_path)
    assert second["tokens"] == first["tokens"]
    assert first["misses"] >= 1 and first["hits"] == 0, first  # compiled, then written
    assert second["misses"] == 0 and second["hits"] == first["misses"], (first, second)
    print(f"compile: first process {first['compile_s']:.2f}s (XLA {first['xla_s']:.2f}s), "
          f"second {second['compile_s']:.2f}s (XLA {second['xla_s']:.2f}s)")


def test_off_means_no_cache(tmp_path, no_compile_cache):
    import packed_ss_jax as ps
    from packed_ss_jax import compile_cache

    try:
        assert ps.set_compile_cache(None) is None
        target = tmp_path / "moved"
        assert ps.set_compile_cache(target) == target and target.is_dir()
        assert oct(target.stat().st_mode & 0o777) == oct(0o700)  # trusted code: private
    finally:
        compile_cache.set_compile_cache(None)
