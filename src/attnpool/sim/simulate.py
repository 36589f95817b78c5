"""Simulate training steps at cluster scale: sample batches, lay out, plan, time every strategy.

For each batch of ``gpus x tokens_per_gpu`` tokens drawn with the paper's recipe:

- ``local``: the linear layout, every piece served at home (packed data parallelism).
- ``wlb``: WLB-LLM packing over all servers (DP only), served at home.
- ``percp-cp{c}``: WLB-LLM packing over ``servers / c`` DP groups and per-document
  context parallelism of degree c inside each (modelled analytically, see
  :meth:`StepModel.percp_step`: ``percp``'s planner is a Python loop over
  documents, too slow to run at every CP degree for every batch).
- ``ulysses-u{u}``: WLB-LLM packing over ``servers / u`` DP groups and Ulysses (head-parallel
  attention) of degree u inside each, for every u that splits the heads per server
  (:meth:`StepModel.ulysses_step`).
- ``cad``: the linear layout planned by the real ``cad`` scheduler, with ping-pong as the runtime runs it
  (two nano-batches of whole documents, each laid out and planned on its own, interleaved:
  :meth:`StepModel.nano_step`); ``cad-serial`` is the whole batch's plan without overlap. The planner knows the
  nodes: a byte between them costs it the intra/inter bandwidth ratio.
- With ``SimConfig.balanced``: ``local-balanced``, ``cad-balanced`` and ``cad-balanced-serial``, the same over the
  balanced layout (attnpool train's ``layout: balanced``: equal tokens, whole documents placed to even out attention
  work first).
- WLB-ideal: the best of ``wlb`` and every ``percp-cp{c}`` by total step time
  over the batches (one DP x CP for the whole run, as the paper sweeps it).
- Best baseline: the best of those and every ``ulysses-u{u}``.

``speedup`` = total step time of WLB-ideal / total step time of ``cad`` (the paper's measure);
``speedup_vs_best_baseline`` the same against the best baseline.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from attnpool.data.lengths import SamplingOptions, sample_batches
from attnpool.errors import ConfigError
from attnpool.model.config import model_config
from attnpool.plan.api import head_chunks_problem, plan_attention
from attnpool.plan.cost import exchange_byte_seconds, gibps_problem
from attnpool.sim.costs import SimCosts, load_sim_costs
from attnpool.plan.layout import balanced_table, linear_table, nano_batch_bounds, wlb_pieces, wlb_table
from attnpool.plan.plan import Topology
from attnpool.plan.ulysses import ulysses_problem
from attnpool.sim.steptime import PINGPONG_SCHEDULES, Cluster, StepModel, StepTime

STRATEGY_GROUPS = ("local", "wlb", "percp", "ulysses", "cad")
# 0.005 stands in for 0: below about 0.001 the cad planner cannot reach its target with
# shards of at least min_shard tokens and runs to its iteration bound (minutes at 64 servers).
MIN_EPS = 0.001
DEFAULT_EPS_SWEEP = (0.005, 0.02, 0.05, 0.1, 0.15)
PAPER_ELONGATE_BASE = 65536  # pretrain lengths are multiplied by max_doc_len / 64K (paper)


@dataclass(frozen=True)
class SimConfig:
    model: str = "llama3-8b"
    layers: int | None = None  # None: the preset's depth
    gpus: int = 512
    tp: int = 8
    gpus_per_node: int = 8
    tokens_per_gpu: int = 65536
    dist: str = "prolong"
    max_doc_len: int = 524288
    batches: int = 30
    seed: int = 0
    eps: float = 0.02
    strategies: tuple = STRATEGY_GROUPS
    # percp also as attnpool's own percp plan prices it ("percp-plan": the linear layout kept, queries and KV
    # prefixes sent out, outputs back, as attnpool bench's percp runs), beside the analytic per-document CP model
    percp_plan: bool = False
    memory_cap: float = 1.1
    elongate: float | None = None  # None: max_doc_len / 64K for pretrain, 1 otherwise
    upsample: bool = True
    cp_degrees: tuple | None = None  # None: every divisor of the number of servers
    recompute: str = "none"  # "linear": linear forwards and head logits run again in backward; "full": attention too
    # attention kinds (attnpool.kinds): a sliding window in the layers layer_types marks sliding (None: all)
    sliding_window: int | None = None
    layer_types: str | None = None
    # FSDP2's parameter gathers and gradient reductions over the servers (attnpool.sim.steptime); the pipeline's
    # stages leave them out
    fsdp: bool = True
    # cad also with the hierarchical exchange (attnpool train's hierarchical_exchange), as "cad-hierarchical" (and
    # "cad-hierarchical-serial" without ping-pong, as "cad-serial")
    hierarchical: bool = False
    # What a byte between nodes costs cad's planner against one inside a node: None, the links' bandwidth ratio (what
    # the simulated cluster would make it worth); a run's, plan.plan.INTER_NODE_BYTE_COST (attnpool train plans with
    # it whatever the network), to price the plans a run made
    inter_node_byte_cost: float | None = None
    # local and cad also over the balanced layout (attnpool train's layout balanced: equal tokens, whole documents
    # placed to even out attention first), as "local-balanced", "cad-balanced" (ping-pong) and "cad-balanced-serial"
    balanced: bool = False
    # core attention in this many groups of heads (attnpool train's head_chunks), for the strategies that run it so:
    # local, wlb, percp-plan and every cad (the analytic percp and ulysses models in one)
    head_chunks: int = 1
    # the order of ping-pong's compute across layers (attnpool.sim.steptime.PINGPONG_SCHEDULES)
    pingpong_schedule: str = "distca"
    # cad prices its exchanges' bytes against balance at the simulated link inside a node (attnpool train's
    # exchange_gibps; plan.cost.exchange_byte_seconds), as "cad" and "cad-serial" (False: balance whatever the bytes)
    price_bytes: bool = False
    # the rate, GiB/s, that price_bytes prices at where a run set exchange_gibps other than the link it measured
    # (sim_validation replays runs so); None: the simulated link's
    price_gibps: float | None = None

    def model_config(self):
        fields = {"n_layers": self.layers} if self.layers is not None else {}
        if self.sliding_window is not None:
            fields.update(sliding_window=self.sliding_window, layer_types=self.layer_types)
        return model_config(self.model, **fields)

    def label(self) -> str:
        return f"{self.model}/{self.dist}/{_size(self.max_doc_len)}/{self.gpus}gpu"

    def elongation(self) -> float:
        if self.elongate is not None:
            return float(self.elongate)
        if self.dist == "pretrain":
            return max(1.0, self.max_doc_len / PAPER_ELONGATE_BASE)
        return 1.0

    def check(self, model_cfg=None) -> None:
        """``model_cfg``: the model simulated, where it is not ``model``'s preset (then only a label)."""
        if self.layers is not None and self.layers < 1:
            raise ConfigError("layers", self.layers, "must be >= 1")
        if self.layer_types is not None and self.sliding_window is None:
            raise ConfigError("layer_types", self.layer_types, "gives which layers slide; give --sliding-window too")
        if model_cfg is None:
            self.model_config()  # the window and layer types checked
        if self.seed < 0:
            raise ConfigError("seed", self.seed, "must be >= 0")
        for s in self.strategies:
            if s not in STRATEGY_GROUPS:
                raise ConfigError("strategies", s, f"unknown; choose from {', '.join(STRATEGY_GROUPS)}")
        if not self.strategies:
            raise ConfigError("strategies", "", "need at least one strategy")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 1:
            raise ConfigError("batches", self.batches, "must be a positive integer")
        check_eps(self.eps, "eps")
        if not self.max_doc_len >= 1:
            raise ConfigError("max_doc_len", self.max_doc_len, "must be positive")
        if not self.memory_cap >= 1.0:
            raise ConfigError("memory_cap", self.memory_cap, "must be >= 1.0")
        m = model_cfg or self.model_config()
        problem = head_chunks_problem(self.head_chunks, m.n_kv_heads // self.tp, m.n_heads // self.tp)
        if problem:
            raise ConfigError("head_chunks", self.head_chunks, problem)
        if self.inter_node_byte_cost is not None and not self.inter_node_byte_cost > 0:
            raise ConfigError("inter_node_byte_cost", self.inter_node_byte_cost, "must be positive, or None")
        problem = None if self.price_gibps is None else gibps_problem(self.price_gibps) or (
            None if self.price_bytes else "prices cad's bytes: needs price_bytes")
        if problem:
            raise ConfigError("price_gibps", self.price_gibps, problem)
        if self.pingpong_schedule not in PINGPONG_SCHEDULES:
            raise ConfigError("pingpong_schedule", self.pingpong_schedule,
                              f"choose one of {', '.join(PINGPONG_SCHEDULES)}")


def check_eps(eps: float, field: str = "eps") -> None:
    if not (MIN_EPS <= eps < 1.0):
        raise ConfigError(field, eps, f"must be in [{MIN_EPS}, 1): below {MIN_EPS} the cad planner cannot meet the "
                                      "tolerance with its minimum shard size and runs for minutes")


def _size(n: int) -> str:
    for unit, mult in (("M", 2**20), ("K", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Acc:
    steps: list = field(default_factory=list)

    def add(self, st: StepTime):
        self.steps.append(st)

    def summary(self) -> dict:
        s = self.steps
        mean = lambda k: float(np.mean([getattr(x, k) for x in s]))  # noqa: E731
        return {
            "step_s": mean("step"),
            "linear_s": mean("linear"),
            "attention_s": mean("attention"),
            "imbalance_s": mean("imbalance"),
            "comm_exposed_s": mean("comm_exposed"),
            "comm_total_s": mean("comm_total"),
            "fsdp_exposed_s": mean("fsdp_exposed"),  # (part of comm_exposed_s)
            "attention_max_over_mean": mean("attention_max_over_mean"),
            "bytes_moved": mean("bytes_moved"),
            "max_bytes_per_server": int(max(x.max_bytes_per_server for x in s)),
            "max_tokens_per_server": int(max(x.max_tokens_per_server for x in s)),
            "per_batch_step_s": [x.step for x in s],
            # what the batch's core attention costs on its critical path (the mean and the slowest server's excess)
            "per_batch_attention_s": [x.attention + x.imbalance for x in s],
        }


def check_tokens(cluster: Cluster, costs: SimCosts) -> None:
    if cluster.tokens_per_gpu < costs.min_shard_tokens:
        raise ConfigError("tokens_per_gpu", cluster.tokens_per_gpu,
                          f"is below the smallest shard the planner may cut ({costs.min_shard_tokens} tokens, from the cost table)")


def sample(config: SimConfig, cluster: Cluster) -> list[list[int]]:
    options = SamplingOptions(upsample=config.upsample, elongate=config.elongation(), max_doc_len=config.max_doc_len)
    return sample_batches(config.dist, cluster.servers * cluster.tokens_per_server, config.batches, config.seed, options)


def simulate_config(config: SimConfig, costs: SimCosts | None = None, *, profile=None, eps_sweep=None,
                    doc_batches: list[list[int]] | None = None, progress=None, model_cfg=None) -> dict:
    """Simulate one configuration; returns a JSON-ready dict (see module docstring). ``model_cfg``: the model, where it
    is not ``config.model``'s preset (a user's own; ``costs`` must then be given)."""
    t0 = time.perf_counter()
    config.check(model_cfg)
    cfg = model_cfg or config.model_config()
    cluster = Cluster(config.gpus, config.tp, config.gpus_per_node, config.tokens_per_gpu)
    if costs is None:
        costs = load_sim_costs(cfg, config.model, profile)
    check_tokens(cluster, costs)
    model = StepModel(cfg, cluster, costs, config.recompute, fsdp=config.fsdp, head_chunks=config.head_chunks,
                      pingpong_schedule=config.pingpong_schedule)
    S, B = cluster.servers, cluster.tokens_per_server
    if doc_batches is None:
        doc_batches = sample(config, cluster)
        if config.batches != len(doc_batches):
            raise ConfigError("batches", config.batches, "sampler returned a different number of batches")
    else:
        for i, lens in enumerate(doc_batches):
            if sum(lens) > S * B:
                raise ConfigError(f"batch[{i}]", f"{sum(lens)} tokens", f"more than {S} servers x {B} tokens can hold")
    for e in eps_sweep or ():
        check_eps(e, "eps_sweep")
    cps = [c for c in (config.cp_degrees or divisors(S)) if c > 1]
    for c in cps:
        if S % c:
            raise ConfigError("cp", c, f"must divide the number of servers {S}")
    want = set(config.strategies)
    heads = (model.shape.n_q_heads // cluster.tp, model.shape.n_kv_heads // cluster.tp)
    ulysses_degrees = [u for u in divisors(S) if u > 1 and ulysses_problem(u, *heads) is None]
    acc: dict[str, _Acc] = {}
    eps_acc: dict[float, _Acc] = {}
    ideal = []
    plan_kw = dict(cost_model=costs.attn_fwd_bwd, min_shard_tokens=costs.min_shard_tokens, shape=model.shape)
    # cad prices a byte between nodes at the links' bandwidth ratio (plan.cad)
    topology = Topology.of(S, cluster.servers_per_node, config.inter_node_byte_cost
                           or costs.intra.bandwidth / costs.inter.bandwidth)

    def add(st: StepTime):
        acc.setdefault(st.strategy, _Acc()).add(st)

    def byte_seconds(overlapped: bool) -> float:  # cad's price of a byte (price_bytes), as attnpool train sets it
        if not config.price_bytes:
            return 0.0
        gibps = config.price_gibps or costs.intra.bandwidth / 2**30
        return exchange_byte_seconds(gibps, 1.0 if config.recompute == "full" else 0.0,
                                     overlapped or config.head_chunks > 1)

    priced_serial, priced_overlapped = byte_seconds(False), byte_seconds(True)

    def plan(table, strategy, **kw) -> dict:  # one plan per distinct window of the model's layers
        return {w: plan_attention(table, strategy, window=w, **plan_kw, **kw) for w in dict.fromkeys(model.layer_windows)}

    for bi, lens in enumerate(doc_batches):
        ideal.append(model.ideal(lens))
        if "local" in want or "cad" in want or config.percp_plan:
            lin = linear_table(lens, S, B)
        if "local" in want:
            add(model.plan_step(plan(lin, "local"), overlap=False))
        if "wlb" in want:
            add(model.plan_step(plan(wlb_table(lens, S, B, config.memory_cap), "local"), overlap=False, name="wlb"))
        if "percp" in want:
            for c in cps:
                add(model.percp_step(wlb_pieces(lens, S // c, c * B, config.memory_cap), c))
            if config.percp_plan:
                add(model.plan_step(plan(lin, "percp"), overlap=False, name="percp-plan"))
        if "ulysses" in want:
            for u in ulysses_degrees:
                add(model.ulysses_step(wlb_pieces(lens, S // u, u * B, config.memory_cap), u))
        balanced = balanced_table(lens, S, B) if config.balanced else None
        if balanced is not None and "local" in want:
            add(model.plan_step(plan(balanced, "local"), overlap=False, name="local-balanced"))
        if "cad" in want:
            # ping-pong as the runtime runs it: nano-batches of whole documents, each laid out and planned alone
            # (the runtime also pads a nano-batch's ranks to a multiple of tp: at most tp - 1 tokens, left out)
            bounds = nano_batch_bounds(lens, 2, S)

            def cad_step(name, eps, topology, layout=linear_table, **kw):
                nanos = [layout(lens[d0:d1], S, -(-sum(lens[d0:d1]) // S)) for d0, d1 in bounds]
                return model.nano_step([plan(t, "cad", eps=eps, topology=topology, byte_seconds=priced_overlapped)
                                        for t in nanos], name=name, **kw)

            pingpong = cad_step("cad", config.eps, topology)
            add(pingpong)
            add(model.plan_step(plan(lin, "cad", eps=config.eps, topology=topology, byte_seconds=priced_serial),
                                overlap=False, name="cad-serial"))
            if balanced is not None:
                add(cad_step("cad-balanced", config.eps, topology, layout=balanced_table))
                add(model.plan_step(plan(balanced, "cad", eps=config.eps, topology=topology,
                                         byte_seconds=priced_serial), overlap=False, name="cad-balanced-serial"))
            if config.hierarchical:  # planned for it: cad prices the KV a relay forwards inside its node
                relays = replace(topology, relays=True)
                add(cad_step("cad-hierarchical", config.eps, relays, hierarchical=True))
                add(model.plan_step(plan(lin, "cad", eps=config.eps, topology=relays, byte_seconds=priced_serial),
                                    overlap=False, name="cad-hierarchical-serial", hierarchical=True))
            for e in eps_sweep or ():
                eps_acc.setdefault(float(e), _Acc()).add(pingpong if e == config.eps else cad_step("cad", e, topology))
        if progress:
            progress(bi + 1, len(doc_batches))

    strategies = {k: a.summary() for k, a in acc.items()}
    result = {
        "label": config.label(),
        "config": {**asdict(config), "strategies": list(config.strategies), "elongate": config.elongation(),
                   "cp_degrees": [1, *cps]},
        "servers": S,
        "tokens_per_server": B,
        "servers_per_node": cluster.servers_per_node,
        "min_shard_tokens": costs.min_shard_tokens,
        "batches": len(doc_batches),
        "num_docs_mean": float(np.mean([len(x) for x in doc_batches])),
        "longest_doc": int(max(max(x) for x in doc_batches)),
        "ideal_step_s": float(np.mean(ideal)),
        "strategies": strategies,
    }
    baselines = [k for k in strategies if k == "wlb" or k.startswith("percp-cp")]
    if baselines:
        best = min(baselines, key=lambda k: (sum(strategies[k]["per_batch_step_s"]), k))
        cp = 1 if best == "wlb" else int(best.removeprefix("percp-cp"))
        result["wlb_ideal"] = {"strategy": best, "cp": cp, "dp": S // cp, "step_s": strategies[best]["step_s"]}
        per_batch_best = np.min([strategies[k]["per_batch_step_s"] for k in baselines], axis=0)
        result["wlb_ideal_per_batch_best_step_s"] = float(per_batch_best.mean())
    every_baseline = baselines + [k for k in strategies if k.startswith("ulysses-u")]
    if every_baseline:
        best = min(every_baseline, key=lambda k: (sum(strategies[k]["per_batch_step_s"]), k))
        result["best_baseline"] = {"strategy": best, "step_s": strategies[best]["step_s"]}
        if "cad" in strategies:
            result["speedup_vs_best_baseline"] = sum(strategies[best]["per_batch_step_s"]) / sum(
                strategies["cad"]["per_batch_step_s"])
    if "cad" in strategies and baselines:
        cad = sum(strategies["cad"]["per_batch_step_s"])
        result["speedup"] = sum(strategies[result["wlb_ideal"]["strategy"]]["per_batch_step_s"]) / cad
        result["speedup_vs_best_per_batch"] = float(per_batch_best.sum()) / cad
        result["speedup_serial"] = sum(strategies[result["wlb_ideal"]["strategy"]]["per_batch_step_s"]) / sum(
            strategies["cad-serial"]["per_batch_step_s"])
    else:
        result["speedup"] = None
    if "cad" in strategies:
        result["cad_efficiency"] = result["ideal_step_s"] / strategies["cad"]["step_s"]
    if eps_acc:
        result["eps_sweep"] = [{"eps": e, **{k: v for k, v in a.summary().items() if k != "per_batch_step_s"}}
                               for e, a in sorted(eps_acc.items())]
    result["wall_s"] = time.perf_counter() - t0
    return result


def expand(base: SimConfig, *, models=None, dists=None, max_doc_lens=None, gpus=None) -> list[SimConfig]:
    """The cartesian product of the swept fields (model, dist, max_doc_len, gpus), in that nesting order."""
    out = []
    for m in models or [base.model]:
        for d in dists or [base.dist]:
            for L in max_doc_lens or [base.max_doc_len]:
                for g in gpus or [base.gpus]:
                    out.append(replace(base, model=m, dist=d, max_doc_len=L, gpus=g))
    return out


def simulate_many(configs: list[SimConfig], *, profile=None, eps_sweep=None, overrides=None, progress=None) -> list[dict]:
    """Run several configurations, sharing the costs of each model."""
    overrides = overrides or {}
    costs_by_model: dict[str, SimCosts] = {}
    for c in configs:  # validate everything before the first long run
        c.check()
        Cluster(c.gpus, c.tp, c.gpus_per_node, c.tokens_per_gpu)
        if c.model not in costs_by_model:
            costs_by_model[c.model] = load_sim_costs(c.model_config(), c.model, profile, **overrides)
        check_tokens(Cluster(c.gpus, c.tp, c.gpus_per_node, c.tokens_per_gpu), costs_by_model[c.model])
    results = []
    for i, c in enumerate(configs):
        results.append(simulate_config(c, costs_by_model[c.model], eps_sweep=eps_sweep))
        if progress:
            progress(i + 1, len(configs), results[-1])
    return results


def assumptions(configs: list[SimConfig], *, profile=None, overrides=None) -> dict:
    """What the numbers rest on, for every report: sources, network, and per model the linear costs."""
    overrides = overrides or {}
    out: dict = {}
    for c in configs:
        if c.model in out.get("models", {}):
            continue
        cfg = c.model_config()
        costs = load_sim_costs(cfg, c.model, profile, **overrides)
        step = StepModel(cfg, Cluster(c.gpus, c.tp, c.gpus_per_node, c.tokens_per_gpu), costs)
        if not out:
            out = {
                "sources": dict(costs.sources),
                "intra_node": {"bandwidth_GBps_per_gpu": costs.intra.bandwidth / 1e9, "latency_us": costs.intra.latency * 1e6},
                "inter_node": {"bandwidth_GBps_per_gpu": costs.inter.bandwidth / 1e9, "latency_us": costs.inter.latency * 1e6},
                "min_shard_tokens": costs.min_shard_tokens,
                # (DistCA's order unless asked: attnpool train runs ping-pong layerwise, steptime.PINGPONG_SCHEDULES)
                "pingpong_schedule": c.pingpong_schedule,
                "models": {},
                "not_modelled": ["pipeline parallelism", "the optimizer step (the same for every strategy)",
                                 "memory limits", "kernel launch and planning overheads"],
            }
        out["models"][c.model] = {
            "linear": costs.linear.source,
            "linear_s_per_token_per_layer": {"fwd": costs.linear.fwd, "bwd": costs.linear.bwd},
            "head_s_per_token": {"fwd": costs.linear.head_fwd, "bwd": costs.linear.head_bwd},
            f"tp_comm_s_per_token_per_layer_at_tp{c.tp}": step.tp_comm_per_token,
        }
    return out
