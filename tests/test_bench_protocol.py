"""The paper's evaluation protocol in `packed-ss bench`, on synthetic inputs with known
answers: pass@1 over repeated samples (App. E.4), paired accuracy differences (Table 11),
the draft-only adapter's row accounting (App. F.2), Figure 5's per-task normalisation,
the probe table (App. F.1), sweeps over widths / orders / adapter settings, the
reproducibility record and --replot."""

import json
from pathlib import Path

import numpy as np
import pytest

from packed_ss_jax.bench import accounting, figures, provenance, stats, tasks
from packed_ss_jax.bench import harness as bench


# --- statistics ----------------------------------------------------------------------------

def test_pass_at_1_is_the_mean_over_samples_then_prompts():
    correct = [[1, 0, 1, 1], [0, 0, 0, 0], [True, True, True, True]]
    assert stats.pass_at_1(correct) == pytest.approx((0.75 + 0 + 1) / 3)
    assert stats.pass_at_1([True, False, True, True]) == pytest.approx(0.75)  # one sample each
    # a prompt with many samples weighs no more than one with few
    assert stats.pass_at_1([[1] * 10, [0]]) == pytest.approx(0.5)
    for bad in ([[0.5, 2]], [[]], [[float("nan")]]):
        with pytest.raises(ValueError, match="prompt 0"):
            stats.pass_at_1(bad)


def test_paired_accuracy_difference_known_answer():
    n = 40
    idx = stats.resample_indices(n, 2000)
    a = [True] * n
    b = [i % 2 == 0 for i in range(n)]                  # half right
    d = stats.paired_accuracy(a, b, idx)
    assert d["diff_pp"] == pytest.approx(50.0)
    lo, hi = d["ci95_pp"]
    assert 30 < lo < 50 < hi < 70                        # prompts differ: a real interval
    same = stats.paired_accuracy(b, b, idx)              # identical labels: exactly zero
    assert same["diff_pp"] == 0 and same["ci95_pp"] == [0.0, 0.0]
    # repeated samples: per-prompt fractions, paired by prompt
    s = stats.paired_accuracy([[1, 1], [1, 0]], [[0, 0], [1, 0]], stats.resample_indices(2, 500))
    assert s["diff_pp"] == pytest.approx(50.0) and s["ci95_pp"] == pytest.approx([0.0, 100.0])
    with pytest.raises(ValueError, match="same prompts"):
        stats.paired_accuracy([1, 0], [1], idx)


def test_paired_accuracy_interval_covers_the_truth():
    rng = np.random.default_rng(3)
    n = 400
    a = rng.random(n) < 0.70
    b = np.where(rng.random(n) < 0.9, a, ~a)             # correlated labels, true diff ~ 0
    b[:40] = False                                       # b worse on 10% of prompts a gets...
    a[:40] = True                                        # ...right: about +10 points
    d = stats.paired_accuracy(a, b, stats.resample_indices(n, 4000))
    lo, hi = d["ci95_pp"]
    assert lo < d["diff_pp"] < hi and lo > 0 and hi - lo < 12


# --- draft-only adapter accounting ------------------------------------------------------------

@pytest.mark.parametrize("schedule, B, expect", [
    ("packed", 8, dict(calls=1, rows=16, max_rows_per_call=16, selected=8, evaluated=16)),
    ("linear", 8, dict(calls=2, rows=16, max_rows_per_call=8, selected=8, evaluated=16)),
    # the paper's Table 4 note at B = 8: updates for 64 proposal rows, computed for 72
    ("quadratic", 8, dict(calls=1, rows=72, max_rows_per_call=72, selected=64, evaluated=72)),
    ("ar", None, dict(calls=1, rows=1, max_rows_per_call=1, selected=0, evaluated=1)),
    ("packed", 32, dict(calls=1, rows=64, max_rows_per_call=64, selected=32, evaluated=64)),
])
def test_adapter_rows_from_the_layouts(schedule, B, expect):
    assert accounting.adapter_rows(schedule, B, True) == expect
    off = accounting.adapter_rows(schedule, B, False)
    assert off["selected"] == off["evaluated"] == 0 and off["rows"] == expect["rows"]


def test_adapter_rows_errors():
    with pytest.raises(ValueError, match="native"):
        accounting.adapter_rows("native", 8, True)
    with pytest.raises(ValueError, match="block size"):
        accounting.adapter_rows("packed", 1, True)


