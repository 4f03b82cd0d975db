"""Every script in benchmarks/ and tools/ runs, the one way scripts are run: `python -m
benchmarks.NAME` or `python -m tools.NAME` from the repository root.

`SMOKE` names, for every script, the test that runs it at tiny sizes (here, or in the
test file of the tool); a script without one fails `test_every_script_has_a_smoke_test`,
so a new script cannot go untested and a changed engine cannot leave a script broken
unnoticed. Every script's `--help` is run here too, as `python -m` runs it (`runpy`, in
this process). The smoke runs call each script's `main(argv)` in this process on the
embedded models, the test fixtures or tiny synthetic shapes, and write only under
pytest's tmp_path. Scripts made for a GPU run their CPU-sized modes (`--smoke`, `tiny`
shapes); a script that starts processes has its in-process part run in the quick loop
and the whole run in the slow list (tests/slow.py).
"""

from __future__ import annotations

import json
import runpy
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> the tests that run it at tiny sizes ("file::function"). CI's whole suite runs
# them all; the quick loop leaves out those in tests/slow.py (whole processes, whole
# benchmarks), and runs `test_help` for every script.
SMOKE = {
    "benchmarks.attention_timing": ["test_scripts.py::test_attention_timing"],
    "benchmarks.auto": ["test_scripts.py::test_auto"],
    "benchmarks.branches": ["test_scripts.py::test_branches"],
    "benchmarks.batch_throughput":
        ["test_benchmarks.py::test_batching_benchmarks_run_on_short_queues"],
    "benchmarks.checkpoint_cost": ["test_scripts.py::test_checkpoint_cost"],
    "benchmarks.cost_check": ["test_scripts.py::test_cost_check"],
    "benchmarks.continuous_batching":
        ["test_benchmarks.py::test_batching_benchmarks_run_on_short_queues"],
    "benchmarks.gpu_timing": ["test_benchmarks.py::test_gpu_timing_calls_at_several_block_sizes",
                              "test_benchmarks.py::test_gpu_timing_smoke_prints_every_call"],
    "benchmarks.real_size": ["test_scripts.py::test_real_size_stages",
                             "test_scripts.py::test_real_size_end_to_end"],
    "benchmarks.roofline": ["test_scripts.py::test_roofline"],
    "benchmarks.lm_eval_serving": ["test_scripts.py::test_lm_eval_serving"],
    "benchmarks.serving": ["test_scripts.py::test_serving"],
    "benchmarks.startup": ["test_scripts.py::test_startup"],
    "benchmarks.stream_overhead": ["test_scripts.py::test_stream_overhead"],
    "tools.call_path": ["test_scripts.py::test_call_path_of_a_decode"],
    "tools.fixtures": ["test_fixtures_manifest.py::test_generator_reproduces_the_committed_files"],
    "tools.fuzz_torch_bin": [
        "test_scripts.py::test_fuzz_torch_bin",
        "test_torch_bin_fuzz.py::test_fuzzed_files_are_refused_or_read_inside_their_storages"],
    "tools.golden": ["test_scripts.py::test_golden_lists_its_cases"],
    "tools.gpu_check": [
        "test_gpu_check.py::test_the_check_stops_within_its_budget",
        "test_gpu_check.py::test_smoke_run_without_the_packages_the_gpu_image_lacks"],
    "tools.synthetic_checkpoint": ["test_scripts.py::test_synthetic_checkpoint",
                                   "test_synthetic_checkpoint.py::test_release_layout"],
    "tools.zero_adapter": ["test_scripts.py::test_zero_adapter"],
}


def scripts() -> list[str]:
    """The scripts: every module of benchmarks/ and tools/, and every package there with a
    `__main__` (tools.fixtures)."""
    out = []
    for folder in ("benchmarks", "tools"):
        for p in sorted((ROOT / folder).iterdir()):
            if p.suffix == ".py" and p.stem != "__init__":
                out.append(f"{folder}.{p.stem}")
            elif p.is_dir() and (p / "__main__.py").is_file():
                out.append(f"{folder}.{p.name}")
    return sorted(out)


def test_every_script_has_a_smoke_test():
    assert sorted(SMOKE) == scripts(), "a script without a smoke test in SMOKE, or a stale entry"
    for script, tests in SMOKE.items():
        for test in tests:
            file, name = test.split("::")
            path = ROOT / "tests" / file
            assert path.is_file() and f"def {name}(" in path.read_text(), (script, test)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("script", scripts())
