"""`attnpool bench` end to end on CPU (gloo, tiny model): the GPU benchmark's own logic, in CI."""

import argparse
import json
import os
import pathlib
import sys
import warnings

import background
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _partial_results_are_written_quietly(tmp_path, records, capsys):
    """After each strategy the results so far are written (a run killed later keeps them), marked partial,
    with nothing printed."""
    from attnpool.bench.e2e import finish
    from attnpool.bench.e2e_options import add_arguments
    from attnpool.model import model_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "partial"), "--device", "cpu", "--model", "tiny", "--layers", "1",
                         "--configs", "prolong:1K", "--strategies", "local,ulysses"])
    args.resolved_attention_backend = "reference"  # (run() resolves it)
    capsys.readouterr()
    finish(records[:2], [], args, 2, model_config("tiny", n_layers=1), complete=False)
    assert capsys.readouterr().out == ""
    written = json.loads((tmp_path / "partial" / "e2e.json").read_text())
    assert [r["strategy"] for r in written["records"]] == ["local", "ulysses"] and written["meta"]["complete"] is False
    assert "Partial: written after each strategy" in (tmp_path / "partial" / "e2e.md").read_text()


def bench_on_two_cpu_ranks(tmp, *args: str):
    """`attnpool bench` on torchrun's 2 gloo ranks with the tiny model, ``args`` added, results under ``tmp``:
    (tmp, the finished process)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "attnpool.cli.main", "bench",
           "--device", "cpu", "--model", "tiny", *args, "--out", str(tmp)]
    return tmp, background.run(cmd, timeout=300)


@background.job("test_bench_runs_every_strategy_and_writes_results")
def every_strategy(tmp):
    """torchrun's 2 ranks through every strategy, with the ablation and a traced step: its --out and the run."""
    strategies = "local,ulysses,cad,cad+pingpong,cad+pingpong+balanced,local+sparse,cad+sparse,cad+sparse+readkv"
    return bench_on_two_cpu_ranks(tmp, "--layers", "1", "--configs", "prolong:1K", "--strategies", strategies,
                                  "--warmup", "1", "--steps", "1", "--ablation", "--head-chunks", "2", "--trace",
                                  "ulysses,cad", "--exchange-gibps", "auto")


def test_bench_runs_every_strategy_and_writes_results(capsys):
    tmp_path, r = every_strategy.result()
    assert r.returncode == 0, r.stderr[-3000:]
    records = json.loads((tmp_path / "e2e.json").read_text())["records"]
    names = [rec["strategy"] for rec in records]
    assert names == ["local", "ulysses", "cad", "cad+pingpong", "cad+pingpong+balanced", "local+sparse", "cad+sparse",
                     "cad+sparse+readkv", "cad+pingpong (1-element messages)"]
    for rec in records:
        for key in ("strategy", "dist", "tokens_per_gpu", "step_time_s", "tokens_per_s", "speedup_vs_local",
                    "speedup_vs_local_total", "total_time_s", "plan_time_s",
                    "efficiency", "efficiency_with_recompute", "mfu", "imbalance_after", "bytes_sent_per_gpu", "peak_memory_bytes"):
            assert key in rec
    assert all(rec["loss_ok"] for rec in records[:8])  # same batches, same initial weights
    # --head-chunks: core attention in 2 groups of heads where it exchanges and is dense, else in one
    assert [rec["head_chunks"] for rec in records] == [2, 1, 2, 2, 2, 1, 1, 1, 2]
    meta = json.loads((tmp_path / "e2e.json").read_text())["meta"]
    assert meta["complete"] and " --head-chunks 2" in meta["command"] and " --exchange-gibps auto" in meta["command"]
    # --exchange-gibps auto: each cad run's planner prices its bytes at the link it measured at its start (gloo's
    # here), which its record keeps; the other strategies plan no moves
    priced = [rec["strategy"].startswith("cad") for rec in records]
    assert priced == [False, False, True, True, True, False, True, True, True]
    for rec, cad in zip(records, priced):
        measured = rec["exchange_gibps"] is not None and rec["exchange_gibps"] > 0 and rec["exchange_gibps_measured"]
        assert measured if cad else (rec["exchange_gibps"] is None and not rec["exchange_gibps_measured"])
    assert all(rec["inter_node_gibps"] is None for rec in records)
    assert "Partial" not in (tmp_path / "e2e.md").read_text()
    _partial_results_are_written_quietly(tmp_path, records, capsys)
    for rec in records:  # keep_attention recomputes the linear parts: a longer ideal, never a shorter one
        assert rec["ideal_step_with_recompute_s"] > rec["ideal_step_s"] > 0
    assert records[0]["attention_density"] is None and 0 < records[6]["attention_density"] <= 1
    assert records[0]["sparse_imbalance_measured"] is None and records[6]["sparse_imbalance_measured"] >= 1
    for kind in ("pairs", "kernel"):
        key = f"sparse_imbalance_measured_{kind}"
        assert records[0][key] is None and records[6][key] >= 1
    for traced in ("ulysses", "cad"):  # each profiled extra step
        assert (tmp_path / f"trace-prolong-1K-{traced}.txt").read_text().strip()
        assert (tmp_path / f"trace-prolong-1K-{traced}.json.gz").stat().st_size > 0
    assert "| prolong | 1K | cad |" in (tmp_path / "e2e.md").read_text()
    # auto on the CPU: the reference kernel, named in every record and in the table's heading
    assert {rec["attention_backend"] for rec in records} == {"reference"}
    assert "core attention kernel reference" in (tmp_path / "e2e.md").read_text()


