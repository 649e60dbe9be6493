"""Planning: how to cut a model over pipeline ranks (:mod:`stratum.plan.partition`)."""

from stratum.plan.partition import (
    Partition,
    evaluate,
    inflight_from_schedule,
    partition,
    stage_costs,
)

__all__ = ["Partition", "evaluate", "inflight_from_schedule", "partition", "stage_costs"]
