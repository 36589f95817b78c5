"""Training loop on gloo: strategies agree, resume is exact, the loss is layout-independent, bad input exits 2.

Tiny models (dim 32, 2 layers) on the standard-library corpus, a few hundred
tokens per rank, float32 on CPU. Each distributed test starts one group of
processes and runs several trainings in it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import background
import numpy as np
import pytest
import torch
import torch.distributed as dist

from attnpool.data import DocumentStream, stdlib_corpus
from attnpool.errors import ConfigError, TrainingError
from attnpool.model import model_config
from attnpool.runtime import core_attention
from attnpool.train import TrainConfig, load_config, train
from attnpool.train.config import save_config
from attnpool.comm import agree
from attnpool.console import START_TIME_ENV
from attnpool.train.optim import lr_factor
from attnpool.train.planning import plan_batch
from attnpool.train.runners import build_model, forward_backward
from attnpool.train.spec import check_sparse, resolve_run_spec
from command import run_command
from dist_harness import run_distributed

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
METRIC_KEYS = ("step", "loss", "lr", "tokens_per_s", "step_time_s", "plan_time_s", "attention_time_s", "comm_time_s",
               "comm_bytes", "peak_memory_bytes", "imbalance_before", "imbalance_after")


def tiny_config(out, **overrides) -> TrainConfig:
    values = dict(model="tiny", model_args=dict(TINY), data="stdlib", tokens_per_rank=256, steps=10, lr=3e-3,
                  warmup_steps=2, cost_model="pairs", min_shard=16, device="cpu", progress=False, out=str(out))
    values.update(overrides)
    return TrainConfig(**values)


def full_weights(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def refused_config(rank, world, overrides):
    """On each rank: the (field, message) a training with ``overrides`` is refused with, or None."""
    try:
        train(tiny_config("unused", **overrides))
    except ConfigError as exc:
        return exc.field, str(exc)
    return None


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


# --- Strategies compute the same training ------------------------------------------------------


def _train_each_strategy(rank, world, out):
    results = {}
    os.environ[START_TIME_ENV] = repr(time.time() - 3600)  # as if the command had started an hour ago
    for strategy in ("local", "percp", "cad"):
        result = train(tiny_config(Path(out) / strategy, attention=strategy))
        results[strategy] = (result.rows, full_weights(result.model), result.summary)
    return results


def test_strategies_give_the_same_training(tmp_path):
    results = run_distributed(_train_each_strategy, 2, str(tmp_path))[0]
    ref_rows, ref_weights, ref_summary = results["local"]
    assert len(ref_rows) == 10
    # The first run's wall time counts from the command's start; the later runs in the process from their own
    assert ref_summary["wall_s"] > 3600 > max(results[s][2]["wall_s"] for s in ("percp", "cad"))
    for strategy in ("percp", "cad"):
        rows, weights, _ = results[strategy]
        assert rel_diff([r["loss"] for r in rows], [r["loss"] for r in ref_rows]) <= 1e-4, strategy
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-3, atol=1e-4, msg=f"{strategy}: {name}")
    cad = results["cad"][0]
    # cad really moved work: every step's batch is a document over both ranks, balanced by sending shards.
    assert all(r["comm_bytes"] > 0 for r in cad)
    assert np.mean([r["imbalance_before"] for r in cad]) > 1.2
    assert max(r["imbalance_after"] for r in cad) < 1.05
    assert ref_rows[0]["loss"] > ref_rows[-1]["loss"] + 0.5  # it learns


def _train_with_a_compiling_position_kernel(rank, world, out):
    """The keys of each document the position kernel served, in call order, per strategy, with the reference's
    kernel marked as compiling on its first call (as fa4's is)."""
    import dataclasses
    from attnpool.kernels import reference

    original = reference.BACKEND
    kernel, seen = original.positions, []

    def forward(q, k, v, handle, **kinds):
        seen.append(handle.num_keys)
        return kernel.forward(q, k, v, handle, **kinds)

    reference.BACKEND = dataclasses.replace(original, positions=dataclasses.replace(
        kernel, forward=forward, compiles_on_first_call=True))
    try:
        results = {}
        for strategy in ("cad", "percp", "ulysses", "local"):
            seen.clear()
            train(tiny_config(Path(out) / strategy, attention=strategy, steps=2))
            results[strategy] = list(seen)
        return results
    finally:
        reference.BACKEND = original


def test_a_compiling_position_kernel_is_compiled_before_the_first_step(tmp_path):
    """fa4's position kernel compiles on its first call, seconds that would land in a step (percp's measured
    single-document step on GPUs): a run that may serve a document in several shards (cad) calls it once first,
    on a small document; percp, whose head and tail shards run as causal calls, and Ulysses and `local`, which
    never serve a document so, do not."""
    from attnpool.kernels.base import COMPILE_KEYS

    for results in run_distributed(_train_with_a_compiling_position_kernel, 2, str(tmp_path)):
        assert results["cad"][0] == COMPILE_KEYS and results["cad"].count(COMPILE_KEYS) == 1
        assert not results["percp"] and not results["ulysses"] and not results["local"]


def _train_with_and_without_pingpong(rank, world, out):
    results = {}
    # (4 groups: finer than TINY's 2 KV heads, two groups of query heads reading each)
    for pingpong, head_chunks in ((False, 1), (True, 1), (False, 2), (True, 2), (False, 4)):
        # Documents of at most 96 tokens, so every step has several to split into nano-batches. Both overlaps
        # together under full checkpointing, whose recompute runs the interleaved layer's exchanges again.
        both = pingpong and head_chunks > 1
        config = tiny_config(Path(out) / f"pingpong-{pingpong}-{head_chunks}", attention="cad", max_doc_len=96,
                             steps=6, pingpong=pingpong, head_chunks=head_chunks,
                             activation_checkpointing="full" if both else "none")
        result = train(config)
        results[pingpong, head_chunks] = (result.rows, full_weights(result.model))
    return results


def test_pingpong_and_head_chunks_train_the_same(tmp_path):
    """Two nano-batches interleaved, core attention in two groups of heads (or four, finer than the KV heads), and
    both (with full checkpointing): one batch's losses and weights."""
    results = run_distributed(_train_with_and_without_pingpong, 2, str(tmp_path))[0]
    plain_rows, plain_w = results[False, 1]
    for (pingpong, head_chunks), (rows, weights) in results.items():
        if pingpong:
            assert all(r["attention_time_s"] is None for r in rows)  # two interleaved nano-batches every step
        assert all(r["nano_batches"] == [2 if pingpong else 1] for r in rows)
        same_groups = zip(rows, results[pingpong, 1][0])
        if pingpong and head_chunks > 1:  # (full checkpointing: the recompute's exchanges are counted too)
            assert all(r["comm_bytes"] > p["comm_bytes"] for r, p in same_groups)
        else:  # the same bytes in more, smaller exchanges
            assert all(r["comm_bytes"] == p["comm_bytes"] for r, p in same_groups)
        assert rel_diff([r["loss"] for r in rows], [r["loss"] for r in plain_rows]) <= 1e-5, (pingpong, head_chunks)
        for name, w in plain_w.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=(pingpong, head_chunks, name))
    assert all(r["comm_bytes"] > 0 for r in results[True, 1][0])


