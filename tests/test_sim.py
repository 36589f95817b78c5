"""Cluster simulator (attnpool.sim) and the profiler's table assembly (attnpool.bench.profile), on CPU."""

import json
from dataclasses import replace

import numpy as np
import pytest

from attnpool.bench.profile import ProfileOptions, assemble, attention_points, attention_table, comm_entry, linear_entry
from attnpool.cli.main import main
from attnpool.errors import ConfigError
from attnpool.model.config import model_config
from attnpool.plan import PieceTable, TableCost, plan_attention
from attnpool.plan.cost import attention_flops
from attnpool.plan.documents import causal_pairs
from attnpool.sim.costs import DEFAULT_LINEAR_TFLOPS, layer_flops_per_token, load_sim_costs
from attnpool.plan.layout import linear_table, nano_batch_bounds, wlb_pieces
from attnpool.sim.report import paper_report
from attnpool.sim.simulate import SimConfig, simulate_config
from attnpool.sim.steptime import PINGPONG_SCHEDULES, Cluster, Collective, StepModel
from command import run_command

CFG = model_config("llama3-8b")
SMALL = SimConfig(gpus=32, tp=8, tokens_per_gpu=8192, max_doc_len=65536, batches=3, dist="prolong")


def run_cli(*args):
    return run_command(*args)  # (in this process: tests/command.py)


@pytest.fixture(scope="module")
def costs():
    return load_sim_costs(CFG, "llama3-8b")


# --- step-time model ---

def _local_step(model, lens_per_server, B):
    S = len(lens_per_server)
    lens, rank = [], []
    for r, docs in enumerate(lens_per_server):
        lens += docs
        rank += [r] * len(docs)
    n = len(lens)
    table = PieceTable.from_arrays(S, np.asarray(lens), rank, np.arange(n), np.zeros(n), lens)
    plan = plan_attention(table, "local", cost_model=model.costs.attn_fwd_bwd)
    return model.plan_step(plan), lens


def test_balanced_plan_costs_exactly_the_ideal(costs):
    model = StepModel(CFG, Cluster(gpus=32, tp=8, tokens_per_gpu=4096), costs)
    B = 4 * 4096
    st, lens = _local_step(model, [[8192, 4096, 4096]] * 4, B)
    assert st.comm_total == 0.0 and st.comm_exposed == pytest.approx(0.0, abs=1e-12) and st.bytes_moved == 0
    assert st.step == pytest.approx(model.ideal(lens), rel=1e-12)
    assert st.imbalance == pytest.approx(0.0, abs=1e-12)
    assert st.linear + st.attention == pytest.approx(st.step, rel=1e-12)


