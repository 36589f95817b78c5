"""``loss_kernel``: which loss the LM head runs (attnpool.model.fused_loss), how it is chosen and refused,
that the training loop's model runs the one chosen, and the memory model's view of it. Liger's kernels need
a CUDA GPU: here a stand-in (the chunked loss behind liger's name) checks the wiring; the kernel itself is
checked against the chunked loss on a GPU (bench/results/2026-11-26-h200-fa4.md)."""

from __future__ import annotations

import pytest
import torch

import attnpool.model.fused_loss as fused_loss
import attnpool.model.loss_kernels as loss_kernels
from attnpool.errors import ConfigError
from attnpool.model import Transformer, model_config
from attnpool.model.llama import chunked_cross_entropy
from attnpool.train import train
from attnpool.train.sections import LOSS_KERNELS
from attnpool.train.memory import MemoryInputs, loss_transient
from dist_harness import run_distributed
from test_train import rel_diff, tiny_config


def test_config_names_the_kernels_the_module_has():
    assert LOSS_KERNELS is loss_kernels.LOSS_KERNELS
    assert set(fused_loss.LOSS_FUNCTIONS) == set(LOSS_KERNELS) - {"auto"}


@pytest.mark.parametrize("overrides", [dict(loss_kernel="fused"), dict(loss_kernel="liger", device="cpu"),
                                       dict(loss_kernel="liger", tp=2, device="auto")])
def test_bad_loss_kernels_are_refused_by_the_config(overrides):
    with pytest.raises(ConfigError) as err:
        tiny_config("unused", **overrides)
    assert err.value.field == "loss_kernel"


def test_auto_resolves_to_what_can_run(monkeypatch):
    assert loss_kernels.resolve_loss_kernel("auto", "cpu") == "chunked"
    assert loss_kernels.resolve_loss_kernel("chunked", "cuda") == "chunked"
    monkeypatch.setattr(loss_kernels.importlib.util, "find_spec", lambda name: None)
    assert loss_kernels.resolve_loss_kernel("auto", "cuda") == "chunked"
    with pytest.raises(ConfigError, match="not installed") as err:
        loss_kernels.resolve_loss_kernel("liger", "cuda")
    assert err.value.field == "loss_kernel"
    monkeypatch.setattr(loss_kernels.importlib.util, "find_spec", lambda name: object())
    assert loss_kernels.resolve_loss_kernel("auto", "cuda") == "liger"
    assert loss_kernels.resolve_loss_kernel("auto", "cuda", tp=2) == "chunked"
    with pytest.raises(ConfigError, match="tensor parallelism"):
        loss_kernels.resolve_loss_kernel("liger", "cuda", tp=2)


def test_the_model_computes_its_loss_with_the_kernel_set_on_it():
    torch.manual_seed(0)
    model = Transformer(model_config("tiny"))
    tokens, labels = torch.randint(0, 256, (64,)), torch.randint(0, 256, (64,))
    positions = torch.arange(64)
    from attnpool.plan import linear_table, plan_attention
    from attnpool.runtime import CoreAttention

    attention = CoreAttention(plan_attention(linear_table([64], 1), "local", cost_model="pairs"), None)
    calls = []
    model.cross_entropy = lambda h, w, y: calls.append(h.shape) or chunked_cross_entropy(h, w, y)
    loss = model(tokens, positions, attention, labels=labels)
    assert calls == [torch.Size([64, 128])]
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(model(tokens, positions, attention), labels,
                                                                 reduction="sum"))


def _train_losses(rank, world, out, liger_stand_in):
    calls = []
    if liger_stand_in:  # liger "available", and the chunked loss behind its name
        def stand_in(h, weight, labels):
            calls.append(h.shape[0])
            return chunked_cross_entropy(h, weight, labels)

        loss_kernels.liger_problem = lambda device_type, tp: None
        fused_loss.LOSS_FUNCTIONS["liger"] = stand_in
    rows = train(tiny_config(out, steps=3)).rows
    return [r["loss"] for r in rows], len(calls)


def test_training_runs_the_loss_kernel_auto_chooses(tmp_path):
    """With liger "available" auto picks it, and every step's loss goes through it; the stand-in is the
    chunked loss, so the run trains as the chunked one."""
    chunked, none = run_distributed(_train_losses, 1, str(tmp_path / "chunked"), False)[0]
    liger, calls = run_distributed(_train_losses, 1, str(tmp_path / "liger"), True)[0]
    assert none == 0 and calls == 3
    assert rel_diff(liger, chunked) <= 1e-6


def test_memory_model_counts_each_loss_by_hand():
    cfg = model_config("llama3-8b", n_layers=4)
    v, d = cfg.vocab_size, cfg.dim
    # chunked: 2048-token chunks of logits (bf16 product, float32 copy, log-softmax, float32 and bf16 gradients)
    assert loss_transient(MemoryInputs(cfg, 131072, "none"), 131072) == 16 * 2048 * v
    # liger: a 4096-token chunk at 128K tokens (131072 / ceil(128256 / 4096), a power of two), its bf16
    # logits and the weight gradient's bf16 copy both beside the float32 accumulator
    liger = MemoryInputs(cfg, 131072, "none", loss_kernel="liger")
    assert loss_transient(liger, 131072) == 4 * v * d + 2 * max(4096 * v, v * d)
    assert loss_transient(liger, 1000) == 4 * v * d + 2 * v * d  # a chunk of 32 tokens: the copy is larger
