#!/usr/bin/env python3
"""Does sparse training keep long-range quality? Dense and vertical-slash training on retrieval tasks (issue 26).

The same Llama-style model (189M parameters: 16 layers, dim 1024, 8 query / 4 KV heads of 128, vocab 128), the same
initial weights (seed) and the same batches (``--data retrieval``, answer-only loss), trained three times: dense,
and vertical-slash sparse at coverages 0.95 and 0.9. A curriculum of rising context (256, 1K, 4K, 8K, 16K tokens per
document; 16K tokens a step up to 1K, then 64K, and 128K at 16K; ``--max-context`` 32K or 64K carries it on at 128K
tokens a step) teaches dense attention the look-up at short contexts, where a step holds many documents (copies of
random spans beside passkeys, RoPE base 1e4), then carries it out to the longest (passkeys and multi-key needles
with every key asked, RoPE base 5e5, as long-context extension raises it, both first at 256 tokens; why: the comment
on ``GPU_CURRICULUM``).
Documents of at least 8K tokens (``--sparse-min-doc-len``) are sparse in the sparse runs, so the stages before are
the same in every run: they are trained once, and the sparse runs continue from a copy of the dense run at that
point (weights, optimizer, data position), as sparse training that continues a dense model's would. ``--mix-from N``
mixes document lengths from N up to each later stage's context (``min_context``); a stage mixing lengths up to
exactly the sparse threshold then counts as shared (its rare documents of that length are trained dense in every
run).
Each stage is one ``attnpool train`` process resuming the last one's checkpoint (the schedule spans all
stages; ``--stop-at`` ends each). Then every run is evaluated on held-out instances at every trained context
from 4K up (``attnpool.train.evaluate``, each run with the attention it trained with).

The filler (``--filler``) is random words or real text. Over random words a model's attention spreads wide, so
sparse patterns that cover 90-95% of it keep most blocks (density 0.90-0.955 at 8K-16K on 2026-11-27). Over
text, trained as language in the first stage (``--loss all-first``), it may concentrate as a language model's
does: the sparse patterns' density at each context is measured and recorded beside the accuracy (issue 45). On
2026-11-28 it did not, at 32K and 64K (density 0.89 and 0.70 at coverage 0.9). Capped patterns did: on
2026-11-29, at evaluation on a dense-trained model, ``slash_cap=128 vertical_cap=512`` kept dense's 64K accuracy
(0.92) at density 0.017.

A run of the script ended by its budget goes on where it stopped when called again with the same ``--work``
(finished stages are skipped, finished evaluations read back from ``RUN/retrieval-eval.json``), so the
experiment can span several shorter calls; ``WORK/retrieval-log.jsonl`` logs every call and what it ran, and the
record holds that log (``log``).

Writes to ``--out``: ``<date>-<gpu>-retrieval.json`` (``-retrieval-text`` with text filler; ``results``: a list of
``{"attention", "coverage", "context", "accuracy", "density"}``, passkey accuracy over all depths and the sparse
layers' measured density there, 1.0 dense; ``details``: every task and depth; ``coverage_sweep``: with
``--eval-coverages``, every run evaluated again with vertical-slash patterns at each of those coverages, at
evaluation only, with each set of ``--eval-sparse-args``' options over the sparse runs' ``--sparse-args``;
``losses``: every run's per-step training loss), a Markdown file of the same name with the commands, the model, the loss curves and the accuracy heat maps (PNGs next to it). Runs and
checkpoints go to ``--work`` (a temporary directory by default).

    PYTHONPATH=src python3 bench/retrieval.py --out bench/results                 # one GPU, ~20 minutes
    PYTHONPATH=src python3 bench/retrieval.py --out /tmp/r --device cpu           # smoke test, tiny model, 1-2 min
    PYTHONPATH=src python3 bench/retrieval.py --out bench/results --filler text --loss all-first \
        --max-context 64K --sparse-min-doc-len 32K --coverages 0.9,0.8 --eval-min-context 32K  # real sparsity

``--budget-s`` (default 1140) bounds the whole script's wall time: no stage or evaluation starts after it is
spent (whatever was evaluated is written, the unfinished named); ``--deadline-s`` stops a stage still running
then with SIGTERM, which checkpoints it, so that a machine's wall limit need not cut one unsaved; no stage starts
within START_MARGIN_S (60 s) of it, nor an evaluation that would not end before it, and a stopped stage is killed
if it has not ended STOP_GRACE_S (120 s) after its SIGTERM (a call to the GPU machine: ``--deadline-s`` at least
the grace, the record's writing and some margin under its limit, ``--budget-s`` below that). ``--steps-scale`` scales every
stage's steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TASKS = "copy,passkey"

GPU_MODEL = dict(dim=1024, n_layers=16, n_heads=8, n_kv_heads=4, ffn_dim=2816, vocab_size=128, max_position=65536,
                 rope_theta=10000.0)


class Stage(NamedTuple):
    """One stage of the curriculum: documents of ``context`` tokens, ``tokens`` a step for ``steps`` steps, of
    ``tasks`` (None: the default; ``--tasks`` replaces every stage's) with ``data_args`` beside them, and
    RoPE's base ``rope_theta`` from this stage on (None: the model's)."""

    context: int
    steps: int
    tokens: int
    tasks: str | None = None
    rope_theta: float | None = None
    data_args: tuple[str, ...] = ()
    loss: str = "answer"  # the targets: the answers' tokens or every token (set from --loss as the stages run)


# Many short documents a step first, then longer ones. The first stage grows the look-up: 256-token
# documents, 64 a step, ~45% of them copies (the ``copy`` task: a span repeated, every copied token supervised).
# The loss sits on a plateau near ln 96 (the span symbols' chance) until an induction-style look-up forms, then
# falls to ~0.05 within a few hundred steps: on an H200 this model left it after ~900-1,300 steps with lr 3e-4
# and rope_theta 1e4, and stayed on it for 1,800 steps with lr 1e-3; with rope_theta 5e5, lr 6e-4 and 64K-token
# steps it stayed on it for 400 (bench/results/2026-11-26-h200-retrieval.md). Short steps buy the most updates
# for the time.
# Once the look-up has formed, two things carry it far back (the 2026-11-26 run, RoPE base 1e4 and copies to
# the end, answered only where the key lay within ~4-8K tokens of the question):
# - RoPE's base is raised to 5e5 (as long-context extension does): with 1e4 even the slowest of a 128-dim
#   head's 64 rotations turns 1.9 radians over 16K tokens, so no part of q.k stays a pure content match that
#   far; with 5e5, 16 of them turn less than 1 radian over 16K.
# - The tasks become passkeys and multi-key needles with every key asked (queries=4): a copy supervises
#   thousands of tokens a document to a passkey's 4, so with copies in the batch the long look-up's gradient
#   was a thousandth of the loss's.
# 8 documents a step at 16K: with 4, the 2026-11-26 run lost the look-up moving there.
# Both changes happen first at 256 tokens (the second stage), where a step holds 64 documents and four times the
# answers' tokens of a 1K step, and only then do documents grow. Made in one move at 1K together with the switch of
# the loss to the answers alone (--loss all-first), they left the answers' loss at chance for ~210 steps before
# the look-up formed on 2026-11-28, and for all 730 steps of its rerun from the same seed
# (bench/results/2026-11-29-h200x2-retrieval-text-rerun.md).
LOOKUP_TASKS = "passkey,multikey"
LOOKUP_ARGS = ("queries=4",)
GPU_CURRICULUM = (Stage(256, 1600, 16384, "copy,passkey"),
                  Stage(256, 300, 16384, LOOKUP_TASKS, 5e5, LOOKUP_ARGS),
                  Stage(1024, 300, 16384, LOOKUP_TASKS, 5e5, LOOKUP_ARGS),
                  Stage(4096, 150, 65536, LOOKUP_TASKS, 5e5, LOOKUP_ARGS),
                  Stage(8192, 120, 65536, LOOKUP_TASKS, 5e5, LOOKUP_ARGS),
                  Stage(16384, 100, 131072, LOOKUP_TASKS, 5e5, LOOKUP_ARGS))
# Beyond 16K (--max-context 32K or 64K, issue 45): 4 and then 2 documents a step. These stages run late in the
# cosine schedule, at about its floor (min_lr_ratio 0.1), where the 16K stage of the 2026-11-27 run had already
# carried the look-up it learnt at 8K out to 16K (accuracy 0.99): the raised base makes it reach that far.
GPU_LONG_STAGES = (Stage(32768, 60, 131072, LOOKUP_TASKS, 5e5, LOOKUP_ARGS),
                   Stage(65536, 50, 131072, LOOKUP_TASKS, 5e5, LOOKUP_ARGS))
# Sparse from 8K-token documents by default: the 4K stage is shared by every run (one H200's ~30 minutes hold the
# dense run and two sparse ones this way); --sparse-min-doc-len 32K shares everything up to 16K.
GPU = dict(lr=3e-4, warmup_steps=30, sparse_min_doc_len=8192, sparse_args={},
           eval_instances=40, eval_depths=(0.0, 0.25, 0.5, 0.75, 1.0), eval_min_context=4096)

# The smoke test: the tiny preset cut to 2 layers, 128- and 256-token documents, sparse from 256 tokens with
# patterns scaled down to those lengths (as bench/sparse_quality.py), the RoPE base raised in the second stage.
CPU_MODEL = dict(n_layers=2, vocab_size=128)
CPU_CURRICULUM = (Stage(128, 2, 512), Stage(256, 2, 1024, rope_theta=5e5))
CPU_LONG_STAGES = (Stage(512, 2, 1024, rope_theta=5e5),)
CPU = dict(lr=3e-3, warmup_steps=1, sparse_min_doc_len=192,
           sparse_args=dict(block=16, vertical_chunk=16, last_queries=32, sink_tokens=4, local_window=32,
                            slash_cap=32, vertical_cap=64),
           eval_instances=2, eval_depths=(0.0, 1.0), eval_min_context=256)


def stage_name(index: int, stage: Stage, stop_at: int) -> str:
    """How messages name a stage: its context and steps (two stages may share a context)."""
    return f"stage {index + 1} ({tokens_text(stage.context)}, steps {stop_at - stage.steps + 1}-{stop_at})"


def tokens_text(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def train_command(run_dir: str, attention: str, coverage: float | None, stage: Stage, stop_at: int,
                  steps: int, resume: bool, args, setup: dict, model: dict) -> list[str]:
    model_args = dict(model, **({"rope_theta": stage.rope_theta} if stage.rope_theta else {}))
    cmd = [sys.executable, "-m", "attnpool.cli.main", "train", "--model", "tiny",
           "--model-args", *[f"{k}={v}" for k, v in model_args.items()],
           "--data", "retrieval", "--data-args", f"task={stage.tasks}", f"context={stage.context}",
           *([f"min_context={args.mix_from}"] if args.mix_from and stage.context > args.mix_from else []),
           *stage.data_args, f"num_docs={args.num_docs}", f"ordinary={args.ordinary}", f"filler={args.filler}",
           f"loss={stage.loss}",
           "--tokens-per-rank", str(stage.tokens), "--seed", str(args.seed),
           "--attention", "local", "--device", args.device, "--steps", str(steps), "--stop-at", str(stop_at),
           "--lr", str(setup["lr"]), "--warmup-steps", str(setup["warmup_steps"]), "--out", run_dir,
           "--checkpoint-every", "0", "--keep-checkpoints", "1", "--no-progress"]
    if args.activation_checkpointing != "none":
        cmd += ["--activation-checkpointing", args.activation_checkpointing]
    if args.deterministic:
        cmd += ["--deterministic"]
    if resume:  # a later stage: longer documents and steps, maybe other tasks and RoPE base, the same schedule
        cmd += ["--resume", "--allow-config-change"]
    if attention == "sparse":
        cmd += ["--sparse", "vertical-slash", "--sparse-coverage", str(coverage),
                "--sparse-min-doc-len", str(setup["sparse_min_doc_len"])]
        if setup["sparse_args"]:
            cmd += ["--sparse-args", *[f"{k}={v}" for k, v in setup["sparse_args"].items()]]
    return cmd


def check_stage(ap, cmd: list[str]) -> None:
    """The parser's error where ``attnpool train`` would refuse a stage's command (``cmd``, as train_command makes
    it) for its settings or its data's: before any stage trains, and before ``--work`` records the settings."""
    from attnpool.cli.main import build_parser
    from attnpool.cli.train_cmd import config_from_args
    from attnpool.errors import ConfigError
    from attnpool.model import model_spec
    from attnpool.train.data_source import build_source, check_documents_fit

    try:
        config = config_from_args(build_parser().parse_args(cmd[cmd.index("train"):]))
        source = build_source(config, model_spec(config.model.name, config.model.args, config.data.max_doc_len,
                                                 config.model.impl))
        check_documents_fit(config, source, dp=1)  # (a stage trains in one process: train_command gives no --nproc)
    except ConfigError as exc:
        ap.error(f"a stage's attnpool train would refuse {exc}")


