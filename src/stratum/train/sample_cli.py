"""``stratum sample``: the command's flags and its run; the work is in :mod:`stratum.train.sample`.

    stratum sample runs/default --prompt "def " --tokens 200 --temperature 0.8 --top-k 200 --seed 1

This module imports nothing heavy at load, so building the CLI's parser stays quick.
"""

from __future__ import annotations

import argparse
import sys

from stratum.errors import StratumError

DEFAULT_TOKENS = 200
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 200
DEFAULT_SEED = 1337


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sample", help="generate text from a trained checkpoint (any model source)")
    p.add_argument("run", nargs="?", default="runs/default", metavar="RUN",
                   help="a run's out_dir (its latest checkpoint) or a checkpoints/step_* directory "
                        "(default: runs/default)")
    p.add_argument("--prompt", default="\n", help="text the samples continue (default: a newline)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"tokens to generate per sample (default: {DEFAULT_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"softmax temperature; 0 = greedy (default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, metavar="K",
                   help=f"draw from the K most likely tokens; 0 = all (default: {DEFAULT_TOP_K})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"the draws' seed: the same seed gives the same text (default: {DEFAULT_SEED})")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="independent samples to print (default: 1)")
    return p


def run(args: argparse.Namespace) -> int:
    from stratum.train.sample import SampleSpec, generate
    from stratum.train.trained import load_trained

    spec = SampleSpec(new_tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                      num_samples=args.num_samples)
    spec.validate()  # before the checkpoint is read: a bad flag answers at once
    trained = load_trained(args.run)
    tok = trained.tokenizer
    prompt = [int(i) for i in tok.encode(args.prompt.encode("utf-8", errors="surrogateescape"))]
    if not prompt:
        raise StratumError("the prompt encodes to no tokens; give a non-empty --prompt")
    # on stderr: standard output holds the samples alone, ready to redirect
    print(f"sampling {trained.model.info.name} ({trained.cfg.model.source} source, step {trained.step}) from "
          f"{trained.path}", file=sys.stderr)
    out = generate(trained.model, prompt, spec, window=trained.cfg.data.seq_len, vocab=tok.vocab_size)
    for i, row in enumerate(out.tolist()):
        if spec.num_samples > 1:
            print(f"---------- sample {i + 1}")
        print(tok.decode(row))
    return 0
