"""The pipeline node over the offload leaf: each rank's stages stream their chunks through its own tiers, its
in-flight micro-batches' activations kept, checkpointed or spilled as its plan says, and the run reproduces the
plain engine's losses and state — real gloo processes through ``stratum train``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stratum.config import load_config
from stratum.errors import StratumError
from stratum.model.gpt import build_gpt
from stratum.offload.planner import make_placement
from stratum.offload.setup import quick_profile
from stratum.offload.tiers import HOST, Bandwidths
from stratum.parallel.pipeline_offload import handoff_config, stage_block_costs
from stratum.profile.profile import BlockProfile, Profile
from stratum.runtime.pipeline import PipelinePlan
from stratum.schedule.generators import generate
from stratum.train.trainer import read_metrics, train

from test_parallel_replicate import _same_run, _stratum, hf_config  # noqa: F401 (a fixture)

# one sequence per micro-batch; dropout on: a recomputed block must draw the masks its first forward drew
DROPOUT = "model.dropout=0.1"
COMMON = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'", "train.micro_batch_size=1",
          "train.grad_accum=4", DROPOUT]
# sequences of 64 tokens: rank 0 of 1F1B holds two micro-batches in flight, whose activations (3.3 MB with its
# streamed chunks) do not fit this budget; their block inputs do (1.8 MB)
ONE_F_ONE_B = [*COMMON, "data.seq_len=64"]
BUDGET = 2_200_000
PLAN = f"parallel.plan='pipeline(2, offload(device_budget={BUDGET}B))'"


def _block(i: int, act: int, out: int, half: tuple[int, int] | None, logits: int | None = None) -> BlockProfile:
    return BlockProfile(index=i, name=f"b{i}", kind="x", n_params=1, param_bytes=4, grad_bytes=4, optim_bytes=8,
                        act_saved_bytes=act, out_bytes=out, fwd_s=1.0, bwd_s=2.0, bwd_input_s=1.0, spill_bytes=act,
                        half_act_saved_bytes=half and half[0], half_out_bytes=half and half[1],
                        half_spill_bytes=half and half[0], logits_bytes=logits)


def test_a_stage_blocks_bytes_count_its_input_and_a_stage_end_its_output_in_both_precisions():
    """Two stages over four blocks. Each block's saved activations and checkpoint carry its input, a stage's
    last block also its output (and its saved activations the output's gradient): on rank 0 block 1's output;
    on rank 1, ending the model, the logits the runtime takes the loss over (the last block's ``out_bytes`` is
    0: its profile ends with the loss). The 16-bit columns (measured on 16-bit chunks) are cut the same way."""
    blocks = [_block(i, 100 * (i + 1), 10 * (i + 1), (50 * (i + 1), 5 * (i + 1))) for i in range(3)]
    blocks.append(_block(3, 400, 0, (200, 0), logits=1000))
    prof = Profile(model="m", device="cpu", dtype="float32", precision="bf16", micro_batch=1, seq_len=4, runs=1,
                   blocks=blocks)
    plan = PipelinePlan(schedule=generate("1f1b", ranks=2, microbatches=2), stages=[range(0, 2), range(2, 4)])

    def cut(mine):
        return [(b.index, b.act_saved_bytes, b.out_bytes, b.spill_bytes, b.half_act_saved_bytes, b.half_out_bytes,
                 b.half_spill_bytes) for b in stage_block_costs(prof, plan, mine)]
    tokens = 1 * 4 * 8  # int64 token ids
    #                   index  act                out           spill   half act           half out     half spill
    assert cut([0, 1]) == [(0, 100 + tokens, tokens, tokens, 50 + tokens, tokens, tokens),
                           (1, 200 + 10 + 20, 10 + 20, 10, 100 + 5 + 10, 5 + 10, 5)]
    assert cut([2, 3]) == [(0, 300 + 20, 20, 20, 150 + 10, 10, 10),
                           (1, 400 + 30 + 1000, 30 + 1000, 30, 200 + 15 + 1000, 15 + 1000, 15)]
    fp32 = dataclasses.replace(prof, blocks=[_block(i, 100, 10, None) for i in range(4)])
    assert stage_block_costs(fp32, plan, [2])[0].half_act_saved_bytes is None


def test_a_pipeline_ranks_16_bit_chunks_hand_gradients_over_per_chunk_on_one_stage_per_rank():
    """bf16 with the masters off the device: a pipeline rank's chunks are 16-bit working copies, and where copies
    run beside compute (a GPU) its gradients go home a chunk at a time, as one engine's do — except on a rank
    running several stages (wave: rank 0 holds the first and the last), which hands them over a tensor at a time
    and refuses the per-chunk hand-off."""
    m = build_gpt("tiny", vocab_size=256, seed=0)
    prof = quick_profile(m, micro_batch=1, seq_len=16, device=torch.device("cpu"), precision="bf16")
    gpu = Bandwidths(h2d=20e9, d2h=20e9, disk_read=2e9, disk_write=1e9, adam_params_per_s=1e9, async_copies=True)
    inflight = (2,) * len(m)
    rank = make_placement(m, device_budget=None, host_budget=None, disk_free=None, profile=prof, n_micro=2,
                          precision="bf16", optimizer_tier=HOST, bandwidths=gpu, inflight=inflight)
    assert rank.half_params and rank.chunk_grads and rank.inflight == inflight
    cfg = load_config(None, ["offload.grad_handoff='chunk'"])
    one = PipelinePlan(schedule=generate("1f1b", ranks=2, microbatches=2), stages=[range(0, 2), range(2, 4)])
    assert handoff_config(cfg, one, [0, 1]) is cfg
    wave = PipelinePlan(schedule=generate("wave", ranks=2, microbatches=2),
                        stages=[range(0, 1), range(1, 2), range(2, 3), range(3, 4)])
    auto = load_config(None, [])
    assert handoff_config(auto, wave, [0, 3]).offload.grad_handoff == "tensor"
    with pytest.raises(StratumError, match="grad_handoff = 'chunk' does not run on a pipeline rank holding several"):
        handoff_config(cfg, wave, [0, 3])


def test_dry_run_fits_a_budget_that_cannot_keep_the_in_flight_activations(make_cfg, capsys):
    """The dry run plans rank 0 under ONE_F_ONE_B's budget with its in-flight activations checkpointed (or
    spilled); kept on the device, as the plan that cannot checkpoint would keep them, they do not fit."""
    from stratum.cli import main
    sets = [a for o in [*ONE_F_ONE_B, PLAN] for a in ("--set", o)]
    base = ["train", "--dry-run", "--set", f"data.corpus={make_cfg().data.corpus!r}", "--set",
            f"data.cache_dir={make_cfg().data.cache_dir!r}", *sets]
    assert main(base) == 0
    out = capsys.readouterr().out
    rank0 = out.split("pipeline rank 0")[1].split("pipeline rank 1")[0]
    assert "does not fit" not in out and "up to 2 micro-batches in flight" in rank0
    assert "activations: recompute" in rank0 or "activations: offload" in rank0
    assert main([*base, "--set", "offload.activations='keep'"]) == 2  # (it would not start: a script reads that)
    out, err = capsys.readouterr()
    rank0 = out.split("pipeline rank 0")[1].split("pipeline rank 1")[0]
    assert "does not fit — offload: no placement fits" in rank0
    assert err.startswith("stratum: error: this run would not start: pipeline rank 0: offload: no placement fits")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_offload_matches_plain(make_cfg, tmp_path):
    """1F1B over two ranks under a device budget (BUDGET) too small for rank 0's in-flight activations: rank 0
    keeps its blocks' inputs (recompute) or spills them to the host (offload), as its plan finds faster, and its
    chunks stream; gradients clipped, 10 steps. Rank 0's measured device peak stays under the budget (every
    rank's engine also asserts it after each block)."""
    common = [*ONE_F_ONE_B, "train.steps=10", "train.eval_interval=5"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), PLAN, "train.grad_accum=4", DROPOUT,
                   f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and "device-resident chunks" in out
    assert "activations: recompute" in out or "activations: offload" in out
    _same_run(tmp_path / "po", tmp_path / "plain")
    assert 0 < max(r["offload_device_peak_bytes"] for r in read_metrics(tmp_path / "po")) <= BUDGET


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tie_to_another_rank_pinned_matches_plain(make_cfg, tmp_path):
    """An embedding (2048 × 128) larger than the chunks (64 Ki elements, the largest other parameter), tied to
    the head on the other rank: each rank pins its holder (an outlier, chunks.outliers) instead of streaming it,
    sums it with the other rank's after the schedule, and the run equals the plain engine's."""
    common = ["train.steps=4", "train.eval_interval=2", "model.preset='mini'", "model.vocab_size=2048",
              "train.grad_accum=2", DROPOUT]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), "parallel.plan='pipeline(2, offload(device_budget=8MB))'",
                   *common, f"offload.chunk_size='{64 * 1024 * 4}B'", f"offload.disk_dir={str(tmp_path)!r}")
    assert out.count("offload plan:") == 2 and out.count("+ pinned 1.00 MiB") == 2
    _same_run(tmp_path / "po", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pipeline,budget,extra,ranks_only", [
    # 1F1B, chunks streamed from the host, AdamW on the host, clipped
    ("pipeline(2, {})", "1.8MB", ["offload.optimizer_tier='host'"], []),
    # wave (the tied embedding and head on rank 0), AdamW on disk, block inputs spilled, unclipped
    ("pipeline(2, schedule=wave, {})", "40%", ["offload.optimizer_tier='disk'", "offload.activations='offload'",
                                               "optim.grad_clip=0.0"], []),
    # the one-step-delayed update (each step's AdamW beside the next; evaluation reads the published copies)
    ("pipeline(2, {})", "1.8MB", ["offload.optimizer_tier='host'", "offload.delayed_update=true"], []),
    # the per-chunk hand-off on each rank (against one engine's per-tensor one: each rank's tied tensor has one
    # contribution a micro-batch, so both hand over the same sums)
    ("pipeline(2, {})", "2.5MB", ["offload.optimizer_tier='host'"], ["offload.grad_handoff='chunk'"]),
], ids=["1f1b", "wave", "delayed", "per-chunk"])
def test_16_bit_chunks_on_pipeline_ranks_match_the_memory_engines_own(make_cfg, tmp_path, pipeline, budget, extra,
                                                                      ranks_only):
    """bf16: each rank's chunks are 16-bit working copies of fp32 masters on the host or disk, and the run
    equals the single memory engine's with 16-bit chunks (itself held to the plain engine's mixed-precision
    recipe in test_offload_mixed.py), losses within 1e-5. Under 1F1B the tied embedding and head are on two
    ranks: their gradients reach the fp32 accumulators apart, where the single engine's autograd first sums the
    two in bf16 — the embedding's AdamW moments differ by up to 4.3e-7 and, through it, parameters whose
    gradients are tiny (Adam's update is near lr·sign(g) there) by up to 1.6e-5 (tolerances: 1e-6, 5e-5)."""
    common = ["train.steps=6", "train.eval_interval=3", "model.preset='mini'", "train.precision='bf16'",
              "train.grad_accum=4", DROPOUT, *extra, f"offload.disk_dir={str(tmp_path)!r}"]
    leaf = f"offload(device_budget={budget})"
    out = _stratum(make_cfg(*common, out=tmp_path / "one"), f"parallel.plan={leaf!r}", *common)
    assert "16-bit working copies on the device" in out
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), f"parallel.plan={pipeline.format(leaf)!r}", *common,
                   *ranks_only)
    assert out.count("16-bit working copies on the device") == 2
    assert out.count("gradients down a chunk at a time") == (2 if ranks_only else 0)
    _same_run(tmp_path / "po", tmp_path / "one", param_atol=5e-5, moment_atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wave_over_offload_resumes_and_matches_plain(make_cfg, tmp_path):
    """The wave schedule puts the embedding and the head (one tied tensor) on rank 0; no clipping (chunks update
    inside the backward), AdamW's moments on disk, the in-flight micro-batches' block inputs spilled to the host
    (a budget that cannot keep their activations: 3.7 MB on rank 0); stopped after step 2 and resumed from the
    checkpoint."""
    common = [*COMMON, "optim.grad_clip=0.0"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    cfg = make_cfg(*common, out=tmp_path / "wave")
    extra = ["parallel.plan='pipeline(2, schedule=wave, offload(device_budget=3MB))'", "train.grad_accum=4",
             "optim.grad_clip=0.0", "offload.optimizer_tier='disk'", "offload.activations='offload'", DROPOUT,
             f"offload.disk_dir={str(tmp_path)!r}"]
    _stratum(cfg, *extra, stop_at=2)
    out = _stratum(cfg, *extra)
    assert "optimizer state on disk" in out and "resum" in out.lower()
    assert out.count("activations: offload (block inputs spilled to the host") == 2
    _same_run(tmp_path / "wave", tmp_path / "plain")
    rows = read_metrics(tmp_path / "wave")
    assert 0 < max(r["offload_device_peak_bytes"] for r in rows) <= 3_000_000


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("source", [
    # built whole (a factory's own initialisation cannot be replayed block by block): the ranks keep their stages
    ["model.source='sequential'", "model.factory='stratum.model.sequential:example_lm'"],
    # built block by block as the memory engine packs each rank's blocks (seeded per block)
    ["model.source='sequential'", "model.factory='stratum.model.sequential:example_lm_blocks'"],
], ids=["whole", "block-by-block"])
def test_pipelined_offload_of_an_nn_sequential_matches_plain(make_cfg, tmp_path, source):
    _pipelined_equals_plain(make_cfg, tmp_path, source, "2MB")


def _pipelined_equals_plain(make_cfg, tmp_path, model: list[str], budget: str, *extra: str) -> str:
    """6 steps of ``model`` under pipeline(2, offload(device_budget=``budget``)) and ``extra``: the plain engine's
    run (losses, parameters, moments); what the ranks printed."""
    common = ["train.steps=6", "train.eval_interval=3", "train.grad_accum=2", *model]
    train(make_cfg(*common, out=tmp_path / "plain"))
    out = _stratum(make_cfg(*common, out=tmp_path / "po"), f"parallel.plan='pipeline(2, offload(device_budget={budget}))'",
                   *common, *extra)
    assert out.count("offload plan:") == 2
    _same_run(tmp_path / "po", tmp_path / "plain")
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hf_config", ["gpt2"], indirect=True)
def test_pipelined_offload_of_transformers_gpt2_matches_plain(make_cfg, tmp_path, hf_config):  # noqa: F811
    """Built block by block on each rank: the head on rank 1 is tied to rank 0's embedding, whose values rank 1
    draws for the moment as its head's chunk is packed (model.placement.stage_block_init)."""
    _pipelined_equals_plain(make_cfg, tmp_path, ["model.source='hf'", f"model.hf_path={hf_config!r}"], "2MB")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipelined_offload_of_transformers_llama_pins_its_untied_embedding_and_head(make_cfg, tmp_path):
    """Llama's embedding and head are two tensors, each four times any other: in chunks smaller than them (the
    other chunks streamed), rank 0 pins the embedding and rank 1 the head, each an outlier of its rank, and the
    run equals plain's."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, vocab_size=256, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path / "llama")
    model = ["model.source='hf'", f"model.hf_path={str(tmp_path / 'llama' / 'config.json')!r}"]
    out = _pipelined_equals_plain(make_cfg, tmp_path, model, "1MB", f"offload.chunk_size='{4096 * 4}B'",
                                  "offload.resident_chunks=4")
    assert out.count("device-resident chunks 4 + pinned 32.00 KiB; parameters' home host") == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("plan", ["pipeline(2)", "pipeline(2, offload(device_budget=2MB))"])
def test_a_pipelines_gradient_norm_is_the_plain_engines_to_the_bit(make_cfg, tmp_path, plan):
    """1F1B over an nn.Sequential (nothing tied; each stage accumulates its micro-batches in plain's order): the
    ranks gather each parameter's norm in the whole model's order (World.gathered_norm), so every step's clipped
    norm — and with it every update and evaluation — is the plain engine's bit for bit (a sum of squares over
    the ranks in float64 differed in the last bit from the third step on)."""
    common = ["train.steps=10", "train.eval_interval=5", "train.grad_accum=4", "train.micro_batch_size=2",
              "model.source='sequential'", "model.factory='stratum.model.sequential:example_lm'"]
    train(make_cfg(*common, out=tmp_path / "plain"))
    _stratum(make_cfg(*common, out=tmp_path / "pipe"), f"parallel.plan={plan!r}", *common)
    got, want = read_metrics(tmp_path / "pipe"), read_metrics(tmp_path / "plain")
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    assert [r.get("eval_loss") for r in got] == [r.get("eval_loss") for r in want]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_budget_no_rank_fits_stops_every_rank_with_one_line_naming_the_budget_that_fits_them_all(make_cfg,
                                                                                                   tmp_path):
    """Each rank's planner finds its own smallest budget; the ranks agree on one line with the largest of them, and
    that budget trains."""
    from cli_in_process import run_main
    cfg = make_cfg(out=tmp_path / "small")
    base = ["train", "--set", f"data.corpus={cfg.data.corpus!r}", "--set", f"data.cache_dir={cfg.data.cache_dir!r}",
            "--set", "model.preset='tiny'", "--set", "data.seq_len=32", "--set", "train.steps=2", "--set",
            "train.grad_accum=2", "--set", "train.eval_interval=0"]
    code, out = run_main([*base, "--set", f"train.out_dir={str(tmp_path / 'small')!r}", "--set",
                          "parallel.plan='pipeline(2, offload(device_budget=1MB))'"])
    lines = {ln for ln in out.splitlines() if ln.startswith("stratum: error:")}
    assert code == 2 and len(lines) == 1, out
    line = lines.pop()
    assert "no placement fits the stages of rank(s) 0, 1 under device_budget = 1MB" in line, line
    need = int(line.split("every rank at this host budget is ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    per_rank = [int(x.split(": ")[1].replace(",", "")) for x in line.split("per rank: ")[1].rstrip(")").split(", ")]
    assert need == max(per_rank) and len(per_rank) == 2
    code, out = run_main([*base, "--set", f"train.out_dir={str(tmp_path / 'fits')!r}", "--set",
                          f"parallel.plan='pipeline(2, offload(device_budget={need}B))'"])
    assert code == 0, out
