"""Hugging Face checkpoints in attnpool's own model (``--model hf:DIR``, model_impl auto): every family it expresses,
read from its safetensors by each rank's shards, under every layout.

Tiny random checkpoints of each family, saved by transformers, float32 on CPU (gloo). The reference is transformers'
eager attention on each document alone; a layout (tp, pp, dp x tp) is compared with it directly, and training under
cad with local under the same layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnpool.errors import ConfigError  # noqa: E402
from attnpool.model.families import model_spec  # noqa: E402
from attnpool.model.hf import INDEX_FILE, hf_name, save_hf_checkpoint  # noqa: E402
from attnpool.parallel import build_rank_mesh  # noqa: E402
from attnpool.runtime import plan_layer_kinds  # noqa: E402
from attnpool.train import TrainConfig, train  # noqa: E402
from attnpool.train.runners import build_model, build_stages  # noqa: E402
from attnpool.train.spec import resolve_run_spec  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from layout_reference import linear_layout  # noqa: E402
from test_hf_models import (ARCHITECTURES, DOC_LENS, MAX_DOC_LEN, document_tokens, reference_logits,  # noqa: E402
                            save_model)

SHARDED = "llama"  # saved in several files with an index


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    directories = {}
    for arch in ARCHITECTURES:
        directory = save_model(root / arch, arch)
        if arch == SHARDED:
            model = transformers.AutoModelForCausalLM.from_pretrained(directory)
            for file in directory.glob("*.safetensors"):
                file.unlink()
            model.save_pretrained(directory, max_shard_size="20KB")
            assert (directory / INDEX_FILE).exists() and len(list(directory.glob("*.safetensors"))) > 2
        directories[arch] = str(directory)
    docs = document_tokens()
    return directories, {arch: reference_logits(d, docs) for arch, d in directories.items()}


def _layout_logits(rank, world, tp, pp, directories):
    """Each family's logits for this rank's rows of the packed documents under (dp, tp, pp), and the elements of
    the checkpoint's tensors this rank read against those it holds."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    read = []
    original = HuggingFaceStorageReader._process_read_request

    def counted(self, f, req, planner):
        read.append(math.prod(req.lengths))
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counted
    results = {}
    for arch, directory in directories.items():
        read.clear()
        dp = world // (tp * pp)
        cfg = TrainConfig(model=f"hf:{directory}", tp=tp, pp=pp, microbatches=pp, nproc=world, device="cpu",
                          attention="local", tokens_per_rank=sum(DOC_LENS) // dp, max_doc_len=MAX_DOC_LEN,
                          progress=False)
        spec = resolve_run_spec(cfg, world, torch.device("cpu"))
        mesh = build_rank_mesh(spec.dims, "cpu")
        pieces = linear_layout(DOC_LENS, dp)
        docs, starts = document_tokens(), np.r_[0, np.cumsum(DOC_LENS)]
        mine = pieces[mesh.dp_rank]
        tokens = torch.cat([docs[p.doc_id][p.start:p.end] for p in mine])
        positions = torch.cat([torch.arange(p.start, p.end) for p in mine])
        rows = torch.cat([torch.arange(starts[p.doc_id] + p.start, starts[p.doc_id] + p.end) for p in mine])
        attention = plan_layer_kinds(spec.layer_kinds, pieces, "local", mesh.attention_group, cost_model="pairs",
                                     min_shard_tokens=8)
        with torch.no_grad():
            if pp == 1:
                model = build_model(spec, mesh)
                out = model(tokens, positions, attention)
            else:
                stage_ids, (model,) = build_stages(spec, mesh)
                model.forward = model.forward.forward  # the stage's own forward, not the schedule's call of it
                peers = mesh.pp_peers()
                if stage_ids[0] == 0:
                    torch.distributed.send(model(tokens, positions, attention).contiguous(), peers[1])
                    out = None
                else:
                    hidden = torch.empty(len(tokens), spec.model.config.dim)
                    torch.distributed.recv(hidden, peers[0])
                    out = model(hidden, positions, attention)
        if out is not None and hasattr(out, "full_tensor"):
            out = out.full_tensor()
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.state_dict().values())
        results[arch] = (rows, out, sum(read), held)
    HuggingFaceStorageReader._process_read_request = original
    return results


