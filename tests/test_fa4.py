"""The fa4 backend on CPU (issue 23): its selection, its calls into flash_attn.cute with a stand-in module, the
attention_backend config key, cost tables per backend, and bench/gpu_fa4.py's script. The kernel itself is
checked on a GPU by bench/gpu_fa4.py."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch

from attnpool.errors import ConfigError
from attnpool.kernels import (BACKENDS, attention, auto_backend_name, backend_problem, fa4, get_backend, reference,
                              resolve_backend_name)
from attnpool.runtime.dispatch import SegmentRows, backward_in_parts, segment_groups
from attnpool.plan.cost import TableCost, backend_table, default_cost_model, load_cost_model
from attnpool.train.config import TrainConfig, load_config, save_config
from attnpool.train.sections import ATTENTION_BACKENDS
from attnpool.train.spec import attention_backend
from test_kernels import MIXED_SEGMENTS, make_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA0 = torch.device("cuda", 0)  # only named: nothing here runs on it


class StandInInterface:
    """flash_attn.cute.interface as fa4 calls it, computed by the reference backend: the keyword names and
    the values of flash-attn-4 4.0.0b36's flash_attn_varlen_func and _flash_attn_bwd that fa4 passes."""

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None,
                               mask_mod=None, block_sparse_tensors=None, aux_tensors=None, aux_scalars=None,
                               return_lse=False):
        self.calls.append(("forward", dict(causal=causal, return_lse=return_lse, max_q=max_seqlen_q,
                                           max_k=max_seqlen_k, scale=softmax_scale)))
        assert causal and return_lse and isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        return reference.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                        num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                        dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                        V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                        score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                        block_sparse_tensors=None, dlse=None, learnable_sink=None):
        self.calls.append(("backward", dict(causal=causal, scale=softmax_scale, into=dq is not None,
                                            deterministic=deterministic)))
        assert causal and lse.dtype == torch.float32 and lse.is_contiguous() and dout.dtype == q.dtype
        assert lse.shape == (q.shape[1], q.shape[0])
        grads = reference.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   softmax_scale)
        if dq is None:
            return grads
        for given, like, grad in zip((dq, dk, dv), (q, k, v), grads):  # as the kernel: checked, then written
            assert given.shape == like.shape and given.dtype == like.dtype and given.device == like.device
            given.copy_(grad)
        return dq, dk, dv


@pytest.fixture
def stand_in(monkeypatch):
    """fa4 importable, its kernels computed by the reference, on a GPU of compute capability 9.0."""
    interface = StandInInterface()
    monkeypatch.setattr(fa4, "_interface", lambda: (interface, None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return interface


# --- selection ---

def test_backend_names_agree_with_the_config_key():
    assert BACKENDS == ("reference", "flash", "fa4")
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}


def test_auto_is_the_reference_on_cpu():
    assert auto_backend_name("cpu") == "reference"
    assert get_backend("auto", "cpu") is reference.BACKEND
    assert get_backend(None, "cpu", torch.bfloat16) is reference.BACKEND


def test_fa4_on_cpu_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as err:
        resolve_backend_name("fa4", "cpu", field="attention_backend")
    assert err.value.field == "attention_backend" and err.value.value == "fa4"
    assert "CUDA" in str(err.value)
    with pytest.raises(ConfigError, match="fa4"):
        get_backend("fa4", "cpu")


def test_fa4_problems_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    imported = []
    monkeypatch.setattr(fa4, "_interface", lambda: imported.append(1) or (object(), None))
    assert "sm90" in backend_problem("fa4", CUDA0) and "8.0" in backend_problem("fa4", CUDA0)
    assert not imported  # a pre-Hopper GPU imports nothing
    assert auto_backend_name(CUDA0, torch.bfloat16) == "flash"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "_interface", lambda: (None, "ModuleNotFoundError: No module named 'flash_attn'"))
    why = backend_problem("fa4", CUDA0)
    assert "not importable" in why and "attnpool[hopper]" in why
    assert auto_backend_name(CUDA0, torch.bfloat16) == "flash"
    with pytest.raises(ConfigError, match="not importable"):
        resolve_backend_name("fa4", CUDA0, field="attention_backend")


