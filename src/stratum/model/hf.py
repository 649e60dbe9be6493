"""A Hugging Face ``transformers`` causal LM as a ``BlockSeq`` (the optional ``hf`` extra).

``build_hf(path)`` reads a local ``config.json`` (or a model directory holding one, plus optional weights),
builds the model with ``transformers`` and flattens it into single-tensor blocks that reuse the model's own
modules, so the BlockSeq computes exactly what the model's ``forward`` computes:

- GPT-2 family (``GPT2LMHeadModel``): ``embed`` = wte + wpe + drop, ``layer.i`` = ``transformer.h[i]``,
  ``head`` = ln_f + lm_head.
- Llama layout (``LlamaForCausalLM`` and families with the same decoder-layer call: Mistral, Qwen2, Qwen3,
  Gemma, Phi-3): ``embed`` = embed_tokens, ``layer.i`` = ``model.layers[i]`` with its own copy of the
  (parameter-free) rotary embedding, ``head`` = final norm + lm_head.

Each layer block builds its own causal (or sliding-window) mask with ``transformers``' mask functions, exactly
as the model's forward does: with the ``sdpa`` attention used here that mask is ``None`` for a plain causal
pattern and attention runs with ``is_causal=True``. No KV cache, no attention outputs. Tied embeddings
(``tie_word_embeddings``) are one Parameter in the embed and head blocks, so BlockSeq records a TiedGroup.

Nothing touches the network: paths must be local and every load runs with ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stratum.errors import StratumError
from stratum.model.blockseq import BlockSeq, ModelInfo, block_seed, lm_cross_entropy, parameters_on_meta

GPT2_TYPES = ("gpt2",)
"""Model types flattened through the GPT-2 path."""
LLAMA_STYLE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
"""Model types whose ``model.model`` has embed_tokens / layers / norm / rotary_emb and whose decoder layer is
called as ``layer(h, attention_mask=, position_ids=, position_embeddings=(cos, sin))`` (checked for parity)."""
SUPPORTED_TYPES = GPT2_TYPES + LLAMA_STYLE_TYPES

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""A model directory holding any of these is loaded with its weights; otherwise it is randomly initialised."""

DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                "embedding_dropout")
"""Config fields ``dropout`` overrides, where the config has them."""

VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash", "architectures", "dtype",
                        "torch_dtype", "_attn_implementation", "_attn_implementation_autoset",
                        "_attn_implementation_internal", "use_cache", "output_attentions",
                        "output_hidden_states", "return_dict")
"""Config keys that do not describe the architecture (left out of ``ModelInfo.extra['config']``)."""

ATTN_IMPLEMENTATION = "sdpa"
"""Causal through ``is_causal`` when no mask is needed, deterministic on CPU, supported by every family here."""