# A stage does not start this close to --deadline-s (it could not make a step and checkpoint before it; a SIGTERM
# while it still imports would end it unsaved), and one stopped there has this long to checkpoint before a SIGKILL.
START_MARGIN_S = 60.0
STOP_GRACE_S = 120.0


class Clock:
    """The script's time: no stage or evaluation starts once ``budget_s`` is spent; a stage still running at
    ``deadline_s`` is stopped (``stopped`` then), none starts within START_MARGIN_S of it, and no evaluation that
    would not end before it, judged by the longest one so far (its checkpoint's loading counted) and at least
    START_MARGIN_S."""

    def __init__(self, budget_s: float, deadline_s: float | None):
        self.start, self.budget_s, self.deadline_s = time.perf_counter(), budget_s, deadline_s
        self.stopped, self.longest_evaluation = False, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def stage_seconds_left(self) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - self.elapsed()

    def may_start_stage(self) -> bool:
        return not self.stopped and self.elapsed() < self.budget_s and (
            self.deadline_s is None or self.elapsed() < self.deadline_s - START_MARGIN_S)

    def may_start_evaluation(self) -> bool:
        return not self.stopped and self.elapsed() < self.budget_s and (
            self.deadline_s is None or self.elapsed() + max(self.longest_evaluation, START_MARGIN_S) < self.deadline_s)

    def evaluated(self, seconds: float) -> None:
        self.longest_evaluation = max(self.longest_evaluation, seconds)

    def why_not(self, evaluation: bool = False) -> str:
        if self.stopped:
            return "--deadline-s reached"
        if self.elapsed() >= self.budget_s:
            return "budget spent"
        return "too close to --deadline-s" + (" for its length" if evaluation else "")