@pytest.mark.parametrize("world, tp, pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 1)])
def test_every_family_loads_into_every_layout_as_transformers_computes(checkpoints, world, tp, pp):
    """Logits within 1e-5 of transformers' (each document alone) on one process, tp=2, pp=2 and dp=2 x tp=2 (FSDP2
    over dp), each rank having read exactly the elements of the shards it holds, no more: the sharded llama
    checkpoint too, and under pp the tied families' last stage its copy of the embedding."""
    directories, expected = checkpoints
    ranks = run_distributed(_layout_logits, world, tp, pp, directories)
    for arch in directories:
        for results in ranks:
            rows, logits, read, held = results[arch]
            assert read == held, f"{arch}: read {read} elements for {held} held"
            if logits is None:
                continue  # an earlier pipeline stage
            want = expected[arch][rows]
            err = (logits - want).abs().max().item() / want.abs().max().item()
            assert err <= 1e-5, f"{arch} (dp x tp x pp = {world // (tp * pp)} x {tp} x {pp}): relative error {err:.3g}"


# --- Training ------------------------------------------------------------------------------------------------------


def _train_layouts(rank, world, out, directories):
    # Every family under tp and pp (Qwen2: biases, tied; Gemma: (1 + w) norms, GeGLU, scaled embedding, tied; Gemma 2:
    # sandwich norms, query scale); Qwen3 and Gemma 3 below also with ping-pong, keep_attention and compile
    plain = {(arch, layout): dict(tp=2) if layout == "tp" else dict(pp=2, microbatches=2)
             for arch in ARCHITECTURES if arch not in ("qwen3", "gemma3_text") for layout in ("tp", "pp")}
    runs = {
        **plain,
        # q/k norms (Qwen3): tp and pp, with ping-pong and keep_attention under tp
        ("qwen3", "tp"): dict(tp=2, pingpong=True, activation_checkpointing="keep_attention"),
        ("qwen3", "pp"): dict(pp=2, microbatches=2),
        # Gemma 3: sandwich and (1 + w) norms, GeGLU, scaled embedding, RoPE per kind of layer
        ("gemma3_text", "tp"): dict(tp=2, pingpong=True, activation_checkpointing="keep_attention"),
        ("gemma3_text", "pp"): dict(pp=2, microbatches=2),  # tied: the last stage's copy of the embedding
        ("gemma3_text", "dp"): dict(compile=True),
    }
    losses = {}
    for (arch, layout), overrides in runs.items():
        for strategy in ("local", "cad"):
            if strategy == "local":
                overrides = {k: v for k, v in overrides.items() if k != "pingpong"}
            # the export test reads one run's checkpoint and export; the others need neither
            kept = (arch, layout, strategy) == ("gemma3_text", "tp", "cad")
            config = TrainConfig(model=f"hf:{directories[arch]}", data="synthetic", data_args=dict(dist="pretrain"),
                                 tokens_per_rank=192 if layout != "tp" else 384, max_doc_len=MAX_DOC_LEN, steps=3, lr=3e-3,
                                 warmup_steps=1, cost_model="pairs", min_shard=16, device="cpu", progress=False,
                                 attention=strategy, nproc=world, out=f"{out}/{arch}-{layout}-{strategy}",
                                 checkpoint_every=0 if kept else -1, hf_export=kept, **overrides)
            losses[arch, layout, strategy] = train(config).losses
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory, checkpoints):
    directories, _ = checkpoints
    root = tmp_path_factory.mktemp("train")
    return root, run_distributed(_train_layouts, 2, str(root), directories)[0]


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def test_cad_trains_a_checkpoint_as_local_does_under_tp_and_pp(trained):
    _, losses = trained
    for (arch, layout, strategy), values in losses.items():
        assert len(values) == 3 and all(math.isfinite(x) for x in values), (arch, layout, strategy)
        if strategy == "cad":
            err = rel_diff(values, losses[arch, layout, "local"])
            assert err <= 1e-4, f"{arch} under {layout}: cad {values} against local {losses[arch, layout, 'local']}"


