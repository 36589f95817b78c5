#!/usr/bin/env python3
"""GPU check of the fa4 kernel backend (FlashAttention-4, issue 23) against the reference and flash backends.

1. Exactness. Unit-scale bf16 inputs; the reference backend runs in float64 on the same (bf16) values;
   fa4 and, as a yardstick of what bf16 allows, flash run in bf16. Forward out and lse, backward dq, dk,
   dv. Cases: odd shard lengths (GQA 32/8 and plain 16/16, head_dim 128), empty shards (q_len 0, with and
   without keys), and rows that see no key (q_len > k_len: the kernels contract allows it, the planner
   never makes it). Pass: max |fa4 - reference| <= 1e-2 x max(1, max |reference|) for every tensor (1e-2
   absolute on unit-scale tensors; gradients summed over a GQA group or a long prefix grow past 1, where
   rounding the result to bf16 alone costs 2^-8 of it), the same -inf lse rows, and the contract's zeros
   in rows without keys.
2. CA-task kernel benchmark, "prefix copies": one document cut into equal query shards, each a kernel
   segment with its own copy of its causal prefix (K/V gathered from the document's unique rows), forward,
   then backward in groups of at most BACKWARD_GROUP_KEYS key rows (runtime.dispatch.backward_in_parts)
   and the prefix copies' gradients summed back (runtime.dispatch.PrefixCopies): how the runtime serves
   shards of one document that do not continue each other with a backend that has no PositionKernel
   (flash); and the same layout as one bare kernel call each way ("one call", what raw FA4 measured).
3. The server step itself (runtime.core_attention.serve_forward / serve_backward, what _Serve runs between
   its exchanges) on layouts made by a plan: rank 0 of two serves some of the document's query shards
   ("all": every shard, which the plan makes one task and the runtime one causal segment; "odd", "every
   4th", "first and last 8", "first and last quarter": shards that do not continue each other, which fa4
   serves without copies, as one call over the document's unique keys at the queries' positions, or with
   at most runtime.dispatch.MAX_CAUSAL_CALL_SEGMENTS segments as a causal call per segment over the keys it
   reads, then also timed as one position call ("fa4 position call"); flash makes the same causal calls and
   copies prefixes where fa4 makes a position call (records before 2026-11-30: flash copied throughout, so
   their speedups over flash on a few segments are against copies); "fa4 copies" is fa4 on the copies path,
   against whose gradients fa4's calls are also checked).
   fa4 and flash in the same run; TFLOP/s from causal pairs (forward 4 * D * H_q * pairs, forward+backward
   3.5x that); medians of several runs after a warm-up that includes FA4's compilation.

Usage (one H100/H200; flash_attn.cute importable, or unpacked into DIR as
../shared/recipes/fa4-on-the-device.md says):
    PYTHONPATH=src python3 bench/gpu_fa4.py --site DIR --out OUT [--quick]     # under 3 minutes
    PYTHONPATH=src python3 bench/gpu_fa4.py --device cpu --out OUT             # the reference stands in for
                                                                               # fa4 and flash: checks the script
Writes OUT/gpu_fa4.json and prints a short table last; exit 1 when an exactness check fails, 2 when fa4
cannot run here (the reason printed). FA4 compiles each kernel configuration on its first call (seconds
each; counted in the exactness phase's time): FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 keeps them on disk
for a second run on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import platform
import site
import statistics
import sys
import time
import traceback

import numpy as np
import torch

from attnpool.bench.timing import cuda_median_s
from attnpool.kernels import Backend, get_backend, reference
from attnpool.sizes import parse_size
from attnpool.plan.documents import DocPiece, PieceTable
from attnpool.plan.plan import make_plan
from attnpool.runtime import dispatch
from attnpool.runtime.core_attention import serve_backward, serve_forward, serves_documents
from attnpool.runtime.dispatch import (BACKWARD_GROUP_KEYS, DispatchLayout, PrefixCopies, SegmentRows,
                                      backward_in_parts, segment_groups)

MAX_ABS = 1e-2  # per unit of max(1, max |reference|)
INF = float("inf")


# --- what runs where ---

def backends_under_test(device: torch.device) -> dict[str, Backend]:
    """{"fa4": ..., "flash": ...}; on the CPU the reference backend stands in for both (for flash without its
    PositionKernel, as flash has none)."""
    if device.type == "cpu":
        return {"fa4": reference.BACKEND, "flash": dataclasses.replace(reference.BACKEND, positions=None)}
    return {name: get_backend(name, device) for name in ("fa4", "flash")}


def median_s(fn, device: torch.device, warmup: int, reps: int) -> float:
    if device.type == "cuda":
        return cuda_median_s(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32, device=device)


# --- exactness ---

def exactness_cases(quick: bool):
    """(name, segments as (q_len, k_len), H_q, H_kv, head_dim): two GQA ratios at head_dim 128, so that
    FA4 compiles few kernels."""
    odd = [(1, 1), (7, 7), (13, 29), (127, 255), (129, 129), (333, 1000), (3, 700), (1000, 1000)]
    empty = [(0, 37), (0, 0), (64, 64), (0, 513), (5, 5), (0, 1)]
    keyless = [(5, 0), (300, 200), (64, 1), (257, 257), (3, 9)]
    if quick:
        odd = odd[:6]
    return [
        ("odd_shards_gqa_32_8", odd, 32, 8, 128),
        ("odd_shards_plain_16_16", odd, 16, 16, 128),
        ("empty_shards_gqa_32_8", empty, 32, 8, 128),
        ("keyless_rows_gqa_32_8 (contract edge)", keyless, 32, 8, 128),
    ]


def keyless_rows(segments) -> list[int]:
    """Query rows that see no key: the first q_len - k_len rows of a segment with q_len > k_len."""
    rows, start = [], 0
    for q_len, k_len in segments:
        rows += range(start, start + min(q_len, max(0, q_len - k_len)))
        start += q_len
    return rows


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over want's finite entries; inf where the -inf entries differ."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return INF
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


def scale_of(want: torch.Tensor) -> float:
    """max(1, max |want| over finite entries): what the tolerance is a fraction of."""
    finite = want[torch.isfinite(want)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def run_backend(backend: Backend, q, k, v, dout, args):
    out, lse = backend.forward(q, k, v, *args)
    return (out, lse, *backend.backward(dout, q, k, v, out, lse, *args))


def check_case(name, segments, n_q, n_kv, dim, device, backends, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t_q, t_k = sum(s[0] for s in segments), sum(s[1] for s in segments)

    def unit(tokens, heads):  # unit scale, rounded to bf16 once: every backend sees the same values
        return torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16).to(device)

    q, k, v, dout = unit(t_q, n_q), unit(t_k, n_kv), unit(t_k, n_kv), unit(t_q, n_q)
    args = (cumulative([s[0] for s in segments], device), cumulative([s[1] for s in segments], device),
            max(s[0] for s in segments), max(s[1] for s in segments))
    want = run_backend(reference.BACKEND, *(x.double() for x in (q, k, v, dout)), args)
    names = ("out", "lse", "dq", "dk", "dv")
    scales = {n: scale_of(w) for n, w in zip(names, want)}
    errors = {}
    for label, backend in backends.items():
        got = run_backend(backend, q, k, v, dout, args)
        errors[label] = {n: max_abs_error(g, w) for n, g, w in zip(names, got, want)}
        if label == "fa4":
            out, lse, dq, dk, dv = got
    blind = keyless_rows(segments)
    checks = {
        "lse_is_float32_heads_by_tokens": lse.dtype == torch.float32 and tuple(lse.shape) == (n_q, t_q),
        "out_dtype_and_shape": out.dtype == q.dtype and out.shape == q.shape,
        "keyless_lse_is_minus_inf": bool((lse[:, blind] == -INF).all()),
        "keyless_out_and_dq_are_zero": bool((out[blind] == 0).all() and (dq[blind] == 0).all()),
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv)),
    }
    passed = all(e <= MAX_ABS * scales[n] for n, e in errors["fa4"].items()) and all(checks.values())
    return dict(name=name, heads=[n_q, n_kv], head_dim=dim, segments=segments, keyless_rows=len(blind),
                max_abs=errors, scale=scales, checks=checks, passed=passed)


def position_cases(quick: bool):
    """(name, query spans of one document, its keys): non-adjacent shards, odd lengths, a single row."""
    cases = [("positions_odd_spans", [(0, 100), (500, 777), (1200, 1201), (2000, 3001)], 3001),
             ("positions_tail_blocks", [(1024, 2048), (3072, 4096)], 4096),
             ("positions_one_row_many_keys", [(37, 38), (2900, 4097)], 4097)]
    return cases[:2] if quick else cases


def check_position_case(name, spans, num_keys, n_q, n_kv, dim, device, backend: Backend, seed=0) -> dict:
    """The backend's PositionKernel in bf16 against the reference's in float64 on the same values."""
    gen = torch.Generator().manual_seed(seed)
    positions = np.concatenate([np.arange(a, b) for a, b in spans])

    def unit(tokens, heads):
        return torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16).to(device)

    q, dout, k, v = unit(len(positions), n_q), unit(len(positions), n_q), unit(num_keys, n_kv), unit(num_keys, n_kv)

    def run(kernel, *tensors):
        handle = kernel.prepare(positions, num_keys, device)
        q, k, v, dout = tensors
        out, lse = kernel.forward(q, k, v, handle)
        return (out, lse, *kernel.backward(dout, q, k, v, out, lse, handle))

    want = run(reference.BACKEND.positions, *(x.double() for x in (q, k, v, dout)))
    got = run(backend.positions, q, k, v, dout)
    names = ("out", "lse", "dq", "dk", "dv")
    errors = {n: max_abs_error(g, w) for n, g, w in zip(names, got, want)}
    scales = {n: scale_of(w) for n, w in zip(names, want)}
    passed = all(e <= MAX_ABS * scales[n] for n, e in errors.items())
    return dict(name=name, heads=[n_q, n_kv], head_dim=dim, spans=spans, num_keys=num_keys, keyless_rows=0,
                max_abs={"fa4": errors}, scale=scales, checks={}, passed=passed)


# --- the CA-task benchmark ---

def timed(row: dict, forward, forward_backward, fwd_flops: float, device, warmup: int, reps: int) -> dict:
    """``row`` with the medians of ``forward`` and ``forward_backward`` and their TFLOP/s (forward+backward
    counted 3.5 forwards), or the error they raised: an OOM of one path must not hide the others."""
    try:
        row["fwd_ms"] = 1e3 * median_s(forward, device, warmup, reps)
        row["fwd_bwd_ms"] = 1e3 * median_s(forward_backward, device, warmup, reps)
        row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_ms"] / 1e9
    except Exception as error:
        row["error"] = repr(error)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def add_speedups_over_flash(rows: list[dict]) -> dict:
    """Each fa4 row's speed-up over flash's row of the same path, in the row; returns the rows that ran by
    (backend, path)."""
    by = {(r["backend"], r["path"]): r for r in rows if "error" not in r}
    for r in rows:
        flash_row = by.get(("flash", r["path"]))
        if r["backend"] in ("fa4", "fa4 position call") and "error" not in r and flash_row:
            r["fwd_bwd_speedup_over_flash"] = flash_row["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            r["fwd_speedup_over_flash"] = flash_row["fwd_ms"] / r["fwd_ms"]
    return by


def ca_tasks(doc_len: int, shard: int):
    """Query shards [a, a + shard) of one document with keys [0, a + shard): (q_len, k_len) per segment."""
    ends = np.arange(shard, doc_len + 1, shard)
    return np.full(len(ends), shard), ends


def bench_layout(doc_len, shard, n_q, n_kv, dim, device, backends, warmup, reps,
                 group_keys=(BACKWARD_GROUP_KEYS,)) -> list[dict]:
    q_len, k_len = ca_tasks(doc_len, shard)
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(tokens, heads):
        return torch.randn(tokens, heads, dim, generator=gen, device=device, dtype=dtype)

    q, dout = randn(doc_len, n_q), randn(doc_len, n_q)
    k_doc, v_doc = randn(doc_len, n_kv), randn(doc_len, n_kv)
    # The unique KV row of each key of each segment: every shard reads its own copy of its prefix.
    kv_expand = torch.as_tensor(np.concatenate([np.arange(end) for end in k_len]), device=device)
    call = (cumulative(q_len, device), cumulative(k_len, device), int(q_len.max()), int(k_len.max()))
    copies = PrefixCopies.of(np.zeros(len(k_len)), k_len, doc_len, device)  # every prefix starts at row 0
    segments = np.arange(len(k_len))
    fwd_flops = 4.0 * dim * n_q * doc_len * (doc_len + 1) / 2  # the tasks' union is the document's causal pairs
    rows = []
    for label, backend in backends.items():
        def server_forward():  # _Serve.forward: the prefix copies gathered, one kernel call
            k, v = k_doc[kv_expand], v_doc[kv_expand]
            return k, v, *backend.forward(q, k, v, *call)

        def server_forward_backward(parts, impl="auto"):  # and _Serve.backward: grouped calls, copies summed
            k, v, out, lse = server_forward()
            dq, dk, dv = backward_in_parts(parts, dout, q, k, v, out, lse, None)
            return dq, copies.sum(dk, impl), copies.sum(dv, impl)

        k_exp, v_exp = k_doc[kv_expand], v_doc[kv_expand]

        def one_call_forward():
            return backend.forward(q, k_exp, v_exp, *call)

        def one_call_forward_backward():
            out, lse = backend.forward(q, k_exp, v_exp, *call)
            return backend.backward(dout, q, k_exp, v_exp, out, lse, *call)

        paths, default_path = [], None
        for keys in group_keys:  # the kernel path with each backward group size asked for
            parts = [(SegmentRows.of(q_len, k_len, (segments >= a) & (segments < b), device), backend)
                     for a, b in segment_groups(k_len, keys)]
            path = "prefix copies" + ("" if keys == BACKWARD_GROUP_KEYS else f" ({keys // 1024}K groups)")
            paths.append((path, keys, len(parts), server_forward, functools.partial(server_forward_backward, parts)))
            if keys != BACKWARD_GROUP_KEYS:
                continue
            default_path = paths[-1][4]
            if device.type == "cuda":  # the A/B of the copies' sum (kernels.prefix_sum)
                paths.append((path + " (torch prefix sum)", keys, len(parts), server_forward,
                              functools.partial(server_forward_backward, parts, "torch")))
            if backend.backward_into:  # the A/B of writing groups in place
                copied = [(rows, dataclasses.replace(backend, backward_into=False)) for rows, _ in parts]
                paths.append((path + " (groups copied)", keys, len(parts), server_forward,
                              functools.partial(server_forward_backward, copied)))
        paths.append(("one call", None, 1, one_call_forward, one_call_forward_backward))
        # The kernel path's gradients (groups written in place, the copies summed as the path sums them)
        # against one call's summed in torch: the grouped backward must compute what one call does.
        path_vs_one_call = None
        if default_path is not None:
            try:
                got = default_path()
                dq1, dk1, dv1 = one_call_forward_backward()
                want = (dq1, copies.sum(dk1, "torch"), copies.sum(dv1, "torch"))
                del dk1, dv1
                path_vs_one_call = {name: ((g.float() - w.float()).abs().max()
                                           / w.float().abs().max().clamp_min(1e-30)).item()
                                    for name, g, w in zip(("dq", "dk", "dv"), got, want)}
                del got, want, dq1
            except Exception as error:  # an OOM here must not end the benchmark
                path_vs_one_call = {"error": repr(error)}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for path, keys, calls, fwd, fwd_bwd in paths:
            row = dict(backend=label, path=path, doc_len=doc_len, shard=shard, shards=len(q_len),
                       backward_group_keys=keys, backward_calls=calls)
            if path == "prefix copies" and path_vs_one_call:  # max |difference| / max |one call's|
                row["grads_vs_one_call"] = path_vs_one_call
            rows.append(timed(row, fwd, fwd_bwd, fwd_flops, device, warmup, reps))
        k_exp = v_exp = None  # freed before the next layout's (the closures above read these names)
    by = add_speedups_over_flash(rows)
    for r in rows:
        flash_default = by.get(("flash", "prefix copies"))
        if r["backend"] == "fa4" and "error" not in r and flash_default and r["path"] != "one call":
            # what the runtime's default flash path gives: the A/B of a backend switch inside attnpool
            r["fwd_bwd_speedup_over_flash_default"] = flash_default["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def server_layout(doc_len: int, shard: int, served, device, position_call: bool = False):
    """Rank 0's DispatchLayout where a plan of two ranks has rank 0 hold the whole document and serve the
    query shards ``served`` (indices), rank 1 the others: the runtime's own cut of that work into calls
    (``position_call``: a split document in one position call however few its segments)."""
    pieces = PieceTable.from_pieces([[DocPiece(0, doc_len, 0, doc_len)], []])
    count = doc_len // shard
    start = np.arange(count) * shard
    server = np.where(np.isin(np.arange(count), served), 0, 1)
    plan = make_plan("bench", pieces, np.zeros(count), start, start + shard, np.zeros(count), server, shard)
    kept = dispatch.MAX_CAUSAL_CALL_SEGMENTS
    dispatch.MAX_CAUSAL_CALL_SEGMENTS = 1 if position_call else kept
    try:
        return plan, DispatchLayout.build(plan, 0, device)
    finally:
        dispatch.MAX_CAUSAL_CALL_SEGMENTS = kept


def calls_made(L: DispatchLayout, backend: Backend, q: torch.Tensor) -> str:
    """How the server step calls the kernel on layout ``L`` under ``backend`` for queries like ``q``."""
    k_len = L.segment_keys
    if not serves_documents(L, backend, q):
        return "one causal segment" if L.kv_expand_identity else f"{len(k_len)} segments, prefix copies"
    D = L.documents
    return ", ".join([f"{len(D.calls)} document call"] * bool(D.calls)
                     + [f"{sum(map(len, D.segmented))} causal calls"] * bool(D.segmented))


def server_layouts(doc_len: int, shard: int):
    count = doc_len // shard
    quarter = max(1, count // 4)
    return {"all": range(count), "odd": range(1, count, 2), "every 4th": range(3, count, 4),
            "first and last 8": [*range(min(8, count)), *range(max(8, count - 8), count)],
            # percp's rank 0 of 2: the head and tail quarters, one copy avoided
            "first and last quarter": [*range(quarter), *range(count - quarter, count)]}


def grads_versus(grads: dict, against: str) -> dict:
    """Per fa4 path of ``grads`` (label -> (dq, dk, dv), or an error's text), max |difference| / max |against's|."""
    if not isinstance(grads.get(against), tuple):
        return {}
    return {label: {name: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                    for name, a, b in zip(("dq", "dk", "dv"), grads[label], grads[against])}
            for label in ("fa4", "fa4 position call") if isinstance(grads.get(label), tuple)}


def bench_server_step(doc_len, shard, n_q, n_kv, dim, device, backends, warmup, reps) -> list[dict]:
    """The server step on each layout with fa4, fa4 made to copy prefixes ("fa4 copies": the layout without
    its DocumentServing, where calls of their own beat the copies), fa4 in one position call where it makes a
    causal call per segment ("fa4 position call"), and flash."""
    fa4, flash = backends["fa4"], backends["flash"]
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, served in server_layouts(doc_len, shard).items():
        plan, L = server_layout(doc_len, shard, served, device)
        runs = {"fa4": (fa4, L), "fa4 copies": (fa4, dataclasses.replace(L, documents=None)), "flash": (flash, L)}
        if L.documents is not None and L.documents.segmented:
            runs["fa4 position call"] = (fa4, server_layout(doc_len, shard, served, device, position_call=True)[1])
        doc, q_len, k_len = plan.kernel_segments(0)
        pairs = float(((k_len - q_len + 1 + k_len) * q_len / 2).sum())  # each segment's rows see k - q + 1 .. k keys
        fwd_flops = 4.0 * dim * n_q * pairs

        def randn(tokens, heads):
            return torch.randn(tokens, heads, dim, generator=gen, device=device, dtype=dtype)

        q, dout, k, v = randn(L.num_server_q, n_q), randn(L.num_server_q, n_q), randn(L.num_unique_kv, n_kv), \
            randn(L.num_unique_kv, n_kv)
        grads = {}
        for label, (backend, layout) in runs.items():  # the gradients on this layout, compared below
            try:
                out, lse = serve_forward(layout, backend, q, k, v)
                grads[label] = serve_backward(layout, backend, dout, q, k, v, out, lse)
                del out, lse
            except Exception as error:  # the timing below records it
                grads[label] = repr(error)
        # another kernel (flash, on the same path where it makes the same calls), and the same kernel's copies path:
        # how the calls' gradients are assembled (the narrower segments' key gradients summed) against the copies'
        vs_flash, vs_copies = grads_versus(grads, "flash"), grads_versus(grads, "fa4 copies")
        del grads
        for label, (backend, layout) in runs.items():

            def forward():
                return serve_forward(layout, backend, q, k, v)

            def forward_backward():
                out, lse = serve_forward(layout, backend, q, k, v)
                return serve_backward(layout, backend, dout, q, k, v, out, lse)

            row = dict(backend=label, path=f"server step: {name}", doc_len=doc_len, shard=shard, shards=len(served),
                       segments=len(k_len), calls=calls_made(layout, backend, q), query_rows=L.num_server_q,
                       unique_kv_rows=L.num_unique_kv, expanded_kv_rows=int(k_len.sum()))
            if label in vs_flash:
                row["grads_vs_flash"] = vs_flash[label]
            if label in vs_copies:
                row["grads_vs_copies"] = vs_copies[label]
            rows.append(timed(row, forward, forward_backward, fwd_flops, device, warmup, reps))
        q = dout = k = v = None  # freed before the next layout's (the closures above read these names)
    add_speedups_over_flash(rows)
    return rows


# --- the run ---

def environment(device: torch.device) -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version(), device=str(device))
    if device.type == "cuda":
        from importlib import metadata

        info.update(cuda=torch.version.cuda, name=torch.cuda.get_device_name(device),
                    capability=".".join(map(str, torch.cuda.get_device_capability(device))))
        for package in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels"):
            try:
                info[package] = metadata.version(package)
            except metadata.PackageNotFoundError:  # unpacked wheels without their metadata on the path
                info[package] = None
    return info


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory for gpu_fa4.json")
    parser.add_argument("--site", type=pathlib.Path, action="append", default=[],
                        help="a folder of unpacked wheels to add to the path (site.addsitedir) before flash_attn.cute "
                             "is imported; may repeat")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the reference backend stands in for fa4 and flash, small sizes (a test of the script)")
    parser.add_argument("--quick", action="store_true", help="fewer cases, a 16K document, fewer repeats (about a minute)")
    parser.add_argument("--doc-len", type=int, default=None, help="document length (default 64K; 16K with --quick; "
                                                                  "2K on the CPU)")
    parser.add_argument("--shard", type=int, default=None, help="query-shard length (default 1024; 256 on the CPU)")
    parser.add_argument("--backward-group-keys", default=str(BACKWARD_GROUP_KEYS),
                        help="comma list of key rows per backward call to time the kernel path with (default "
                             f"{BACKWARD_GROUP_KEYS}, the runtime's); e.g. 128K,512K,4M")
    parser.add_argument("--skip-exactness", action="store_true", help="only the benchmark")
    parser.add_argument("--server-step-only", action="store_true",
                        help="only the server step's benchmark (part 3): no exactness checks, no CA-task kernel paths")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per median (default 7; 3 with --quick)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    opts.skip_exactness = opts.skip_exactness or opts.server_step_only
    for folder in opts.site:
        site.addsitedir(str(folder))
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu to check the script)", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    cpu = device.type == "cpu"
    doc_len = opts.doc_len or (2048 if cpu else 16384 if opts.quick else 65536)
    shard = opts.shard or (256 if cpu else 1024)
    reps = opts.reps or (3 if opts.quick or cpu else 7)
    heads = (4, 2, 32) if cpu else (32, 8, 128)  # H_q, H_kv, head_dim of the benchmark (Llama-3-8B's)
    result = dict(command=" ".join(sys.argv) if argv is None else " ".join(["bench/gpu_fa4.py", *argv]),
                  environment=environment(device), stand_in=("reference backend for fa4 and flash" if cpu else None),
                  tolerance_max_abs=MAX_ABS, exactness=[], benchmark=[])
    try:
        backends = backends_under_test(device)
    except Exception as error:  # fa4 cannot run here: say why, as the backend selection does
        print(f"gpu_fa4: {error}", file=sys.stderr)
        return 2

    for name, segments, n_q, n_kv, dim in ([] if opts.skip_exactness else exactness_cases(opts.quick)):
        if cpu:  # the same shapes, smaller: the float64 reference on two cores
            segments = [(min(a, 40), min(b, 80)) for a, b in segments]
            n_q, n_kv, dim = n_q // 8 or 1, n_kv // 8 or 1, 16
        try:
            result["exactness"].append(check_case(name, segments, n_q, n_kv, dim, device, backends))
        except Exception as error:  # one failing case must not hide the rest
            result["exactness"].append(dict(name=name, passed=False, error=repr(error),
                                            traceback=traceback.format_exc()))
        if not cpu:
            torch.cuda.empty_cache()
    for name, spans, num_keys in ([] if opts.skip_exactness else position_cases(opts.quick)):
        n_q, n_kv, dim = (4, 2, 16) if cpu else (32, 8, 128)
        if cpu:
            spans, num_keys = [(a // 8, max(a // 8 + 1, b // 8)) for a, b in spans], num_keys // 8 + 1
        try:
            result["exactness"].append(check_position_case(name, spans, num_keys, n_q, n_kv, dim, device,
                                                           backends["fa4"]))
        except Exception as error:
            result["exactness"].append(dict(name=name, passed=False, error=repr(error),
                                            traceback=traceback.format_exc()))
    result["seconds_exactness"] = time.time() - started  # FA4 compiles its kernels here, on their first calls
    group_keys = [parse_size(x) for x in opts.backward_group_keys.split(",")]
    result["benchmark"] = [] if opts.server_step_only else bench_layout(
        doc_len, shard, *heads, device, backends, warmup=2 if not cpu else 1, reps=reps, group_keys=group_keys)
    result["benchmark"] += bench_server_step(doc_len, shard, *heads, device, backends, warmup=2 if not cpu else 1,
                                             reps=reps)
    result["seconds"] = time.time() - started
    (opts.out / "gpu_fa4.json").write_text(json.dumps(result, indent=2))

    env = result["environment"]
    print(f"torch {env['torch']} on {env.get('name', env['device'])}"
          + (f", flash-attn-4 {env.get('flash-attn-4')}" if not cpu else ", reference standing in for fa4 and flash"))
    if opts.skip_exactness:
        print("\nexactness: skipped (--skip-exactness)")
    else:
        print(f"\nexactness: max |error| against the float64 reference (pass: fa4 <= {MAX_ABS:g} x max(1, max |reference|), "
              "the scale in brackets where above 1; flash for comparison)")
    for case in result["exactness"]:
        if "error" in case:
            print(f"  {case['name']:40s} ERROR {case['error']}")
            continue
        failed = [k for k, ok in case["checks"].items() if not ok]
        fa4_errors = " ".join(f"{k} {e:.1e}" + (f" [{case['scale'][k]:.1f}]" if case["scale"][k] > 1 else "")
                              for k, e in case["max_abs"]["fa4"].items())
        worst_flash = max(case["max_abs"]["flash"].values()) if "flash" in case["max_abs"] else None
        print(f"  {case['name']:40s} {'PASS' if case['passed'] else 'FAIL'}  fa4: {fa4_errors}  "
              + (f"(flash worst {worst_flash:.1e})" if worst_flash is not None else "(flash: no position kernel)")
              + (f"  failed: {failed}" if failed else ""))
    print(f"\nCA-tasks: a {doc_len}-token document in {shard}-token query shards with their prefixes, "
          f"H_q/H_kv/D {heads[0]}/{heads[1]}/{heads[2]}; TFLOP/s from causal pairs, median of {reps}")
    print(f"  {'backend':17s} {'path':40s} {'fwd ms':>8s} {'fwd':>6s} {'fwd+bwd ms':>11s} {'fwd+bwd':>8s} {'vs flash':>8s}")
    for row in result["benchmark"]:
        if "error" in row:
            print(f"  {row['backend']:17s} {row['path']:40s} ERROR {row['error'][:80]}")
            continue
        speedup = row.get("fwd_bwd_speedup_over_flash")
        print(f"  {row['backend']:17s} {row['path']:40s} {row['fwd_ms']:8.2f} {row['fwd_tflops']:6.1f} "
              f"{row['fwd_bwd_ms']:11.2f} {row['fwd_bwd_tflops']:8.1f} {f'{speedup:.2f}x' if speedup else '':>8s}"
              + (f" ({row['fwd_bwd_speedup_over_flash_default']:.2f}x flash's default)"
                 if "fwd_bwd_speedup_over_flash_default" in row and row["path"] != "prefix copies" else "")
              + (f"  [{row['calls']}]" if "calls" in row else "")
              + (" gradients vs one call: " + " ".join(f"{k} {e:.1e}" if isinstance(e, float) else f"{k} {e[:60]}"
                                                        for k, e in row["grads_vs_one_call"].items())
                 if "grads_vs_one_call" in row else "")
              + (" gradients vs flash: " + " ".join(f"{k} {e:.1e}" for k, e in row["grads_vs_flash"].items())
                 if "grads_vs_flash" in row else "")
              + (" vs copies: " + " ".join(f"{k} {e:.1e}" for k, e in row["grads_vs_copies"].items())
                 if "grads_vs_copies" in row else ""))
    ok = all(case["passed"] for case in result["exactness"])
    verdict = ("exactness not checked" if opts.skip_exactness else
               "ALL EXACTNESS CHECKS PASS" if ok else "SOME EXACTNESS CHECKS FAILED")
    print(f"\n{verdict} in {result['seconds']:.0f} s "
          f"(exactness and first compilations {result['seconds_exactness']:.0f} s); "
          f"wrote {opts.out / 'gpu_fa4.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