def test_head_chunks_are_refused_where_they_cannot_apply_or_split(tmp_path):
    for overrides, message in (
            (dict(attention="ulysses", head_chunks=2), "not with ulysses"),
            (dict(head_chunks=2, **SPARSE), "not with sparse attention"),
            (dict(head_chunks=0), "must be at least 1")):
        with pytest.raises(ConfigError, match="head_chunks") as raised:
            tiny_config(tmp_path, **overrides)
        assert message in str(raised.value), (overrides, raised.value)
    # TINY's 2 KV heads and 4 query heads: 3 groups can neither split the KV heads nor share them, found on every
    # rank when the model is known
    for field, message in run_distributed(refused_config, 2, dict(head_chunks=3)):
        assert field == "head_chunks" and "must divide the 2 KV heads a rank holds" in message, message


# --- Sparse attention trains the same under every strategy -------------------------------------

SPARSE = dict(sparse="vertical-slash", sparse_coverage=0.8, sparse_min_doc_len=128,
              sparse_args=dict(block=16, vertical_chunk=16, last_queries=16, sink_tokens=4, local_window=16,
                               vertical_cap=32, slash_cap=24))


def _train_sparse(rank, world, out):
    results = {}
    for strategy in ("local", "wlb", "percp", "cad", "cad+pingpong", "percp/read", "cad+pingpong/read"):
        name, _, transfer = strategy.partition("/")
        options = dict(SPARSE, sparse_args=dict(SPARSE["sparse_args"], kv_transfer=transfer or "prefix"))
        config = tiny_config(Path(out) / strategy.replace("/", "-"), attention=name.split("+")[0],
                             pingpong="+" in name, steps=4, **options)
        result = train(config)
        results[strategy] = (result.rows, full_weights(result.model))
    dense_first = train(tiny_config(Path(out) / "dense-first", attention="cad", steps=4, dense_layers=1, **SPARSE))
    cut = dict(attention="cad", steps=4, **SPARSE)
    train(tiny_config(Path(out) / "cut", stop_at=2, **cut))
    resumed = train(tiny_config(Path(out) / "cut", resume=True, **cut))
    # planned in seconds (the shipped table) with price_from_kernels: the tiles' prices follow the kernels' seconds,
    # fitted from each step after the first two (counted here)
    from attnpool.sparse.cost import SparsePrior
    fitted, fit = [], SparsePrior.update_kernel_scale
    SparsePrior.update_kernel_scale = lambda prior, kernel_s, *args, **kw: (fitted.append(len(kernel_s)),
                                                                            fit(prior, kernel_s, *args, **kw))
    try:
        fitting = dict(SPARSE, sparse_args=dict(SPARSE["sparse_args"], price_from_kernels=True))
        seconds = train(tiny_config(Path(out) / "seconds", attention="cad", steps=6, cost_model="table", **fitting))
    finally:
        SparsePrior.update_kernel_scale = fit
    return results, dense_first.rows, resumed.rows, (seconds.rows, fitted)


