"""Processes for multi-process plans: spawn local workers, or join a ``torchrun`` job; the default group.

Three ways a run gets its processes:

- ``stratum train`` with a plan of N > 1 processes (``parallel.plan``) on a plain shell: the CLI checks the plan,
  prepares the data once, then :func:`spawn_local` starts N copies of the same command as workers
  (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` on a free local port, plus
  ``STRATUM_WORKER=1``) and waits for them; ``stratum run --nproc N script.py`` does the same for a user's script.
  On Linux the workers are forked from a warm forkserver (:mod:`stratum.dist.forked_rank`: torch imported once,
  not once per worker); ``STRATUM_SPAWN=exec`` starts each as a fresh ``python`` instead;
- ``torchrun --nproc_per_node N -m stratum train ...`` (also multi-node, with torchrun's rendezvous): torchrun
  sets the same variables, the CLI sees them and runs as a worker directly;
- a one-process plan needs no group at all (:func:`stratum.dist.world.join_world`).

Every wait has a limit: the process groups are created with ``parallel.timeout_s`` (collectives and start-up),
and the pipeline runtime waits on its point-to-point messages with the same limit. A peer that dies or hangs
surfaces as :class:`~stratum.errors.PeerError` (exit code 3), a one-line message naming the rank and what it waited for.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stratum.dist.forked import die_with_parent
from stratum.dist.forked_rank import ForkedRank
from stratum.dist.roles import WORKER_ENV, env_rank, forking, under_torchrun
from stratum.errors import INTERRUPTED, PeerError, StratumError
from stratum.procs import Terminated, sigterm_as_interrupt, usable_cores


def rank() -> int:
    """This process's rank in the default group (0 when there is none)."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0 (or no process group): the process that prints and writes."""
    return rank() == 0


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise StratumError("parallel.backend = 'nccl' needs CUDA devices (train.device = cuda); "
                           "use parallel.backend = 'gloo' on the CPU")
    return backend