def copy_run(src: str, dst: str) -> None:
    """``dst`` a copy of the run directory ``src``, whole or not at all (copied beside it, then renamed)."""
    part = dst + ".copying"
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(src, part)
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(part, dst)


def sparse_options(ap, flag: str, items: list[str], base: dict) -> dict:
    """``base`` with the ``K=V`` pattern options over it (sizes as numbers, 4K and the like read), refused with the
    parser's error naming ``flag`` where one is not one of attnpool train's ``sparse_args`` (coverage and the
    sparse length have flags of their own here) or the two do not go together."""
    from attnpool.errors import ConfigError
    from attnpool.sizes import parse_size
    from attnpool.train.sections import SparseSection

    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            ap.error(f"{flag} {item!r}: not K=V")
        try:
            options[key] = parse_size(value)
        except ValueError:
            options[key] = value
    try:  # as attnpool train will read them, before any stage trains
        SparseSection(mode="vertical-slash", args={**base, **options}).sparse_config()
    except (ConfigError, TypeError) as exc:
        ap.error(f"{flag} {' '.join(items)}: {exc}")
    return {**base, **options}


def coverage_list(ap, flag: str, text: str) -> list[float]:
    """A comma list of coverages, each in (0, 1], or the parser's error naming ``flag``."""
    try:
        values = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        ap.error(f"{flag} {text!r}: not a comma list of numbers")
    if any(not 0 < c <= 1 for c in values):
        ap.error(f"{flag} {text!r}: each must be in (0, 1]")
    return values


