"""Model sources flattened into the ``BlockSeq`` IR."""

from stratum.model.blockseq import BlockSeq, ModelInfo, TiedGroup, lm_cross_entropy

__all__ = ["BlockSeq", "ModelInfo", "TiedGroup", "lm_cross_entropy"]
