"""Benchmark: the plain engine (Stratum's reference) against a hand-written PyTorch loop, per GPT preset.

Every later engine is measured against the plain engine; this script shows what the plain engine itself costs
over the simplest possible PyTorch training loop on the same model, batches and AdamW.

Runbook::

    python benchmarks/plain_engine.py                                  # tiny, mini, small, gpt2-124m
    python benchmarks/plain_engine.py --presets gpt2-124m --steps 6 --repeats 3

Each (preset, side) runs in its own process (so peak RSS is that run's alone), the two sides alternate, and the
median over repeats is reported. Writes ``benchmarks/results/plain_engine.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "plain_engine.json"
SEQ_LEN = {"tiny": 128, "mini": 128, "small": 256, "gpt2-124m": 256}


def worker(preset: str, side: str, steps: int, micro_batch: int, seq_len: int, cache_dir: str) -> dict:
    import torch

    from stratum.config import load_config
    from stratum.data.prepare import prepare_data
    from stratum.data.tokens import TRAIN
    from stratum.model.build import build_model
    from stratum.parallel.compose import make_engine
    from stratum.runtime.device import peak_rss_bytes, resolve_device

    cfg = load_config(None, [f"model.preset={preset!r}", f"data.seq_len={seq_len}",
                             f"train.micro_batch_size={micro_batch}", f"data.cache_dir={cache_dir!r}"])
    data = prepare_data(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, tokenizer_vocab=256, seq_len=seq_len, seed=0)
    device = resolve_device("auto")
    batches = [data.sampler.micro_batches(TRAIN, s, micro_batch, 1) for s in range(steps + 2)]
    if side == "stratum":
        engine = make_engine(cfg, model, device)

        def step(b):
            return engine.train_step(b, 1e-4).loss
    else:  # the simplest PyTorch loop: same model, same fused AdamW, same clipping
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

        def step(b):
            loss = model.loss(b[0].x.to(device), b[0].y.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    times = []
    for b in batches:
        t0 = time.perf_counter()
        step(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times[2:])  # two warm-up steps
    tokens = micro_batch * seq_len
    flops = model.flops_per_token(seq_len) * tokens
    return {"preset": preset, "side": side, "params": model.num_params(), "step_s": dt,
            "tokens_per_s": tokens / dt, "tflops": flops / dt / 1e12, "peak_rss_bytes": peak_rss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,mini,small,gpt2-124m")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (after 2 warm-up steps)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "stratum"))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--worker", nargs=2, metavar=("PRESET", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        preset, side = args.worker
        print(json.dumps(worker(preset, side, args.steps, args.micro_batch, SEQ_LEN.get(preset, 256),
                                args.cache_dir)))
        return

    results = []
    for preset in args.presets.split(","):
        runs = {"stratum": [], "torch": []}
        for _ in range(args.repeats):
            for side in ("torch", "stratum"):
                out = subprocess.run([sys.executable, __file__, "--worker", preset, side, "--steps", str(args.steps),
                                      "--micro-batch", str(args.micro_batch), "--cache-dir", args.cache_dir],
                                     check=True, capture_output=True, text=True)
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = {"preset": preset, "params": runs["stratum"][0]["params"], "seq_len": SEQ_LEN.get(preset, 256),
               "micro_batch": args.micro_batch}
        for side, rs in runs.items():
            row[side] = {k: statistics.median(r[k] for r in rs)
                         for k in ("tokens_per_s", "tflops", "step_s", "peak_rss_bytes")}
        row["ratio_tokens_per_s"] = row["stratum"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
        results.append(row)
        print(f"{preset:>10} {row['params']:>12,} params  plain {row['stratum']['tokens_per_s']:>9,.0f} tok/s "
              f"{row['stratum']['tflops']:.3f} TFLOP/s  peak RSS {row['stratum']['peak_rss_bytes'] / 2**20:,.0f} MiB"
              f"  | torch loop {row['torch']['tokens_per_s']:>9,.0f} tok/s  ratio {row['ratio_tokens_per_s']:.3f}",
              flush=True)
    doc = {"benchmark": "plain_engine", "measured": True, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": args.repeats, "steps": args.steps,
           "results": results}
    sys.path.insert(0, str(HERE.parent / "src"))
    from stratum.atomic import atomic_write_json
    atomic_write_json(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
