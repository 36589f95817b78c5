"""What a run reports: per-step metrics in ``metrics.jsonl``, a progress bar, a summary and a plot.

Times (all in seconds, per step):

- ``step_time_s``: rank 0's wall time from taking the batch to the end of the
  optimizer step and the loss all-gather (which waits for every rank).
- ``plan_time_s``: rank 0's layout and planning time (every rank plans the same).
- ``attention_time_s``: time inside core attention, forward and backward, summed
  over layers, the slowest rank's (:class:`AttentionTimer`); null with ping-pong,
  where its phases interleave with the other nano-batch's work.
- ``comm_time_s``: time inside core attention's all-to-all calls, the slowest
  rank's. Measured, not estimated (wall time on CPU, CUDA events on GPU); it
  includes waiting for the slowest peer; with ping-pong or head groups
  (``head_chunks``) it runs from launch to wait, so it includes compute
  overlapped with the transfer, and exchanges in flight together count once
  (the union of their spans). ``comm_bytes`` are
  the bytes all ranks sent to other ranks.
- ``peak_memory_bytes``: the largest rank's peak: CUDA allocator peak during the
  step on GPU, the process's peak resident set size (since start) on CPU.
  ``peak_reserved_bytes`` (GPU only): the allocator's reserved memory at its
  peak, allocated bytes plus what it caches, which is what the GPU must hold.
- ``activation_offload_bytes`` (with ``activation_offload``): the bytes of saved
  activations the largest rank copied to host memory in the step.
- ``nano_batches``: per micro-batch, how many nano-batches it ran as: 2 where ping-pong split it, 1 without
  ping-pong or where it could not split (a single document, or a cut that would leave a nano-batch of fewer than
  ranks squared tokens: attnpool.plan.layout.nano_batch_bounds).
- ``compile_s`` (with ``compile``): the slowest rank's seconds in torch.compile's compiling during the step, the
  first step's graphs and any recompile (a new range of token counts: attnpool.parallel.compile); null without
  compile. The summary's steady throughput leaves such steps out.
- ``model_flops``: the step's model FLOPs, linear layers and causal attention,
  forward and backward (attnpool.train.flops); ``mfu`` those over the step's time
  and every GPU's bf16 peak (null on the CPU, in float32, or on a GPU without a
  known peak).

With ``--sparse vertical-slash``, ``attention_density`` is the share of causal
(query, key) pairs the step's patterns computed, over all documents (dense
short ones included), heads and sparse layers (null for dense attention).
``attention_work_total`` and the imbalances are then in the sparse planning
cost (per average layer; see ``sparse.cost.SparsePrior``): predictions made before
the step's patterns exist. ``sparse_served_pairs`` is what each rank's sparse layers
then computed, counted from the patterns they ran (runtime.sparse.SparseStats), and
``sparse_served_work`` the same tiles and dense spans priced as the plans price them
(seconds with a measured cost table), ``sparse_served_kernel_s`` the seconds of those
layers' attention kernel calls (CUDA events; the host's clock on the CPU);
``sparse_imbalance_measured`` is the work's max/mean within the ranks cad balances
together (a pipeline stage's dp ranks of one tp rank), the largest over them, and
``sparse_imbalance_measured_pairs`` and ``sparse_imbalance_measured_kernel`` the
pairs' and the kernel seconds'. ``sparse_kernel_price_scale`` is what the step's plans
multiplied the sparse tiles' calibrated prices by, fitted to the kernel seconds of
the steps before (``sparse.cost.SparsePrior.update_kernel_scale``; null where the
plans are not in seconds or ``price_from_kernels`` is off).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time

import numpy as np
import torch

from attnpool.console import text_console
from attnpool.errors import TrainingError, storage_error
from attnpool.kinds import CAUSAL
from attnpool.train.memory import auto_choice

METRICS_FILE = "metrics.jsonl"
# the sparse layers' measured balances of a step's row (the module docstring): of the work priced as planned, of the
# pairs, of the kernel seconds
SPARSE_IMBALANCES = ("sparse_imbalance_measured", "sparse_imbalance_measured_pairs", "sparse_imbalance_measured_kernel")
SUMMARY_FILE = "summary.json"
PLOT_FILE = "summary.png"


class _Clock:
    """Adds up intervals between start() and stop() marks; CUDA events on GPU, wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds_cpu = 0.0
        self.open: list = []  # starts without a stop yet
        self.pairs: list = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        self.open.append(self._now())

    def stop(self):
        start, end = self.open.pop(), self._now()
        if self.cuda:
            self.pairs.append((start, end))
        else:
            self.seconds_cpu += end - start

    def seconds(self) -> float:
        total = self.seconds_cpu
        for start, end in self.pairs:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``action``: marks when gradients pass a point."""

    @staticmethod
    def forward(ctx, action, *xs):
        ctx.action = action
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.action()
        return (None, *grads)


class AttentionTimer:
    """Wraps core attention ``(q, k, v) -> out`` and times it, forward and backward, over all layers.

    Forward: the call itself. Backward: from the gradient reaching ``out`` to the
    gradients of q, k and v leaving core attention's backward (two identity marks).
    """

    def __init__(self, attention, device: torch.device):
        self.attention = attention
        self.clock = _Clock(device)

    def __call__(self, q, k, v, **kwargs):
        if q.requires_grad:
            q, k, v = _Mark.apply(self.clock.stop, q, k, v)
        self.clock.start()
        out = self.attention(q, k, v, **kwargs)
        self.clock.stop()
        if out.requires_grad:
            (out,) = _Mark.apply(self.clock.start, out)
        return out

    def kind_of(self, layer: int):
        """The layer's attention kind, as the attention it wraps says (runtime.LayerKinds; causal otherwise)."""
        kind_of = getattr(self.attention, "kind_of", None)
        return kind_of(layer) if kind_of is not None else CAUSAL

    def seconds(self) -> float:
        return self.clock.seconds()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> int:
    """The CUDA caching allocator's peak of reserved memory (allocated plus cached, what the device must hold);
    0 on CPU."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else 0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


NONFINITE_AS_NULL = ("loss", "grad_norm")  # the numbers a skipped step may hold as NaN or inf


def json_line(row: dict) -> str:
    """One row of metrics.jsonl: strict JSON, a non-finite number written as null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


