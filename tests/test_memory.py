"""The memory model against hand counts and the real model; the refusal paths; offload's exactness.

The GPU side of the model (calibration, the check against measured peaks) is bench/gpu_memory.py's.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import torch

import attnpool.model.llama as llama
from attnpool.errors import ConfigError
import attnpool.parallel.checkpointing as checkpointing
from attnpool.model import Transformer, model_config
from attnpool.parallel.checkpointing import apply_activation_checkpointing
from attnpool.parallel.compile import compile_linear_parts
from attnpool.parallel.pingpong import apply_pingpong
from attnpool.plan import linear_table, plan_attention
from attnpool.plan.metrics import AttentionRows
from attnpool.runtime import CoreAttention, LayerKinds
from attnpool.runtime.dispatch import DispatchLayout
from attnpool.sizes import format_tokens, parse_memory_size
from attnpool.train.memory import (CHECKPOINTING_MODES, Calibration, MemoryInputs, RowRatios, estimate, saved_per_layer,
                                   undominated)
from attnpool.train.memory_fit import Capacity, largest_tokens, report, settings
from attnpool.train.offload import ActivationOffload, piece_sizes
from command import run_command
from dist_harness import run_distributed
from test_train import tiny_config

SMALL = dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
DOCS = np.array([200, 300, 100])


def small_model(layers: int, mode: str, compiled: bool = False, **variant) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", **{**SMALL, "n_layers": layers, **variant}))
    if compiled:  # as parallelize orders them: compile, then checkpointing around the compiled parts
        compile_linear_parts(model)
    apply_activation_checkpointing(model, mode)
    return model


def batch():
    plan = plan_attention(linear_table(DOCS, 1, int(DOCS.sum())), "local")
    tokens = torch.randint(0, 256, (int(DOCS.sum()),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in DOCS])
    return tokens, positions, plan


def saved_storage_bytes(model, tokens, positions, plan, kinds=()) -> int:
    """Bytes of every storage autograd keeps for backward (parameters aside), each storage once. ``kinds``: the
    model's layer kinds, where it has windows (every one longer than these documents: the plan serves them all)."""
    storages = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention = CoreAttention(plan) if not kinds else LayerKinds(
            kinds, {kind.window: plan for kind in kinds}, lambda p, cap: CoreAttention(p, softcap=cap))
        model(tokens, positions, attention, labels=tokens)
    return sum(storages.values())


# --- The hand count ------------------------------------------------------------------------------------


def test_parameter_terms_by_hand():
    m = model_config("tiny", **SMALL)  # vocab 256, dim 64, 4 x 16 query heads, 2 KV heads, ffn 96
    layer = 64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 96 + 2 * 64
    assert m.layer_params() == layer == 30848
    assert m.num_params() == layer + 64 + 2 * 256 * 64
    e = estimate(MemoryInputs(m, 1024, "keep_attention", dp=2))
    owned = (layer + 2 * 256 * 64 + 64) / 2
    assert e.breakdown["parameters"] == 4 * owned and e.breakdown["optimizer states"] == 8 * owned
    assert e.breakdown["root parameters (compute copy)"] == 2 * (2 * 256 * 64 + 64)  # bf16 copy, unsharded
    assert e.breakdown["layer parameters (compute copy)"] == 2 * layer
    offloaded = estimate(MemoryInputs(m, 1024, "keep_attention", optimizer_offload=True, dp=2))
    assert "parameters" not in offloaded.breakdown and offloaded.host_bytes == 16 * owned


def test_saved_per_layer_by_hand():
    m = model_config("tiny", **SMALL)
    bf16 = {mode: sum(saved_per_layer(MemoryInputs(m, 600, mode)).values()) for mode in CHECKPOINTING_MODES}
    # full: the layer's input; keep_attention: plus Q, K/V (2 of 2 heads x 16), float32 LSE (4 heads) and
    # the output; none: plus the norms' inputs, statistics and outputs, the block's sum and the MLP's four
    assert bf16["full"] == 2 * 64
    assert bf16["keep_attention"] == 2 * 64 + 2 * 64 + 2 * 2 * 32 + 4 * 4 + 2 * 64
    assert bf16["none"] == bf16["keep_attention"] + 2 * 4 + 2 * 2 * 64 + 2 * 64 + 4 * 2 * 96
    # cad's rows scale the attention terms: twice the queries served, returned outputs, three KV rows per token
    rows = RowRatios(query=2.0, returned=1.0, unique_kv=3.0, expanded_kv=3.0)
    cad = sum(saved_per_layer(MemoryInputs(m, 600, "keep_attention", rows=rows)).values())
    assert cad == 2 * 64 + 2 * 64 * 2 + 2 * 2 * 32 * 3 + 4 * 4 * 2 + 2 * 64 + 2 * 64 * 1


