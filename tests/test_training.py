"""The training objective on a tiny config: both losses fall, and an exported checkpoint
reloads (through `packed_ss_jax.load`, the real-checkpoint path) to identical logits."""

import itertools
import json
import re

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import model as model_lib
from packed_ss_jax.nemotron import checkpoint as nemotron
from packed_ss_jax.training import corpus, export, objective
from packed_ss_jax.training import train as train_lib
from packed_ss_jax.training.tokenizer import BOS, EOS, MASK, PAD, special_ids, train_tokenizer


def _tiny_setup(n_problems=400, vocab=300):
    texts = [p.text for p in itertools.islice(corpus.arithmetic("train"), n_problems)]
    tok = train_tokenizer(texts, vocab)
    ids = special_ids(tok)
    c = train_lib.model_config(tok.get_vocab_size(), ids, hidden=64, layers=2, heads=4,
                               kv_heads=2, head_dim=16, intermediate=128, block_size=4,
                               max_pos=256)
    stream = np.concatenate([np.asarray(e.ids + [ids["eos"]], np.int32)
                             for e in tok.encode_batch(texts)])
    return tok, c, stream


def test_tokenizer_specials_and_roundtrip():
    tok, c, _ = _tiny_setup(200, 300)
    ids = special_ids(tok)
    assert [tok.id_to_token(ids[k]) for k in ("bos", "eos", "mask", "pad")] == [BOS, EOS, MASK, PAD]
    assert c.mask_token_id == ids["mask"]
    text = "Question: Ava has 12 apples.\nAnswer: 12 + 7 = 19\n#### 19"
    enc = tok.encode(text)
    assert enc.ids[0] == ids["bos"]                     # BOS prepended, as Nemotron's does
    assert tok.decode(enc.ids) == text                  # byte-level: lossless
    assert "1" in enc.tokens and "9" in enc.tokens      # digits are single tokens


def test_block_diffusion_mask_and_noise():
    rng = np.random.default_rng(0)
    L = 32
    clean = rng.integers(10, 50, (3, L)).astype(np.int32)
    tokens, mask, w = objective.noise_batch(rng, clean, mask_id=2)
    assert tokens.shape == (3, 2 * L) and mask.shape == (3, 2 * L, 2 * L)
    np.testing.assert_array_equal(tokens[:, L:], clean)
    for n in range(3):
        m = mask[n]
        assert not m[L:, :L].any()                                    # clean never sees noised
        np.testing.assert_array_equal(m[L:, L:], np.tril(np.ones((L, L), bool)))  # causal
        nn, nc = m[:L, :L], m[:L, L:]
        np.testing.assert_array_equal(nn, nn.T)                       # bidirectional blocks
        for p in range(L):
            start = int(np.argmax(nn[p]))                             # first row of p's block
            np.testing.assert_array_equal(nc[p], np.arange(L) < start)  # earlier clean only
        masked = tokens[n, :L] == 2
        np.testing.assert_array_equal(masked, w[n] > 0)
        assert (w[n][masked] >= 1).all()