def test_sparse_training_is_the_same_under_every_strategy(tmp_path):
    results, dense_first, resumed, seconds = run_distributed(_train_sparse, 2, str(tmp_path))[0]
    ref_rows, ref_weights = results["local"]
    for strategy in ("wlb", "percp", "cad", "cad+pingpong", "percp/read", "cad+pingpong/read"):
        rows, weights = results[strategy]
        assert rel_diff([r["loss"] for r in rows], [r["loss"] for r in ref_rows]) <= 1e-4, strategy
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-3, atol=1e-4, msg=f"{strategy}: {name}")
    # kv_transfer="read" withheld KV and fetched it (at this tiny size nearly every row is read:
    # the byte saving is tested on a sparse document in test_sparse_runtime).
    assert sum(r["comm_bytes"] for r in results["percp/read"][0]) != sum(r["comm_bytes"] for r in results["percp"][0])
    densities = [r["attention_density"] for r in ref_rows]
    assert all(0.0 < d < 1.0 for d in densities), densities  # the documents over 128 tokens really are sparse
    assert all(d is not None for d in (r["attention_density"] for r in dense_first))
    # Every rank's served sparse work is recorded, in pairs and priced as planned, and their spreads are the
    # measured max/means.
    for r in results["cad"][0]:
        pairs, work, kernel_s = (np.array(r[f"sparse_served_{kind}"]) for kind in ("pairs", "work", "kernel_s"))
        assert len(pairs) == len(work) == len(kernel_s) == 2
        assert (pairs > 0).all() and (work > 0).all() and (kernel_s > 0).all()
        # these runs plan in pairs (cost_model "pairs"), one head's: so is the work they were priced in
        np.testing.assert_allclose(work, pairs / TINY["n_heads"], rtol=1e-9)
        assert r["sparse_imbalance_measured"] == pytest.approx(work.max() / work.mean())
        assert r["sparse_imbalance_measured_pairs"] == pytest.approx(pairs.max() / pairs.mean())
        assert r["sparse_imbalance_measured_kernel"] == pytest.approx(kernel_s.max() / kernel_s.mean())
        assert r["sparse_kernel_price_scale"] is None  # plans in pairs: no seconds to fit the tiles' prices to
    # Planned in seconds, the kernels' seconds are fitted from the third step on, every rank's; the plans use the
    # calibration's tile prices until two steps are fitted (step 5's plan), then the fit (on the CPU, to the twin's
    # seconds: anything within the bounds); every plan computes the same.
    seconds, fitted = seconds
    assert fitted == [2] * 4, fitted
    scales = [r["sparse_kernel_price_scale"] for r in seconds]
    assert scales[:4] == [1.0] * 4 and all(0.25 <= x <= 4.0 for x in scales), scales
    assert rel_diff([r["loss"] for r in seconds[:4]], [r["loss"] for r in ref_rows]) <= 1e-4
    # Resuming restores the planning prior too: the steps after the cut are planned as without it.
    cad = results["cad"][0]
    assert [r["attention_work_total"] for r in resumed[2:]] == [r["attention_work_total"] for r in cad[2:]]
    assert rel_diff([r["loss"] for r in resumed[2:]], [r["loss"] for r in cad[2:]]) <= 1e-5


