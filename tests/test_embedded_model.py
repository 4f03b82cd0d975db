"""The model shipped inside the package: loads with no argument, every schedule reproduces
AR greedy on it, and `packed-ss generate` runs it by default."""

import json

import pytest

import packed_ss_jax as ps
from packed_ss_jax import cli
from packed_ss_jax.loading import EMBEDDED
from packed_ss_jax.training import corpus

MAX_NEW = 20


@pytest.fixture(scope="module")
def embedded():
    return ps.load()


def test_embedded_checkpoint_layout(embedded):
    files = {p.name for p in EMBEDDED.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert sum(p.stat().st_size for p in EMBEDDED.iterdir()) <= 25 * 2 ** 20
    cfg = json.loads((EMBEDDED / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_labs_diffusion"
    c = embedded.config
    assert c.family == "nemotron" and not c.tie_embeddings and c.dtype == "float32"
    assert embedded.tokenizer is not None
    assert embedded.tokenizer.token_to_id("<|mask|>") == c.mask_token_id


def _prompts():
    return ([p.prompt for p in corpus.arithmetic_test(2)]
            + corpus.code_prompts(1) + corpus.prose_prompts(1))


def test_all_schedules_return_ar_greedy_tokens(embedded):
    B = embedded.config.block_size
    for prompt in _prompts():
        ref = ps.decode(embedded, prompt, schedule="ar", max_new_tokens=MAX_NEW, eos_id=None)
        assert len(ref.tokens) == MAX_NEW
        for s in ("linear", "quadratic", "packed"):
            r = ps.decode(embedded, prompt, schedule=s, block_size=B, max_new_tokens=MAX_NEW,
                          eos_id=None)
            assert r.tokens == ref.tokens, (s, prompt)
            assert r.text == ref.text


def test_packed_drafts_are_accepted(embedded):
    """The diffusion mode is trained: Packed-SS emits more than one token per call."""
    prompt = corpus.arithmetic_test(3)[2].prompt
    r = ps.decode(embedded, prompt, schedule="packed", max_new_tokens=48)
    assert r.tokens_per_nfe > 1.3, r.accept_hist


def test_cli_generate_defaults_to_the_embedded_model(capsys):
    prompt = corpus.arithmetic_test(1)[0].prompt
    assert cli.main(["generate", prompt, "--max-new-tokens", str(MAX_NEW)]) == 0
    out = capsys.readouterr().out
    assert "| schedule | tokens | NFE | tokens/NFE | wall (ms) | tokens/s |" in out
    assert "| packed (B=" in out


@pytest.mark.parametrize("prompt", ["", "   "])
def test_cli_empty_prompt_is_a_clear_error(prompt, capsys):
    assert cli.main(["generate", prompt]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_cli_missing_model_path_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert cli.main(["generate", "hello", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such directory" in err


def test_problems_fit_the_training_window_and_the_output_cap(embedded):
    """With the shipped tokenizer, a whole problem (BOS ... EOS) fits one training window,
    so the answer line is always trained, and every solution fits the evaluation cap."""
    import itertools

    from packed_ss_jax.bench import tasks
    from packed_ss_jax.training.evaluate import MAX_NEW_ARITH
    from packed_ss_jax.training.train import TrainConfig

    tok = embedded.tokenizer
    cap = tasks.arithmetic(1)[0].max_new_tokens
    assert cap == MAX_NEW_ARITH
    probs = list(itertools.islice(corpus.arithmetic("train"), 3000)) + corpus.arithmetic_test(200)
    for p in probs:
        assert len(tok.encode(p.text).ids) + 1 <= TrainConfig().seq_len, p.text
        answer = tok.encode(p.text).ids[len(tok.encode(p.prompt).ids):]
        assert len(answer) + 1 <= cap, p.text