# The layer variants of the families Hugging Face checkpoints come from (attnpool.model.hf)
VARIANTS = {"llama": {}, "qwen3": dict(qk_norm=True),
            "gemma3": dict(qk_norm=True, sandwich_norms=True, activation="gelu_tanh", query_scale=0.2)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", CHECKPOINTING_MODES)
def test_saved_per_layer_matches_what_autograd_keeps(mode, variant):
    """The real model's saved tensors, counted by a hook over one and two layers (float32 on CPU)."""
    tokens, positions, plan = batch()
    one, two = (saved_storage_bytes(small_model(n, mode, **VARIANTS[variant]), tokens, positions, plan)
                for n in (1, 2))
    config = model_config("tiny", **SMALL, **VARIANTS[variant])
    predicted = sum(saved_per_layer(MemoryInputs(config, len(tokens), mode, bf16=False)).values())
    # CPU's rms_norm is composite and keeps its normalized input too (CUDA's fused kernel does not:
    # bench/results/2026-11-25-h200-memory.md counts the same hook on an H200 and matches exactly).
    heads = (config.n_heads + config.n_kv_heads) * config.head_dim
    norm_widths = 2 * 64 + (2 * 64 if config.sandwich_norms else 0) + (heads if config.qk_norm else 0)
    cpu_norm_outputs = 4 * norm_widths if mode == "none" else 0
    assert (two - one) / len(tokens) == predicted + cpu_norm_outputs


@pytest.mark.parametrize("mode", CHECKPOINTING_MODES)
def test_saved_per_layer_of_compiled_layers(mode):
    """The compiled linear parts keep what the model counts for them: under none the MLP's activation is
    recomputed (three ffn_dim-wide tensors kept, not four), and the norms' outputs are kept on CPU as on CUDA;
    keep_attention and full keep what the eager layers keep."""
    tokens, positions, plan = batch()
    one, two = (saved_storage_bytes(small_model(n, mode, compiled=True), tokens, positions, plan) for n in (1, 2))
    config = model_config("tiny", **SMALL)
    compiled = sum(saved_per_layer(MemoryInputs(config, len(tokens), mode, bf16=False, compiled=True)).values())
    eager = sum(saved_per_layer(MemoryInputs(config, len(tokens), mode, bf16=False)).values())
    assert (two - one) / len(tokens) == compiled
    assert eager - compiled == (4 * config.ffn_dim if mode == "none" else 0)


# transformers' configs of the adapter's layer variants: Llama's norms; Qwen3's q/k norms; Gemma 3's sandwich norms, its
# q/k norms and its (1 + w) norms computed in float32
ADAPTER_VARIANTS = {"llama": ("LlamaConfig", {}), "qwen3": ("Qwen3Config", {}),
                    "gemma3_text": ("Gemma3TextConfig", dict(query_pre_attn_scalar=16, sliding_window=4096))}


def adapter_model(variant: str, layers: int, mode: str):
    """transformers' model of the variant, in bf16 (as FSDP2's mixed precision computes), behind the adapter."""
    transformers = pytest.importorskip("transformers")
    from attnpool.model.hf_causal_lm import ATTENTION_NAME, HFCausalLM, register_attention

    name, extra = ADAPTER_VARIANTS[variant]
    config = getattr(transformers, name)(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, **extra)
    register_attention()
    torch.manual_seed(0)
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                     attn_implementation=ATTENTION_NAME).train())
    apply_activation_checkpointing(model, mode)
    return model, config


@pytest.mark.parametrize("variant", list(ADAPTER_VARIANTS))
@pytest.mark.parametrize("mode", ("none", "full"))
def test_saved_per_layer_of_transformers_layers(mode, variant):
    """What the adapter's layers (transformers' modules) keep, counted by the hook over one and two layers in bf16:
    their norms run in float32 as written in Python, on CPU as on CUDA."""
    from attnpool.model.hf_causal_lm import planning_config

    tokens, positions, plan = batch()
    (one, config), (two, _) = ((saved_storage_bytes(model, tokens, positions, plan,
                                                    planning_config(config).layer_kinds()), config)
                               for model, config in (adapter_model(variant, n, mode) for n in (1, 2)))
    x = MemoryInputs(planning_config(config), len(tokens), mode, layer_modules="transformers")
    per_token = (two - one) / len(tokens)
    # Gemma's norms also keep 1 + w in float32: a few hundred bytes per layer, whatever the tokens
    offset_weights = 4 * (4 * 64 + 2 * 16) / len(tokens) if variant == "gemma3_text" and mode == "none" else 0
    assert per_token == pytest.approx(sum(saved_per_layer(x).values()) + offset_weights, abs=1e-9)
    assert sum(saved_per_layer(x).values()) > sum(saved_per_layer(replace(x, layer_modules="attnpool")).values()) \
        or mode == "full"


def test_the_adapter_is_offered_only_the_checkpointing_it_runs():
    x = MemoryInputs(model_config("tiny", **SMALL), 1024, "full", layer_modules="transformers")
    assert {s.activation_checkpointing for s in settings(x)} == {"none", "full"}
    own = replace(x, layer_modules="attnpool")
    assert {s.activation_checkpointing for s in settings(own)} == set(CHECKPOINTING_MODES)