# --- Resume continues exactly ------------------------------------------------------------------


def _train_and_resume(rank, world, out):
    full = train(tiny_config(Path(out) / "full"))
    first = train(tiny_config(Path(out) / "cut", stop_at=4))
    resumed = train(tiny_config(Path(out) / "cut", resume=True))
    return full.losses, first.losses, resumed.losses, full_weights(full.model), full_weights(resumed.model)


def test_resume_equals_uninterrupted_run(tmp_path):
    full, first, resumed, w_full, w_resumed = run_distributed(_train_and_resume, 2, str(tmp_path))[0]
    assert len(first) == 4 and first == full[:4]
    assert len(resumed) == 10  # rows 1..4 from the metrics file, 5..10 run after the resume
    assert resumed[4:] == full[4:]  # bit for bit
    for name, w in w_full.items():
        assert torch.equal(w_resumed[name], w), name
    rows = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["step-000004", "step-000010"]


# --- The loss does not depend on how tokens are spread -----------------------------------------


def _loss_and_grads(rank, world, strategies, global_tokens):
    """Per strategy: the loss and full gradients at the initial weights on each of the first two batches."""
    out = {}
    for strategy in strategies:
        attention, _, layout = strategy.partition("/")
        cfg = tiny_config("unused", attention=attention, layout=layout or "linear", tokens_per_rank=global_tokens // world)
        spec = resolve_run_spec(cfg, world, torch.device("cpu"))
        model = build_model(spec)
        stream = DocumentStream(stdlib_corpus(), world, cfg.data.tokens_per_rank, cfg.data.seed)
        steps = []
        for _ in range(2):
            batch = stream.next_batch()
            step = plan_batch(batch, spec)
            tensors = batch.rank_batch(step.plan.pieces, rank).to_torch()
            loss_sum = forward_backward(model, [tensors], [functools.partial(core_attention, plan=step.plan)],
                                        batch.num_label_tokens)
            dist.all_reduce(loss_sum)
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            steps.append((float(loss_sum) / batch.num_label_tokens, grads,
                          np.bincount(step.plan.pieces.rank, minlength=world).tolist(), step.imbalance_planned,
                          step.plan.pieces.tokens_per_rank.tolist(), step.plan.pieces.doc.tolist(),
                          step.imbalance_local))
        out[strategy] = steps
    return out


def _agree_when_one_rank_fails(rank, world):
    def build():
        if rank == 1:
            raise ConfigError("data_path", "/only/on/rank/1", "no such file or directory")
        return "ok"

    def read_checkpoint():  # (a storage error on one rank: a TrainingError, its restartable kept)
        if rank == 1:
            raise TrainingError("step-000004/manifest.json did not read: a storage error", restartable=True)
        return "ok"
    said = []
    for check, error in ((build, ConfigError), (read_checkpoint, TrainingError)):
        try:
            agree(check)
        except error as exc:
            said.append((str(exc), getattr(exc, "restartable", None)))
    return said


def test_loss_and_gradients_do_not_depend_on_layout():
    global_tokens = 512
    single = run_distributed(_loss_and_grads, 1, ("local",), global_tokens)[0]["local"]
    double = run_distributed(_loss_and_grads, 2, ("local", "wlb", "cad", "local/balanced", "cad/balanced"),
                             global_tokens)[0]
    for strategy, steps in double.items():
        for (loss, grads, *_), (ref_loss, ref_grads, *_) in zip(steps, single):
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss, strategy
            for name, g in ref_grads.items():
                # A wrong normalisation (FSDP's average over ranks) would be off by 2x here.
                torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=f"{strategy}: {name}")
    # wlb really re-packed: its ranks hold different numbers of pieces or tokens than linear's split.
    assert any(s[2] != d[2] for s, d in zip(double["wlb"], double["local"])) or \
        any(s[3] != d[3] for s, d in zip(double["wlb"], double["local"]))
    # the balanced layout kept linear's tokens per rank, and really placed documents elsewhere; "before" is still
    # what the linear layout would have served at home
    assert all(s[4] == d[4] and s[6] == d[6] for s, d in zip(double["local/balanced"], double["local"]))
    assert any(s[5] != d[5] for s, d in zip(double["local/balanced"], double["local"]))


def test_a_problem_on_one_rank_is_raised_on_every_rank():
    said = run_distributed(_agree_when_one_rank_fails, 2)
    assert said[0] == said[1] and len(said[0]) == 2
    (config_error, _), (training_error, restartable) = said[0]
    assert "no such file" in config_error and "on rank 1" in config_error
    assert "a storage error" in training_error and "on rank 1" in training_error and restartable is True


