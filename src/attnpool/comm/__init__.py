"""Communication: flat all-to-all with explicit split sizes, byte counters, plan agreement, process groups."""

from attnpool.comm.all_to_all import CommStats, all_gather_flat, all_to_all_flat, comm_stats, group_rank_size
from attnpool.comm.agreement import agree_on_plan
from attnpool.comm.process import end_process, opened_process_group, process_group

__all__ = ["CommStats", "all_gather_flat", "all_to_all_flat", "comm_stats", "group_rank_size", "agree_on_plan",
           "end_process", "opened_process_group", "process_group"]
