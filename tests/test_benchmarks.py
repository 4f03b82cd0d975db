"""Benchmark statistics, scorers, task loaders, the time split and a small end-to-end run."""

import json
from pathlib import Path

import numpy as np
import pytest

from packed_ss_jax.bench import harness as bench
from packed_ss_jax.bench import scoring, stats, tasks, timing

DATA = Path(__file__).parent / "data"


def test_bootstrap_exact_ratio():
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 200, size=40)
    wall = rng.uniform(0.5, 2.0, size=40)
    base = {"tokens": tokens, "wall_s": wall, "nfe": tokens}
    faster = {"tokens": tokens, "wall_s": wall / 2, "nfe": tokens // 2 + 1}
    idx = stats.resample_indices(40, 2000)
    p = stats.paired(faster, base, idx)
    assert p["throughput_ratio"] == pytest.approx(2.0)
    assert p["throughput_ratio_ci95"] == pytest.approx([2.0, 2.0])
    assert p["wall_diff_s"] == pytest.approx(-wall.mean() / 2)
    same = stats.paired(base, base, idx)
    assert same["throughput_ratio_ci95"] == pytest.approx([1.0, 1.0])
    assert same["wall_diff_ci95"] == pytest.approx([0.0, 0.0])


def test_bootstrap_noisy_ratio_covers_truth():
    rng = np.random.default_rng(1)
    n = 200
    tokens = rng.integers(50, 200, size=n).astype(float)
    wall_b = tokens / 100 * rng.lognormal(0, 0.3, n)
    wall_a = tokens / 150 * rng.lognormal(0, 0.3, n)  # true throughput ratio 1.5
    idx = stats.resample_indices(n, 5000)
    p = stats.paired({"tokens": tokens, "wall_s": wall_a}, {"tokens": tokens, "wall_s": wall_b}, idx)
    lo, hi = p["throughput_ratio_ci95"]
    assert lo < 1.5 < hi and hi - lo < 0.3
    assert lo > 1.2  # and clearly above 1


def test_resamples_are_shared_and_sized():
    idx = stats.resample_indices(7)
    assert idx.shape == (20_000, 7) and idx.min() >= 0 and idx.max() < 7


@pytest.mark.parametrize("text,ref,ok", [
    ("so she has 72 clips.\n#### 72", "... #### 72", True),
    ("The answer is \\boxed{1,000}.", "1000", True),
    ("she earned $10.00 in total", 10, True),
    ("#### 71", "72", False),
    ("no number here", "3", False),
])
def test_numeric_match(text, ref, ok):
    assert scoring.numeric_match(text, ref) is ok


@pytest.mark.parametrize("text,ref,ok", [
    ("thus \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
    ("\\boxed{\\left( 3, \\dfrac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{5} then \\boxed{6}", "6", True),
    ("\\boxed{\\text{(B)}}", "(B)", True),
    ("\\boxed{5}", "6", False),
    ("the answer is 6", "6", False),
])
def test_boxed_match(text, ref, ok):
    assert scoring.boxed_match(text, ref) is ok


def test_run_tests_pass_fail_timeout():
    assert scoring.run_tests("assert 1 + 1 == 2\n")
    assert not scoring.run_tests("assert 1 + 1 == 3\n")
    assert not scoring.run_tests("while True:\n    pass\n", timeout_s=1.0)


def test_loaders_read_public_formats():
    g = tasks.gsm8k(DATA / "gsm8k.jsonl")
    assert len(g) == 2 and g[0].max_new_tokens == 1024
    assert g[0].score("... so \\boxed{72}") and not g[0].score("\\boxed{71}")
    m = tasks.math500(DATA / "math500.jsonl")
    assert m[0].id == "test/precalculus/807.json"
    assert m[0].score("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}")
    h = tasks.humaneval(DATA / "humaneval.jsonl")
    assert h[0].max_new_tokens == 512
    assert h[0].score("    return a + b\n") and not h[0].score("    return a - b\n")
    b = tasks.mbpp(DATA / "mbpp.jsonl")
    assert "assert set(similar_elements" in b[0].text  # visible tests in the prompt
    assert b[0].score("def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```")
    assert not b[0].score("def similar_elements(a, b):\n    return ()\n")
    w = tasks.writingbench(DATA / "writingbench.jsonl")
    assert len(w) == 1 and w[0].score is None  # English only, speed only


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        tasks.gsm8k(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match=r"lacks \['question', 'answer'\]"):
        tasks.gsm8k(bad)
    with pytest.raises(ValueError, match="pass --data"):
        tasks.load("gsm8k", None, None)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load("nope", None, None)


@pytest.mark.usefixtures("user_codegen")  # reads the compiled HLO
def test_doubled_model_decodes_identically_with_twice_the_forwards():
    import packed_ss_jax as ps

    m = ps.load()
    d = timing.Doubled(m)
    assert d.program_key != m.program_key and d.config is m.config
    prompt = tasks.load("arithmetic", None, 1)[0].text
    for s in ("ar", "linear", "packed", "quadratic"):
        a = ps.decode(m, prompt, schedule=s, block_size=4, max_new_tokens=12, cache_size=128)
        b = ps.decode(d, prompt, schedule=s, block_size=4, max_new_tokens=12, cache_size=128)
        assert (a.tokens, a.nfe, a.iterations) == (b.tokens, b.nfe, b.iterations)
    # twice the matmuls in the compiled step: the HLO of the doubled program has twice the dots
    from packed_ss_jax import Engine

    def ar_program(model):
        return next(exe.as_text() for k, exe in Engine.of(model).executables().items()
                    if k[0] == "decode" and k[1].schedule == "ar" and k[1].capacity == 128)

    assert ar_program(d).count(" dot(") == 2 * ar_program(m).count(" dot(")


def test_null_model_runs_the_same_program_without_the_model():
    """The null decode has the real decode's shapes and steps, but no model work: no dot
    in its program, all drafts accepted, one ordinary token repeated up to the limit."""
    import packed_ss_jax as ps
    from packed_ss_jax import Engine

    m = ps.load()
    n = timing.Null(m)
    assert n.program_key != m.program_key and n.config is m.config
    prompt = tasks.load("arithmetic", None, 1)[0].text
    B, L = 4, 12
    # The first call emits 1 token; then Linear-SS and Quadratic-SS accept whole blocks
    # (4, 4, and 3 to the limit), Packed-SS alternates (its next draft after a whole block
    # is empty, Eq. 4).
    for s, iterations in (("ar", L), ("linear", 4), ("packed", 6), ("quadratic", 4)):
        r = ps.decode(n, prompt, schedule=s, block_size=B, max_new_tokens=L, cache_size=128)
        assert r.tokens == [n._token] * L and n._token not in (m.config.eos_token_id, m.mask_id)
        assert r.iterations == iterations, s
    program = next(exe for k, exe in Engine.of(n).executables().items()
                   if k[0] == "decode" and k[1].schedule == "packed" and k[1].capacity == 128)
    assert " dot(" not in program.as_text()  # no matmul: the forward computes nothing


def test_null_split_scales_by_iterations(monkeypatch):
    import dataclasses

    import packed_ss_jax as ps

    real = ps.decode

    def decode(model, prompt, **kw):  # fixed wall times: real 10 ms, null 1 ms
        r = real(model, prompt, **kw)
        return dataclasses.replace(r, wall_s=0.001 if isinstance(model, timing.Null) else 0.01)

    monkeypatch.setattr(bench.api, "decode", decode)
    prompts = tasks.load("arithmetic", None, 1)
    per = bench.run(ps.load(), prompts, ["packed"], {"packed": 4}, capacity=256,
                    max_new_tokens=12, progress=False)
    null = real(timing.Null(ps.load()), prompts[0].text, schedule="packed", block_size=4,
                max_new_tokens=12, cache_size=256, eos_id=-1)
    it = per["packed"]["iterations"][0]
    assert per["packed"]["model_s"][0] == pytest.approx(0.01 - 0.001 * (it + 1) / (null.iterations + 1))
    with pytest.raises(ValueError, match="split"):
        bench.run(ps.load(), prompts, ["packed"], {"packed": 4}, capacity=256, split="nope",
                  progress=False)


def test_block_size_spec():
    assert bench.parse_widths("8", ["ar", "packed"]) == {"ar": 8, "packed": 8}
    assert bench.parse_widths("packed=16,linear=4", ["linear", "packed"]) == \
        {"linear": 4, "packed": 16}
    with pytest.raises(ValueError, match="not among"):
        bench.parse_widths("quadratic=4", ["packed"])


def test_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "r.json"
    plot = tmp_path / "fig3.png"
    rc = bench.main(["--task", "arithmetic", "--limit", "3", "--schedules", "linear,packed",
                     "--block-size", "4", "--max-new-tokens", "12", "--resamples", "500",
                     "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["n_prompts"] == 3 and set(r["results"]) == {"linear", "packed"}
    for s, m in r["results"].items():
        assert {"tokens", "wall_s", "nfe", "tokens_per_nfe", "time_per_nfe_ms", "throughput_tok_s",
                "model_time_s", "accuracy"} <= set(m)
        assert m["tokens"] == sum(r["per_prompt"][s]["tokens"])
        assert sum(k * c for k, c in enumerate(m["accept_hist"])) == m["tokens"]
    p = r["paired"]["packed_vs_linear"]
    assert p["throughput_ratio_ci95"][0] <= p["throughput_ratio"] <= p["throughput_ratio_ci95"][1]
    assert plot.stat().st_size > 1000
    assert "| packed |" in capsys.readouterr().out


def test_probe_picks_fastest_block_size(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--task", "arithmetic", "--limit", "12", "--schedules", "linear,packed",
                     "--probe", "2,4,4", "--block-size", "linear=3", "--max-new-tokens", "6",
                     "--resamples", "200", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = r["probe"]
    assert [(x["schedule"], x["width"]) for x in rows] == [("packed", 2), ("packed", 4)]
    fastest = max(rows, key=lambda x: x["throughput_tok_s"])["width"]
    assert r["results"]["packed"]["block_size"] == fastest
    assert r["results"]["linear"]["block_size"] == 3          # --block-size wins over the probe
    # the probe decodes the first ten prompts only (greedy: the same tokens at every B)
    first_ten = sum(r["per_prompt"]["packed"]["tokens"][:bench.PROBE_PROMPTS])
    assert all(x["tokens"] == first_ten for x in rows)
    # Table 3's columns: the most rows per call (Packed-SS: 2B) and the accuracy
    assert [x["rows_per_call"] for x in rows] == [4, 8]
    first_ten_correct = r["per_prompt"]["packed"]["correct"][:bench.PROBE_PROMPTS]
    assert all(x["accuracy"] == np.mean(first_ten_correct) for x in rows)
    assert "block-size probe" in capsys.readouterr().out


def test_repeats_keep_the_fastest_decode(monkeypatch):
    """Every prompt is decoded `repeats` times per schedule, schedules in turn, and the
    fastest wall time is the one reported."""
    import dataclasses

    import packed_ss_jax as ps

    real, calls = ps.decode, []

    def decode(model, prompt, **kw):
        r = real(model, prompt, **kw)
        calls.append((prompt, kw["schedule"]))
        return dataclasses.replace(r, wall_s=[0.3, 0.2, 0.1][(len(calls) - 1) // 2 % 3])

    monkeypatch.setattr(bench.api, "decode", decode)
    prompts = tasks.load("arithmetic", None, 2)
    per = bench.run(ps.load(), prompts, ["ar", "packed"], {"ar": None, "packed": 4},
                    capacity=256, max_new_tokens=4, repeats=3, split=None, progress=False)
    runs = calls[2:]                                          # after the warm-up decodes
    assert runs == [(p.text, s) for p in prompts for _ in range(3) for s in ("ar", "packed")]
    assert per["ar"]["wall_s"] == per["packed"]["wall_s"] == [0.1, 0.1]


@pytest.mark.parametrize("flags, message", [(["--probe", "1,4"], "--probe"),
                                            (["--probe", ","], "--probe"),
                                            (["--probe", "4", "--block-size", "8"], "nothing to probe"),
                                            (["--repeats", "0"], "--repeats")])
def test_probe_and_repeat_errors(flags, message, capsys):
    assert bench.main(["--limit", "1"] + flags) == 2
    assert message in capsys.readouterr().err


def test_batching_benchmarks_run_on_short_queues(tmp_path, capsys):
    """The batching benchmarks of the GPU check, on queues shorter than their slots (the
    warm-up of the continuous one once asked for a seed per slot and one more)."""
    from benchmarks import batch_throughput, continuous_batching

    args = ["--max-new-tokens", "4", "--repeats", "1"]
    assert continuous_batching.main(["--prompts", "2", "--slots", "4", "--every", "64",
                                     "--json", str(tmp_path / "q.json"), *args]) == 0
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["static", "continuous"]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0
    assert batch_throughput.main(["--schedules", "ar", "--sizes", "1,2", "--prompts", "2",
                                  "--json", str(tmp_path / "b.json"), *args]) == 0
    assert "| ar | 2 |" in capsys.readouterr().out
    for every in ("0", "8,x"):  # refused before anything is loaded
        with pytest.raises(SystemExit):
            continuous_batching.main(["--every", every])
        assert "--every" in capsys.readouterr().err


def test_gpu_timing_smoke_prints_every_call(capsys):
    from benchmarks import gpu_timing

    assert gpu_timing.main(["--smoke", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| smoke")]
    calls = ["ar (1 row)", "linear draft", "linear verify", "packed", "quadratic"]
    assert len(rows) == 2 * len(calls)  # two cache lengths
    for row, name in zip(rows, calls * 2):
        assert name in row
        assert row.split("|")[3].strip() == "1"  # batch
        assert float(row.split("|")[5]) > 0  # ms / call
    # A batched decode's call: the forward vmapped over sequences with their own caches.
    c = gpu_timing.config("smoke", "float32")
    params = gpu_timing.model_lib.unstack_layers(
        gpu_timing.model_lib.init_params(c, gpu_timing.jax.random.PRNGKey(0)))
    name, call, rows = gpu_timing.calls(4, 3, c.mask_token_id)[0]
    assert gpu_timing.time_call(c, params, call, rows, 64, repeat=1, batch=3) > 0
    # The weight products alone, by rows: every 2-D weight of the layers and the head,
    # 2 FLOPs per weight and row.
    time_once, flops = gpu_timing.products(c, params, 3, repeat=1)
    weights = [x for k, x in params.items() if k.startswith("layer_") or k == "head"]
    assert time_once() > 0 and flops == 2 * 3 * sum(
        w.size for w in gpu_timing.jax.tree.leaves(weights) if w.ndim == 2)
    assert gpu_timing.main(["--smoke", "--products", "--batch", "1,2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s" in out.splitlines()[1]  # the rate of one large product, for reference
    assert [r.split("|")[2].strip() for r in out.splitlines() if r.startswith("| smoke")] == [
        "1", "2"]


def test_gpu_timing_calls_at_several_block_sizes(capsys):
    """Every schedule's calls at each B in turn (the GPU check times B = 8, 16, 32); each
    call has the rows its name says."""
    from benchmarks import gpu_timing

    got = gpu_timing.calls([8, 16], [8, 16], mask_id=100)
    assert [name for name, _, _ in got] == [
        "ar (1 row)", "linear draft (8 rows)", "linear verify (8 rows)", "packed (16 rows)",
        "quadratic (72 rows, B=8)", "linear draft (16 rows)", "linear verify (16 rows)",
        "packed (32 rows)", "quadratic (272 rows, B=16)"]
    for name, call, _ in got:
        assert call.tokens.shape == (int(name.split("(")[1].split()[0]),)
    with pytest.raises(SystemExit):
        gpu_timing.main(["--smoke", "--block-size", "8,x"])
    assert "--block-size" in capsys.readouterr().err