# --- Config and schedule -----------------------------------------------------------------------


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\nmodel_args: {n_layers: 2, dim: 64}\nlr: 3e-3\ntokens_per_rank: 4K\nsteps: 20\n")
    cfg = load_config(path, {"steps": "50", "attention": "local", "model_args": {"n_layers": 3}})
    assert cfg.optim.steps == 50 and cfg.attention.strategy == "local" and cfg.optim.lr == 3e-3
    assert cfg.data.tokens_per_rank == 4096
    assert cfg.model.args == {"n_layers": 3, "dim": 64}
    with pytest.raises(ConfigError, match=r"^stepz=3: unknown key \(did you mean steps\?\); known keys: model, "):
        load_config(None, {"stepz": 3})
    # a dict flag given twice adds up, as one flag with both; a key given again takes its later value
    from attnpool.cli.main import build_parser
    from attnpool.cli.train_cmd import config_from_args

    args = build_parser().parse_args(["train", "--config", str(path), "--model-args", "n_layers=3",
                                      "--model-args", "n_heads=2"])
    assert config_from_args(args).model.args == {"n_layers": 3, "dim": 64, "n_heads": 2}
    args = build_parser().parse_args(["train", "--model-args", "n_layers=3", "dim=32", "--model-args", "n_layers=4"])
    assert config_from_args(args).model.args == {"n_layers": 4, "dim": 32}


def test_config_in_sections_is_the_flat_config(tmp_path):
    """The same run given flat (configs/demo-cpu.yaml) and in sections of short names; written back in sections
    (a run's config.yaml), it reads as itself; what is unknown or given twice is refused by name."""
    flat = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.yaml")
    path = tmp_path / "sections.yaml"
    path.write_text("model: {name: tiny}\ndata: {source: stdlib, tokens_per_rank: 256, seed: 2}\n"
                    "attention: {strategy: cad, cost_model: pairs, min_shard: 64}\n"
                    "optim: {steps: 150, lr: 3.0e-3, warmup_steps: 10, min_lr_ratio: 0.1, weight_decay: 0.1}\n"
                    "run: {nproc: 4, device: cpu, out: runs/demo-cpu}\n")
    assert load_config(path) == flat
    assert (flat.data.seed, flat.attention.min_shard, flat.run.nproc) == (2, 64, 4)
    assert TrainConfig(**flat.to_dict()) == flat == TrainConfig(**flat.to_sections())
    save_config(flat, tmp_path / "written.yaml")
    assert load_config(tmp_path / "written.yaml") == flat
    assert "parallel:" in (tmp_path / "written.yaml").read_text()  # written in sections
    mixed = load_config(path, {"tp": "2", "model_args": {"n_layers": 2}})  # flags on top of sections
    assert mixed.parallel.tp == 2 and mixed.model.args == {"n_layers": 2} and mixed.model.name == "tiny"
    assert flat.replace(resume=True).checkpoint.resume and flat.replace(resume=True).run.out == flat.run.out
    with pytest.raises(ConfigError, match="unknown setting of section parallel") as err:
        TrainConfig(parallel={"tpp": 2})
    assert (err.value.field, err.value.value) == ("parallel.tpp", 2) and "(did you mean tp?)" in str(err.value)
    with pytest.raises(ConfigError, match="given twice"):
        TrainConfig(steps=3, optim={"steps": 4})
    with pytest.raises(ConfigError) as err:  # each section checks its own values, naming the key
        TrainConfig(optim={"lr": -1})
    assert err.value.field == "lr"


def test_train_help_groups_the_flags_by_section(capsys):
    from attnpool.cli.main import main
    from attnpool.train.config import KEYS, SECTIONS

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    groups = [text.index(f"(section {name}):" if cls.TITLE != name else f"\n{name}:") for name, cls in SECTIONS.items()]
    assert groups == sorted(groups)  # in the sections' order
    assert text.index("\n  --tp INT") > text.index("(section parallel):") > text.index("\n  --steps INT")
    assert all("--" + key.replace("_", "-") in text for key in KEYS) and "--kernel" in text  # every key, the alias


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(i, warmup_steps=4, steps=20, min_ratio=0.1) for i in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    assert 0.1 <= f[-1] < 0.12


# --- The command line --------------------------------------------------------------------------


def cli(*args):
    """``attnpool train ARGS`` in a process of its own, to its end (from a background job: tests/background.py)."""
    return background.run([sys.executable, "-m", "attnpool.cli.main", "train", *args], timeout=300)