def local_device(device: torch.device) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` for a CUDA run, the given device otherwise."""
    if device.type != "cuda":
        return device
    _, _, local = env_rank()
    n = torch.cuda.device_count()
    if local >= n:
        raise StratumError(f"local rank {local} has no GPU (this machine has {n}); start at most {n} processes "
                           "per machine")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_process_group(*, world: int, plan: str, backend: str, device: torch.device, timeout_s: float) -> bool:
    """Create the default process group for this process unless one exists; True when this call created it.

    Under a launcher the group comes from ``env://``; without one only ``world = 1`` is possible (a private
    in-memory store). ``world`` must equal the launcher's WORLD_SIZE; ``plan`` (the plan's expression) is named
    in the errors, since the user may have set its sizes through a shorthand such as pipeline.ranks.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise StratumError(f"the plan {plan} needs {_processes(world)} but the process group has "
                               f"{dist.get_world_size()}")
        return False
    backend = resolve_backend(backend, device)
    timeout = datetime.timedelta(seconds=timeout_s)
    rk, ws, _ = env_rank()
    if not under_torchrun():
        if world != 1:
            raise StratumError(f"the plan {plan} needs {world} processes: run it with `stratum train` (which spawns "
                               f"them) or `torchrun --nproc_per_node {world} -m stratum train ...`; a script of your "
                               f"own with `stratum run --nproc {world} script.py`")
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return True
    if ws != world:
        raise StratumError(f"the plan {plan} needs {_processes(world)} but the launcher started WORLD_SIZE = {ws}; "
                           f"start {_processes(world)} or change the plan's sizes (parallel.plan, or pipeline.ranks "
                           "under train.engine = pipeline)")
    try:
        dist.init_process_group(backend, init_method="env://", rank=rk, world_size=ws, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    except (RuntimeError, ValueError) as e:  # rendezvous failures (a peer never came, port in use, ...)
        raise PeerError(f"rank {rk}: cannot join the process group within {timeout_s:g} s: "
                        f"{_first_line(e)}") from None
    return True


def destroy_process_group() -> None:
    """Leave the default group after a clean run. Every rank first meets the others (a barrier bounded by the
    group's timeout): a rank tearing gloo down while a peer still has work in flight on the same pairs can abort
    that peer at exit ("terminate called without an active exception")."""
    import torch.distributed as dist
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def short_reason(e: BaseException) -> str:
    """The gist of a torch.distributed error: first sentence, without gloo's ``[file.cc:123]`` prefix."""
    text = _first_line(e)
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0][:160]


def from_backend(e: BaseException) -> bool:
    """Whether ``e`` is the process group's report of a failed exchange (a peer gone, a wait past the group's
    timeout) rather than a fault of this rank's own: torch's ``DistError`` family (NCCL, the store), or gloo's
    transport errors, which reach Python as plain ``RuntimeError`` with gloo's source file as their prefix."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError)
                                             and re.match(r"\[[^\]]*/gloo/", _first_line(e)) is not None)


def wait_until(work, *, backend: str, deadline: float) -> None:
    """Wait for a ``torch.distributed`` work handle until ``deadline`` (``time.monotonic()`` seconds).

    Raises ``TimeoutError`` at the deadline; a failed peer surfaces as the backend's ``RuntimeError``. gloo's
    ``wait`` takes a timeout; NCCL work is polled, since its ``wait`` only orders the CUDA stream.
    """
    if backend == "nccl":
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(5e-5)
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The worker gets SIGTERM when the launcher dies, so no orphan keeps waiting on its peers."""
    die_with_parent(signal.SIGTERM)


def _start_rank(argv: list[str], env: dict[str, str], rank: int) -> ForkedRank | subprocess.Popen:
    """``python <argv>`` with ``env`` as rank ``rank``: forked from the warm server, or exec'd."""
    if forking():
        return ForkedRank(argv, env, name=f"stratum-rank-{rank}")
    return subprocess.Popen([sys.executable, *argv], env=env, preexec_fn=_die_with_parent, stderr=subprocess.PIPE,
                            text=True, bufsize=1)


class _ErrorDedup:
    """Forwards the workers' stderr line by line; an error line every rank prints alike is shown once.

    With a ``log`` file, only Stratum's own lines (``stratum: …``) reach the terminal; everything else a worker
    writes there — a traceback, torch's C++ frames, gloo's messages — goes to the log, marked with its rank, and
    the last such line of each rank is kept to name a crash in one line."""

    def __init__(self, log: Path | None = None):
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.log = log
        self.reported: set[int] = set()
        """Ranks that printed a ``stratum: error:`` line themselves."""
        self.last_other: dict[int, str] = {}

    def follow(self, stream, rank: int) -> None:
        def pump():
            for line in stream:
                with self.lock:
                    self._route(line, rank)
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.threads.append(t)

    def _route(self, line: str, rank: int) -> None:
        if line.startswith("stratum: error:") or line.startswith(INTERRUPTED):
            if line.startswith("stratum: error:"):
                self.reported.add(rank)
            if line in self.seen:
                return
            self.seen.add(line)
        elif self.log is not None and not line.startswith("stratum:"):
            if line.strip():  # torch marks a rank's own traceback lines "[rankN]: "; the log says the rank already
                self.last_other[rank] = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
            try:
                with self.log.open("a") as fh:
                    fh.write(f"[rank {rank}] {line}")
                return
            except OSError:
                pass  # an unwritable log must not hide the line: it goes to the terminal
        sys.stderr.write(line)
        sys.stderr.flush()

    def crash_line(self, rank: int, code: int) -> str | None:
        """The one line for a rank that failed without saying why itself; None where it did."""
        if rank in self.reported:
            return None
        gist = f": {self.last_other[rank][:200]}" if rank in self.last_other else ""
        where = f"; its output is in {self.log}" if self.log is not None else ""
        return f"stratum: error: rank {rank} failed with exit code {code}{gist}{where}"

    def join(self, timeout_s: float = 5.0) -> None:
        for t in self.threads:
            t.join(timeout_s)


class Stopped(KeyboardInterrupt):
    """The launcher's job was stopped (Ctrl-C, SIGTERM) and its ranks have ended; ``shown``: they said so."""

    def __init__(self, *, shown: bool):
        super().__init__()
        self.shown = shown


PEER_GRACE_S = 5.0
"""Seconds the other ranks get after one failed, when the caller asks for it (``fail_grace_s``): a live rank
blocked on the failed one is stopped by its own time limit anyway, and a stopped (SIGSTOP) or hung one never
exits by itself — waiting longer only delays the end of the run."""


def rank_env(rank: int, world: int, *, local_rank: int, local_world: int, master: tuple[str, int]) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world`` (rendezvous at ``master``: address, port), and the
    mark of a worker this process group's launcher started."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world),
                MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), **{WORKER_ENV: "1"})


MAX_PER_CORE = 16
"""The most local processes a run starts per usable core: beyond it each would get a sliver of a core and its own
copy of the runtime in memory, so a larger count (replicate(1000) on a laptop) is a typo, refused before any
process starts rather than left to exhaust the machine."""


def check_local_count(nprocs: int) -> None:
    """Refuse ``nprocs`` local processes where that is more than :data:`MAX_PER_CORE` a usable core."""
    cores = usable_cores()
    if nprocs > MAX_PER_CORE * cores:
        raise StratumError(f"{nprocs:,} local processes on {cores} usable core(s) is more than {MAX_PER_CORE} a core; "
                           f"use at most {MAX_PER_CORE * cores:,} here, or spread a run over machines "
                           "(torchrun --nnodes)")


STOPPED = 130
"""A rank's exit code after a requested stop (SIGINT, SIGTERM): it finished its step and checkpointed."""


def _await_stop(procs: list, grace_s: float) -> None:
    """After a stop was forwarded: every rank finishes its step and writes its checkpoint, however long its step
    takes; once one has ended, the others get ``grace_s`` to follow (a peer that hung leaves the rest to their
    collectives' time limits), then are killed. A second interrupt kills them at once."""
    deadline = None
    try:
        while any(p.poll() is None for p in procs):
            if deadline is None and any(p.poll() is not None for p in procs):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def spawn_local(argv: list[str], nprocs: int, *, grace_s: float, env: dict[str, str] | None = None,
                log: Path | None = None, fail_grace_s: float | None = None) -> int:
    """Run ``python <argv>`` (``-m stratum train …``, or a user's script and its arguments) as ``nprocs`` local
    worker processes and wait for all of them.

    Returns 0 when every worker succeeded, else the exit code of the first worker that failed. When one fails,
    the others get ``grace_s`` seconds to notice (they stop with their own one-line error), then are killed.
    """
    check_local_count(nprocs)
    port = free_port()
    procs: list[ForkedRank | subprocess.Popen] = []
    errors = _ErrorDedup(log)
    base = dict(os.environ, **(env or {}))
    for r in range(nprocs):
        e = dict(base, **rank_env(r, nprocs, local_rank=r, local_world=nprocs, master=("127.0.0.1", port)))
        # CPU workers share the cores: keep torch's intra-op pool from oversubscribing them
        if "OMP_NUM_THREADS" not in base:
            e["OMP_NUM_THREADS"] = str(max(1, usable_cores() // nprocs))
        procs.append(_start_rank(argv, e, r))
        errors.follow(procs[-1].stderr, r)
    first_fail: tuple[int, int] | None = None
    fail_grace = grace_s if fail_grace_s is None else fail_grace_s
    deadline = None
    killed_here: set[int] = set()
    # SIGTERM to the launcher stops the job as Ctrl-C does: forwarded, each rank checkpoints and exits
    try:
        with sigterm_as_interrupt():
            while True:
                codes = [p.poll() for p in procs]
                for r, c in enumerate(codes):
                    if c not in (None, 0) and first_fail is None:
                        first_fail = (r, c)
                        deadline = time.monotonic() + fail_grace
                if all(c is not None for c in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            p.kill()
                            killed_here.add(r)
                    for p in procs:
                        p.wait()
                    break
                time.sleep(0.05)
    except KeyboardInterrupt as e:
        sig = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT  # (each rank says which stopped it)
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        _await_stop(procs, grace_s)
        errors.join()
        raise Stopped(shown=any(line.startswith(INTERRUPTED) for line in errors.seen)) from e
    errors.join()
    if first_fail is None:
        return 0
    # A rank killed by a signal is the cause, even when a peer noticed the broken connection and exited first.
    final = [p.wait() for p in procs]  # every rank has ended by now
    died = [(r, c) for r, c in enumerate(final) if c < 0 and r not in killed_here]
    if died:
        r, c = died[0]
        name = signal.Signals(-c).name if -c in signal.Signals._value2member_map_ else str(-c)
        print(f"stratum: error: rank {r} was killed by {name}; the other ranks stopped",
              file=sys.stderr)
        return 3
    for r in sorted(killed_here):  # (one a peer timed out waiting on is the one that hung)
        print(f"stratum: error: rank {r} had not ended {fail_grace:g} s after rank {first_fail[0]} stopped; it was "
              "killed", file=sys.stderr)
    # a rank that crashed without a word of its own is the cause, whichever rank the others' errors reached first;
    # one that stopped on a signal it was sent (SIGTERM, Ctrl-C: exit 130, with a checkpoint) did not crash
    for r, c in enumerate(final):
        if c not in (0, STOPPED) and r not in killed_here:
            if (line := errors.crash_line(r, c)) is not None:
                print(line, file=sys.stderr)
    return first_fail[1]
