"""Checkpoints named by their Hugging Face hub id (hub.py), offline, from a hub cache
built here out of the tests' fixtures (huggingface_hub's own layout: refs/ and snapshots/
under models--ORG--NAME): `ps.load("ORG/NAME")` and `packed-ss generate --model
ORG/NAME` read the same checkpoint as its local directory and decode the same tokens; a
file missing from the cache, a checkpoint not in it and an unknown revision are one line
each, exit status 2 on the command line."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import packed_ss_jax as ps
from packed_ss_jax import cli

constants = pytest.importorskip("huggingface_hub.constants")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPOS = {"test/nemotron-tiny": FIXTURES / "nemotron_tiny",
         "test/setdlm-tiny": FIXTURES / "setdlm_tiny"}
WIDTH = {"test/nemotron-tiny": ["--block-size", "4"], "test/setdlm-tiny": ["--window", "4"]}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding both fixture checkpoints at COMMIT (branch "main"), and
    huggingface_hub offline on it."""
    cache = tmp_path / "hub"
    for repo, source in REPOS.items():
        folder = cache / ("models--" + repo.replace("/", "--"))
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(COMMIT)
        shutil.copytree(source, folder / "snapshots" / COMMIT,
                        ignore=shutil.ignore_patterns("reference.npz"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("repo", sorted(REPOS))
def test_a_hub_name_loads_its_checkpoint(hub_cache, repo):
    local = ps.load(str(REPOS[repo]))
    for name, revision in ((repo, None), (repo + "@main", None), (repo, COMMIT)):
        model = ps.load(name, revision=revision)
        assert model.source == str(hub_cache / ("models--" + repo.replace("/", "--"))
                                   / "snapshots" / COMMIT)
        assert model.config == local.config
        width = {"block_size": 4} if "nemotron" in repo else {"window": 4}
        assert ps.decode(model, [1, 5, 7, 9], schedule="packed", max_new_tokens=8,
                         **width).tokens == \
            ps.decode(local, [1, 5, 7, 9], schedule="packed", max_new_tokens=8, **width).tokens


def _generate(model: str, capsys, *width) -> tuple[int, str, str]:
    code = cli.main(["generate", "--model", model, "--ids", "1,5,7,9", "--schedule", "packed",
                     *width, "--max-new-tokens", "8"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_offline_gives_the_local_directory_s_tokens(hub_cache):
    """As a user runs it: a new process, HF_HUB_OFFLINE=1 and HF_HUB_CACHE in its
    environment."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache),
               PYTHONPATH=str(ROOT))

    def generate(model: str) -> str:
        out = subprocess.run([sys.executable, "-m", "packed_ss_jax", "generate", "--model",
                              model, "--ids", "1,5,7,9", "--schedule", "packed",
                              "--block-size", "4", "--max-new-tokens", "8"], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("| schedule")[0]   # the tokens, not the timings

    assert generate("test/nemotron-tiny") == generate(str(REPOS["test/nemotron-tiny"]))


def test_a_missing_shard_offline_is_one_line(hub_cache, capsys):
    snapshot = hub_cache / "models--test--nemotron-tiny" / "snapshots" / COMMIT
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    code, _, err = _generate("test/nemotron-tiny", capsys, *WIDTH["test/nemotron-tiny"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model-00002-of-00002.safetensors missing" in err
    assert "HF_HUB_OFFLINE" in err and "hf download test/nemotron-tiny" in err


def test_missing_weights_and_config_are_named(hub_cache):
    snapshot = hub_cache / "models--test--setdlm-tiny" / "snapshots" / COMMIT
    (snapshot / "pytorch_model.bin").unlink()
    (snapshot / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json, model.safetensors or "
                                                "pytorch_model.bin missing"):
        ps.load("test/setdlm-tiny")


@pytest.mark.parametrize("name, words", [
    ("test/absent", "not in the hub cache"),
    ("test/nemotron-tiny@v9", "not in the hub cache"),
])
def test_what_the_cache_lacks_is_one_line(hub_cache, capsys, name, words):
    code, _, err = _generate(name, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert words in err and "HF_HUB_OFFLINE" in err, err


def test_a_revision_needs_a_hub_name():
    with pytest.raises(ps.ConfigError, match="revision 'main' applies to a Hugging Face hub"):
        ps.load("nld-tiny", revision="main")


def test_a_local_directory_wins_over_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    shutil.copytree(FIXTURES / "nemotron_tiny", tmp_path / "org" / "model")
    monkeypatch.chdir(tmp_path)
    assert ps.load("org/model").source == "org/model"


def test_convert_takes_a_hub_name(hub_cache, tmp_path):
    out = ps.convert("test/setdlm-tiny", tmp_path / "converted", dtype="float32",
                     progress=False)
    local = ps.load(str(REPOS["test/setdlm-tiny"]))
    assert ps.decode(ps.load(str(out)), [1, 5, 7, 9], schedule="packed", window=4,
                     max_new_tokens=8).tokens == \
        ps.decode(local, [1, 5, 7, 9], schedule="packed", window=4, max_new_tokens=8).tokens
