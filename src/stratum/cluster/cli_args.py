"""``stratum cluster``'s arguments (:mod:`stratum.cluster.cli` runs it): argparse only, so the command line's
grammar and ``--help`` answer without importing torch."""

from __future__ import annotations


def add_parser(sub) -> None:
    # (the simulate-only options default to None, so that trace can refuse them: their defaults are simulate's)
    p = sub.add_parser("cluster", help="SIMULATED cluster: replay a job trace under static-dp, burst, "
                                       "burst+multiplex or elastic allocation; generate traces")
    p.add_argument("action", choices=("simulate", "trace"),
                   help="simulate: replay --jobs on --hardware; trace: write a generated trace to --out")
    p.add_argument("--hardware", metavar="FILE.toml", help="the hardware spec ([hardware] table)")
    p.add_argument("--jobs", metavar="FILE.csv | N", help="simulate: the trace; trace: how many jobs")
    p.add_argument("--policy", metavar="P[,P]",
                   help="simulate: static-dp, burst, burst+multiplex, elastic, elastic-devices, a comma-separated "
                        "list, or all (default)")
    p.add_argument("--png", metavar="FILE.png", help="simulate: write utilisation over time")
    p.add_argument("--json", metavar="FILE.json", help="simulate: write the results")
    p.add_argument("--until", type=float, metavar="SECONDS",
                   help="simulate: stop at this time (default: when every job is done)")
    p.add_argument("--amplification", type=float,
                   help="burst plans: a block's device-seconds at most this × its one-device cost (default 2)")
    p.add_argument("--restart-startup", type=float, metavar="SECONDS",
                   help="elastic: start-up seconds of a restarted job, on top of moving its state (default 30)")
    p.add_argument("--interference", type=float,
                   help="burst+multiplex: the share both sides lose when background work shares a foreground "
                        "job's devices (default 0.1)")
    p.add_argument("--out", metavar="FILE.csv", help="trace: where to write it")
    p.add_argument("--seed", type=int, help="trace: the generator's seed (default 0)")
    p.add_argument("--models", metavar="M[,M]", help="trace: the presets jobs are drawn from (default: "
                                                     "gpt2-124m,gpt2-355m,gpt2-774m,gpt2-1.5b)")
    p.add_argument("--seq-len", type=int, metavar="N", help="trace: tokens per sequence (default 1024)")
    p.add_argument("--load", type=float,
                   help="trace: device-hours asked for per cluster device-hour (default 1.0)")
    p.add_argument("--cache-dir", metavar="DIR", help="where measured model costs are kept (default: Stratum's "
                                                       "cache directory)")