def test_auto_picks_fa4_where_it_runs(stand_in):
    assert auto_backend_name(CUDA0, torch.bfloat16) == "fa4"
    assert auto_backend_name(CUDA0) == "fa4"
    assert auto_backend_name(CUDA0, torch.float32) == "reference"  # the GPU kernels take fp16/bf16 only
    assert get_backend("fa4", CUDA0) is fa4.BACKEND


def test_the_import_failure_is_kept():
    fa4._interface.cache_clear()
    try:
        interface, why = fa4._interface()
        if importlib.util.find_spec("flash_attn") is None:
            assert interface is None and "flash_attn" in why
    finally:
        fa4._interface.cache_clear()


# --- the calls into flash_attn.cute ---

@pytest.mark.parametrize("n_q,n_kv", [(4, 2), (4, 1), (2, 2)])
def test_fa4_forward_and_backward_through_the_interface(stand_in, n_q, n_kv):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, n_q, n_kv, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=0.3)
    want_out, want_lse = reference.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=0.3)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # dout in float32 and lse not contiguous: fa4 hands the kernel dout in q's dtype and a contiguous lse.
    grads = fa4.backward(dout.float(), q, k, v, out, lse.t().contiguous().t(), cu_q, cu_k, max_q, max_k, scale=0.3)
    want = reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=0.3)
    for got, expected in zip(grads, want):
        assert torch.equal(got, expected)
    assert [c[0] for c in stand_in.calls] == ["forward", "backward"]
    assert all(c[1]["scale"] == 0.3 for c in stand_in.calls)


def test_fa4_backward_writes_into_given_tensors(stand_in):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, 4, 2, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    into = tuple(torch.full_like(x, float("nan")) for x in (q, k, v))
    grads = fa4.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, into=into)
    assert all(got is given for got, given in zip(grads, into)) and stand_in.calls[-1][1]["into"]
    for got, expected in zip(grads, reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)):
        assert torch.equal(got, expected)
    empty = tuple(x[:0] for x in (q, k, v))
    assert all(t.numel() == 0 for t in fa4.backward(dout[:0], *empty, out[:0], lse[:, :0], cu_q[:1], cu_k[:1], 0, 0,
                                                    into=tuple(torch.empty_like(x) for x in empty)))
    with pytest.raises(ValueError, match="into"):
        fa4.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, into=(into[0], into[1], into[2][1:]))


def test_deterministic_algorithms_ask_fa4_for_its_deterministic_backward(stand_in):
    """Under torch's deterministic algorithms (the run's ``deterministic``) FA4's backward runs in a fixed order,
    and the position kernel (whose block tables carry no write order) gives way to copies."""
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, 4, 2, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    assert fa4.supports_positions(CUDA0, 128)
    fa4.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
    try:
        torch.use_deterministic_algorithms(True)
        assert not fa4.supports_positions(CUDA0, 128)
        fa4.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [c[1]["deterministic"] for c in stand_in.calls if c[0] == "backward"] == [False, True]


def test_deterministic_fa4_is_refused_where_it_has_no_deterministic_backward(stand_in, monkeypatch):
    config = TrainConfig(model="tiny", attention_backend="fa4", deterministic=True, device="cuda")
    assert attention_backend(config, CUDA0) == "fa4"  # sm90 (the stand-in's)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "an sm120 GPU")
    with pytest.raises(ConfigError, match="deterministic=True: FlashAttention-4 has no deterministic backward on "
                                          "compute capability 12.0 .*; use attention_backend flash"):
        attention_backend(config, CUDA0)
    assert attention_backend(config.replace(deterministic=False), CUDA0) == "fa4"
    assert attention_backend(config.replace(attention_backend="auto"), CUDA0) == "flash"  # auto takes what can


