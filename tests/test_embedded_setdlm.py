"""The SetDLM model shipped inside the package (`embedded/setdlm-tiny`): it is in the
release layout and loads through the real SetDLM reader; on held-out prompts every LTR
speculative schedule returns the serial greedy tokens, and its drafts are accepted (Packed-SS makes
more than 1.5 tokens per NFE at W = 8)."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import packed_ss_jax as ps
from packed_ss_jax.setdlm import checkpoint as setdlm_ckpt
from packed_ss_jax.api import decode
from packed_ss_jax.training import corpus

SETDLM_TINY = Path(ps.__file__).resolve().parent / "embedded" / "setdlm-tiny"
W = 8
MAX_NEW = 32
CACHE = 128  # prompt (< 64 tokens) + MAX_NEW


@pytest.fixture(scope="module")
def model():
    m = ps.load("setdlm-tiny")  # embedded models load by name
    assert m.source == str(SETDLM_TINY)
    return m


def test_release_layout(model):
    files = {p.name for p in SETDLM_TINY.iterdir()}
    assert files == {"config.json", "model.safetensors", "tokenizer.json", "training.json",
                     "tokenizer_config.json", "chat_template.jinja", "README.md"}  # + model card
    assert sum(p.stat().st_size for p in SETDLM_TINY.iterdir()) <= 20 * 2 ** 20
    cfg = json.loads((SETDLM_TINY / "config.json").read_text())
    assert cfg["model_type"] == "bd3lm" and cfg["architectures"] == ["SetDLM"]
    assert cfg["qwen3_config"]["model_type"] == "qwen3"
    assert cfg["noise_config"]["desired_block_size"] == W
    c = model.config
    assert c.family == "setdlm" and c.qk_norm and c.tie_embeddings and c.dtype == "float32"
    assert c.block_size == W and c.num_layers == cfg["backbone_config"]["num_layers"]
    assert model.tokenizer.token_to_id("<|mask|>") == c.mask_token_id == cfg["mask_token_id"]
    with safe_open(str(SETDLM_TINY / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert all(n.startswith(setdlm_ckpt.PREFIX) for n in names)
    assert setdlm_ckpt.PREFIX + "model.layers.0.self_attn.q_norm.weight" in names


def test_ltr_schedules_return_serial_greedy_and_drafts_are_accepted(model):
    tokens = nfe = 0
    for p in corpus.arithmetic_test(3)[1:]:
        ref = decode(model, p.prompt, schedule="serial", max_new_tokens=MAX_NEW, eos_id=None,
                     cache_size=CACHE)
        assert len(ref.tokens) == MAX_NEW and ref.nfe == MAX_NEW + 1
        for schedule in ("linear", "quadratic", "packed"):  # native is not exact (App. E.6)
            r = decode(model, p.prompt, schedule=schedule, window=W, max_new_tokens=MAX_NEW,
                       eos_id=None, cache_size=CACHE)
            assert r.tokens == ref.tokens, (schedule, p.prompt)
            if schedule == "packed":
                tokens, nfe = tokens + len(r.tokens), nfe + r.nfe
    assert tokens / nfe > 1.5, (tokens, nfe)