# --- Loggers: every row of metrics.jsonl, also to TensorBoard or W&B -------------------------------

LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
TENSORBOARD_DIR = "tensorboard"


def logger_problem(kind: str) -> str | None:
    """Why ``logger: kind`` cannot run here (its package is missing; W&B online without credentials), or None."""
    import importlib.util

    package = LOGGER_PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"needs the {package} package: pip install 'attnpool[{kind}]'"
    if kind == "wandb":
        import wandb

        # The mode from WANDB_MODE or `wandb offline`'s settings file; checking credentials neither prompts
        # nor goes on the network.
        if wandb.setup().settings.mode not in ("offline", "dryrun", "disabled") and not wandb.login(prompt=False):
            return ("W&B has no API key here: run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to "
                    "write the run locally (`wandb sync` uploads it later)")
    return None


def _scalars(row: dict) -> dict[str, float]:
    """A row's numbers (booleans as 0/1), without the step and without the nulls of a metric a step lacks."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoardLogger:
    """Scalars in OUT/tensorboard (``tensorboard --logdir OUT/tensorboard``), one tag per metric."""

    def __init__(self, out: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(out, TENSORBOARD_DIR), flush_secs=10)

    def log(self, row: dict) -> None:
        for name, value in _scalars(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run under OUT/wandb, with the run's settings as its config. WANDB_MODE=offline writes it locally
    without a network (``wandb sync`` uploads it later); WANDB_PROJECT names the project (default attnpool)."""

    def __init__(self, out: str, settings: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "attnpool"), dir=out,
                              name=os.path.basename(os.path.abspath(out)), config=settings)

    def log(self, row: dict) -> None:
        self.run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def open_logger(kind: str, out: str, settings: dict):
    """The logger ``kind`` names (None for ``none``)."""
    if kind == "tensorboard":
        return TensorBoardLogger(out)
    if kind == "wandb":
        return WandbLogger(out, settings)
    return None


