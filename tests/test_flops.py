"""MFU: the model's FLOPs of a step, and the GPUs' bf16 peak."""

from __future__ import annotations

import pytest
import torch

from attnpool.model import model_config
from attnpool.train.flops import bf16_peak_flops, linear_flops_per_token, step_flops


def test_step_flops_count_linear_layers_and_causal_attention():
    cfg = model_config("llama3-8b")
    # 6 FLOPs per matmul weight: 32 layers of 218.1M and the 525.3M output head (embedding lookups are none)
    assert linear_flops_per_token(cfg) == pytest.approx(6 * (32 * 218_103_808 + 4096 * 128_256))
    # one 128K document: 4 x 128 x 32 FLOPs per (query, key) pair forward, 3 times that with the backward (the
    # model's; FlashAttention's recompute in its backward is not the model's work)
    pairs = 131072 * 131073 / 2
    attention = 32 * 3 * 4 * 128 * 32 * pairs
    assert step_flops(cfg, [131072]) == pytest.approx(linear_flops_per_token(cfg) * 131072 + attention)
    # the same tokens as many short documents: the linear part alone, nearly
    assert step_flops(cfg, [128] * 1024) < 1.01 * linear_flops_per_token(cfg) * 131072


def test_peak_by_the_gpus_name(monkeypatch):
    assert bf16_peak_flops(torch.device("cpu")) is None
    cuda = torch.device("cuda", 0)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989.4e12),
                       ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA H100 NVL", 835.5e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert bf16_peak_flops(cuda) == peak, name


def _rows(rank, world, out):
    from test_train import tiny_config

    from attnpool.train import train

    return train(tiny_config(out, steps=2)).rows


def test_a_run_reports_model_flops_and_no_mfu_on_the_cpu(tmp_path):
    from dist_harness import run_distributed

    rows = run_distributed(_rows, 1, str(tmp_path))[0]
    cfg = model_config("tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    assert all(r["mfu"] is None and r["model_flops"] >= linear_flops_per_token(cfg) * r["tokens"] for r in rows)


def test_mfu_recount_turns_the_old_count_into_the_new():
    """bench/mfu_recount.py: a step counted with attention as 3.5 forwards, counted again, is step_flops' count."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "mfu_recount.py"
    spec = importlib.util.spec_from_file_location("mfu_recount", path)
    recount = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recount)
    cfg = model_config("llama3-8b", n_layers=4)
    lens = [131072, 4096, 300]
    linear = linear_flops_per_token(cfg) * sum(lens)
    old = linear + (step_flops(cfg, lens) - linear) * 3.5 / 3
    assert recount.recounted(old, linear) == pytest.approx(step_flops(cfg, lens), rel=1e-12)
