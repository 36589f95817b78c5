"""``compile``: the layers' linear parts under torch.compile train as the eager model does (float32, CPU)."""

from __future__ import annotations

import pytest

from attnpool.errors import ConfigError
from dist_harness import run_distributed
from test_parallel import _losses
from test_train import rel_diff, tiny_config


def _losses_and_graphs(rank, world, out, runs):
    """Each run's losses, after each step how many graphs torch.compile has made in this process, and each step's
    compile_s."""
    import torch._dynamo

    from attnpool.train import train

    results = {}
    for name, kw in runs:
        graphs = []
        result = train(tiny_config(f"{out}/{name}", **kw),
                       on_step=lambda: graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
        s = result.summary
        results[name] = ([r["loss"] for r in result.rows], graphs, [r["compile_s"] for r in result.rows],
                         (s["compile_s_total"], s["compiled_steps"]))
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
        losses, graphs, compile_s, (total, compiled_steps) = compiled[name]
        assert len(losses) == kw["steps"]
        assert rel_diff(losses, eager[name]) <= 1e-5, name
        assert graphs[-1] == graphs[1], (name, graphs)  # nothing compiled after the second step
        # the steps that made graphs are those whose compile time the run records
        made = [after > before for before, after in zip(graphs, graphs[1:])]
        assert [seconds > 0 for seconds in compile_s[1:]] == made, (name, graphs, compile_s)
        assert total == pytest.approx(sum(compile_s))
        assert compiled_steps == [step for step, seconds in enumerate(compile_s, 1) if seconds > 0]
    assert compiled[runs[0][0]][2][0] > 0  # (the process's first step compiles every graph)
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


def test_compile_clock_times_compiles_and_recompiles_only():
    """CompileClock: the first call's compile and a recompile for a new shape are timed, a call that compiles nothing
    is not, and the clock's callbacks are gone once it is left."""
    import torch
    import torch._dynamo

    from attnpool.parallel.compile import CompileClock

    torch._dynamo.reset()
    double = torch.compile(lambda x: (x * 2).sum())
    with CompileClock() as clock:
        double(torch.ones(4, 3))
        first = clock.take()
        double(torch.ones(4, 3))
        again = clock.take()
        double(torch.ones(8, 3))  # a new size: compiled again, with the first dimension dynamic
        new_shape = clock.take()
    assert first > 0 and new_shape > 0 and again == 0
    assert clock._started not in torch._dynamo.callback_handler.start_callbacks
    assert clock._ended not in torch._dynamo.callback_handler.end_callbacks


def test_steady_throughput_leaves_out_steps_that_compiled():
    """The summary's steady rate is the median over steps after the warm-up that compiled nothing, and says which it
    left out; where every such step compiled, all of them count."""
    from attnpool.train.metrics import summarize

    def row(step, seconds, compile_s):
        return dict(step=step, loss=1.0, tokens=100, step_time_s=seconds, compile_s=compile_s, mfu=None,
                    imbalance_before=1.0, imbalance_after=1.0, attention_time_s=None, comm_time_s=0.0, comm_bytes=0,
                    peak_memory_bytes=1)

    rows = [row(1, 9.0, 8.0), row(2, 1.0, 0.0), row(3, 1.0, 0.0), row(4, 5.0, 4.0), row(5, 2.0, 0.0)]
    summary = summarize(rows, None, {})
    assert summary["steady_tokens_per_s"] == 75.0  # the median of steps 3 and 5: 100 and 50 tokens/s
    assert summary["steady_steps_left_out"] == [4] and summary["compiled_steps"] == [1, 4]
    assert summary["compile_s_total"] == 12.0
    every = summarize([row(1, 9.0, 8.0), row(2, 1.0, 0.0), row(3, 4.0, 3.0)], None, {})
    assert every["steady_tokens_per_s"] == 25.0 and every["steady_steps_left_out"] == []
    eager = summarize([dict(r, compile_s=None) for r in rows], None, {})
    assert eager["compile_s_total"] is None and eager["steady_tokens_per_s"] == 50.0  # steps 3-5: 100, 20, 50