def test_full_recompute_runs_core_attention_forward_again(costs):
    """recompute full (attnpool train's full checkpointing): the linear parts as under linear, and core
    attention's forward once more in each layer's backward."""
    cluster = Cluster(gpus=32, tp=8, tokens_per_gpu=4096)
    docs = [8192, 4096, 4096]
    steps = {r: _local_step(StepModel(CFG, cluster, costs, r), [docs] * 4, 4 * 4096)[0] for r in ("linear", "full")}
    forward, _ = StepModel(CFG, cluster, costs).task_attention(np.zeros(3, dtype=np.int64), np.array(docs))
    assert steps["full"].linear == pytest.approx(steps["linear"].linear, rel=1e-12)
    assert steps["full"].attention - steps["linear"].attention == pytest.approx(CFG.n_layers * forward.sum(), rel=1e-9)
    # with exchanges (one long document on server 0, cad moving its work), recomputing them costs more
    moved = {}
    for r in ("linear", "full"):
        model = StepModel(CFG, cluster, costs, r)
        lens = [32768] + [4096] * 24  # server 0 one long document, the others eight short ones each
        rank = [0] + [1 + i // 8 for i in range(24)]
        table = PieceTable.from_arrays(4, np.array(lens), rank, np.arange(25), np.zeros(25), lens)
        plan = plan_attention(table, "cad", cost_model=model.costs.attn_fwd_bwd)
        moved[r] = model.plan_step(plan)
    assert moved["full"].comm_total > moved["linear"].comm_total > 0


def test_more_imbalance_takes_longer(costs):
    model = StepModel(CFG, Cluster(gpus=32, tp=8, tokens_per_gpu=4096), costs)
    steps = []
    for long_doc in (4096, 8192, 16384):  # the same tokens on every server, one longer document on server 0
        rest = [4096] * ((16384 - long_doc) // 4096)
        st, _ = _local_step(model, [[long_doc, *rest]] + [[4096] * 4] * 3, 16384)
        steps.append(st)
    assert steps[0].imbalance == pytest.approx(0.0, abs=1e-12)
    assert steps[0].step < steps[1].step < steps[2].step
    assert 0 < steps[1].imbalance < steps[2].imbalance
    for st in steps:  # the breakdown adds up
        assert st.linear + st.attention + st.imbalance + st.comm_exposed == pytest.approx(st.step, rel=1e-9)


def test_pingpong_hides_communication_and_slower_network_costs_more(costs):
    lens = [60000, 3000, 2000, 1000, 30000, 500, 20000, 14572]  # 131072 tokens on 8 servers (TP=1)
    cl = Cluster(gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384)  # one GPU per node: all traffic inter-node
    model = StepModel(CFG, cl, costs)
    plan = plan_attention(linear_table(lens, 8, 16384), "cad", cost_model=costs.attn_fwd_bwd, eps=0.05, shape=model.shape)
    assert plan.num_ranks == 8 and not plan.is_fully_local()
    serial, overlap = model.plan_step(plan, overlap=False), model.plan_step(plan, overlap=True)
    assert overlap.step < serial.step
    # serial: every collective is exposed, plus the wait for the slowest server at each of them
    assert serial.comm_exposed >= serial.comm_total * (1 - 1e-9)
    assert overlap.comm_exposed < serial.comm_exposed
    slow = StepModel(CFG, cl, replace(costs, inter=replace(costs.inter, bandwidth=costs.inter.bandwidth / 100)))
    assert slow.plan_step(plan, overlap=True).step > overlap.step


def test_pingpong_runs_the_nano_batches_the_runtime_makes(costs):
    """cad's ping-pong as the runtime runs it: nano-batches of whole documents (data.batch.GlobalBatch's split),
    each planned alone. One nano-batch is the serial step; a batch of one document cannot be split, so its
    ping-pong hides nothing (the even halves of one plan would have hidden half its exchanges); documents that
    split evenly hide some."""
    lens = [60000, 3000, 2000, 1000, 30000, 500, 20000, 14572]
    cl = Cluster(gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384)
    model = StepModel(CFG, cl, costs)
    plan = plan_attention(linear_table(lens, 8, 16384), "cad", cost_model=costs.attn_fwd_bwd, eps=0.05, shape=model.shape)
    assert model.nano_step([plan]) == model.plan_step(plan, overlap=False)
    nanos = [plan_attention(linear_table(lens[d0:d1], 8, -(-sum(lens[d0:d1]) // 8)), "cad",
                            cost_model=costs.attn_fwd_bwd, eps=0.05, shape=model.shape)
             for d0, d1 in nano_batch_bounds(lens, 2, 8)]
    assert len(nanos) == 2 and model.nano_step(nanos).comm_exposed < model.plan_step(plan).comm_exposed

    one = replace(SMALL, gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384, batches=1, strategies=("cad",))
    whole = simulate_config(one, costs, doc_batches=[[131072]])["strategies"]
    assert whole["cad"]["step_s"] == pytest.approx(whole["cad-serial"]["step_s"], rel=1e-12)
    halves = simulate_config(one, costs, doc_batches=[lens])["strategies"]
    assert halves["cad"]["step_s"] < halves["cad-serial"]["step_s"]


def test_pingpong_schedules_and_the_recomputed_forward_as_its_own_stage(costs):
    """Two nano-batches, one layer, two servers; only the dispatch (T seconds) and the backward's linear part
    after core attention (P) take time. Forward: both dispatches, one after the other, 2T. Under full recompute a
    checkpointed layer runs its forward again, dispatches included, before its backward: 2T again, then 2P;
    its dispatches hide behind nothing (before, they were taken as one exchange with dO's, behind the other
    nano-batch's backward: 5T where it is 6T). With a second layer, "layerwise" (the runtime's order: every
    nano-batch's layer ends before the next begins) hides less than "distca" (a nano-batch's part after one layer
    runs with its part before the next, behind which the other's dispatch runs); one nano-batch runs alike."""
    T = P = 1.0
    cl = Cluster(gpus=2, tp=1, gpus_per_node=2, tokens_per_gpu=1)

    def model(schedule="distca", recompute="full"):
        m = StepModel(CFG, cl, costs, recompute=recompute, pingpong_schedule=schedule)
        m.tok_fwd_pre = m.tok_fwd_post = m.tok_bwd_pre = m.tok_head_fwd = m.tok_head_bwd = 0.0
        m.tok_again_pre = m.tok_again_post = 0.0
        m.tok_bwd_post = P
        return m

    def layer(dispatch=T):
        none = Collective(np.zeros(1), np.zeros(1))
        return (np.zeros(2), np.zeros(2), (Collective(np.zeros(1), np.array([dispatch])), none), (none, none), 0, 0)

    tokens = np.ones(2)
    one_layer = [(tokens, [layer()]), (tokens, [layer()])]
    assert model()._simulate("cad", one_layer, 2, 0, 0).step == pytest.approx(2 * T + 2 * T + 2 * P)
    assert model(recompute="none")._simulate("cad", one_layer, 2, 0, 0).step == pytest.approx(2 * T + 2 * P)
    two_layers = [(tokens, [layer(), layer()]), (tokens, [layer(), layer()])]
    distca, layerwise = (model(s, "none") for s in ("distca", "layerwise"))
    for m in (distca, layerwise):  # a part after core attention worth hiding a dispatch behind
        m.tok_fwd_post = T
    assert layerwise._simulate("cad", two_layers, 2, 0, 0).step > distca._simulate("cad", two_layers, 2, 0, 0).step
    assert layerwise._simulate("cad", two_layers[:1], 2, 0, 0).step == pytest.approx(
        distca._simulate("cad", two_layers[:1], 2, 0, 0).step, rel=1e-12)
    # Real costs, tp 8, full recompute: every stage's compute is a time (the forward again holds its linear parts, not
    # the TP collectives), and a plan without exchanges runs at its compute under either order.
    lens = [8192] * 16  # a whole document on each server of each nano-batch: no exchange
    wide = Cluster(gpus=64, tp=8, gpus_per_node=8, tokens_per_gpu=16384)
    for schedule in PINGPONG_SCHEDULES:
        m = StepModel(CFG, wide, costs, recompute="full", pingpong_schedule=schedule)
        nanos = [plan_attention(linear_table(lens[d0:d1], 8, -(-sum(lens[d0:d1]) // 8)), "local",
                                cost_model=costs.attn_fwd_bwd) for d0, d1 in nano_batch_bounds(lens, 2, 8)]
        assert len(nanos) == 2
        for lead, stages, tail in m._passes(*m._nano_batch(nanos[0], None, False)):
            assert all(np.all(np.asarray(part) >= 0) for stage in stages for part in (stage[0], stage[1], stage[3]))
        step = m.nano_step(nanos)
        assert step.comm_exposed == pytest.approx(0.0, abs=1e-9) and step.comm_total == 0
    with pytest.raises(ConfigError, match="pingpong_schedule"):
        StepModel(CFG, cl, costs, pingpong_schedule="cross")
    with pytest.raises(ConfigError, match="pingpong_schedule"):
        replace(SMALL, pingpong_schedule="cross").check()


def test_head_chunks_hide_exchanges_behind_the_other_groups_kernels(costs):
    """Core attention in groups of heads: the same bytes in more collectives (each with its latency), a shorter
    step where the exchanges were exposed, and nothing changed for a plan without exchanges. A batch of one
    document, which ping-pong cannot split, hides most of its exchanges so."""
    lens = [60000, 3000, 2000, 1000, 30000, 500, 20000, 14572]
    cl = Cluster(gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384)
    slow_costs = replace(costs, inter=replace(costs.inter, bandwidth=costs.inter.bandwidth / 20))
    slow = {n: StepModel(CFG, cl, slow_costs, head_chunks=n) for n in (1, 2, 4)}
    plan = plan_attention(linear_table(lens, 8, 16384), "cad", cost_model=costs.attn_fwd_bwd, eps=0.05,
                          shape=slow[1].shape)
    one, two, four = (slow[n].plan_step(plan) for n in (1, 2, 4))
    assert four.step < two.step < one.step
    assert four.step > max(one.step - one.comm_exposed, 0)  # the first group's exchange stays exposed
    collectives = 4 * CFG.n_layers  # Q/KV out, O back, dO out, dQ/dKV back in every layer
    for chunked, n in ((two, 2), (four, 4)):
        assert chunked.comm_total == pytest.approx(one.comm_total + (n - 1) * collectives * costs.inter.latency,
                                                   rel=1e-9)
    local = plan_attention(linear_table([16384] * 8, 8, 16384), "local", cost_model=costs.attn_fwd_bwd)
    unchunked, chunked = slow[1].plan_step(local), slow[4].plan_step(local)
    assert chunked.comm_total == unchunked.comm_total == 0
    assert chunked.step == pytest.approx(unchunked.step, rel=1e-12)  # (the kernel's time in four parts)
    config = replace(SMALL, gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384, batches=1, strategies=("cad",))
    whole = {n: simulate_config(replace(config, head_chunks=n), costs, doc_batches=[[131072]])["strategies"]
             for n in (1, 2)}
    assert whole[2]["cad"]["step_s"] < whole[1]["cad"]["step_s"]
    with pytest.raises(ConfigError, match="head_chunks"):
        replace(config, head_chunks=3).check()  # llama3-8b's 8 KV heads


def test_head_groups_finer_than_the_kv_heads_carry_each_kv_head_with_one_group(costs):
    """Past the KV heads (llama3-8b's 8 a GPU, 16 groups) a KV head's bytes go with one of its groups: the same
    bytes in all, the groups' shares unequal, and so less hidden than the same count of equal groups."""
    whole = Collective(np.array([1e-5]), np.array([2.0]), kv_fraction=0.75)
    shares = [whole.head_group(g, 16, 8).transfer[0] for g in range(16)]
    assert sum(shares) == pytest.approx(2.0)
    assert shares[0] == pytest.approx(2.0 * (0.25 / 16 + 0.75 / 8)) and shares[1] == pytest.approx(2.0 * 0.25 / 16)
    backward = [whole.head_group(g, 16, 8, reverse=True).transfer[0] for g in range(16)]
    assert backward[1] == shares[0] and backward[0] == shares[1]  # served last to first: the KV with the last
    assert [whole.head_group(g, 8, 8).transfer[0] for g in range(8)] == [2.0 / 8] * 8
    lens = [60000, 3000, 2000, 1000, 30000, 500, 20000, 14572]
    cl = Cluster(gpus=8, tp=1, gpus_per_node=1, tokens_per_gpu=16384)
    slow_costs = replace(costs, inter=replace(costs.inter, bandwidth=costs.inter.bandwidth / 20))
    finer = StepModel(CFG, cl, slow_costs, head_chunks=16)
    plan = plan_attention(linear_table(lens, 8, 16384), "cad", cost_model=costs.attn_fwd_bwd, eps=0.05,
                          shape=finer.shape)
    step = finer.plan_step(plan).step
    equal = Collective.head_group
    try:  # the same count taken as equal groups, as the model did before
        Collective.head_group = lambda self, index, groups, kv_heads, reverse=False: self.part(groups)
        equal_step = finer.plan_step(plan).step
    finally:
        Collective.head_group = equal
    assert step > equal_step


def test_ulysses_fetches_only_a_windows_keys_of_a_remote_prefix(costs):
    """A piece that starts inside its document, in another Ulysses group, fetches the keys before it: all of them
    in a causal layer, the window's last ones (window - 1) in a sliding layer, as percp's model does."""
    cl = Cluster(gpus=4, tp=1, gpus_per_node=1, tokens_per_gpu=32768)
    pieces = wlb_pieces([131072], 2, 65536, 1.1)  # one document over two groups of two
    start = pieces[3]
    assert start.max() > 1024
    causal = StepModel(CFG, cl, costs).ulysses_step(pieces, 2)
    windowed = StepModel(model_config("llama3-8b", sliding_window=1024), cl, costs).ulysses_step(pieces, 2)
    kv_bytes = 2 * CFG.n_kv_heads * CFG.head_dim * 2
    assert causal.bytes_moved - windowed.bytes_moved == pytest.approx(
        float((start - np.minimum(start, 1023)).sum()) * kv_bytes, rel=1e-12)


def test_fsdp_gathers_and_reductions_exposed_where_compute_cannot_hide_them(costs):
    """FSDP2 over 4 servers of one GPU on 4 nodes: where each layer's compute hides its neighbours' collectives,
    the step grows by what nothing hides, counted here from the model's sizes: the root's bf16 gather (embedding
    and output projection) and the first layer's before the first layer, the first layer's and the root's float32
    reductions after the last backward. Over a link 100x slower every layer's collective shows; one server
    gathers nothing."""
    cl = Cluster(gpus=4, tp=1, gpus_per_node=1, tokens_per_gpu=16384)
    docs = [[16384]] * 4
    plain, _ = _local_step(StepModel(CFG, cl, costs), docs, 16384)
    with_fsdp, _ = _local_step(StepModel(CFG, cl, costs, fsdp=True), docs, 16384)
    link = costs.inter
    layer = 4096 * 128 * (32 + 2 * 8) + 4096 * 128 * 32 + 3 * 4096 * 14336 + 2 * 4096  # Q/K/V, O, MLP, norms
    root = 2 * 128256 * 4096 + 4096  # embedding, output projection, final norm

    def ring(params, nbytes):
        return link.latency + params * nbytes * 3 / 4 / link.bandwidth

    expected = ring(root, 2) + ring(layer, 2) + ring(layer, 4) + ring(root, 4)
    assert with_fsdp.fsdp_exposed == pytest.approx(expected, rel=1e-9)
    assert with_fsdp.step == pytest.approx(plain.step + expected, rel=1e-9) and plain.fsdp_exposed == 0.0
    slow = replace(costs, inter=replace(link, bandwidth=link.bandwidth / 100))
    crawling, _ = _local_step(StepModel(CFG, cl, slow, fsdp=True), docs, 16384)
    assert crawling.fsdp_exposed > 100 * (expected - 4 * link.latency) * 2  # every layer's gathers now show
    one, _ = _local_step(StepModel(CFG, Cluster(gpus=1, tp=1, gpus_per_node=1, tokens_per_gpu=16384), costs,
                                   fsdp=True), [[16384]], 16384)
    assert one.fsdp_exposed == 0.0


def test_fsdp_exposure_follows_what_each_collective_hides_behind(costs):
    """Three layers whose compute is either nothing or plenty: layer 1's gather waits behind layer 0's empty
    forward, layer 2's hides behind layer 1's; the last layer's second gather behind an empty head backward shows;
    in backward, layer 1's empty compute exposes layer 0's gather and layer 2's reduction, layers 2 and 0 hide
    theirs; the first layer's and the root's reductions end the step."""
    model = StepModel(CFG, Cluster(gpus=4, tp=1, gpus_per_node=1, tokens_per_gpu=16384), costs, fsdp=True)
    t = model.fsdp_seconds()
    g, r = t["layer_gather"], t["layer_reduce"]
    big = 1e3
    exposed = model.fsdp_exposed(np.array([0.0, big, big]), np.array([big, 0.0, big]), 0.0)
    expected = t["root_gather"] + g + g + g + (g + r) + r + t["root_reduce"]
    assert exposed == pytest.approx(expected, rel=1e-12)
    hidden = model.fsdp_exposed(np.array([big, big, big]), np.array([big, big, big]), big)
    assert hidden == pytest.approx(t["root_gather"] + g + r + t["root_reduce"], rel=1e-12)
    assert StepModel(CFG, model.cluster, costs).fsdp_exposed(np.zeros(3), np.zeros(3), 0.0) == 0.0  # fsdp off


def test_a_shared_fabric_moves_a_skewed_all_to_all_at_its_total_bytes(costs):
    """One long document on the first of 4 servers: cad sends its work out, so the first GPU sends most of the
    bytes. On links of their own the exchange takes the busiest GPU's bytes; on one shared fabric (the emulated
    network's loopback), the mean GPU's, at most as long."""
    cl = Cluster(gpus=4, tp=1, gpus_per_node=1, tokens_per_gpu=16384)
    own = StepModel(CFG, cl, costs)
    shared = StepModel(CFG, cl, replace(costs, inter=replace(costs.inter, shared=True)))
    plan = plan_attention(linear_table([16384] + [512] * 96, 4, 16384), "cad", cost_model=costs.attn_fwd_bwd,
                          shape=own.shape)
    src = np.array([0, 0, 0, 1])
    dst = np.array([1, 2, 3, 0])
    nbytes = np.array([3e9, 3e9, 3e9, 1e9])
    per_gpu = np.maximum(np.bincount(src, weights=nbytes, minlength=4), np.bincount(dst, weights=nbytes, minlength=4))
    assert own._a2a(src, dst, nbytes, 4).transfer[0] == pytest.approx(per_gpu.max() / costs.inter.bandwidth)
    assert shared._a2a(src, dst, nbytes, 4).transfer[0] == pytest.approx(per_gpu.mean() / costs.inter.bandwidth)
    assert shared.plan_step(plan).step < own.plan_step(plan).step


def test_tp_divides_attention_and_linear_per_server(costs):
    # One server of 8 GPUs holds 8x the tokens of one GPU at TP=1: the same work per GPU, plus TP collectives.
    one = StepModel(CFG, Cluster(gpus=1, tp=1, gpus_per_node=8, tokens_per_gpu=8192), costs)
    eight = StepModel(CFG, Cluster(gpus=8, tp=8, gpus_per_node=8, tokens_per_gpu=8192), costs)
    f1, b1 = one.task_attention(np.array([0]), np.array([8192]))
    f8, b8 = eight.task_attention(np.array([0]), np.array([8192]))
    assert f8[0] == pytest.approx(f1[0] / 8) and b8[0] == pytest.approx(b1[0] / 8)
    assert one.tp_comm_per_token == 0.0 and eight.tp_comm_per_token > 0.0
    assert 8 * 8192 * (eight.linear_per_token_step()) > 8192 * one.linear_per_token_step()


def test_percp_model_conserves_work_and_balances_long_documents(costs):
    S, B = 4, 65536
    model = StepModel(CFG, Cluster(gpus=4 * 8, tp=8, tokens_per_gpu=B // 8), costs)
    lens = [131072, 65536, 32768, 32768]
    pieces = wlb_pieces(lens, 1, S * B)
    st = model.percp_step(pieces, S)
    assert st.attention_max_over_mean < 1.01  # every long document cut head-tail over all 4 ranks
    assert st.max_tokens_per_server == B
    assert st.bytes_moved > 0 and st.comm_exposed > 0
    pairs = sum(float(causal_pairs(0, L)) for L in lens)
    ideal_flops = CFG.n_layers * float(attention_flops(pairs, CFG.n_heads, CFG.head_dim, "fwd+bwd")) / 8
    assert st.attention * S == pytest.approx(ideal_flops / 330e12, rel=0.1)  # ~330 TFLOP/s on big shards


# --- simulation ---

def test_wlb_ideal_is_the_best_dp_x_cp_and_speedup_is_over_it():
    r = simulate_config(SMALL)
    s = r["strategies"]
    baselines = {k: sum(v["per_batch_step_s"]) for k, v in s.items() if k == "wlb" or k.startswith("percp-cp")}
    assert set(baselines) == {"wlb", "percp-cp2", "percp-cp4"}  # 4 servers: CP 1, 2, 4
    best = min(baselines, key=baselines.get)
    assert r["wlb_ideal"]["strategy"] == best
    assert r["wlb_ideal"]["cp"] * r["wlb_ideal"]["dp"] == r["servers"] == 4
    assert r["speedup"] == pytest.approx(baselines[best] / sum(s["cad"]["per_batch_step_s"]))
    assert r["speedup_vs_best_per_batch"] <= r["speedup"] + 1e-12
    assert s["cad"]["step_s"] <= s["cad-serial"]["step_s"]
    assert r["ideal_step_s"] <= s["cad"]["step_s"] * (1 + 1e-9)


def test_small_run_is_deterministic():
    a, b = simulate_config(SMALL, eps_sweep=[0.01, 0.1]), simulate_config(SMALL, eps_sweep=[0.01, 0.1])
    a.pop("wall_s"), b.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert [p["eps"] for p in a["eps_sweep"]] == [0.01, 0.1]


def test_cli_json_has_speedup(capsys, tmp_path):
    assert main(["simulate", "--gpus", "32", "--tokens-per-gpu", "8K", "--max-doc-len", "64K", "--batches", "2",
                 "--json", "--plot-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["speedup"], float) and out["speedup"] > 0
    assert out["configs"][0]["speedup"] == out["speedup"]
    assert {"local", "wlb", "cad", "cad-serial"} <= set(out["configs"][0]["strategies"])
    assert "linear" in out["assumptions"]["sources"]
    assert (tmp_path / "speedup.png").stat().st_size > 5000
    assert (tmp_path / "breakdown.png").stat().st_size > 5000


def test_cli_simulates_core_attention_in_groups_of_heads(capsys):
    """--head-chunks: cad's exchanges hidden behind its own kernels over a slow link; refused where it cannot split
    a GPU's heads (llama3-8b's over --tp 8: one KV head, four query heads; 3 groups neither divide nor share it)."""
    steps = {}
    for n in (1, 4):
        assert main(["simulate", "--gpus", "8", "--tp", "1", "--gpus-per-node", "1", "--tokens-per-gpu", "16K",
                     "--max-doc-len", "128K", "--dist", "pretrain", "--batches", "1", "--strategies", "cad",
                     "--inter-bw", "5", "--head-chunks", str(n), "--json"]) == 0
        steps[n] = json.loads(capsys.readouterr().out)["configs"][0]["strategies"]["cad-serial"]["step_s"]
    assert steps[4] < steps[1]
    assert main(["simulate", "--tp", "8", "--head-chunks", "3", "--batches", "1"]) == 2
    assert "head_chunks" in capsys.readouterr().err


def test_cli_prices_pingpong_in_the_runtimes_layerwise_order(capsys):
    """--pingpong-schedule layerwise: cad with ping-pong over a slow link hides less than in DistCA's order (its
    serial step, one nano-batch, the same), and the report says which order it priced."""
    out = {}
    for schedule in ("distca", "layerwise"):
        assert main(["simulate", "--gpus", "8", "--tp", "1", "--gpus-per-node", "1", "--tokens-per-gpu", "16K",
                     "--max-doc-len", "64K", "--batches", "1", "--strategies", "cad", "--inter-bw", "5",
                     "--pingpong-schedule", schedule, "--json"]) == 0
        out[schedule] = json.loads(capsys.readouterr().out)
        assert out[schedule]["assumptions"]["pingpong_schedule"] == schedule
    distca, layerwise = (out[s]["configs"][0]["strategies"] for s in ("distca", "layerwise"))
    assert layerwise["cad"]["step_s"] > distca["cad"]["step_s"]
    assert layerwise["cad-serial"]["step_s"] == pytest.approx(distca["cad-serial"]["step_s"], rel=1e-12)


def test_cli_sweep_gives_speedup_per_configuration(capsys):
    assert main(["simulate", "--gpus", "16,32", "--tokens-per-gpu", "8K", "--max-doc-len", "32K,64K", "--batches", "1",
                 "--strategies", "wlb,cad", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["configs"]) == 4 and set(out["speedup"]) == {r["label"] for r in out["configs"]}
    assert all(v > 0 for v in out["speedup"].values())


def test_cli_table_output(capsys):
    assert main(["simulate", "--gpus", "16", "--tokens-per-gpu", "8K", "--max-doc-len", "32K", "--batches", "1",
                 "--eps-sweep", "0.01,0.1"]) == 0
    out = capsys.readouterr().out
    assert "speedup of cad over WLB-ideal" in out and "tolerance sweep" in out


def test_paper_report_writes_markdown_and_json(tmp_path):
    info = paper_report(tmp_path, replace(SMALL, batches=1, tokens_per_gpu=8192),
                        grid=dict(models=("llama3-8b",), dists=("prolong",), max_doc_lens=(65536,), gpus=(16, 32)),
                        command="test")
    md = (tmp_path / "sim_paper_scale.md").read_text()
    data = json.loads((tmp_path / "sim_paper_scale.json").read_text())
    assert "not measurements" in md and "1.05-1.12x" in md
    assert data["predictions"] is True and len(data["configs"]) == 2
    assert info["speedup_range"][0] > 0


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def test_bad_input_exits_2(tmp_path, capsys):
    default = json.loads((__import__("importlib").resources.files("attnpool.resources") / "cost_h200.json").read_text())
    other_model = _write(tmp_path, "d64.json", {**default, "head_dim": 64})
    no_fwd = _write(tmp_path, "nofwd.json", {**default, "tables": {"fwd+bwd": default["tables"]["fwd+bwd"]}})
    no_grid = _write(tmp_path, "nogrid.json", {k: v for k, v in default.items() if k != "q_grid"})
    bad_linear = _write(tmp_path, "lin.json", {**default, "linear": {"models": {"llama3-8b": {"fwd_s_per_token": 1e-9}}}})
    base = ["simulate", "--batches", "1", "--gpus", "16", "--tokens-per-gpu", "8K", "--max-doc-len", "32K"]
    cases = [
        (["--gpus", "12"], "not divisible by tp"),
        (["--tp", "3"], "gpus_per_node"),
        (["--tokens-per-gpu", "256"], "smallest shard"),
        (["--profile", other_model], "head_dim"),
        (["--profile", no_fwd], "tables.fwd"),
        (["--profile", no_grid], "malformed cost table"),
        (["--profile", bad_linear], "fwd_bwd_s_per_token"),
        (["--profile", str(tmp_path / "missing.json")], "no such file"),
        (["--model", "gpt5"], "unknown preset"),
        (["--eps", "0"], "eps"),
        (["--dist", "nope"], "unknown distribution"),
        (["--inter-bw", "0"], "bandwidth"),
        (["--max-doc-len", "12Q"], "not a size"),  # argparse: exits 2 itself
    ]
    for extra, needle in cases:  # in-process (fast); any exception other than ConfigError would fail the test
        try:
            code = main([*base, *extra])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert needle in err, (extra, err)
    r = run_cli(*base, "--gpus", "12")  # and once end to end: one line, exit 2, no traceback
    assert r.returncode == 2 and "not divisible by tp" in r.stderr and "Traceback" not in r.stderr


def test_profile_without_gpu_exits_2(tmp_path):
    r = run_cli("profile", "--out", str(tmp_path / "p.json"), "--quick")
    assert r.returncode == 2 and "CUDA" in r.stderr and "Traceback" not in r.stderr


# --- profiler table assembly with a fake timer ---

def _fake_rate(q, k, phase):
    """A made-up kernel: slower for short shards and short prefixes (TFLOP/s)."""
    base = 340.0 if phase == "fwd" else 320.0
    return base * min(1.0, 0.3 + 0.1 * np.log2(q)) * min(1.0, 0.5 + 0.05 * np.log2(k))


def test_profile_table_round_trips_through_tablecost_and_sim_costs():
    opts = replace(ProfileOptions.quick(), q_grid=(128, 512, 2048, 8192), k_grid=(128, 512, 2048, 8192, 32768),
                   q_measure_max=2048, models=("llama3-8b",))
    calls = []

    def fake_attention(q, k, n, phase):
        calls.append((q, k, n, phase))
        flops = attention_flops(n * causal_pairs(k - q, k), opts.n_q_heads, opts.head_dim, phase)
        return float(flops) / (_fake_rate(q, k, phase) * 1e12)

    att = attention_table(fake_attention, opts)
    assert len(calls) == 2 * len(attention_points(opts))
    assert all(n >= 1 and n * q <= max(opts.target_q_tokens, q) for q, _, n, _ in calls)

    lin_cfg = model_config("llama3-8b")
    pre, post = layer_flops_per_token(lin_cfg)
    fake_layer = lambda T, phase: T * (pre + post) * (1 if phase == "fwd" else 3) / 500e12 + 1e-4  # noqa: E731
    linear = {"llama3-8b": linear_entry(fake_layer, lin_cfg, (2048, 8192), lambda phase: 0.01, 4096)}
    fake_coll = lambda kind, b: 20e-6 + b * 7 / 8 / 200e9 if kind == "all_to_all" else 30e-6 + b * 7 / 300e9  # noqa: E731
    comm = comm_entry(fake_coll, 8, (2**16, 2**20, 2**24))
    obj = json.loads(json.dumps(assemble({"flash": att}, opts, linear=linear, comm=comm, device={"name": "FakeGPU"},
                                         meta={"torch": "x"})))

    for phase in ("fwd", "fwd+bwd"):
        t = TableCost.from_json(obj, phase)
        for q, k, _, _ in calls:
            assert float(t.interpolate(q, k)) == pytest.approx(_fake_rate(q, k, phase), rel=1e-4)
        # filled: q above the measured maximum takes the largest measured q of its column
        assert float(t.interpolate(8192, 32768)) == pytest.approx(_fake_rate(2048, 32768, phase), rel=1e-4)
        # filled: q > k takes the diagonal
        assert float(t.interpolate(2048, 512)) == pytest.approx(_fake_rate(512, 512, phase), rel=1e-4)
    assert obj["attention"]["filled"] > 0 and obj["device"]["name"] == "FakeGPU"

    c8 = load_sim_costs(lin_cfg, "llama3-8b", obj)
    assert c8.linear.source.startswith("measured")
    assert c8.linear.fwd + c8.linear.bwd == pytest.approx(linear["llama3-8b"]["fwd_bwd_s_per_token"])
    assert c8.intra.bandwidth == pytest.approx(200e9, rel=1e-3) and c8.intra.latency == pytest.approx(20e-6, rel=1e-2)
    # another model: the measured TFLOP/s applied to its FLOPs
    cfg34 = model_config("llama-34b")
    c34 = load_sim_costs(cfg34, "llama-34b", obj)
    p34, q34 = layer_flops_per_token(cfg34)
    assert (c34.linear.fwd + c34.linear.bwd) == pytest.approx(3 * (p34 + q34) / (linear["llama3-8b"]["tflops_fwd_bwd"] * 1e12))
    # a table without a linear section: the documented assumption
    no_linear = {k: v for k, v in obj.items() if k != "linear"}
    d = load_sim_costs(lin_cfg, "llama3-8b", no_linear)
    assert d.linear.fwd == pytest.approx((pre + post) / (DEFAULT_LINEAR_TFLOPS * 1e12))
    # the packaged table was measured on an H200: its linear section is used
    assert load_sim_costs(lin_cfg, "llama3-8b").linear.source.startswith("measured")
    with pytest.raises(ConfigError, match="head_dim"):
        load_sim_costs(model_config("tiny"), "tiny", obj)


def test_profile_measuring_code_runs_on_cpu_with_reference_backend():
    """The CUDA profiler's plumbing (buffers, cu_seqlens, the layer and head calls) with a wall-clock timer."""
    import torch

    from attnpool.bench.profile import AttentionBench, linear_measures, wall_median

    opts = ProfileOptions(q_grid=(16, 32), k_grid=(16, 32, 64), q_measure_max=32, target_q_tokens=64, max_kv_tokens=256,
                          n_q_heads=2, n_kv_heads=1, head_dim=16, min_time_s=0.0, max_reps=3)
    bench = AttentionBench(opts, "cpu", backend_name="reference", timer=wall_median, dtype=torch.float32)
    obj = assemble({"reference": attention_table(bench, opts)}, opts, device={"name": "cpu"})
    assert TableCost.from_json(obj, "fwd", "reference").tflops.shape == (2, 3)
    assert obj["backends"]["reference"]["source"] == "attnpool profile: reference varlen, bf16, on cpu"
    tiny = model_config("tiny")
    layer, head = linear_measures(tiny, "cpu", replace(opts, head_tokens=32), timer=wall_median, dtype=torch.float32)
    entry = linear_entry(layer, tiny, (32, 64), head, 32)
    assert entry["fwd_bwd_s_per_token"] > 0 and entry["head_fwd_bwd_s_per_token"] > 0


def _comm_rank(rank, world):
    from attnpool.bench.profile import measure_collectives, wall_median

    opts = replace(ProfileOptions(), min_time_s=0.0, max_reps=3, comm_bytes=(2**12, 2**16))
    return measure_collectives("cpu", opts, timer=wall_median, backend="gloo")


def test_profile_comm_code_runs_on_gloo():
    from dist_harness import run_distributed

    r0, r1 = run_distributed(_comm_rank, 3)[:2]
    assert r1 == {}  # rank 0 reports
    assert r0["world_size"] == 3 and set(r0["by_world_size"]) == {"2", "3"}
    assert len(r0["all_to_all"]) == 2 and r0["fit"]["all_gather"]["bandwidth_Bps"] > 0
    obj = assemble({}, ProfileOptions(), comm=r0, base=json.loads(
        (__import__("importlib").resources.files("attnpool.resources") / "cost_h200.json").read_text()))
    assert load_sim_costs(CFG, "llama3-8b", obj).intra.source.startswith("measured")


def test_cp_group_inside_a_node_uses_nvlink(costs):
    """CP=2 inside an 8-GPU node (TP=4: 2 servers per node) gathers faster than CP=2 across nodes (TP=8)."""
    lens = [65536, 32768, 32768]
    inside = StepModel(CFG, Cluster(gpus=8, tp=4, gpus_per_node=8, tokens_per_gpu=16384), costs)
    across = StepModel(CFG, Cluster(gpus=16, tp=8, gpus_per_node=8, tokens_per_gpu=8192), costs)
    a = inside.percp_step(wlb_pieces(lens, 1, 131072), 2)
    b = across.percp_step(wlb_pieces(lens, 1, 131072), 2)
    assert a.bytes_moved == b.bytes_moved > 0
    assert a.comm_total < b.comm_total


def test_one_part_of_a_link_given_keeps_the_profiles_measured_other():
    """--intra-latency-us alone keeps the packaged profile's measured all-to-all bandwidth (and --intra-bw alone its
    latency): a partial override is not a swap for the built-in assumption."""
    from attnpool.cli.main import build_parser
    from attnpool.cli.simulate_cmd import _overrides

    measured = load_sim_costs(CFG, "llama3-8b").intra
    for flags, bandwidth, latency in ((["--intra-latency-us", "20"], measured.bandwidth, 20e-6),
                                      (["--intra-bw", "400"], 400e9, measured.latency)):
        args = build_parser().parse_args(["simulate", *flags])
        link = load_sim_costs(CFG, "llama3-8b", **_overrides(args)).intra
        assert (link.bandwidth, link.latency) == pytest.approx((bandwidth, latency)), flags
        assert link.source.startswith("given: ") and ("otherwise measured" in link.source), link.source


def test_balanced_layout_simulated_on_request_beside_the_linear_one():
    """SimConfig(balanced=True): local and cad also over the balanced layout (equal tokens, whole documents placed to
    even out attention first): local's imbalance falls at no byte, and cad moves fewer bytes to its balance."""
    config = SimConfig(gpus=2, tp=1, gpus_per_node=2, tokens_per_gpu=32768, max_doc_len=8192, batches=3,
                       strategies=("local", "cad"), balanced=True)
    s = simulate_config(config)["strategies"]
    assert {"local-balanced", "cad-balanced", "cad-balanced-serial"} <= set(s)
    assert s["local-balanced"]["max_tokens_per_server"] == s["local"]["max_tokens_per_server"] == 32768
    # (bytes: only a document split at a rank's end sends its prefix's KV, as under the linear layout)
    assert s["local-balanced"]["bytes_moved"] <= s["local"]["bytes_moved"]
    assert s["local-balanced"]["attention_max_over_mean"] < s["local"]["attention_max_over_mean"]
    assert s["cad-balanced-serial"]["bytes_moved"] < s["cad-serial"]["bytes_moved"]
    assert "local-balanced" not in simulate_config(replace(config, balanced=False))["strategies"]


def test_percp_priced_as_attnpools_percp_plan_on_request_and_never_a_grid_baseline():
    """SimConfig(percp_plan=True): percp also as the plan attnpool bench's percp runs (the linear layout kept: its
    tokens stay, queries and KV prefixes travel), beside the analytic per-document CP; the grid's best baseline is
    chosen among the analytic models only."""
    r = simulate_config(SimConfig(gpus=4, tp=1, gpus_per_node=4, tokens_per_gpu=8192, max_doc_len=32768, batches=1,
                                  strategies=("local", "wlb", "percp", "cad"), percp_plan=True))
    plan = r["strategies"]["percp-plan"]
    assert plan["max_tokens_per_server"] == 8192 and plan["bytes_moved"] > 0
    assert r["best_baseline"]["strategy"] != "percp-plan" and "percp-cp4" in r["strategies"]
    assert "percp-plan" not in simulate_config(SimConfig(gpus=4, tp=1, gpus_per_node=4, tokens_per_gpu=8192,
                                                         max_doc_len=32768, batches=1))["strategies"]
