"""The Plan tree as data: parsing, nesting rules, the mesh, the config's shorthands and derived batch math."""

from __future__ import annotations

import pytest

from stratum.errors import StratumError
from stratum.ir.plan import Coord, Local, Offload, Pipeline, Replicate, Split, parse_plan

ACCEPTED = [
    ("local", "local", 1),
    ("plain", "local", 1),
    ("replicate(2)", "replicate(2)", 2),
    ("replicate(2, pipeline(2))", "replicate(2, pipeline(2, schedule=1f1b, partition=even))", 4),
    ("pipeline(2, split(2))", "pipeline(2, schedule=1f1b, partition=even, split(2))", 4),
    ("replicate(2, offload(device_budget=25%))", "replicate(2, offload(device_budget=25%))", 2),
    ("pipeline(2, offload(device_budget=1GB, host_budget=2GB))",
     "pipeline(2, schedule=1f1b, partition=even, offload(device_budget=1GB, host_budget=2GB))", 2),
    ("replicate(2, pipeline(2, split(2)))", "replicate(2, pipeline(2, schedule=1f1b, partition=even, split(2)))", 8),
    ("split(2, offload(device_budget=25%))", "split(2, offload(device_budget=25%))", 2),
    ("replicate(2, pipeline(2, split(2, offload)))",
     "replicate(2, pipeline(2, schedule=1f1b, partition=even, split(2, offload)))", 8),
    ("replicate(3, reduce=adasum)", "replicate(3, reduce=adasum)", 3),
    ("replicate(2, shard=true)", "replicate(2, shard=true)", 2),
    ("pipeline(4, schedule=wave, waves=2)", "pipeline(4, schedule=wave, partition=even, waves=2)", 4),
    ("replicate(n=2, pipeline(schedule=gpipe, ranks=3))",
     "replicate(2, pipeline(3, schedule=gpipe, partition=even))", 6),
]


@pytest.mark.parametrize("text, canonical, world", ACCEPTED)
def test_accepted_plans_render_canonically_and_round_trip(text, canonical, world):
    plan = parse_plan(text)
    assert str(plan) == canonical
    assert parse_plan(canonical) == plan
    assert plan.world_size() == world


def test_the_tree_holds_the_nodes_it_was_given():
    plan = parse_plan("replicate(2, reduce=adasum, pipeline(3, schedule=zb-wave, split(2)))")
    assert plan.root == Replicate(n=2, reduce="adasum", child=Pipeline(ranks=3, schedule="zb-wave",
                                                                      child=Split(n=2, child=Local())))
    assert plan.mesh_shape == (2, 3, 2) and isinstance(plan.leaf, Local)
    assert parse_plan("offload(host_budget=1GB)").leaf == Offload(host_budget="1GB")


REFUSED = [
    ("replicate(0)", "replicate(0) must have at least 1 process"),
    ("pipeline(0)", "pipeline(0) must have at least 1 process"),
    ("split(2, pipeline(2))", "split cannot hold pipeline"),
    ("replicate(2, replicate(2))", "replicate cannot hold replicate"),
    ("pipeline(2, replicate(2))", "pipeline cannot hold replicate"),
    ("offload(local)", "offload is a leaf"),
    ("offload(2)", "offload takes no positional value"),
    ("foo(2)", "'foo' is not a plan node"),
    ("replicate(2", "ends too early"),
    ("offload(host_budget=)", "host_budget= has no value"),
    ("offload(device_budget=, host_budget=1GB)", "device_budget= has no value"),
    ("replicate(x)", "must be a whole number"),
    ("replicate(2, reduce=sum)", "replicate(reduce=sum) is not one of: mean, adasum"),
    ("pipeline()", "pipeline needs its size"),
    ("replicate(2, shard=maybe)", "must be true or false"),
    ("local local", "unexpected 'local'"),
    ("replicate(2, bogus=1)", "replicate has no setting 'bogus'"),
    ("replicate(2, reduce=adasum, shard=true)", "cannot shard them"),
    ("replicate(2, local, local)", "holds one child"),
    ("", "is empty"),
    ("replicate(99999999999999999999)", "needs 99,999,999,999,999,999,999 processes; a plan may need at most 65,536"),
    ("replicate(257, pipeline(16, split(16)))", "needs 65,792 processes"),
]


@pytest.mark.parametrize("text, message", REFUSED)
def test_refused_plans_say_why_in_one_line(text, message):
    with pytest.raises(StratumError) as e:
        parse_plan(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_mesh_coordinates_and_groups_run_replica_then_stage_then_split():
    plan = parse_plan("replicate(2, pipeline(2, split(2)))")
    assert [plan.coord(r) for r in (0, 1, 2, 5, 7)] == [
        Coord(0, 0, 0), Coord(0, 0, 1), Coord(0, 1, 0), Coord(1, 0, 1), Coord(1, 1, 1)]
    assert all(plan.rank_of(plan.coord(r)) == r for r in range(8))
    assert plan.all_groups("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan.all_groups("stage_rank") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.all_groups("split") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.group_ranks("stage_rank", 5) == [5, 7]
    with pytest.raises(StratumError, match="outside"):
        plan.coord(8)


def test_config_shorthands_and_batch_math(make_cfg):
    assert str(make_cfg().plan) == "local"
    assert str(make_cfg("train.engine='offload'").plan) == "offload"
    pipe = make_cfg("train.engine='pipeline'", "pipeline.ranks=3", "pipeline.schedule='gpipe'")
    assert str(pipe.plan) == "pipeline(3, schedule=gpipe, partition=even)"
    # settings a pipeline node omits come from [pipeline]; the expression wins where it names them
    cfg = make_cfg("parallel.plan='replicate(3, pipeline(2, partition=balanced))'", "pipeline.schedule='zb-1f1b'",
                   "train.grad_accum=2", "train.micro_batch_size=4")
    assert cfg.plan.pipeline == Pipeline(ranks=2, schedule="zb-1f1b", partition="balanced")
    assert cfg.micro_batches_per_step == 6 and cfg.global_batch == 24
    assert "× 3 (replicas) = 24 sequences" in cfg.derived_summary()


def test_a_bad_plan_in_the_config_is_a_one_line_error(make_cfg):
    with pytest.raises(StratumError, match=r"parallel.plan 'replicate\(0\)'"):
        make_cfg("parallel.plan='replicate(0)'")
    with pytest.raises(StratumError, match=r"parallel.plan 'pipeline\(100000\)' needs 100,000 processes"):
        make_cfg("train.engine='pipeline'", "pipeline.ranks=100000")  # (its schedule would fill memory)
    # moved keys keep working
    assert make_cfg("pipeline.timeout_s=7").parallel.timeout_s == 7.0