def _run(task, results, *, lora=None, order="ltr", n=2, samples=1, family="nemotron",
         width_name="block_size"):
    """A synthetic bench run: `results` {schedule: (wall_s, model_s, tokens, iterations, B)}."""
    out = {"model": "m", "family": family, "width_name": width_name, "task": task,
           "n_prompts": n, "samples": samples, "order": order, "time_split": "null",
           "results": {}, "per_prompt": {}, "paired": {}}
    if lora is not None:
        out["lora"] = lora
    for s, (wall, model, tokens, iters, B) in results.items():
        out["results"][s] = {width_name: B, "tokens": tokens, "wall_s": wall, "nfe": iters,
                             "model_time_s": model, "non_model_time_s": wall - model,
                             "throughput_tok_s": tokens / wall, "accuracy": 0.5}
        out["per_prompt"][s] = {"iterations": [iters // n] * n}
    return out


def test_lora_table_means_and_rows():
    runs = [_run("t", {"packed": (2.0, 1.5, 100, 40, 8), "linear": (1.0, 0.9, 100, 20, 8)},
                 lora=on) for on in (True, False)]
    rows = accounting.lora_table(runs)
    assert [(r["schedule"], r["adapter"]) for r in rows] == \
        [("packed", True), ("linear", True), ("packed", False), ("linear", False)]
    p = rows[0]
    assert p["mean_wall_s"] == 1.0 and p["mean_model_s"] == 0.75 and p["mean_non_model_s"] == 0.25
    assert p["mean_iterations"] == 20 and p["model_ms_per_iteration"] == pytest.approx(37.5)
    assert (p["selected_per_iteration"], p["evaluated_per_iteration"]) == (8, 16)
    assert (rows[2]["selected_per_iteration"], rows[2]["evaluated_per_iteration"]) == (0, 0)
    assert "| t | packed | 8 | on |" in accounting.lora_markdown(rows)
    # SetDLM runs have no adapter: nothing to account
    assert accounting.lora_table([_run("t", {"packed": (1, 1, 1, 1, 8)}, family="setdlm")]) == []


# --- Figure 5 -----------------------------------------------------------------------------------

def test_time_decomposition_normalises_each_task_then_averages():
    # task a: linear total 10 s; task b: linear total 2 s (a long-output task must not dominate)
    a = _run("a", {"linear": (10.0, 8.0, 1, 1, 8), "packed": (9.0, 6.0, 1, 1, 8)})
    b = _run("b", {"linear": (2.0, 1.0, 1, 1, 8), "packed": (1.0, 0.5, 1, 1, 8),
                   "quadratic": (3.0, 2.0, 1, 1, 8)})
    [g] = figures.time_decomposition([a, b])
    assert g["tasks"] == ["a", "b"] and list(g["schedules"]) == ["linear", "packed"]
    lin, pk = g["schedules"]["linear"], g["schedules"]["packed"]
    assert lin["total"] == pytest.approx(1.0)
    assert lin["model"] == pytest.approx((0.8 + 0.5) / 2)
    assert pk["model"] == pytest.approx((0.6 + 0.25) / 2)
    assert pk["non_model"] == pytest.approx((0.3 + 0.25) / 2)
    assert g["per_task"]["b"]["quadratic"] == {"model": 1.0, "non_model": 0.5}
    # different widths are different groups; a run without Linear-SS is left out
    c = _run("a", {"linear": (1.0, 0.5, 1, 1, 16)})
    d = _run("a", {"packed": (1.0, 0.5, 1, 1, 8)})
    groups = figures.time_decomposition([a, b, c, d])
    assert [g["group"] for g in groups] == ["B=8", "B=16"]
    assert "| B=8 | a, b | packed | 0.425 | 0.275 | 0.700 |" in \
        figures.decomposition_markdown(groups)


# --- reproducibility ------------------------------------------------------------------------------

def test_directory_checksum(tmp_path):
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "w.bin").write_bytes(b"\x00" * 1000)
    first = provenance.directory_sha256(d)
    assert first["files"] == 2 and first["bytes"] == 1002
    copy = tmp_path / "copy"
    (copy / "sub").mkdir(parents=True)
    (copy / "sub" / "w.bin").write_bytes(b"\x00" * 1000)
    (copy / "config.json").write_text("{}")
    assert provenance.directory_sha256(copy) == first            # content, not location
    (d / "sub" / "w.bin").write_bytes(b"\x00" * 999 + b"\x01")
    assert provenance.directory_sha256(d)["sha256"] != first["sha256"]
    (d / "sub" / "w.bin").write_bytes(b"\x00" * 1000)
    (d / "sub" / "w.bin").rename(d / "sub" / "v.bin")          # a rename changes it too
    assert provenance.directory_sha256(d)["sha256"] != first["sha256"]
    with pytest.raises(NotADirectoryError, match="config.json"):
        provenance.directory_sha256(d / "config.json")


# --- the bench: repeated samples, probe columns, sweeps, replot -----------------------------------

def test_repeated_samples_have_distinct_seeds_and_give_pass_at_1(monkeypatch):
    import packed_ss_jax as ps

    real, seeds = ps.decode, []

    def decode(model, prompt, **kw):
        seeds.append((prompt, kw["seed"]))
        return real(model, prompt, **kw)

    monkeypatch.setattr(bench.api, "decode", decode)
    prompts = tasks.load("arithmetic", None, 2)
    per = bench.run(ps.load(), prompts, ["ar"], {"ar": None}, capacity=256, max_new_tokens=4,
                    temperature=1.0, seed=7, samples=3, split=None, progress=False)["ar"]
    measured = seeds[1:]                                             # after the warm-up
    assert [s for _, s in measured] == [7, 8, 9, 10, 11, 12]         # seed + i * 3 + j
    assert len(set(measured)) == 6
    assert [len(c) for c in per["correct"]] == [3, 3]
    again = [real(ps.load(), p.text, schedule="ar", max_new_tokens=4, temperature=1.0, seed=s,
                  cache_size=256) for p, s in zip([prompts[0]] * 3 + [prompts[1]] * 3,
                                                  range(7, 13))]
    assert per["tokens"] == [sum(len(r.tokens) for r in again[:3]),
                             sum(len(r.tokens) for r in again[3:])]
    summary = bench.summarize("m", "arithmetic", {"ar": per}, {"ar": None}, 8, 100, samples=3)
    assert summary["samples"] == 3
    assert summary["results"]["ar"]["accuracy"] == stats.pass_at_1(per["correct"])
    assert summary["results"]["ar"]["mean_tokens"] == pytest.approx(sum(per["tokens"]) / 6)


def test_samples_need_a_temperature(capsys):
    assert bench.main(["--limit", "1", "--samples", "3"]) == 2
    assert "--temperature" in capsys.readouterr().err


def _fake_run(model, prompts, schedules, widths, *, order="ltr", samples=1, split="null", **kw):
    """Stands in for the decoding: deterministic per-prompt numbers from the width and order."""
    per = {}
    for s in schedules:
        B = widths.get(s) or 1
        k = 2 if order == "confidence" else 1
        n = len(prompts)
        per[s] = {"tokens": [10 * B] * n, "wall_s": [0.01 * B * k + 0.001 * i for i in range(n)],
                  "nfe": [5] * n, "iterations": [5] * n, "model_s": [0.005 * B * k] * n,
                  "correct": [i % 2 == 0 for i in range(n)], "max_rows": [2 * B] * n,
                  "hist": np.array([0, 5])}
    return per


def test_sweep_over_widths_orders_and_adapter(tmp_path, monkeypatch, capsys):
    """One invocation runs every (adapter, task, width, order); orderless schedules run in
    the first order only; each run is in the JSON with its paired intervals, and Figure 5,
    the adapter table and the reproducibility record are there too. The decoding is faked
    (this checks the plumbing; the decode itself is tested elsewhere)."""
    import types

    import packed_ss_jax as ps

    monkeypatch.setattr(bench, "run", _fake_run)
    loaded, nld = [], ps.load()

    def load_model(args, lora=None):  # the embedded model, as if it carried an adapter
        loaded.append(lora)
        config = nld.config.replace(lora_rank=2, lora_alpha=4.0) if lora else nld.config
        return types.SimpleNamespace(config=config, tokenizer=nld.tokenizer)

    monkeypatch.setattr(bench, "load_model", load_model)
    out = tmp_path / "r.json"
    argv = ["--task", "arithmetic,prose", "--limit", "4", "--schedules", "ar,linear,packed",
            "--block-size", "4,8", "--lora", "on,off", "--resamples", "200", "--json", str(out)]
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())
    assert loaded == [True, False]
    runs = r["runs"]
    assert [(x["lora"], x["task"], x["results"]["packed"]["block_size"]) for x in runs] == \
        [(on, t, B) for on in (True, False) for t in ("arithmetic", "prose") for B in (4, 8)]
    for x in runs:
        assert set(x["paired"]) == {"packed_vs_ar", "packed_vs_linear"}
        assert x["paired"]["packed_vs_linear"]["accuracy_diff_pp"] == 0.0
        assert x["ratios_to_linear"]["packed"]["accuracy_diff_pp"]["diff"] == 0.0
    # Figure 5: one group per (width, adapter), each averaging the two tasks
    assert sorted(g["group"] for g in r["figure5"]) == \
        sorted(f"B={B}, adapter {a}" for B in (4, 8) for a in ("on", "off"))
    assert all(g["tasks"] == ["arithmetic", "prose"] for g in r["figure5"])
    rows = r["lora_accounting"]
    assert {(x["schedule"], x["adapter"], x["selected_per_iteration"],
             x["evaluated_per_iteration"]) for x in rows if x["block_size"] == 8} == \
        {("linear", True, 8, 16), ("packed", True, 8, 16),
         ("linear", False, 0, 0), ("packed", False, 0, 0)}
    rep = r["reproducibility"]
    import jax

    assert rep["model"] == "nld-tiny" and rep["argv"] == argv
    assert rep["flags"]["block_size"] == "4,8"
    assert rep["jax"] == jax.__version__ and rep["package_version"] == ps.__version__
    assert rep["device_kind"] == jax.devices()[0].device_kind
    embedded = Path(ps.__file__).parent / "embedded" / "nld-tiny"
    assert rep["model_checksum"] == provenance.directory_sha256(embedded)
    assert rep["seeds"] == {"seed": 0, "decode": "seed + prompt * samples + sample",
                            "bootstrap": 0}
    text = capsys.readouterr().out
    assert "| run | schedule |" in text and "time decomposition" in text
    assert "adapter accounting" in text