def test_losses_fall_and_export_reloads_identically(tmp_path):
    tok, c, stream = _tiny_setup()
    tc = train_lib.TrainConfig(steps=30, batch=8, seq_len=48, lr=3e-3, warmup=5)
    params = model_lib.init_params(c, jax.random.PRNGKey(0))
    tx = train_lib.optimizer(tc)
    opt_state = tx.init(params)
    step = train_lib.make_step(c, tx, (1.0, 0.3))
    rng = np.random.default_rng(0)
    hist = []
    for _ in range(tc.steps):
        starts = rng.integers(0, len(stream) - tc.seq_len, tc.batch)
        clean = np.stack([stream[s:s + tc.seq_len] for s in starts])
        batch = objective.noise_batch(rng, clean, c.mask_token_id)
        params, opt_state, loss, (ar, diff) = step(params, opt_state, *batch)
        hist.append((float(ar), float(diff)))
    hist = np.asarray(hist)
    first, last = hist[:5].mean(0), hist[-5:].mean(0)
    assert last[0] < 0.8 * first[0], f"AR loss did not fall: {first[0]:.3f} -> {last[0]:.3f}"
    assert last[1] < 0.8 * first[1], f"diffusion loss did not fall: {first[1]:.3f} -> {last[1]:.3f}"

    out = export.export(tmp_path / "ckpt", c, params, tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_labs_diffusion"
    assert cfg["mask_token_id"] == c.mask_token_id and cfg["tie_word_embeddings"] is False
    names = set(export.tensors(c, params))
    assert names == {n for e in nemotron.table(c)
                     for n in ([e.name.format(i=i) for i in range(c.num_layers)] if e.layer
                               else [e.name])}
    assert "diffusion_head.weight" in names

    loaded = ps.load(out)
    assert loaded.config == c
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("7 + 5").ids == tok.encode("7 + 5").ids
    T = 12
    tokens = np.asarray(tok.encode("Question: Ava has 7 apples.").ids[:T - 3] + [c.mask_token_id] * 3)
    T = len(tokens)
    positions = np.arange(T)
    mask = np.tril(np.ones((T, T), bool))
    mask[T - 4:, T - 4:] = True                           # a draft block [x, MASK^3]
    mine = ps.logits(ps.Model(config=c, params=params), tokens, positions, mask)
    theirs = ps.logits(loaded, tokens, positions, mask)
    np.testing.assert_array_equal(mine, theirs)


def test_recall_sheets_repeat_each_list_exactly():
    sheets = list(itertools.islice(corpus.recall(seed=3), 50))
    assert sheets == list(itertools.islice(corpus.recall(seed=3), 50))   # seeded
    for sheet in sheets:
        lines = sheet.split("\n")
        assert len(lines) == 8
        for first, again in zip(lines[::2], lines[1::2]):
            assert first.startswith("List: ") and again.startswith("Again: ")
            assert first.removeprefix("List: ") == again.removeprefix("Again: ")
        words = set(" ".join(lines[::2]).replace("List: ", " ").split())
        known = {w for n in corpus.NAMES + corpus.ITEMS + corpus.CONTAINERS for w in n.split()}
        assert words <= known | {str(i) for i in range(100)}
    assert sheets != list(itertools.islice(corpus.recall(seed=4), 50))


def test_problem_solutions_check_out():
    """The templates pass the right operands to the working: every equation in a solution is
    true, and the answer line is the generator's answer."""
    checked = 0
    for p in itertools.islice(corpus.arithmetic("train"), 2000):
        assert corpus.parse_answer(p.solution) == p.answer
        eqs = re.findall(r"(\d+) ([-+*/]) (\d+)(?: \([^)]*\))? = (\d+)", p.solution)
        assert eqs, p.solution
        for a, op, b, c in eqs:
            assert eval(f"{a} {op} {b}") == int(c), p.solution
        checked += len(eqs)
    assert checked > 2000


def test_warm_up_mix_then_main_mix():
    tc = train_lib.TrainConfig(steps=100, warm_fraction=0.25)
    assert [tc.mix_at(i) for i in (1, 25, 26, 100)] == [tc.warm_mix] * 2 + [tc.mix] * 2
    with pytest.raises(ValueError, match="5 non-negative weights"):
        train_lib.TrainConfig(mix=(0.65, 0.25, 0.05, 0.05))



def test_column_working_is_correct_arithmetic():
    """Every step of the written-out sums and differences is a true one-digit fact and the
    tens result followed by the ones digit spells the answer."""

    for a in range(0, 100):
        for b in range(0, 100):
            for text, op, want in ([(corpus.plus(a, b), "+", a + b)] +
                                   ([(corpus.minus(a, b), "-", a - b)] if b <= a else [])):
                head, work, tail = re.fullmatch(r"(.*) \((.*)\) = (\d+)", text).groups()
                assert head == f"{a} {op} {b}" and int(tail) == want
                ones, tens = work.split(",")
                x, y, z = map(int, re.split(r"[-+=]", ones))
                assert (x + y if op == "+" else x - y) == z and 0 <= z < 20
                assert x % 10 == a % 10 and y == b % 10
                t = list(map(int, re.split(r"[-+=]", tens)))
                assert (t[0] + t[1] + t[2] if op == "+" else t[0] - t[1] - t[2]) == t[3]
                carry = z // 10 if op == "+" else x // 10
                assert t[:3] == [a // 10, b // 10, carry]
                assert (10 * t[3] + z % 10) == want
