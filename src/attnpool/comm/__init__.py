"""Communication: flat all-to-all with explicit split sizes, byte counters, plan agreement, process groups."""

from attnpool.comm.all_to_all import CommStats, all_gather_flat, all_to_all_flat, comm_stats, group_rank_size
from attnpool.comm.agreement import agree, agree_on_plan, portable
from attnpool.comm.ports import free_port
from attnpool.comm.process import end_process, opened_process_group, process_group, under_torchrun

__all__ = ["CommStats", "all_gather_flat", "all_to_all_flat", "comm_stats", "group_rank_size", "agree", "agree_on_plan",
           "portable", "free_port", "end_process", "opened_process_group", "process_group", "under_torchrun"]