def test_order_sweep_runs_orderless_schedules_once(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", _fake_run)
    out = tmp_path / "r.json"
    assert bench.main(["--model", "setdlm-tiny", "--limit", "3", "--window", "8,16",
                       "--order", "ltr,confidence", "--schedules", "serial,native,linear,packed",
                       "--resamples", "100", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(x["order"], x["results"]["packed"]["window"], sorted(x["results"])) for x in runs] == [
        ("ltr", 8, ["linear", "native", "packed", "serial"]),
        ("confidence", 8, ["linear", "packed"]),
        ("ltr", 16, ["linear", "native", "packed", "serial"]),
        ("confidence", 16, ["linear", "packed"])]


@pytest.mark.parametrize("flags, message", [
    (["--order", "ltr,sideways", "--model", "setdlm-tiny"], "--order"),
    (["--lora", "on"], None),   # nld-tiny has no adapter: the loader says so
    (["--lora", "maybe"], "--lora"),
    (["--lora", "on", "--model", "setdlm-tiny"], "no draft-only adapter"),
    (["--probe", "4,8", "--block-size", "4,8"], "--probe"),
    (["--task", "arithmetic,trivia"], "trivia"),
    (["--task", "arithmetic", "--data", "x.jsonl"], "--data"),
    (["--temperature", "1", "--model", "setdlm-tiny", "--order", "confidence"], "ltr order"),
    (["--replot", "none.json"], "--plot"),
])
def test_protocol_flag_errors(flags, message, capsys):
    assert bench.main(["--limit", "1"] + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
    if message:
        assert message in err


def test_replot_redraws_without_decoding(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run", _fake_run)
    out, png = tmp_path / "r.json", tmp_path / "f.png"
    assert bench.main(["--limit", "4", "--schedules", "linear,packed", "--block-size", "4",
                       "--resamples", "100", "--json", str(out)]) == 0
    first = capsys.readouterr().out

    def no_decoding(*a, **k):
        raise AssertionError("--replot decoded")

    monkeypatch.setattr(bench, "run", no_decoding)
    monkeypatch.setattr(bench, "load_model", no_decoding)
    assert bench.main(["--replot", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert capsys.readouterr().out.strip() == first.strip()    # the same tables
    bad = tmp_path / "bad.json"
    for text in ("not json", "[1, 2]", '{"runs": []}', '{"task": "x"}',
                 '{"model": "m", "task": "t", "n_prompts": 1, "results": {}}'):
        bad.write_text(text)
        assert bench.main(["--replot", str(bad), "--plot", str(png)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--replot" in err, (text, err)