def test_bench_sets_growable_segments_before_anything_starts_cuda(monkeypatch):
    """The allocator reads its settings when CUDA starts, and resolving the kernel starts it: set after
    that, growable segments were silently off (as in issue 27's fifth session)."""
    import attnpool.bench.e2e as e2e
    from attnpool.bench.e2e_options import add_arguments
    from attnpool.errors import ConfigError

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    seen = []

    def resolve(config, device):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise ConfigError("attention_backend", config.attention.backend, "stop here")

    monkeypatch.setattr(e2e, "attention_backend", resolve)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", "unused", "--device", "cpu", "--model", "tiny", "--layers", "1", "--configs", "prolong:1K",
                         "--strategies", "local"])
    with pytest.raises(ConfigError, match="stop here"):
        e2e.run(args)
    assert seen == ["expandable_segments:True"]


def test_growable_segments_asked_for_too_late_are_warned_of(monkeypatch):
    from attnpool.train.launch import use_growable_segments

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="after CUDA started"):
        use_growable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    with warnings.catch_warnings():  # set already (a user's, or an earlier run's in this process): left alone
        warnings.simplefilter("error")
        use_growable_segments()


@background.job("test_bench_refuses_a_kernel_that_cannot_run_before_any_process_group")
def refused_kernel(tmp):
    """One rank, as torchrun sets it up but with no rendezvous, asked for fa4 on the CPU: its --out and the run."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # as torchrun sets them; no rendezvous
    cmd = [sys.executable, "-m", "attnpool.cli.main", "bench", "--device", "cpu", "--model", "tiny", "--layers", "1",
           "--configs", "prolong:1K", "--strategies", "local", "--attention-backend", "fa4", "--out", str(tmp)]
    return tmp, background.run(cmd, env=env, timeout=120)


def test_bench_refuses_a_kernel_that_cannot_run_before_any_process_group():
    tmp_path, r = refused_kernel.result()
    assert r.returncode == 2, r.stderr[-2000:]
    assert "attention_backend" in r.stderr and "fa4" in r.stderr
    assert not (tmp_path / "e2e.json").exists()


def bench_batches(*args) -> list[list[int]]:
    """The document lengths of a benchmark's steps, as bench/sim_validation.py draws them for its comparisons."""
    sys.path.insert(0, str(ROOT / "bench"))
    from sim_validation import bench_batches as drawn
    return drawn(*args)


@background.job("test_warm_up_on_small_batches_measures_the_batches_a_full_warm_up_would")
def small_warm_up(tmp):
    """torchrun's 2 ranks, local and cad (traced on both ranks), warmed up on batches of 256 tokens per GPU: its --out
    and the run."""
    return bench_on_two_cpu_ranks(tmp, "--layers", "1", "--configs", "prolong:1K", "--strategies", "local,cad",
                                  "--warmup", "1", "--warmup-tokens", "256", "--steps", "1", "--trace", "cad",
                                  "--trace-ranks", "all")


