"""One engine for both families: every (family, schedule) of the family table through the
CLI, the bench on a SetDLM checkpoint, the pytree model, and the jittable decoder."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import cli, families
from packed_ss_jax.bench import harness
from test_setdlm_decode import tiny_setdlm
from tiny import tiny_model

# One checkpoint per family: adding a family to the table without one fails here.
IDS = [1, 5, 7, 9]


@pytest.fixture(scope="module")
def setdlm_split(tmp_path_factory, setdlm_dir):
    """The SetDLM fixture as the release ships it: config.json names its backbone and
    carries no dimensions; the base model's config.json sits elsewhere (--base-config)."""
    root = tmp_path_factory.mktemp("setdlm_release")
    ckpt = root / "setdlm"
    shutil.copytree(setdlm_dir, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (root / "base_config.json").write_text(json.dumps(cfg.pop("qwen3_config")))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt, root / "base_config.json"


@pytest.fixture(scope="module")
def checkpoints(nemotron_dir, setdlm_split):
    ckpt, base = setdlm_split
    table = {"nemotron": (nemotron_dir, []), "setdlm": (ckpt, ["--base-config", str(base)])}
    assert set(table) == set(families.FAMILIES), "every family needs a checkpoint here"
    return table


def _cases():
    return [(f.name, s) for f in families.FAMILIES.values() for s in f.schedules]


@pytest.mark.parametrize("family,schedule", _cases())
def test_every_schedule_runs_from_the_cli(family, schedule, checkpoints, capsys):
    f = families.FAMILIES[family]
    path, extra = checkpoints[family]
    width_flag = "--" + f.width_name.replace("_", "-")
    argv = ["generate", "--model", str(path), *extra, "--ids", ",".join(map(str, IDS)),
            "--schedule", schedule, width_flag, "4", "--max-new-tokens", "10", "--no-eos"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    tokens = [int(t) for t in out[0].split()]
    assert f"| {schedule}" in "\n".join(out)
    # The same request through the Python API: the same tokens; and every exact
    # schedule's tokens are the reference schedule's.
    model = ps.load(path, base_config=extra[1] if extra else None)
    width = {f.width_name: 4}
    assert ps.decode(model, IDS, schedule=schedule, max_new_tokens=10, eos_id=None,
                     **width).tokens == tokens
    if schedule not in f.inexact:
        assert ps.decode(model, IDS, schedule=f.reference, max_new_tokens=10, eos_id=None,
                         **width).tokens == tokens


def _word_tokenizer(path):
    """A word-level tokenizer small enough for the SetDLM fixture's 300-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "question answer how many apples does ann have she buys more gets the a is of" \
            " and , . ? : # 0 1 2 3 4 5 6 7 8 9".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_bench_runs_a_setdlm_checkpoint(tmp_path, setdlm_split, capsys):
    ckpt, base = setdlm_split
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Ann has 3 apples. She buys 4 more. How many apples does Ann have?",
         "answer": "3 + 4 = 7\n#### 7"},
        {"question": "Ann has 2 apples. She gets 5 more. How many apples does Ann have?",
         "answer": "2 + 5 = 7\n#### 7"}]) + "\n")
    out = tmp_path / "r.json"
    rc = harness.main(["--model", str(ckpt), "--base-config", str(base), "--tokenizer",
                       str(_word_tokenizer(tmp_path / "tokenizer.json")), "--task", "gsm8k",
                       "--data", str(data), "--schedules", "serial,native,packed",
                       "--window", "4", "--max-new-tokens", "8", "--resamples", "100",
                       "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["family"] == "setdlm" and r["n_prompts"] == 2
    assert set(r["results"]) == {"serial", "native", "packed"}
    assert r["results"]["serial"]["window"] is None and r["results"]["packed"]["window"] == 4
    for s, m in r["results"].items():
        assert {"tokens", "wall_s", "nfe", "tokens_per_nfe", "time_per_nfe_ms",
                "throughput_tok_s", "model_time_s", "non_model_fraction", "accuracy"} <= set(m)
        assert m["tokens"] == sum(r["per_prompt"][s]["tokens"])
    assert {"packed_vs_serial", "packed_vs_native"} == set(r["paired"])
    table = capsys.readouterr().out
    assert "| schedule | W |" in table and "| packed | 4 |" in table


# --- the pytree model and the jittable decoder -------------------------------------------

MODELS = {"nemotron": lambda: tiny_model(0), "setdlm": lambda: tiny_setdlm(0)}
WIDTH = {"nemotron": {"block_size": 4}, "setdlm": {"window": 3}}
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [3]]
P, MAX_NEW, CACHE = 16, 12, 64


def test_model_is_a_pytree():
    model = tiny_model(0)
    leaves = jax.tree.leaves(model)
    assert len(leaves) == len(jax.tree.leaves(model.params)) and leaves
    doubled = jax.tree.map(lambda x: 2 * x, model)
    assert isinstance(doubled, ps.Model) and doubled.config is model.config
    chex.assert_trees_all_close(doubled.params, jax.tree.map(lambda x: 2 * x, model.params))
    placed = jax.device_put(model, jax.devices()[0])
    assert isinstance(placed, ps.Model)
    # A model passes through jit like any params tree (its config is static structure).
    tokens = jnp.asarray(IDS)
    out = jax.jit(lambda m: m.forward(m.params, tokens, jnp.arange(4), jnp.tril(
        jnp.ones((4, 4), bool)), m.empty_cache(0), 0)[0])(model)
    chex.assert_shape(out, (4, model.vocab_size))


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
def test_params_dict_with_config_decodes_as_the_model(family):
    model = MODELS[family]()
    kw = dict(max_new_tokens=MAX_NEW, cache_size=CACHE, **WIDTH[family])
    assert ps.decode(model.params, PROMPTS[0], config=model.config, **kw).tokens == \
        ps.decode(model, PROMPTS[0], **kw).tokens
    with pytest.raises(TypeError, match="pass the params tree"):
        ps.decode(model, PROMPTS[0], config=model.config, **kw)


@pytest.mark.parametrize("family", ["nemotron", "setdlm"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_vmapped_decoder_equals_decode_per_prompt(family, temperature):
    model = MODELS[family]()
    kw = dict(schedule="packed", max_new_tokens=MAX_NEW, cache_size=CACHE,
              temperature=temperature, eos_id=1, **WIDTH[family])
    fn = ps.decoder(model, **kw)
    ids = np.zeros((len(PROMPTS), P), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    lens = np.array([len(p) for p in PROMPTS], np.int32)
    seeds = [11, 12, 13]
    keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    tokens, n, stats = jax.jit(jax.vmap(fn, in_axes=(None, 0, 0, 0)))(model.params, ids, lens,
                                                                      keys)
    chex.assert_shape(tokens, (len(PROMPTS), MAX_NEW))
    for i, p in enumerate(PROMPTS):
        r = ps.decode(model, p, seed=seeds[i], **kw)
        assert tokens[i, : n[i]].tolist() == r.tokens
        assert (int(stats["nfe"][i]), int(stats["iterations"][i])) == (r.nfe, r.iterations)
        assert int(stats["nonfinite_at"][i]) == -1


def test_decoder_compiles_once_per_shape():
    """chex counts the traces: new prompts, lengths and keys of the same shapes reuse the
    compiled decoder; a new prompt length (shape) is a new trace."""
    model = tiny_model(0)
    fn = chex.assert_max_traces(ps.decoder(model, block_size=4, max_new_tokens=6,
                                           cache_size=CACHE), n=1)
    run = jax.jit(fn)
    key = jax.random.PRNGKey(0)
    for prompt, n in (([1, 2, 3, 0], 3), ([4, 5, 6, 7], 4), ([8, 0, 0, 0], 1)):
        run(model.params, jnp.asarray(prompt), jnp.int32(n), key)
    with pytest.raises(AssertionError, match="traced"):
        run(model.params, jnp.zeros(5, jnp.int32), jnp.int32(2), key)


def test_decoder_checks_its_inputs():
    model = tiny_model(0)
    fn = ps.decoder(model, block_size=4, max_new_tokens=60, cache_size=CACHE)
    with pytest.raises(AssertionError):  # chex: prompt_ids must be one sequence
        fn(model.params, jnp.zeros((2, 3), jnp.int32), 3, None)
    with pytest.raises(ValueError, match="exceed the cache"):
        fn(model.params, jnp.zeros(8, jnp.int32), 3, None)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        ps.decoder(model, block_size=4, temperature=1.0, max_new_tokens=6, cache_size=CACHE)(
            model.params, jnp.zeros(4, jnp.int32), 2, None)
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        ps.decoder(model.config, block_size=1)
    # Its key is its argument: a seed in the options would be ignored, so it is refused.
    with pytest.raises(ps.InputError, match="takes its PRNG key when called") as e:
        ps.decoder(model, options=ps.DecodeOptions(width=4, seed=5))
    assert e.value.param == "seed"
    ps.decoder(model, options=ps.DecodeOptions(width=4, seed=0))
