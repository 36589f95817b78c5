"""Tensor parallelism: every layout computes the same training as one process (float32, gloo).

dp x tp ranks against dp ranks without TP and against one process: losses over several steps,
gradients after one step, checkpoints resumed across layouts, bad layouts refused on every rank.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnpool.data import DocumentStream, stdlib_corpus
from attnpool.data.batch import GlobalBatch
from attnpool.errors import ConfigError
from attnpool.model import model_config
from attnpool.parallel import ParallelDims, build_rank_mesh, tensor_parallel_problem
from attnpool.plan import linear_table, pad_ranks, plan_attention, wlb_table
from attnpool.runtime import CoreAttention
from attnpool.train import train
from attnpool.train.memory import CHECKPOINTING_MODES, MemoryInputs, estimate, saved_per_layer
from attnpool.train.planning import plan_batch
from attnpool.train.runners import build_model, build_stages, forward_backward, step_context
from attnpool.train.spec import resolve_run_spec
from command import run_command
from dist_harness import run_distributed
from test_train import TINY, refused_config, rel_diff, tiny_config

SPARSE = dict(sparse="vertical-slash", sparse_min_doc_len=64,
              sparse_args=dict(block=16, vertical_chunk=16, last_queries=16, sink_tokens=4, local_window=16,
                               slash_cap=32, vertical_cap=64))


def _losses(rank, world, out, tp, runs):
    return {name: [r["loss"] for r in train(tiny_config(f"{out}/{name}-{world}-{tp}", tp=tp, **kw)).rows]
            for name, kw in runs}


def test_dp_by_tp_trains_as_dp_alone(tmp_path):
    """dp=2 x tp=2 (4 processes) against dp=2 (2 processes): local, cad, cad with ping-pong."""
    runs = [("local", dict(attention="local", steps=5)), ("cad", dict(attention="cad", steps=5)),
            ("pingpong", dict(attention="cad", pingpong=True, steps=5))]
    dp = run_distributed(_losses, 2, str(tmp_path), 1, runs)[0]
    dp_tp = run_distributed(_losses, 4, str(tmp_path), 2, runs)[0]
    for name, _ in runs:
        assert len(dp_tp[name]) == 5
        assert rel_diff(dp_tp[name], dp[name]) <= 1e-5, name


def test_tp_alone_trains_as_one_process(tmp_path):
    """dp=1 x tp=2 against one process, with what else TP must carry: both checkpointing modes, a token
    count tp does not divide (padded), wlb's uneven layout, sparse attention with ping-pong, offload."""
    runs = [("keep", dict(activation_checkpointing="keep_attention", steps=3)),
            ("full-odd", dict(activation_checkpointing="full", tokens_per_rank=255, steps=3)),
            ("sparse-pingpong", dict(pingpong=True, steps=3, **SPARSE)),
            ("offload", dict(activation_offload=True, optimizer_offload=True, steps=3))]
    one = run_distributed(_losses, 1, str(tmp_path), 1, runs)[0]
    tp = run_distributed(_losses, 2, str(tmp_path), 2, runs)[0]
    for name, _ in runs:
        assert rel_diff(tp[name], one[name]) <= 1e-5, name


