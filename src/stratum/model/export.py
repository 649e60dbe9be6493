"""A BlockSeq as a ``transformers`` model, to be written with ``save_pretrained`` (``stratum export``).

- hf source: the same architecture rebuilt from the config the BlockSeq was made from (``ModelInfo.extra``), its
  parameters given the BlockSeq's values by canonical name — both are flattened by :func:`from_transformers`.
- gpt source (Stratum's own GPT): a ``GPT2LMHeadModel`` of the same shape. The layouts agree — pre-LN layers,
  fused q/k/v split in that order, tanh GELU (``gelu_new``), LayerNorm eps 1e-5, learned positions, the head
  tied to the token embedding — except that GPT-2's ``Conv1D`` stores its weights transposed.
- sequential: no transformers architecture matches an arbitrary nn.Sequential; refused.

The transformers model is built with its parameters on the meta device and given storage block by block, so
no random initialisation runs for values that are overwritten at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, parameters_on_meta
from stratum.model.hf import ATTN_IMPLEMENTATION, from_transformers, import_transformers, quiet_progress_bars

EXPORTABLE_SOURCES = ("gpt", "hf")

GPT2_LAYER_NAMES: dict[str, tuple[str, bool]] = {
    # GPT-2 name inside a layer block → (own GPT name, stored transposed by GPT-2's Conv1D)
    "layer.ln_1.weight": ("ln1.weight", False), "layer.ln_1.bias": ("ln1.bias", False),
    "layer.attn.c_attn.weight": ("qkv.weight", True), "layer.attn.c_attn.bias": ("qkv.bias", False),
    "layer.attn.c_proj.weight": ("proj.weight", True), "layer.attn.c_proj.bias": ("proj.bias", False),
    "layer.ln_2.weight": ("ln2.weight", False), "layer.ln_2.bias": ("ln2.bias", False),
    "layer.mlp.c_fc.weight": ("fc.weight", True), "layer.mlp.c_fc.bias": ("fc.bias", False),
    "layer.mlp.c_proj.weight": ("fc_out.weight", True), "layer.mlp.c_proj.bias": ("fc_out.bias", False),
}
GPT2_END_NAMES: dict[str, str] = {"wte.weight": "tok.weight", "wpe.weight": "pos.weight",
                                  "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}
"""GPT-2 name inside the embed or head block → own GPT name (the head's lm_head is the tied wte)."""


def to_transformers(seq: BlockSeq) -> Any:
    """A ``transformers`` causal LM computing what ``seq`` computes, with ``seq``'s parameter values (CPU, fp32,
    eval mode, ``use_cache`` on as ``generate`` expects)."""
    source = seq.info.extra.get("source")
    if source == "hf":
        model = _hf_like(seq)
        values = _own_values(seq)
    elif source == "gpt":
        model = _gpt2_like(seq)
        values = _gpt2_values(seq)
    else:
        raise StratumError(f"a {source!r}-source model cannot be exported as a transformers model (only "
                           f"{', '.join(EXPORTABLE_SOURCES)} sources have a transformers architecture); its "
                           "checkpoint's state files hold every parameter by name")
    _fill(model, values)
    model.config.use_cache = True
    return model.eval()


def _build(config):
    """The transformers model of ``config`` with uninitialised CPU parameters (ties kept)."""
    transformers = import_transformers("stratum export")
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION,
                                                              dtype=torch.float32)
    return model


def _hf_like(seq: BlockSeq):
    transformers = import_transformers("stratum export")
    fields = {k: v for k, v in seq.info.extra["config"].items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(seq.info.extra["model_type"], **fields)
    return _build(config)


def _gpt2_like(seq: BlockSeq):
    transformers = import_transformers("stratum export")
    info = seq.info
    dropout = float(info.extra.get("dropout", 0.0))
    config = transformers.GPT2Config(
        vocab_size=info.vocab_size, n_positions=info.max_seq_len, n_embd=info.d_model, n_layer=info.n_layer,
        n_head=info.extra["n_head"], activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True,
        # GPT-2's own special ids (50256) mean nothing under another tokenizer
        bos_token_id=None, eos_token_id=None)
    return _build(config)


def _own_values(seq: BlockSeq) -> Callable[[str], Tensor | None]:
    params = dict(seq.named_parameters())
    return params.get


def _gpt2_values(seq: BlockSeq) -> Callable[[str], Tensor | None]:
    """GPT-2 BlockSeq name → the own GPT's value for it (transposed where GPT-2 stores it so)."""
    params = dict(seq.named_parameters())
    last = len(seq) - 1

    def value(name: str) -> Tensor | None:
        _, i, rest = name.split(".", 2)
        block = int(i)
        if block in (0, last):
            own = GPT2_END_NAMES.get(rest)
            return params.get(f"blocks.{i}.{own}") if own else None
        own, transposed = GPT2_LAYER_NAMES.get(rest, (None, False))
        t = params.get(f"blocks.{i}.{own}") if own else None
        return t.t() if t is not None and transposed else t
    return value


def _fill(model, value: Callable[[str], Tensor | None]) -> None:
    """Give every parameter of ``model`` storage and the value ``value`` names for it (by its BlockSeq name);
    a parameter without a value, or of another shape, is an architecture mismatch."""
    target = from_transformers(model)
    for i in range(len(target)):
        target.allocate(i)
    with torch.no_grad():
        for name, p in target.named_parameters():
            v = value(name)
            if v is None or tuple(v.shape) != tuple(p.shape):
                found = "nothing" if v is None else f"shape {tuple(v.shape)}"
                raise StratumError(f"cannot export: the transformers model's {name} {tuple(p.shape)} has "
                                   f"{found} in the trained model; the architectures differ")
            p.copy_(v.detach().to("cpu", torch.float32))


def save_pretrained(model: Any, directory: str) -> None:
    """``model.save_pretrained(directory)`` (safetensors) without transformers' progress bars."""
    with quiet_progress_bars(import_transformers("stratum export")):
        model.save_pretrained(directory)
