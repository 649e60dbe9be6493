"""``stratum train --dry-run``: everything a run would decide, nothing it would compute."""

from __future__ import annotations

from stratum.config import Config, to_toml
from stratum.data.corpus import resolve_corpus
from stratum.data.prepare import make_tokenizer
from stratum.model.build import build_model
from stratum.runtime.device import describe, resolve_device

ADAMW_STATE_BYTES_PER_PARAM = 8  # two fp32 moments


def dry_run(cfg: Config) -> dict:
    """Print the resolved config, derived values and the model's blocks (built on the meta device: no memory)."""
    device = resolve_device(cfg.train.device)
    corpus = resolve_corpus(cfg.data.corpus)
    tok = make_tokenizer(cfg, corpus)
    model = build_model(cfg.model, tokenizer_vocab=tok.vocab_size, seq_len=cfg.data.seq_len,
                        seed=cfg.train.seed, device="meta")
    n = model.num_params()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 2 * param_bytes + n * ADAMW_STATE_BYTES_PER_PARAM
    print(to_toml(cfg))
    print(cfg.derived_summary())
    print(f"device {describe(device)}; engine {cfg.train.engine}; corpus {len(corpus.files):,} files, "
          f"{corpus.total_bytes:,} bytes; tokenizer {tok.name} (vocab {tok.vocab_size})")
    print(f"model {model.info.name}: {n:,} parameters in {len(model)} blocks; training state (params + grads + "
          f"AdamW) {state / 2**30:.2f} GiB; {model.flops_per_token(cfg.data.seq_len) / 1e9:.3f} GFLOP per token")
    for i, name in enumerate(model.block_names):
        owned = sum(p.numel() for _, p in model.owned_parameters(i))
        print(f"  {i:>3} {name:<16} {type(model.blocks[i]).__name__:<16} {owned:>14,} params")
    for g in model.tied:
        print(f"  tied: {' = '.join(g.names)}")
    if cfg.train.engine == "offload":
        from stratum.offload.setup import plan_for
        print(plan_for(cfg, model, device, always_profile=True).describe())
    return {"params": n, "train_state_bytes": state}
