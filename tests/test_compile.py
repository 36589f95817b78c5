"""``compile``: the layers' linear parts under torch.compile train as the eager model does (float32, CPU)."""

from __future__ import annotations

import pytest

from attnpool.errors import ConfigError
from dist_harness import run_distributed
from test_parallel import _losses
from test_train import rel_diff, tiny_config


def _losses_and_graphs(rank, world, out, runs):
    """Each run's losses, and after each step how many graphs torch.compile has made in this process."""
    import torch._dynamo

    from attnpool.train import train

    results = {}
    for name, kw in runs:
        graphs = []
        result = train(tiny_config(f"{out}/{name}", **kw),
                       on_step=lambda: graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
        results[name] = [r["loss"] for r in result.rows], graphs
    return results


def test_compiled_linear_parts_train_as_eager(tmp_path):
    """One process, with what the compiled parts must live with: linear recompute (their backward runs the
    compiled code again, in chunks), ping-pong (two nano-batches, whose sizes change every step), full recompute; then dp=2 (FSDP2 around the compiled blocks)
    against the eager dp=2. Every layer shares the compiled graphs: after the second step's shapes (dynamic from
    then on) no step compiles again."""
    runs = [("keep", dict(activation_checkpointing="keep_attention", steps=3)),
            ("pingpong-full", dict(attention="cad", pingpong=True, activation_checkpointing="full", steps=5))]
    eager = run_distributed(_losses, 1, str(tmp_path / "eager"), 1, runs)[0]
    compiled = run_distributed(_losses_and_graphs, 1, str(tmp_path / "compiled"),
                               [(n, {**kw, "compile": True}) for n, kw in runs])[0]
    for name, kw in runs:
        losses, graphs = compiled[name]
        assert len(losses) == kw["steps"]
        assert rel_diff(losses, eager[name]) <= 1e-5, name
        assert graphs[-1] == graphs[1], (name, graphs)  # nothing compiled after the second step
    dp_runs = [("keep", dict(attention="cad", activation_checkpointing="keep_attention", steps=3))]
    dp_eager = run_distributed(_losses, 2, str(tmp_path / "dp-eager"), 1, dp_runs)[0]
    dp_compiled = run_distributed(_losses, 2, str(tmp_path / "dp"), 1, [("keep", dict(dp_runs[0][1], compile=True))])[0]
    assert rel_diff(dp_compiled["keep"], dp_eager["keep"]) <= 1e-5


@pytest.mark.parametrize("overrides", [dict(model="hf:/nonexistent", model_args={}, model_impl="transformers"),
                                       dict(tp=2)])
def test_compile_is_refused_where_it_is_not_exact(overrides):
    with pytest.raises(ConfigError) as err:
        tiny_config("unused", compile=True, **overrides)
    assert err.value.field == "compile"
