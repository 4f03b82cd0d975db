"""lm-evaluation-harness against `packed-ss serve`, end to end, offline.

lm-evaluation-harness (`pip install -e ".[eval]"`) evaluates the embedded model through
the server as it evaluates any OpenAI-compatible server: its `local-completions` model,
with its default tokenized requests (it tokenizes with the server's own tokenizer,
through /tokenizer_info, /tokenize and /detokenize) and `--batch_size 4` (four prompts
per request). Two tasks over the held-out arithmetic problems, written here as local
task files (no download):

- `packed_ss_arith_gen` (generate_until): the model's answer, greedy, its `#### N` line
  compared with the right answer (exact match);
- `packed_ss_arith_mc` (multiple choice, loglikelihood): four candidate answers
  ` #### N` after the question and the model's worked line; each choice's loglikelihood
  is also computed in this process (`scoring.score` on the same ids, at the same length)
  and compared.

    python -m benchmarks.lm_eval_serving                    # 40 problems
    python -m benchmarks.lm_eval_serving --limit 8 --json benchmarks/results/lm_eval_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.serving import Server

ROOT = Path(__file__).resolve().parents[1]
# The loglikelihoods' agreement: two float32 computations (the server's process and this
# one) of sums of log-softmax terms of tens each agree to about 1e-5 of the sum.
MAX_RELATIVE = 1e-4

GEN_TASK = """task: packed_ss_arith_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|endoftext|>", "Question:"]
  max_gen_toks: 64
  do_sample: false
filter_list:
  - name: final
    filter:
      - function: regex
        regex_pattern: "#### (-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""

MC_TASK = """task: packed_ss_arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: acc
"""


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lm_eval_serving",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=40, help="arithmetic problems per task")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--schedule", default="packed")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.limit < 1 or args.batch_size < 1:
        p.error("--limit and --batch-size must be at least 1")
    args.max_num_seqs, args.model = 8, None   # benchmarks.serving.Server's settings
    return args


def _documents(model, limit: int) -> tuple[list[dict], list[dict]]:
    """The generate task's documents, and the multiple-choice task's: the question and
    the model's worked line (greedy, up to its `####`) as the context, four answers."""
    import packed_ss_jax as ps
    from packed_ss_jax.training import corpus

    gen, mc = [], []
    rng = np.random.default_rng(0)
    for p in corpus.arithmetic_test(limit):
        gen.append({"prompt": p.prompt, "answer": str(p.answer)})
        worked = ps.decode(model, p.prompt, max_new_tokens=64).text.split("####")[0]
        wrong = sorted({p.answer + int(d) for d in rng.choice([-3, -2, -1, 1, 2, 5, 10], 3,
                                                              replace=False)})
        choices = [f"#### {a}" for a in sorted([p.answer, *wrong])]
        mc.append({"context": p.prompt + worked, "choices": choices,
                   "target": choices.index(f"#### {p.answer}")})
    return gen, mc


def _write_tasks(folder: Path, gen: list[dict], mc: list[dict]) -> None:
    for name, docs, template in (("gen", gen, GEN_TASK), ("mc", mc, MC_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(template.format(data=data))


def _in_process_loglikelihoods(model, samples: list[dict]) -> list[tuple[float, float]]:
    """(lm-eval's, this process's) loglikelihood of every choice of every document: the
    context and continuation encoded as lm-eval encodes them (the whole text, then the
    context's ids off its front), scored by `scoring.score`."""
    from packed_ss_jax import scoring
    from packed_ss_jax.engine import Engine

    engine, tok = Engine.of(model), model.tokenizer
    pairs = []
    for s in samples:
        for (context, continuation), resp in zip((a["arguments"] for a in
                                                  _requests(s)), s["resps"]):
            whole = tok.encode(context + continuation, add_special_tokens=False).ids
            ctx = tok.encode(context, add_special_tokens=False).ids
            # lm-eval asks for one generated token after the text (max_tokens 1, echo): one
            # more id here scores at the server's length (the earlier ids' log-probabilities
            # do not depend on it), so both run the same program.
            logp = scoring.score(engine, whole + whole[-1:]).logp
            pairs.append((float(resp[0][0]), float(np.sum(logp[len(ctx):len(whole)]))))
    return pairs


def _requests(sample: dict) -> list[dict]:
    """A logged sample's requests as {"arguments": (context, continuation)}."""
    args = sample["arguments"]
    if isinstance(args, dict):  # newer lm-eval: {"gen_args_0": {"arg_0": ..., "arg_1": ...}}
        return [{"arguments": (a["arg_0"], a["arg_1"])} for a in args.values()]
    return [{"arguments": tuple(a)} for a in args]


def run(args) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import packed_ss_jax as ps

    model = ps.load()
    gen, mc = _documents(model, args.limit)
    with tempfile.TemporaryDirectory() as tmp, Server(args, args.schedule) as server:
        _write_tasks(Path(tmp), gen, mc)
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={server.base}/completions,model=nld-tiny,num_concurrent=1,"
                       "max_retries=1,tokenized_requests=True",
            tasks=["packed_ss_arith_gen", "packed_ss_arith_mc"],
            task_manager=TaskManager(include_path=tmp), batch_size=args.batch_size,
            log_samples=True)
        wall = time.perf_counter() - t0
    pairs = _in_process_loglikelihoods(model, out["samples"]["packed_ss_arith_mc"])
    diff = max(abs(a - b) for a, b in pairs)
    relative = max(abs(a - b) / max(abs(b), 1.0) for a, b in pairs)
    res = out["results"]
    return {"schedule": args.schedule, "problems": args.limit, "batch_size": args.batch_size,
            "wall_s": wall, "exact_match": res["packed_ss_arith_gen"]["exact_match,final"],
            "mc_acc": res["packed_ss_arith_mc"]["acc,none"], "choices": len(pairs),
            "max_loglikelihood_diff": diff, "max_relative_diff": relative}


def main(argv=None) -> int:
    args = _arguments(argv)
    if importlib.util.find_spec("lm_eval") is None:
        print("lm-evaluation-harness is not installed: pip install -e \".[eval]\"",
              file=sys.stderr)
        return 2
    r = run(args)
    print("| schedule | problems | batch size | generate: exact match | multiple choice: acc "
          "| choices | loglikelihood diff: max, max relative | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {r['schedule']} | {r['problems']} | {r['batch_size']} | {r['exact_match']:.3f} | "
          f"{r['mc_acc']:.3f} | {r['choices']} | {r['max_loglikelihood_diff']:.1e}, "
          f"{r['max_relative_diff']:.1e} | {r['wall_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    # Two float32 computations of one sum: equal to float32's accuracy.
    return 0 if r["max_relative_diff"] < MAX_RELATIVE else 1


if __name__ == "__main__":
    raise SystemExit(main())