def test_warm_up_on_small_batches_measures_the_batches_a_full_warm_up_would():
    """--warmup-tokens: the warm-up step runs on a 256-token batch, in a run of its own, and the measured step is
    still the stream's second batch, as in the run warmed up on a full batch (every_strategy): the same layout's
    balance and `local`'s plan, and the second batch's longest document (the first batch's is shorter, the warm-up's at most 512 tokens)."""
    tmp_path, r = small_warm_up.result()
    assert r.returncode == 0, r.stderr[-3000:]
    written = json.loads((tmp_path / "e2e.json").read_text())
    assert written["meta"]["warmup_tokens"] == 256 and " --warmup-tokens 256 " in written["meta"]["command"]
    assert "1 warm-up (on batches of 256 tokens per GPU, a run of their own)" in (tmp_path / "e2e.md").read_text()
    first, second = bench_batches("prolong", 1024, 2, 0, 2)
    assert max(first) < max(second)
    full_tmp, full = every_strategy.result()
    assert full.returncode == 0, full.stderr[-3000:]
    full_records = {rec["strategy"]: rec for rec in json.loads((full_tmp / "e2e.json").read_text())["records"]}
    for rec in written["records"]:
        assert rec["longest_doc"] == max(second)
        assert rec["tokens_per_s"] == pytest.approx(2048 / rec["step_time_s"])  # the measured batch's tokens
        # (the same batch; and the same plan where every_strategy's run planned as this one, not at a link it
        # measured: --exchange-gibps auto)
        full_rec = full_records[rec["strategy"]]
        for key in ("imbalance_before",) + (("imbalance_after",) if full_rec["exchange_gibps"] is None else ()):
            assert rec[key] == pytest.approx(full_rec[key])
        assert len(rec["losses"]) == 2 and rec["loss_ok"]
        assert rec["peak_memory_first_step_only"] and not full_records[rec["strategy"]]["peak_memory_first_step_only"]
    assert "*: the peak of a run's first step, the only one measured" in (tmp_path / "e2e.md").read_text()
    # traced, the measured run goes on past its measured step to the profiled one, which is not in the record; on
    # both ranks (--trace-ranks all), rank 1's named so
    for name in ("trace-prolong-1K-cad", "trace-prolong-1K-cad-rank1"):
        assert (tmp_path / f"{name}.txt").read_text().strip() and (tmp_path / f"{name}.json.gz").stat().st_size > 0
    assert " --trace cad --trace-ranks all" in written["meta"]["command"]


@background.job("test_warm_up_on_small_batches_skips_every_micro_batch_of_its_steps")
def small_warm_up_of_micro_batches(tmp):
    """torchrun's 2 ranks, local in 2 micro-batches a step, warmed up on 256 tokens per GPU: its --out and the run."""
    return bench_on_two_cpu_ranks(tmp, "--layers", "1", "--configs", "prolong:1K", "--strategies", "local",
                                  "--microbatches", "2", "--warmup", "1", "--warmup-tokens", "256", "--steps", "1")


def test_warm_up_on_small_batches_skips_every_micro_batch_of_its_steps():
    """A step draws a batch per micro-batch: the measured step after one warm-up step of 2 micro-batches trains on
    the stream's third and fourth batches, whose longest document (2,048 tokens) the first three lack."""
    tmp_path, r = small_warm_up_of_micro_batches.result()
    assert r.returncode == 0, r.stderr[-3000:]
    batches = bench_batches("prolong", 1024, 2, 0, 4)
    assert max(map(max, batches[:3])) < max(map(max, batches[2:])) == 2048
    (rec,) = json.loads((tmp_path / "e2e.json").read_text())["records"]
    assert rec["longest_doc"] == 2048 and rec["microbatches"] == 2


@background.job("test_bench_with_auto_checkpointing_says_what_each_run_chose")
def auto_checkpointing(tmp):
    """torchrun's 2 ranks, local and cad with activation_checkpointing=auto: its --out and the run."""
    return bench_on_two_cpu_ranks(tmp, "--layers", "2", "--configs", "prolong:1K", "--strategies", "local,cad",
                                  "--warmup", "0", "--steps", "1", "--activation-checkpointing", "auto")


def test_bench_with_auto_checkpointing_says_what_each_run_chose():
    """auto on the CPU, whose memory holds everything: no layer recomputes, and every record says so."""
    tmp_path, r = auto_checkpointing.result()
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "e2e.json").read_text())["meta"]
    assert meta["command"].endswith("--attention-backend reference --activation-checkpointing auto")  # as run
    assert "activation checkpointing per layer as the memory model chose" in (tmp_path / "e2e.md").read_text()
    assert "auto's choice: prolong 1K local: all 2 layers none; prolong 1K cad: all 2 layers none." in \
        (tmp_path / "e2e.md").read_text()
    for rec in json.loads((tmp_path / "e2e.json").read_text())["records"]:  # nothing is recomputed
        assert rec["layer_checkpointing"] == "all 2 layers none"
        assert rec["efficiency_with_recompute"] == rec["efficiency"]