def test_export_of_a_trained_checkpoint_loads_in_transformers(trained, checkpoints):
    """The run's OUT/hf: the checkpoint's own config.json back, tensors under its names, the tied output projection
    still tied; transformers computes from it what the trained model computes."""
    root, _ = trained
    directories, _ = checkpoints
    export = root / "gemma3_text-tp-cad" / "hf"
    original = json.loads((Path(directories["gemma3_text"]) / "config.json").read_text())
    written = json.loads((export / "config.json").read_text())
    for key in ("architectures", "model_type", "layer_types", "rope_parameters", "query_pre_attn_scalar",
                "tie_word_embeddings", "sliding_window"):
        assert written.get(key) == original.get(key), key
    exported = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    assert exported.config.tie_word_embeddings

    from attnpool.train.export import read_checkpoint_model

    model, spec, _, _, _ = read_checkpoint_model(run_dir=str(root / "gemma3_text-tp-cad"))
    docs = document_tokens()
    attention = plan_layer_kinds(spec.config.layer_kinds(), linear_layout(DOC_LENS, 1), "local", cost_model="pairs")
    with torch.no_grad():
        got = model.eval()(torch.cat(docs), torch.cat([torch.arange(n) for n in DOC_LENS]), attention)
        want = torch.cat([exported(input_ids=doc[None]).logits[0] for doc in docs])
        before = reference_logits(directories["gemma3_text"], docs)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert (want - before).abs().max().item() > 1e-3 * before.abs().max().item()  # trained weights, not the start

    # attnpool export: what OUT/hf holds, in the dtype config.json names (float32 here), and says so
    from attnpool.train.export import export_hf

    export_hf(run_dir=str(root / "gemma3_text-tp-cad"), out=str(root / "exported"))
    assert json.loads((root / "exported" / "config.json").read_text())["dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(root / "exported", attn_implementation="eager").eval()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_sharded_export_writes_an_index_transformers_reads(checkpoints, tmp_path):
    directories, _ = checkpoints
    spec = model_spec(f"hf:{directories['qwen3']}")
    model = spec.build("cpu")
    spec.materialize(model, torch.device("cpu"), seed=0)
    save_hf_checkpoint(model, spec.config, tmp_path, hf_config=spec.hf_config, max_shard_bytes=16 * 1024)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert set(index["weight_map"]) == {hf_name(name, spec.config) for name in model.state_dict()}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(directories["qwen3"], attn_implementation="eager")
    for name, tensor in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_checkpoint_that_does_not_match_its_config_is_refused_by_tensor(checkpoints, tmp_path):
    directories, _ = checkpoints
    config = json.loads((Path(directories["qwen3"]) / "config.json").read_text())
    for file in Path(directories["qwen3"]).iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    with pytest.raises(ConfigError) as err:
        model_spec(f"hf:{tmp_path}")
    assert err.value.field.startswith("model.layers.0.self_attn.") and "expected shape" in str(err.value)
    # fewer layers than the checkpoint has: the rest are left unread
    spec = model_spec(f"hf:{directories['qwen3']}", {"num_hidden_layers": 1})
    assert spec.config.n_layers == 1


def test_model_impl_picks_the_model(checkpoints):
    directories, _ = checkpoints
    assert type(model_spec(f"hf:{directories['qwen3']}")).__name__ == "HFCheckpointSpec"
    assert type(model_spec(f"hf:{directories['qwen3']}", impl="transformers")).__name__ == "HFAdapterSpec"


def test_a_checkpoint_fed_documents_past_its_trained_context_is_told_so_at_start(checkpoints):
    """A checkpoint's weights know positions up to its max_position_embeddings: where documents may pass it (data's
    max_doc_len, or without one a whole step), the run's start says so and names both ways out; not where they fit,
    and not for random weights (a preset)."""
    from attnpool.train.spec import context_note

    directories, _ = checkpoints

    def note(model, **settings):
        cfg = TrainConfig(model=model, nproc=2, device="cpu", attention="local", tokens_per_rank=80, progress=False,
                          **settings)
        spec = resolve_run_spec(cfg, 2, torch.device("cpu"))
        return context_note(cfg, spec.model, spec.dims.dp)

    for impl in ("attnpool", "transformers"):  # (both the own model's spec and transformers' adapter)
        llama = dict(model_impl=impl, model_args={"max_position_embeddings": 64})
        line = note(f"hf:{directories['llama']}", max_doc_len=128, **llama)
        assert "up to 128 tokens (data.max_doc_len) pass its max_position_embeddings 64" in line, line
        assert "max_position_embeddings=128" in line and "--max-doc-len 64" in line
        assert note(f"hf:{directories['llama']}", max_doc_len=64, **llama) is None
        assert "up to 160 tokens (no data.max_doc_len" in note(f"hf:{directories['llama']}", **llama)
    assert note("tiny", max_doc_len=128, model_args={"max_position": 64}) is None
