"""A burst node's planned widths are recorded in the run's out_dir and kept by a resumed run: planned again, they
would follow the new start's timings, and other widths sum a step's gradients in another order."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_in_process import run_main

from stratum.parallel.burst_setup import RECORD
from stratum.train.trainer import read_metrics


def _train(make_cfg, out, plan: str, *, stop_at: int | None = None) -> str:
    cfg = make_cfg("train.steps=4", "train.grad_accum=2", out=out)
    d, t = cfg.data, cfg.train
    args = ["train"] + (["--stop-at", str(stop_at)] if stop_at else [])
    for o in [f"data.corpus={d.corpus!r}", f"data.cache_dir={d.cache_dir!r}", f"data.seq_len={d.seq_len}",
              "model.preset='tiny'", f"train.micro_batch_size={t.micro_batch_size}", "train.steps=4",
              "train.grad_accum=2", "train.eval_interval=0", f"train.out_dir={str(out)!r}",
              f"parallel.plan={plan!r}"]:
        args += ["--set", o]
    code, text = run_main(args)
    assert code == 0, text
    return text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_burst_run_keeps_the_widths_it_planned(make_cfg, tmp_path):
    out = tmp_path / "planned"
    _train(make_cfg, out, "burst(2)", stop_at=2)
    rec = json.loads((out / RECORD).read_text())
    widths = rec["widths"]
    assert len(widths) == 4 and all(w in (1, 2) for w in widths)  # tiny: embedding, 2 layers, head
    # another valid choice recorded, as if the first start had measured other timings: the resumed run takes it
    other = tmp_path / "other"
    shutil.copytree(out, other)
    flipped = [1 if w == 2 else 2 for w in widths]
    (other / RECORD).write_text(json.dumps({**rec, "widths": flipped}))
    assert f"burst widths {':'.join(map(str, flipped))}" in _train(make_cfg, other, "burst(2)")
    # resumed with the widths it planned, the run is the uninterrupted one with those widths, to the bit
    _train(make_cfg, out, "burst(2)")
    whole = tmp_path / "whole"
    _train(make_cfg, whole, f"burst(2, widths={':'.join(map(str, widths))})")
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(whole)]