def run_stage(cmd: list[str], env: dict, seconds: float | None) -> tuple[subprocess.CompletedProcess, bool]:
    """The stage's ``attnpool train`` to its end, or, still running after ``seconds``, stopped with SIGTERM (it
    finishes its step and checkpoints, so a later call goes on from there; killed if it has not ended
    STOP_GRACE_S later); and whether it was stopped."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=None if seconds is None else max(seconds, 0.0))
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:  # (no checkpoint within the grace: ended unsaved)
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), True


def run_evaluations(run_dir: str, key: dict, labels: list[str], evaluate, may_start,
                    said) -> tuple[dict, list[tuple[str, str | None]]]:
    """The run's evaluations by label, in ``labels``' order: read back from ``RUN/retrieval-eval.json`` where an
    earlier call made them with this ``key``, else made now, ``evaluate(model, settings, label)``, while
    ``may_start()`` (each is saved as it is made, ``said(label, seconds)``); and the labels left unmade, each with
    what went wrong where one failed (None: not started). A failure (a checkpoint that does not read, memory) is
    the record's to say, not the end of the script."""
    from attnpool.train.evaluate import EvalCell
    from attnpool.train.export import read_checkpoint_model

    path = os.path.join(run_dir, "retrieval-eval.json")
    earlier = read_json(path) if os.path.isfile(path) else None
    stored = {}
    if isinstance(earlier, dict) and earlier.get("key") == key:
        # (a file of before --eval-coverages holds one evaluation, the run's own attention, as "cells")
        stored = earlier.get("evaluations", {"trained": earlier["cells"]} if "cells" in earlier else {})
    made, left, model = {}, [], None
    for label in labels:
        if label in stored:
            made[label] = [EvalCell(**c) for c in stored[label]]
            continue
        if not may_start():
            left.append((label, None))
            continue
        t0 = time.perf_counter()  # (the first evaluation's time includes reading the checkpoint)
        try:
            if model is None:
                model, _, settings, _, _ = read_checkpoint_model(run_dir=run_dir)
            made[label] = evaluate(model, settings, label)
        except Exception as exc:  # noqa: BLE001 (named in the record's unfinished)
            left.append((label, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"))
            if model is None:  # (the checkpoint did not read: no other evaluation will)
                left += [(other, "not started: the checkpoint did not read") for other in labels[labels.index(label) + 1:]
                         if other not in stored]
                break
            continue
        said(label, time.perf_counter() - t0)
        stored[label] = [dataclasses.asdict(c) for c in made[label]]
        write_json(path, {"key": key, "evaluations": stored})
    if model is not None:
        del model
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {label: made[label] for label in labels if label in made}, left


def train_stage(name: str, run_dir: str, stage: Stage, stop_at: int, total_steps: int, command, env: dict,
                clock: Clock, log: CallLog) -> str:
    """The run's stage ending at step ``stop_at`` (``command(resume)``: its ``attnpool train``), unless an earlier
    call finished it; logged. Returns ``done before``, ``finished``, ``stopped`` (--deadline-s), ``failed (exit
    N)`` or why it did not start."""
    from attnpool.train.checkpoint import finished_checkpoints

    saved = finished_checkpoints(run_dir)
    # Done by an earlier call with the same --work: its checkpoint says so (a metrics row alone does not, where that
    # call was cut off after the step and before the checkpoint).
    if saved and saved[-1][0] >= stop_at:
        print(f"        {name}: context {stage.context} done before (step {saved[-1][0]})", flush=True)
        return "done before"
    if not clock.may_start_stage():
        return f"and later not started ({clock.why_not()})"
    # A later stage, or a stage an earlier call stopped part-way (SIGTERM checkpoints), goes on from the run's last
    # checkpoint; a first stage that left none starts again, over whatever metrics it left.
    resume = stop_at > stage.steps or bool(saved)
    start = max(stop_at - stage.steps, saved[-1][0] if saved else 0)
    print(f"[{clock.elapsed():6.0f} s] {name}: context {stage.context}, steps {start + 1}..{stop_at} of "
          f"{total_steps}", flush=True)
    t0 = time.perf_counter()
    done, stopped = run_stage(command(resume) + ([] if resume else ["--overwrite"]), env, clock.stage_seconds_left())
    seconds = time.perf_counter() - t0
    rows, after = read_rows(run_dir), finished_checkpoints(run_dir)
    last = rows[-1] if rows and rows[-1]["step"] > start else {}  # (none of this stage's: {})
    outcome = "stopped" if stopped else f"failed (exit {done.returncode})" if done.returncode != 0 else "finished"
    log.add(run=name, context=stage.context, steps=[start + 1, stop_at], seconds=round(seconds, 1),
            outcome=outcome.split(" ")[0], last_step=last.get("step"), checkpoint=after[-1][0] if after else None,
            loss=last.get("loss"), tokens_per_s=last.get("tokens_per_s"),
            attention_density=last.get("attention_density"))
    if outcome != "finished":
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        clock.stopped = clock.stopped or stopped
        return outcome
    print(f"        {seconds:.0f} s, loss {number(last.get('loss'), '.3f')}, "
          f"{number(last.get('tokens_per_s'), '.0f')} tokens/s, attention density "
          f"{number(last.get('attention_density'), '.3f')}", flush=True)
    return outcome


def number(value, spec: str) -> str:
    """``value`` formatted, or "-" where there is none (a metric a step did not have, or a non-finite one)."""
    return "-" if value is None else format(value, spec)


def read_jsonl(path: str) -> list[dict]:
    """The file's lines as JSON, none where it is missing; a line that does not parse (the last of a process killed
    while writing it) left out."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def read_rows(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def read_json(path: str):
    """The file's JSON, or None where it cannot be read (a call killed while writing it)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class CallLog:
    """Every call of the script on one --work, and what each did, in ``WORK/retrieval-log.jsonl`` (a line an event,
    appended): the record of a run spread over several calls holds them all."""

    def __init__(self, work: str, command: str):
        self.path = os.path.join(work, "retrieval-log.jsonl")
        self.call = 1 + sum(1 for e in self.entries() if "command" in e)
        self.add(command=command, started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def entries(self) -> list[dict]:
        return read_jsonl(self.path)

    def add(self, **event) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"call": self.call, **event}) + "\n")