def _first_step_gradients(rank, world, tp):
    cfg = tiny_config("unused", attention="cad", tokens_per_rank=255, tp=tp)
    spec = resolve_run_spec(cfg, world, torch.device("cpu"))
    mesh = build_rank_mesh(spec.dims, "cpu")
    model = build_model(spec, mesh)
    batch = DocumentStream(stdlib_corpus(), mesh.dims.dp, cfg.data.tokens_per_rank, cfg.data.seed).next_batch()
    step = plan_batch(batch, spec)
    tensors = step.batch.rank_batch(step.plan.pieces, mesh.dp_rank).to_torch()
    forward_backward(model, [tensors], [CoreAttention(step.plan, mesh.attention_group)], batch.num_label_tokens,
                     vocab_parallel=tp > 1)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _saved_per_token_under_tp(rank, world, mode):
    """Bytes autograd keeps per layer and per token of the dp rank (each storage once, parameters aside),
    from one and two layers of the tp=world model."""
    from torch.distributed.tensor import DTensor

    mesh = build_rank_mesh(ParallelDims.of(world, world), "cpu")
    saved = {}
    for layers in (1, 2):
        args = {**TINY, "n_layers": layers}
        cfg = tiny_config("unused", model_args=args, tokens_per_rank=256, tp=world, activation_checkpointing=mode)
        spec = resolve_run_spec(cfg, world, torch.device("cpu"))
        model = build_model(spec, mesh)
        batch = DocumentStream(stdlib_corpus(), 1, cfg.data.tokens_per_rank, cfg.data.seed).next_batch()
        step = plan_batch(batch, spec)
        tensors = step.batch.rank_batch(step.plan.pieces, 0).to_torch()
        storages = {}

        def pack(t):
            local = t._local_tensor if isinstance(t, DTensor) else t
            local = getattr(local, "elem", local)  # a collective's result (AsyncCollectiveTensor)
            if not isinstance(t, torch.nn.Parameter) and not isinstance(local._base, torch.nn.Parameter):
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            return t

        with step_context("cpu", False, True), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tensors.tokens, tensors.positions, CoreAttention(step.plan, mesh.attention_group),
                  labels=tensors.labels)
        saved[layers] = sum(storages.values())
    return (saved[2] - saved[1]) / cfg.data.tokens_per_rank


@pytest.mark.parametrize("mode", CHECKPOINTING_MODES)
def test_saved_per_layer_under_tp_is_the_memory_models(mode):
    """Under tp=2 a layer keeps its share of what one process keeps, but for the norms' outputs: sequence
    parallelism gathers them to the whole sequence before the projections, which save them whole."""
    # (in processes of its own: a count of saved storages must not meet what earlier calls left cached)
    measured = run_distributed(_saved_per_token_under_tp, 2, mode, fresh=True)[0]
    x = MemoryInputs(model_config("tiny", **TINY), 256, mode, bf16=False, tp=2)
    predicted = sum(saved_per_layer(x).values()) / 2
    if mode != "none":
        assert measured == predicted
    else:
        # CPU's composite rms_norm keeps its float32 normalized input per local token (see test_memory's
        # count); 40 bytes per token stay unaccounted, 3% of the layer's (with the norms' outputs counted
        # as split by tp, the prediction would be 8% lower still).
        cpu_norm_outputs = 2 * 4 * TINY["dim"] / 2
        assert abs(measured - (predicted + cpu_norm_outputs)) <= 0.05 * measured


def test_gradients_after_one_step_do_not_depend_on_tp():
    dp = run_distributed(_first_step_gradients, 2, 1)[0]
    dp_tp = run_distributed(_first_step_gradients, 4, 2)[0]
    for name, g in dp.items():
        torch.testing.assert_close(dp_tp[name], g, rtol=1e-4, atol=1e-7, msg=name)


def _built_weights(rank, world, tp, pp, on_meta):
    """Every weight this rank holds, whole (DTensor shards gathered), as build_model or build_stages made it;
    ``on_meta``: built on the meta device and initialised after sharding, as models over 1B parameters are."""
    import attnpool.model.llama_spec as llama_spec

    if on_meta:
        llama_spec.META_INIT_PARAMS = 0
    cfg = tiny_config("unused", tp=tp, pp=pp, microbatches=2, seed=7)
    spec = resolve_run_spec(cfg, world, torch.device("cpu"))
    mesh = build_rank_mesh(spec.dims, "cpu")
    if pp > 1:
        models = build_stages(spec, mesh)[1]
    else:
        models = [build_model(spec, mesh)]
    return {n: p.full_tensor() for m in models for n, p in m.named_parameters()}


@pytest.mark.parametrize("world, tp, pp", [(4, 2, 1), (4, 1, 2), (4, 2, 2)])
def test_every_layout_starts_from_the_one_process_weights(world, tp, pp):
    """Built on the meta device and sharded (dp x tp, pp x dp, pp x tp), the model holds the very weights
    the one-process model is built with: each weight is drawn whole by name and seed and cut, so a layout's
    training can be compared with one process's (on GPUs, where 8B models are built on the meta device,
    the RNG's order of draws used to differ per layout)."""
    one = run_distributed(_built_weights, 1, 1, 1, False)[0]
    ranks = run_distributed(_built_weights, world, tp, pp, True)
    held = {}
    for weights in ranks:
        held.update(weights)
    assert held.keys() == one.keys()
    for name, weight in one.items():
        assert torch.equal(held[name], weight), name