# ---- blocks ------------------------------------------------------------------------------------------------
def _positions(x: Tensor) -> Tensor:
    """Position ids (1, T) for a (B, T[, d]) input, as the HF models make them without a cache."""
    return torch.arange(x.size(1), device=x.device).unsqueeze(0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _first(out):
    """Some transformers versions return a tuple from a decoder layer; the hidden states come first."""
    return out[0] if isinstance(out, tuple) else out


class GPT2Embed(nn.Module):
    """Token + learned position embedding, then embedding dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: Tensor) -> Tensor:
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class GPT2Layer(nn.Module):
    """One ``GPT2Block``, with the causal mask its attention implementation needs."""

    def __init__(self, layer: nn.Module, config):
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, x: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = _positions(x)
        # (config, embeddings, attention mask, cache) by position: transformers renamed the cache's keyword
        mask = create_causal_mask(self.config, x, None, None, position_ids=pos)
        return _first(self.layer(x, None, mask, None, use_cache=False, position_ids=pos))


class Head(nn.Module):
    """Final norm and the output projection (whose weight may be the embedding's)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, norm_name: str):
        super().__init__()
        self.norm_name = norm_name
        self.add_module(norm_name, norm)
        self.lm_head = lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(getattr(self, self.norm_name)(x))


class TokenEmbed(nn.Module):
    """The token embedding alone (Llama layout: positions are rotary, applied in every layer)."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids)


class LlamaStyleLayer(nn.Module):
    """One decoder layer that computes its own rotary embedding and causal / sliding-window mask."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, layer_idx: int):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            self.sliding = layer_types[layer_idx] == "sliding_attention"
        else:
            self.sliding = getattr(config, "sliding_window", None) is not None

    def extra_repr(self) -> str:
        return f"sliding_window={self.config.sliding_window}" if self.sliding else "full attention"

    def forward(self, x: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        pos = _positions(x)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make_mask(self.config, x, None, None, position_ids=pos)  # (no cache: by position, as above)
        cos_sin = self.rotary(x, position_ids=pos)
        return _first(self.layer(x, attention_mask=mask, position_ids=pos, use_cache=False,
                                 position_embeddings=cos_sin))


# ---- loading -------------------------------------------------------------------------------------------------
def import_transformers(purpose: str = "model.source = 'hf'"):
    """The ``transformers`` module, offline; a one-line error naming ``purpose`` where it is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise StratumError(f"{purpose} needs the transformers package; "
                           "install the hf extra: pip install 'stratum[hf]'") from None
    return transformers


@contextlib.contextmanager
def quiet_progress_bars(transformers: types.ModuleType) -> Iterator[None]:
    """transformers' loading and saving bars off inside (they would interleave with Stratum's own output)."""
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _resolve(path: str) -> tuple[Path, Path | None]:
    """(config file, model directory holding weights or None) for a user-given path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise StratumError(f"model.hf_path {str(p)!r} does not exist; give a local transformers model "
                           "directory or its config.json")
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise StratumError(f"model.hf_path {str(p)!r} is a directory without config.json; point it at a "
                               "transformers model directory (save_pretrained) or a config.json file")
        has_weights = any((p / w).is_file() for w in WEIGHT_FILES)
        return cfg, (p if has_weights else None)
    if not p.is_file():
        raise StratumError(f"model.hf_path {str(p)!r} is neither a file nor a directory")
    return p, None


def _load_config(transformers, cfg_file: Path):
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # (nested too deeply)
        raise StratumError(f"model.hf_path: {str(cfg_file)!r} is not a readable JSON config ({e})") from None
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise StratumError(f"model.hf_path: {str(cfg_file)!r} has no 'model_type'; it must be a transformers "
                           "config.json (save one with config.save_pretrained(dir))")
    model_type = raw["model_type"]
    if raw.get("add_cross_attention") or raw.get("is_encoder_decoder"):
        raise StratumError(f"model.hf_path: {str(cfg_file)!r} has cross-attention (an encoder-decoder model); "
                           "the hf source takes decoder-only causal LMs")
    if model_type not in SUPPORTED_TYPES:
        raise StratumError(f"model.hf_path: model_type {model_type!r} is not supported by the hf source; "
                           f"supported decoder-only causal LMs: {', '.join(SUPPORTED_TYPES)}")
    try:
        return transformers.AutoConfig.from_pretrained(str(cfg_file), local_files_only=True)
    except Exception as e:  # transformers raises ValueError/OSError/KeyError/TypeError for bad configs
        raise StratumError(f"model.hf_path: cannot read config {str(cfg_file)!r}: {_first_line(e)}") from None


def _override(config, *, dropout: float | None, vocab_size: int | None, loading: bool) -> None:
    config.use_cache = False
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise StratumError(f"model.dropout must be in [0, 1), got {dropout}")
        for key in DROPOUT_KEYS:
            if hasattr(config, key):
                setattr(config, key, float(dropout))
    if vocab_size is not None and vocab_size != config.vocab_size:
        if vocab_size <= 0:
            raise StratumError(f"vocab_size must be positive, got {vocab_size}")
        if loading and vocab_size > config.vocab_size:
            raise StratumError(f"model.vocab_size = {vocab_size} is larger than the pretrained model's vocabulary "
                               f"of {config.vocab_size}; set at most {config.vocab_size} (0: the model's own) or "
                               "train from a config.json (random init)")
        if not loading:
            config.vocab_size = vocab_size
            # special ids of the config's original tokenizer that fall outside the new vocabulary mean nothing
            # here (and an out-of-range pad id would make nn.Embedding refuse to build)
            for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
                tok = getattr(config, key, None)
                if isinstance(tok, int) and tok >= vocab_size:
                    setattr(config, key, None)


def _config_dict(config) -> dict:
    d = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return json.loads(json.dumps(d, sort_keys=True, default=str))


class _Weights:
    """Checkpoint key → file, and reading a block's tensors from those files one file at a time: safetensors
    through ``safe_open``, ``pytorch_model.bin`` through ``torch.load(mmap=True)`` (tensors backed by the file,
    paged in as they are copied, so the checkpoint never sits in RAM whole)."""

    def __init__(self, keys: dict[str, Path], safetensors: bool):
        self.keys = keys
        self.safetensors = safetensors
        self._bins: dict[Path, dict] = {}

    def read(self, path: Path, keys: list[str]) -> list[Tensor]:
        if self.safetensors:
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                return [f.get_tensor(k) for k in keys]
        return [self._bin(path)[k] for k in keys]

    def names_in(self, path: Path) -> list[str]:
        if self.safetensors:
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                return list(f.keys())
        return list(self._bin(path))

    def _bin(self, path: Path) -> dict:
        if path not in self._bins:
            try:
                self._bins[path] = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # not a zip checkpoint, corrupt, or pickled objects: several exception types
                raise StratumError(f"model.hf_path: cannot read the weights in {str(path)!r}: "
                                   f"{_first_line(e)}") from None
        return self._bins[path]


def _weights_index(weights_dir: Path) -> _Weights | None:
    """Where each checkpoint tensor is, or None when the directory has no weight files."""
    try:
        for stem, safetensors in (("model.safetensors", True), ("pytorch_model.bin", False)):
            single, index = weights_dir / stem, weights_dir / f"{stem}.index.json"
            if single.is_file():
                w = _Weights({}, safetensors)
                w.keys = {k: single for k in w.names_in(single)}
                return w
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return _Weights({k: weights_dir / f for k, f in weight_map.items()}, safetensors)
    except StratumError:
        raise
    except Exception as e:  # a corrupt header or index surfaces as several exception types
        raise StratumError(f"model.hf_path: cannot read the weights in {str(weights_dir)!r}: "
                           f"{_first_line(e)}") from None
    return None


def _block_loader(model, blocks: list[nn.Module], weights_dir: Path, weights: _Weights):
    """``block_init(seq, i)``: fill block i's (allocated) parameters from the weight files. Parameters are
    found by their name inside the block, so a deep copy of the BlockSeq loads into itself."""
    keys = weights.keys
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter has one (the first) name
    prefix = getattr(model, "base_model_prefix", "")

    def key_of(name: str) -> str | None:
        for k in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if k in keys:
                return k
        return None
    missing = [n for n in names.values() if key_of(n) is None]
    if missing:
        raise StratumError(f"model.hf_path: the weights in {str(weights_dir)!r} have no tensor for {missing[0]!r}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; save the model "
                           "with save_pretrained, or train from its config.json")

    per_block = [[(pname, key_of(names[id(p)])) for pname, p in blk.named_parameters()] for blk in blocks]

    def block_init(seq: BlockSeq, i: int) -> None:
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for pname, key in per_block[i]:  # each shard is opened once per block, not once per tensor
            assert key is not None  # (a missing key was refused above)
            by_file.setdefault(keys[key], []).append((pname, key))
        for path, items in by_file.items():
            for (pname, key), t in zip(items, weights.read(path, [k for _, k in items])):
                p = seq.blocks[i].get_parameter(pname)
                if tuple(t.shape) != tuple(p.shape):
                    raise StratumError(f"model.hf_path: weight {key!r} has shape {tuple(t.shape)}, the model "
                                       f"expects {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(t.to(p.dtype))
    return block_init


def _post_order(m: nn.Module) -> list[nn.Module]:
    """Children before their parent, as ``nn.Module.apply`` (and so transformers' initialisation) visits them:
    a parent's ``_init_weights`` may override a child's (GPT-2's scaled residual projections)."""
    out: list[nn.Module] = []
    for c in m.children():
        out += _post_order(c)
    out.append(m)
    return out


def _random_block_init(model, seed: int):
    """``block_init(seq, i)`` for a randomly initialised model: the model's own ``_init_weights`` on every module
    of block i, each module under its own seed drawn from (seed, i, module index). Block by block, in any order,
    gives the same values as all blocks at once, so a lazy build (offload engine) and an eager one (every other
    engine) train identically. A parameter tied to an earlier block is left to that block."""

    def block_init(seq: BlockSeq, i: int) -> None:
        owned = {id(p) for _, p in seq.owned_parameters(i)}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for j, m in enumerate(_post_order(seq.blocks[i])):
                direct = list(m.parameters(recurse=False))
                if direct and not any(id(p) in owned for p in direct):
                    continue
                keep = [(p, p.detach().clone()) for p in m.parameters() if id(p) not in owned and not p.is_meta]
                for p in m.parameters():
                    if hasattr(p, "_is_hf_initialized"):  # transformers' init functions skip flagged tensors
                        del p._is_hf_initialized
                torch.manual_seed(block_seed(seed, i) * 10_007 + j)
                model._init_weights(m)
                for p, v in keep:
                    p.copy_(v)
    return block_init


def _make_model(transformers, config, weights_dir: Path | None, device: torch.device,
                params_on_meta: bool = False):
    """The transformers model: weights loaded from ``weights_dir``, or built from the config with parameters on
    the meta device (``params_on_meta``: they get storage and values block by block) or entirely on meta."""
    Auto = transformers.AutoModelForCausalLM
    with quiet_progress_bars(transformers):
        if weights_dir is not None and not params_on_meta and device.type != "meta":
            try:
                model = Auto.from_pretrained(str(weights_dir), config=config, local_files_only=True,
                                             attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
            except Exception as e:  # corrupt / mismatched weight files surface as many exception types
                raise StratumError(f"model.hf_path: cannot load the weights in {str(weights_dir)!r}: "
                                   f"{_first_line(e)}") from None
            return model.to(device)
        where = parameters_on_meta() if params_on_meta else torch.device("meta")
        try:
            with where:
                return Auto.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
        except (ValueError, AssertionError, TypeError, KeyError, IndexError) as e:
            raise StratumError(f"model.hf_path: cannot build a {config.model_type} model from this "
                               f"config: {_first_line(e)}") from None


# ---- flattening --------------------------------------------------------------------------------------------
def _flatten_gpt2(model) -> tuple[list[nn.Module], list[str]]:
    tr = model.transformer
    blocks: list[nn.Module] = [GPT2Embed(tr.wte, tr.wpe, tr.drop)]
    blocks += [GPT2Layer(layer, model.config) for layer in tr.h]
    blocks.append(Head(tr.ln_f, model.lm_head, "ln_f"))
    return blocks, ["embed"] + [f"layer.{i}" for i in range(len(tr.h))] + ["head"]


def _flatten_llama_style(model) -> tuple[list[nn.Module], list[str]]:
    inner = model.model
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            raise StratumError(f"model.hf_path: {type(model).__name__} has no model.{attr}; "
                               "it does not have the Llama layout the hf source flattens")
    rotary = inner.rotary_emb
    if any(True for _ in rotary.parameters()):
        raise StratumError(f"model.hf_path: {type(model).__name__}'s rotary embedding has parameters; "
                           "not supported")
    layers = list(inner.layers)[: model.config.num_hidden_layers]
    blocks: list[nn.Module] = [TokenEmbed(inner.embed_tokens)]
    # every layer block gets its own copy of the (buffer-only) rotary module, so engines can place blocks
    # independently; the config object stays shared
    blocks += [LlamaStyleLayer(layer, copy.deepcopy(rotary, {id(rotary.config): rotary.config})
                               if hasattr(rotary, "config") else copy.deepcopy(rotary), model.config, i)
               for i, layer in enumerate(layers)]
    blocks.append(Head(inner.norm, model.lm_head, "norm"))
    return blocks, ["embed"] + [f"layer.{i}" for i in range(len(layers))] + ["head"]


def from_transformers(model: Any) -> BlockSeq:
    """A transformers causal LM (GPT-2 or the Llama layout), already built, as a BlockSeq sharing its modules."""
    config = model.config
    model_type = config.model_type
    tie = bool(getattr(config, "tie_word_embeddings", False))
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if tie and emb.weight is not out.weight:
        raise RuntimeError(f"transformers did not tie {type(model).__name__}'s embedding and lm_head "
                           "although tie_word_embeddings is set")

    if model_type in GPT2_TYPES:
        blocks, names = _flatten_gpt2(model)
    else:
        blocks, names = _flatten_llama_style(model)

    d_model = getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0)
    max_len = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 0) or 0
    n_layer = getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0)
    info = ModelInfo(
        name=model_type,
        vocab_size=int(config.vocab_size),
        max_seq_len=int(max_len),
        n_layer=int(n_layer),
        d_model=int(d_model),
        extra={"source": "hf", "model_type": model_type, "config": _config_dict(config)},
    )
    seq = BlockSeq(blocks, lm_cross_entropy, info, names)
    if tie and not seq.tied:
        raise RuntimeError("tied embedding was not found in both the embed and head blocks")
    return seq


def build_hf(path: str, *, seed: int, dropout: float | None = None, device: torch.device | str = "cpu",
             vocab_size: int | None = None, lazy: bool = False) -> BlockSeq:
    """Build a local ``transformers`` causal LM as a BlockSeq.

    ``path`` is a ``config.json`` (random init) or a model directory: with weights (``model.safetensors``,
    ``pytorch_model.bin`` or their sharded indexes) they are loaded, otherwise the model is randomly
    initialised from ``seed`` (deterministically; the caller's RNG state is left untouched). ``dropout``
    overrides the config's dropout probabilities. ``vocab_size`` is the tokenizer's vocabulary: with random
    init it replaces ``config.vocab_size``; with loaded weights it must not exceed it. On the ``meta`` device
    the structure is built without memory or weights. ``lazy`` (CPU): parameters on the meta device and
    ``seq.materialize(i)`` gives block i its values — read from the weight files (safetensors, or
    ``pytorch_model.bin`` memory-mapped; the values ``from_pretrained`` gives) or, for random init, drawn block by
    block exactly as the eager build draws them — so a model larger than RAM is built one block at a time.
    Bad input raises :class:`StratumError`.
    """
    transformers = import_transformers()
    cfg_file, weights_dir = _resolve(path)
    config = _load_config(transformers, cfg_file)
    _override(config, dropout=dropout, vocab_size=vocab_size, loading=weights_dir is not None)
    dev = torch.device(device)
    weights = _weights_index(weights_dir) if lazy and weights_dir is not None and dev.type == "cpu" else None
    per_block = weights_dir is None and dev.type != "meta"  # random init, block by block (eager or lazy)
    model = _make_model(transformers, config, weights_dir, dev,
                        params_on_meta=weights is not None or per_block)
    model.train()  # from_pretrained returns eval mode; a BlockSeq starts in train mode like any nn.Module
    seq = from_transformers(model)
    if weights is not None and weights_dir is not None:  # (weights come from weights_dir)
        seq.block_init = _block_loader(model, list(seq.blocks), weights_dir, weights)
    elif per_block:
        seq.block_init = _random_block_init(model, seed)
        if not lazy or dev.type != "cpu":
            for i in range(len(seq)):
                seq.allocate(i, dev)
                seq.materialize(i)
            seq.block_init = None
    return seq
