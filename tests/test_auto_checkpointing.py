"""``activation_checkpointing: auto``: each layer's mode, the least recompute the memory model says fits.

Against brute force over every way of splitting the layers into full, keep_attention and none; a model whose layers
are checkpointed differently against the same model checkpointed whole (float64, exact); and a training run whose
capacity forces a mix, against the same run with ``full``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from attnpool.model import model_config
from attnpool.model.llama import Transformer
from attnpool.parallel.checkpointing import apply_activation_checkpointing
from attnpool.runtime import CoreAttention
from attnpool.train.memory import AUTO, Calibration, MemoryInputs, describe_layer_modes, estimate, saved_per_layer
from attnpool.train.memory_fit import OFFLOAD_STEP_SHARE, Capacity, auto_checkpointing
from attnpool.train.sections import AUTO_HEADROOM

from dist_harness import run_distributed
from test_memory import SMALL, batch, saved_storage_bytes
from test_train import tiny_config

GiB = 1 << 30
SHARE = 0.4  # core attention's forward FLOPs over the linear parts'


def inputs(layers=6, tokens=64 * 1024, **fields) -> MemoryInputs:
    return MemoryInputs(model_config("llama3-8b", n_layers=layers), tokens, **{"activation_checkpointing": "full",
                                                                              "dp": 4, **fields})


def modes(full, keep, none):
    return ("full",) * full + ("keep_attention",) * keep + ("none",) * none


def cost(full, keep, offloaded, layers):
    step = layers * (3 + 3.5 * SHARE)
    return keep + full * (1 + SHARE) + (OFFLOAD_STEP_SHARE * step if offloaded else 0.0)


def peak(x, chosen, offloaded=False, cal=None):
    return estimate(replace(x, activation_checkpointing=AUTO, layer_modes=chosen, activation_offload=offloaded),
                    cal).peak_bytes


def test_one_mode_for_every_layer_is_that_mode():
    x = inputs()
    for mode in ("none", "keep_attention", "full"):
        uniform = estimate(replace(x, activation_checkpointing=mode))
        auto = estimate(replace(x, activation_checkpointing=AUTO, layer_modes=(mode,) * 6))
        assert auto.peak_bytes == uniform.peak_bytes and auto.phase == uniform.phase
        assert auto.inputs.layer_modes == (mode,) * 6


def test_one_mode_counts_every_layers_backward():
    """Layer i's backward holds layers 0..i's activations, the later layers' sharded gradients and the next one's
    float32 copy; the last layer's holds no gradient yet. With full recompute at 64K tokens and dp 4 a layer keeps
    less than its gradients, so the layer before the last holds the most, one mode or several; offloaded, the
    second (two layers' activations and nearly every gradient)."""
    x = inputs()  # 6 layers of llama3-8b, full, dp 4
    peak = estimate(x)
    assert peak.phase == "layer 4 backward (full)"
    kept = peak.breakdown["activations"] / 5  # one layer's
    assert kept < peak.breakdown["gradients"]
    offloaded = estimate(replace(x, activation_offload=True))
    assert offloaded.phase == "layer 1 backward (full)" and offloaded.breakdown["activations"] == 2 * kept


def test_a_later_micro_batchs_loss_holds_the_accumulated_gradients():
    """With several micro-batches, each one's loss after the first runs with the gradients accumulated so far
    (unsharded float32, every layer's and the root's): at few tokens that is the step's peak."""
    x = MemoryInputs(model_config("llama3-8b", n_layers=2), 8 * 1024, activation_checkpointing="full", dp=8,
                     microbatches=4)
    peak = estimate(x)
    assert peak.phase == "loss backward" and peak.breakdown["accumulated gradients"] > 0


# (model fields, tokens, dp, tp, calibrated): long and short contexts (at 8K tokens a keep_attention layer's chunked
# recompute holds more than a none layer's backward, so the peak is not monotone in the layers recomputed), tp, and
# the packaged calibration's per-mode residuals
CASES = [(dict(n_layers=6), 64 * 1024, 4, 1, False), (dict(n_layers=6), 8 * 1024, 2, 1, True),
         (dict(n_layers=5), 64 * 1024, 4, 2, True)]


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_auto_picks_the_least_recompute_that_fits(case, offload):
    fields, tokens, dp, tp, calibrated = CASES[case]
    layers = fields["n_layers"]
    x = MemoryInputs(model_config("llama3-8b", **fields), tokens, "full", dp=dp, tp=tp)
    cal = Calibration.load() if calibrated else None
    ends = [peak(x, modes(*split), cal=cal) for split in ((layers, 0, 0), (0, 0, layers))]
    for device in [ends[0] * 0.9] + [ends[0] + (ends[1] - ends[0]) * f for f in (0.02, 0.1, 0.3, 0.6, 1.0)]:
        capacity = Capacity(int(device / (1 - AUTO_HEADROOM)), "test", int(16 * GiB / (1 - AUTO_HEADROOM)))
        chosen = auto_checkpointing(x, capacity, cal, SHARE, offload=offload)
        device = int(capacity.device_bytes * (1 - AUTO_HEADROOM))  # what auto holds the peak to
        host = int(capacity.host_bytes * (1 - AUTO_HEADROOM))
        fitting = []
        for offloaded in (False, True) if offload else (False,):
            for full in range(layers + 1):
                for keep in range(layers - full + 1):
                    if offloaded and full + keep < layers:
                        continue  # (none's activations are never offloaded by auto)
                    split = modes(full, keep, layers - full - keep)
                    e = estimate(replace(x, activation_checkpointing=AUTO, layer_modes=split,
                                         activation_offload=offloaded), cal)
                    if e.peak_bytes <= device and e.host_bytes <= host:
                        fitting.append((cost(full, keep, offloaded, layers), split, offloaded))
        if not fitting:
            assert chosen is None
            continue
        assert chosen is not None
        picked = next(c for c, split, offloaded in fitting
                      if split == chosen.layer_modes and offloaded == chosen.activation_offload)
        assert picked == pytest.approx(min(c for c, _, _ in fitting))
    assert auto_checkpointing(x, Capacity(ends[0] // 2, "small"), cal, SHARE) is None
    roomy = auto_checkpointing(x, Capacity(1 << 50, "roomy"), cal, SHARE, offload=offload)
    assert roomy.layer_modes == ("none",) * layers and not roomy.activation_offload


def test_layers_of_each_mode_keep_what_the_memory_model_counts():
    """Autograd's saved tensors of a model whose layers are checkpointed full, keep_attention and none, less those of
    its first layer alone: the other two layers' counts, each by its own mode (float32 on CPU)."""
    tokens, positions, plan = batch()
    saved = {}
    for layer_modes in (("full",), ("full", "keep_attention", "none")):
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", **{**SMALL, "n_layers": len(layer_modes)}))
        apply_activation_checkpointing(model, layer_modes)
        saved[len(layer_modes)] = saved_storage_bytes(model, tokens, positions, plan)
    x = MemoryInputs(model_config("tiny", **SMALL), len(tokens), "full", bf16=False)
    predicted = sum(sum(saved_per_layer(x, mode).values()) for mode in ("keep_attention", "none"))
    cpu_norm_outputs = 4 * 2 * 64  # CPU's composite rms_norm keeps its output (test_memory: none's layers)
    assert (saved[3] - saved[1]) / len(tokens) == predicted + cpu_norm_outputs


def test_a_mix_is_found_where_neither_end_is_best():
    x = inputs()
    middle = (peak(x, modes(6, 0, 0)) + peak(x, modes(0, 0, 6))) // 2
    chosen = auto_checkpointing(x, Capacity(int(middle / (1 - AUTO_HEADROOM)), "test"), None, SHARE)
    assert len(set(chosen.layer_modes)) > 1
    assert list(chosen.layer_modes) == sorted(chosen.layer_modes, key=["full", "keep_attention", "none"].index)
    assert describe_layer_modes(("full", "keep_attention", "keep_attention", "none")) == \
        "layers 0 full, 1-2 keep_attention, 3 none"
    assert describe_layer_modes(("full",) * 4) == "all 4 layers full"
    assert "activation_checkpointing=auto (layers" in chosen.setting


def test_what_auto_may_choose():
    """Under pipeline stages one mode for every layer; transformers' layers run none or full; ``runs`` narrows."""
    x = inputs(pp=2, rank_layers=3, stage_layers=3)
    middle = (peak(x, modes(3, 0, 0)) + peak(x, modes(0, 0, 3))) // 2
    chosen = auto_checkpointing(x, Capacity(middle, "test"), None, SHARE)
    assert len(set(chosen.layer_modes)) == 1
    hf = inputs(layer_modules="transformers")
    for capacity in (peak(hf, modes(6, 0, 0)) * 1.2, peak(hf, modes(0, 0, 6)) * 0.8):
        chosen = auto_checkpointing(hf, Capacity(int(capacity), "test"), None, SHARE)
        assert chosen is not None and "keep_attention" not in chosen.layer_modes
    x = inputs()
    narrow = auto_checkpointing(x, Capacity(peak(x, modes(0, 6, 0)) * 2, "test"), None, SHARE,
                                runs=("none", "keep_attention"))
    assert "full" not in narrow.layer_modes
    with pytest.raises(ValueError, match="pipeline stages"):
        inputs(pp=2, activation_checkpointing=AUTO, layer_modes=modes(1, 1, 0))


def test_layers_checkpointed_differently_compute_what_full_computes():
    tokens, positions, plan = batch()
    grads = {}
    for name, mode in (("full", "full"), ("none", "none"), ("mixed", ("full", "keep_attention", "none"))):
        torch.manual_seed(0)
        model = Transformer(model_config("tiny", **{**SMALL, "n_layers": 3})).double()
        apply_activation_checkpointing(model, mode)
        loss = model(tokens, positions, CoreAttention(plan), labels=tokens)
        loss.backward()
        grads[name] = [loss.detach()] + [p.grad for p in model.parameters()]
    for name in ("none", "mixed"):
        for a, b in zip(grads[name], grads["full"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    model = Transformer(model_config("tiny", **{**SMALL, "n_layers": 3}))
    with pytest.raises(ValueError, match="modes for 2 layers"):
        apply_activation_checkpointing(model, ("full", "none"))
    with pytest.raises(ValueError, match="'most'"):
        apply_activation_checkpointing(model, ("full", "none", "most"))


# --- A training run ------------------------------------------------------------------------------------------

MODEL = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128)


def applied_modes(model) -> tuple[str, ...]:
    """Each block's checkpointing as its wrappers show it (attnpool.parallel.checkpointing)."""
    from attnpool.parallel.checkpointing import RecomputedInChunks, RecomputedLayer

    def mode(block):
        if isinstance(vars(block).get("forward"), RecomputedLayer):
            return "full"
        return "keep_attention" if isinstance(vars(block).get("before_attention"), RecomputedInChunks) else "none"

    return tuple(mode(model.layers[str(i)]) for i in range(len(model.layers)))


def _train_auto_and_full(rank, world, out):
    """Trains with auto where rank 0's memory would hold every layer's activations and rank 1's only a mix of full
    and keep_attention layers (halfway between their predicted peaks), then with full; returns what auto chose and
    applied on this rank, what `attnpool memory`'s path chooses for rank 1's capacity, and the losses."""
    import torch.distributed as dist

    import attnpool.train.memory_check as memory_check
    from attnpool.train import train
    from attnpool.train.setup import NO_RUN_DIRECTORY, prepare

    config = tiny_config(f"{out}/auto", steps=3, attention="cad", tokens_per_rank=512, model_args=MODEL,
                         activation_checkpointing=AUTO)
    planned = prepare(config.replace(out=NO_RUN_DIRECTORY, memory_check=False), world, device_type="cpu")
    x = memory_check.run_memory_inputs(planned.spec, planned.source, Capacity(1 << 50, "roomy"), Calibration.none())
    ends = [peak(x, (mode,) * 4) for mode in ("full", "keep_attention")]
    tight = Capacity(int((ends[0] + ends[1]) / 2 / (1 - AUTO_HEADROOM)), "half way")
    expected = memory_check.choose_checkpointing(planned.spec, x, planned.source, tight, Calibration.none())
    mine = Capacity(1 << 50, "roomy") if dist.get_rank() == 0 else tight
    rank_capacity, cpu = memory_check.rank_capacity, Calibration.cpu
    memory_check.rank_capacity = lambda device, local_ranks: (mine, Calibration.none())
    Calibration.cpu = Calibration.none  # (the capacities above are the hand count's, without a process's own memory)
    try:
        auto = train(config)
    finally:
        memory_check.rank_capacity, Calibration.cpu = rank_capacity, cpu  # (the harness's processes serve later tests)
    full = train(tiny_config(f"{out}/full", steps=3, attention="cad", tokens_per_rank=512, model_args=MODEL,
                             activation_checkpointing="full"))
    return auto.layer_checkpointing, applied_modes(auto.model), expected.layer_modes, auto.losses, full.losses


def test_training_with_auto_takes_the_memory_models_choice_and_computes_what_full_does(tmp_path):
    """Every rank takes the choice for the smallest rank's memory (one that recomputed core attention alone would
    wait in exchanges the others never start), applies it, and trains as full does."""
    ranks = run_distributed(_train_auto_and_full, 2, str(tmp_path))
    for chosen, applied, expected, auto, full in ranks:
        assert chosen == applied == expected and {"full", "keep_attention"} <= set(chosen), (chosen, applied)
        torch.testing.assert_close(torch.tensor(auto), torch.tensor(full), rtol=1e-6, atol=0)
    with open(os.path.join(tmp_path, "auto", "summary.json")) as fh:
        summary = json.load(fh)
    assert summary["activation_checkpointing"] == AUTO and tuple(summary["layer_checkpointing"]) == ranks[0][0]


def test_auto_is_refused_in_one_line_where_even_full_leaves_too_little(capsys):
    """Where full fits the memory but not with auto_headroom left free, the refusal names auto_headroom; where it
    does not fit at all, the memory check's refusal (the fields to change)."""
    from attnpool.cli.main import main

    args = ["memory", "--model", "tiny", "--data", "stdlib", "--device", "cpu", "--activation-checkpointing", "auto"]
    # (full's peak: about 29 MiB of the model's and 400 MiB of the process's own)
    assert main(args + ["--host-memory", "460MiB"]) == 2
    assert "auto_headroom=0.15: no choice of layers leaves 15% of the 460 MiB" in capsys.readouterr().err
    assert main(args + ["--host-memory", "10MiB"]) == 2
    assert "nproc=1: predicted peak" in capsys.readouterr().err


def test_a_headroom_outside_zero_to_one_is_refused():
    from attnpool.errors import ConfigError
    from attnpool.train.config import TrainConfig

    for value in (1.0, -0.1):
        with pytest.raises(ConfigError, match="auto_headroom"):
            TrainConfig(model="tiny", data="stdlib", device="cpu", auto_headroom=value)