def tiny_flags(out):
    return ["--model-args", "dim=32", "n_layers=1", "n_heads=4", "n_kv_heads=2", "ffn_dim=64",
            "--tokens-per-rank", "128", "--steps", "3", "--cost-model", "pairs", "--min-shard", "16",
            "--device", "cpu", "--out", str(out)]


@background.job("test_cli_run_writes_metrics_plot_and_summary", "test_cli_bad_input_exits_2")
def cli_run(tmp):
    """One small run through the CLI on 2 processes (its checkpoint serves the resume checks): its directory, the
    run."""
    out = tmp / "run"
    return out, cli(*tiny_flags(out), "--nproc", "2", "--attention", "cad", "--deterministic")


def test_cli_run_writes_metrics_plot_and_summary():
    out, done = cli_run.result()
    stdout = done.stdout
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in METRIC_KEYS:
        assert all(key in r for r in rows), key
    assert (out / "summary.png").stat().st_size > 10_000
    assert (out / "checkpoints" / "step-000003" / ".metadata").is_file()
    assert "local would have had" in stdout and "cad reached" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["end_step"] == 3 and summary["steady_from_step"] == 3
    assert summary["wall_s"] > summary["steps_time_s"] > 0  # (the wall time counts the start-up too)
    assert "tokens/s steady (median of steps 3..3)" in stdout and " s of steps; the rest start-up" in stdout
    assert max(map(len, stdout.splitlines())) > 80  # not wrapped at 80 columns where the output is not a terminal
    assert "deterministic: true" in (out / "config.yaml").read_text()  # (cad on 2 ranks under it)


def test_deterministic_turns_on_torchs_deterministic_algorithms_and_is_refused_with_sparse(monkeypatch, tmp_path):
    from attnpool.train.loop import deterministic_algorithms

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset after the test")  # (so that monkeypatch restores it unset)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()  # as it was before the run
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting stays
    with deterministic_algorithms(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with deterministic_algorithms(False):
        assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ConfigError, match="atomics") as err:
        tiny_config(tmp_path, deterministic=True, **SPARSE)
    assert err.value.field == "sparse"


def test_ping_pong_is_refused_with_wlb(tmp_path):
    """wlb packs whole documents on ranks; ping-pong is for the strategies that move work."""
    with pytest.raises(ConfigError, match="not with wlb") as err:
        tiny_config(tmp_path, attention="wlb", pingpong=True)
    assert err.value.field == "pingpong"


def test_progress_lines_mark_skipped_steps(capsys):
    from attnpool.train.metrics import Progress

    row = dict(imbalance_before=1.5, imbalance_after=1.0, tokens_per_s=1e3, loss=None, skipped_step=True)
    with Progress(True, 100, 0, "cad") as progress:  # (no terminal here: a plain line about every 5%)
        progress.update({**row, "step": 7})  # skipped: always a line
        progress.update({**row, "step": 8, "loss": 2.0, "skipped_step": False})  # not a 5% step: none
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 7/100  loss skipped (not finite)"), lines


TOKEN_ID_NEEDLE = "token id 349"