@pytest.mark.parametrize("consecutive", [True, False])
def test_a_split_backward_lands_every_part_in_its_rows(stand_in, consecutive):
    """backward_in_parts over fa4: consecutive groups of segments (the backward's key groups) are written into
    the call's gradients by the kernel; other subsets (sparse and dense segments) are copied there. Either way
    the gradients are one call's, and no row is left as allocated."""
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, 4, 2, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    q_len, k_len = np.diff(cu_q.numpy()), np.diff(cu_k.numpy())
    segs = np.arange(len(k_len))
    if consecutive:
        keeps = [(segs >= a) & (segs < b) for a, b in segment_groups(k_len, 24)]
        assert len(keeps) >= 3
    else:
        keeps = [segs % 2 == 0, segs % 2 == 1]
    parts = [(SegmentRows.of(q_len, k_len, keep, "cpu"), fa4.BACKEND) for keep in keeps]
    stand_in.calls.clear()
    grads = backward_in_parts(parts, dout, q, k, v, out, lse, None)
    assert [c[1]["into"] for c in stand_in.calls if c[0] == "backward"] == [consecutive] * len(keeps)
    for got, expected in zip(grads, reference.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)):
        assert torch.equal(got, expected)


def test_fa4_empty_calls_never_reach_the_kernel(stand_in):
    q, k, v, dout, cu_q, cu_k, _, _ = make_inputs([(0, 0)], 4, 2, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, 0, 0)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0) and lse.dtype == torch.float32
    q, k, v, dout, cu_q, cu_k, _, _ = make_inputs([(3, 0)], 4, 2, 16, torch.bfloat16)
    out, lse = fa4.forward(q, k, v, cu_q, cu_k, 3, 0)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert all(g.abs().sum() == 0 for g in fa4.backward(dout, q, k, v, out, lse, cu_q, cu_k, 3, 0))
    assert stand_in.calls == []


def test_fa4_refuses_float32_and_a_missing_package(stand_in, monkeypatch):
    q, k, v, _, cu_q, cu_k, max_q, max_k = make_inputs([(2, 3)], 2, 1, 16, torch.float32)
    with pytest.raises(ConfigError, match="fa4 backend takes float16 or bfloat16"):
        fa4.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    monkeypatch.setattr(fa4, "_interface", lambda: (None, "ModuleNotFoundError: flash_attn"))
    with pytest.raises(ImportError, match="attnpool\\[hopper\\]"):
        fa4.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, max_q, max_k)


def test_fa4_in_the_autograd_wrapper(stand_in):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_inputs(MIXED_SEGMENTS, 4, 2, 16, torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention(*leaves, cu_q, cu_k, max_q, max_k, backend=fa4.BACKEND)
    grads = torch.autograd.grad(out, leaves, dout)
    want = reference.backward(dout, q, k, v, *reference.forward(q, k, v, cu_q, cu_k, max_q, max_k),
                              cu_q, cu_k, max_q, max_k)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))


# --- the config key ---

def test_attention_backend_key_and_its_old_name(tmp_path):
    assert TrainConfig().attention.backend == "auto"
    with pytest.raises(ConfigError) as err:
        TrainConfig(attention_backend="fa5")
    assert err.value.field == "attention_backend" and err.value.value == "fa5"
    old = tmp_path / "config.yaml"  # a run directory's config.yaml from before the rename
    old.write_text("kernel: null\nsteps: 3\n")
    assert load_config(old).attention.backend == "auto"
    old.write_text("kernel: flash\n")
    assert load_config(old).attention.backend == "flash"
    assert load_config(old, {"attention_backend": "fa4"}).attention.backend == "fa4"  # the flag wins
    assert load_config(None, {"kernel": "reference"}).attention.backend == "reference"
    old.write_text("kernel: flash\nattention_backend: fa4\n")
    with pytest.raises(ConfigError, match="old name of attention_backend"):
        load_config(old)
    save_config(TrainConfig(attention_backend="fa4"), tmp_path / "new.yaml")
    assert not any(line.startswith("kernel:") for line in (tmp_path / "new.yaml").read_text().splitlines())
    assert load_config(tmp_path / "new.yaml").attention.backend == "fa4"


