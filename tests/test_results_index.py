"""bench/results: its index is current with the results and the docs that cite them, and it holds results only."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _results_index():
    spec = importlib.util.spec_from_file_location("results_index", os.path.join(ROOT, "bench", "results_index.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_index_is_current():
    index = _results_index()
    with open(os.path.join(index.RESULTS, index.INDEX), encoding="utf-8") as fh:
        assert fh.read() == index.build_index(), "bench/results/INDEX.md is stale: python3 bench/results_index.py"


def test_bench_results_holds_results_not_patches():
    kept = [n for n in os.listdir(os.path.join(ROOT, "bench", "results")) if n.endswith((".patch", ".diff", ".py"))]
    assert not kept, f"code changes belong in bench/experiments, not bench/results: {kept}"
