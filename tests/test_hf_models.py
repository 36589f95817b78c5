"""Bring your own model and data: Hugging Face causal LMs under attnpool's core attention, HF datasets, loggers.

Tiny random models of every supported architecture, made with transformers' config classes and saved to
temporary directories, float32 on CPU. The references are transformers' own attention (eager) on each
document alone, and attnpool's `local` strategy for training.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnpool.errors import ConfigError  # noqa: E402
from attnpool.model.hf_causal_lm import build_hf_model, load_hf_spec  # noqa: E402
from attnpool.model.hf_config import hf_model_problem  # noqa: E402
from attnpool.plan import plan_attention  # noqa: E402
from attnpool.runtime import CoreAttention, plan_layer_kinds  # noqa: E402
from attnpool.train import TrainConfig, train  # noqa: E402
from command import run_command  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from layout_reference import linear_layout  # noqa: E402
from test_train import SPARSE  # noqa: E402

VOCAB = 97
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, dtype="float32")
# Windows shorter than the documents (several windows long): the sliding layers' windows cut (attnpool.kinds).
WINDOW = 16
MAX_DOC_LEN = 128
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW)),  # every layer windowed
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1)),  # the first layer full, the second windowed
    "qwen3": (transformers.Qwen3Config, dict()),  # q/k norms
    "gemma": (transformers.GemmaConfig, dict()),  # scaled embedding, (1 + w) norms, GeLU MLP
    # soft-capped attention (50) and output (30) logits, alternating windowed and full layers
    "gemma2": (transformers.Gemma2Config, dict(query_pre_attn_scalar=16, sliding_window=WINDOW)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(query_pre_attn_scalar=16, sliding_window=WINDOW,
                                                        layer_types=["sliding_attention", "full_attention"])),
}
DOC_LENS = [40, 13, 70, 5, 32]  # 160 tokens: 40 per rank on 4 ranks, documents split between ranks


def randomize_(model, seed=0):
    """Weights large enough that attention is far from uniform (transformers' init leaves it nearly flat)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if p.mean() > 0.5 else
                        0.2 * torch.randn(p.shape, generator=gen))  # Gemma's norms hold w of (1 + w)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def save_model(directory: Path, arch: str, randomize: bool = True, **extra) -> Path:
    config_class, options = ARCHITECTURES[arch]
    config = config_class(**{**SHAPE, **options, **extra})
    if randomize:
        randomize_(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(directory)
    else:
        config.save_pretrained(directory)  # no weights: attnpool initialises from the config
    return directory


def document_tokens(seed=1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in DOC_LENS]


def reference_logits(directory: Path, docs: list[torch.Tensor]) -> torch.Tensor:
    """transformers' own attention (eager), each document alone from position 0, concatenated."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(input_ids=doc[None]).logits[0] for doc in docs])


def _logits_under_core_attention(rank, world, directories, strategy):
    """Each architecture's logits for this rank's tokens of the packed documents, and the rows they are."""
    pieces = linear_layout(DOC_LENS, world)
    docs, starts = document_tokens(), np.r_[0, np.cumsum(DOC_LENS)]
    mine = pieces[rank]
    tokens = torch.cat([docs[p.doc_id][p.start:p.end] for p in mine])
    positions = torch.cat([torch.arange(p.start, p.end) for p in mine])
    rows = torch.cat([torch.arange(starts[p.doc_id] + p.start, starts[p.doc_id] + p.end) for p in mine])
    results, autocast = {}, {}
    for arch, directory in directories.items():
        spec = load_hf_spec(directory)
        model = build_hf_model(spec).eval()
        attention = plan_layer_kinds(spec.config.layer_kinds(), pieces, strategy, cost_model="pairs",
                                     min_shard_tokens=8)
        with torch.no_grad():
            results[arch] = model(tokens, positions, attention)
            # bf16 autocast over float32 weights, as a GPU run without FSDP's bf16 parameters: RoPE's and q/k
            # norms' float32 factors must not leave q, k and v in different dtypes.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast[arch] = model(tokens, positions, attention).float()
    return rows, results, autocast


@pytest.fixture(scope="module")
def saved_architectures(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    directories = {arch: str(save_model(root / arch, arch)) for arch in ARCHITECTURES}
    docs = document_tokens()
    return directories, {arch: reference_logits(d, docs) for arch, d in directories.items()}


@pytest.mark.parametrize("world, strategy", [(1, "local"), (4, "cad")])
def test_logits_equal_transformers_own_attention(saved_architectures, world, strategy):
    directories, expected = saved_architectures
    for rows, logits, autocast in run_distributed(_logits_under_core_attention, world, directories, strategy):
        for arch, got in logits.items():
            want = expected[arch][rows]
            err = (got - want).abs().max().item() / want.abs().max().item()
            assert err <= 1e-5, f"{arch} on {world} ranks ({strategy}): relative error {err:.3g}"
            err = (autocast[arch] - want).abs().max().item() / want.abs().max().item()
            assert err <= 0.1, f"{arch} under bf16 autocast: relative error {err:.3g}"  # bf16's rounding


def test_problems_name_architecture_and_feature():
    bidirectional = transformers.Gemma3TextConfig(**SHAPE, use_bidirectional_attention=True)
    assert "non-causal" in hf_model_problem(bidirectional)
    assert "attention_dropout=0.1" in hf_model_problem(transformers.LlamaConfig(**SHAPE, attention_dropout=0.1))
    assert "GPT2" in hf_model_problem(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4))
    assert hf_model_problem(transformers.Qwen3Config(**SHAPE)) is None
    # windows and soft-caps are attention kinds now, not problems
    assert hf_model_problem(transformers.Gemma2Config(**SHAPE)) is None
    assert hf_model_problem(transformers.MistralConfig(**SHAPE, sliding_window=64)) is None


def test_layer_kinds_are_read_from_the_config():
    from attnpool.model.hf_causal_lm import planning_config

    kinds = planning_config(transformers.Gemma2Config(**SHAPE, sliding_window=WINDOW)).layer_kinds()
    assert [k.describe() for k in kinds] == ["window 16, soft-cap 50", "causal, soft-cap 50"]
    assert planning_config(transformers.Gemma2Config(**SHAPE)).final_softcap == 30.0
    mistral = planning_config(transformers.MistralConfig(**SHAPE, sliding_window=WINDOW)).layer_kinds()
    assert [k.window for k in mistral] == [WINDOW, WINDOW]
    assert all(k.causal for k in planning_config(transformers.MistralConfig(**SHAPE, sliding_window=None)).layer_kinds())
    gemma3 = transformers.Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 6}, sliding_window=WINDOW)
    assert [k.window for k in planning_config(gemma3).layer_kinds()] == [WINDOW] * 5 + [None]


def test_a_windowed_layer_refuses_a_causal_core_attention(saved_architectures):
    directories, _ = saved_architectures
    model = build_hf_model(load_hf_spec(directories["mistral"])).eval()
    plan = plan_attention(linear_layout(DOC_LENS, 1), "local", cost_model="pairs")
    with pytest.raises(ConfigError, match="layer 0 needs it, but the core attention it was given computes causal"):
        model(torch.cat(document_tokens()), torch.cat([torch.arange(n) for n in DOC_LENS]), CoreAttention(plan))


# --- Training: strategies agree, checkpointing and resume, the export ----------------------------


def hf_train_config(out, model_dir, **overrides) -> TrainConfig:
    # transformers' modules behind the adapter (attnpool's own model: tests/test_hf_checkpoints.py)
    values = dict(model=f"hf:{model_dir}", model_impl="transformers", data="synthetic", data_args=dict(dist="pretrain"),
                  tokens_per_rank=192, steps=4, lr=3e-3, warmup_steps=1, cost_model="pairs", min_shard=16, device="cpu",
                  progress=False, out=str(out))
    values.update(overrides)
    return TrainConfig(**values)


def _train_hf(rank, world, out, model_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    runs = {"local": {}, "wlb": {}, "percp": {},
            "cad": dict(checkpoint_every=1, keep_checkpoints=2, hf_export_checkpoints=True),
            # (and core attention in two groups of heads: the model's heads split inside core attention)
            "cad-full-recompute": dict(activation_checkpointing="full", head_chunks=2),
            "cad-stopped": dict(stop_at=2), "local-sparse": SPARSE, "cad-sparse": SPARSE,
            "cad-rope": dict(model_args=dict(rope_theta=1e6))}
    losses = {}
    for name, overrides in runs.items():
        strategy = name.split("-")[0]
        result = train(hf_train_config(Path(out) / name, model_dir, attention=strategy, **overrides))
        losses[name] = result.losses
        if name == "cad-sparse":
            losses["density"] = [r["attention_density"] for r in result.rows]
        if name == "cad":
            weights = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True))
    losses["cad-resumed"] = train(hf_train_config(Path(out) / "cad-stopped", model_dir, attention="cad",
                                                  resume=True)).losses
    return losses, weights


@pytest.fixture(scope="module")
def hf_training(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-train")
    model_dir = save_model(root / "model", "qwen3", randomize=False, tie_word_embeddings=True)
    losses, weights = run_distributed(_train_hf, 2, str(root), str(model_dir))[0]
    return root, model_dir, losses, weights


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def test_cad_trains_an_hf_model_as_local_does(hf_training):
    _, _, losses, _ = hf_training
    assert len(losses["local"]) == 4 and all(math.isfinite(x) for x in losses["local"])
    for strategy in ("wlb", "percp", "cad"):
        assert rel_diff(losses[strategy], losses["local"]) <= 1e-4, strategy
    assert rel_diff(losses["cad-full-recompute"], losses["cad"]) <= 1e-6  # (in two groups of heads)
    assert losses["cad-resumed"] == losses["cad"]  # stopped after step 2, resumed from its checkpoint: exact
    # Vertical-slash sparse attention runs in the model's layers too (the attention function passes the layer).
    assert rel_diff(losses["cad-sparse"], losses["local-sparse"]) <= 1e-4
    assert any(0.0 < d < 1.0 for d in losses["density"]), losses["density"]


def test_model_args_change_an_hf_models_config(tmp_path, hf_training):
    """--model-args for an hf: model: settings of its config.json, changed as transformers reads them (RoPE's base
    and scaling, what context extension changes, live in rope_parameters). The model computes what transformers
    computes with the config changed by hand, a run trains with it and exports it; what the checkpoint's weights
    fix, or what the config lacks, is refused by name."""
    directory = str(save_model(tmp_path / "llama", "llama"))
    args = {"rope_theta": 500000.0, "max_position_embeddings": "4K", "num_hidden_layers": 1}  # (a size, as written)
    spec = load_hf_spec(directory, model_args=args)
    assert spec.hf_config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}
    assert spec.hf_config.max_position_embeddings == 4096 and spec.config.n_layers == 1
    scaled = load_hf_spec(directory, model_args={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert scaled.hf_config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}

    config = transformers.AutoConfig.from_pretrained(directory)
    config.rope_parameters, config.num_hidden_layers = {"rope_theta": 500000.0, "rope_type": "default"}, 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, config=config, attn_implementation="eager")
    docs = document_tokens()
    with torch.no_grad():
        want = torch.cat([reference.eval()(input_ids=doc[None]).logits[0] for doc in docs])
        plan = plan_attention(linear_layout(DOC_LENS, 1), "local", cost_model="pairs")
        got = build_hf_model(spec).eval()(torch.cat(docs), torch.cat([torch.arange(n) for n in DOC_LENS]),
                                          CoreAttention(plan))
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    unchanged = reference_logits(directory, docs)
    assert (want - unchanged).abs().max().item() > 1e-3 * unchanged.abs().max().item()  # the arguments took effect

    root, _, losses, _ = hf_training  # a run with rope_theta=1e6: another training, written back in its export
    assert rel_diff(losses["cad-rope"], losses["cad"]) > 1e-4
    exported = json.loads((root / "cad-rope" / "hf" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_theta"] == 1e6

    for bad, field in ((dict(hidden_size=64), "model_args.hidden_size"), (dict(num_hidden_layers=3), "model_args."
                       "num_hidden_layers"), (dict(n_layers=2), "model_args.n_layers"),
                       (dict(rope_scaling=2.0), "model_args.rope_scaling"),
                       (dict(rope_scaling={"rope_type": "yarn"}), "model_args"),  # yarn needs its factor
                       (dict(max_position_embeddings="4Q"), "model_args.max_position_embeddings")):
        with pytest.raises(ConfigError) as err:
            load_hf_spec(directory, model_args=bad)
        assert err.value.field == field, bad
    gemma3 = str(save_model(tmp_path / "gemma3", "gemma3_text", randomize=False))
    with pytest.raises(ConfigError, match="per layer type") as err:  # local and global layers: RoPE of their own
        load_hf_spec(gemma3, model_args={"rope_theta": 1e6})
    assert err.value.field == "model_args.rope_theta"


def test_export_loads_in_transformers_with_the_trained_weights(hf_training):
    root, model_dir, _, weights = hf_training
    export = root / "cad" / "hf"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    config = transformers.AutoConfig.from_pretrained(model_dir, attn_implementation="eager")
    trained = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    trained.load_state_dict({k.removeprefix("hf."): v for k, v in weights.items()})
    torch.manual_seed(0)  # the run's seed: the weights it started from
    start = build_hf_model(load_hf_spec(str(model_dir))).hf.eval()
    start.config._attn_implementation = "eager"
    tokens = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want, before = (m(input_ids=tokens).logits for m in (exported, trained, start))
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert (want - before).abs().max().item() > 1e-3  # the export holds trained weights, not the initial ones

    # hf_export_checkpoints: an export beside each checkpoint, as many as keep_checkpoints, the last one the end's.
    exports = root / "cad" / "hf-exports"
    assert sorted(p.name for p in exports.iterdir()) == ["step-000003", "step-000004"]
    for step in ("step-000003", "step-000004"):
        model = transformers.AutoModelForCausalLM.from_pretrained(exports / step, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        assert torch.equal(logits, got) == (step == "step-000004"), step

    from attnpool.train.export import export_hf  # attnpool export: the run's checkpoint, in one process

    export_hf(run_dir=str(root / "cad"), out=str(root / "exported"), dtype="fp32")
    again = transformers.AutoModelForCausalLM.from_pretrained(root / "exported", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens).logits, got)


# --- Data and loggers through the command line ---------------------------------------------------


TEXTS = ["the quick brown fox jumps over the lazy dog " * 6, "a stitch in time saves nine " * 9,
         "pack my box with five dozen liquor jugs " * 4, "", "how vexingly quick daft zebras jump " * 12] * 4


def save_tokenizer(directory: Path, vocab_size: int = 60) -> Path:
    """A small word-piece BPE tokenizer trained on TEXTS, saved as transformers reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """datasets' own Arrow cache (of the json and parquet files read here) in a temporary directory, for this
    process where datasets is not imported yet, and for the command lines started."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets-cache")))
        yield


def cli(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "attnpool.cli.main", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    with open(root / "docs.jsonl", "w") as fh:
        for text in TEXTS:
            fh.write(json.dumps({"body": text, "id": len(text)}) + "\n")
    save_tokenizer(root / "tokenizer")
    return root


def test_jsonl_dataset_trains_with_tensorboard(data_dir, tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("tensorboard")
    model_dir = save_model(tmp_path / "model", "llama", randomize=False)
    out = tmp_path / "run"
    p = cli("--model", f"hf:{model_dir}", "--data", f"hf:{data_dir / 'docs.jsonl'}", "--tokenizer",
            str(data_dir / "tokenizer"), "--data-args", "text_field=body", f"cache_dir={tmp_path / 'cache'}",
            "--logger", "tensorboard", "--tokens-per-rank", "96", "--steps", "3", "--cost-model", "pairs",
            "--device", "cpu", "--no-progress", "--out", str(out))
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # tokenised once, by the launcher; the rank read it

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for tag in ("loss", "imbalance_after", "comm_bytes", "peak_memory_bytes", "tokens_per_s"):
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3], tag
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    # The export carries the tokenizer it was trained with.
    assert transformers.AutoTokenizer.from_pretrained(out / "hf")("a stitch")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(data_dir / "tokenizer")("a stitch")["input_ids"]


@pytest.mark.parametrize("kind, streaming", [("parquet", False), ("parquet", True), ("saved", False)])
def test_dataset_documents_are_the_tokenizers_ids(data_dir, tmp_path, kind, streaming):
    datasets = pytest.importorskip("datasets")
    from attnpool.data import make_source

    if kind == "parquet":
        path = tmp_path / "docs.parquet"
        datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(path)
    else:  # a directory save_to_disk wrote
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(path)
    source = make_source("hf", name=str(path), tokenizer=str(data_dir / "tokenizer"), streaming=streaming,
                         cache_dir=str(tmp_path / "cache"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(data_dir / "tokenizer")
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS if t]
    assert [source[i].tolist() for i in range(len(source))] == expected
    assert source.lengths().tolist() == [len(ids) for ids in expected]
    again = make_source("hf", name=str(path), tokenizer=str(data_dir / "tokenizer"), streaming=streaming,
                        cache_dir=str(tmp_path / "cache"))
    assert isinstance(again.tokens, np.memmap)  # read from the cache the first one wrote, not tokenised again
    assert [again[i].tolist() for i in range(len(again))] == expected
    limited = make_source("hf", name=str(path), tokenizer=str(data_dir / "tokenizer"),
                          streaming=streaming, documents=4, cache_dir=str(tmp_path / "cache"))
    assert len(limited) == 3  # the first 4 records, one of them empty


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from attnpool.train.metrics import open_logger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = open_logger("wandb", str(tmp_path), {"model": "hf:x"})
    for step in (1, 2):
        logger.log({"step": step, "loss": 1.0 / step, "attention_time_s": None, "skipped_step": False})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


# --- Bad input: one line, exit code 2 ------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, data_dir):
    pytest.importorskip("datasets")
    tmp = tmp_path_factory.mktemp("bad-hf")
    (tmp / "no-config").mkdir()
    llama = save_model(tmp / "llama", "llama", randomize=False)
    small = save_model(tmp / "small-vocab", "llama", randomize=False, vocab_size=32)
    gpt2 = tmp / "gpt2"
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4).save_pretrained(gpt2)
    dropout = tmp / "dropout"
    transformers.LlamaConfig(**SHAPE, attention_dropout=0.1).save_pretrained(dropout)
    data = ["--data", f"hf:{data_dir / 'docs.jsonl'}", "--tokenizer", str(data_dir / "tokenizer")]
    # weights that cannot be read: never trained from random weights in their place
    bin_only = save_model(tmp / "bin-only", "llama", randomize=False)
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    missing_shard = save_model(tmp / "missing-shard", "llama", randomize=False)
    (missing_shard / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    corrupt = save_model(tmp / "corrupt", "llama", randomize=False)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    synthetic = ["--data", "synthetic"]
    cases = {
        "weights not as safetensors": (["--model", f"hf:{bin_only}", *synthetic], "holds weights as pytorch_model.bin"),
        "a shard missing": (["--model", f"hf:{missing_shard}", *synthetic],
                            "lists model-00001-of-00002.safetensors, which is not there"),
        "damaged safetensors": (["--model", f"hf:{corrupt}", *synthetic], "does not read as safetensors"),
        "damaged safetensors, transformers' modules": (["--model", f"hf:{corrupt}", "--model-impl", "transformers",
                                                        *synthetic], "does not read as safetensors"),
        "no config.json": (["--model", f"hf:{tmp / 'no-config'}"], "has no config.json"),
        "unsupported architecture": (["--model", f"hf:{gpt2}"], "model_type 'gpt2'"),
        "unsupported feature": (["--model", f"hf:{dropout}"], "attention_dropout=0.1"),
        "missing text field": (["--model", f"hf:{llama}", *data, "--data-args", "text_field=content",
                                f"cache_dir={tmp / 'cache'}"], "text_field='content'"),
        "tokenizer vocab": (["--model", f"hf:{small}", *data], "tokenizer="),
        "no tokenizer": (["--data", f"hf:{data_dir / 'docs.jsonl'}"], "tokenizer=None"),
        "bytes for a tokenizer's model": (["--model", f"hf:{llama}", "--data", "stdlib"], "data='stdlib': is text as "
                                                                                         "bytes"),
    }
    common = ["--device", "cpu", "--steps", "1", "--no-progress"]
    results = {}
    for name, (args, needle) in cases.items():  # refused before any worker: in this process (tests/command.py)
        done = run_command("train", *args, *common, "--out", str(tmp / "out"))
        results[name] = (done.returncode, done.stderr, needle)
    return results


@pytest.mark.parametrize("case", ["no config.json", "unsupported architecture", "unsupported feature",
                                  "missing text field", "tokenizer vocab", "no tokenizer",
                                  "bytes for a tokenizer's model", "weights not as safetensors", "a shard missing",
                                  "damaged safetensors", "damaged safetensors, transformers' modules"])
def test_bad_input_exits_2_with_one_line(bad_runs, case):
    code, stderr, needle = bad_runs[case]
    assert code == 2, stderr
    assert needle in stderr, stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.parametrize("case", ["malformed jsonl", "malformed jsonl, streamed", "empty text file", "missing file",
                                  "hub unreachable"])
def test_unreadable_datasets_are_refused_naming_the_data(data_dir, tmp_path, capfd, monkeypatch, case):
    """A file datasets cannot read, or none to read, in one ConfigError (one line, exit 2 from the CLI) and nothing
    else printed: not Arrow's or datasets' tracebacks, not half a minute of retries against an unreachable Hub."""
    pytest.importorskip("datasets")
    from attnpool.data.hf_dataset import HFDatasetSource

    (tmp_path / "bad.jsonl").write_text('{"body": "the cat"}\n{"body": oops}\n')
    (tmp_path / "empty.txt").write_text("")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (what a machine without a network answers, at once)
    name, said = {"malformed jsonl": (tmp_path / "bad.jsonl", "datasets cannot read it (ArrowInvalid: JSON parse"),
                  "malformed jsonl, streamed": (tmp_path / "bad.jsonl", "datasets cannot load it (ArrowInvalid"),
                  "empty text file": (tmp_path / "empty.txt", "holds no records"),
                  "missing file": ("corpus.jsonl", "no such file or directory"),
                  "hub unreachable": ("someone/corpus", "the Hugging Face Hub (huggingface.co) cannot be reached"),
                  }[case]
    with pytest.raises(ConfigError, match=re.escape(said)) as refused:
        HFDatasetSource(str(name), str(data_dir / "tokenizer"), text_field="body", streaming="streamed" in case,
                        cache_dir=str(tmp_path / "cache"))
    assert refused.value.field == "data" and refused.value.value == f"hf:{name}"
    out, err = capfd.readouterr()
    assert not err.strip() and not out.strip(), err


def test_hf_export_checkpoints_needs_an_hf_model():
    with pytest.raises(ConfigError, match="hf_export_checkpoints"):
        TrainConfig(model="tiny", hf_export_checkpoints=True)


def test_hf_model_refuses_what_it_cannot_run():
    """transformers' modules (model_impl: transformers) run one layer whole: what splits or rearranges attnpool's
    own layers is refused by name before anything is read; attnpool's own model runs them."""
    with pytest.raises(ConfigError, match="tp=2"):
        TrainConfig(model="hf:somewhere", tp=2, nproc=2, model_impl="transformers")
    with pytest.raises(ConfigError, match="keep_attention"):
        TrainConfig(model="hf:somewhere", activation_checkpointing="keep_attention", model_impl="transformers")
    TrainConfig(model="hf:somewhere", tp=2, nproc=2, activation_checkpointing="keep_attention")
    with pytest.raises(ConfigError, match="model_impl"):
        TrainConfig(model="tiny", model_impl="transformers")
    with pytest.raises(ConfigError, match="logger='mlflow'"):
        TrainConfig(logger="mlflow")


def test_weights_in_other_formats_are_told_from_a_trainers_files(tmp_path):
    """pytorch_model.bin (or a shard of it, Meta's consolidated.00.pth, a .gguf) alone: weights attnpool does not
    read, refused; a trainer's training_args.bin, optimizer.pt and rng_state.pth beside a config.json alone are not
    weights (random initialisation, as with the config alone); safetensors or their index: weights."""
    from attnpool.errors import ConfigError
    from attnpool.model.hf_config import has_safetensors

    for name in ("pytorch_model-00001-of-00002.bin", "consolidated.00.pth", "model.gguf"):
        directory = tmp_path / name
        directory.mkdir()
        (directory / name).write_bytes(b"")
        with pytest.raises(ConfigError, match=f"holds weights as {name}"):
            has_safetensors(str(directory))
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    for name in ("training_args.bin", "optimizer.pt", "rng_state.pth", "config.json"):
        (trainer / name).write_bytes(b"")
    assert not has_safetensors(str(trainer))
    (trainer / "model.safetensors.index.json").write_text("{}")
    assert has_safetensors(str(trainer))
