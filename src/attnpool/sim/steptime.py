"""Step time of one micro-batch on a cluster, from a plan and :class:`SimCosts`.

Servers. With tensor parallelism of degree ``tp`` inside a node, one attention
server is one TP group: its ``tp`` GPUs hold the same tokens and each computes
``n_heads / tp`` heads of every CA-task the server runs, so a server's attention
time is its tasks' table time divided by ``tp``, its linear time is its tokens'
linear time divided by ``tp``, and each GPU sends ``1/tp`` of the server's
bytes over its own link. ``servers = gpus / tp``; ``gpus_per_node / tp`` servers
share a node (NVLink between them); other traffic crosses the inter-node network.

Per server s, per layer (seconds on each of its GPUs), with T_s its tokens:

    linear fwd  = T_s * (lin_fwd / tp + tp_comm)   lin_fwd: profile, per token, TP=1
    linear bwd  = T_s * lin_bwd / tp               (backward TP collectives overlap
                                                    the weight-gradient GEMMs)
    tp_comm     = 4 * (tp - 1) / tp * dim * 2 B / intra_bw   (sequence parallel:
                                                    2 all-gathers + 2 reduce-scatters)
    attention   = sum over its tasks of table_cost(a, b) / tp  (fwd; bwd = fwd+bwd - fwd)
    head        = T_s * head_{fwd,bwd} / tp, once per step

Collectives. A collective costs ``latency + max over its group's servers of
max(bytes_intra / intra_bw, bytes_inter / inter_bw)`` per GPU, where a server's
bytes are the larger of what it sends and receives, split by whether the peer is
in the same node. A collective with no bytes is not launched (a fully local
plan costs nothing beyond local attention). Per layer, plan-based strategies
run 4 all-to-alls (as the runtime does): forward Q+KV out and O back, backward
dO out and dQ+dKV back (the server keeps what it received for the backward).
Per-document CP (``percp``) runs an all-gather of KV before attention in
forward and backward, and a reduce-scatter of dKV after it in backward, each
inside its CP group.

Overlap. A tiny two-stream event simulation per layer: a compute stream per
server, and collectives that start when every server of the group has reached
them and the previous collective of the group is done. Without overlap (one
nano-batch) every collective is exposed. With DistCA's ping-pong, the
micro-batch is split into two nano-batches and the compute stream runs
pre(a) pre(b) attn(a) attn(b) post+pre(a) post+pre(b) ...  while nano-batch a's
collectives run behind nano-batch b's compute (DistCA's schedule; attnpool's
runtime runs post(a) post(b) pre(a) pre(b): ``pingpong_schedule``, PINGPONG_SCHEDULES).
Under full recompute a layer's backward is its forward again, exchanges included,
and then its backward, as a checkpointed layer runs. :meth:`StepModel.nano_step` takes
the nano-batches as the runtime makes them (whole documents, each planned alone,
so one long document makes them unequal, or leaves one); ``plan_step(overlap=True)``
approximates them by exact halves of one plan (half the tokens, work and bytes
each; the latency paid per collective), which hid 2.3-5.0% more of a measured
step on the emulated network's runs (bench/results/2026-11-29-cpu-sim-nano-batches.md).

FSDP2 (``fsdp``, as attnpool.parallel.parallelize applies it over the servers): each
layer's weights (its GPU's 1/tp share) are all-gathered in bf16 before its forward
and again before its backward, its gradients reduce-scattered in float32 after
it; the root (embedding and output projection) is gathered once a step (FSDP2
does not reshard the root after forward) and reduced at the end. Ring
collectives over the servers, on the inter-node link where they span nodes. Each
layer's gather is prefetched behind the previous layer's compute (the slowest
server's), a backward layer's compute also hides the reduce-scatter of the layer
after it; the root's gather, the first layer's, and the last two reduce-scatters
have nothing to hide behind (:meth:`StepModel.fsdp_exposed`). The same for every
strategy but for how much compute hides it; it matters where the link is slow.
FSDP's collectives are not made to share the links with the core attention
exchanges: counted so, Ulysses on the emulated network came out 7.5-7.9% long
where it is 1.8-6.1% as it is (bench/results/2026-11-28-sim-validation-baselines.md).
Nor does an exchange wait for them: core attention has a communicator of its own
(attnpool.parallel.mesh); on FSDP's, NCCL ran each backward exchange after FSDP's
reduction and gather, and this model was 12.8-21.4% low on those runs.
Assumed: bf16 training (bf16 gathers; a float32 run gathers twice the bytes); the
norms counted as if TP split them (a rounding error).

Breakdown (sums to the step time): ``linear`` and ``attention`` are means over
servers; ``imbalance`` is the slowest server's compute minus the mean compute;
``comm_exposed`` is the rest: time the slowest server waits at collectives,
for the transfer itself and for the other servers of its group to reach them,
and FSDP's exposed time (also alone, ``fsdp_exposed``).
Not modelled: pipeline parallelism, the optimizer step (the same for every
strategy), memory limits, kernel launch overheads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.documents import key_start
from attnpool.plan.plan import AttentionShape, Plan
from attnpool.plan.stages import layer_weights
from attnpool.plan.ulysses import bytes_per_peer, ulysses_problem
from attnpool.sim.costs import SimCosts


@dataclass(frozen=True)
class Cluster:
    gpus: int
    tp: int = 8
    gpus_per_node: int = 8
    tokens_per_gpu: int = 65536

    def __post_init__(self):
        for name in ("gpus", "tp", "gpus_per_node", "tokens_per_gpu"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(name, v, "must be a positive integer")
        if self.gpus_per_node % self.tp:
            raise ConfigError("tp", self.tp, f"must divide gpus_per_node={self.gpus_per_node}: a TP group stays inside one node")
        if self.gpus % self.tp:
            raise ConfigError("gpus", self.gpus, f"is not divisible by tp={self.tp}")

    @property
    def servers(self) -> int:
        """Attention servers = TP groups."""
        return self.gpus // self.tp

    @property
    def servers_per_node(self) -> int:
        return self.gpus_per_node // self.tp

    @property
    def tokens_per_server(self) -> int:
        return self.tokens_per_gpu * self.tp

    def node(self, server):
        return np.asarray(server) // self.servers_per_node


@dataclass
class Collective:
    """One kind of collective per layer, per group: fixed latency and transfer time of the whole micro-batch."""

    latency: np.ndarray  # (G,)
    transfer: np.ndarray  # (G,)
    kv_fraction: float = 0.0  # the share of its bytes that are K and V (or their gradients): see head_group

    @property
    def active(self) -> bool:
        return bool(np.any(self.transfer > 0))

    def duration(self) -> np.ndarray:
        return np.where(self.transfer > 0, self.latency + self.transfer, 0.0)

    def part(self, parts: int) -> "Collective":
        """The collective of one of ``parts`` equal parts of the batch: its share of the bytes, the whole latency."""
        return Collective(self.latency, self.transfer / parts, self.kv_fraction)

    def head_group(self, index: int, groups: int, kv_heads: int, reverse: bool = False) -> "Collective":
        """Head group ``index``'s of ``groups`` (runtime.core_attention's head_chunks) on GPUs of ``kv_heads`` KV
        heads: an equal part where the groups split the KV heads; past them, each KV head's bytes go with the first
        of its groups (``reverse``: the last, as backward serves the groups last to first) and the queries' are
        shared by all. The whole latency either way."""
        if groups <= kv_heads:
            return self.part(groups)
        per_kv = groups // kv_heads
        carries = index % per_kv == (per_kv - 1 if reverse else 0)
        share = (1 - self.kv_fraction) / groups + (self.kv_fraction / kv_heads if carries else 0.0)
        return Collective(self.latency, self.transfer * share, self.kv_fraction)


@dataclass
class StepTime:
    """Step time of one batch under one strategy, and where it goes (seconds)."""

    strategy: str
    step: float
    linear: float
    attention: float
    imbalance: float
    comm_exposed: float
    comm_total: float  # collective time of one group summed over the step (the largest group)
    bytes_moved: int  # per layer, forward: every server's bytes of the forward collectives
    max_bytes_per_server: int
    max_tokens_per_server: int
    attention_max_over_mean: float
    fsdp_exposed: float = 0.0  # FSDP2's gathers and reductions the compute does not hide (part of comm_exposed)

    def to_dict(self) -> dict:
        return asdict(self)


RECOMPUTE = ("none", "linear", "full")
# Ping-pong's compute order across layers. "distca": each nano-batch's compute after one layer's core attention runs
# with its compute before the next layer's, so that nano-batch a's next dispatch runs behind nano-batch b's MLP
# (DistCA's schedule). "layerwise": every nano-batch's layer ends before the next layer begins, as
# attnpool.parallel.pingpong runs it (a layer is one FSDP unit and one checkpoint), so that nano-batch a's dispatch
# runs behind nano-batch b's QKV projection alone. The default is DistCA's: on the measured 2-GPU runs "layerwise"
# fits pretrain 256K better and over-predicts prolong 128K by up to 11.2%
# (bench/results/2026-11-30-sim-pingpong-schedule.md).
PINGPONG_SCHEDULES = ("distca", "layerwise")


class StepModel:
    """Step times for one model, cluster and set of costs."""

    def __init__(self, cfg, cluster: Cluster, costs: SimCosts, recompute: str = "none", head: bool = True,
                 fsdp: bool = False, head_chunks: int = 1, pingpong_schedule: str = "distca"):
        """``head``: the servers run the output projection (a pipeline's stages but the last do not); ``fsdp``:
        count FSDP2's parameter gathers and gradient reductions over the servers (the module's docstring);
        ``head_chunks``: the plans' core attention (:meth:`plan_step`, :meth:`nano_step`) in that many groups of
        heads, as attnpool train's head_chunks runs it (:meth:`_simulate`); ``pingpong_schedule``: the order of
        ping-pong's compute (PINGPONG_SCHEDULES, the module docstring)."""
        if recompute not in RECOMPUTE:
            raise ConfigError("recompute", recompute, f"choose one of {', '.join(RECOMPUTE)}")
        if pingpong_schedule not in PINGPONG_SCHEDULES:
            raise ConfigError("pingpong_schedule", pingpong_schedule, f"choose one of {', '.join(PINGPONG_SCHEDULES)}")
        self.cfg = cfg
        self.cluster = cluster
        self.costs = costs
        self.shape = AttentionShape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 2)
        tp = cluster.tp
        lin = costs.linear
        tp_comm = 4 * (tp - 1) / tp * cfg.dim * 2 / costs.intra.bandwidth if tp > 1 else 0.0
        # Per token, per layer, per GPU: forward/backward linear split at core attention.
        # Of the four forward TP collectives one precedes core attention.
        self.tok_fwd_pre = lin.fwd * lin.pre_fraction / tp + tp_comm / 4
        self.tok_fwd_post = lin.fwd * (1 - lin.pre_fraction) / tp + 3 * tp_comm / 4
        self.tok_bwd_pre = lin.bwd * lin.pre_fraction / tp
        self.tok_bwd_post = lin.bwd * (1 - lin.pre_fraction) / tp
        self.tok_head_fwd = lin.head_fwd / tp if head else 0.0
        self.tok_head_bwd = lin.head_bwd / tp if head else 0.0
        # full (attnpool train's full checkpointing, whole layers): core attention's forward runs again
        # in backward too, with its exchanges, before its backward.
        self.attention_again = recompute == "full"
        # What of tok_bwd_pre and tok_bwd_post is the forward again (its linear parts; its TP collectives are not
        # counted again), which full recompute runs as a stage of its own (_passes).
        self.tok_again_pre = self.tok_again_post = 0.0
        if recompute in ("linear", "full"):
            # Activation checkpointing of the linear parts (core attention kept) and a loss
            # computed in checkpointed chunks: backward runs every linear forward and the
            # head's logits once more.
            self.tok_again_pre = lin.fwd * lin.pre_fraction / tp
            self.tok_again_post = lin.fwd * (1 - lin.pre_fraction) / tp
            self.tok_bwd_pre += self.tok_again_pre
            self.tok_bwd_post += self.tok_again_post
            self.tok_head_bwd += lin.head_fwd / tp if head else 0.0
        self.tp_comm_per_token = tp_comm
        self.fsdp = fsdp
        self.counts_fsdp = fsdp and cluster.servers > 1  # (one server shards nothing)
        self.head_chunks = head_chunks
        self.cross_layer = pingpong_schedule == "distca"

    def fsdp_seconds(self) -> dict[str, float]:
        """One FSDP2 collective's time on each GPU's link: a layer's gather ("layer_gather", bf16) and gradient
        reduction ("layer_reduce", float32), the root's ("root_gather", "root_reduce"); a ring over the servers
        moves (servers - 1) / servers of the whole to every GPU."""
        S, cl, cfg = self.cluster.servers, self.cluster, self.cfg
        if S == 1:
            return dict.fromkeys(("layer_gather", "layer_reduce", "root_gather", "root_reduce"), 0.0)
        link = self.costs.inter if S > cl.servers_per_node else self.costs.intra
        layer = (sum(layer_weights(cfg)) + 2 * cfg.dim) / cl.tp  # its matrices and its two norms
        root = (cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim) / cl.tp

        def ring(params, dtype_bytes):
            return link.latency + params * dtype_bytes * (S - 1) / S / link.bandwidth

        return {"layer_gather": ring(layer, 2), "layer_reduce": ring(layer, 4), "root_gather": ring(root, 2),
                "root_reduce": ring(root, 4)}

    def fsdp_exposed(self, forward: np.ndarray, backward: np.ndarray, head_backward: float) -> float:
        """Seconds of a step FSDP2's collectives add: ``forward``/``backward``: each layer's compute on the
        slowest server, in layer order, which hides them; ``head_backward``: the output projection's backward,
        behind which the last layer's second gather runs."""
        if not self.counts_fsdp:
            return 0.0
        t = self.fsdp_seconds()
        gather, reduce = t["layer_gather"], t["layer_reduce"]
        exposed = t["root_gather"] + gather  # nothing runs before the first layer
        exposed += float(np.maximum(gather - forward[:-1], 0.0).sum())  # layer i + 1's behind layer i's forward
        exposed += max(0.0, gather - head_backward)
        # Backward, layer i (last to first): the gather of layer i - 1 and the reduction of layer i + 1 behind it
        L = len(backward)
        for i in range(L - 1, -1, -1):
            link = (gather if i > 0 else 0.0) + (reduce if i < L - 1 else 0.0)
            exposed += max(0.0, link - float(backward[i]))
        return exposed + reduce + t["root_reduce"]  # the first layer's and the root's reductions end the step

    # --- the pieces ---

    def linear_per_token_step(self) -> float:
        """Seconds per token of a server over the whole step (all layers, fwd+bwd, head)."""
        per_layer = self.tok_fwd_pre + self.tok_fwd_post + self.tok_bwd_pre + self.tok_bwd_post
        return self.cfg.n_layers * per_layer + self.tok_head_fwd + self.tok_head_bwd

    def task_attention(self, a, b, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-GPU (fwd, bwd) seconds of tasks on a server of tp GPUs (each GPU runs n_heads / tp), under a
        sliding window of ``window`` keys where given."""
        f, b_ = self.costs.attention(a, b, window)
        return f / self.cluster.tp, (b_ + f if self.attention_again else b_) / self.cluster.tp

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: causal): the model's attention kinds (attnpool.kinds)."""
        return [kind.window for kind in self.cfg.layer_kinds()]

    def ideal(self, doc_lens) -> float:
        """Perfect balance, no communication: mean linear + mean attention (whole documents, each layer its kind)."""
        lens = np.asarray(doc_lens, dtype=np.int64)
        S = self.cluster.servers
        attn = 0.0
        for window, layers in Counter(self.layer_windows).items():
            f, b = self.task_attention(np.zeros_like(lens), lens, window)
            attn += layers * float(f.sum() + b.sum()) / S
        return float(lens.sum()) / S * self.linear_per_token_step() + attn

    def _per_layer(self, layer_of_window) -> list:
        """Each layer's entry, ``layer_of_window(window)`` computed once per distinct window of the model."""
        by_window = {window: layer_of_window(window) for window in dict.fromkeys(self.layer_windows)}
        return [by_window[window] for window in self.layer_windows]

    def _a2a(self, src, dst, nbytes, group_size: int, inter_extra=0.0) -> Collective:
        """One all-to-all over groups of ``group_size`` consecutive servers (bytes src -> dst), each pair's bytes on
        the link between the two (``inter_extra``: per server, bytes across nodes besides)."""
        S, c = self.cluster.servers, group_size
        keep = (src != dst) & (nbytes > 0)
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep].astype(np.float64)
        inter = self.cluster.node(src) != self.cluster.node(dst)
        send_i = np.bincount(src, weights=np.where(inter, 0, nbytes), minlength=S)
        recv_i = np.bincount(dst, weights=np.where(inter, 0, nbytes), minlength=S)
        send_x = np.bincount(src, weights=np.where(inter, nbytes, 0), minlength=S)
        recv_x = np.bincount(dst, weights=np.where(inter, nbytes, 0), minlength=S)
        return self._collective(np.maximum(send_i, recv_i), np.maximum(send_x, recv_x) + inter_extra, c, S // c)

    def _collective(self, intra_bytes, inter_bytes, c: int, G: int) -> Collective:
        transfer = np.maximum(self._link_seconds(intra_bytes, self.costs.intra, c, G),
                              self._link_seconds(inter_bytes, self.costs.inter, c, G))
        has_inter = inter_bytes.reshape(G, c).sum(1) > 0
        latency = np.where(has_inter, self.costs.inter.latency, self.costs.intra.latency)
        return Collective(latency, transfer)

    def _link_seconds(self, nbytes, link, c: int, G: int) -> np.ndarray:
        """Per group of ``c`` servers, the time its servers' ``nbytes`` take on ``link``: the busiest GPU's, or
        on a shared fabric the mean GPU's (Link.shared)."""
        per_gpu = np.asarray(nbytes, dtype=np.float64).reshape(G, c) / self.cluster.tp / link.bandwidth
        return per_gpu.mean(1) if link.shared else per_gpu.max(1)

    # --- strategies ---

    def plan_step(self, plan: Plan | dict, overlap: bool = False, name: str | None = None,
                  task_seconds: tuple[np.ndarray, np.ndarray] | None = None, hierarchical: bool = False) -> StepTime:
        """Step time of a plan from the real planner (local, wlb, cad): all-to-alls over all servers. For a model
        whose layers differ in kind, ``plan`` maps each window to its plan (plan_attention(..., window=w)) and
        each layer runs its window's.

        ``overlap``: ping-pong approximated as two exact halves of this one plan (for callers without the
        planner at hand; :meth:`nano_step` runs ping-pong's nano-batches as the runtime plans them).
        ``task_seconds``: per-GPU (fwd, bwd) seconds of each of the plan's tasks, where the dense table does
        not price them (sparse attention: bench/sim_sparse.py). ``hierarchical``: the hierarchical exchange
        (attnpool train's hierarchical_exchange): KV a relay forwards goes from it, inside its node, in a second
        all-to-all after the first, on the compute path as runtime.core_attention runs it (backward: the forwarded
        rows' gradients back to the relay, then across)."""
        tokens, layers = self._nano_batch(plan, task_seconds, hierarchical)
        return self._simulate(name or _strategy(plan), _even_parts(tokens, layers, 2 if overlap else 1),
                              group_size=self.cluster.servers, head_chunks=self.head_chunks, **_bytes_of([layers]))

    def nano_step(self, nano_plans: list, name: str | None = None, hierarchical: bool = False) -> StepTime:
        """Step time of ping-pong as the runtime runs it: the micro-batch's nano-batches of whole documents
        (plan.layout.nano_batch_bounds), each laid out over every server and planned on its own (``nano_plans``:
        each one's plan, or plans by window as :meth:`plan_step` takes them), interleaved layer by layer. One
        long document makes them unequal, and the smaller then hides less of the larger's exchanges."""
        nanos = [self._nano_batch(plan, None, hierarchical) for plan in nano_plans]
        return self._simulate(name or _strategy(nano_plans[0]), nanos, group_size=self.cluster.servers,
                              head_chunks=self.head_chunks, **_bytes_of([layers for _, layers in nanos]))

    def _nano_batch(self, plan: Plan | dict, task_seconds, hierarchical: bool) -> tuple[np.ndarray, list]:
        """(tokens per server, per layer its entry of :meth:`_plan_layer`) of one (nano-)batch's plan."""
        plans = plan if isinstance(plan, dict) else {window: plan for window in set(self.layer_windows)}
        layers = self._per_layer(lambda window: self._plan_layer(plans[window], task_seconds, hierarchical))
        return next(iter(plans.values())).pieces.tokens_per_rank.astype(np.float64), layers

    def _plan_layer(self, plan: Plan, task_seconds=None, hierarchical: bool = False) -> tuple:
        """One layer under ``plan``: (attention fwd, bwd per server, forward and backward exchanges, bytes moved,
        the bytes each server moves)."""
        S = self.cluster.servers
        if plan.num_ranks != S:
            raise ConfigError("plan.num_ranks", plan.num_ranks, f"the cluster has {S} servers")
        if task_seconds is None:
            f, b = self.task_attention(plan.task_start, plan.task_end, plan.window)
        else:
            f, b = task_seconds[0], task_seconds[1] + (task_seconds[0] if self.attention_again else 0)
        attn_f = np.bincount(plan.task_server, weights=f, minlength=S)
        attn_b = np.bincount(plan.task_server, weights=b, minlength=S)
        home, srv, ln = plan.task_home, plan.task_server, plan.task_len
        x = plan.kv_transfers()
        sh = self.shape
        kv_src = x.senders(self.cluster.node(np.arange(S)) if hierarchical else None)
        src = np.concatenate([home, kv_src])
        dst = np.concatenate([srv, x.server])
        nbytes = np.concatenate([ln * sh.q_bytes, x.length * sh.kv_bytes])
        # Under the hierarchical exchange the relays forward what they received once it came, in a second all-to-all
        # inside core attention's compute (runtime.core_attention: blocking, so under ping-pong too it is on every
        # server's compute path, not hidden behind the other nano-batch), and backward the gradients the other way.
        forwarded = np.r_[np.zeros(len(home), bool), kv_src != x.src]
        out = self._a2a(src[~forwarded], dst[~forwarded], nbytes[~forwarded], S)  # Q + KV out (fwd), dQ + dKV back (bwd)
        sent = np.where((src != dst) & ~forwarded, nbytes, 0)
        out.kv_fraction = float(sent[len(home):].sum() / sent.sum()) if sent.sum() else 0.0
        if forwarded.any():
            relay_s = float(self._a2a(src[forwarded], dst[forwarded], nbytes[forwarded], S).duration().max())
            # backward sends the forwarded rows' gradients back to the relays; a recomputed forward relays again
            attn_f, attn_b = attn_f + relay_s, attn_b + relay_s * (2 if self.attention_again else 1)
        back = self._a2a(srv, home, ln * sh.o_bytes, S)  # O back (fwd), dO out (bwd)
        moved = np.where(src != dst, nbytes, 0)
        o_moved = np.where(srv != home, ln * sh.o_bytes, 0)
        per_server = (np.bincount(src, weights=moved, minlength=S) + np.bincount(srv, weights=o_moved, minlength=S))
        return attn_f, attn_b, (out, back), (back, out), moved.sum() + o_moved.sum(), per_server

    def percp_step(self, group_pieces, cp: int, name: str | None = None) -> StepTime:
        """WLB-LLM packing over DP groups + per-document CP of degree ``cp`` inside each group, analytically.

        ``group_pieces = (doc_len, group, doc, start, length)``: the WLB layout over
        ``servers / cp`` groups (see :func:`attnpool.plan.layout.wlb_pieces`). Every
        piece of a group is cut into ``n = min(2 cp, length // min_shard)`` equal
        chunks (at least 1), chunk i served by CP rank ``min(i, n - 1 - i)`` (head-tail
        pairs; a piece with fewer than 2 cp chunks starts at the CP rank where its
        first token lies in the group's token order); each chunk is one task over its
        causal prefix, and its tokens live on that rank (equal tokens per rank). KV:
        every rank holding part of a piece all-gathers the rest of it (and a piece
        that starts inside its document fetches the prefix from another group,
        charged as inter-node traffic). CP=1 keeps every piece whole.
        """
        doc_len, grp, doc, start, length = group_pieces
        S = self.cluster.servers
        c = int(cp)
        if S % c:
            raise ConfigError("cp", c, f"must divide the number of servers {S}")
        G = S // c
        min_shard = self.costs.min_shard_tokens
        n = np.ones_like(length) if c == 1 else np.minimum(2 * c, np.maximum(1, length // min_shard))
        gtok = np.bincount(grp, weights=length, minlength=G)
        gbase = np.r_[0, np.cumsum(gtok)[:-1]]
        offset = (np.cumsum(length) - length) - gbase[grp]
        first = (offset * c // np.maximum(gtok[grp], 1)).astype(np.int64)
        piece = np.repeat(np.arange(len(length)), n)
        i = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        nn = n[piece]
        a = start[piece] + (i * length[piece]) // nn
        b = start[piece] + ((i + 1) * length[piece]) // nn
        pair = np.minimum(i, nn - 1 - i)
        rank = np.where(nn == 2 * c, pair, (first[piece] + pair) % c)
        server = grp[piece] * c + rank
        tokens = np.bincount(server, weights=b - a, minlength=S)

        def layer_attention(window):
            f, bw = self.task_attention(a, b, window)
            return np.bincount(server, weights=f, minlength=S), np.bincount(server, weights=bw, minlength=S)

        # KV each (piece, rank) receives: the rest of the piece if split, and a remote prefix.
        key = piece * c + rank
        ukey, inv = np.unique(key, return_inverse=True)
        own = np.bincount(inv, weights=b - a)
        upiece, urank = ukey // c, ukey % c
        nranks = np.bincount(upiece, minlength=len(length))[upiece]
        gather = np.where(nranks > 1, length[upiece] - own, 0.0)
        userver = grp[upiece] * c + urank
        kvb = self.shape.kv_bytes
        gather_b = np.bincount(userver, weights=gather, minlength=S) * kvb
        # A CP group of consecutive servers that crosses a node boundary gathers over the inter-node network.
        first_server = np.arange(G) * c
        spans = np.repeat(self.cluster.node(first_server) != self.cluster.node(first_server + c - 1), c)
        none = Collective(np.zeros(G), np.zeros(G))

        def layer(window):  # a remote prefix is fetched whole, or under a window its last window - 1 keys
            prefix = start[upiece] - key_start(start[upiece], window)
            prefix_b = np.bincount(userver, weights=prefix.astype(np.float64), minlength=S) * kvb
            ag = self._collective(np.where(spans, 0.0, gather_b), np.where(spans, gather_b, 0.0) + prefix_b, c, G)
            ag.kv_fraction = 1.0  # KV alone: each server's queries stay home
            return (*layer_attention(window), (ag, none), (ag, ag)), gather_b + prefix_b

        layers = self._per_layer(layer)
        moved = [total for _, total in layers]
        return self._simulate(name or f"percp-cp{c}", [(tokens, [entry for entry, _ in layers])], group_size=c,
                              bytes_moved=int(np.mean([total.sum() for total in moved])),
                              max_bytes=int(max(total.max() for total in moved)))

    def ulysses_step(self, group_pieces, degree: int, name: str | None = None) -> StepTime:
        """WLB-LLM packing over DP groups + Ulysses of ``degree`` servers inside each group, analytically.

        ``group_pieces`` as :meth:`percp_step` takes them. Every server of a group computes every document of
        the group whole on 1/degree of its heads, so a group's attention (its documents' table time) is split
        evenly; a document split across groups fetches its prefix, charged as inter-node traffic. Per layer,
        forward: an all-to-all of Q and K/V out (the server's tokens, (degree - 1)/degree of its heads; K/V of
        the KV heads each peer reads, replicated where degree > KV heads) and one of O back; backward the
        reverse, as the runtime does (runtime.ulysses)."""
        doc_len, grp, doc, start, length = group_pieces
        S, u, sh = self.cluster.servers, int(degree), self.shape
        if S % u:
            raise ConfigError("ulysses degree", u, f"must divide the number of servers {S}")
        tp = self.cluster.tp
        gpu_shape = AttentionShape(sh.n_q_heads // tp, sh.n_kv_heads // tp, sh.head_dim, sh.dtype_bytes)
        problem = ulysses_problem(u, gpu_shape.n_q_heads, gpu_shape.n_kv_heads)
        if problem:
            raise ConfigError("ulysses degree", u, problem)
        G = S // u
        group_tokens = np.bincount(grp, weights=length, minlength=G)
        tokens = np.repeat(group_tokens / u, u)
        def layer_attention(window):
            f, b = self.task_attention(start, start + length, window)
            return (np.repeat(np.bincount(grp, weights=f, minlength=G) / u, u),
                    np.repeat(np.bincount(grp, weights=b, minlength=G) / u, u))

        q, kv, o = bytes_per_peer(u, gpu_shape)  # each of the server's tp GPUs sends its heads' share
        out_bytes = tokens * (u - 1) * (q + kv) * tp
        back_bytes = tokens * (u - 1) * o * tp
        # every pair of a group's servers, each pair's bytes on its own link (a group may span nodes: only the
        # pairs on different nodes cross them)
        members = np.arange(S).reshape(G, u)
        src, dst = np.repeat(members, u, axis=1).ravel(), np.tile(members, (1, u)).ravel()
        back = self._a2a(src, dst, (tokens * o * tp)[src], u)

        def layer(window):  # a piece inside its document fetches the prefix: whole, or under a window its last keys
            remote_keys = start - key_start(start, window)
            prefix = np.repeat(np.bincount(grp, weights=remote_keys, minlength=G) / u, u) * sh.kv_bytes
            out = self._a2a(src, dst, (tokens * (q + kv) * tp)[src], u, inter_extra=prefix)
            return (*layer_attention(window), (out, back), (back, out)), out_bytes + back_bytes + prefix

        layers = self._per_layer(layer)
        moved = [total for _, total in layers]
        return self._simulate(name or f"ulysses-u{u}", [(tokens, [entry for entry, _ in layers])], group_size=u,
                              bytes_moved=int(np.mean([total.sum() for total in moved])),
                              max_bytes=int(max(total.max() for total in moved)))

    # --- the event simulation ---

    def _passes(self, tokens, layers) -> list[tuple]:
        """One nano-batch's forward and backward passes for :meth:`_simulate`, each (compute before its first
        stage, its stages, compute after its last), a stage being one layer's core attention and the compute
        around it: (compute before, attention seconds, (exchange before, exchange after), compute after, whether
        its exchanges are the backward's, which serve head groups last to first). Backward runs the layers in
        reverse; under ``full`` recompute each layer's backward is two stages, its forward again (exchanges
        included) and then its backward, as a checkpointed layer runs."""
        fwd_pre, fwd_post = tokens * self.tok_fwd_pre, tokens * self.tok_fwd_post
        bwd_pre, bwd_post = tokens * self.tok_bwd_pre, tokens * self.tok_bwd_post
        head_f, head_b = tokens * self.tok_head_fwd, tokens * self.tok_head_bwd
        forward = [(fwd_pre, layer[0], layer[2], fwd_post, False) for layer in layers]
        backward = []
        if self.attention_again:  # bwd_pre, bwd_post and the attention's backward hold the forward again
            again_pre, again_post = tokens * self.tok_again_pre, tokens * self.tok_again_post
            only_pre, only_post = bwd_pre - again_pre, bwd_post - again_post
        for layer in reversed(layers):
            if self.attention_again:
                backward += [(again_pre, layer[0], layer[2], again_post, False),
                             (only_post, layer[1] - layer[0], layer[3], only_pre, True)]
            else:
                backward.append((bwd_post, layer[1], layer[3], bwd_pre, True))
        return [(0.0, forward, head_f), (head_b, backward, 0.0)]

    def _simulate(self, name, nanos, group_size, bytes_moved, max_bytes, head_chunks: int = 1) -> StepTime:
        """``nanos``: per nano-batch (one without ping-pong), its tokens per server and its layers: per layer,
        (attention forward and backward seconds per server, the forward's exchanges (before, after core
        attention), the backward's, ...); :meth:`_passes` makes them stages. Each stage runs every nano-batch's
        compute before core attention in turn, each launching its exchange before, then every core attention
        once its exchange is in, each launching its exchange after, one's exchanges behind the next one's
        compute; then, once its exchange after is in, every nano-batch's compute after core attention
        (attnpool.parallel.pingpong: a layer ends before the next begins; under pingpong_schedule "distca" each
        nano-batch's compute after one stage runs with its compute before the next, as DistCA schedules it). With
        ``head_chunks`` each core attention is that many groups of heads (Collective.head_group: equal
        parts, or past the KV heads each KV head's bytes with its first group, in backward its last), as
        runtime.core_attention runs them: every group's exchange before it in turn (each with the whole
        latency), then each group's kernel once its own exchange is in and its exchange after it, so that a
        group's kernel runs behind the next group's transfer."""
        S, c = self.cluster.servers, group_size
        G = S // c
        m = len(nanos)
        kv_heads = max(1, self.shape.n_kv_heads // self.cluster.tp)  # a GPU's
        cf = np.zeros(S)
        mf = np.zeros(G)
        comm_total = np.zeros(G)
        passes = [self._passes(tokens, layers) for tokens, layers in nanos]  # per nano-batch: (forward, backward)

        def after_wait(x, seconds):  # nano-batch x's compute once its last exchange is in
            return cf + seconds if ready[x] is None else np.maximum(cf, np.repeat(ready[x], c)) + seconds

        for p in range(2):
            ready = [None] * m  # per nano-batch: when its last exchange ends (G,)
            for stage in range(len(passes[0][p][1])):
                if stage > 0 and not self.cross_layer:  # every nano-batch's stage ends before the next begins
                    for x in range(m):
                        cf, ready[x] = after_wait(x, passes[x][p][1][stage - 1][3]), None
                if stage == 0 and not self.cross_layer:  # the output projection's backward, of every nano-batch
                    for x in range(m):
                        cf = cf + passes[x][p][0]
                dispatched = [None] * m
                for x in range(m):
                    lead, stages, _ = passes[x][p]
                    pre, _, (before, _), _, reverse = stages[stage]
                    if stage == 0 and self.cross_layer:
                        pre = pre + lead
                    elif self.cross_layer:
                        pre = stages[stage - 1][3] + pre
                    cf = after_wait(x, pre)
                    if before.active:
                        dispatched[x] = []
                        for group in range(head_chunks):
                            took = before.head_group(group, head_chunks, kv_heads, reverse=reverse).duration()
                            mf = np.maximum(mf, cf.reshape(G, c).max(1)) + took
                            comm_total += took
                            dispatched[x].append(mf)
                for x in range(m):
                    _, attn, (_, after), _, reverse = passes[x][p][1][stage]
                    for group in range(head_chunks):
                        arrived = cf if dispatched[x] is None else np.maximum(cf, np.repeat(dispatched[x][group], c))
                        cf = arrived + attn / head_chunks
                        took = after.head_group(group, head_chunks, kv_heads, reverse=reverse).duration() \
                            if after.active else None
                        if took is not None:
                            mf = np.maximum(mf, cf.reshape(G, c).max(1)) + took
                            comm_total += took
                    ready[x] = mf if took is not None else None
            if self.cross_layer:
                for x in range(m):
                    _, stages, tail = passes[x][p]
                    cf = after_wait(x, stages[-1][3] + tail)
            else:  # every nano-batch's last layer, then every output projection (parallel.pingpong.NanoBatchForward)
                for x in range(m):
                    cf = after_wait(x, passes[x][p][1][-1][3])
                for x in range(m):
                    cf = cf + passes[x][p][2]
        tokens = sum(t for t, _ in nanos)
        attn_fwd = [sum(layers[i][0] for _, layers in nanos) for i in range(len(nanos[0][1]))]
        attn_bwd = [sum(layers[i][1] for _, layers in nanos) for i in range(len(nanos[0][1]))]
        fsdp = self.fsdp_exposed(
            np.array([float((tokens * (self.tok_fwd_pre + self.tok_fwd_post) + f).max()) for f in attn_fwd]),
            np.array([float((tokens * (self.tok_bwd_pre + self.tok_bwd_post) + b).max()) for b in attn_bwd]),
            float((tokens * self.tok_head_bwd).max())) if self.counts_fsdp else 0.0
        step = float(cf.max()) + fsdp
        lin = tokens * self.linear_per_token_step()
        attn = sum(attn_fwd) + sum(attn_bwd)
        compute = lin + attn
        mean_attn = float(attn.mean())
        return StepTime(
            strategy=name, step=step, linear=float(lin.mean()), attention=mean_attn,
            imbalance=max(0.0, float(compute.max() - compute.mean())), comm_exposed=max(0.0, step - float(compute.max())),
            comm_total=float(comm_total.max()), bytes_moved=bytes_moved, max_bytes_per_server=max_bytes,
            max_tokens_per_server=int(tokens.max()),
            attention_max_over_mean=float(attn.max() / mean_attn) if mean_attn > 0 else 1.0, fsdp_exposed=fsdp,
        )


def _strategy(plan: Plan | dict) -> str:
    return next(iter(plan.values())).strategy if isinstance(plan, dict) else plan.strategy


def _even_parts(tokens: np.ndarray, layers: list, parts: int) -> list:
    """``parts`` equal nano-batches of one batch (tokens, layers): each a share of the tokens, attention and
    bytes, every collective's latency whole."""
    if parts == 1:
        return [(tokens, layers)]
    part = [(f / parts, b / parts, tuple(x.part(parts) for x in fwd), tuple(x.part(parts) for x in bwd), *rest)
            for f, b, fwd, bwd, *rest in layers]
    return [(tokens / parts, part)] * parts


def _bytes_of(nano_layers: list) -> dict:
    """bytes_moved (one layer's, the layers' mean where their kinds move different amounts) and max_bytes (the
    most one server moves in a layer) of plan-based nano-batches' layers (their bytes summed)."""
    per_layer = list(zip(*nano_layers))
    return dict(bytes_moved=int(np.mean([sum(layer[4] for layer in nanos) for nanos in per_layer])),
                max_bytes=int(max(sum(layer[5] for layer in nanos).max() for nanos in per_layer)))
