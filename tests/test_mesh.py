"""Decoding on a device mesh gives the tokens of one device (8 simulated CPU devices).

JAX fixes its device count when it starts, so each checkpoint is decoded in its own
short child process (tests/mesh_child.py) with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the rest of the suite keeps one
device. The child is killed if it outlives its time.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 900


def _child(checkpoint: str) -> dict:
    devices = "--xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {devices}",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]),
               PACKED_SS_COMPILE_CACHE="off", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, str(HERE / "mesh_child.py"), checkpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=HERE.parent)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _check(r: dict, kv_replicated_at: set) -> None:
    assert r["devices"] == 8
    # Loaded on each mesh, slice by slice: the params of one device, bit for bit.
    assert set(r["params_differ"]) == {n for n in r["meshes"] if "_" not in n}
    assert not any(r["params_differ"].values()), r["params_differ"]
    for name, tokens in r["meshes"].items():
        if name.endswith("_sampled"):
            assert tokens == r["one_sampled"], name
        elif name.endswith("_single"):
            assert tokens == r["one"][3], name
        else:
            assert tokens == r["one"], name
    for name, s in r["sharded"].items():
        model = int(name.split("x")[1])
        # The weight is split over the model axis: no device holds all of it.
        assert s["compiled_shard"] == [s["full"][0], s["full"][1] // model], (name, s)
        assert s["device_shards"] == [[s["full"][0], s["full"][1] // model]], (name, s)
        want = [None, None] if name in kv_replicated_at else [None, "model"]
        assert s["kv_spec"] == want, (name, s)


def test_meshes_give_one_devices_tokens_on_the_fixture(nemotron_dir):
    # 2 KV heads: a model axis of 4 replicates them (query heads stay split).
    _check(_child(str(nemotron_dir)), kv_replicated_at={"2x4"})


def test_meshes_give_one_devices_tokens_on_the_embedded_model():
    _check(_child("embedded"), kv_replicated_at=set())


def test_mesh_flags_are_checked_before_loading(capsys):
    from packed_ss_jax import cli, sharding

    assert sharding.parse("model=4") == {"data": 1, "model": 4}
    for spec, message in [("data=3,model=5", "needs 15 devices"),
                          ("data=2,pipe=2", "not AXIS=SIZE"), ("model=0", "not AXIS=SIZE"),
                          ("model=2,model=2", "twice")]:
        assert cli.main(["generate", "--ids", "1,2", "--mesh", spec]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["generate", "--ids", "1,2", "--coordinator", "localhost:1234"]) == 2
    assert "go together" in capsys.readouterr().err
    assert cli.main(["bench", "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
