"""Ulysses in the simulator, and nodes in the cad planner (plan.plan.Topology) and in a run's settings."""

from __future__ import annotations

import background
import numpy as np
import pytest

from attnpool.errors import ConfigError
from attnpool.model.config import model_config
from attnpool.plan import AttentionShape, PairsCost, linear_table, plan_attention
from attnpool.plan.layout import wlb_pieces
from attnpool.plan.metrics import imbalance, server_loads
from attnpool.plan.plan import Topology
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.simulate import SimConfig, simulate_config
from attnpool.sim.steptime import Cluster, StepModel

CFG = model_config("llama3-8b")
SHAPE = AttentionShape(32, 8, 128, 2)


@pytest.fixture(scope="module")
def costs():
    return load_sim_costs(CFG, "llama3-8b")


def test_ulysses_step_balances_by_heads_and_moves_every_token(costs):
    """4 servers of one GPU each: the group's attention split evenly whatever the documents, 3/4 of every token's
    Q, K/V (8 KV heads over 4: two each) and O in each direction; more bytes than cad, none of its imbalance."""
    B = 65536
    model = StepModel(CFG, Cluster(gpus=4, tp=1, gpus_per_node=8, tokens_per_gpu=B), costs)
    lens = [131072, 65536, 32768, 32768]
    st = model.ulysses_step(wlb_pieces(lens, 1, 4 * B), 4)
    assert st.attention_max_over_mean == pytest.approx(1.0) and st.max_tokens_per_server == B
    per_token = 3 / 4 * (SHAPE.q_bytes + SHAPE.kv_bytes + SHAPE.o_bytes)
    assert st.bytes_moved == pytest.approx(sum(lens) * per_token, rel=1e-9)
    local = model.plan_step(plan_attention(linear_table(lens, 4, B), "local", cost_model=costs.attn_fwd_bwd))
    assert st.attention == pytest.approx(local.attention, rel=0.05)  # the same work, spread (whole documents)
    assert st.step < local.step


def test_ulysses_degrees_in_the_grid_split_the_heads():
    """tp=8 leaves 4 query heads and 1 KV head per server: degrees 2 and 4 (the KV head replicated), not 8."""
    r = simulate_config(SimConfig(gpus=64, tp=8, tokens_per_gpu=8192, max_doc_len=65536, batches=2))
    assert {k for k in r["strategies"] if k.startswith("ulysses")} == {"ulysses-u2", "ulysses-u4"}
    assert r["best_baseline"]["strategy"] in {"wlb", "ulysses-u2", "ulysses-u4"} | \
        {k for k in r["strategies"] if k.startswith("percp")}
    best = sum(r["strategies"][r["best_baseline"]["strategy"]]["per_batch_step_s"])
    assert r["speedup_vs_best_baseline"] == pytest.approx(best / sum(r["strategies"]["cad"]["per_batch_step_s"]))
    with pytest.raises(ConfigError, match="ulysses degree"):
        StepModel(CFG, Cluster(gpus=64, tp=8), load_sim_costs(CFG, "llama3-8b")).ulysses_step(
            wlb_pieces([65536], 1, 8 * 65536), 8)


def _crossing_bytes(plan, topology) -> float:
    """Bytes of Q, O and KV that cross between nodes under a plan."""
    node = np.asarray(topology.rank_node)
    q = np.where(node[plan.task_home] != node[plan.task_server], plan.task_len, 0).sum()
    x = plan.kv_transfers()
    return float(q * (SHAPE.q_bytes + SHAPE.o_bytes)
                 + np.where(node[x.src] != node[x.server], x.length, 0).sum() * SHAPE.kv_bytes)


