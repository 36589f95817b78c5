"""GPU time of a traced step by the core attention phase that launched each kernel: what `attnpool bench --trace`'s
trace (trace-*.json.gz) spends in the attention kernels and in the copies and exchanges around them.

    python bench/trace_breakdown.py OUT/trace-prolong-128K-cad.json.gz [--json breakdown.json]

A kernel is put under the longest enclosing CPU op, on the thread that launched it, whose name holds one of
``PHASES`` (core attention's autograd functions, forward and backward; Ulysses' forward, its exchanges and its
kernel call, whose backward nodes it names; its backward's reordering copies are IndexBackward0, under "other");
kernels launched elsewhere fall under "other" (the model's linear layers, norms, the loss, FSDP's collectives). Within a phase the
kernels are grouped as attention kernels, indexed copies (index, gather, scatter, index_add), plain copies (device
to device memcpy, which a contiguous slice's copy is, and copy or cat kernels), collectives, and the rest, so that a
change to the dispatch's copies shows as a change in two columns. Memcpy and memset are counted with the kernels.

It also says how much of core attention's collective kernels' time another collective ran beside them on the same
GPU (one under "other": FSDP's gathers and reductions): on a network where every collective shares one slow link
(bench/gpu_e2e.sh emulated-trace), an exchange of a few MiB that runs for tens of milliseconds beside FSDP's
transfers is waiting for them, not moving its own bytes.

And it says where each GPU's compute stream (the stream of most kernel time outside collectives) stood idle within
the traced step, and what ran meanwhile: a core attention phase's collective (the one of earliest start among
those running), another collective (FSDP's), a kernel on another stream (activation offload's copies, FSDP2's
copy-in), or nothing (the host behind). A collective's time alone says little under ping-pong, where it runs behind the other nano-batch's compute;
the compute stream's idle time beside it is what the step lost to it.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

PHASES = ("_DispatchStart", "_DispatchWait", "_Serve", "_ReturnStart", "_Collect", "_Relay",  # cad's
          "ulysses_attention", "_Exchange", "_Attention")  # Ulysses' forward (a record_function), exchanges, kernel
KINDS = (("attention kernel", ("flash_attn", "flash_fwd", "flash_bwd", "FlashAttention", "fmha")),
         ("indexed copy", ("index_elementwise", "indexFunc", "gather", "scatter", "index_put")),
         ("plain copy", ("Memcpy", "copy_kernel", "CatArrayBatchedCopy")),
         ("collective", ("nccl",)),
         ("other", ("",)))


def kind_of(kernel: str) -> str:
    return next(name for name, keys in KINDS if any(key in kernel for key in keys))


def breakdown(kernels: list[tuple]) -> dict[str, dict[str, float]]:
    """Milliseconds of kernel time (memcpy and memset included) by phase and kind, of :func:`classified`'s kernels."""
    table: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for phase, kind, k in kernels:
        table[phase][kind] += k["dur"] / 1e3
    return {phase: dict(kinds) for phase, kinds in table.items()}


