"""``attnpool eval``: accuracy of a trained checkpoint on held-out retrieval instances, by task, context and depth.

The checkpoint is read by one process (attnpool.train.export.read_checkpoint_model), whatever layout trained
it. Instances come from :func:`attnpool.data.retrieval.eval_instance`, a seed space training never draws from.
Several instances of one (task, context, depth) run in one forward as separate documents of one packed
sequence, planned ``local`` on one rank, so each attends only to itself, as in training. The attention is the
run's: vertical-slash sparse attention with the run's options where the run trained with it (``attention="dense"``
evaluates a sparse run densely; ``attention="sparse"`` a dense run with patterns, and a coverage or sparse length
other than the run's may be given: :func:`sparse_config_of`). Accuracy is the exact match of every answer token by
the most likely next token given the right earlier ones, which is what greedy decoding of the answer gives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from attnpool.data.retrieval import RETRIEVAL_VOCAB, TASKS, TaskShape, answer_correct, eval_instance, parse_tasks
from attnpool.errors import ConfigError

ATTENTIONS = ("trained", "dense", "sparse")
# The reference kernel's score block: up to 2^24 float32 elements, and at least one query row over every key.
REFERENCE_SCORE_ELEMENTS = 1 << 24


def forward_peak_bytes(config, tokens: int, context: int, bf16: bool) -> int:
    """About what one forward without gradients of ``tokens`` tokens (instances of ``context`` tokens) holds: the
    weights, the token ids (generated, then on the device, with positions), and one layer's largest moment: the
    residual stream and the norm's output beside q, k, v and attention's output, or beside the MLP's three
    ffn_dim-wide intermediates; plus the reference kernel's score block of one chunk of query rows."""
    a = 2 if bf16 else 4
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_token = 3 * 8 + a * 2 * config.dim + max(a * (2 * q + 2 * kv) + 4 * config.n_heads, 3 * a * config.ffn_dim)
    scores = 4 * max(REFERENCE_SCORE_ELEMENTS, config.n_heads * context)
    return 4 * config.num_params() + per_token * tokens + scores


def check_eval_fits(config, contexts, batch_tokens: int, device: torch.device) -> None:
    """Refuse, naming the context, one whose forward does not fit the device's memory (a GPU's, or this machine's
    for the CPU), before anything is generated."""
    if device.type == "cuda":
        capacity, where = torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    else:
        capacity, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    for context in contexts:
        tokens = max(1, batch_tokens // context) * context
        need = forward_peak_bytes(config, tokens, context, device.type == "cuda")
        if need > capacity:
            raise ConfigError("--contexts", context, f"a forward of {tokens} tokens needs about {need / 2**30:.1f} "
                                                     f"GiB, more than the {capacity / 2**30:.1f} GiB of {where}")


@dataclass(frozen=True)
class EvalCell:
    task: str
    context: int
    depth: float
    correct: int
    total: int
    # Sparse attention with needle_probe: the share of (instance, sparse layer) pairs whose pattern lets the
    # first answer query attend to the asked value's first token in some head (None: not probed).
    needle_kept: float | None = None
    # Sparse attention: the share of the causal (query, key) pairs the sparse layers' patterns computed over these
    # instances (runtime.sparse.SparseStats: an upper bound by a little, slash tiles counted whole; documents below
    # the sparse length count dense; the dense_layers are not counted); dense attention: 1.0
    density: float = 1.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


def sparse_config_of(settings: dict, attention: str, **options):
    """The SparseConfig to evaluate a run with (None: dense). ``trained``: the run's own attention; ``sparse``:
    vertical-slash with the run's sparse options, or, for a run trained dense, with those its settings hold
    (defaults unless given): the patterns then exist at evaluation only. ``options`` (SparseConfig's fields, e.g.
    ``coverage``, ``min_doc_len``; None: the run's) replace the run's; they are refused with dense attention."""
    import dataclasses

    from attnpool.train.config import KEYS, TrainConfig

    if attention not in ATTENTIONS:
        raise ConfigError("attention", attention, f"choose one of {', '.join(ATTENTIONS)}")
    options = {k: v for k, v in options.items() if v is not None}
    if attention == "dense" and not options:
        return None  # (whatever the run's settings hold)
    config = TrainConfig(**{k: v for k, v in settings.items() if k in KEYS})
    sparse = config.sparse.sparse_config()
    if attention == "sparse" and sparse is None:
        sparse = dataclasses.replace(config.sparse, mode="vertical-slash").sparse_config()
    if attention == "dense" or sparse is None:
        for name, value in options.items():
            raise ConfigError(f"sparse_{name}", value, "only with sparse attention: attention dense has no patterns"
                              if attention == "dense" else "only with sparse attention: the run trained dense (attention "
                                                           "sparse, attnpool eval's --attention sparse, evaluates it "
                                                           "with patterns)")
        return None
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(sparse) if f.init})
    if unknown:
        raise ConfigError("sparse options", unknown[0], "not an option of sparse attention")
    return dataclasses.replace(sparse, **options) if options else sparse