def _attention_group(rank, world, tp, pp):
    from datetime import timedelta

    import torch.distributed as dist
    mesh = build_rank_mesh(ParallelDims.of(world, tp, pp), "cpu", timedelta(seconds=7))
    group = mesh.attention_group

    def timeout_s(g):
        return g._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    timeouts = {timeout_s(g) for g in (group, mesh.dp_mesh.get_group(), mesh.tp_mesh.get_group(), mesh.pp_group)}
    return (dist.get_process_group_ranks(group), dist.get_process_group_ranks(mesh.dp_mesh.get_group()),
            group is mesh.dp_mesh.get_group(), timeouts)


@pytest.mark.parametrize("world, tp, pp", [(4, 2, 1), (4, 1, 2), (2, 1, 1)])
def test_core_attention_has_a_communicator_of_its_own(world, tp, pp):
    """Core attention exchanges over the dp ranks of its pipeline and tp index, on a communicator of its own: on
    the dp mesh's, which FSDP2 gathers and reduces over, NCCL ran each exchange after the collectives FSDP had
    issued before it (attnpool.parallel.mesh). It, and the mesh's own groups, wait on a silent peer for the run's
    collective timeout, not torch's default of 30 minutes (tests/test_faults.py stalls a worker)."""
    for ranks, dp_ranks, shared, timeouts in run_distributed(_attention_group, world, tp, pp):
        assert ranks == dp_ranks and len(ranks) == world // (tp * pp)
        assert not shared
        assert timeouts == {7}


def _step_with_an_empty_rank(rank, world, strategy):
    """One forward and backward where the layout leaves every rank but 0 without tokens (as wlb's packing can, of
    long documents over many ranks): the summed loss and the full gradients."""
    from attnpool.plan import PieceTable, plan_attention
    cfg = tiny_config("unused", attention="local")
    spec = resolve_run_spec(cfg, world, torch.device("cpu"))
    mesh = build_rank_mesh(spec.dims, "cpu")
    model = build_model(spec, mesh)
    docs = [np.arange(100) % 50 + 3, np.arange(60) % 40 + 5]
    batch = GlobalBatch.from_documents(docs, num_ranks=world, tokens_per_rank=160)
    lens = batch.doc_lens
    table = PieceTable.from_arrays(world, lens, np.zeros(2, np.int64), np.arange(2), np.zeros(2, np.int64), lens)
    plan = plan_attention(table, strategy, cost_model="pairs", min_shard_tokens=16)
    tensors = batch.rank_batch(plan.pieces, rank).to_torch()
    loss = forward_backward(model, [tensors], [CoreAttention(plan, mesh.attention_group)], batch.num_label_tokens)
    return float(loss), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["local", "cad"])
def test_a_rank_without_tokens_trains(strategy):
    """A rank the layout gives no tokens runs its layers on none (and, under cad, serves attention for the others):
    the losses and gradients are one process's."""
    (one_loss, one_grads), = run_distributed(_step_with_an_empty_rank, 1, "local")
    ranks = run_distributed(_step_with_an_empty_rank, 2, strategy)
    assert ranks[1][0] == 0.0 and abs(ranks[0][0] - one_loss) <= 1e-5 * abs(one_loss)
    for name, grad in one_grads.items():
        assert torch.allclose(ranks[0][1][name], grad, rtol=1e-4, atol=1e-6), name


def _train_cut(rank, world, out, tp, resume, stop_at):
    result = train(tiny_config(out, attention="cad", steps=6, stop_at=stop_at, tp=tp, resume=resume))
    return [r["loss"] for r in result.rows]


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_checkpoint_resumes_with_another_tp(tmp_path, first, then):
    """Steps 1-3 with tp=first on `first` processes, steps 4-6 resumed with tp=then on `then`: the same
    losses as six uninterrupted steps with tp=then (weights, optimizer state, schedule and data position
    resharded by DCP)."""
    full = run_distributed(_train_cut, then, str(tmp_path / "full"), then, False, None)[0]
    first_part = run_distributed(_train_cut, first, str(tmp_path / "cut"), first, False, 3)[0]
    resumed = run_distributed(_train_cut, then, str(tmp_path / "cut"), then, True, None)[0]
    assert len(first_part) == 3 and len(resumed) == 6
    assert rel_diff(resumed[3:], full[3:]) <= 1e-5


