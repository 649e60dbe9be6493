"""Processes and process groups for the multi-process engines (see :mod:`stratum.dist.launch`)."""

from stratum.dist.launch import (destroy_process_group, init_process_group, is_main, is_worker,
                                 local_device, rank, spawn_local, under_torchrun, world_size)

__all__ = ["destroy_process_group", "init_process_group", "is_main", "is_worker", "local_device",
           "rank", "spawn_local", "under_torchrun", "world_size"]