class NeedleProbe:
    """Core attention that also estimates each sparse layer's patterns as the runtime does (the same function
    of the same queries and keys, so the same patterns) and counts, per instance, the layers whose pattern lets
    the first answer query reach the asked value's key column in at least one head: does the online estimate
    keep the needle?"""

    def __init__(self, attention, sparse, group):
        self.attention, self.sparse, self.group = attention, sparse, group
        self.kept = np.zeros(len(group))
        self.layers = 0

    def __call__(self, q, k, v, *, layer=None):
        from attnpool.sparse import estimate_vertical_slash

        out = self.attention(q, k, v, layer=layer)
        if layer is not None and not self.sparse.is_sparse_layer(layer):
            return out
        n = len(self.group[0].tokens)
        lens = [n] * len(self.group)
        m = min(n, self.sparse.last_queries)
        rows = torch.cat([torch.arange((j + 1) * n - m, (j + 1) * n) for j in range(len(self.group))]).to(q.device)
        cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device) * m
        cu_k = torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device) * n
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            pattern = estimate_vertical_slash(q[rows], k, cu_q, cu_k, self.sparse, k_lens_host=lens)
        for j, inst in enumerate(self.group):  # a document below the sparse length is dense: it keeps everything
            query = inst.answer.start - 1
            self.kept[j] += bool(pattern.dense[j]) or bool(
                pattern.mask(j, 1, query + 1, device=q.device)[:, 0, inst.value].any())
        self.layers += 1
        return out


# What an evaluation scores: not copy, a warm-up whose answer is a span that starts where nothing in the prompt marks
EVALUATED_TASKS = tuple(t for t in TASKS if t != "copy")


def evaluated_tasks(tasks, *, from_run: bool = False) -> tuple[str, ...]:
    """The tasks an evaluation scores: ``tasks`` parsed ("all": every one but copy), copy refused by name.
    ``from_run``: ``tasks`` are a run's training tasks, copy left out of them (passkey where none is left)."""
    if tasks == "all":
        return EVALUATED_TASKS
    names = parse_tasks(tasks)
    if from_run:
        return tuple(t for t in names if t != "copy") or ("passkey",)
    if "copy" in names:
        raise ConfigError("tasks", "copy", f"a warm-up, its answer a span the prompt does not mark: not evaluated; "
                                           f"choose from {', '.join(EVALUATED_TASKS)} or all")
    return names


def check_contexts(contexts, *, key_len: int = 4, num_keys: int = 4, hops: int = 2, filler: str = "random") -> None:
    """Refuse, naming it, a context the tasks' instances do not fit (before any is evaluated)."""
    for context in contexts:
        TaskShape(context, key_len, num_keys, hops, filler=filler)


