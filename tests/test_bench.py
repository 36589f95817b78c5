"""`attnpool bench` end to end on CPU (gloo, tiny model): the GPU benchmark's own logic, in CI."""

import json
import subprocess
import sys


def test_bench_runs_every_strategy_and_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "attnpool.cli.main", "bench",
           "--device", "cpu", "--model", "tiny", "--layers", "1", "--configs", "prolong:1K", "--strategies",
           "local,cad,cad+pingpong,local+sparse,cad+sparse,cad+sparse+readkv", "--warmup", "1", "--steps", "1", "--ablation",
           "--trace", "cad", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = json.loads((tmp_path / "e2e.json").read_text())["records"]
    names = [rec["strategy"] for rec in records]
    assert names == ["local", "cad", "cad+pingpong", "local+sparse", "cad+sparse", "cad+sparse+readkv",
                     "cad+pingpong (1-element messages)"]
    for rec in records:
        for key in ("strategy", "dist", "tokens_per_gpu", "step_time_s", "tokens_per_s", "speedup_vs_local",
                    "speedup_vs_local_total", "total_time_s", "plan_time_s",
                    "efficiency", "mfu", "imbalance_after", "bytes_sent_per_gpu", "peak_memory_bytes"):
            assert key in rec
    assert all(rec["loss_ok"] for rec in records[:6])  # same batches, same initial weights
    assert records[0]["attention_density"] is None and 0 < records[4]["attention_density"] <= 1
    assert (tmp_path / "trace-prolong-1K-cad.txt").read_text().strip()  # the profiled extra step
    assert (tmp_path / "trace-prolong-1K-cad.json.gz").stat().st_size > 0
    assert "| prolong | 1K | cad |" in (tmp_path / "e2e.md").read_text()


def test_bench_without_activation_checkpointing_says_so(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "attnpool.cli.main", "bench",
           "--device", "cpu", "--model", "tiny", "--layers", "1", "--configs", "prolong:1K", "--strategies", "local,cad",
           "--warmup", "0", "--steps", "1", "--activation-checkpointing", "none", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "e2e.json").read_text())["meta"]
    assert meta["command"].endswith("--activation-checkpointing none")
    assert "activation checkpointing off" in (tmp_path / "e2e.md").read_text()
