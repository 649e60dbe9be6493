"""What a job over k slots pays before its first step, beyond a one-slot job: a one-slot segment is forked from
the sweep's warm forkserver (torch and the trainer already imported), while a k-slot segment is a fresh
``stratum train`` launcher that spawns k fresh rank interpreters, each importing torch and the trainer on the
same cores. Measured here as exactly that — one interpreter importing what the launcher imports, then k at once
importing what a rank imports — once per machine, cached beside its hardware spec (``stratum hardware probe``'s,
in the data cache directory; delete it to measure again)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from stratum.atomic import atomic_write_text
from stratum.errors import StratumError

LAUNCHER_IMPORTS = "import stratum.parallel.compose, stratum.data.prepare, stratum.train.trainer"
RANK_IMPORTS = "import stratum.train.trainer, torch.distributed"
IMPORT_TIMEOUT_S = 300.0


def launch_seconds(processes: int, cache_dir: Path) -> float:
    """Seconds a ``processes``-rank ``stratum train`` spends starting (launcher, then its ranks together) that a
    forked one-slot worker does not; cached in ``cache_dir``."""
    path = cache_dir / f"{socket.gethostname()}-launch{processes}.json"
    if path.is_file():
        return float(json.loads(path.read_text())["seconds"])
    seconds = _imports_s([LAUNCHER_IMPORTS]) + _imports_s([RANK_IMPORTS] * processes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"processes": processes, "seconds": seconds}))
    return seconds


def _imports_s(snippets: list[str]) -> float:
    """Wall seconds for fresh interpreters running ``snippets`` at once."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", s], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for s in snippets]
    try:
        for p in procs:
            _, err = p.communicate(timeout=IMPORT_TIMEOUT_S)
            if p.returncode != 0:
                raise StratumError(f"a fresh interpreter cannot import Stratum ({err.decode(errors='replace')[-200:]}"
                                   "); jobs over several slots start one per rank")
    except subprocess.TimeoutExpired:
        raise StratumError(f"importing Stratum in a fresh interpreter took over {IMPORT_TIMEOUT_S:g} s; jobs over "
                           "several slots start one per rank: use sweep.plans = [\"local\"]") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return time.perf_counter() - t0
