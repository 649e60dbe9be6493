"""no_meta_init: initialisers skip meta tensors (no torch._dynamo import for a meta build) and run elsewhere."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from stratum.config import ModelConfig
from stratum.model.build import build_model
from stratum.model.gpt import build_gpt
from stratum.model.meta_init import no_meta_init


def test_initialisers_skip_meta_tensors_and_run_on_others():
    with no_meta_init():
        meta = nn.Linear(3, 4, device="meta")
        torch.manual_seed(0)
        real = nn.Linear(3, 4)
    torch.manual_seed(0)
    want = nn.Linear(3, 4)
    assert meta.weight.is_meta and meta.weight.shape == (4, 3)
    torch.testing.assert_close(real.weight, want.weight, rtol=0, atol=0)
    t = torch.empty(5)
    with no_meta_init():
        nn.init.constant_(t, 2.0)
        t.add_(1)
    assert t.eq(3).all()


def test_build_model_on_cpu_gives_the_values_of_a_plain_build():
    got = build_model(ModelConfig(preset="tiny"), tokenizer_vocab=256, seq_len=32, seed=3)
    want = build_gpt("tiny", vocab_size=256, seed=3)
    for (n, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_a_meta_build_does_not_import_dynamo():
    code = ("import sys\nfrom stratum.config import ModelConfig\nfrom stratum.model.build import build_model\n"
            "m = build_model(ModelConfig(preset='gpt2-124m'), tokenizer_vocab=256, seq_len=64, seed=0, device='meta')\n"
            "assert all(p.is_meta for p in m.parameters())\n"
            "assert 'torch._dynamo' not in sys.modules, 'a meta build imported torch._dynamo'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
