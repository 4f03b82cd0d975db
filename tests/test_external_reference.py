"""Cross-check against the independent external reference set, where it is present.

The tests run on the project's own fixtures (tests/fixtures, written by
tools/fixtures). An external set made by other code from other seeds guards
against the generator and the package sharing a mistake: its checkpoints are loaded with
the package's loaders and every logits array of its `reference.npz` is reproduced
through its whole-forward form (float32, precision "highest", atol 1e-4), and AR greedy
decoding reproduces its continuation.

To stay cheap, each family's layouts are packed into a single forward of one padded
length: the sequences sit side by side with a block-diagonal mask (explicit positions
make them independent), and padding rows see only themselves.
"""

import jax
import numpy as np
import pytest

import packed_ss_jax as ps
from packed_ss_jax import rope
import external_set

SHARED = external_set.shared()
if SHARED is None:
    pytest.skip(external_set.MISSING, allow_module_level=True)
EXTERNAL = SHARED / "fixtures"

ATOL = 1e-4
NEMOTRON_ROWS = 160
SETDLM_ROWS = 80


def causal(n):
    return np.tril(np.ones((n, n), bool))


class Packed:
    """Several independent forwards as one: pieces placed side by side."""

    def __init__(self, T):
        self.tokens = np.zeros(T, np.int32)
        self.positions = np.zeros(T, np.int32)
        self.mask = np.eye(T, dtype=bool)
        self.draft = np.zeros(T, bool)
        self.used = 0

    def add(self, tokens, positions, mask, draft=None) -> np.ndarray:
        """Places one forward; returns its row indices in the packed forward."""
        n = len(tokens)
        rows = np.arange(self.used, self.used + n)
        assert rows[-1] < len(self.tokens), "the packed forward is too short"
        self.tokens[rows], self.positions[rows] = tokens, positions
        self.mask[np.ix_(rows, rows)] = mask
        if draft is not None:
            self.draft[rows] = draft
        self.used += n
        return rows

    def add_full(self, r, name, draft=None):
        return self.add(r[f"{name}_full_tokens"], r[f"{name}_full_positions"],
                        r[f"{name}_full_mask"], draft)[r[f"{name}_rows"]]

    def run(self, model):
        return ps.logits(model, self.tokens, self.positions, self.mask, draft_rows=self.draft)


def check(got, want, what):
    err = float(np.max(np.abs(got - want)))
    assert err < ATOL, f"external {what}: max abs error {err:.3g}"


def logits_arrays(r):
    return {k for k in r if "_logits" in k}


@pytest.fixture(scope="module")
def nemotron_ext():
    d = EXTERNAL / "nemotron_tiny"
    return ps.load(d, lora=True, matmul_precision="highest"), dict(np.load(d / "reference.npz"))


@pytest.fixture(scope="module")
def setdlm_ext():
    d = EXTERNAL / "setdlm_tiny"
    return ps.load(d, matmul_precision="highest"), dict(np.load(d / "reference.npz")), \
        EXTERNAL / "setdlm_tiny_safetensors"


def test_nemotron_logits(nemotron_ext):
    """Every logits array, from two forwards of one shape (adapter off except on the
    `lora_*` rows; the adapter never touches rows that are not draft rows)."""
    model, r = nemotron_ext
    c = model.config
    np.testing.assert_allclose(rope.inv_freq(c), r["rope_inv_freq"], rtol=1e-6)
    assert rope.attention_factor(c) == pytest.approx(float(r["rope_attention_scaling"]))
    np.testing.assert_allclose(rope.query_scale(c, np.arange(len(r["long_tokens"]))),
                               r["long_llama4_q_scale"], rtol=1e-6)

    first = Packed(NEMOTRON_ROWS)
    T = len(r["long_tokens"])
    long_rows = first.add(r["long_tokens"], np.arange(T), causal(T))
    greedy = np.concatenate([r["greedy_prompt"], r["greedy_continuation"]])
    G, n0 = len(greedy), len(r["greedy_prompt"])
    greedy_rows = first.add(greedy, np.arange(G), causal(G))

    second = Packed(NEMOTRON_ROWS)
    rows = {}
    for name in ("ar", "prefix"):
        T = len(r[f"{name}_tokens"])
        rows[name] = second.add(r[f"{name}_tokens"], np.arange(T), causal(T))
    for name in ("block", "packed"):
        rows[name] = second.add_full(r, name)
    P = len(r["prefix_tokens"])
    on_block = np.arange(len(r["block_full_tokens"])) >= P
    rows["lora_block"] = second.add_full(r, "block", draft=on_block)
    rows["lora_all_block"] = second.add_full(r, "block", draft=np.ones_like(on_block))

    got = first.run(model)
    check(got[long_rows], r["long_logits"], "long_logits")
    # Teacher forcing over prompt + continuation: each row's argmax is the next greedy token.
    np.testing.assert_array_equal(got[greedy_rows][n0 - 1:G - 1].argmax(-1),
                                  r["greedy_continuation"])
    got = second.run(model)
    for name, idx in rows.items():
        check(got[idx], r[f"{name}_logits"], f"{name}_logits")
    assert {f"{n}_logits" for n in rows} | {"long_logits"} == logits_arrays(r)


def test_nemotron_greedy_decode(nemotron_ext):
    model, r = nemotron_ext
    want = r["greedy_continuation"].tolist()
    got = ps.decode(model, r["greedy_prompt"].tolist(), schedule="ar", max_new_tokens=len(want),
                    eos_id=None)
    assert got.tokens == want


def test_setdlm_logits(setdlm_ext):
    """Every logits array from one forward; the safetensors copy gives the same weights."""
    model, r, safetensors_dir = setdlm_ext
    other = ps.load(safetensors_dir, matmul_precision="highest")
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(model.params), jax.tree.leaves(other.params), strict=True))

    packed = Packed(SETDLM_ROWS)
    rows = {name: packed.add_full(r, name) for name in ("train", "window", "step", "packed")}
    L, P = len(r["train_tokens"]), len(r["prefix_tokens"])
    train_clean = rows["train"] - L  # the clean stream: rows 0..L-1 of the train forward
    prefix = rows["window"][0] - P + np.arange(P)  # the causal prefix rows of the window forward
    got = packed.run(model)
    for name, idx in rows.items():
        check(got[idx], r[f"{name}_logits"], f"{name}_logits")
    check(got[train_clean], r["train_logits_clean"], "train_logits_clean")
    check(got[prefix], r["prefix_logits"], "prefix_logits")
    assert {f"{n}_logits" for n in rows} | {"train_logits_clean", "prefix_logits"} == \
        logits_arrays(r)