def test_attention_rows_match_the_dispatch_layout():
    lens = np.array([5000, 300, 2200, 900, 4000, 64, 3000])
    table = linear_table(lens, 4, int(lens.sum()) // 4 + 1)
    for strategy in ("local", "percp", "cad"):
        plan = plan_attention(table, strategy, cost_model="pairs", min_shard_tokens=64)
        rows = AttentionRows.of(plan)
        for r in range(4):
            layout = DispatchLayout.build(plan, r, "cpu")
            assert rows.home[r] == layout.num_tokens
            assert rows.query[r] == layout.num_server_q
            assert rows.unique_kv[r] == layout.num_unique_kv
            assert rows.expanded_kv[r] == len(layout.kv_expand)
            assert rows.returned[r] == len(layout.recv_q_pos)


def test_the_estimate_is_the_largest_over_sampled_ranks_not_their_bound():
    """Two ranks, each the worst in another count: the peak is one of theirs, below the elementwise
    bound that would combine both; a rank matched or exceeded in every count by another is dropped."""
    m = model_config("llama3-8b", n_layers=8)
    many_queries = RowRatios(query=1.6, returned=0.6, unique_kv=1.2, expanded_kv=1.2, batches=2)
    many_keys = RowRatios(query=1.1, returned=0.1, unique_kv=2.5, expanded_kv=2.5, batches=2)
    dominated = RowRatios(query=1.0, returned=0.1, unique_kv=1.1, expanded_kv=1.1, batches=2)
    assert undominated([many_queries, dominated, many_keys, many_queries]) == (many_queries, many_keys)
    bound = RowRatios(query=1.6, returned=0.6, unique_kv=2.5, expanded_kv=2.5, batches=2)
    for mode in CHECKPOINTING_MODES:
        x = MemoryInputs(m, 64 * 1024, mode, dp=4, rows=bound)
        each = [estimate(replace(x, rows=r)).peak_bytes for r in (many_queries, many_keys)]
        peak = estimate(replace(x, row_candidates=(many_queries, many_keys))).peak_bytes
        assert peak == max(each) < estimate(x).peak_bytes


def test_more_tokens_layers_and_fewer_ranks_need_more_memory():
    m = model_config("llama3-8b", n_layers=8)
    for mode in CHECKPOINTING_MODES:
        base = MemoryInputs(m, 64 * 1024, mode)
        peak = estimate(base).peak_bytes
        assert estimate(replace(base, tokens_per_rank=128 * 1024)).peak_bytes > peak
        assert estimate(replace(base, model=model_config("llama3-8b", n_layers=16))).peak_bytes > peak
        assert estimate(replace(base, dp=4)).peak_bytes < peak
        assert estimate(replace(base, activation_offload=True)).peak_bytes <= peak
        assert estimate(replace(base, optimizer_offload=True)).peak_bytes < peak
    keep, full = (estimate(MemoryInputs(m, 128 * 1024, mode)) for mode in ("keep_attention", "full"))
    assert keep.breakdown["activations"] > full.breakdown["activations"]


def test_largest_tokens_is_the_boundary():
    x = MemoryInputs(model_config("llama3-8b", n_layers=4), 64 * 1024, "keep_attention")
    capacity = Capacity(80 << 30, "a test GPU")
    largest = largest_tokens(x, capacity)
    assert largest % 1024 == 0 and largest > 0
    assert estimate(replace(x, tokens_per_rank=largest)).peak_bytes <= capacity.device_bytes
    assert estimate(replace(x, tokens_per_rank=largest + 1024)).peak_bytes > capacity.device_bytes
    assert largest_tokens(x, Capacity(1 << 30, "too small")) == 0


def test_settings_fastest_first_and_offloads_only_on_request():
    x = MemoryInputs(model_config("tiny"), 1024)
    all_settings = settings(x)
    assert len(all_settings) == 12 and len({s.setting for s in all_settings}) == 12
    assert all_settings[0].setting == "activation_checkpointing=none"
    assert [s.setting for s in settings(x, offloads=False)] == [
        f"activation_checkpointing={mode}" for mode in ("none", "keep_attention", "full")]


def test_host_memory_is_a_limit_of_offload():
    x = MemoryInputs(model_config("llama3-8b", n_layers=4), 128 * 1024, "keep_attention", activation_offload=True)
    e = estimate(x)
    assert e.host_bytes == 4 * sum(saved_per_layer(x).values()) * 128 * 1024
    assert Capacity(e.peak_bytes, "gpu", e.host_bytes).holds(e)
    assert not Capacity(e.peak_bytes, "gpu", e.host_bytes - 1).holds(e)


# --- Refusals ------------------------------------------------------------------------------------------


def test_refusal_names_the_field_and_the_largest_value_that_fits():
    x = MemoryInputs(model_config("llama3-8b", n_layers=4), 256 * 1024, "none")
    r = report(x, Capacity(60 << 30, "a 60 GiB test GPU"))
    assert not r.fits
    error = r.refusal()
    assert error.field == "tokens_per_rank" and error.value == 256 * 1024
    largest = r.configured.largest_tokens
    assert f"the largest tokens_per_rank that fits is {format_tokens(largest)}" in str(error)
    assert "fits it" in str(error) and r.first_fitting().inputs.activation_checkpointing != "none"
    # Model states alone too large for the GPU: no token count helps; a setting with offload does.
    states = report(MemoryInputs(model_config("llama3-8b"), 1024, "full"), Capacity(80 << 30, "an 80 GiB GPU"))
    error = states.refusal()
    assert error.field == "optimizer_offload" and "optimizer_offload=true" in str(error)
    nothing = report(MemoryInputs(model_config("llama3-8b"), 1024, "full"), Capacity(1 << 30, "1 GiB"))
    assert nothing.refusal().field == "nproc"


def test_memory_sizes_parse_and_bad_ones_are_refused():
    assert parse_memory_size("gpu_memory", "141GB") == 141 * 10**9
    assert parse_memory_size("gpu_memory", "139.8GiB") == int(139.8 * 2**30)
    assert parse_memory_size("gpu_memory", "80G") == 80 * 2**30
    assert parse_memory_size("gpu_memory", "81559MiB") == 81559 * 2**20
    assert parse_memory_size("gpu_memory", str(80 << 30)) == 80 << 30  # plain bytes
    for bad in ("lots", "12XB", "-3GB", "0", "nanGB", "80", "128 b"):  # (80 and 128 without a unit: bytes, surely not)
        with pytest.raises(ConfigError, match="gpu_memory"):
            parse_memory_size("gpu_memory", bad)


def test_a_smaller_models_calibrated_residual_is_in_proportion_to_what_its_layers_keep():
    """The calibration was fitted on Llama-3-8B's widths: the 8B and larger models take its residual whole, a smaller
    one in proportion, so a tiny model's estimate stays above zero and has a largest token count (it had neither:
    at 16M tokens -54,564 MiB, and 2^41 tokens "fit" 79 GiB)."""
    from attnpool.train.memory import residual_share

    eight_b = MemoryInputs(model_config("llama3-8b", n_layers=4), 64 * 1024, "none")
    assert residual_share(eight_b, "none") == residual_share(eight_b, "full") == 1.0
    assert residual_share(replace(eight_b, model=model_config("llama-34b", n_layers=2)), "none") == 1.0
    tiny = MemoryInputs(model_config("tiny"), 16 << 20, "none")
    assert 0 < residual_share(tiny, "none") < 0.05
    assert estimate(tiny).allocated_bytes > 0
    assert 0 < largest_tokens(replace(tiny, tokens_per_rank=2048), Capacity(79 << 30, "a 79 GiB GPU")) < 1 << 30


def test_calibration_loads_and_a_foreign_file_is_refused(tmp_path):
    packaged = Calibration.load()
    assert packaged.fragmentation >= 1.0 and packaged.cuda_context_bytes > 0
    assert set(packaged.residual_per_token) == set(CHECKPOINTING_MODES)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fragmentation": 1.0}))
    with pytest.raises(ConfigError, match="memory_calibration"):
        Calibration.load(str(bad))


def _cli(*args, check_rc=None) -> subprocess.CompletedProcess:
    """These commands refuse or only plan: run in this process (tests/command.py)."""
    out = run_command(*args)
    if check_rc is not None:
        assert out.returncode == check_rc, out.stderr
    return out


MEMORY_8B = ("memory", "--model", "llama3-8b", "--data", "synthetic", "--data-args", "dist=prolong", "--nproc", "4",
             "--tokens-per-rank", "256K", "--attention", "cad", "--gpu-memory", "139.8GiB", "--host-memory", "128GiB")


def test_memory_command_names_a_setting_that_fits():
    out = _cli(*MEMORY_8B, "--json", check_rc=0)
    data = json.loads(out.stdout)
    for key in ("peak_bytes", "capacity_bytes", "fits", "breakdown"):
        assert key in data
    assert data["fits"] is False and isinstance(data["fits"], bool)
    assert data["peak_bytes"] == sum(data["breakdown"].values())
    assert data["capacity_bytes"] == int(139.8 * 2**30)
    fitting = data["fitting_setting"]
    assert fitting is not None and fitting["peak_bytes"] <= data["capacity_bytes"]
    assert data["attention_rows"]["batches"] > 0  # cad's rows came from plans
    text = _cli(*MEMORY_8B, check_rc=0).stdout
    assert "does NOT fit" in text and f"activation_checkpointing={fitting['activation_checkpointing']}" in text


def test_a_short_run_samples_only_the_batches_it_trains_on():
    """Core attention's rows come from the run's first batches: 8 at most, and no more than it draws
    (steps x micro-batches, up to stop_at)."""
    def sampled(*args):
        return json.loads(_cli(*MEMORY_8B, "--json", *args, check_rc=0).stdout)["attention_rows"]["batches"]
    assert sampled("--steps", "1000") == 8
    assert sampled("--steps", "3") == 3
    assert sampled("--steps", "1000", "--stop-at", "2", "--microbatches", "2") == 4


def test_memory_command_plans_gpus_from_a_machine_without_one():
    """--device cuda names the GPUs the run will have, not this machine's; dp=1 (tp=4) says why no plan was drawn."""
    out = _cli(*MEMORY_8B, "--device", "cuda", "--tp", "4", check_rc=0).stdout
    assert "dp 1 x tp 4 ranks" in out and "one dp rank: core attention runs on its own tokens" in out


@pytest.mark.parametrize("args, field", [
    (("--gpu-memory", "plenty"), "gpu_memory"),
    (("--gpu-memory", "2GB"), "nproc"),  # not even one token fits: the states alone are larger
    (("--tokens-per-rank", "1G"), "tokens_per_rank"),
    (("--host-memory", "-1"), "host_memory"),
])
def test_memory_command_bad_input_exits_2(args, field):
    out = _cli(*MEMORY_8B, *args)
    assert out.returncode == 2 and field in out.stderr and "Traceback" not in out.stderr


def test_memory_command_predicts_a_cpu_run_for_the_cpu(capsys):
    """device: cpu (the demo's config): what the run's own check compares, the hand count against each rank's share
    of this machine's memory, and no offload setting (they move nothing on the CPU)."""
    from attnpool.cli.main import main

    assert main(["memory", "--config", "configs/demo-cpu.yaml", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "this machine's memory for each of its 4 ranks" and data["fits"] is True
    assert data["calibration"] == Calibration.cpu().source
    assert {(s["activation_offload"], s["optimizer_offload"]) for s in data["settings"]} == {(False, False)}
    assert main(["memory", "--config", "configs/demo-cpu.yaml", "--gpu-memory", "80GB"]) == 2
    assert "gpu_memory='80GB': the config runs on the CPU" in capsys.readouterr().err


def test_a_cpu_rank_counts_its_process_and_too_many_ranks_are_refused(monkeypatch, capsys):
    """Each CPU rank holds its process's own memory besides the model's (Python, torch, gloo: about 400 MiB), and
    the ranks share this machine's: 64 ranks of 16 GiB are refused, naming nproc and saying to start fewer."""
    import attnpool.train.memory_check as memory_check
    from attnpool.cli.main import main

    monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 16 << 30)
    assert main(["memory", "--config", "configs/demo-cpu.yaml", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["breakdown"]["process (Python, torch, gloo)"] == 400 << 20
    assert main(["memory", "--config", "configs/demo-cpu.yaml", "--nproc", "64"]) == 2
    assert "nproc=64" in (err := capsys.readouterr().err) and "start fewer processes" in err
    assert "--no-memory-check" not in err  # (a run's check says how to skip it; this command checks nothing to skip)


def test_memory_command_needs_a_gpu_or_its_size():
    out = _cli("memory", "--model", "tiny")
    assert out.returncode == 2 and "gpu_memory" in out.stderr


def test_train_refuses_a_batch_no_memory_holds(tmp_path):
    out = _cli("train", "--config", "configs/demo-cpu.yaml", "--tokens-per-rank", "1G", "--nproc", "2",
               "--out", str(tmp_path / "run"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "tokens_per_rank=1073741824" in out.stderr and "the largest tokens_per_rank that fits is" in out.stderr


# --- Chunked recompute and offload compute the same function ----------------------------------------------


@pytest.mark.parametrize("mode", CHECKPOINTING_MODES)
def test_offload_and_chunked_recompute_keep_gradients_exact(mode, monkeypatch):
    """Every saved tensor through ActivationOffload (min_bytes=0), and keep_attention's linear parts
    recomputed 128 tokens at a time: the same loss and gradients, bit for bit, and the bytes offloaded
    per layer are the hand count's."""
    monkeypatch.setattr(checkpointing, "LINEAR_CHUNK_TOKENS", 128)
    tokens, positions, plan = batch()
    results = {}
    for offload in (False, True):
        for layers in (1, 2):
            model = small_model(layers, mode)
            # pieces of at least 256 bytes: most regions are held in several host pieces
            hooks = ActivationOffload("cpu", min_bytes=0, piece_floor_bytes=256) if offload else None
            with hooks if hooks else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = model(tokens, positions, CoreAttention(plan), labels=tokens)
            loss.backward()
            results[offload, layers] = (loss.detach(), [p.grad for p in model.parameters()],
                                        hooks.offloaded_bytes if hooks else 0)
    for layers in (1, 2):
        (loss, grads, _), (loss_off, grads_off, _) = results[False, layers], results[True, layers]
        assert torch.equal(loss, loss_off)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_off))
    per_layer = (results[True, 2][2] - results[True, 1][2]) / len(tokens)
    x = MemoryInputs(model_config("tiny", **SMALL), len(tokens), mode, bf16=False)
    cpu_norm_outputs = 2 * 4 * 64 if mode == "none" else 0  # see test_saved_per_layer_matches_what_autograd_keeps
    assert per_layer == sum(saved_per_layer(x).values()) + cpu_norm_outputs


@pytest.mark.parametrize("mode", CHECKPOINTING_MODES)
def test_offload_moves_the_same_per_layer_under_pingpong(mode, monkeypatch):
    """Two nano-batches interleaved (ping-pong) save what one batch of their tokens saves per layer, and
    offload moves all of it: a checkpoint keeps non-tensor arguments (a list of nano-batches) on the GPU,
    out of the offload's reach, so the layer must hand its tensors over one by one."""
    monkeypatch.setattr(checkpointing, "LINEAR_CHUNK_TOKENS", 128)
    tokens, positions, _ = batch()
    cut = int(DOCS[:2].sum())  # nano-batches of whole documents
    halves = [(tokens[:cut], positions[:cut], DOCS[:2]), (tokens[cut:], positions[cut:], DOCS[2:])]
    offloaded = {}
    for layers in (1, 2):
        model = small_model(layers, mode)
        apply_pingpong(model)
        hooks = ActivationOffload("cpu", min_bytes=0)
        attentions = [CoreAttention(plan_attention(linear_table(d, 1, int(d.sum())), "local")) for _, _, d in halves]
        with hooks:
            losses = model([t for t, _, _ in halves], [p for _, p, _ in halves], attentions,
                           labels=[t for t, _, _ in halves])
        sum(losses).backward()
        offloaded[layers] = hooks.offloaded_bytes
    per_layer = (offloaded[2] - offloaded[1]) / len(tokens)
    x = MemoryInputs(model_config("tiny", **SMALL), len(tokens), mode, bf16=False)
    cpu_norm_outputs = 2 * 4 * 64 if mode == "none" else 0  # see test_saved_per_layer_matches_what_autograd_keeps
    assert per_layer == sum(saved_per_layer(x).values()) + cpu_norm_outputs


def test_chunked_recompute_matches_plain_backward(monkeypatch):
    tokens, positions, plan = batch()
    grads = {}
    for chunk in (10**9, 97):  # one chunk (a plain checkpoint), then uneven chunks
        monkeypatch.setattr(checkpointing, "LINEAR_CHUNK_TOKENS", chunk)
        model = small_model(2, "keep_attention").double()
        model(tokens, positions, CoreAttention(plan), labels=tokens).backward()
        grads[chunk] = [p.grad for p in model.parameters()]
    for a, b in zip(grads[10**9], grads[97]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_linear_chunks_are_the_fewest_of_equal_size():
    """keep_attention's recompute chunks: the fewest of at most the chunk size, equal within a token, so that no
    remainder of a few tokens comes out (under compile such a remainder recompiled the parts on GPUs: the 66,118-token
    nano-batch's 582)."""
    for tokens in (1, 97, 8191, 8192, 8193, 66_118, 70_052, 131_072, 262_143):
        sizes = checkpointing.linear_chunks(tokens, 8192)
        assert sum(sizes) == tokens and max(sizes) <= 8192 and max(sizes) - min(sizes) <= 1, tokens
        assert len(sizes) == -(-tokens // 8192)
        if tokens > 8192:
            assert min(sizes) >= 4096, (tokens, sizes)  # (at least half a chunk)
    assert checkpointing.linear_chunks(66_118, 8192) == [7347] * 4 + [7346] * 5


def test_offload_leaves_parameters_and_small_tensors_alone():
    weight = torch.nn.Parameter(torch.randn(512, 512))
    small = torch.randn(16, requires_grad=True)
    big = torch.randn(1024, 512, requires_grad=True)
    ((small * 2).sum() + (big @ weight).sum()).backward()
    expected = weight.grad.clone()
    weight.grad = None
    offload = ActivationOffload("cpu")  # default min_bytes: 1 MiB
    with offload:
        loss = (small * 2).sum() + (big @ weight).sum()
    assert offload.offloaded_bytes == big.numel() * 4  # the matmul keeps big and the weight; only big moves
    loss.backward()
    assert torch.equal(weight.grad, expected)
    empty = torch.zeros(0, 8, requires_grad=True)
    with ActivationOffload("cpu", min_bytes=0) as offload:
        loss = torch.sin(empty).sum()  # sin keeps its (empty) input: left where it is
    loss.backward()
    assert offload.offloaded_bytes == 0 and empty.grad.shape == (0, 8)


def test_host_pieces_are_powers_of_two_between_floor_and_ceiling():
    """The pinned allocator rounds each block up to a power of two: a region's pieces are the ceiling as often
    as it fits, then powers of two (in bytes) down to the floor, largest first, and one piece below the floor
    holds the rest."""
    for numel in (1, 5, 1000, 12345, (1 << 20) + 3, 3 << 20):
        for element_size in (2, 4, 8):
            sizes = piece_sizes(numel, element_size, floor_bytes=1024, ceiling_bytes=1 << 16)
            assert sum(sizes) == numel
            whole = [s * element_size for s in sizes if s * element_size >= 1024]
            assert all(b & (b - 1) == 0 and b <= 1 << 16 for b in whole) and whole == sorted(whole, reverse=True)
            assert len(set(b for b in whole if b < 1 << 16)) == len([b for b in whole if b < 1 << 16])
            assert len(sizes) - len(whole) <= 1 and sum(sizes[len(whole):]) * element_size < 1024
    assert piece_sizes(0, 2) == []
    # 2.3 GiB of bf16 (a 300K-token layer input of Llama-3-8B): 18 pieces of 128 MiB, 32 MiB, 16 MiB and the rest
    # below the floor, not one 4 GiB block
    assert piece_sizes(int(2.3 * 2**30) // 2, 2)[:20] == [1 << 26] * 18 + [1 << 24, 1 << 23]


def test_pinned_ahead_are_the_ceiling_pieces_the_regions_will_ask_for(monkeypatch):
    """pin_host_ahead pins, per region, the 128 MiB pieces piece_sizes gives it, so that the first step's offloads
    find them cached; a region's smaller pieces (and a region below the ceiling) are left to the step, where
    pinned ahead they would sit unused. Without CUDA it pins nothing."""
    from attnpool.train import offload

    assert offload.pin_host_ahead(2 << 30, 32) == 0  # (no CUDA here)
    asked = []
    monkeypatch.setattr(offload.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(offload.torch, "empty", lambda n, dtype, pin_memory: asked.append((n, pin_memory)))
    layer_input = (2 << 30) + (40 << 20)  # 2 GiB and 40 MiB: 16 ceiling pieces, then 32 and 8 MiB ones
    assert offload.pin_host_ahead(layer_input, 3) == 3 * 16 * offload.PIECE_CEILING_BYTES
    ceiling = [b for b in piece_sizes(layer_input // 2, 2) if b * 2 == offload.PIECE_CEILING_BYTES]
    assert asked == [(offload.PIECE_CEILING_BYTES, True)] * 3 * len(ceiling) and len(ceiling) == 16
    assert offload.pin_host_ahead(offload.PIECE_CEILING_BYTES - 1, 32) == 0 and len(asked) == 48


def test_host_cache_stays_near_a_step_when_regions_change_size():
    """PyTorch's pinned cache serves a request only from blocks of its own power of two (ATen's
    CachingHostAllocator: free lists by log2 of the size). Over steps whose layer inputs change size (wlb: each
    rank's tokens differ every step), what the cache ends up holding, the most blocks of each size any step
    used, stays within a ceiling and a floor per region of the largest step's need; whole powers of two held about
    twice it."""
    def cached_and_needed(steps, **kw):
        most = {}  # power-of-two block size -> the most blocks of it in use at once
        needed = 0
        for tokens in steps:
            blocks = [1 << (n * 2 - 1).bit_length() for n in piece_sizes(tokens * 4096, 2, **kw)] * 32  # 32 layers
            needed = max(needed, sum(blocks))
            for size in set(blocks):
                most[size] = max(most.get(size, 0), blocks.count(size))
        return sum(size * count for size, count in most.items()), needed

    steps = [270_000, 250_000, 288_000, 241_000]  # a wlb rank's tokens at a 256K budget, cap 1.1
    cached, needed = cached_and_needed(steps)
    assert cached <= needed + 32 * ((128 << 20) + (16 << 20))
    assert cached_and_needed(steps[:2]) == (66 * 2**30 + 2**26, 66 * 2**30)  # the two steps the record counts
    cached_whole, needed_whole = cached_and_needed(steps, ceiling_bytes=1 << 40)
    assert cached_whole > 1.4 * needed_whole


def _offload_dtensors(rank, world):
    """A sharded activation, a replicated weight and an activation gathered asynchronously (tensor
    parallelism's DTensors; the gather's output an AsyncCollectiveTensor until waited for) saved through
    offload: the same gradients as without it, and the local shards moved."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    results = []
    for offload in (None, ActivationOffload("cpu", min_bytes=0)):
        xd = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        with offload or contextlib.nullcontext():
            gathered = xd.redistribute(mesh, [Replicate()], async_op=True)
            loss = torch.tanh(xd @ wd).sum() + torch.sin(gathered).sum()
        loss.backward()
        results.append((xd.grad.full_tensor(), wd.grad.full_tensor(), offload.offloaded_bytes if offload else 0))
    (gx, gw, _), (gx_off, gw_off, moved) = results
    return torch.equal(gx, gx_off) and torch.equal(gw, gw_off), moved


def test_offload_moves_dtensors_local_shards():
    for same, moved in run_distributed(_offload_dtensors, 2):
        assert same
        # x's shard (4 x 16), w (16 x 16), tanh's output shard (4 x 16) and x gathered (8 x 16), float32
        assert moved == (4 * 16 + 16 * 16 + 4 * 16 + 8 * 16) * 4


def test_loss_chunk_is_sized_by_bytes_of_logits():
    assert llama.loss_chunk_tokens(128256) == 2048
    assert llama.loss_chunk_tokens(32000) == 8192
    assert llama.loss_chunk_tokens(256) == 1 << 20
    assert llama.loss_chunk_tokens(10**9) == 256


# --- Training with offload --------------------------------------------------------------------------------


def _train_with_offloads(rank, world, out):
    from attnpool.train import train

    results = {}
    for name, overrides in (("plain", {}), ("activations", dict(activation_offload=True)),
                            ("optimizer", dict(optimizer_offload=True)),
                            ("both", dict(activation_offload=True, optimizer_offload=True,
                                          activation_checkpointing="keep_attention"))):
        # 1024 tokens of dim 256: a layer's input is 1 MiB, enough for offload to move it
        config = tiny_config(f"{out}/{name}", steps=3, tokens_per_rank=1024, model_args=dict(
            dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256), **overrides)
        result = train(config)
        results[name] = [(r["loss"], r["activation_offload_bytes"]) for r in result.rows]
    return results


def test_training_with_offload_gives_the_same_losses(tmp_path):
    results = run_distributed(_train_with_offloads, 2, str(tmp_path))[0]
    plain = [loss for loss, _ in results["plain"]]
    for name in ("activations", "optimizer", "both"):
        assert [loss for loss, _ in results[name]] == plain, name
    assert all(offloaded is None for _, offloaded in results["plain"])
    assert all(offloaded > 0 for _, offloaded in results["activations"] + results["both"])


def test_prefix_copies_are_counted_only_where_the_backend_makes_them(monkeypatch):
    """A server holding shards of one document that do not continue each other reads the unique rows, with one
    segment's keys more for the gradients a causal call per segment makes apart; where a document of its has more
    segments than a causal call per segment takes, under a backend that serves queries at given positions (fa4 on
    sm90, the reference) the unique rows, and under flash (and fa4 off sm90) a prefix copy per shard."""
    import attnpool.runtime.dispatch as dispatch
    from attnpool.kernels import serves_positions
    from attnpool.plan.documents import DocPiece, PieceTable

    monkeypatch.setattr(dispatch, "MIN_AVOIDED_KEYS_PER_CALL", 1024)
    from attnpool.plan.plan import make_plan

    assert serves_positions("reference", "cpu", 128)
    assert not any(serves_positions(name, "cpu", 128) for name in ("fa4", "flash", "auto", None))
    pieces = PieceTable.from_pieces([[DocPiece(0, 4096, 0, 4096)], []])
    start = np.arange(8) * 512
    plan = make_plan("test", pieces, np.zeros(8), start, start + 512, np.zeros(8), np.arange(8) % 2, 512)
    copies, unique = AttentionRows.of(plan), AttentionRows.of(plan, copies=False, causal_call_segments=4)
    assert copies.expanded_kv[0] == 512 * (1 + 3 + 5 + 7) and copies.unique_kv[0] == 3584
    # the unique rows, and three times the widest segment but one's keys (rank 0: 2560 of [512, 1536, 2560, 3584],
    # rank 1: 3072), whose gradients a causal call per segment makes apart and sums in float32; four segments are
    # one position call where the runtime makes causal calls of three at most
    assert np.array_equal(unique.expanded_kv, copies.unique_kv + 3 * np.array([2560, 3072]))
    assert np.array_equal(AttentionRows.of(plan, copies=False, causal_call_segments=3).expanded_kv, copies.unique_kv)
    # a backend without a position kernel copies where a position call would be made, and elsewhere where too few
    # copies are avoided (runtime.dispatch's thresholds): counted as the larger
    assert np.array_equal(AttentionRows.of(plan, copies=True, causal_call_segments=4).expanded_kv,
                          np.maximum(copies.expanded_kv, unique.expanded_kv))
    assert np.array_equal(AttentionRows.of(plan, copies=True, causal_call_segments=3).expanded_kv, copies.expanded_kv)
    # by document: beside a second document, each rank's most keys of a segment but its document's widest (rank 0:
    # document 0's 2560 over document 1's 2048 of [2048, 6144]; rank 1: document 1's 4096 of [4096, 8192])
    pieces = PieceTable.from_pieces([[DocPiece(0, 4096, 0, 4096), DocPiece(1, 8192, 0, 8192)], []])
    start = np.r_[np.arange(8) * 512, np.arange(4) * 2048]
    doc = np.r_[np.zeros(8), np.ones(4)]
    plan = make_plan("test", pieces, doc, start, start + np.r_[np.full(8, 512), np.full(4, 2048)], doc,
                     np.r_[np.arange(8) % 2, np.arange(4) % 2], 512)
    rows = AttentionRows.of(plan, copies=False, causal_call_segments=4)
    assert rows.expanded_kv[0] == rows.unique_kv[0] + 3 * 2560 and rows.expanded_kv[1] == rows.unique_kv[1] + 3 * 4096
    # where document 0's four segments take one position call, document 1's two count alone
    fewer = AttentionRows.of(plan, copies=False, causal_call_segments=3)
    assert np.array_equal(fewer.expanded_kv, rows.unique_kv + 3 * np.array([2048, 4096]))
    # and without a position kernel document 0's four segments make both ranks copy every prefix
    assert np.array_equal(AttentionRows.of(plan, copies=True, causal_call_segments=4).expanded_kv, rows.expanded_kv)
    assert np.array_equal(AttentionRows.of(plan, copies=True, causal_call_segments=3).expanded_kv,
                          [int(plan.kernel_segments(r)[2].sum()) for r in range(2)])
    # 4.5K rows avoided in 4 calls (a causal call per segment), over a quarter of the unique rows
    assert DispatchLayout.build(plan, 0, "cpu").documents is not None


def test_liger_gradients_of_earlier_micro_batches_are_held_where_their_backward_waits():
    """Liger's loss makes its gradients in the forward and keeps them until the backward: a last pipeline rank that
    runs every micro-batch's forward first (GPipe, pooled) holds the earlier ones' at the last one's loss; 1F1B's
    last rank, one micro-batch at a time, does not; nor does the chunked loss, which makes none in the forward."""
    m = model_config("llama3-8b", n_layers=16)
    x = MemoryInputs(m, 65536, "keep_attention", pp=4, microbatches=4, in_flight=4, rank_layers=5, stage_layers=5,
                     loss_kernel="liger")
    held = estimate(x).breakdown["earlier micro-batches' loss gradients"]
    assert held == 3 * 2 * (m.vocab_size + 65536) * m.dim
    one_at_a_time = estimate(replace(x, in_flight=1)).breakdown
    chunked = estimate(replace(x, loss_kernel="chunked")).breakdown
    assert "earlier micro-batches' loss gradients" not in one_at_a_time and \
        "earlier micro-batches' loss gradients" not in chunked