def test_attention_backend_of_a_run():
    assert attention_backend(TrainConfig(device="cpu")) == "reference"
    for name in ("fa4", "flash"):
        with pytest.raises(ConfigError) as err:  # what every rank raises, through agree(), before any other collective
            attention_backend(TrainConfig(device="cpu", attention_backend=name), torch.device("cpu"))
        assert err.value.field == "attention_backend" and err.value.value == name
        assert f"the {name} backend cannot run here" in str(err.value)
    with pytest.raises(ConfigError, match="float32"):
        attention_backend(TrainConfig(attention_backend="fa4", precision="fp32"), CUDA0)


def test_attention_backend_on_a_gpu(stand_in):
    assert attention_backend(TrainConfig(), CUDA0) == "fa4"
    assert attention_backend(TrainConfig(attention_backend="flash"), CUDA0) == "flash"
    assert attention_backend(TrainConfig(precision="fp32"), CUDA0) == "reference"


def test_prepare_refuses_fa4_on_cpu():
    """prepare() runs in the launcher and on every rank (through agree) before any other collective."""
    from attnpool.train.setup import prepare

    with pytest.raises(ConfigError) as err:
        prepare(load_config(ROOT / "configs/demo-cpu.yaml", {"attention_backend": "fa4", "device": "cpu"}), 4)
    assert err.value.field == "attention_backend" and "CUDA" in str(err.value)


# --- cost tables per backend ---

def test_cost_tables_are_keyed_by_backend():
    flash = default_cost_model()
    assert flash.backend == "flash" and "flash" in flash.source
    # The packaged file holds fa4's measured table too: faster than flash's on a long prefix.
    packaged = default_cost_model(backend="fa4")
    assert packaged.backend == "fa4" and "fa4" in packaged.source
    long_shard = (np.array([0.0]), np.array([65536.0]))
    assert packaged.cost(*long_shard)[0] < 0.7 * flash.cost(*long_shard)[0]
    # A file without one: flash's table stands in, and says so.
    obj = json.loads(json.dumps(flash.to_json()))
    stand_in = TableCost.from_json(obj, backend="fa4")
    assert stand_in.backend == "flash" and "standing in for fa4" in stand_in.source
    assert (stand_in.tflops == flash.tflops).all()
    # A file with an fa4 table: fa4 runs use it, flash runs keep the top-level one.
    obj["backends"] = {"fa4": {**flash.to_json(), "tflops": (flash.tflops * 2).tolist(), "source": "fa4 table"}}
    fa4_table = TableCost.from_json(obj, backend="fa4")
    assert fa4_table.backend == "fa4" and fa4_table.source == "fa4 table"
    assert (fa4_table.tflops == 2 * flash.tflops).all()
    assert TableCost.from_json(obj).backend == "flash"
    assert TableCost.from_json(obj, backend="reference").backend == "flash"
    only_fa4 = {"backends": obj["backends"]}
    with pytest.raises(ConfigError, match="no kernel table for the flash backend"):
        backend_table(only_fa4, "flash")
    path = pathlib.Path(__file__).parent / "__fa4_table.json"
    try:
        path.write_text(json.dumps(obj))
        assert load_cost_model(str(path), backend="fa4").backend == "fa4"
    finally:
        path.unlink()


def test_profile_writes_flash_at_the_top_and_others_under_backends():
    from attnpool.bench.profile import ProfileOptions, assemble
    from attnpool.sim.costs import load_sim_costs
    from attnpool.model.config import model_config

    base = json.loads((ROOT / "src/attnpool/resources/cost_h200.json").read_text())
    fa4_attention = {key: base[key] for key in ("q_grid", "k_grid", "attention")}
    fa4_attention["tables"] = {p: {"tflops": [[2 * x for x in row] for row in t["tflops"]]}
                               for p, t in base["tables"].items()}
    obj = assemble({"fa4": fa4_attention}, ProfileOptions(), device={"name": "FakeGPU"}, base=base)
    assert obj["tables"] == base["tables"] and obj["source"] == base["source"]  # flash's, kept where it was
    assert obj["backends"]["fa4"]["source"] == "attnpool profile: fa4 varlen, bf16, on FakeGPU"
    cfg = model_config("llama3-8b")
    flash_costs = load_sim_costs(cfg, "llama3-8b", obj)
    fa4_costs = load_sim_costs(cfg, "llama3-8b", obj, attention_backend="fa4")
    assert fa4_costs.attn_fwd_bwd.backend == "fa4" and "fa4" in fa4_costs.sources["attention"]
    assert float(fa4_costs.attn_fwd_bwd.cost(0, 4096)) == pytest.approx(float(flash_costs.attn_fwd_bwd.cost(0, 4096)) / 2)
    packaged = load_sim_costs(cfg, "llama3-8b", attention_backend="fa4")  # fa4's measured H200 table
    assert packaged.attn_fwd_bwd.backend == "fa4" and "fa4 varlen" in packaged.sources["attention"]
    base.pop("backends", None)  # a file with flash's table alone: it stands in, and says so
    assert "standing in for fa4" in load_sim_costs(cfg, "llama3-8b", base, attention_backend="fa4").sources["attention"]


