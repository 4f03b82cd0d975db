"""`python -m packed_ss_jax.training`: train a small model from scratch (seeded)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from .train import FAMILIES, TrainConfig

    p = argparse.ArgumentParser(prog="python -m packed_ss_jax.training",
                                description="Train a small self-speculative model (Nemotron-Labs-"
                                            "Diffusion: AR + diffusion drafting; SetDLM: the "
                                            "two-stream any-order objective) and save it in its "
                                            "family's release layout.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--family", choices=sorted(FAMILIES), default="nemotron",
                   help="nemotron (default; the embedded nld-tiny) or setdlm (setdlm-tiny)")
    p.add_argument("--steps", type=int, default=None, help="default: the family's")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--problems", type=int, default=None, metavar="N",
                   help="arithmetic problems in the training corpus (default: the family's, "
                        "as the embedded model was trained); the practice and copying sheets "
                        "number half as many each, and the tokenizer learns from at most N "
                        "problems: a small N makes a short trial run start in seconds")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (and save) after this much wall time")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="afterwards, measure accuracy and tokens/NFE on N held-out problems")
    args = p.parse_args(argv)
    given = {k: v for k, v in (("steps", args.steps), ("batch", args.batch),
                               ("seq_len", args.seq_len), ("lr", args.lr)) if v is not None}
    if args.problems is not None:
        if args.problems < 1:
            p.error(f"--problems must be at least 1, got {args.problems}")
        given |= {"n_problems": args.problems, "n_drills": max(args.problems // 2, 1),
                  "n_recall": max(args.problems // 2, 1),
                  "tokenizer_problems": min(args.problems,
                                            TrainConfig.tokenizer_problems)}
    tc = TrainConfig.for_family(args.family, seed=args.seed, **given)
    model_kw = {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate}
    from .train import train

    train(args.out, tc, model_kw, max_minutes=args.max_minutes)
    if args.eval:
        from .evaluate import evaluate, print_report

        print_report(evaluate(args.out, n_arith=args.eval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
