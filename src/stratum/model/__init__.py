"""Model sources flattened into the ``BlockSeq`` IR (:mod:`stratum.model.blockseq`). The package re-exports
nothing, so importing one of its light modules (:mod:`stratum.model.presets`) does not import torch."""
