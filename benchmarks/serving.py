"""The server under many clients: `packed-ss serve` (a process of its own) against the
official `openai` client, for each schedule and number of concurrent clients.

The same requests (the arithmetic task's first `--requests` prompts, greedy, streamed,
`--max-tokens` each; with `--mixed`, every third one greedy, sampled at temperature 1, or
at 0.7 with top-p 0.8, each with its own seed) are sent by C clients at once, for each C
of `--concurrency` (C = 1: one after another). Reported per schedule and C: tokens per second over the
whole run, its ratio to C = 1, the latency of a request (p50, p95) and its time to first
token (p50, p95). Then, per schedule, a short request's latency alone and while a long
one runs (their ratio is what a long request costs the others). Every response is
checked against the sequential run's tokens.

    python -m benchmarks.serving                          # ar and packed, C = 1, 8, 32
    python -m benchmarks.serving --json benchmarks/results/serving_cpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from packed_ss_jax.arguments import int_at_least, ints_at_least
from packed_ss_jax.bench import tasks

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"serving \S+ on http://(\S+):(\d+)/v1")
ACCESS = re.compile(r" (GET|POST) /\S* \d{3} ")   # an access-log line of the server


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="ar,packed")
    p.add_argument("--concurrency", type=ints_at_least(1), default="1,8,32",
                   help="clients at once, to measure")
    p.add_argument("--requests", type=int_at_least(1), default=32)
    p.add_argument("--max-tokens", type=int_at_least(1), default=64)
    p.add_argument("--long-tokens", type=int_at_least(1), default=400,
                   help="the long request's max_tokens (the short one's: 8)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--mixed", action="store_true",
                   help="greedy, sampled and top-p requests in turn (default: all greedy)")
    p.add_argument("--model", default=None, help="a checkpoint (default: the embedded one)")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


class Server:
    """`packed-ss serve --port 0` of one schedule, ready (its /health answers 200: it
    listens before its programs are ready, and a request sent meanwhile would time the
    warm-up); stopped on exit."""

    def __init__(self, args, schedule: str, timeout: float = 600):
        cmd = [sys.executable, "-m", "packed_ss_jax", "serve", "--port", "0", "--schedule",
               schedule, "--max-num-seqs", str(args.max_num_seqs)]
        if args.model:
            cmd += ["--model", args.model]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.startup = []
        for line in self.proc.stderr:
            self.startup.append(line.rstrip())
            if m := SERVING.search(line):
                self.base = f"http://{m.group(1)}:{m.group(2)}/v1"
                break
        else:
            raise RuntimeError("the server did not start:\n" + "\n".join(self.startup))
        # The rest of its output read on, so that a full pipe never stalls it.
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(self.base.removesuffix("/v1") + "/health", timeout)

    def _drain(self) -> None:
        """Its startup lines kept up to "ready in ..."; its access log (the readiness
        polls among it) read and dropped."""
        ready = any("ready in" in line for line in self.startup)
        for line in self.proc.stderr:
            if not ready and not ACCESS.search(line):
                self.startup.append(line.rstrip())
                ready = "ready in" in line

    def _wait_ready(self, health: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(health, timeout=5):
                    return   # 200; 503 ("starting") raises HTTPError
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("the server did not become ready:\n" + "\n".join(self.startup))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _sampling(i: int, mixed: bool) -> dict:
    """Request i's sampling options."""
    if not mixed or i % 3 == 0:
        return {"temperature": 0}
    return {"temperature": 1.0, "seed": i} if i % 3 == 1 else {"temperature": 0.7,
                                                                "top_p": 0.8, "seed": i}


def _one(client, model: str, prompt: str, max_tokens: int, sampling=None) -> dict:
    """One streamed request: its tokens, latency and time to first token."""
    t0 = time.perf_counter()
    first, ids = None, []
    for event in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           stream=True, **(sampling or {"temperature": 0})):
        if first is None and event.choices and event.choices[0].text:
            first = time.perf_counter() - t0
        stats = (event.model_extra or {}).get("packed_ss")
        if stats:
            ids = stats["token_ids"]
    latency = time.perf_counter() - t0
    return {"ids": ids, "latency": latency, "ttft": latency if first is None else first}


def _run(client, model, prompts, args, concurrency) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(lambda i: _one(client, model, prompts[i], args.max_tokens,
                                           _sampling(i, args.mixed)), range(len(prompts))))
    return out, time.perf_counter() - t0


def _row(schedule, c, out, wall, base_tps) -> dict:
    tokens = sum(len(o["ids"]) for o in out)
    lat, ttft = [o["latency"] for o in out], [o["ttft"] for o in out]
    tps = tokens / wall
    return {"schedule": schedule, "clients": c, "requests": len(out), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tps, "vs_sequential": tps / (base_tps or tps),
            "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p95_s": float(np.percentile(lat, 95)),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p95_s": float(np.percentile(ttft, 95))}


def _short_behind_long(client, model, args) -> dict:
    """A short request's latency alone, then sent while a long one decodes."""
    short = "Question: Ava has 3 apples. How many?\nAnswer:"
    alone = min(_one(client, model, short, 8)["latency"] for _ in range(3))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(_one, client, model, "Question:", args.long_tokens)
        time.sleep(0.2)
        beside = _one(client, model, short, 8)["latency"]
        long_s = long.result()["latency"]
    return {"short_alone_s": alone, "short_beside_long_s": beside, "long_s": long_s,
            "ratio": beside / alone}


def measure(args, schedule: str) -> tuple[list[dict], dict, list[str]]:
    import openai

    prompts = [t.text for t in tasks.load("arithmetic", None, args.requests)]
    with Server(args, schedule) as server:
        client = openai.OpenAI(base_url=server.base, api_key="none", timeout=600,
                               max_retries=0)
        model = client.models.list().data[0].id
        rows, want, base_tps = [], None, None
        for c in args.concurrency:
            out, wall = _run(client, model, prompts, args, c)
            ids = [o["ids"] for o in out]
            if want is None:
                want = ids
            elif ids != want:
                raise SystemExit(f"{schedule}, {c} clients: the tokens differ from the "
                                 "first run's")
            rows.append(_row(schedule, c, out, wall, base_tps))
            base_tps = base_tps or rows[-1]["tokens_per_s"]
        return rows, _short_behind_long(client, model, args), server.startup


def _table(rows, behind) -> str:
    lines = ["| schedule | clients | tokens/s | vs 1 client | latency p50 / p95 (s) | "
             "TTFT p50 / p95 (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['clients']} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_sequential']:.2f}x | {r['latency_p50_s']:.3f} / "
                     f"{r['latency_p95_s']:.3f} | {r['ttft_p50_s']:.3f} / "
                     f"{r['ttft_p95_s']:.3f} |")
    lines += ["", "| schedule | short alone (s) | short beside a long one (s) | ratio |",
              "|---|---|---|---|"]
    for s, b in behind.items():
        lines.append(f"| {s} | {b['short_alone_s']:.3f} | {b['short_beside_long_s']:.3f} | "
                     f"{b['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _arguments(argv)
    rows, behind, startup = [], {}, {}
    for schedule in args.schedules.split(","):
        r, b, s = measure(args, schedule)
        rows += r
        behind[schedule], startup[schedule] = b, s
        print(f"{schedule}: {s[-2] if len(s) > 1 else ''}", file=sys.stderr, flush=True)
    print(_table(rows, behind))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows,
             "short_behind_long": behind, "startup": startup}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
