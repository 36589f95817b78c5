"""Cluster-scale simulation: the real planner and a calibrated cost model, 64 to 1024 GPUs on a laptop.

    from attnpool.sim import SimConfig, simulate_config
    r = simulate_config(SimConfig(model="llama3-8b", gpus=512, dist="prolong", max_doc_len=512 * 1024))
    r["speedup"]  # cad over WLB-ideal

- ``costs``: what is charged (profile JSON or built-in assumptions), see :func:`load_sim_costs`.
- ``steptime``: the step-time model (servers = TP groups, collectives, ping-pong overlap).
- ``simulate``: batches -> layouts -> plans -> step times per strategy, WLB-ideal, speedup.
- ``report`` / ``plots``: Markdown + JSON reports, the paper-scale grid, PNG figures.
"""

from attnpool.sim.costs import DEFAULT_INTER, DEFAULT_INTRA, DEFAULT_LINEAR_TFLOPS, LinearCost, Link, SimCosts, load_sim_costs
from attnpool.sim.simulate import SimConfig, expand, simulate_config, simulate_many
from attnpool.sim.steptime import Cluster, StepModel, StepTime

__all__ = [
    "DEFAULT_INTER", "DEFAULT_INTRA", "DEFAULT_LINEAR_TFLOPS", "LinearCost", "Link", "SimCosts", "load_sim_costs",
    "SimConfig", "expand", "simulate_config", "simulate_many", "Cluster", "StepModel", "StepTime",
]
