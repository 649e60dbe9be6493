"""Heterogeneous memory engine: parameters in fixed-size chunks over device → host → disk tiers.

Modules, one job each: :mod:`units` (human byte sizes), :mod:`tiers` (budgets, measured bandwidths, the disk
store), :mod:`chunks` (packing parameters into chunks), :mod:`trace` (the recorded access sequence and its
per-step check), :mod:`belady` (OPT eviction), :mod:`prefetch` (asynchronous transfers), :mod:`cpu_adam`
(per-chunk AdamW), :mod:`planner` (the bounded search that picks a placement), :mod:`engine` (the Engine).
"""