@background.job("test_bench_ablation_of_the_pooled_pipeline_shrinks_its_exchanges")
def pooled_ablation(tmp):
    """torchrun's 2 ranks as 2 pooled stages, cad and its one-element-message ablation: its --out and the run."""
    return bench_on_two_cpu_ranks(tmp, "--layers", "3", "--configs", "pretrain:1K", "--strategies", "cad", "--warmup",
                                  "0", "--steps", "1", "--pp", "2", "--microbatches", "2", "--pp-schedule", "pooled",
                                  "--ablation")


def test_bench_ablation_of_the_pooled_pipeline_shrinks_its_exchanges():
    """Pipelined, the ablation is plain cad (ping-pong does not run there), and its messages are really cut: the
    idle stage's served queries come back as zeros, so the first loss moves."""
    tmp_path, r = pooled_ablation.result()
    assert r.returncode == 0, r.stderr[-3000:]
    cad, ablated = json.loads((tmp_path / "e2e.json").read_text())["records"]
    assert (cad["strategy"], ablated["strategy"]) == ("cad", "cad (1-element messages)")
    assert cad["pp_schedule"] == ablated["pp_schedule"] == "pooled"
    assert cad["bytes_sent_per_gpu"] > 0  # the pooled exchange spans both stages: there is something to cut
    assert abs(cad["losses"][0] - ablated["losses"][0]) > 1e-6


def test_summary_of_ping_pong_steps_with_one_document():
    """Under ping-pong a step of one document runs as one nano-batch and times its core attention; the
    others do not. The record then says "not measured" rather than failing or quoting those steps alone."""
    from attnpool.bench.e2e import summarize

    args, cfg, as_run = summary_inputs()
    mixed = summarize("cad+pingpong", "pretrain", 2048, [summary_row(1, None), summary_row(2, 0.3),
                                                         summary_row(3, None), summary_row(4, 0.2)],
                      args, 2, cfg, as_run)
    assert mixed["attention_time_s"] is None
    timed = summarize("cad", "pretrain", 2048, [summary_row(1, 0.5), summary_row(2, 0.1), summary_row(3, 0.2),
                                                summary_row(4, 0.3)], args, 2, cfg, as_run)
    assert timed["attention_time_s"] == 0.2


def summary_row(step, attention_time_s=None, peak_memory_bytes=1):
    """One training step's metrics, as summarize reads them."""
    return dict(step=step, step_time_s=1.0, tokens=4096, imbalance_after=1.0, imbalance_before=1.5, comm_bytes=0,
                peak_memory_bytes=peak_memory_bytes, attention_work_total=1.0, loss=1.0, plan_time_s=1e-3,
                attention_time_s=attention_time_s, longest_doc=4096)


def summary_inputs():
    """summarize's arguments but the rows: one warm-up step, a 1-layer tiny model on 2 GPUs."""
    from attnpool.model import model_config

    args = argparse.Namespace(warmup=1, tp=1, pp=1, microbatches=1, activation_checkpointing="keep_attention",
                              hierarchical_exchange=False)
    as_run = {"layer_checkpointing": ("keep_attention",), "activation_offload": False, "pp_schedule": None,
              "pp_schedule_choice": None, "head_chunks": 1, "exchange_gibps": None,
              "exchange_gibps_measured": False, "inter_node_gibps": None, "inter_node_gibps_measured": False}
    return args, model_config("tiny", n_layers=1), as_run


def test_peak_memory_is_taken_after_a_runs_first_step_where_one_was_measured():
    """A run's first step makes the optimizer's state after its peak: the peak comes from later steps, and where the
    first is the only one measured (--warmup-tokens' measured run, --steps 1) the record says so."""
    from attnpool.bench.e2e import summarize

    args, cfg, as_run = summary_inputs()
    full_warm_up = summarize("local", "prolong", 2048, [summary_row(1, peak_memory_bytes=5),
                                                        summary_row(2, peak_memory_bytes=3),
                                                        summary_row(3, peak_memory_bytes=4)], args, 2, cfg, as_run)
    assert full_warm_up["peak_memory_bytes"] == 4 and not full_warm_up["peak_memory_first_step_only"]
    # --warmup-tokens: the warm-up run's step, then the measured run counting from 1 again
    small_warm_up = [summary_row(1, peak_memory_bytes=9), summary_row(1, peak_memory_bytes=2),
                     summary_row(2, peak_memory_bytes=3)]
    assert summarize("local", "prolong", 2048, small_warm_up, args, 2, cfg, as_run)["peak_memory_bytes"] == 3
    first_only = summarize("local", "prolong", 2048, small_warm_up[:2], args, 2, cfg, as_run)
    assert first_only["peak_memory_bytes"] == 2 and first_only["peak_memory_first_step_only"]


