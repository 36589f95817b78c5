"""float8 linear layers through torchao (issue 47): what is converted, that emulated float8 trains as bf16 would to
within float8's rounding, and that a run where float8 cannot run is refused in one line. The float8 matmuls
themselves need a GPU of compute capability 8.9+ (bench/results/2026-11-28-h200-float8.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from attnpool.errors import ConfigError  # noqa: E402
from attnpool.model import Transformer, model_config  # noqa: E402
from attnpool.model.float8_options import RECIPES, float8_problem  # noqa: E402
from attnpool.parallel.float8 import apply_float8  # noqa: E402
from attnpool.plan import linear_layout, plan_attention  # noqa: E402
from attnpool.runtime import CoreAttention  # noqa: E402
from attnpool.train import TrainConfig  # noqa: E402

SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)


def test_only_the_decoder_layers_linear_layers_are_converted():
    from torchao.float8.float8_linear import Float8Linear

    model = Transformer(model_config("tiny", **SHAPE))
    converted = apply_float8(model, "tensorwise", emulate=True)
    assert len(converted) == 2 * 7  # q, k, v, o and the gated MLP's three, in each layer
    floats = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert floats == set(converted)
    assert not isinstance(model.embed, Float8Linear) and "norm" not in " ".join(floats)
    # a micro-batch's tokens, the inner dimension of the weight gradient's matmul, need not be a multiple of 16
    # (ping-pong halves end at documents' ends): _scaled_mm refused 64499 of them on the GPU before padding
    assert all(module.config.pad_inner_dim for name, module in model.named_modules() if name in floats)


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_float8_trains_as_bf16_within_its_rounding(recipe):
    """Ten steps of AdamW on the same batch from the same weights: float8 (emulated: its rounding, matmuls in higher
    precision) keeps the loss within 2% of the plain model's, and moves it (the updates flow through the float8
    modules' backward)."""
    docs = [120, 70, 67]  # 257 tokens: not a multiple of 16, as the float8 matmuls pad
    plan = plan_attention(linear_layout(docs, 1), "local", cost_model="pairs")
    tokens = torch.randint(0, 256, (sum(docs),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in docs])
    losses = {}
    for float8 in (False, True):
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", **SHAPE))
        if float8:
            apply_float8(model, recipe, emulate=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(10):
            loss = model(tokens, positions, CoreAttention(plan), labels=tokens) / len(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.item())
        losses[float8] = run
    assert losses[True][-1] < losses[True][0] - 0.5
    for plain, eight in zip(losses[False], losses[True]):
        assert abs(eight - plain) <= 0.02 * plain, (losses[False], losses[True])


def test_float8_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="float8=True: float8 matmuls run on CUDA GPUs"):
        TrainConfig(model="tiny", float8=True, device="cpu")
    with pytest.raises(ConfigError, match="float8=True: not with tensor parallelism"):
        TrainConfig(model="tiny", float8=True, tp=2, nproc=2, device="cuda")
    with pytest.raises(ConfigError, match="float8_recipe='blockwise'"):
        TrainConfig(model="tiny", float8_recipe="blockwise")
    assert "compute capability 8.9" in float8_problem("cuda", (8, 0))
    assert float8_problem("cuda", (9, 0)) is None
