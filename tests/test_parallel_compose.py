"""Plans as engines, end to end: what `--dry-run` shows, bad plans refused before any process starts, a dead rank
stopping a composed plan, two torchrun "nodes" joined by rendezvous, and a user's own script on a plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_in_process import run_main

from stratum.dist.launch import free_port
from stratum.train.trainer import read_metrics, train

ROOT = Path(__file__).resolve().parents[1]


def _base(cfg) -> list[str]:
    d, t = cfg.data, cfg.train
    return [f"data.corpus={d.corpus!r}", f"data.cache_dir={d.cache_dir!r}", f"data.seq_len={d.seq_len}",
            "model.preset='tiny'", f"train.micro_batch_size={t.micro_batch_size}", f"train.steps={t.steps}",
            f"train.eval_interval={t.eval_interval}", f"train.eval_batches={t.eval_batches}",
            f"optim.warmup_steps={cfg.optim.warmup_steps}", f"optim.lr={cfg.optim.lr}", f"train.out_dir={t.out_dir!r}"]


def _sets(items: list[str]) -> list[str]:
    return [a for o in items for a in ("--set", o)]


def _same_losses(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=rel)


def test_dry_run_prints_the_plan_its_batch_math_and_who_holds_what(make_cfg, capsys):
    from stratum.cli import main
    cfg = make_cfg()
    plan = "replicate(2, pipeline(2, split(2)))"
    assert main(["train", "--dry-run", *_sets(_base(cfg) + [f"parallel.plan={plan!r}", "train.grad_accum=3"])]) == 0
    out = capsys.readouterr().out
    assert "plan replicate(2, pipeline(2, schedule=1f1b, partition=even, split(2))) on 8 process(es)" in out
    assert "global batch = 4 (micro) × 3 (accum) × 2 (replicas) = 24 sequences" in out
    assert "processes: 8 (replicas × pipeline ranks × splits = 2 × 2 × 2)" in out
    rows = [ln.split() for ln in out.splitlines() if "1/2 of each layer's heads" in ln]
    # rank, replica, pipeline rank, split, blocks: replicas outermost, splits innermost; tiny's 4 blocks in 2 stages
    assert [r[:5] for r in rows] == [[str(k), str(k // 4), str(k // 2 % 2), str(k % 2), "0-1" if k // 2 % 2 == 0
                                      else "2-3"] for k in range(8)]
    assert rows[5][-2:] == ["(shard", "1)"]


def test_dry_run_prints_each_pipeline_ranks_offload_placement_under_the_leafs_budget(make_cfg, capsys):
    """The dry run plans each pipeline rank's blocks under the leaf's own budget as the rank does at start-up:
    a budget that fits the ranks is planned per rank; one that does not says so per rank, with the smallest budget
    the rank itself would name (and the dry run exits 2, as the run would not start)."""
    from stratum.cli import main
    cfg = make_cfg()
    for budget, fits in (("1%", False), ("200%", True)):
        plan = f"pipeline(2, offload(device_budget={budget}))"
        assert main(["train", "--dry-run", *_sets(_base(cfg) + [f"parallel.plan={plan!r}"])]) == (0 if fits else 2)
        out = capsys.readouterr().out
        assert "pipeline rank 0 (blocks 0–1):" in out and "pipeline rank 1 (blocks 2–3):" in out
        assert out.count("offload plan:") == (2 if fits else 0)
        assert out.count("does not fit — offload: no placement fits offload.device_budget = " + budget) == \
            (0 if fits else 2)


def test_dry_run_cuts_the_pipeline_by_the_given_speeds_as_the_run_does(make_cfg, capsys):
    """parallel.speeds given as numbers: the dry run's table is the cut the ranks make (a faster rank more
    blocks; the run cuts by rank_model's plan_pipeline with the same speeds)."""
    from stratum.cli import main
    cfg = make_cfg()
    sets = _base(cfg) + ["parallel.plan='pipeline(2, partition=balanced)'", "parallel.speeds='1000,1'"]
    assert main(["train", "--dry-run", *_sets(sets)]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if "whole parameters" in ln]
    assert [r[4] for r in rows] == ["0-2", "3"]  # tiny's 4 blocks: without speeds 0-1 and 2-3