def test_peak_breakdown_groups_what_was_live_at_the_peak():
    """Replaying the allocator's trace as its allocated-bytes statistic moves: the peak, and the live
    blocks then grouped by their innermost frame in the attnpool package."""
    import os

    from attnpool.bench.memory import NO_FRAME, PACKAGE_DIR, breakdown_markdown, peak_breakdown

    def frames(*where):
        return [dict(filename=f, line=n, name=fn) for f, n, fn in where]

    attn = frames(("/x/torch/functional.py", 10, "cat"), (os.path.join(PACKAGE_DIR, "runtime", "core_attention.py"), 42,
                  "forward"), (os.path.join(PACKAGE_DIR, "model", "llama.py"), 7, "forward"))
    mlp = frames((os.path.join(PACKAGE_DIR, "model", "llama.py"), 99, "mlp"))
    other = frames(("/home/u/attnpool/.venv/torch/autograd/graph.py", 5, "run"))  # not the package itself
    trace = [
        dict(action="free_requested", addr=999, size=50, frames=[]),  # allocated before recording: ignored
        dict(action="alloc", addr=1, size=100, frames=attn),
        dict(action="alloc", addr=2, size=300, frames=mlp),
        dict(action="free_requested", addr=2, size=300, frames=[]),  # no longer allocated ...
        dict(action="free_completed", addr=2, size=300, frames=[]),  # ... whenever its free completes
        dict(action="alloc", addr=3, size=200, frames=attn),
        dict(action="alloc", addr=4, size=40, frames=other),
        dict(action="alloc", addr=5, size=10, frames=[]),
        dict(action="alloc", addr=6, size=5, frames=mlp),  # 100 + 200 + 40 + 10 + 5 = 355 < 400
        dict(action="free_requested", addr=3, size=200, frames=[]),
        dict(action="free_completed", addr=3, size=200, frames=[]),
    ]
    report = peak_breakdown(trace, top=2)
    assert report["peak_bytes"] == 400 and report["peak_index"] == 2  # 100 + 300, before the MLP block's free
    assert report["live_blocks"] == 2
    assert [(g["site"], g["bytes"]) for g in report["groups"]] == [
        ("attnpool/model/llama.py:99 mlp", 300), ("attnpool/runtime/core_attention.py:42 forward", 100)]
    trace[2]["size"] = 30  # now the peak is later, with every site live
    report = peak_breakdown(trace, top=2)
    assert report["peak_bytes"] == 100 + 200 + 40 + 10 + 5
    assert report["peak_index"] == 8 and report["live_blocks"] == 5
    sites = [(g["site"], g["bytes"], g["blocks"]) for g in report["groups"]]
    assert sites == [("attnpool/runtime/core_attention.py:42 forward", 300, 2),
                     ("/home/u/attnpool/.venv/torch/autograd/graph.py:5 run", 40, 1), ("(other sites)", 15, 2)]
    report.update(start_bytes=2 ** 30, truncated=False)
    text = breakdown_markdown("t", report)
    assert "| `attnpool/runtime/core_attention.py:42 forward` |" in text and "1.00 GiB live when recording began" in text
    assert NO_FRAME not in text  # grouped into "(other sites)" by top=2
    # A block whose free waits on another stream stops counting at the request, as the statistic does.
    late = [dict(action="alloc", addr=1, size=100, frames=[]), dict(action="free_requested", addr=1, size=100, frames=[]),
            dict(action="alloc", addr=2, size=100, frames=[]), dict(action="free_completed", addr=1, size=100, frames=[])]
    assert peak_breakdown(late)["peak_bytes"] == 100


def test_memory_breakdown_needs_cuda(monkeypatch):
    import pytest

    from attnpool.bench.e2e import check_arguments
    from attnpool.bench.e2e_options import add_arguments
    from attnpool.errors import ConfigError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", "x", "--device", "cpu", "--memory-breakdown"])
    with pytest.raises(ConfigError) as err:
        check_arguments(args)
    assert err.value.field == "--memory-breakdown"


def test_trace_ranks_are_checked_among_the_arguments(monkeypatch):
    """--trace-ranks names ranks of the run, or all; anything else is refused before any run, naming the flag."""
    from attnpool.bench.e2e import check_arguments, traced_ranks
    from attnpool.errors import ConfigError

    assert traced_ranks("all", 4) == {0, 1, 2, 3} and traced_ranks("0,3", 4) == {0, 3} and traced_ranks("0", 1) == {0}
    p = bench_arguments(monkeypatch, 2)
    for bad in ("2", "x", "0,-1", ""):
        with pytest.raises(ConfigError, match="name ranks among 0..1") as err:
            check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--trace-ranks", bad]))
        assert err.value.field == "--trace-ranks"