def read_metrics_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl. A last line that does not parse is one a process ended while writing (a kill,
    a full disk): dropped, as its step is after the newest checkpoint anyway. One before it is refused by line."""
    lines = [(number, line) for number, line in enumerate(open(path).read().splitlines(), 1) if line.strip()]
    rows = []
    for i, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise TrainingError(f"{path}: line {number} is not a metrics row ({exc.msg}): the run's log is "
                                "damaged; move it aside to resume without it") from None
    return rows


class MetricsLog:
    """``metrics.jsonl`` in the run directory, one JSON object per step (written by rank 0 only), and each row
    to ``logger`` (TensorBoard or W&B) where one is given.

    A resumed run keeps the rows up to the step it resumes from and drops any
    later ones (written after that checkpoint by the run that stopped).
    """

    def __init__(self, out: str, write: bool, resume_step: int | None, logger=None):
        self.path = os.path.join(out, METRICS_FILE)
        self.write = write
        self.logger = logger
        self.rows: list[dict] = []
        if resume_step is not None and os.path.isfile(self.path):
            rows = read_metrics_rows(self.path)
            for r in rows:  # a skipped step's non-finite loss or norm, written as null, is NaN again
                for key in NONFINITE_AS_NULL:
                    if key in r and r[key] is None:
                        r[key] = math.nan
            self.rows = [r for r in rows if r.get("step", 0) <= resume_step]

    def start(self) -> None:
        """(Re)write the file with the rows kept so far, whole or not at all. Call once every rank has read it."""
        if self.write:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path + ".partial", "w") as fh:
                    for row in self.rows:
                        fh.write(json_line(row))
                os.replace(self.path + ".partial", self.path)
            except OSError as exc:
                raise storage_error(exc, self.path) from None

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.write:
            try:
                with open(self.path, "a") as fh:
                    fh.write(json_line(row))
            except OSError as exc:  # (rank 0's alone: the launcher ends the others, and says this)
                raise storage_error(exc, self.path) from None
        if self.logger is not None:
            self.logger.log(row)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}K" if x < 1e6 else f"{x / 1e6:.2f}M"


class Progress:
    """A rich progress bar on a terminal (rank 0): loss, tokens/s, attention balance before -> after.

    Without a terminal (logs, CI) it prints a plain line about every 5% of the run.
    """

    def __init__(self, enabled: bool, total: int, start: int, strategy: str):
        self.enabled = enabled
        self.total, self.strategy = total, strategy
        self.bar = None
        if not enabled:
            return
        self.console = text_console()
        self.every = max(1, total // 20)
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(
                TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}[/]"), TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("attention max/mean {task.fields[balance]}"), TimeRemainingColumn(),
                console=self.console)
            self.task = self.bar.add_task("train", total=total, completed=start, loss="-", rate="-", balance="-")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        balance = f"local {row['imbalance_before']:.2f} -> {self.strategy} {row['imbalance_after']:.2f}"
        skipped = row.get("skipped_step")
        loss = "skipped (not finite)" if skipped else f"{row['loss']:.3f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=row["step"], loss=loss, rate=_fmt_rate(row["tokens_per_s"]),
                            balance=balance)
        elif skipped or row["step"] % self.every == 0 or row["step"] in (1, self.total):
            self.console.print(f"step {row['step']}/{self.total}  loss {loss}  "
                               f"{_fmt_rate(row['tokens_per_s'])} tok/s  attention max/mean {balance}",
                               highlight=False)


def attention_time(rows: list[dict], statistic) -> float | None:
    """``statistic`` of the steps' core-attention times, or None where a step has none. Under ping-pong
    only the steps of one document (one nano-batch) are timed: a statistic over those alone would mislead."""
    times = [r["attention_time_s"] for r in rows]
    return None if any(t is None for t in times) else float(statistic(times))


# Steps left out of the steady-state throughput (the first ones compile, warm the allocator and the kernels' caches)
WARM_UP_STEPS = 2


def summarize(rows: list[dict], last_loads: dict | None, info: dict) -> dict:
    """The run's summary: losses, throughput, and the attention balance local would have had vs the plan's."""
    loss = [r["loss"] for r in rows]
    tail = max(1, min(10, len(rows) // 10))
    times = [r["step_time_s"] for r in rows]
    after_warm_up = rows[WARM_UP_STEPS if len(rows) > WARM_UP_STEPS else 0:]
    # Steps that compiled (a new token-count range under compile: attnpool.parallel.compile) are not steady either;
    # left out where some others remain
    compiled = [r["step"] for r in after_warm_up if r.get("compile_s")]
    steady = [r for r in after_warm_up if not r.get("compile_s")] or after_warm_up
    compile_times = [r["compile_s"] for r in rows if r.get("compile_s") is not None]

    def mean(key):
        values = [r[key] for r in rows if r[key] is not None]
        return float(np.mean(values)) if values else None

    summary = dict(info)
    summary.update({
        "steps_run": len(rows),
        "first_loss": loss[0],
        "last_loss": loss[-1],
        "last_loss_mean": float(np.mean(loss[-tail:])),
        "last_loss_steps": tail,
        "tokens_per_s": float(np.sum([r["tokens"] for r in rows]) / np.sum(times)),
        # the median step's rate after the first WARM_UP_STEPS (where the run has more), those that compiled left
        # out (where others remain): what a longer run keeps
        "steady_tokens_per_s": float(np.median([r["tokens"] / r["step_time_s"] for r in steady])),
        "steady_from_step": after_warm_up[0]["step"],
        "steady_steps_left_out": compiled if len(steady) < len(after_warm_up) else [],
        # seconds torch.compile compiled over the run's steps (the slowest rank's each step), and in which steps;
        # None without compile
        "compile_s_total": float(np.sum(compile_times)) if compile_times else None,
        "compiled_steps": [r["step"] for r in rows if r.get("compile_s")],
        # the model's FLOPs over the GPUs' bf16 peak (attnpool.train.flops), median of the same steps; None on the
        # CPU, in float32, or on a GPU without a known peak
        "mfu": float(np.median([r["mfu"] for r in steady])) if rows[-1].get("mfu") is not None else None,
        "steps_time_s": float(np.sum(times)),
        "imbalance_local_mean": mean("imbalance_before"),
        "imbalance_planned_mean": mean("imbalance_after"),
        "imbalance_local_last": rows[-1]["imbalance_before"],
        "imbalance_planned_last": rows[-1]["imbalance_after"],
        "attention_time_s_mean": attention_time(rows, np.mean),
        "comm_time_s_mean": mean("comm_time_s"),
        "comm_bytes_mean": mean("comm_bytes"),
        "step_time_s_mean": float(np.mean(times)),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        "peak_reserved_bytes": max((r.get("peak_reserved_bytes") or 0 for r in rows), default=0) or None,
        "attention_density_mean": mean("attention_density") if "attention_density" in rows[0] else None,
        **{f"{key}_mean": mean(key) if key in rows[0] else None for key in SPARSE_IMBALANCES},
    })
    if last_loads is not None:
        summary["last_step_loads"] = last_loads
    return summary


def _steps(steps: list[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def print_summary(summary: dict, files: list[str]) -> None:
    from rich.table import Table

    s = summary
    console = text_console()
    layout = (f"{s['world']} ranks (pp {s['pp']} x dp {s['dp']} x tp {s['tp']}), {s['dp']} dp ranks x"
              if s.get("pp", 1) > 1 else
              f"{s['world']} ranks (dp {s['dp']} x tp {s['tp']}), {s['dp']} dp ranks x" if s.get("tp", 1) > 1
              else f"{s['world']} ranks x" if s["world"] > 1 else "1 rank x")
    micro = f"{s['microbatches']} micro-batches x " if s.get("microbatches", 1) > 1 else ""
    console.print(f"[bold]attnpool train[/]: {s['model']} ({s['params'] / 1e6:.2f}M params), {layout} "
                  f"{micro}{s['tokens_per_rank']} tokens, {s['strategy']} attention"
                  + (f" over the {s['layout']} layout" if s.get("layout", "linear") != "linear" else ""), highlight=False)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("steps", f"{s['start_step'] + 1}..{s['end_step']} of {s['steps']} in {s['wall_s']:.0f} s "
                           f"({s['steps_time_s']:.0f} s of steps; the rest start-up, compile and checkpoints)")
    last = s["end_step"]
    if s.get("layer_checkpointing"):
        table.add_row("checkpointing", "auto: " + auto_choice(s["layer_checkpointing"], s["activation_offload"]))
    table.add_row("loss", f"{s['first_loss']:.3f} at step 1 -> {s['last_loss_mean']:.3f} mean of steps "
                          f"{last - s['last_loss_steps'] + 1}..{last} (step {last}: {s['last_loss']:.3f})")
    mfu = "" if s.get("mfu") is None else f", MFU {s['mfu']:.3f}"
    left_out = s.get("steady_steps_left_out")
    without = f" but {_steps(left_out)}, which compiled" if left_out else ""
    table.add_row("throughput", f"{_fmt_rate(s['steady_tokens_per_s'])} tokens/s steady (median of steps "
                                f"{s['steady_from_step']}..{last}{without}{mfu}); {_fmt_rate(s['tokens_per_s'])} "
                                f"tokens/s over all, {s['step_time_s_mean']:.3f} s/step")
    if s.get("compile_s_total") is not None:
        later = [step for step in s["compiled_steps"] if step > s["start_step"] + 1]
        table.add_row("compile", f"{s['compile_s_total']:.1f} s compiling, in "
                                 + (_steps(s["compiled_steps"]) if s["compiled_steps"] else "no step")
                                 + (" (later steps compile where their token counts leave the ranges compiled "
                                    "before)" if later else ""))
    measured = s.get("exchange_gibps_measured")
    table.add_row("attention max/mean", f"local would have had {s['imbalance_local_mean']:.3f} (last step "
                                        f"{s['imbalance_local_last']:.3f}); {s['strategy']} reached "
                                        f"{s['imbalance_planned_mean']:.3f} (last step {s['imbalance_planned_last']:.3f})"
                                        + (f", its bytes priced at {s['exchange_gibps']:{'.3g' if measured else 'g'}} "
                                           f"GiB/s (exchange_gibps{' auto, measured at the start' if measured else ''})"
                                           if s.get("exchange_gibps") is not None else ""))
    # Ping-pong interleaves core attention with the linear layers, the pooled pipeline runs it over ticks: no time
    # of its own to report.
    attention = ("core attention interleaved with other work, all-to-all" if s["attention_time_s_mean"] is None
                 else f"core attention {s['attention_time_s_mean']:.3f} s, of it all-to-all")
    table.add_row("per step", f"{attention} {s['comm_time_s_mean']:.3f} s; {s['comm_bytes_mean'] / 2**20:.2f} MiB sent")
    if s.get("attention_density_mean") is not None:
        served, pairs, kernel = (s.get(f"{key}_mean") for key in SPARSE_IMBALANCES)
        table.add_row("sparse attention", f"{s['attention_density_mean']:.3f} of the causal (query, key) pairs computed"
                      + (f"; served work max/mean {served:.3f} (measured tiles, priced as planned)"
                         if served is not None else "")
                      + (f", in pairs {pairs:.3f}" if pairs is not None else "")
                      + (f", kernel time {kernel:.3f}" if kernel is not None else ""))
    memory = f"{s['peak_memory_bytes'] / 2**20:.0f} MiB (largest rank)"
    if s.get("peak_reserved_bytes"):
        memory = (f"{s['peak_memory_bytes'] / 2**30:.1f} GiB allocated, {s['peak_reserved_bytes'] / 2**30:.1f} GiB "
                  f"reserved (largest rank)")
    if s.get("predicted_peak_memory_bytes"):
        memory += f"; predicted {s['predicted_peak_memory_bytes'] / 2**30:.1f} GiB allocated"
        if s.get("predicted_device_bytes"):
            memory += f", {s['predicted_device_bytes'] / 2**30:.1f} GiB of the GPU with the CUDA context"
    table.add_row("peak memory", memory)
    table.add_row("files", "\n".join(files))
    console.print(table, highlight=False)


def plot_run(rows: list[dict], last_loads: dict | None, strategy: str, path: str) -> None:
    """Loss curve, and the per-rank attention load of the last step: local vs the plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_load) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = [r["step"] for r in rows]
    loss = np.asarray([r["loss"] for r in rows])
    ax_loss.plot(steps, loss, lw=0.8, color="#9ecae1", label="per step")
    if len(loss) >= 10:  # each step is a few documents: show the trend as well
        k = max(5, len(loss) // 15)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax_loss.plot(steps[k - 1:], smooth, lw=1.6, color="#1f77b4", label=f"mean of {k} steps")
        ax_loss.legend(fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (mean over tokens)")
    ax_loss.set_title("training loss", fontsize=10)
    ax_loss.grid(alpha=0.3)
    if last_loads is not None:
        before = np.asarray(last_loads["local"], dtype=float)
        after = np.asarray(last_loads["planned"], dtype=float)
        mean = after.mean() if after.mean() > 0 else 1.0
        x = np.arange(len(before))
        width = 0.4
        ax_load.bar(x - width / 2, before / mean, width, color="#bbbbbb",
                    label=f"local (max/mean {before.max() / mean:.2f})")
        ax_load.bar(x + width / 2, after / mean, width, color="#1f77b4",
                    label=f"{strategy} (max/mean {after.max() / mean:.2f})")
        ax_load.axhline(1.0, color="k", lw=0.8, ls="--")
        ax_load.set_xticks(x)
        ax_load.set_xlabel("rank")
        ax_load.set_ylabel("attention load / mean")
        ax_load.set_title(f"attention load per rank, step {rows[-1]['step']} ({last_loads['unit']})", fontsize=10)
        ax_load.legend(fontsize=8, loc="upper left")
    # fixed margins: tight_layout drew the figure once more only to measure it (a third of a tiny run's time)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.13, top=0.92, wspace=0.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)
