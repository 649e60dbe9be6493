"""Processes and process groups for the multi-process engines (see :mod:`stratum.dist.launch`). The package
re-exports nothing, so its torch-free modules (:mod:`stratum.dist.roles`, :mod:`stratum.dist.forked`) import
without torch."""