def test_cad_keeps_work_inside_a_node_where_it_can():
    """2 nodes x 4 ranks: a long document on each node's first rank, short ones elsewhere. Aware of the nodes, cad
    balances as well and sends fewer bytes between them."""
    lens = [48_000] + [1000] * 16 + [40_000] + [1000] * 24
    table = linear_table(lens, 8, sum(lens) // 8 + 1)
    topology = Topology.of(8, 4)
    flat = plan_attention(table, "cad", cost_model="pairs", shape=SHAPE, min_shard_tokens=256)
    aware = plan_attention(table, "cad", cost_model="pairs", shape=SHAPE, min_shard_tokens=256, topology=topology)
    for plan in (flat, aware):
        assert imbalance(server_loads(plan, PairsCost())) <= 1.02
    assert _crossing_bytes(aware, topology) < 0.7 * _crossing_bytes(flat, topology)  # 40% less (node 0 has more work)
    assert aware.options["nodes"] == 2
    with pytest.raises(ConfigError, match="topology"):
        plan_attention(table, "cad", cost_model="pairs", topology=Topology.of(4, 2))


def _kv_rows_into_nodes(plan, topology) -> int:
    """KV rows crossing into nodes when each node receives a row of a piece once (the hierarchical exchange:
    causal prefixes of a piece nest, so every row a node needs crosses once): per (node, piece), the union of the
    ranges its servers need from another node, merged range by range."""
    node = np.asarray(topology.rank_node)
    x = plan.kv_transfers()
    ranges: dict[tuple, list] = {}
    for server, src, piece, start, length in zip(x.server, x.src, x.piece, x.start, x.length):
        if node[server] != node[src]:
            ranges.setdefault((node[server], piece), []).append((int(start), int(start + length)))
    rows = 0
    for spans in ranges.values():
        end = -1
        for a, b in sorted(spans):
            rows += max(0, b - max(a, end))
            end = max(end, b)
    return rows


def test_cad_plans_for_the_hierarchical_exchange(costs):
    """With relays (Topology.relays), cad prices KV another server of the receiver's node has as a hop inside the
    node: on the DistCA paper's prolong batches at 64 GPUs (32 servers of tp 2, 4 a node) fewer bytes cross
    between nodes under the hierarchical exchange than with the flat exchange's plan, never more on any batch,
    with the same balance."""
    import dataclasses

    from attnpool.plan.plan import inter_node_bytes
    from attnpool.sim.simulate import sample

    config = SimConfig(gpus=64, tp=2, dist="prolong", tokens_per_gpu=65536, max_doc_len=512 * 1024, batches=3,
                       strategies=("cad",))
    cluster = Cluster(64, 2, 8, 65536)
    topology = Topology.of(cluster.servers, cluster.servers_per_node, costs.intra.bandwidth / costs.inter.bandwidth)
    kw = dict(cost_model=costs.attn_fwd_bwd, min_shard_tokens=costs.min_shard_tokens, shape=SHAPE)
    totals = {False: 0, True: 0}
    for lens in sample(config, cluster):
        table = linear_table(lens, cluster.servers, cluster.tokens_per_server)
        plans = {relays: plan_attention(table, "cad", topology=dataclasses.replace(topology, relays=relays), **kw)
                 for relays in (False, True)}
        crossing = {}
        for relays, plan in plans.items():
            assert imbalance(server_loads(plan, costs.attn_fwd_bwd)) <= 1.02
            node = np.asarray(topology.rank_node)
            q_and_o = plan.task_len[node[plan.task_home] != node[plan.task_server]].sum() * (SHAPE.q_bytes + SHAPE.o_bytes)
            crossing[relays] = q_and_o + _kv_rows_into_nodes(plan, topology) * SHAPE.kv_bytes
            assert inter_node_bytes(plan, topology.rank_node, SHAPE, relays=True) == crossing[relays]
            totals[relays] += crossing[relays]
        assert crossing[True] <= crossing[False]
    assert totals[True] < 0.9 * totals[False]  # 16% fewer on these three batches
    assert plans[True].options["relays"] and "relays" not in plans[False].options


def test_ranks_per_node_gives_the_dp_ranks_nodes(monkeypatch):
    from attnpool.train import TrainConfig
    from attnpool.train.spec import resolve_run_spec

    def spec(world, **values):
        config = TrainConfig(model="tiny", data="stdlib", tokens_per_rank=256, device="cpu", cost_model="pairs",
                             attention="cad", **values)
        return resolve_run_spec(config, world)

    assert spec(8).topology is None  # every rank on one node
    assert spec(8, ranks_per_node=4).topology.rank_node == (0, 0, 0, 0, 1, 1, 1, 1)
    assert spec(8, ranks_per_node=4, tp=2).topology.rank_node == (0, 0, 1, 1)
    assert not spec(8, ranks_per_node=4).topology.relays
    assert spec(8, ranks_per_node=4, hierarchical_exchange=True).topology.relays  # (cad plans for it)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert spec(4).topology.rank_node == (0, 0, 1, 1)
    with pytest.raises(ConfigError, match="ranks_per_node=3"):
        spec(8, ranks_per_node=3)


def test_kv_sent_into_a_node_twice_counted_as_a_hierarchy_would_save_it(costs):
    """bench/kv_per_node.py's count against one made row by row: 8 servers, 4 a node, long documents spread by
    cad; every KV row a node receives from another node more than once is a duplicate. With one server a node
    nothing is."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("kv_per_node", Path(__file__).parents[1] / "bench/kv_per_node.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lens = [30000, 2000, 1000, 20000, 3000, 5536, 3000, 500, 500]
    plan = plan_attention(linear_table(lens, 8, 8192), "cad", cost_model=costs.attn_fwd_bwd, min_shard_tokens=256,
                          shape=SHAPE)
    total, duplicate = script.inter_node_bytes(plan, SHAPE, 4)
    x = plan.kv_transfers()
    rows = [(server // 4, piece, row) for server, src, piece, start, length in
            zip(x.server, x.src, x.piece, x.start, x.length) if server // 4 != src // 4
            for row in range(start, start + length)]
    assert duplicate == (len(rows) - len(set(rows))) * SHAPE.kv_bytes and duplicate > 0
    remote = plan.task_home // 4 != plan.task_server // 4
    assert total == (plan.task_len[remote].sum() * (SHAPE.q_bytes + SHAPE.o_bytes) + sum(
        length for server, src, length in zip(x.server, x.src, x.length) if server // 4 != src // 4) * SHAPE.kv_bytes)
    assert script.inter_node_bytes(plan, SHAPE, 1)[1] == 0


def _train_flat_and_hierarchical(rank, world, out):
    """Losses of a cad run on 4 ranks as 2 nodes, with the flat exchange and with the hierarchical one (and with
    ping-pong, whose nano-batches relay each on their own), and the relayed bytes of the hierarchical runs' steps."""
    from pathlib import Path

    from attnpool.comm import comm_stats
    from test_train import tiny_config

    from attnpool.train import train

    losses, relayed = {}, {}
    pingpong = dict(pingpong=True, max_doc_len=192)
    for name, overrides in (("flat", {}), ("hierarchical", dict(hierarchical_exchange=True)),
                            ("flat-pingpong", pingpong), ("hierarchical-pingpong", dict(hierarchical_exchange=True, **pingpong))):
        config = tiny_config(Path(out) / name, attention="cad", ranks_per_node=2, steps=3, tokens_per_rank=384,
                             **overrides)
        comm_stats.reset()
        losses[name] = [row["loss"] for row in train(config).rows]
        relayed[name] = comm_stats.by_tag.get("relay", [0, 0, 0])[1]
    return losses, relayed


def test_hierarchical_exchange_trains_as_the_flat_one(tmp_path):
    from dist_harness import run_distributed

    results = run_distributed(_train_flat_and_hierarchical, 4, str(tmp_path))
    losses = results[0][0]
    flat = np.asarray(losses["flat"])
    np.testing.assert_allclose(losses["hierarchical"], flat, rtol=1e-5)
    np.testing.assert_allclose(losses["hierarchical-pingpong"], losses["flat-pingpong"], rtol=1e-5)
    # some rank forwarded KV inside its node, with ping-pong too (the flat runs relay nothing)
    assert sum(r[1]["hierarchical"] for r in results) > 0 and sum(r[1]["hierarchical-pingpong"] for r in results) > 0
    assert sum(r[1]["flat"] + r[1]["flat-pingpong"] for r in results) == 0


def test_hierarchical_exchange_is_refused_where_nothing_crosses_nodes():
    from attnpool.train import TrainConfig
    from attnpool.train.spec import resolve_run_spec

    config = TrainConfig(model="tiny", data="stdlib", tokens_per_rank=256, device="cpu", cost_model="pairs",
                         attention="cad", hierarchical_exchange=True)
    with pytest.raises(ConfigError, match="hierarchical_exchange=True: the attention's 4 ranks are on one node"):
        resolve_run_spec(config, 4)
    assert resolve_run_spec(config.replace(ranks_per_node=2), 4).relay_nodes == (0, 0, 1, 1)
    # a pipeline stage's ranks must fill whole nodes (each stage's dp ranks are counted on the first stage's)
    with pytest.raises(ConfigError, match="a pipeline stage.s 6 ranks do not fill whole nodes of 4"):
        resolve_run_spec(config.replace(ranks_per_node=4, pp=2, microbatches=2, model_args={"n_layers": 2}), 12)
    # ulysses exchanges heads, not KV rows: nothing to relay, refused rather than silently ignored; every other
    # strategy sends KV rows of documents split across ranks
    with pytest.raises(ConfigError, match="attention ulysses exchanges heads, not KV rows"):
        resolve_run_spec(config.replace(ranks_per_node=2, attention="ulysses"), 4)
    for strategy in ("local", "wlb", "percp"):
        assert resolve_run_spec(config.replace(ranks_per_node=2, attention=strategy), 4).relay_nodes == (0, 0, 1, 1)


def test_simulated_hierarchical_exchange_relays_only_where_servers_share_a_node(costs):
    """The simulator's cad-hierarchical: with 8 servers a node (tp 1) the long documents' KV crosses once per
    node, so less is exposed than with the flat exchange; with one server a node (tp 8) nothing is relayed and
    the step is the flat one's."""
    shared = simulate_config(SimConfig(gpus=16, tp=1, tokens_per_gpu=65536, dist="prolong", batches=2,
                                       strategies=("cad",), hierarchical=True), costs)["strategies"]
    assert shared["cad-hierarchical"]["comm_total_s"] < shared["cad"]["comm_total_s"]
    alone = simulate_config(SimConfig(gpus=16, tp=8, tokens_per_gpu=65536, dist="prolong", batches=2,
                                      strategies=("cad",), hierarchical=True), costs)["strategies"]
    assert alone["cad-hierarchical"]["step_s"] == alone["cad"]["step_s"]


def test_simulated_relays_forward_after_the_first_all_to_all(costs):
    """The relay's hop runs after the exchange between nodes, inside core attention's compute (runtime.core_attention:
    a blocking all-to-all), so the simulator charges it on every server's compute path, forward and backward, and
    the forwarded KV on the relays' own links. Here one document lies over both nodes and node 1's servers need
    node 0's pieces whole: relayed by one server, it would forward all 8 pieces 7 times (the flat exchange's time
    again); relays rotating over the servers that need a piece whole (KVTransfers.relays) forward an eighth each."""
    model = StepModel(CFG, Cluster(gpus=16, tp=1, gpus_per_node=8, tokens_per_gpu=8192), costs)
    lens = [16 * 8192 - 3 * 4096] + [4096] * 3  # one long document over every server, cut by cad
    plan = plan_attention(linear_table(lens, 16, 8192), "cad", cost_model=costs.attn_fwd_bwd, shape=SHAPE,
                          topology=Topology.of(16, 8, relays=True))
    x = plan.kv_transfers()
    relay_of = x.relays(Topology.of(16, 8).rank_node)
    forwarded = np.bincount(x.server[relay_of[relay_of >= 0]], weights=x.length[relay_of >= 0], minlength=16)
    assert forwarded[8:].min() > 0 and forwarded.max() <= 2 * forwarded[8:].mean()  # every node-1 server relays
    flat_f, flat_b, (flat_out, _), _ = model._plan_layer(plan)[:4]
    relay_f, relay_b, (relayed_out, _), _ = model._plan_layer(plan, hierarchical=True)[:4]
    hop = relay_f - flat_f
    assert np.allclose(hop, hop[0]) and np.allclose(relay_b - flat_b, hop[0])  # every server waits for it
    assert hop[0] > costs.intra.latency and relayed_out.latency[0] == costs.inter.latency
    assert relayed_out.transfer[0] <= flat_out.transfer[0]  # the first hop sends no more than the flat exchange
    assert hop[0] < 0.2 * flat_out.transfer[0]  # and the forwarding, spread, a fraction of it
    full = StepModel(CFG, model.cluster, costs, recompute="full")  # a recomputed forward relays again
    (flat_f, flat_b), (relay_f, relay_b) = full._plan_layer(plan)[:2], full._plan_layer(plan, hierarchical=True)[:2]
    assert np.allclose(relay_f - flat_f, hop[0]) and np.allclose(relay_b - flat_b, 2 * hop[0])


@background.job("test_emulated_nodes_number_ranks_node_by_node_and_the_probe_measures_each_tier")
def two_emulated_nodes(tmp):
    """bench/torchrun_nodes.sh: two emulated nodes of two processes each, running bench/a2a_probe.py (on gloo
    here: the launch and the tiers' groups, not a network's figures). Returns the launch and the probe's record."""
    import json
    import sys

    out = tmp / "probe.json"
    done = background.run(["bash", "bench/torchrun_nodes.sh", "bench/a2a_probe.py", "--out", str(out), "--mib", "1",
                           "--iters", "1"], env={"NODES": "2", "NPROC": "4", "PYTHON": sys.executable}, timeout=300)
    return done, json.loads(out.read_text()) if out.exists() else None


def _start_up_tiers(rank, world):
    """start_up_link_rates' groups on 4 ranks, the all-to-all's figure faked by group (inside a node of 2: 1 GiB a
    second; 2 ranks across nodes: 1/4; all 4: 1/8), and its real figures on gloo."""
    from unittest import mock

    import torch
    import torch.distributed as dist

    import attnpool.comm.probe as probe

    def by_group(mib, iters, device, group=None):
        # (a collective on the group as the real one's: every member has connected before any ends the group)
        dist.barrier(group=group)
        ranks = dist.get_process_group_ranks(group)
        return 2**30, 1.0 if ranks in ([0, 1], [2, 3]) else 4.0 if len(ranks) == 2 else 8.0

    cpu = torch.device("cpu")
    with mock.patch.object(probe, "all_to_all_rate", by_group):
        faked = [probe.start_up_link_rates(cpu, per_node, True, True) for per_node in (2, 1, 4)]
        faked.append(probe.start_up_link_rates(cpu, 2, False, True))
    try:  # nodes of uneven sizes (LOCAL_WORLD_SIZE 2, 2, 1, 1): refused on every rank, before any group is made
        probe.same_ranks_per_node(2 if rank < 2 else 1, cpu)
        uneven = None
    except ConfigError as error:
        uneven = str(error)
    return faked, probe.start_up_link_rates(cpu, 2, True, True), uneven


def _train_across_two_nodes_with_measured_links(rank, world, out):
    """A cad run over 2 nodes of 2 ranks with both links auto, the probe's figures replaced by 50 and 5 GiB/s: what
    each rank asked the probe for, the summary and the rates the run planned with."""
    from pathlib import Path
    from unittest import mock

    from test_train import tiny_config

    import attnpool.train.loop as loop
    from attnpool.train import train

    config = tiny_config(Path(out), attention="cad", cost_model="table", min_shard=None, steps=1, tokens_per_rank=512,
                         ranks_per_node=2, exchange_gibps="auto", inter_node_gibps="auto")
    asked = []

    def fixed(device, per_node, inside, between, timeout):
        asked.append((per_node, inside, between))
        return 50.0, 5.0

    with mock.patch.object(loop, "start_up_link_rates", fixed):
        result = train(config)
    return asked, result.summary, result.link_rates["exchange_gibps"], result.link_rates["inter_node_gibps"]


def test_the_start_up_probe_measures_each_link_in_its_own_groups():
    """exchange_gibps / inter_node_gibps auto: inside a node, every node's ranks at once; between nodes, each local
    rank's ranks across them; a node of one rank has nothing inside it, so the link between nodes stands for it; on
    one node nothing is between nodes. Made and ended each time, alike on every rank."""
    from dist_harness import run_distributed

    results = run_distributed(_start_up_tiers, 4)
    faked, real, _ = results[0]
    assert faked == [(1.0, 0.25), (0.125, 0.125), (0.125, None), (None, 0.25)]
    assert all(r[:2] == results[0][:2] for r in results) and real[0] > 0 and real[1] > 0
    assert all(f"ranks_per_node={2 if rank < 2 else 1}: differs between ranks (1 to 2" in uneven
               for rank, (_, _, uneven) in enumerate(results))


def test_a_run_across_nodes_measures_both_links_and_plans_with_them(tmp_path):
    from dist_harness import run_distributed

    results = run_distributed(_train_across_two_nodes_with_measured_links, 4, str(tmp_path))
    asked, summary, inside, between = results[0]
    assert all(r[0] == [(2, True, True)] and r[2:] == (50.0, 5.0) for r in results)
    assert summary["exchange_gibps"] == 50.0 and summary["inter_node_gibps"] == 5.0
    assert summary["exchange_gibps_measured"] and summary["inter_node_gibps_measured"]


def test_emulated_nodes_number_ranks_node_by_node_and_the_probe_measures_each_tier():
    from attnpool.comm.probe import tier_groups

    done, probe = two_emulated_nodes.result()
    # (C++ stack frames left out: the first error, the one that stopped the other node, must fit in the message)
    said = "\n".join(line for line in done.stderr.splitlines() if not line.lstrip().startswith("frame #"))
    assert done.returncode == 0, done.stdout[-2000:] + said[:3000] + "\n...\n" + said[-3000:]
    # LOCAL_WORLD_SIZE (ranks_per_node's default) is a node's share; rank 0 runs on node 0, with node 0's host id
    assert (probe["world"], probe["ranks_per_node"], probe["backend"]) == (4, 2, "gloo")
    assert probe["nccl_env"]["NCCL_HOSTID"] == "attnpool-emulated-node-0"
    # 1 MiB of float32 split over the group, the rank's own share not counted: 3/4 of it over all four ranks, 1/2
    # inside a node and between the nodes
    assert probe["bytes_out_per_rank"] == 3 * 2**20 // 4
    assert probe["intra_node_bytes_out_per_rank"] == probe["inter_node_bytes_out_per_rank"] == 2**20 // 2
    assert all(probe[f"{tier}GiBps_out_per_rank"] > 0 for tier in ("", "intra_node_", "inter_node_"))
    assert tier_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_a_rendezvous_port_is_drawn_below_the_ephemeral_range_and_is_free(monkeypatch, tmp_path):
    """free_port: below the range bind(0) and outgoing connections take ports from, never a port held now, not
    repeated by a seeded random generator, and the kernel's choice where the range leaves no room below it."""
    import random
    import socket

    from attnpool.comm import ports

    low = min(ports.ephemeral_low(), ports.NODE_PORTS_LOW)
    pairs = []
    for _ in range(3):  # two launchers whose processes seeded Python's generator alike
        random.seed(0)
        first = ports.free_port()
        random.seed(0)
        pairs.append((first, ports.free_port()))
    assert any(a != b for a, b in pairs)
    assert all(max(1024, low - ports.DRAW_SPAN) <= p < low for pair in pairs for p in pair)
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        assert not ports.is_free(held.getsockname()[1])
    try:  # a listener on IPv6 alone holds its port too (where this host has IPv6)
        held6 = socket.socket(socket.AF_INET6)
        held6.bind(("::1", 0))
    except OSError:
        held6 = None
    if held6 is not None:
        with held6:
            held6.listen()
            assert not ports.is_free(held6.getsockname()[1])
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        # every draw held: the kernel's choice, which is not the held port
        monkeypatch.setattr(ports, "is_free", lambda port: False)
        assert ports.free_port() != held.getsockname()[1]
    monkeypatch.undo()
    (tmp_path / "range").write_text("1030\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "range")
    assert ports.ephemeral_low() == 1030 and ports.free_port() >= 1030  # no room below 1030: the kernel's choice
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ports.ephemeral_low() == ports.LINUX_EPHEMERAL_LOW


def test_a_ulysses_group_across_two_nodes_sends_only_the_other_nodes_share_across(costs):
    """16 servers of one GPU, 8 a node, one ulysses group of 16: each server's exchange sends 7 peers' share over
    NVLink and 8 peers' over the network (as cad's exchanges are priced, pair by pair), not all 15 across."""
    B = 8192
    model = StepModel(CFG, Cluster(gpus=16, tp=1, gpus_per_node=8, tokens_per_gpu=B), costs)
    seen = []
    collective = model._collective

    def recording(intra, inter, c, G):
        seen.append((np.asarray(intra, dtype=float).copy(), np.asarray(inter, dtype=float).copy()))
        return collective(intra, inter, c, G)
    model._collective = recording
    model.ulysses_step(wlb_pieces([B] * 16, 1, 16 * B), 16)  # whole documents: no prefix to fetch
    q, kv, _ = (SHAPE.q_bytes / 16, SHAPE.kv_bytes / 8, SHAPE.o_bytes / 16)  # per peer: 2 query heads, 1 KV head
    intra, inter = seen[1]  # the forward's exchange out (O's, back, is costed first, once for every kind of layer)
    assert intra == pytest.approx(np.full(16, 7 * B * (q + kv))) and inter == pytest.approx(np.full(16, 8 * B * (q + kv)))


def _exchange_bytes_reference(plan, shape) -> np.ndarray:
    """Per server, loop by loop, what its forward exchanges hold its link for: out, the larger of the Q and KV it
    sends and receives (Q of every task served off its home; the causal KV prefix [0, end) of every document a
    server serves, less its own pieces' rows, from the ranks that hold them), then back, the same of O."""
    W, pieces = plan.num_ranks, plan.pieces
    out_sent, out_received, back_sent, back_received = (np.zeros(W) for _ in range(4))
    need: dict[tuple[int, int], int] = {}
    for doc, a, b, piece, server in zip(plan.task_doc, plan.task_start, plan.task_end, plan.task_piece,
                                        plan.task_server):
        home = int(pieces.rank[piece])
        if home != server:
            out_sent[home] += (b - a) * shape.q_bytes
            out_received[server] += (b - a) * shape.q_bytes
            back_sent[server] += (b - a) * shape.o_bytes
            back_received[home] += (b - a) * shape.o_bytes
        need[(int(server), int(doc))] = max(need.get((int(server), int(doc)), 0), int(b))
    for (server, doc), end in need.items():
        for p in np.flatnonzero(pieces.doc == doc):
            src = int(pieces.rank[p])
            rows = max(0, min(end, pieces.start[p] + pieces.length[p]) - pieces.start[p])
            if src != server and rows:
                out_sent[src] += rows * shape.kv_bytes
                out_received[server] += rows * shape.kv_bytes
    return np.maximum(out_sent, out_received) + np.maximum(back_sent, back_received)


@pytest.mark.parametrize("seed", range(6))
def test_cad_pricing_its_bytes_is_never_priced_above_local_and_keeps_the_balance_on_a_fast_link(seed):
    """exchange_gibps (plan.cost.exchange_byte_seconds): cad keeps the plan of least busiest work plus priced
    bytes of the busiest exchange. Priced by a reference count of the exchanges' bytes, its plan is never above
    local's; on a link fast against the work it is the unpriced plan; on a slow one it moves less."""
    from attnpool.plan.cost import exchange_byte_seconds, load_cost_model
    from attnpool.plan.plan import server_exchange_bytes

    rng = np.random.default_rng(seed)
    W = int(rng.integers(2, 5))
    lens = [int(x) for x in rng.integers(256, 24_000, size=int(rng.integers(3, 12)))]
    table = linear_table(lens, W, -(-sum(lens) // W))
    cost = load_cost_model(None)
    kw = dict(cost_model=cost, shape=SHAPE, min_shard_tokens=512)
    local = plan_attention(table, "local", **kw)
    unpriced = plan_attention(table, "cad", **kw)
    for plan in (local, unpriced):
        np.testing.assert_allclose(server_exchange_bytes(plan, SHAPE), _exchange_bytes_reference(plan, SHAPE))
    fast = plan_attention(table, "cad", byte_seconds=exchange_byte_seconds(1e6), **kw)
    assert fast.fingerprint() == unpriced.fingerprint()
    for gibps in (0.01, 1.0, 10.0, 100.0):
        price = exchange_byte_seconds(gibps, recomputed_share=1.0, overlapped=True)
        priced = plan_attention(table, "cad", byte_seconds=price, **kw)
        assert priced.options["byte_seconds"] == price
        score = lambda plan: (server_loads(plan, cost).max()  # noqa: E731
                              + price * _exchange_bytes_reference(plan, SHAPE).max())
        assert score(priced) <= min(score(local), score(unpriced)) * (1 + 1e-9)
    slow = plan_attention(table, "cad", byte_seconds=exchange_byte_seconds(1e-6), **kw)
    assert int(slow.task_len[slow.task_server != slow.task_home].sum()) == 0


def test_cad_keeps_a_partly_balanced_state_where_the_last_moves_cost_more_than_they_save():
    """The states the greedy passes through are priced by the bytes of its moves: on 7 ranks at 5 GiB/s the plan
    kept is neither local's nor the balanced one, and it is priced 10-24% below both."""
    from attnpool.plan.cost import exchange_byte_seconds, load_cost_model

    table = linear_table([1437, 16823, 6474, 771, 3381], 7, 4127)
    cost = load_cost_model(None)
    kw = dict(cost_model=cost, shape=SHAPE, min_shard_tokens=512)
    price = exchange_byte_seconds(5.0, recomputed_share=1.0, overlapped=True)
    local, balanced = plan_attention(table, "local", **kw), plan_attention(table, "cad", **kw)
    priced = plan_attention(table, "cad", byte_seconds=price, **kw)
    assert priced.fingerprint() not in (local.fingerprint(), balanced.fingerprint())
    score = lambda plan: server_loads(plan, cost).max() + price * _exchange_bytes_reference(plan, SHAPE).max()  # noqa: E731
    assert score(priced) < 0.9 * score(local) and score(priced) < 0.8 * score(balanced)
    assert 1.02 < imbalance(server_loads(priced, cost)) < imbalance(server_loads(local, cost))


def test_the_price_of_a_byte_follows_the_link_recompute_and_overlap():
    """Seconds of attention work a byte of the busiest exchange costs: 2 exchanges (forward and backward) over the
    link's rate, 3 where the forward runs again (whose work is then a forward's share more), a share where ping-pong
    or head groups hide the rest. Bad rates are refused naming the setting, and so is a price against pair counts."""
    from attnpool.plan.cost import BWD_TO_FWD_FLOPS, OVERLAPPED_EXCHANGE_SHARE, exchange_byte_seconds

    byte = 1 / 2**30
    assert exchange_byte_seconds(1.0) == pytest.approx(2 * byte)
    assert exchange_byte_seconds(4.0, recomputed_share=1.0) == pytest.approx(
        3 * byte / 4 / (1 + 1 / (1 + BWD_TO_FWD_FLOPS)))
    assert 0 < OVERLAPPED_EXCHANGE_SHARE < 1
    assert exchange_byte_seconds(2.0, overlapped=True) == pytest.approx(OVERLAPPED_EXCHANGE_SHARE
                                                                        * exchange_byte_seconds(2.0))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="exchange_gibps"):
            exchange_byte_seconds(bad)
    table = linear_table([9000, 3000], 2, 6000)
    with pytest.raises(ConfigError, match="byte_seconds.*pairs"):
        plan_attention(table, "cad", cost_model="pairs", byte_seconds=1e-9)
    with pytest.raises(ConfigError, match="byte_seconds"):
        plan_attention(table, "cad", byte_seconds=-1.0)


def test_exchange_gibps_is_a_cad_setting_priced_as_the_run_checkpoints_and_overlaps():
    """attnpool train's exchange_gibps: refused for strategies that plan no moves and for a cost model of pair
    counts, on every rank before any process group; a run's price counts its recomputed layers and ping-pong."""
    from attnpool.plan.cost import exchange_byte_seconds
    from attnpool.train.config import TrainConfig
    from attnpool.train.spec import resolve_run_spec

    base = dict(model="tiny", nproc=2, device="cpu", steps=1, tokens_per_rank=2048)
    for bad, match in [(dict(exchange_gibps=0.0), "positive"), (dict(exchange_gibps=5.0, attention="percp"), "percp"),
                       (dict(exchange_gibps=float("nan")), "positive")]:
        with pytest.raises(ConfigError, match=f"exchange_gibps.*{match}"):
            TrainConfig(**base, **bad)
    with pytest.raises(ConfigError, match="exchange_gibps.*pairs"):
        resolve_run_spec(TrainConfig(**base, exchange_gibps=5.0, cost_model="pairs"), 2, None, "cpu")
    assert resolve_run_spec(TrainConfig(**base), 2, None, "cpu").byte_seconds == 0.0
    # inter_node_gibps: a byte between nodes costs the links' ratio (NVLink's measured rate inside where unset)
    from attnpool.plan.plan import INTER_NODE_BYTE_COST, NVLINK_GIBPS

    nodes = dict(base, nproc=4, ranks_per_node=2)
    assert resolve_run_spec(TrainConfig(**nodes), 4, None, "cpu").topology.inter_node_byte_cost == INTER_NODE_BYTE_COST
    assert resolve_run_spec(TrainConfig(**nodes, inter_node_gibps=5.0, exchange_gibps=50.0), 4, None,
                            "cpu").topology.inter_node_byte_cost == 10.0
    assert resolve_run_spec(TrainConfig(**nodes, inter_node_gibps=5.0), 4, None,
                            "cpu").topology.inter_node_byte_cost == NVLINK_GIBPS / 5.0
    assert resolve_run_spec(TrainConfig(**nodes, exchange_gibps=93.0), 4, None,
                            "cpu").topology.inter_node_byte_cost == pytest.approx(93.0 * 2**30 / 50e9)
    # activation_checkpointing auto, before it is resolved (the memory check's sampled plans): priced as full
    spec = resolve_run_spec(TrainConfig(**base, exchange_gibps=5.0, activation_checkpointing="auto"), 2, None, "cpu")
    assert spec.byte_seconds == exchange_byte_seconds(5.0, recomputed_share=1.0)
    with pytest.raises(ConfigError, match="inter_node_gibps=-1.0: must be a positive number"):
        TrainConfig(**nodes, inter_node_gibps=-1.0)
    spec = resolve_run_spec(TrainConfig(**base, exchange_gibps=5.0, pingpong=True, activation_checkpointing="full"),
                            2, None, "cpu")
    assert spec.byte_seconds == exchange_byte_seconds(5.0, recomputed_share=1.0, overlapped=True)
    # auto: measured at the run's start; before that priced as unset, after it as the rates measured
    from attnpool.train.spec import measures_links, with_measured_links

    for key, value in (("exchange_gibps", "fast"), ("inter_node_gibps", "")):
        with pytest.raises(ConfigError, match=f"{key}=.*or auto"):
            TrainConfig(**nodes, **{key: value})
    given = TrainConfig(**nodes, exchange_gibps="Auto", inter_node_gibps="auto")  # (a word read as the config reads)
    assert (given.attention.exchange_gibps, given.parallel.inter_node_gibps) == ("auto", "auto")
    assert measures_links(given) and not measures_links(TrainConfig(**nodes, exchange_gibps="5.5"))
    spec = resolve_run_spec(given, 4, None, "cpu")
    assert spec.byte_seconds == 0.0 and spec.topology.inter_node_byte_cost == INTER_NODE_BYTE_COST
    measured = with_measured_links(spec, 4, 40.0, 4.0)
    assert measured.config.attention.exchange_gibps == 40.0 and measured.topology.inter_node_byte_cost == 10.0
    assert measured.byte_seconds == exchange_byte_seconds(40.0, recomputed_share=0.0)
    assert spec.config.attention.exchange_gibps == "auto"  # (the config as given stays: what config.yaml keeps)
    # one of the two measured, the other given; on one node nothing is between nodes: inter_node_gibps unset
    half = with_measured_links(resolve_run_spec(TrainConfig(**nodes, exchange_gibps=20.0, inter_node_gibps="auto"),
                                                4, None, "cpu"), 4, 40.0, 4.0)
    assert half.config.attention.exchange_gibps == 20.0 and half.topology.inter_node_byte_cost == 5.0
    one_node = with_measured_links(resolve_run_spec(TrainConfig(**base, exchange_gibps="auto",
                                                                inter_node_gibps="auto"), 2, None, "cpu"), 2, 9.0, None)
    assert (one_node.config.attention.exchange_gibps, one_node.config.parallel.inter_node_gibps) == (9.0, None)
    # measured only where the run's plans use it: cad, two servers or more, nodes for the link between them
    from attnpool.train.spec import links_to_measure

    both = dict(exchange_gibps="auto", inter_node_gibps="auto")
    assert links_to_measure(spec) == (True, True)
    assert links_to_measure(resolve_run_spec(TrainConfig(**base, **both), 2, None, "cpu")) == (True, False)
    assert links_to_measure(resolve_run_spec(TrainConfig(**dict(nodes, attention="local"), inter_node_gibps="auto"),
                                             4, None, "cpu")) == (False, False)
    assert links_to_measure(resolve_run_spec(TrainConfig(**dict(base, nproc=1), **both), 1, None, "cpu")) == \
        (False, False)
    assert links_to_measure(resolve_run_spec(TrainConfig(**base, **both, tp=2), 2, None, "cpu")) == (False, False)
    # pipeline stages: 1f1b plans over a stage's dp ranks (one here), pooled over every stage's, flat across nodes
    staged = dict(pp=2, microbatches=2)
    assert links_to_measure(resolve_run_spec(TrainConfig(**base, **both, **staged), 2, None, "cpu")) == (False, False)
    assert links_to_measure(resolve_run_spec(TrainConfig(**base, **both, **staged, pp_schedule="pooled"), 2, None,
                                             "cpu")) == (True, False)
    assert links_to_measure(resolve_run_spec(TrainConfig(**nodes, **both, **staged, pp_schedule="pooled"), 4, None,
                                             "cpu")) == (True, False)
    unused = with_measured_links(resolve_run_spec(TrainConfig(**dict(base, nproc=1), **both), 1, None, "cpu"), 1,
                                 None, None)  # (an auto no plan would use: unset, not a rate of 0)
    assert (unused.config.attention.exchange_gibps, unused.byte_seconds) == (None, 0.0)
    # a run's plans: on a link slow against the work, cad keeps every task at home where it moved some
    from attnpool.data import DocumentStream, stdlib_corpus
    from attnpool.train.planning import plan_batch

    batch = DocumentStream(stdlib_corpus(), 2, 16384, 0).next_batch()
    moved = {}
    for gibps in (None, 1e-3):
        spec = resolve_run_spec(TrainConfig(**{**base, "tokens_per_rank": 16384}, exchange_gibps=gibps), 2, None,
                                "cpu")
        plan = plan_batch(batch, spec).plan
        moved[gibps] = int(plan.task_len[plan.task_server != plan.task_home].sum())
    assert moved[None] > 0 and moved[1e-3] == 0


def test_the_simulator_prices_cads_bytes_as_a_run_with_exchange_gibps_would():
    """SimConfig.price_bytes: on a link slow against the work (2.5 GiB/s, 2 GPUs) cad without ping-pong keeps local's
    plan, where balancing made its step slower than local's; on NVLink's rate every plan is the unpriced one."""
    config = dict(gpus=2, tp=1, tokens_per_gpu=65536, dist="prolong", batches=3, strategies=("local", "cad"),
                  recompute="full")
    slow = load_sim_costs(CFG, "llama3-8b", intra_bandwidth=2.5 * 2**30)
    plain, priced = (simulate_config(SimConfig(**config, price_bytes=p), slow)["strategies"] for p in (False, True))
    assert plain["cad-serial"]["step_s"] > 1.1 * plain["local"]["step_s"]
    assert priced["cad-serial"]["step_s"] == priced["local"]["step_s"]
    assert priced["cad"]["step_s"] < plain["cad"]["step_s"]
    fast = load_sim_costs(CFG, "llama3-8b", intra_bandwidth=300 * 2**30)
    plain, priced = (simulate_config(SimConfig(**config, price_bytes=p), fast)["strategies"] for p in (False, True))
    assert priced == plain
    # a run priced at a rate other than the link simulated (sim_validation replays runs so): the plan is the slow
    # price's, local's, whatever link the steps are timed on
    priced = simulate_config(SimConfig(**config, price_bytes=True, price_gibps=2.5), fast)["strategies"]
    assert priced["cad-serial"]["step_s"] == priced["local"]["step_s"]
    with pytest.raises(ConfigError, match="price_gibps"):
        SimConfig(**config, price_bytes=True, price_gibps=0.0).check()
    with pytest.raises(ConfigError, match="price_gibps=2.5: prices cad's bytes: needs price_bytes"):
        SimConfig(**config, price_gibps=2.5).check()


def _train_priced_and_not(rank, world, out):
    """Losses and per-step balance of a cad run balancing whatever the bytes, and of one whose bytes are priced on a
    link far too slow to move any (exchange_gibps), with ping-pong; and the priced run's summary."""
    from pathlib import Path

    from test_train import tiny_config

    from attnpool.train import train

    from unittest import mock

    import torch

    import attnpool.train.loop as loop
    from attnpool.comm.probe import start_up_link_rates

    runs = {"probed": start_up_link_rates(torch.device("cpu"), world, True, False)}

    def measured_slow(*args):  # the start-up's probe as it runs, its figure a link far too slow to move any
        assert start_up_link_rates(*args)[0] > 0
        return 1e-4, None

    for name, gibps in (("balanced", None), ("priced", 1e-4), ("measured", "auto")):
        config = tiny_config(Path(out) / name, attention="cad", cost_model="table", min_shard=None, steps=2,
                             tokens_per_rank=1024, pingpong=True, exchange_gibps=gibps)
        with mock.patch.object(loop, "start_up_link_rates", measured_slow):
            result = train(config)
        runs[name] = ([row["loss"] for row in result.rows], [row["imbalance_after"] for row in result.rows],
                      [row["imbalance_before"] for row in result.rows], result.summary)
    return runs


def test_a_run_with_priced_bytes_trains_the_same_model_and_says_so(tmp_path, capsys):
    """exchange_gibps changes where core attention runs, not what it computes: the same losses; on a link too slow
    to move anything the plans keep every task at home (balance as local's); the summary names the price."""
    from dist_harness import run_distributed

    both = run_distributed(_train_priced_and_not, 2, str(tmp_path))
    runs = both[0]
    balanced, priced = runs["balanced"], runs["priced"]
    # the start-up's probe: the same figure on every rank (the slowest rank's), of the link inside the node only
    assert both[0]["probed"] == both[1]["probed"] and both[0]["probed"][0] > 0 and both[0]["probed"][1] is None
    np.testing.assert_allclose(priced[0], balanced[0], rtol=1e-5)
    assert priced[1] == priced[2] and balanced[1] != balanced[2]
    assert priced[3]["exchange_gibps"] == 1e-4 and balanced[3]["exchange_gibps"] is None
    # auto: the link measured at the start (here its figure replaced by a slow one), planned with, and said so
    measured = runs["measured"]
    np.testing.assert_allclose(measured[0], balanced[0], rtol=1e-5)
    assert measured[1] == measured[2]  # (the runner plans with the measured price: every task at home)
    assert measured[3]["exchange_gibps"] == 1e-4 and measured[3]["exchange_gibps_measured"]
    assert not priced[3]["exchange_gibps_measured"]
    from attnpool.train.metrics import print_summary

    capsys.readouterr()
    for summary in (priced[3], measured[3]):
        print_summary(summary, [])
    printed = " ".join(capsys.readouterr().out.split())  # (the table's lines wrap at the console's width)
    assert "its bytes priced at 0.0001 GiB/s (exchange_gibps)" in printed
    assert f"its bytes priced at {measured[3]['exchange_gibps']:.3g} GiB/s (exchange_gibps auto, measured at the " \
           "start)" in printed