@torch.no_grad()
def evaluate_retrieval(model, *, tasks=TASKS, contexts=(4096,), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
                       instances: int = 20, seed: int = 0, sparse=None, device="cpu", batch_tokens: int = 65536,
                       key_len: int = 4, num_keys: int = 4, hops: int = 2, filler: str = "random",
                       needle_probe: bool = False, progress=None) -> list[EvalCell]:
    """Accuracy per (task, context, depth) over ``instances`` held-out instances each (their filler ``filler``, as
    the model was trained on: attnpool.data.retrieval); with sparse attention and ``needle_probe``, also how often
    the patterns keep the needle (:class:`NeedleProbe`)."""
    from attnpool.plan import linear_table, plan_attention
    from attnpool.runtime import CoreAttention, plan_layer_kinds
    from attnpool.runtime.sparse import SparseStats

    device = torch.device(device)
    tasks = evaluated_tasks(tasks)
    check_contexts(contexts, key_len=key_len, num_keys=num_keys, hops=hops, filler=filler)
    if instances < 1:
        raise ConfigError("instances", instances, "must be >= 1")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ConfigError("depths", bad[0], "every depth must be in [0, 1]")
    if model.output_weight.shape[0] < RETRIEVAL_VOCAB:
        raise ConfigError("model", f"vocab_size={model.output_weight.shape[0]}",
                          f"the retrieval tasks use token ids below {RETRIEVAL_VOCAB}")
    model = model.to(device).eval()
    config = getattr(model, "config", None)  # (a stand-in model without one computes causal attention)
    kinds = config.layer_kinds() if hasattr(config, "layer_kinds") else ()
    kinds_differ = any(not kind.causal for kind in kinds)
    if kinds_differ and sparse is not None:
        raise ConfigError("sparse", "enabled", "sparse attention computes causal attention only; the model's layers "
                                               "have sliding windows or soft-caps")
    bf16 = device.type == "cuda"
    cells = []
    for context in contexts:
        shape = TaskShape(context, key_len, num_keys, hops, filler=filler)
        per_call = max(1, batch_tokens // shape.context)
        for task in tasks:
            for depth in depths:
                correct, kept, probed = 0, 0.0, 0
                stats = SparseStats() if sparse is not None else None
                for first in range(0, instances, per_call):
                    group = [eval_instance(task, shape, depth, i, seed) for i in range(first, min(instances, first + per_call))]
                    tokens = torch.from_numpy(np.concatenate([g.tokens for g in group])).to(device)
                    positions = torch.arange(shape.context, device=device).repeat(len(group))
                    table = linear_table([shape.context] * len(group), 1)
                    if kinds_differ:  # each layer its kind's plan (sparse attention refused with kinds, above)
                        attention = plan_layer_kinds(kinds, table, "local", cost_model="pairs")
                    else:
                        attention = CoreAttention(plan_attention(table, "local", cost_model="pairs"), None, sparse=sparse,
                                                  sparse_stats=stats)
                    probe = NeedleProbe(attention, sparse, group) if needle_probe and sparse is not None else None
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                        hidden = model(tokens, positions, probe or attention, return_hidden=True)
                        rows = torch.cat([torch.arange(g.answer.start - 1, g.answer.stop - 1) + j * shape.context
                                          for j, g in enumerate(group)]).to(device)
                        logits = torch.nn.functional.linear(hidden[rows], model.output_weight).float().cpu().numpy()
                    lengths = [g.answer.stop - g.answer.start for g in group]  # (a copy's answer is its span)
                    correct += sum(answer_correct(part, g)
                                   for part, g in zip(np.split(logits, np.cumsum(lengths)[:-1]), group))
                    if probe is not None and probe.layers:
                        kept += float(probe.kept.sum()) / probe.layers
                        probed += len(group)
                sums = stats.values() if stats is not None else None
                cells.append(EvalCell(task, shape.context, float(depth), correct, instances,
                                      kept / probed if probed else None,
                                      sums[3] / sums[4] if sums is not None and sums[4] else 1.0))
                if progress is not None:
                    progress(cells[-1])
    return cells


def by_context(cells: list[EvalCell]) -> dict[tuple[str, int], float]:
    """Accuracy per (task, context) over all depths."""
    out: dict[tuple[str, int], list[int]] = {}
    for c in cells:
        acc = out.setdefault((c.task, c.context), [0, 0])
        acc[0] += c.correct
        acc[1] += c.total
    return {key: ok / n for key, (ok, n) in out.items()}


def write_results(cells: list[EvalCell], out_dir: str, meta: dict) -> tuple[str, str]:
    """``eval.json`` (every cell, the accuracy by context, ``meta``) and ``eval.png`` (a heat map per task:
    depth by context) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, png_path = os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "eval.png")
    doc = {**meta,
           "cells": [{"task": c.task, "context": c.context, "depth": c.depth, "correct": c.correct, "total": c.total,
                      "accuracy": c.accuracy, "needle_kept": c.needle_kept, "density": c.density} for c in cells],
           "by_context": [{"task": t, "context": n, "accuracy": a} for (t, n), a in by_context(cells).items()]}
    with open(json_path, "w") as fh:
        json.dump(doc, fh, indent=1)
    plot_heatmap(cells, png_path, meta.get("title", ""))
    return json_path, png_path


def plot_heatmap(cells: list[EvalCell], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c.task for c in cells))
    contexts = sorted({c.context for c in cells})
    depths = sorted({c.depth for c in cells})
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.2 + 1.1 * len(contexts) * len(tasks), 0.5 * len(depths) + 1.6),
                             squeeze=False)
    for n, (ax, task) in enumerate(zip(axes[0], tasks)):
        grid = np.full((len(depths), len(contexts)), np.nan)
        for c in cells:
            if c.task == task:
                grid[depths.index(c.depth), contexts.index(c.context)] = c.accuracy
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), a in np.ndenumerate(grid):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(contexts)), [_size(n) for n in contexts], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
        ax.set_xlabel("context (tokens)")
        if n == 0:
            ax.set_ylabel("depth of the needle")
        ax.set_title(task, fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10, y=1.04)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def format_table(cells: list[EvalCell]) -> str:
    """Plain text: a row per (task, depth), a column per context, and each task's mean over depths; under sparse
    attention, a last row of the patterns' density per context (over every task and depth)."""
    contexts = sorted({c.context for c in cells})
    lines = [f"{'task':<10} {'depth':>6} " + " ".join(f"{_size(n):>7}" for n in contexts)]
    acc = {(c.task, c.depth, c.context): c.accuracy for c in cells}
    mean = by_context(cells)
    for task in dict.fromkeys(c.task for c in cells):
        for depth in sorted({c.depth for c in cells if c.task == task}):
            lines.append(f"{task:<10} {depth:>6g} " + " ".join(
                f"{acc.get((task, depth, n), float('nan')):>7.2f}" for n in contexts))
        lines.append(f"{task:<10} {'all':>6} " + " ".join(f"{mean.get((task, n), float('nan')):>7.2f}" for n in contexts))
    if any(c.density < 1.0 for c in cells):
        density = {n: sum(c.density * c.total for c in cells if c.context == n) /
                   sum(c.total for c in cells if c.context == n) for n in contexts}
        lines.append(f"{'density':<10} {'':>6} " + " ".join(f"{density[n]:>7.2f}" for n in contexts))
    return "\n".join(lines)