def test_bad_tp_is_refused_on_every_rank():
    for overrides, field, text in ((dict(tp=2), "tp", "must divide the number of ranks (3)"),
                                   (dict(tp=3, model_args=dict(TINY, n_kv_heads=2)), "tp", "n_kv_heads")):
        answers = run_distributed(refused_config, 3, overrides)
        assert all(a is not None and a[0] == field and text in a[1] for a in answers), answers


def test_cli_refuses_bad_tp_before_starting_processes(tmp_path):
    for args, text in ((["--nproc", "3", "--tp", "2"], "must divide the number of ranks (3)"),
                       (["--nproc", "4", "--tp", "4"], "n_kv_heads")):
        out = run_command("train", "--config", "configs/demo-cpu.yaml", "--out", str(tmp_path / "run"), *args)
        assert out.returncode == 2 and "tp=" in out.stderr and text in out.stderr and "Traceback" not in out.stderr


def test_tensor_parallel_problems():
    llama = model_config("llama3-8b")
    assert tensor_parallel_problem(llama, 1) is None and tensor_parallel_problem(llama, 8) is None
    assert "n_kv_heads" in tensor_parallel_problem(llama, 16)
    assert "ffn_dim" in tensor_parallel_problem(model_config("tiny", n_heads=4, n_kv_heads=4, ffn_dim=6), 4)
    with pytest.raises(ConfigError, match="tp"):
        ParallelDims.of(6, 4)
    assert ParallelDims.of(8, 2) == ParallelDims(dp=4, tp=2)


# --- Padding a rank's tokens to a multiple of tp ---------------------------------------------------------


def test_pad_ranks_rounds_every_rank_up_with_documents_of_their_own():
    lens = np.array([300, 41, 700, 9])
    for table in (linear_table(lens, 3, 351), wlb_table(lens, 3, 351)):
        padded = pad_ranks(table, 4)
        assert np.all(padded.tokens_per_rank % 4 == 0)
        assert np.all(padded.tokens_per_rank - table.tokens_per_rank < 4)
        pads = padded.doc_len[table.num_docs:]
        assert np.array_equal(padded.doc_len[:table.num_docs], table.doc_len) and np.all(pads > 0)
        for r in range(3):  # a rank's own pieces first, in their order, then its padding
            mine = padded.doc[padded.rank == r]
            own = table.doc[table.rank == r]
            assert np.array_equal(mine[:len(own)], own) and np.all(mine[len(own):] >= table.num_docs)
        plan = plan_attention(padded, "cad", cost_model="pairs", min_shard_tokens=16)
        assert plan.num_ranks == 3
    table = linear_table(np.array([8, 8]), 2)
    assert pad_ranks(table, 4) is table  # nothing to pad


def test_padded_batch_adds_documents_without_labels():
    batch = GlobalBatch.from_documents([np.arange(5), np.arange(3)])
    padded = batch.padded([2, 1])
    assert padded.num_docs == 4 and padded.num_tokens == 11
    assert padded.num_label_tokens == batch.num_label_tokens
    assert np.all(padded.labels[8:] == -100) and not padded.loss_mask[8:].any()
    assert batch.padded([]) is batch


# --- The planner and the memory model count one GPU's share ----------------------------------------------


def test_plan_command_reports_bytes_per_gpu():
    def plan(tp):
        out = run_command("plan", "--servers", "8", "--tp", str(tp), "--tokens-per-server", "64K", "--strategy", "cad",
                          "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["strategies"]["cad"]
    one, two = plan(1), plan(2)
    assert two["imbalance_after"] == one["imbalance_after"] and two["num_shards"] == one["num_shards"]
    assert two["bytes_moved"] * 2 == one["bytes_moved"]


def test_memory_model_divides_layers_by_tp():
    m = model_config("llama3-8b")
    one, two = (estimate(MemoryInputs(m, 128 * 1024, "keep_attention", dp=2, tp=tp)) for tp in (1, 2))
    assert two.breakdown["layer parameters (compute copy)"] * 2 == one.breakdown["layer parameters (compute copy)"]
    assert two.breakdown["activations"] * 2 == pytest.approx(one.breakdown["activations"])
    assert two.peak_bytes < one.peak_bytes