@background.job("test_cli_bad_input_exits_2")
def token_id_beyond_vocab(tmp):
    """Token ids are checked as documents are read: this error surfaces inside the ranks, mid-run. The run."""
    np.save(tmp / "tokens.npy", np.r_[np.arange(200), np.arange(100) + 250].astype(np.int64))
    np.save(tmp / "offsets.npy", np.array([0, 200, 300], dtype=np.int64))
    return cli("--data", "npy", "--data-path", str(tmp / "tokens.npy"), "--data-args",
               f"offsets_path={tmp / 'offsets.npy'}", "--nproc", "2", "--tokens-per-rank", "128",
               "--model-args", "n_layers=1", "dim=32", "--no-progress", "--out", str(tmp / "out" / "token-id"))


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every bad input: refused before any worker starts, in this process (tests/command.py); the token ids only in
    the ranks (a background job)."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "unknown.yaml").write_text("steps: 3\nlearning_rate: 0.1\n")
    (tmp / "not-a-table.json").write_text('{"steps": 3}')
    (tmp / "empty").mkdir()
    (tmp / "empty" / "a.txt").write_text("")
    (tmp / "empty" / "b.txt").write_text("")
    run_dir = cli_run.result()[0]
    cases = {
        "unknown key": (["--config", str(tmp / "unknown.yaml")], "learning_rate"),
        "unknown flag": (["--learning-rate", "0.1"], "unrecognized arguments"),
        "heads": (["--model-args", "n_heads=4", "n_kv_heads=3"], "n_kv_heads=3"),
        "token budget": (["--tokens-per-rank", "0"], "tokens_per_rank=0"),
        "missing data path": (["--data", "text", "--data-path", str(tmp / "nope")], "no such file"),
        "empty corpus": (["--data", "text", "--data-path", str(tmp / "empty")], "empty"),
        "other model shape": (tiny_flags(run_dir) + ["--nproc", "2", "--resume", "--model-args", "dim=64"],
                              "another model shape"),
        "earlier run": (tiny_flags(run_dir) + ["--nproc", "2"], "--resume"),
        "sparse coverage": (["--sparse", "vertical-slash", "--sparse-coverage", "1.5"], "sparse_coverage=1.5"),
        "sparse cap": (["--sparse", "vertical-slash", "--sparse-args", "vertical_cap=0"], "sparse_args.vertical_cap=0"),
        "sparse mode": (["--sparse", "block-sparse"], "sparse='block-sparse'"),
        "dense layers": (["--sparse", "vertical-slash", "--dense-layers", "4"], "dense_layers=4"),
        "sparse cost file": (["--sparse", "vertical-slash", "--sparse-args", f"cost_coefficients={tmp / 'nope.json'}"],
                             "sparse_args.cost_coefficients="),
        "sparse options of a dense run": (["--sparse-args", "slash_cap=128"], "sparse is none"),
        "infinite weight decay": (["--weight-decay", "inf"], "weight_decay=inf"),
        "infinite memory cap": (["--memory-cap", "inf"], "memory_cap=inf"),
        "unknown model field": (["--model-args", "n_layerz=2"], "model_args.n_layerz=2: is not a model field"),
        "not a cost table": (["--cost-model", str(tmp / "not-a-table.json")], "is not a cost table"),
        "task longer than a batch": (["--data", "retrieval", "--data-args", "context=4K", "--tokens-per-rank", "2K"],
                                     "data_args.context=4096: retrieval's tasks (4096 tokens) are longer than a micro-batch's 2048"),
    }
    results = {}
    for name, (args, needle) in cases.items():
        out = [] if name in ("other model shape", "earlier run") else ["--out", str(tmp / "out" / name)]
        done = run_command("train", *args, *out)
        results[name] = (done.returncode, done.stderr, needle)
    done = token_id_beyond_vocab.result()
    results["token id beyond vocab"] = (done.returncode, done.stderr, TOKEN_ID_NEEDLE)
    return results


@pytest.mark.parametrize("case", ["unknown key", "unknown flag", "heads", "token budget", "missing data path",
                                  "empty corpus", "token id beyond vocab", "other model shape", "earlier run",
                                  "sparse coverage", "sparse cap", "sparse mode", "dense layers", "sparse cost file",
                                  "sparse options of a dense run", "infinite weight decay", "infinite memory cap",
                                  "unknown model field", "not a cost table", "task longer than a batch"])
def test_cli_bad_input_exits_2(bad_runs, case):
    code, stderr, needle = bad_runs[case]
    assert code == 2, stderr
    assert needle in stderr
    assert "Traceback" not in stderr
    if case != "unknown flag":
        assert len(stderr.strip().splitlines()) == 1, stderr


