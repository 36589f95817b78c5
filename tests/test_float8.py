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
    # under tp 4 a rank's k and v projections hold 32 / 4 = 8 output rows, no multiple of 16: they stay bf16
    split = apply_float8(Transformer(model_config("tiny", **SHAPE)), "tensorwise", emulate=True, tp=4)
    assert len(split) == 2 * 5 and not any(n.endswith(("k_proj", "v_proj")) for n in split), split
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
    TrainConfig(model="tiny", float8=True, tp=2, nproc=2, device="cuda")  # (with tp since power-of-two scales)
    with pytest.raises(ConfigError, match="float8_recipe='blockwise'"):
        TrainConfig(model="tiny", float8_recipe="blockwise")
    assert "compute capability 8.9" in float8_problem("cuda", (8, 0))
    assert float8_problem("cuda", (9, 0)) is None


def _float8_steps(rank, world, tp, recipe, all_gather=False, steps=1, checkpoint=None):
    """The losses of ``steps`` AdamW steps of the emulated float8 model on ``world`` ranks, ``tp`` of them a
    tensor-parallel group, and every weight's gradient in the last: float8, then tensor parallelism and FSDP2
    applied as ``parallelize`` does, the scales of weights gathered in float8 refreshed before each step as the
    training loop does. ``checkpoint``: a directory to save the model into after the steps and load it back
    from into a model built afresh; then that model's weights too."""
    from attnpool.data import DocumentStream, stdlib_corpus
    from attnpool.parallel import build_rank_mesh
    from attnpool.parallel.float8 import refresh_float8_scales
    from attnpool.parallel.parallelize import apply_fsdp
    from attnpool.parallel.tensor import apply_tensor_parallel
    from attnpool.train.checkpoint import load_checkpoint, save_checkpoint
    from attnpool.train.optim import build_optimizer, build_scheduler
    from attnpool.train.planning import plan_batch
    from attnpool.train.runners import forward_backward
    from attnpool.train.spec import resolve_run_spec
    from test_train import tiny_config

    cfg = tiny_config("unused", model_args=dict(SHAPE), attention="cad", tokens_per_rank=255, tp=tp)
    spec = resolve_run_spec(cfg, world, torch.device("cpu"))
    mesh = build_rank_mesh(spec.dims, "cpu")

    def built():
        torch.manual_seed(0)
        model = spec.model.build(spec.device)
        apply_float8(model, recipe, emulate=True, all_gather=all_gather)
        if tp > 1:
            apply_tensor_parallel(model, mesh.tp_mesh)
        apply_fsdp(model, mesh.dp_mesh, False, False, spec.device)
        spec.model.materialize(model, spec.device, 0, spec.device)
        gathered_in_float8 = [n for n, p in model.named_parameters()
                              if type(p.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"]
        assert len(gathered_in_float8) == (2 * 7 if all_gather else 0), gathered_in_float8
        optimizer = build_optimizer(model, cfg.optim, fused=False)
        return model, optimizer, build_scheduler(optimizer, cfg.optim)

    model, optimizer, scheduler = built()
    stream = DocumentStream(stdlib_corpus(), mesh.dims.dp, cfg.data.tokens_per_rank, cfg.data.seed)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        refresh_float8_scales(model)  # as the training loop does before every step
        batch = stream.next_batch()
        step = plan_batch(batch, spec)
        tensors = step.batch.rank_batch(step.plan.pieces, mesh.dp_rank).to_torch()
        losses.append(float(forward_backward(model, [tensors], [CoreAttention(step.plan, mesh.attention_group)],
                                             batch.num_label_tokens, vocab_parallel=tp > 1)))
        if len(losses) < steps:
            optimizer.step()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if checkpoint is None:
        return losses, grads
    save_checkpoint(checkpoint, model, optimizer, scheduler, stream, steps, device=spec.device)
    loaded, loaded_optimizer, loaded_scheduler = built()
    load_checkpoint(checkpoint, loaded, loaded_optimizer, loaded_scheduler, stream, device=spec.device)
    return ({n: p.full_tensor() for n, p in model.named_parameters()},
            {n: p.full_tensor() for n, p in loaded.named_parameters()})


def _float8_first_step(rank, world, tp, recipe):
    losses, grads = _float8_steps(rank, world, tp, recipe)
    return losses[0], grads


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_under_tensor_parallelism_computes_what_it_does_without(recipe):
    """tp=2 against tp=1 (dp=2 both): the same loss and gradients. A tp rank scales its own shard of a tensor (or of
    a row: the weight gradient's rows are split by tp), but the scales are powers of two, and rounding x * 2^k to
    float8 is the same for every k that keeps x from overflowing or going subnormal. (With tensorwise's exact
    scales, gradients came out up to 4% away.)"""
    from dist_harness import run_distributed

    loss_dp, grads_dp = run_distributed(_float8_first_step, 2, 1, recipe)[0]
    loss_tp, grads_tp = run_distributed(_float8_first_step, 4, 2, recipe)[0]
    assert abs(loss_tp - loss_dp) <= 1e-5 * abs(loss_dp)
    for name, grad in grads_dp.items():
        torch.testing.assert_close(grads_tp[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_float8_gathers_of_weights_train_as_bf16_gathers_do(tmp_path):
    """FSDP2 gathering the weights in float8 (dp=2, tensorwise): each weight cast with one scale over its shards (a
    power of two), as after a bf16 gather, so three steps (the scales refreshed before each) give the same losses
    and gradients; and a checkpoint of such a model loads back as it was."""
    from dist_harness import run_distributed

    losses, grads = run_distributed(_float8_steps, 2, 1, "tensorwise", False, 3)[0]
    losses8, grads8 = run_distributed(_float8_steps, 2, 1, "tensorwise", True, 3)[0]
    assert losses8 == losses  # (bit for bit: the same scales, the same float8 weights)
    for name, grad in grads.items():
        assert torch.equal(grads8[name], grad), name
    # and with tp=2 beside it (dp=2, four ranks): weights sharded over both, gathered in float8 over dp
    losses8_tp = run_distributed(_float8_steps, 4, 2, "tensorwise", True, 3)[0][0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses8_tp, losses)), (losses8_tp, losses)
    saved, loaded = run_distributed(_float8_steps, 2, 1, "tensorwise", True, 2, str(tmp_path / "step-2"))[0]
    for name, weight in saved.items():
        assert torch.equal(torch.as_tensor(loaded[name]), torch.as_tensor(weight)), name
    with pytest.raises(ValueError, match="all_gather"):
        apply_float8(Transformer(model_config("tiny", **SHAPE)), "rowwise", emulate=True, all_gather=True)
    with pytest.raises(ConfigError, match="float8_all_gather=True: needs float8 with float8_recipe tensorwise"):
        TrainConfig(model="tiny", float8=True, float8_recipe="rowwise", float8_all_gather=True, device="cuda")
    # A weight whose rows the dp ranks do not divide: FSDP2 pads its last shard, which torchao's float8 gather does
    # not handle (at dp=3 the ranks' gathers differed and the run hung), refused before any rank starts.
    from attnpool.train.spec import resolve_run_spec

    uneven = TrainConfig(model="tiny", model_args=dict(SHAPE), float8=True, float8_all_gather=True, device="cuda",
                         nproc=3)
    with pytest.raises(ConfigError, match="float8_all_gather=True: .* q_proj's 64 rows do not divide by 3") as err:
        resolve_run_spec(uneven, 3, None, "cuda")
    assert err.value.field == "float8_all_gather"
    resolve_run_spec(uneven.replace(nproc=2), 2, None, "cuda")
    # One dp rank (one GPU, or tp over them all) gathers nothing, and left torchao's wrapper on the weights the
    # end-of-run export then could not write
    for nproc, tp in ((1, 1), (2, 2)):
        with pytest.raises(ConfigError, match="float8_all_gather=True: one dp rank gathers nothing"):
            resolve_run_spec(uneven.replace(nproc=nproc, tp=tp), nproc, None, "cuda")
    # On CPU the first thing to say is that float8 cannot run there at all
    with pytest.raises(ConfigError, match="float8=True: float8 matmuls run on CUDA GPUs"):
        resolve_run_spec(uneven.replace(nproc=1), 1, None, "cpu")


def test_quality_table_compares_each_window_with_the_baseline(tmp_path):
    """bench/float8_quality.py: a run 10% above the baseline in its second window reads +10.00% there, names lose
    their shared prefix, and a run named in two records is refused rather than one hiding the other."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "float8_quality.py"
    spec = importlib.util.spec_from_file_location("float8_quality", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    base = {"loss": [2.0] * 4, "grad_norm": [1.0] * 4}
    other = {"loss": [2.0, 2.0, 2.2, 2.2], "grad_norm": [3.0] * 4}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"runs": {"q-bf16-s0": base, "q-short-s0": {"loss": [1.0], "grad_norm": [1.0]}}}))
    second.write_text(json.dumps({"runs": {"q-rowwise-s0": other}}))
    runs = quality.load_runs([str(first), str(second)], steps=4)
    assert list(runs) == ["q-bf16-s0", "q-rowwise-s0"]  # (the 1-step run is another length's)
    header, _, one, two = quality.window_table(runs, "q-bf16-s0", window=2)
    assert "| bf16-s0 loss | rowwise-s0 |" in header
    assert one.startswith("| 1-2 | 2.0000 | +0.00% |") and two.startswith("| 3-4 | 2.0000 | +10.00% |")
    assert two.endswith("| 1.00 / 3.00 |")
    with pytest.raises(SystemExit, match="q-rowwise-s0"):
        quality.load_runs([str(second), str(second)], steps=4)


def test_quality_groups_compare_means_and_show_each_groups_spread(tmp_path):
    """bench/float8_quality.py --group: each window reads a group's mean against the baseline group's mean, with the
    group's lowest and highest runs, and a pattern that matches no run is refused."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "float8_quality.py"
    spec = importlib.util.spec_from_file_location("float8_quality", path)
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    runs = {"bf16-a": {"loss": [1.9, 2.0]}, "bf16-b": {"loss": [2.1, 2.0]},
            "f8-a": {"loss": [2.2, 2.0]}, "f8-b": {"loss": [1.8, 2.3]}}
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"runs": {k: {**v, "grad_norm": [1.0, 1.0]} for k, v in runs.items()}}))
    loaded = quality.load_runs([str(record)], steps=2)
    groups = quality.group_runs(loaded, {"bf16": "bf16-*", "f8": "f8-*"})
    assert groups == {"bf16": ["bf16-a", "bf16-b"], "f8": ["f8-a", "f8-b"]}
    header, _, first, second = quality.group_table(loaded, groups, "bf16", window=1)
    assert "bf16 loss (mean of 2)" in header and "f8 (mean of 2) [runs]" in header
    # step 1: bf16's mean 2.0 (runs -5% and +5%); f8's mean 2.0, its runs 1.8 (-10%) and 2.2 (+10%)
    assert first == "| 1-1 | 2.0000 | -5.00% to +5.00% | +0.00% [-10.00%, +10.00%] |"
    assert second == "| 2-2 | 2.0000 | +0.00% to +0.00% | +7.50% [+0.00%, +15.00%] |"
    with pytest.raises(SystemExit, match="--group tw=tw-\\*: matches none"):
        quality.group_runs(loaded, {"tw": "tw-*"})