def bench_arguments(monkeypatch, world: int) -> argparse.ArgumentParser:
    """`attnpool bench`'s parser, as rank 0 of ``world`` under torchrun would check its arguments."""
    from attnpool.bench.e2e_options import add_arguments

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_sparse_strategies_refused_before_any_run_on_a_gpu_older_than_hopper(monkeypatch):
    """Refused among the arguments: refused in the sparse strategy's own run, the results of the
    strategies before it would be lost."""
    import pytest
    import torch

    from attnpool.bench.e2e import check_arguments
    from attnpool.errors import ConfigError

    p = bench_arguments(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    dense = p.parse_args(["--out", "x", "--strategies", "local,cad"])
    assert check_arguments(dense)[1] == ["local", "cad"]
    args = p.parse_args(["--out", "x", "--strategies", "local,cad+sparse"])
    with pytest.raises(ConfigError, match="sm_80") as err:
        check_arguments(args)
    assert err.value.field == "--strategies" and err.value.value == "cad+sparse"


def test_balanced_after_a_strategy_runs_it_over_the_balanced_layout_and_not_wlb(monkeypatch):
    from attnpool.bench.e2e import check_arguments
    from attnpool.bench.e2e_options import strategy_settings
    from attnpool.errors import ConfigError

    assert strategy_settings("cad+pingpong+balanced") == ("cad", True, None, "balanced")
    assert strategy_settings("cad+sparse+balanced") == ("cad", False, "prefix", "balanced")
    assert strategy_settings("local") == ("local", False, None, "linear")
    assert strategy_settings("wlb+balanced") is None and strategy_settings("cad+balanced+pingpong") is None
    p = bench_arguments(monkeypatch, 2)
    with pytest.raises(ConfigError, match="each but wlb also with \\+balanced") as err:
        check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--strategies", "local,wlb+balanced"]))
    assert err.value.field == "--strategies" and "wlb+balanced" in str(err.value)


def test_ulysses_refused_before_any_run_where_the_ranks_cannot_split_the_heads(monkeypatch, capsys):
    """3 ranks and Llama-3-8B's 32 query heads: named, ulysses is refused among the arguments; among the
    defaults it is left out, and the bench says why."""
    import pytest

    from attnpool.bench.e2e import check_arguments
    from attnpool.bench.e2e_options import DEFAULT_STRATEGIES
    from attnpool.errors import ConfigError

    p = bench_arguments(monkeypatch, 3)
    with pytest.raises(ConfigError, match="3 ranks cannot split 32 query heads") as err:
        check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--strategies", "local,ulysses"]))
    assert err.value.field == "--strategies"
    assert check_arguments(p.parse_args(["--out", "x", "--device", "cpu"]))[1] == \
        [s for s in DEFAULT_STRATEGIES if s != "ulysses"]
    assert "ulysses: not run: 3 ranks cannot split 32 query heads" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "ulysses" in check_arguments(p.parse_args(["--out", "x", "--device", "cpu"]))[1]


@background.job("test_bench_over_two_emulated_nodes_records_them_and_relays_only_where_kv_rows_move")
def two_nodes_hierarchical(tmp):
    """bench/torchrun_nodes.sh: two emulated nodes of one rank each (the probe's test has two a node), ulysses and
    cad with --hierarchical-exchange: its --out and the run."""
    cmd = ["bash", "bench/torchrun_nodes.sh", "-m", "attnpool.cli.main", "bench", "--device", "cpu", "--model", "tiny",
           "--layers", "2", "--configs", "prolong:1K", "--strategies", "ulysses,cad", "--warmup", "0", "--steps", "1",
           "--hierarchical-exchange", "--out", str(tmp)]
    return tmp, background.run(cmd, env={"NODES": "2", "NPROC": "2", "PYTHON": sys.executable}, timeout=300)


def test_bench_over_two_emulated_nodes_records_them_and_relays_only_where_kv_rows_move():
    """ulysses, which exchanges heads, runs without the hierarchical exchange rather than being refused; the record
    says how the ranks were launched, as bench/sim_validation.py reads it."""
    tmp_path, r = two_nodes_hierarchical.result()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    meta = result["meta"]
    assert (meta["layers"], meta["ranks_per_node"], meta["hierarchical_exchange"]) == (2, 1, True)
    assert meta["command"].startswith("torchrun --nnodes 2 --nproc-per-node 1 ")
    assert meta["command"].endswith(" --hierarchical-exchange")
    assert meta["nccl_env"]["NCCL_HOSTID"] == "attnpool-emulated-node-0"  # (rank 0's: the emulation shows)
    assert {rec["strategy"]: rec["hierarchical_exchange"] for rec in result["records"]} == {"ulysses": False,
                                                                                           "cad": True}


def test_a_run_starts_before_the_budget_and_where_one_like_the_longest_ends_by_end_by():
    from attnpool.bench.e2e import may_start

    inf = float("inf")
    assert may_start(0.0, 0.0, inf, 480)  # the first run: nothing measured yet
    assert may_start(300.0, 150.0, inf, 480)  # would end at 450 s
    assert not may_start(400.0, 150.0, inf, 480)  # would end at 550 s
    assert may_start(400.0, 150.0, 480, inf) and not may_start(480.0, 0.0, 480, inf)  # --budget-s: elapsed alone
    assert may_start(1e6, 1e6, inf, inf)  # neither given


def test_trace_breakdown_puts_kernels_under_the_phase_that_launched_them():
    """bench/trace_breakdown.py: a kernel goes under the longest enclosing core attention op on its launching thread
    (a backward node named apart), grouped by kind; a kernel launched outside any phase is "other"."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from trace_breakdown import breakdown, classified

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(ts, correlation, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": correlation}}

    def kernel(name, correlation, dur_us):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur_us, "args": {"correlation": correlation}}

    events = [op("_Serve", 100, 50), op("aten::index_put_", 105, 5), launch(106, 1), launch(120, 2),
              op("autograd::engine::evaluate_function: _CollectBackward", 300, 20, tid=2), launch(310, 3, tid=2),
              launch(400, 4), launch(130, 5, tid=2),  # outside any phase; a phase's time on another thread
              {**launch(112, 6), "cat": "cuda_driver", "name": "cuLaunchKernelEx"},  # NCCL's launches: the driver's
              kernel("void at::native::index_elementwise_kernel<128, 4>", 1, 3000),
              kernel("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90", 2, 8000),
              kernel("void at::native::vectorized_gather_kernel<16, long>", 3, 1000),
              kernel("nvjet_sm90_tst_320x128", 4, 9000), kernel("ncclDevKernel_SendRecv", 5, 2000),
              kernel("ncclDevKernel_SendRecv", 6, 4000),
              {**launch(115, 7), "name": "cudaMemcpyAsync"},  # a contiguous slice's copy: a memcpy, not a kernel
              {**kernel("Memcpy DtoD (Device -> Device)", 7, 500), "cat": "gpu_memcpy"}]
    table = breakdown(list(classified(events)))
    assert table["_Serve"] == {"indexed copy": 3.0, "attention kernel": 8.0, "collective": 4.0, "plain copy": 0.5}
    assert table["_Collect (backward)"] == {"indexed copy": 1.0}
    assert table["other"] == {"other": 9.0, "collective": 2.0}


def test_trace_breakdown_counts_the_time_an_exchange_ran_beside_another_collective():
    """bench/trace_breakdown.py: of core attention's collective kernels, the time a collective launched elsewhere
    (FSDP's) ran on the same device, each instant once; another device's collectives and other kernels are not."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from trace_breakdown import beside_other_collectives, classified

    def at(name, ts, dur, correlation, device=0, phase=True):
        tid = 1 if phase else 2
        return [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": ts, "dur": 1, "tid": tid,
                 "args": {"correlation": correlation}},
                {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                 "args": {"correlation": correlation, "device": device}}]

    events = [{"ph": "X", "cat": "cpu_op", "name": "_DispatchStart", "ts": 0, "dur": 10_000, "tid": 1},
              *at("ncclDevKernel_AllToAll", 1000, 3000, 1),  # 1,000-4,000 us
              *at("ncclDevKernel_AllToAll", 6000, 1000, 2),  # 6,000-7,000 us: beside nothing
              *at("ncclDevKernel_AllGather", 500, 1500, 3, phase=False),  # 500-2,000: 1,000 beside the first
              *at("ncclDevKernel_ReduceScatter", 1500, 1000, 4, phase=False),  # overlaps the gather: union to 2,500
              *at("ncclDevKernel_AllGather", 3500, 3000, 5, device=1, phase=False),  # another GPU's
              *at("nvjet_sm90_tst", 3000, 500, 6, phase=False)]  # not a collective
    assert beside_other_collectives(list(classified(events))) == {"attention_collectives_ms": 4.0, "beside_other_collectives_ms": 1.5}


def test_trace_breakdown_says_what_ran_while_the_compute_stream_stood_idle():
    """bench/trace_breakdown.py: per device, the compute stream is the one of most kernel time outside collectives; its
    idle time within the device's span goes to the earliest-started core attention collective running, else another
    collective, else a kernel on another stream, else nothing."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from trace_breakdown import classified, compute_stream_idle

    def at(name, ts, dur, correlation, stream, device=0, tid=2, cat="kernel"):
        return [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": ts, "dur": 1, "tid": tid,
                 "args": {"correlation": correlation}},
                {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                 "args": {"correlation": correlation, "device": device, "stream": stream}}]

    events = [{"ph": "X", "cat": "cpu_op", "name": "_DispatchStart", "ts": 0, "dur": 200, "tid": 1},
              {"ph": "X", "cat": "cpu_op", "name": "_ReturnStart", "ts": 0, "dur": 200, "tid": 3},
              *at("nvjet_sm90", 0, 10, 1, stream=7), *at("nvjet_sm90", 30, 10, 2, stream=7),
              *at("nvjet_sm90", 60, 40, 3, stream=7), *at("nvjet_sm90", 110, 10, 4, stream=7),
              *at("ncclDevKernel_AllToAll", 5, 30, 5, stream=20, tid=1),  # idle 10-30 beside it
              *at("ncclDevKernel_AllToAll", 8, 10, 6, stream=20, tid=3),  # started later: not the one named
              *at("ncclDevKernel_ReduceScatter", 35, 35, 7, stream=21),  # idle 40-60 beside it (and the copy)
              *at("Memcpy DtoH (Device -> Pinned)", 45, 60, 8, stream=22, cat="gpu_memcpy"),  # idle 100-105 beside it
              *at("nvjet_sm90", 0, 1, 9, stream=7, device=1)]  # another device's
    idle = compute_stream_idle(list(classified(events)))
    assert idle["0"] == {"compute_stream": 7, "span_ms": 0.12, "compute_busy_ms": 0.07,
                         "idle_ms": {"_DispatchStart": 0.02, "other collective": 0.02, "kernel on another stream": 0.005,
                                     "nothing": 0.005}}  # nothing at 105-110
    assert idle["1"]["compute_busy_ms"] == 0.001 and idle["1"]["idle_ms"] == {}


def test_warm_up_tokens_are_refused_without_warm_up_steps(monkeypatch):
    from attnpool.bench.e2e import check_arguments
    from attnpool.errors import ConfigError

    p = bench_arguments(monkeypatch, 2)
    assert p.parse_args(["--out", "x", "--warmup-tokens", "16K"]).warmup_tokens == 16384
    check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--warmup", "1", "--warmup-tokens", "1K"]))
    for bad in (["--warmup", "0", "--warmup-tokens", "1K"], ["--warmup", "1", "--warmup-tokens", "0"],
                ["--warmup", "1", "--warmup-tokens", "128K", "--configs", "prolong:128K,prolong:64K"]):
        with pytest.raises(ConfigError, match="at most each config's, with --warmup 1 or more") as err:
            check_arguments(p.parse_args(["--out", "x", "--device", "cpu", *bad]))
        assert err.value.field == "--warmup-tokens"
    with pytest.raises(ConfigError, match="sparse strategies warm up on full batches") as err:
        check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--warmup", "1", "--warmup-tokens", "1K",
                                      "--strategies", "local,cad+sparse"]))
    assert err.value.field == "--strategies" and err.value.value == "cad+sparse"


def test_the_links_rates_are_numbers_or_auto_refused_among_the_arguments(monkeypatch):
    """--exchange-gibps / --inter-node-gibps: GiB/s, or auto (each run measures at its start); anything else is
    refused by the parser or among the arguments, before a run sets up its process groups."""
    import pytest

    from attnpool.bench.e2e import check_arguments
    from attnpool.errors import ConfigError

    p = bench_arguments(monkeypatch, 2)
    args = p.parse_args(["--out", "x", "--device", "cpu", "--exchange-gibps", "Auto", "--inter-node-gibps", "40"])
    assert (args.exchange_gibps, args.inter_node_gibps) == ("auto", 40.0)
    check_arguments(args)
    with pytest.raises(SystemExit):  # (argparse: neither a number nor auto)
        p.parse_args(["--out", "x", "--exchange-gibps", "fast"])
    with pytest.raises(ConfigError, match="positive") as err:
        check_arguments(p.parse_args(["--out", "x", "--device", "cpu", "--inter-node-gibps", "0"]))
    assert err.value.field == "--inter-node-gibps"