def test_sparse_needs_triton_a_hopper_gpu_and_a_head_dim_it_can_tile_on_cuda(monkeypatch, tmp_path):
    """What the GPU path checks before training: Triton and head_dim in the launcher too, the GPU's kind
    only in a rank, which passes its device (the CPU twin runs any shape)."""
    train_module = sys.modules[check_sparse.__module__]

    config = tiny_config(tmp_path, **SPARSE)
    rank_gpu = torch.device("cuda", 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (8, 0))
    monkeypatch.setattr(train_module.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError, match="sm_90 .*A100-SXM4-80GB is sm_80") as err:
        train_module.check_sparse(config, model_config("tiny", **dict(TINY, dim=64)), rank_gpu, "cuda")
    assert err.value.field == "sparse" and asked == [rank_gpu]
    train_module.check_sparse(config, model_config("tiny", **dict(TINY, dim=64)), None, "cuda")  # a launcher
    assert asked == [rank_gpu]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(train_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="Triton") as err:
        train_module.check_sparse(config, model_config("tiny", **TINY), None, "cuda")
    assert err.value.field == "sparse"
    monkeypatch.setattr(train_module.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError, match="head_dim"):
        train_module.check_sparse(config, model_config("tiny", **TINY), rank_gpu, "cuda")  # head_dim 8
    # head_dim 256: the forward and the dQ pass would not fit in Hopper's shared memory (refused before
    # training, where the first launch would fail inside every rank).
    with pytest.raises(ConfigError, match="head_dim=256: .* from 16 to 128 for 16-bit inputs"):
        train_module.check_sparse(config, model_config("tiny", **dict(TINY, dim=1024)), rank_gpu, "cuda")
    train_module.check_sparse(config, model_config("tiny", **dict(TINY, dim=64)), rank_gpu, "cuda")  # head_dim 16
    train_module.check_sparse(config, model_config("tiny", **dict(TINY, dim=512)), rank_gpu, "cuda")  # head_dim 128
    with pytest.raises(ConfigError, match="head_dim=128: .* from 16 to 64 for 32-bit inputs"):  # float32 rows
        train_module.check_sparse(tiny_config(tmp_path, precision="fp32", **SPARSE),
                                  model_config("tiny", **dict(TINY, dim=512)), rank_gpu, "cuda")
    # A pattern block of 256 doubles the tiles: the forward would not fit either.
    wide = dict(SPARSE, sparse_args=dict(SPARSE["sparse_args"], block=256))
    with pytest.raises(ConfigError, match="sparse_block=256: .* at most 128") as err:
        train_module.check_sparse(tiny_config(tmp_path, **wide), model_config("tiny", **dict(TINY, dim=512)), rank_gpu,
                                  "cuda")
    assert err.value.field == "sparse"
    # And a vertical chunk of 256 the dQ pass.
    wide = dict(SPARSE, sparse_args=dict(SPARSE["sparse_args"], vertical_chunk=256))
    with pytest.raises(ConfigError, match="sparse_vertical_chunk=256: .* at most 128"):
        train_module.check_sparse(tiny_config(tmp_path, **wide), model_config("tiny", **dict(TINY, dim=512)), rank_gpu,
                                  "cuda")


def test_third_party_warnings_a_user_cannot_act_on_are_quiet(monkeypatch):
    import warnings

    import torch

    from attnpool.train.launch import quiet_warnings

    monkeypatch.setenv("PYTHONWARNINGS", "default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_warnings()
        # what torch says where a skipped step left the optimizer's update out and the schedule's in
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).step()
        # what the CUTLASS DSL says on every compilation of FA4's kernels
        warnings.warn("Argument aux_data (position 19) cannot be converted to a JitArgument for function 'f'. Its "
                      "type `<class 'flash_attn.cute.utils.AuxData'>` is not supported.", UserWarning)
        warnings.warn("something else")
    assert [str(w.message) for w in caught] == ["something else"]
    assert os.environ["PYTHONWARNINGS"] == "default,ignore:resource_tracker:UserWarning"


def test_a_config_file_with_a_key_given_twice_is_refused_naming_it(tmp_path):
    """YAML itself keeps the last of two values silently; a run's settings must not be one of two the user wrote."""
    from attnpool.train.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("steps: 5\nlr: 1e-3\nsteps: 6\n")
    with pytest.raises(ConfigError, match="the key 'steps' is given twice.*line 3"):
        load_config(str(path))
    path.write_text("model_args: {n_layers: 2, n_layers: 3}\n")  # nested mappings alike
    with pytest.raises(ConfigError, match="the key 'n_layers' is given twice"):
        load_config(str(path))
    path.write_text("steps: [5\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_layout_is_linear_or_balanced_and_wlb_keeps_its_own_packing():
    for overrides, said in ((dict(layout="zigzag"), "choose one of linear, balanced"),
                            (dict(attention="wlb", layout="balanced"), "wlb lays documents out by its own packing")):
        with pytest.raises(ConfigError, match=said) as err:
            tiny_config("unused", **overrides)
        assert err.value.field == "layout"
    assert tiny_config("unused", layout="balanced", pp=2).attention.layout == "balanced"  # equal tokens: stages may


def test_a_run_stopped_before_its_first_step_does_not_block_its_out(tmp_path):
    """Its metrics.jsonl is empty: nothing to lose, so the run, its input fixed, starts again there without
    --overwrite; one that logged a step is kept."""
    from attnpool.train.resume import refuse_overwriting_a_run

    (tmp_path / "metrics.jsonl").write_text("")
    refuse_overwriting_a_run(tiny_config(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="holds an earlier run's metrics.jsonl"):
        refuse_overwriting_a_run(tiny_config(tmp_path))