def test_help(script, monkeypatch, capsys):
    """`python -m SCRIPT --help` prints a usage line under that command and exits 0."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    handler = signal.getsignal(signal.SIGTERM)  # tools.gpu_check sets its own
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {script}"), out[:200]
    assert "--" in out  # its options are listed


def test_attention_timing(monkeypatch, capsys):
    from benchmarks import attention_timing
    from packed_ss_jax import model as model_lib

    monkeypatch.setattr(model_lib, "CHUNK", model_lib.CHUNK)  # the script sets it
    assert attention_timing.main(["--shape", "smoke", "--rows", "1", "--cases", "64:40",
                                  "--repeat", "2", "--trials", "1", "--chunk", "16"]) == 0
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines() if r.startswith("| 64 ")]
    assert [r[3].strip() for r in rows] == ["1"]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)  # full, live (ms)


def test_checkpoint_cost(tmp_path, capsys):
    from benchmarks import checkpoint_cost

    assert checkpoint_cost.main(["--gib", "0.001", "--hidden-size", "64",
                                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("SHA-256, one thread", "NaN/Inf scan", "load, verify=True",
                "verification overhead"):
        assert row in out
    assert list(tmp_path.iterdir()) == []  # the checkpoint is removed


def test_roofline(capsys):
    from benchmarks import roofline

    assert roofline.main(["--shapes", "tiny", "--live", "64"]) == 0
    out = capsys.readouterr().out
    rows = [r.split("|") for r in out.splitlines() if r.startswith("| tiny | ")]
    schedules = ["ar", "linear", "quadratic", "packed", "branched"]
    assert [r[2].split()[0] for r in rows[:5]] == schedules
    assert all(float(r[3]) >= 0 and float(r[4]) >= 0 for r in rows[:5])  # GFLOP, GB (XLA)
    # Then the throughput ratios per device: Linear-SS / Packed-SS time per NFE, projected
    # with XLA's bytes / with the minimal traffic.
    assert [r[2].strip() for r in rows[5:]] == list(roofline.DEVICES)
    assert all(float(x) > 0 for r in rows[5:] for x in r[3].split("/"))
    with pytest.raises(SystemExit):
        roofline.main(["--shapes", "2B"])
    assert "--shapes" in capsys.readouterr().err


def test_stream_overhead(capsys):
    from benchmarks import stream_overhead

    assert stream_overhead.main(["--tokens", "16", "--chunks", "4", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "| one-shot | 1 |" in out and "| k=4 |" in out and "| k=4 + text |" in out


def test_startup(tmp_path, capsys):
    from benchmarks import startup

    out = tmp_path / "startup"
    assert startup.main(["--modes", "disk", "--repeat", "1", "--max-model-len", "32",
                         "--out", str(out)]) == 0
    assert "| warm, programs on disk |" in capsys.readouterr().out
    row = json.loads(out.with_suffix(".json").read_text())["rows"]["warm, programs on disk"]
    assert "read from disk" in row["serve"]["ready"], row


def test_branches(tmp_path, capsys):
    from benchmarks import branches

    out = tmp_path / "branches.json"
    assert branches.main(["--blocks", "2", "--prompts", "2", "--max-new-tokens", "12",
                          "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| nld-tiny | B=2 | branched | 2 | 6 |" in text
    assert "| setdlm-tiny | W=2 | branched | 2 | 9 |" in text
    rows = json.loads(out.read_text())["rows"]
    for model in ("nld-tiny", "setdlm-tiny"):
        ours = [r for r in rows if r["model"] == model]
        assert [(r["schedule"], r["branches"]) for r in ours] == [
            ("packed", None), ("branched", 1), ("branched", 2), ("quadratic", None)]
        assert ours[0]["tokens_per_nfe"] == ours[1]["tokens_per_nfe"]   # k = 1 is Packed-SS


def test_auto(tmp_path, capsys):
    from benchmarks import auto

    out = tmp_path / "auto.json"
    assert auto.main(["--models", "nld-tiny", "--width", "4", "--schedules", "packed",
                      "--prompts", "2",
                      "--calibration", "2", "--rounds", "1", "--max-new-tokens", "8",
                      "--batches", "2", "--load", "quiet,loaded", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| auto |" in text and "| packed B=4 |" in text and "auto chose" in text
    run = json.loads(out.read_text())["runs"][0]
    assert run["candidates"] == 2 and run["calibration_s"] > 0   # ar and packed B=4
    assert [(r["load"], r["batch"]) for r in run["rows"]] == [("quiet", 2), ("loaded", 2)]
    assert all(r["auto_choices"] and r["auto_vs_best"] > 0 for r in run["rows"])
    # every auto call's prediction beside what it made (2 prompts, 2 at a time, 2 rounds)
    assert all(len(r["predictions"]) == 2 and r["predictions"][0]["observed"] > 0
               for r in run["rows"])


def test_cost_check(tmp_path, capsys):
    from benchmarks import cost_check, gpu_timing

    assert gpu_timing.main(["--smoke", "--cache-lengths", "64", "--repeat", "1"]) == 0
    measured = tmp_path / "timing.md"
    measured.write_text(capsys.readouterr().out)
    assert cost_check.main(["--smoke", "--measured", str(measured)]) == 0
    out = capsys.readouterr().out
    assert "| packed (8 rows) | 8 |" in out and "predicted / measured" in out
    assert "| branched B=8 k=2 |" in out and "auto at batch 8: " in out


def test_lm_eval_serving(tmp_path, capsys):
    """lm-evaluation-harness against the server (the `eval` extra; CI's test extra leaves
    it out: it installs a dataset stack of its own)."""
    pytest.importorskip("lm_eval")
    from benchmarks import lm_eval_serving

    out = tmp_path / "lm_eval.json"
    assert lm_eval_serving.main(["--limit", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["choices"] == 8 and r["max_relative_diff"] < lm_eval_serving.MAX_RELATIVE


def test_serving(tmp_path, capsys):
    from benchmarks import serving

    out = tmp_path / "serving.json"
    assert serving.main(["--schedules", "packed", "--concurrency", "1,3", "--requests", "3",
                         "--max-tokens", "6", "--long-tokens", "24", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| packed | 1 |" in table and "| packed | 3 |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["clients"] for r in rows] == [1, 3] and rows[0]["vs_sequential"] == 1.0


def _stage(real_size, spec: dict, capsys) -> dict:
    """One stage of benchmarks.real_size, run as its child runs it (`--stage SPEC`)."""
    assert real_size.main(["--stage", json.dumps(spec)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_real_size_stages(tmp_path, capsys):
    """Each stage of the real-size benchmark on the tiny shape, in this process (the whole
    benchmark, every stage in its own process, is test_real_size_end_to_end)."""
    from benchmarks import real_size

    src, dst = tmp_path / "nld-tiny", tmp_path / "nld-tiny-bf16"
    assert _stage(real_size, {"kind": "write", "shape": "tiny", "out": str(src)},
                  capsys)["seconds"] > 0
    _stage(real_size, {"kind": "convert", "src": str(src), "dst": str(dst)}, capsys)
    loaded = _stage(real_size, {"kind": "load", "model": str(dst)}, capsys)
    assert loaded["weight_bytes"] > 0
    decode = {"kind": "decode", "model": str(dst), "block_size": 4, "max_new_tokens": 6,
              "cache_size": 64, "prompt": list(real_size.PROMPT)}
    ar = _stage(real_size, dict(decode, schedule="ar"), capsys)
    packed = _stage(real_size, dict(decode, schedule="packed"), capsys)
    assert len(ar["tokens"]) == 6 and packed["tokens"] == ar["tokens"]  # greedy
    assert ar["nfe"] >= packed["nfe"] > 0 and ar["s_per_call"] > 0


def test_real_size_end_to_end(tmp_path, capsys):
    from benchmarks import real_size

    out = tmp_path / "r.json"
    assert real_size.main(["--shapes", "tiny", "--dir", str(tmp_path / "ckpt"),
                           "--schedules-3b", "ar", "packed", "--max-new-tokens", "6",
                           "--block-size", "4", "--wait-memory", "60", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["stage"] for r in results] == ["write", "convert", "load", "load (Hugging Face)",
                                            "decode ar", "decode packed"]
    assert all(r["peak_rss"] > 0 for r in results)
    assert results[-1]["same_as_ar"] is True
    assert not (tmp_path / "ckpt" / "nld-tiny").exists()  # written here, so removed
    assert "tiny decode packed" in capsys.readouterr().out


def test_fuzz_torch_bin(setdlm_dir, capsys):
    from tools import fuzz_torch_bin

    assert fuzz_torch_bin.main(["--cases", "20", "--seed", "1",
                                "--fixture", str(setdlm_dir / "pytorch_model.bin")]) == 0
    out = capsys.readouterr().out
    assert "summary: seed 1: 20 cases" in out and "0 failures" in out


def test_call_path_of_a_decode(capsys):
    """A decode's host path goes down the import layers only, through the request check,
    the engine and the result; a call up the layers (a callback) would be listed."""
    import packed_ss_jax as ps
    from tools import call_path

    out = call_path.report("decode", call_path.decode_path(ps.load("nld-tiny")))
    assert out["up"] == [] and out["crossings"] <= 12, capsys.readouterr().out
    modules = set(out["modules"])
    assert {"packed_ss_jax.api", "packed_ss_jax.options", "packed_ss_jax.engine",
            "packed_ss_jax.results"} <= modules
    assert "packed_ss_jax.scheduler" not in modules   # one request: `Loop.run`, no slots


def test_golden_lists_its_cases(capsys):
    from tools import golden

    assert golden.main(["--list"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids and len(set(ids)) == len(ids)


def test_synthetic_checkpoint(tmp_path, capsys):
    import packed_ss_jax as ps
    from tools import synthetic_checkpoint

    out = tmp_path / "nld-tiny"
    assert synthetic_checkpoint.main(["--shape", "tiny", "--out", str(out), "--no-lora"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert ps.load(out).config == synthetic_checkpoint.model_config("tiny", "float32")
    assert synthetic_checkpoint.main(["--shape", "tiny", "--out", str(out)]) == 1  # exists
    assert "exists" in capsys.readouterr().err


def test_zero_adapter(tmp_path, capsys):
    import packed_ss_jax as ps
    from tools import zero_adapter

    out = tmp_path / "nld-tiny-zero-adapter"
    assert zero_adapter.main([str(out), "--rank", "2"]) == 0
    model = ps.load(out)
    assert (model.config.lora_rank, model.config.lora_alpha) == (2, 8.0)
    assert model.tokenizer is not None
    assert zero_adapter.main([str(out)]) == 1  # never overwrites
    assert "exists" in capsys.readouterr().err
