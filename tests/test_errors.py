"""Bad input gets a clear error naming the problem."""

import shutil

import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.config import ConfigError
from checkpoint_copies import copy_checkpoint as _copy_checkpoint
from tiny import tiny_model

MODEL = tiny_model(0)


@pytest.mark.parametrize("prompt,match", [
    ([], "prompt is empty"),
    ([1, 2, 12], r"outside the vocabulary \[0, 12\): \[12\]"),
    ([-1, 2], r"outside the vocabulary .*\[-1\]"),
    ("hello", "no tokenizer"),
    ([1.5, 2], "integer token ids"),
])
def test_bad_prompts(prompt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ps.decode(MODEL, prompt, max_new_tokens=4)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=1), "block_size must be an integer >= 2"),
    (dict(block_size=0), "block_size must be an integer >= 2"),
    (dict(block_size=2.5), "block_size must be an integer >= 2"),
    (dict(schedule="cubic"), "unknown schedule 'cubic'"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(eos_id=99), "eos_id 99 is outside the vocabulary"),
    (dict(max_new_tokens=300), r"exceeds the cache \(256 positions\)"),
    (dict(max_new_tokens=30, cache_size=32), r"3 tokens\) \+ max_new_tokens \(30\) = 33 exceeds"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.decode(MODEL, [1, 2, 3], **kwargs)


def test_prompt_filling_the_cache_exactly_is_fine():
    r = ps.decode(MODEL, [1, 2, 3], schedule="packed", block_size=4, max_new_tokens=29,
                  eos_id=None, cache_size=32)
    assert len(r.tokens) == 29


def test_logits_shape_errors():
    with pytest.raises(ValueError, match="mask"):
        ps.logits(MODEL, [1, 2], [0, 1], np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ps.logits(MODEL, [1, 50], [0, 1], np.ones((2, 2), bool))


def test_missing_misshaped_unexpected_tensors(nemotron_dir, tmp_path):
    def edit(w):
        del w["encoder.layers.1.mlp.up_proj.weight"]
        w["encoder.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
        w["encoder.extra.weight"] = np.zeros(3, np.float32)

    bad = _copy_checkpoint(nemotron_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        ps.load(bad)
    msg = str(e.value)
    assert "missing (1): encoder.layers.1.mlp.up_proj.weight [160, 64]" in msg
    assert "encoder.layers.0.self_attn.k_proj.weight: expected [64, 64], found [8, 64]" in msg
    assert "unexpected (1): encoder.extra.weight" in msg


def test_failed_conversion_leaves_no_output(nemotron_dir, tmp_path):
    bad = _copy_checkpoint(nemotron_dir, tmp_path / "bad",
                           lambda w: w.pop("diffusion_head.weight"))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="diffusion_head.weight"):
        ps.convert(bad, out, progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no partial directory either


def test_single_file_checkpoint_loads(nemotron_dir, tmp_path, nemotron_ref):
    good = _copy_checkpoint(nemotron_dir, tmp_path / "single")
    m = ps.load(good)
    T = len(nemotron_ref["ar_tokens"])
    got = ps.logits(m, nemotron_ref["ar_tokens"], np.arange(T), np.tril(np.ones((T, T), bool)))
    assert np.abs(got - nemotron_ref["ar_logits"]).max() < 1e-4


@pytest.mark.parametrize("model_type", ["llama", None])
def test_config_of_another_family(nemotron_dir, tmp_path, model_type):
    def config_edit(cfg):
        cfg["model_type"] = model_type

    other = _copy_checkpoint(nemotron_dir, tmp_path / "other", config_edit=config_edit)
    with pytest.raises(ConfigError, match=f"unsupported model_type {model_type!r}"):
        ps.load(other)


def test_bd3lm_config_that_is_not_setdlm(nemotron_dir, tmp_path):
    other = _copy_checkpoint(nemotron_dir, tmp_path / "other",
                             config_edit=lambda cfg: cfg.update(model_type="bd3lm"))
    with pytest.raises(ConfigError, match="is not SetDLM"):
        ps.load(other)


def test_config_missing_fields(nemotron_dir, tmp_path):
    broken = _copy_checkpoint(nemotron_dir, tmp_path / "broken",
                              config_edit=lambda cfg: cfg.pop("num_hidden_layers"))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ps.load(broken)


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ps.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ps.load(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        ps.load(tmp_path, dtype="float16")


def test_lora_required_but_absent(nemotron_dir, tmp_path):
    plain = _copy_checkpoint(nemotron_dir, tmp_path / "plain")
    with pytest.raises(CheckpointError, match="no linear_spec_lora"):
        ps.load(plain, lora=True)


def test_corrupt_safetensors(nemotron_dir, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(nemotron_dir, bad)
    shard = bad / "model-00002-of-00002.safetensors"
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        ps.load(bad)
