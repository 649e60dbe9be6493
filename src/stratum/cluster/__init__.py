"""SIMULATED clusters: job traces replayed under allocation policies (static data parallelism, DeepPool's burst
plans and multiplexing, Saxena et al.'s elastic scaling) on a hardware spec and the one cost model. See
docs/cluster.md."""