def beside_other_collectives(kernels: list[tuple]) -> dict[str, float]:
    """Milliseconds of core attention's collective kernels (:func:`classified`'s), and of that time the part during
    which a collective launched outside core attention ran on the same device (each instant counted once)."""
    attention, other = collections.defaultdict(list), collections.defaultdict(list)
    for phase, kind, k in kernels:
        if kind == "collective":
            device = k.get("args", {}).get("device")
            (other if phase == "other" else attention)[device].append((k["ts"], k["ts"] + k["dur"]))
    total = beside = 0.0
    for device, spans in attention.items():
        merged = _merged(other.get(device, []))
        ends = [end for _, end in merged]
        for start, end in spans:
            total += end - start
            i = bisect.bisect_right(ends, start)
            while i < len(merged) and merged[i][0] < end:
                beside += min(end, merged[i][1]) - max(start, merged[i][0])
                i += 1
    return {"attention_collectives_ms": total / 1e3, "beside_other_collectives_ms": beside / 1e3}


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) spans, as disjoint spans in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def compute_stream_idle(kernels: list[tuple]) -> dict[str, dict]:
    """Per device, of :func:`classified`'s kernels: the compute stream, the span from the device's first kernel to its
    last (ms), the compute stream's busy time, and its idle time by what ran meanwhile (ms): a core attention
    phase's collective, "other collective", "kernel on another stream" or "nothing"."""
    by_device = collections.defaultdict(list)
    for phase, kind, k in kernels:
        args = k.get("args", {})
        by_device[args.get("device")].append((phase, kind, k["ts"], k["ts"] + k["dur"], args.get("stream")))
    out = {}
    for device, rows in by_device.items():
        busy_by_stream = collections.Counter()
        for _, kind, start, end, stream in rows:
            if kind != "collective":
                busy_by_stream[stream] += end - start
        compute = max(busy_by_stream, key=busy_by_stream.get) if busy_by_stream else None
        # a sweep over every kernel's start and end: between two of them the compute stream is busy or not, and
        # the same kernels run elsewhere
        points = []
        for phase, kind, start, end, stream in rows:
            if stream == compute and kind != "collective":
                label = None  # the compute stream's own
            elif kind == "collective":
                label = "other collective" if phase == "other" else phase
            else:
                label = "kernel on another stream"
            points += [(start, 1, label, start), (end, -1, label, start)]
        points.sort(key=lambda p: (p[0], p[1]))
        running: collections.Counter = collections.Counter()  # (label, start) of what runs off the compute stream
        busy = 0
        idle: dict[str, float] = collections.defaultdict(float)
        busy_us = 0.0
        for (t, step, label, start), (t_next, *_) in zip(points, points[1:] + [points[-1]]):
            if label is None:
                busy += step
            else:
                running[(label, start)] += step
                if running[(label, start)] == 0:
                    del running[(label, start)]
            if t_next <= t:
                continue
            if busy:
                busy_us += t_next - t
                continue
            collectives = [(s, lab) for lab, s in running if lab != "kernel on another stream"]
            if collectives:
                idle[min(collectives)[1]] += t_next - t
            elif running:
                idle["kernel on another stream"] += t_next - t
            else:
                idle["nothing"] += t_next - t
        out[str(device)] = {"compute_stream": compute, "span_ms": (points[-1][0] - points[0][0]) / 1e3,
                            "compute_busy_ms": busy_us / 1e3,
                            "idle_ms": {k: v / 1e3 for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}}
    return out


def classified(events: list[dict]):
    """Each kernel, memcpy and memset of the trace as (phase, kind, event)."""
    # (NCCL and CuTe DSL kernels are launched through the driver API: cuLaunchKernelEx, category cuda_driver)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = collections.defaultdict(list)  # per thread: the phases' ops, by start
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation") \
                and any(p in e["name"] for p in PHASES):
            ops[e["tid"]].append(e)
    starts = {}
    for tid, list_ in ops.items():
        list_.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in list_]
    # (a slice's copy between contiguous buffers is a cudaMemcpyAsync: category gpu_memcpy, not kernel)
    for k in (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        launch = launches.get(k.get("args", {}).get("correlation"))
        phase = "other"
        if launch is not None and launch["tid"] in ops:
            candidates = ops[launch["tid"]][:bisect.bisect_right(starts[launch["tid"]], launch["ts"])]
            enclosing = [o for o in candidates if o["ts"] + o["dur"] >= launch["ts"]]
            if enclosing:
                name = max(enclosing, key=lambda o: o["dur"])["name"]
                phase = next(p for p in PHASES if p in name) + (" (backward)" if "Backward" in name else "")
        yield phase, kind_of(k["name"]), k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace-*.json.gz (or .json) of attnpool bench --trace")
    parser.add_argument("--json", default=None, help="also write the breakdown here")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = list(classified(events))
    table, beside, idle = breakdown(kernels), beside_other_collectives(kernels), compute_stream_idle(kernels)
    kinds = [name for name, _ in KINDS]
    print("| phase | " + " | ".join(f"{k} (ms)" for k in kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for phase in sorted(table, key=lambda p: (p == "other", p)):
        print(f"| {phase} | " + " | ".join(f"{table[phase].get(k, 0.0):.1f}" for k in kinds) + " |")
    attention = {k: sum(row.get(k, 0.0) for p, row in table.items() if p != "other") for k in kinds}
    print("| all core attention | " + " | ".join(f"{attention[k]:.1f}" for k in kinds) + " |")
    print(f"core attention's collectives {beside['attention_collectives_ms']:.1f} ms, of it "
          f"{beside['beside_other_collectives_ms']:.1f} ms beside another collective (FSDP's) on the same GPU")
    for device, row in idle.items():
        print(f"device {device}: compute stream {row['compute_stream']} busy {row['compute_busy_ms']:.1f} of "
              f"{row['span_ms']:.1f} ms; idle beside " +
              (", ".join(f"{what} {ms:.1f}" for what, ms in row["idle_ms"].items()) or "nothing") + " ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "ms_by_phase_and_kind": table, **beside, "compute_stream_idle": idle},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