def write_json(path: str, obj) -> None:
    """Written whole or not at all (a temporary file renamed over it)."""
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".tmp", path)


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower()
    match = re.search(r"(h100|h200|a100|b200|gb200|l40s?|a10g?)", name)
    return match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def plot_losses(runs: dict, boundaries: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, rows in runs.items():
        if rows:
            steps = np.array([r["step"] for r in rows])
            loss = np.array([np.nan if r["loss"] is None else r["loss"] for r in rows], dtype=float)
            if len(loss) >= 10:  # the mean of the 5 steps up to each (no zeros padded in at the ends)
                steps, loss = steps[4:], np.convolve(loss, np.ones(5) / 5, mode="valid")
            ax.plot(steps, loss, lw=1.2, label=name)
    for b, label in boundaries:
        ax.axvline(b, color="#bbbbbb", lw=0.8, ls=":")
        ax.text(b, ax.get_ylim()[1], f" {label}", fontsize=7, va="top", color="#777777")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (5-step mean)")
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    from attnpool.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the JSON, the Markdown and the plots go")
    ap.add_argument("--work", help="run directories and checkpoints (default: a temporary directory)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke test (tiny model)")
    ap.add_argument("--coverages", default="0.95,0.9", help="sparse coverages, most important first (default 0.95,0.9)")
    ap.add_argument("--tasks", default=None,
                    help="training tasks of every stage (default: the curriculum's, copy,passkey until the look-up "
                         "forms, then passkey,multikey; a third task beside the copies slows it)")
    ap.add_argument("--eval-tasks", default="passkey",
                    help="tasks evaluated (default passkey; the results hold passkey's accuracy)")
    ap.add_argument("--budget-s", type=float, default=1140.0, help="wall-time budget of the script (default 1140)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="a stage still running this long after the start is stopped with SIGTERM: it finishes its "
                         "step and checkpoints (killed if not ended 120 s later), and a later call with the same "
                         "--work goes on from there; no stage starts within 60 s of it (default none; set it at "
                         "least 3 minutes below the wall limit of the machine's call, which would cut a stage "
                         "unsaved)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every stage's steps (default 1)")
    ap.add_argument("--num-docs", type=int, default=200_000, help="documents in the training source")
    ap.add_argument("--ordinary", type=float, default=0.1, help="share of ordinary (decoy) documents (default 0.1)")
    ap.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "keep_attention"))
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4 on GPU, 3e-3 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true",
                    help="train with attnpool train's --deterministic, so that a run with the same settings and "
                         "seed repeats bit for bit; dense runs only (with --coverages ''), as sparse training's "
                         "backward adds with atomics (whether the look-up forms in the 1K stage differed between two "
                         "runs without it: bench/results/2026-11-29-h200x2-retrieval-text-rerun.md)")
    ap.add_argument("--long-rope-theta", type=float, default=None, metavar="BASE",
                    help="RoPE base of the stages that raise it (default theirs, 5e5; the model's 1e4 keeps the "
                         "first stage's base throughout, the ablation of the raise)")
    ap.add_argument("--filler", choices=("random", "text"), default="random",
                    help="the documents' filler: random words, or the standard library's text (data filler; "
                         "attention concentrates over text once the model is trained on it: --loss all)")
    ap.add_argument("--loss", choices=("answer", "all", "all-first"), default="answer",
                    help="train on the answers' tokens only, on every token (data loss), or on every token in the "
                         "first stage (the filler as language, beside the copies) and on the answers after it")
    ap.add_argument("--max-context", type=parse_size, default=None, metavar="N",
                    help="the longest stage's documents: the curriculum up to N (default 16K on GPU; 32K and 64K "
                         "add stages beyond it)")
    ap.add_argument("--sparse-min-doc-len", type=parse_size, default=None, metavar="N",
                    help="the sparse runs' documents of N+ tokens are sparse; every stage before is trained once, "
                         "dense (default 8K on GPU)")
    ap.add_argument("--eval-min-context", type=parse_size, default=None, metavar="N",
                    help="evaluate at every trained context from N up (default 4K on GPU)")
    ap.add_argument("--eval-coverages", default="", metavar="C,C",
                    help="also evaluate every run with vertical-slash patterns at these coverages, at evaluation only "
                         "(from the sparse runs' length): density against accuracy without training again")
    ap.add_argument("--sparse-args", nargs="+", default=[], metavar="K=V",
                    help="the sparse runs' pattern options over the default ones (attnpool train --sparse-args: "
                         "slash_cap, vertical_cap, block, ...), e.g. slash_cap=128 vertical_cap=512")
    ap.add_argument("--eval-sparse-args", nargs="*", action="append", default=None, metavar="K=V",
                    help="the --eval-coverages patterns' options over the sparse runs' (e.g. caps, which bound a "
                         "long document's density whatever the coverage); given again, another set, each set "
                         "evaluated at every --eval-coverages coverage (a bare --eval-sparse-args: the sparse runs' "
                         "own options)")
    ap.add_argument("--eval-instances", type=int, default=None, metavar="N",
                    help="held-out instances per needle depth and context (default 40 on GPU)")
    ap.add_argument("--mix-from", type=int, default=None, metavar="N",
                    help="mix document lengths from N tokens up to each later stage's context (data min_context; "
                         "default: every document of the stage's length)")
    args = ap.parse_args()
    clock = Clock(args.budget_s, args.deadline_s)
    from attnpool.data.retrieval import parse_tasks
    from attnpool.errors import ConfigError
    from attnpool.train.checkpoint import finished_checkpoints

    gpu = args.device == "cuda"
    setup = dict(GPU if gpu else CPU)
    model = GPU_MODEL if gpu else CPU_MODEL
    if args.long_rope_theta is not None and not args.long_rope_theta > 0:
        ap.error(f"--long-rope-theta {args.long_rope_theta}: must be positive")
    stages = (GPU_CURRICULUM + GPU_LONG_STAGES) if gpu else (CPU_CURRICULUM + CPU_LONG_STAGES)
    max_context = (GPU_CURRICULUM if gpu else CPU_CURRICULUM)[-1].context if args.max_context is None \
        else args.max_context
    if max_context not in {stage.context for stage in stages}:
        ap.error(f"--max-context {args.max_context}: not a stage's context; choose one of "
                 f"{', '.join(tokens_text(stage.context) for stage in stages)}")
    for name, value in (("sparse_min_doc_len", args.sparse_min_doc_len), ("eval_min_context", args.eval_min_context),
                        ("eval_instances", args.eval_instances)):
        if value is not None:
            if not value > 0:
                ap.error(f"--{name.replace('_', '-')} {value}: must be positive")
            setup[name] = value
    if setup["eval_min_context"] > max_context:
        ap.error(f"--eval-min-context {setup['eval_min_context']}: beyond the longest stage's {max_context} tokens")
    if args.deadline_s is not None and not args.deadline_s > START_MARGIN_S:
        ap.error(f"--deadline-s {args.deadline_s}: must be more than {START_MARGIN_S:g} s (no stage starts closer "
                 "to it than that)")
    # The stages as run: --max-context, --tasks, --steps-scale, --long-rope-theta and --loss applied.
    curriculum = [stage._replace(steps=max(1, round(stage.steps * args.steps_scale)),
                                 tasks=args.tasks or stage.tasks or DEFAULT_TASKS,
                                 rope_theta=args.long_rope_theta if stage.rope_theta and args.long_rope_theta
                                 else stage.rope_theta,
                                 loss="all" if args.loss == "all" or (args.loss == "all-first" and i == 0) else "answer")
                  for i, stage in enumerate(s for s in stages if s.context <= max_context)]
    if args.mix_from is not None and not 0 < args.mix_from:
        ap.error(f"--mix-from {args.mix_from}: must be a positive number of tokens")
    if args.lr is not None:
        if not args.lr > 0:
            ap.error(f"--lr {args.lr}: must be positive")
        setup["lr"] = args.lr
    coverages, eval_coverages = (coverage_list(ap, flag, text) for flag, text in
                                 (("--coverages", args.coverages), ("--eval-coverages", args.eval_coverages)))
    setup["sparse_args"] = sparse_options(ap, "--sparse-args", args.sparse_args, setup["sparse_args"])
    eval_option_sets = list({json.dumps(o, sort_keys=True): o for o in (
        sparse_options(ap, "--eval-sparse-args", items, setup["sparse_args"])
        for items in (args.eval_sparse_args or [[]]))}.values())
    if (coverages or eval_coverages) and setup["sparse_min_doc_len"] > max_context:
        ap.error(f"--sparse-min-doc-len {setup['sparse_min_doc_len']}: no stage reaches it (the longest holds "
                 f"{max_context}-token documents), so nothing would be sparse")
    # Stages of documents shorter than sparse_min_doc_len compute the same in every run: the sparse runs start
    # from a copy of the dense run taken after the last of them (same weights, data and optimizer state). A
    # stage mixing lengths up to exactly sparse_min_doc_len counts as one (see the module's docstring).
    shared = sum(1 for stage in curriculum if stage.context < setup["sparse_min_doc_len"]
                 or (stage.context == setup["sparse_min_doc_len"] and bool(args.mix_from)
                     and stage.context > args.mix_from))
    if coverages and shared == len(curriculum):
        ap.error(f"--sparse-min-doc-len {setup['sparse_min_doc_len']}: every stage is shared (trained dense once), so "
                 "the sparse runs would train nothing sparse")
    if gpu:
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: no GPU visible (use --device cpu for the smoke test)")
    try:
        eval_tasks = parse_tasks(args.eval_tasks)
        for stage in curriculum:
            parse_tasks(stage.tasks)
    except ConfigError as exc:
        ap.error(str(exc))
    if "copy" in eval_tasks:
        ap.error("--eval-tasks: copy is a warm-up, its answer a span, not evaluated")
    if "passkey" not in eval_tasks:  # (the others are in the heat maps and `details`)
        ap.error(f"--eval-tasks {args.eval_tasks}: include passkey, whose accuracy the record's results report")
    total_steps = sum(stage.steps for stage in curriculum)
    for i, stage in enumerate(curriculum):  # (every stage's data and settings, dense and sparse)
        for attention, coverage in [("dense", None)] + [("sparse", c) for c in coverages[:1]]:
            check_stage(ap, train_command("unused", attention, coverage, stage, total_steps, total_steps, i > 0, args,
                                          setup, model))
    work = args.work or tempfile.mkdtemp(prefix="attnpool-retrieval-")
    os.makedirs(args.out, exist_ok=True)
    # What the runs in --work are trained with: a later call goes on with them only where it would train the
    # same (finished stages are skipped by their step, finished evaluations read back), never mixing two setups.
    training = {"device": args.device, "model": model, "seed": args.seed, "lr": setup["lr"],
                "warmup_steps": setup["warmup_steps"], "num_docs": args.num_docs, "ordinary": args.ordinary,
                "mix_from": args.mix_from, "filler": args.filler, "loss": args.loss,
                "activation_checkpointing": args.activation_checkpointing, "deterministic": args.deterministic,
                "sparse_min_doc_len": setup["sparse_min_doc_len"], "sparse_args": setup["sparse_args"],
                "curriculum": [stage._asdict() for stage in curriculum]}
    training = json.loads(json.dumps(training))  # (tuples as lists, as read back)
    settings_path = os.path.join(work, "retrieval-settings.json")
    if os.path.isfile(settings_path):
        earlier = read_json(settings_path)
        if isinstance(earlier, dict):  # (written before filler, loss and deterministic were options: the defaults)
            earlier = {"filler": "random", "loss": "answer", "deterministic": False, **earlier}
            for stage in earlier.get("curriculum", []):  # (and before each stage had its own: the run's)
                if isinstance(stage, dict):
                    stage.setdefault("loss", earlier["loss"])
        if earlier != training:
            differ = sorted(k for k in set(training) | set(earlier or {}) if (earlier or {}).get(k) != training.get(k))
            ap.error(f"--work {work}: holds runs trained with other settings ({', '.join(differ) or 'unreadable'}); "
                     "use another --work")
    else:
        os.makedirs(work, exist_ok=True)
        write_json(settings_path, training)
    log = CallLog(work, shlex.join(["python", "bench/retrieval.py", *sys.argv[1:]]))
    # an evaluation's length as earlier calls on this --work measured it, before this call has timed one
    clock.evaluated(max((float(e.get("seconds") or 0) for e in log.entries() if "evaluated" in e), default=0.0))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")])))

    variants = [("dense", None)] + [("sparse", c) for c in coverages]
    branch = os.path.join(work, "dense-branch")
    shared_steps = sum(stage.steps for stage in curriculum[:shared])
    commands, unfinished = [], []
    for attention, coverage in variants:
        name = attention if coverage is None else f"sparse-{coverage:g}"
        run_dir = os.path.join(work, name)
        saved = finished_checkpoints(run_dir)
        if clock.stopped:
            if not saved or saved[-1][0] < total_steps:
                unfinished.append(f"{name}: not trained on (--deadline-s reached)")
            continue
        first = 0
        if attention == "sparse" and shared:
            if not read_rows(run_dir):  # (a run begun by an earlier call of this script goes on without the branch)
                if not os.path.isdir(branch):
                    dense = finished_checkpoints(os.path.join(work, "dense"))
                    unfinished.append(f"{name}: no dense run to branch from" + (
                        f" (the dense run is past the shared stages, at step {dense[-1][0]}, with no copy of it at "
                        f"step {shared_steps}: use another --work)" if dense and dense[-1][0] > shared_steps else ""))
                    continue
                copy_run(branch, run_dir)
            first = shared
        stop_at = sum(stage.steps for stage in curriculum[:first])
        for i, stage in enumerate(curriculum[first:], start=first):
            stop_at += stage.steps
            command = lambda resume: train_command(run_dir, attention, coverage, stage, stop_at,  # noqa: E731
                                                   total_steps, resume, args, setup, model)
            commands.append(shlex.join(["python", *command(stop_at > stage.steps)[1:]]))  # as the curriculum runs it
            outcome = train_stage(name, run_dir, stage, stop_at, total_steps, command, env, clock, log)
            if outcome not in ("done before", "finished", "stopped"):
                unfinished.append(f"{name}: {stage_name(i, stage, stop_at)} {outcome}")
            # The sparse runs' start: the dense run as it ends its last shared stage, copied while that stage's
            # checkpoint is its newest (whichever call, and however the stage ended, saw it first).
            if attention == "dense" and i + 1 == shared and not os.path.isdir(branch):
                newest = finished_checkpoints(run_dir)
                if newest and newest[-1][0] == stop_at:
                    copy_run(run_dir, branch)
            if outcome == "stopped":
                newest = finished_checkpoints(run_dir)
                unfinished.append(f"{name}: {stage_name(i, stage, stop_at)} stopped by --deadline-s (" + (
                    f"checkpointed at step {newest[-1][0]}: the same --work goes on from there"
                    if newest and newest[-1][0] > stop_at - stage.steps else
                    "no checkpoint written: the stage starts again") + ")")
            if outcome not in ("done before", "finished"):
                break

    # Evaluation: each finished run with the attention it trained with, at every trained context from the minimum up.
    from attnpool.train.evaluate import evaluate_retrieval, plot_heatmap, sparse_config_of

    eval_contexts = sorted({stage.context for stage in curriculum if stage.context >= setup["eval_min_context"]})
    tasks = ",".join(eval_tasks)
    # What an evaluation is of: a run evaluated by an earlier call of this script with the same --work (its
    # RUN/retrieval-eval.json) is read back when these match.
    eval_key = {"tasks": tasks, "filler": args.filler, "contexts": eval_contexts, "depths": list(setup["eval_depths"]),
                "instances": setup["eval_instances"], "seed": args.seed + 1, "step": total_steps}
    # What each run is evaluated with: the attention it trained with ("trained"), then vertical-slash patterns at
    # each --eval-coverages coverage with each set of --eval-sparse-args, from the sparse runs' length, at
    # evaluation only. A label names the options that differ from the sparse runs', in name order
    # (RUN/retrieval-eval.json's key: the same set read back whatever order a later call gives it in).
    sweep = {f"coverage {c:g}" + "".join(f" {k}={v}" for k, v in sorted(options.items())
                                         if setup["sparse_args"].get(k) != v): (c, options)
             for options in eval_option_sets for c in eval_coverages}

    def evaluate(model_obj, settings: dict, label: str) -> list:
        if label == "trained":
            sparse = sparse_config_of(settings, "trained")
        else:
            coverage, options = sweep[label]
            sparse = sparse_config_of(settings, "sparse", coverage=coverage, min_doc_len=setup["sparse_min_doc_len"],
                                      **options)
        return evaluate_retrieval(model_obj, tasks=tasks, contexts=eval_contexts, depths=setup["eval_depths"],
                                  instances=setup["eval_instances"], seed=args.seed + 1, sparse=sparse,
                                  filler=args.filler, device="cuda" if gpu else "cpu",
                                  batch_tokens=max(stage.tokens for stage in curriculum), needle_probe=True)

    results, details, runs, heatmaps, swept = [], [], {}, {}, []
    for attention, coverage in variants:
        name = attention if coverage is None else f"sparse-{coverage:g}"
        run_dir = os.path.join(work, name)
        runs[name] = read_rows(run_dir)
        checkpoints = finished_checkpoints(run_dir)
        if not checkpoints or checkpoints[-1][0] < total_steps:
            continue  # unfinished: not evaluated (named in unfinished)
        def said(label: str, seconds: float) -> None:
            clock.evaluated(seconds)
            log.add(evaluated=name, label=label, seconds=round(seconds, 1))
            print(f"[{clock.elapsed():6.0f} s] evaluated {name} ({label}) in {seconds:.0f} s", flush=True)

        made, left = run_evaluations(run_dir, eval_key, ["trained", *sweep], evaluate, clock.may_start_evaluation,
                                     said)
        unfinished += [f"{name}: evaluation {label} ({why or clock.why_not(evaluation=True)})" for label, why in left]
        for label, cells in made.items():
            for context in eval_contexts:
                mine = [c for c in cells if c.task == "passkey" and c.context == context]
                if not mine:
                    continue
                # density: the sparse layers' share of causal pairs, measured on these instances (1.0 dense)
                row = {"context": context, "accuracy": sum(c.correct for c in mine) / sum(c.total for c in mine),
                       "density": sum(c.density * c.total for c in mine) / sum(c.total for c in mine)}
                if label == "trained":
                    results.append({"attention": attention, "coverage": coverage, **row})
                else:
                    kept = [c.needle_kept for c in mine if c.needle_kept is not None]
                    swept_coverage, options = sweep[label]
                    swept.append({"run": name, "coverage": swept_coverage, "sparse_args": options, **row,
                                  "needle_kept": float(np.mean(kept)) if kept else None})
        if "trained" in made:
            cells = made["trained"]
            details += [{"attention": attention, "coverage": coverage, "task": c.task, "context": c.context,
                         "depth": c.depth, "accuracy": c.accuracy, "instances": c.total, "needle_kept": c.needle_kept,
                         "density": c.density}
                        for c in cells]
            heatmaps[name] = cells

    gpu_name = device_name(args.device)
    stem = f"{datetime.date.today()}-{gpu_name}-retrieval" + ("-text" if args.filler == "text" else "")
    loss_png = f"{stem}-loss.png"
    boundaries, at = [], 0
    for stage in curriculum:
        boundaries.append((at, tokens_text(stage.context)))
        at += stage.steps
    plot_losses(runs, boundaries, os.path.join(args.out, loss_png), f"dense vs vertical-slash, same weights and data "
                                                                     f"({gpu_name})")
    for name, cells in heatmaps.items():
        plot_heatmap(cells, os.path.join(args.out, f"{stem}-{name}.png"), name)

    from attnpool.model import model_config

    params = model_config("tiny", **model).num_params()
    doc = {"date": str(datetime.date.today()), "device": gpu_name, "command": shlex.join(["python", *sys.argv]),
           "model": {"preset": "tiny", "model_args": model, "params": params}, "curriculum": training["curriculum"],
           "tasks": tasks, "mix_from": args.mix_from, "filler": args.filler, "loss": args.loss,
           "sparse_min_doc_len": setup["sparse_min_doc_len"],
           "sparse_args": setup["sparse_args"], "eval": {"depths": list(setup["eval_depths"]),
                                                        "instances": setup["eval_instances"], "contexts": eval_contexts},
           "results": results, "details": details, "coverage_sweep": swept, "unfinished": unfinished,
           "final_loss": {k: (v[-1]["loss"] if v else None) for k, v in runs.items()},
           # every run's per-step training loss, [step, loss], from its metrics.jsonl
           "losses": {k: [[r["step"], r["loss"]] for r in v] for k, v in runs.items()},
           "wall_s": clock.elapsed(), "train_commands": commands}
    log.add(ended=True, wall_s=round(clock.elapsed(), 1), unfinished=unfinished)
    doc["log"] = log.entries()  # every call on this --work: its command, stages, evaluations and end
    with open(os.path.join(args.out, f"{stem}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    write_markdown(os.path.join(args.out, f"{stem}.md"), doc, loss_png, [f"{stem}-{n}.png" for n in heatmaps])
    print(f"wrote {os.path.join(args.out, stem)}.json and .md ({clock.elapsed():.0f} s)")
    return 0 if not unfinished else 1


LOSS_TEXT = {"answer": "answer-only loss", "all": "loss on every token",
             "all-first": "loss on every token in the first stage, on the answers after it"}


def stage_text(stage: dict) -> str:
    extra = [*stage["data_args"], *([f"rope_theta {stage['rope_theta']:g}"] if stage["rope_theta"] else [])]
    return (f"{tokens_text(stage['context'])} x {stage['steps']} ({tokens_text(stage['tokens'])}, `{stage['tasks']}`"
            + (f" {' '.join(extra)}" if extra else "") + ")")


def write_markdown(path: str, doc: dict, loss_png: str, heatmap_pngs: list[str]) -> None:
    m = doc["model"]
    contexts = doc["eval"]["contexts"]
    variants = list(dict.fromkeys((r["attention"], r["coverage"]) for r in doc["results"]))
    acc = {(r["attention"], r["coverage"], r["context"]): r["accuracy"] for r in doc["results"]}
    density = {(r["attention"], r["coverage"], r["context"]): r["density"] for r in doc["results"]}
    lines = [
        "# Long-range retrieval: dense and vertical-slash training from the same start (issues 26 and 45)", "",
        f"{doc['device']}, {doc['date']}. Command: `{doc['command']}` ({doc['wall_s']:.0f} s).", "",
        f"Model: `--model tiny --model-args {' '.join(f'{k}={v}' for k, v in m['model_args'].items())}` "
        f"({m['params'] / 1e6:.2f}M parameters); `--data retrieval`, {doc['filler']} filler, "
        f"{LOSS_TEXT[doc['loss']]}; evaluated: `{doc['tasks']}`. "
        f"Curriculum (context x steps, tokens per step, tasks, and where it changes, RoPE's base): "
        f"{', '.join(stage_text(stage) for stage in doc['curriculum'])}"
        + (f", documents of each later stage from {tokens_text(doc['mix_from'])} tokens up to its context" if doc["mix_from"]
           else "") + f"; sparse runs: documents of "
        f"{doc['sparse_min_doc_len']}+ tokens sparse"
        + (f", `--sparse-args {' '.join(f'{k}={v}' for k, v in doc['sparse_args'].items())}`" if doc["sparse_args"] else "")
        + ".", "",
        f"Passkey accuracy over needle depths {', '.join(f'{d:g}' for d in doc['eval']['depths'])} "
        f"({doc['eval']['instances']} held-out instances per depth), and in brackets the sparse layers' density (the "
        "share of causal (query, key) pairs their patterns computed on those instances, an upper bound by a little: "
        "slash tiles count whole; 1 dense):", "",
        "| attention | coverage | " + " | ".join(tokens_text(n) for n in contexts) + " |",
        "|---|---|" + "---|" * len(contexts),
    ]
    for attention, coverage in variants:
        lines.append(f"| {attention} | {'-' if coverage is None else coverage} | "
                     + " | ".join(f"{acc.get((attention, coverage, n), float('nan')):.3f} "
                                  f"({density.get((attention, coverage, n), float('nan')):.2f})" for n in contexts)
                     + " |")
    probed = [d for d in doc["details"] if d["needle_kept"] is not None and d["task"] == "passkey"]
    if probed:
        lines += ["", "How often a sparse run's patterns let the answer's first query reach the passkey's first value "
                      "token (share of instances x sparse layers, any head; the online estimate missing the needle "
                      "would show here):", "", "| coverage | " + " | ".join(tokens_text(n) for n in contexts) + " |",
                  "|---|" + "---|" * len(contexts)]
        for coverage in dict.fromkeys(d["coverage"] for d in probed):
            kept = [np.mean([d["needle_kept"] for d in probed if d["coverage"] == coverage and d["context"] == n] or
                            [np.nan]) for n in contexts]
            lines.append(f"| {coverage} | " + " | ".join(f"{k:.3f}" for k in kept) + " |")
    if doc["coverage_sweep"]:
        def differing(row: dict) -> str:  # the row's --eval-sparse-args that differ from the sparse runs' options
            return " ".join(f"{k}={v}" for k, v in (row.get("sparse_args") or {}).items()
                            if doc["sparse_args"].get(k) != v) or "-"

        swept = {(r["run"], r["coverage"], differing(r), r["context"]): r for r in doc["coverage_sweep"]}
        lines += ["", "Each run with vertical-slash patterns at other coverages, at evaluation only (`--eval-coverages`, "
                      f"documents of {doc['sparse_min_doc_len']}+ tokens, with the `--eval-sparse-args` shown): "
                      "passkey accuracy, (density) and the share of probes whose patterns reached the needle:", "",
                  "| run | coverage | options | " + " | ".join(tokens_text(n) for n in contexts) + " |",
                  "|---|---|---|" + "---|" * len(contexts)]
        for run, coverage, options in dict.fromkeys((r["run"], r["coverage"], differing(r))
                                                    for r in doc["coverage_sweep"]):
            cells = [swept.get((run, coverage, options, n)) for n in contexts]
            lines.append(f"| {run} | {coverage:g} | {options} | " + " | ".join(
                "-" if c is None else f"{c['accuracy']:.3f} ({c['density']:.2f})"
                + ("" if c["needle_kept"] is None else f" {c['needle_kept']:.2f}") for c in cells) + " |")
    stages = [e for e in doc.get("log", []) if "run" in e]
    if stages:
        lines += ["", "Stages as run, over every call on this `--work` (`log` in the JSON; the steps the call ran, the "
                      "last it finished and the newest checkpoint; the last step's loss, tokens/s and density):", "",
                  "| call | run | context | steps | s | outcome | loss | tokens/s | density |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {e['call']} | {e['run']} | {tokens_text(e['context'])} | {e['steps'][0]}-{e['steps'][1]} "
                  f"(to {number(e['last_step'], 'd')}, checkpoint {number(e['checkpoint'], 'd')}) | "
                  f"{e['seconds']:.0f} | {e['outcome']} | {number(e['loss'], '.3f')} | "
                  f"{number(e['tokens_per_s'], '.0f')} | {number(e['attention_density'], '.3f')} |" for e in stages]
        lines += ["", "Calls:", ""] + [f"{e['call']}. `{e['command']}`" for e in doc["log"] if "command" in e]
    if doc["unfinished"]:
        lines += ["", "Not finished: " + "; ".join(doc["unfinished"]) + "."]
    lines += ["", f"Loss curves: ![loss]({loss_png})", ""]
    lines += [f"![accuracy]({p})" for p in heatmap_pngs]
    lines += ["", "Training commands (one per stage; each resumes the previous stage's checkpoint):", "", "```"]
    lines += doc["train_commands"]
    lines += ["```"]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
