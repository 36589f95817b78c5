"""Ping-pong (two nano-batches interleaved layer by layer, async collectives) computes exactly
what running the nano-batches one after another computes, on gloo with 2 processes."""

import numpy as np
import torch
import torch.nn.functional as F

from attnpool import plan_attention
from attnpool.model import Transformer, model_config
from attnpool.parallel.checkpointing import apply_activation_checkpointing
from attnpool.parallel.pingpong import apply_pingpong
from attnpool.plan import linear_layout
from attnpool.runtime import CoreAttention
from dist_harness import run_distributed


def nano_batch(lens, world, rank, seed):
    """This rank's tokens and positions of one nano-batch, and its cad plan."""
    pieces = linear_layout(lens, world)
    plan = plan_attention(pieces, "cad", cost_model="pairs", min_shard_tokens=16)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=L) for L in lens]
    mine = pieces[rank]
    tokens = torch.as_tensor(np.concatenate([docs[p.doc_id][p.start:p.end] for p in mine]))
    positions = torch.as_tensor(np.concatenate([np.arange(p.start, p.end) for p in mine]))
    return tokens, positions, plan


def worker(rank, world):
    torch.manual_seed(0)
    config = model_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    weights = Transformer(config).double().state_dict()
    batches = [nano_batch([300, 41, 700, 9], world, rank, 1), nano_batch([1000, 77, 120], world, rank, 2)]
    assert any(np.any(b[2].task_server != b[2].task_home) for b in batches)  # work really moves

    def loss_of(logits_list, batches):
        return sum(F.cross_entropy(lg[:-1], b[0][1:], reduction="sum") for lg, b in zip(logits_list, batches))

    results = {}
    checkpointing = {"pingpong+recompute": "keep_attention",
                     "pingpong+full-recompute": "full"}  # full: core attention and its exchanges run again in backward
    for mode in ("sequential", "pingpong", "pingpong+recompute", "pingpong+full-recompute"):
        model = Transformer(config).double()
        model.load_state_dict(weights)
        apply_activation_checkpointing(model, checkpointing.get(mode, "none"))
        attentions = [CoreAttention(b[2]) for b in batches]
        if mode.startswith("pingpong"):
            apply_pingpong(model)
            logits = model([b[0] for b in batches], [b[1] for b in batches], attentions)
        else:
            logits = [model(b[0], b[1], a) for b, a in zip(batches, attentions)]
        loss = loss_of(logits, batches)
        loss.backward()
        results[mode] = dict(logits=[lg.detach() for lg in logits],
                             grads={n: p.grad.clone() for n, p in model.named_parameters()})
    return results


def test_pingpong_equals_sequential():
    for res in run_distributed(worker, 2):
        seq = res["sequential"]
        for mode in ("pingpong", "pingpong+recompute", "pingpong+full-recompute"):
            for a, b in zip(seq["logits"], res[mode]["logits"]):
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
            for name, g in seq["grads"].items():
                torch.testing.assert_close(res[mode]["grads"][name], g, rtol=1e-10, atol=1e-12, msg=f"{mode} {name}")