# --- bench/gpu_fa4.py ---

def test_gpu_fa4_script_on_cpu(tmp_path, capsys, monkeypatch):
    import attnpool.runtime.dispatch as dispatch

    # a 512-token document avoids few copies: served without them all the same, as 64K ones are on the GPU
    monkeypatch.setattr(dispatch, "MIN_AVOIDED_KEYS_PER_CALL", 0)
    monkeypatch.setattr(dispatch, "MIN_AVOIDED_FRACTION", 0)
    spec = importlib.util.spec_from_file_location("gpu_fa4", ROOT / "bench/gpu_fa4.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main(["--device", "cpu", "--out", str(tmp_path), "--doc-len", "512", "--shard", "128",
                        "--reps", "1", "--site", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((tmp_path / "gpu_fa4.json").read_text())
    assert result["stand_in"] and len(result["exactness"]) == 7
    assert all(case["passed"] for case in result["exactness"])
    assert any(case["keyless_rows"] for case in result["exactness"])
    assert sum(case["name"].startswith("positions_") for case in result["exactness"]) == 3
    rows = result["benchmark"]
    steps = ("all", "odd", "every 4th", "first and last 8", "first and last quarter")
    assert {(r["backend"], r["path"]) for r in rows} == {
        (b, p) for b in ("fa4", "flash") for p in ("prefix copies", "one call", *(f"server step: {s}" for s in steps))
    } | {("fa4 copies", f"server step: {s}") for s in steps} | {
        ("fa4 position call", f"server step: {s}") for s in ("odd", "first and last quarter")}  # two segments each
    assert all("error" not in r and r["fwd_bwd_ms"] > 0 for r in rows)
    assert all(r["shards"] == 4 for r in rows if not r["path"].startswith("server step"))
    assert "fwd_bwd_speedup_over_flash" in rows[0]
    step = {(r["backend"], r["path"]): r for r in rows}
    # the plan makes every shard one task, one causal segment; shards that do not continue each other (the odd
    # two of four) are a causal call each, under flash too, or one document call when made to (the stand-in for
    # fa4 serves positions), and copies on the copies path
    assert step["fa4", "server step: all"]["calls"] == step["flash", "server step: all"]["calls"] == "one causal segment"
    assert step["fa4", "server step: odd"]["calls"] == step["flash", "server step: odd"]["calls"] == "2 causal calls"
    assert step["fa4 position call", "server step: odd"]["calls"] == "1 document call"
    assert step["fa4 copies", "server step: odd"]["calls"] == "2 segments, prefix copies"
    for backend in ("fa4", "fa4 position call"):
        assert max(step[backend, "server step: odd"]["grads_vs_flash"].values()) < 1e-5
        assert max(step[backend, "server step: odd"]["grads_vs_copies"].values()) < 1e-5
    assert printed.strip().splitlines()[-1].startswith("ALL EXACTNESS CHECKS PASS")


def _resolve_per_rank(rank, world):
    from attnpool.train.spec import same_attention_backend

    try:
        same_attention_backend("fa4" if rank == 0 else "flash", "auto")
    except ConfigError as error:
        return str(error)
    return None


def test_ranks_that_resolve_different_kernels_are_refused_on_every_rank():
    from dist_harness import run_distributed

    messages = run_distributed(_resolve_per_rank, 2)
    assert messages[0] == messages[1] and "rank 0: fa4, rank 1: flash" in messages[0]