@pytest.mark.parametrize("speeds, message", [
    ("1,1,3,3", "runs exactly 2 micro-batches a step, and parallel.speeds gives the replicas 1, 3 of a step's 4"),
    ("auto", "runs exactly 2 micro-batches a step, and parallel.speeds = auto shares a step's micro-batches"),
])
def test_replicas_of_a_fixed_count_schedule_must_share_a_step_evenly(make_cfg, tmp_path, capsys, speeds, message):
    """A schedule file runs one count of micro-batches: replicas given unequal (or measured) speeds would run
    others, and the run would fail after its start. One line before any process; equal speeds run."""
    from stratum.cli import main
    from stratum.schedule.generators import generate
    from stratum.schedule.textio import save
    cfg = make_cfg()
    path = tmp_path / "two.txt"
    save(generate("1f1b", ranks=2, microbatches=2), path)
    plan = f"replicate(2, pipeline(2, schedule={path}))"
    code = main(["train", *_sets(_base(cfg) + [f"parallel.plan={plan!r}", "train.grad_accum=2",
                                               f"parallel.speeds={speeds!r}"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "give the replicas equal speeds" in err and "\n" not in err, err
    assert not Path(cfg.train.out_dir).exists()
    # a generated kind takes every share
    assert main(["train", "--dry-run", *_sets(_base(cfg) + ["parallel.plan='replicate(2, pipeline(2))'",
                                                             "train.grad_accum=2", f"parallel.speeds={speeds!r}"])]) == 0


# ---- bad plans: one line before any process starts -----------------------------------------------------------------
@pytest.mark.parametrize("plan, message", [
    ("replicate(0)", "replicate(0) must have at least 1 process"),
    ("split(2, pipeline(2))", "split cannot hold pipeline"),
    ("pipeline(8)", "needs 8 stages but the model has only 4 blocks"),
    ("split(3)", "has 2 attention heads, not divisible by 3"),
    ("split(2, split(2, offload(device_budget=25%)))", "split cannot hold split"),
    ("replicate(2, shard=true, split(2, offload(device_budget=25%)))", "cannot shard split"),
    ("pipeline(2, schedule=zb-1f1b, split(2, offload))", "splits the backward"),
    ("pipeline(2, schedule=zb-1f1b, offload)", "splits the backward"),
    ("replicate(2, shard=true, split(2))", "cannot shard split"),
    ("pipeline(2, schedule=1f1b, partition=profiled)", "names a cut from a profile: give the profile's file"),
])
def test_bad_plans_are_one_line_errors_before_any_process(make_cfg, capsys, plan, message):
    from stratum.cli import main
    cfg = make_cfg()
    t0 = time.perf_counter()
    code = main(["train", *_sets(_base(cfg) + [f"parallel.plan={plan!r}"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("stratum: error:") and message in err and "\n" not in err, err
    assert time.perf_counter() - t0 < 20
    assert not Path(cfg.train.out_dir).exists()


def test_a_launcher_with_another_world_size_is_refused(make_cfg, capsys, monkeypatch):
    from stratum.cli import main
    cfg = make_cfg()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code = main(["train", *_sets(_base(cfg) + ["parallel.plan='replicate(2)'"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs 2 processes but the launcher started WORLD_SIZE = 3" in err


# ---- failures and launchers ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_rank_stops_a_replicated_pipeline_naming_the_rank(make_cfg, tmp_path):
    cfg = make_cfg("train.steps=50", out=tmp_path / "run")
    mark = tmp_path / "fault_time"
    p = subprocess.run([sys.executable, "-m", "stratum", "train",
                        *_sets(_base(cfg) + ["parallel.plan='replicate(2, pipeline(2))'", "train.grad_accum=2",
                                             "parallel.timeout_s=4"])],
                       capture_output=True, text=True, timeout=150,
                       env=dict(os.environ, STRATUM_TEST_FAULT="1:2:1", STRATUM_TEST_FAULT_FILE=str(mark)))
    assert p.returncode == 3 and mark.exists(), p.stderr
    assert time.time() - float(mark.read_text()) < 60
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and all(ln.startswith("stratum: error:") for ln in lines), p.stderr
    assert "stratum: error: rank 1 was killed by SIGKILL" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_joined_by_rendezvous_match_plain(make_cfg, tmp_path):
    """Two torchrun launches (2 "nodes" × 2 processes) meet at a c10d rendezvous on 127.0.0.1 and train
    replicate(2, pipeline(2)) like the plain engine on the same global batch."""
    plain = make_cfg("train.grad_accum=4", out=tmp_path / "plain")
    train(plain)
    cfg = make_cfg(out=tmp_path / "nodes")
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stratum-test",
           "-m", "stratum", "train", *_sets(_base(cfg) + ["parallel.plan='replicate(2, pipeline(2))'",
                                                          "train.grad_accum=2"])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(2)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outs
    _same_losses(read_metrics(tmp_path / "nodes"), read_metrics(tmp_path / "plain"))
    assert sum(o.count("done:") for o in outs) == 1  # only rank 0 prints


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("differ", ["config", "checkpoint"])
def test_torchrun_nodes_that_differ_stop_before_training(make_cfg, tmp_path, differ):
    """Each torchrun node runs its own command on its own files: a setting given differently, or a node that
    finds no checkpoint where the other resumes, stops every rank in one line naming it — nothing trained, no
    checkpoint written (both used to train a mixed model, or fail later in a collective naming no cause)."""
    base = _base(make_cfg(out=tmp_path / "a")) + ["parallel.plan='replicate(2)'", "train.ckpt_interval=2"]
    if differ == "checkpoint":  # node a resumes a run, node b (its own out_dir) starts afresh
        assert run_main(["train", *_sets(base + ["train.steps=2"])])[0] == 0
    before = sorted((tmp_path / "a").rglob("*"))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = []
    for node, extra in (("a", []), ("b", ["optim.lr=0.005"] if differ == "config" else [])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stratum-differ",
               "-m", "stratum", "train", *_sets(base + [f"train.out_dir={str(tmp_path / node)!r}"] + extra)]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    assert all(n.returncode != 0 for n in nodes), outs
    said = "the ranks differ in " + ("optim.lr" if differ == "config" else "the checkpoint resumed")
    assert all(said in o for o in outs), outs
    assert sorted((tmp_path / "a").rglob("*")) == before and not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_script_on_a_plan_matches_one_process(tmp_path):
    """examples/parallelize.py: the user's own nn.Sequential and loop, three added lines; 4 processes under
    `stratum run` follow the one-process run's losses."""
    script = ROOT / "examples" / "parallelize.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, str(script), "--steps", "8", "--out", str(tmp_path / "one.json")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr
    code, out = run_main(["run", "--nproc", "4", str(script), "--steps", "8", "--plan", "replicate(2, pipeline(2))",
                          "--out", str(tmp_path / "four.json")])  # in this process: cli_in_process.py
    assert code == 0, out
    want, got = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "four.json"))
    assert len(got) == 8 and got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0] - 1.0


def test_the_example_script_refuses_a_plan_of_other_process_counts_in_one_line_with_exit_2(tmp_path):
    script = ROOT / "examples" / "parallelize.py"
    got = subprocess.run([sys.executable, str(script), "--steps", "1", "--plan", "pipeline(3)"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert got.returncode == 2 and got.stderr.startswith("stratum: error: ") and got.stderr.count("\n") == 1, got
