"""``attnpool profile``: measure the cost table the simulator and the planner read, on the GPU at hand.

One JSON file per GPU type, in the cost-table format :class:`TableCost` reads
(``q_grid``, ``k_grid``, ``tables.fwd/fwd+bwd.tflops``, ``n_q_heads``, ``head_dim``), one
table per kernel backend measured (``--attention-backend``): the flash backend's at the top
level, where every reader before per-backend tables looks, the others' under
``backends.NAME`` (see :func:`attnpool.plan.cost.backend_table`); plus sections the
simulator reads:

- ``attention``: how the table was measured. For every grid point (query-shard
  length q, prefix length k >= q), one call of the kernel backend runs n
  equal CA-tasks (bottom-right causal, q queries over k keys each) fused in one
  varlen batch, n chosen to fill the GPU (about ``target_q_tokens`` query
  tokens) within a KV memory budget and a FLOP cap per call; median of CUDA
  event timings. TFLOP/s are counted from causal pairs as everywhere in
  attnpool (forward 4 * head_dim * heads * pairs; forward+backward 3.5x that).
  Points with q above ``q_measure_max`` (the kernel is saturated there and one
  call would take seconds) and points with q > k (no CA-task has them) are
  filled from the nearest measured point of the same column with a smaller q.
- ``linear``: seconds per token of one layer's linear part (norms, QKV and O
  projections, RoPE, SwiGLU MLP: a ``TransformerBlock`` whose core attention is
  the identity), forward and forward+backward, bf16, at a few token counts; the
  largest count gives the per-token figure. Also the LM head + cross-entropy.
- ``comm``: all-to-all and all-gather latency by message size on groups of
  2, 4, ... and all GPUs of this host (under torchrun, NCCL), and a fit
  ``t = latency + bytes / bandwidth`` per group size; the simulator reads the
  fit of the largest group. Skipped with one GPU.
- ``device``, ``torch``, ``cuda``, ``command``, ``seconds``.

The measuring functions need CUDA; everything that turns timings into the
table (:func:`attention_table`, :func:`linear_entry`, :func:`comm_entry`,
:func:`assemble`) takes a timing function and is tested on CPU with a fake one.
"""

from __future__ import annotations

from attnpool.bench.timing import cuda_median_s

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.cost import PHASES, TOP_LEVEL_BACKEND, attention_flops
from attnpool.plan.documents import causal_pairs

FORMAT = "attnpool-cost-table/1"
KV_TOKEN_BYTES_PER_HEAD = 2 * 2  # K and V, bf16


@dataclass(frozen=True)
class ProfileOptions:
    q_grid: tuple = tuple(2**i for i in range(7, 20))  # 128 .. 512K
    k_grid: tuple = tuple(2**i for i in range(7, 20))
    q_measure_max: int = 16384
    target_q_tokens: int = 65536
    max_kv_tokens: int = 4 * 2**20
    max_fwd_flops_per_call: float = 2e13  # about 60 ms forward on an H200
    n_q_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    models: tuple = ("llama3-8b",)
    linear_tokens: tuple = (4096, 8192, 16384)
    head_tokens: int = 8192
    comm_bytes: tuple = tuple(2**i for i in range(16, 29, 2))  # 64 KiB .. 256 MiB per rank
    min_time_s: float = 0.05  # repeat short calls until the timed runs cover this
    max_reps: int = 20

    @classmethod
    def quick(cls) -> "ProfileOptions":
        """A grid small enough for a smoke test in seconds."""
        return cls(q_grid=(128, 512, 2048), k_grid=(128, 512, 2048, 8192), q_measure_max=2048,
                   linear_tokens=(2048, 4096), head_tokens=2048, comm_bytes=(2**16, 2**20, 2**24), max_reps=5)

    def check(self) -> None:
        for name in ("q_grid", "k_grid"):
            g = list(getattr(self, name))
            if len(g) < 2 or any(x < 1 for x in g) or any(b <= a for a, b in zip(g, g[1:])):
                raise ConfigError(name, g, "needs at least 2 ascending positive lengths")
        if not any(q <= self.q_measure_max for q in self.q_grid):
            raise ConfigError("q_measure_max", self.q_measure_max, f"is below every q_grid point {list(self.q_grid)}")
        if self.n_q_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", self.n_kv_heads, f"must divide n_q_heads={self.n_q_heads}")


# --- turning timings into the table (no torch) ---

def tasks_per_call(q: int, k: int, opts: ProfileOptions) -> int:
    """How many equal (q, k) tasks one timed call fuses: enough to fill the GPU, within memory and time caps."""
    one = float(attention_flops(causal_pairs(k - q, k), opts.n_q_heads, opts.head_dim, "fwd"))
    return int(max(1, min(opts.target_q_tokens // q, opts.max_kv_tokens // k, math.floor(opts.max_fwd_flops_per_call / one))))


def attention_points(opts: ProfileOptions) -> list[tuple[int, int, int]]:
    """(q, k, n) for every measured point: q <= k and q <= q_measure_max."""
    return [(q, k, tasks_per_call(q, k, opts)) for q in opts.q_grid for k in opts.k_grid
            if q <= k and q <= opts.q_measure_max]


def attention_table(measure: Callable[[int, int, int, str], float], opts: ProfileOptions,
                    progress: Callable | None = None) -> dict:
    """Measure every point with ``measure(q, k, n, phase) -> seconds`` and fill the rest of the grid."""
    opts.check()
    qg, kg = list(opts.q_grid), list(opts.k_grid)
    tflops = {p: np.full((len(qg), len(kg)), np.nan) for p in PHASES}
    measured = []
    points = attention_points(opts)
    for i, (q, k, n) in enumerate(points):
        row = {"q": q, "k": k, "tasks": n}
        for phase in PHASES:
            t = float(measure(q, k, n, phase))
            if not (np.isfinite(t) and t > 0):
                raise ConfigError("timing", t, f"non-positive time for q={q} k={k} {phase}")
            flops = float(attention_flops(n * causal_pairs(k - q, k), opts.n_q_heads, opts.head_dim, phase))
            tflops[phase][qg.index(q), kg.index(k)] = flops / t / 1e12
            row[f"{phase}_ms"] = t * 1e3
            row[f"{phase}_tflops"] = flops / t / 1e12
        measured.append(row)
        if progress:
            progress(i + 1, len(points), row)
    filled = fill_table(tflops, qg, kg)
    if any(np.isnan(t).any() for t in tflops.values()):
        raise ConfigError("k_grid", kg, "has a column with no measured point (every k needs some q <= k)")
    return {
        "q_grid": [float(x) for x in qg],
        "k_grid": [float(x) for x in kg],
        "tables": {p: {"tflops": [[float(f"{x:.5g}") for x in row] for row in tflops[p]]} for p in PHASES},
        "attention": {
            "measured": measured,
            "filled": filled,
            "q_measure_max": opts.q_measure_max,
            "target_q_tokens": opts.target_q_tokens,
            "max_kv_tokens": opts.max_kv_tokens,
            "fill_rule": "a point with q > q_measure_max or q > k takes the value of the largest measured q <= min(q, k) in its column",
        },
    }


def fill_table(tflops: dict, qg: list, kg: list) -> int:
    """Fill unmeasured entries in place from the largest measured q <= min(q, k) of the same column."""
    count = 0
    ref = tflops[PHASES[0]]
    for ik, k in enumerate(kg):
        have = [iq for iq in range(len(qg)) if np.isfinite(ref[iq, ik])]
        if not have:
            continue
        for iq, q in enumerate(qg):
            if np.isfinite(ref[iq, ik]):
                continue
            lower = [j for j in have if qg[j] <= min(q, k)]
            src = max(lower) if lower else min(have)
            for p in tflops:
                tflops[p][iq, ik] = tflops[p][src, ik]
            count += 1
    return count


def linear_entry(measure: Callable[[int, str], float], cfg, tokens: tuple, head_measure: Callable[[str], float] | None = None,
                 head_tokens: int = 8192) -> dict:
    """Linear time of one layer from ``measure(T, phase) -> seconds`` (phase "fwd" or "fwd+bwd")."""
    from attnpool.sim.costs import head_flops_per_token, layer_flops_per_token

    pre, post = layer_flops_per_token(cfg)
    fwd = [float(measure(T, "fwd")) for T in tokens]
    fwd_bwd = [float(measure(T, "fwd+bwd")) for T in tokens]
    T = tokens[-1]
    out = {
        "tokens": list(tokens),
        "fwd_s": fwd,
        "fwd_bwd_s": fwd_bwd,
        "fwd_s_per_token": fwd[-1] / T,
        "fwd_bwd_s_per_token": fwd_bwd[-1] / T,
        "flops_per_token_fwd": pre + post,
        "tflops_fwd_bwd": 3 * (pre + post) * T / fwd_bwd[-1] / 1e12,
        "dims": {"dim": cfg.dim, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                 "ffn_dim": cfg.ffn_dim, "vocab_size": cfg.vocab_size},
    }
    if head_measure is not None:
        t = float(head_measure("fwd+bwd"))
        out["head_tokens"] = head_tokens
        out["head_fwd_bwd_s_per_token"] = t / head_tokens
        out["head_tflops_fwd_bwd"] = 3 * head_flops_per_token(cfg) * head_tokens / t / 1e12
    return out


def fit_latency_bandwidth(nbytes, seconds) -> dict:
    """Least-squares ``t = latency + bytes / bandwidth`` (latency clamped at >= 0)."""
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    slope, intercept = np.polyfit(x, t, 1) if len(x) >= 2 else (t[0] / x[0], 0.0)
    if slope <= 0:
        slope, intercept = float(t[-1] / x[-1]), 0.0
    return {"latency_s": float(max(0.0, intercept)), "bandwidth_Bps": float(1.0 / slope)}


def comm_entry(measure: Callable[[str, int], float], world: int, sizes: tuple, backend: str = "nccl") -> dict:
    """Collectives by message size from ``measure(kind, bytes_per_rank) -> seconds``.

    Bytes moved per rank: all-to-all sends ``(W - 1) / W`` of its buffer to others;
    all-gather receives ``W - 1`` inputs. The fit is over those bytes.
    """
    out = {"world_size": world, "backend": backend, "fit": {}}
    for kind, moved in (("all_to_all", lambda b: b * (world - 1) / world), ("all_gather", lambda b: b * (world - 1))):
        rows = []
        for b in sizes:
            t = float(measure(kind, b))
            rows.append({"bytes_per_rank": int(b), "seconds": t, "GBps_per_rank": moved(b) / t / 1e9})
        out[kind] = rows
        out["fit"][kind] = fit_latency_bandwidth([moved(r["bytes_per_rank"]) for r in rows], [r["seconds"] for r in rows])
    return out


def assemble(attention: dict, opts: ProfileOptions, *, linear: dict | None = None, comm: dict | None = None,
             device: dict | None = None, meta: dict | None = None, base: dict | None = None) -> dict:
    """The profile JSON: cost tables TableCost.from_json reads, plus linear, comm, device sections.

    ``attention``: the :func:`attention_table` of each kernel backend measured, by backend name.
    ``base``: an earlier profile whose sections (other backends' tables among them) are kept where
    this run measured nothing.
    """
    obj = dict(base or {})
    for backend, table in attention.items():
        section = {
            "source": f"attnpool profile: {backend} varlen, bf16, on {(device or {}).get('name', 'unknown device')}",
            "n_q_heads": opts.n_q_heads, "n_kv_heads": opts.n_kv_heads, "head_dim": opts.head_dim,
            "dtype": "bfloat16", **table,
        }
        if backend == TOP_LEVEL_BACKEND:
            obj.update(section)
        else:
            obj["backends"] = {**obj.get("backends", {}), backend: section}
    if attention:
        obj["format"] = FORMAT
    if linear:
        merged = dict((obj.get("linear") or {}).get("models", {}))
        merged.update(linear)
        obj["linear"] = {"models": merged,
                         "note": "one layer's linear part (TransformerBlock with identity core attention), one GPU, TP=1, "
                                 "seconds per token at the largest token count"}
    if comm is not None:
        obj["comm"] = comm
    elif "comm" not in obj:
        obj["comm"] = {"skipped": "one GPU: run under torchrun with several GPUs to measure collectives"}
    if device:
        obj["device"] = device
    obj.update(meta or {})
    return obj


# --- measuring on CUDA ---

def wall_median(fn, opts: ProfileOptions, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()``: the CPU stand-in for :func:`cuda_median` (tests)."""
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < 3 or (sum(times) < opts.min_time_s and len(times) < opts.max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)



def cuda_median(fn, opts: ProfileOptions, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` by CUDA events; repeats short calls until about ``min_time_s``."""
    return cuda_median_s(fn, warmup=warmup, reps=3, min_time_s=opts.min_time_s, max_reps=opts.max_reps)


@dataclass
class AttentionBench:
    """Buffers sized once for the largest call; each point uses views of them."""

    opts: ProfileOptions
    device: object
    backend_name: str = "flash"
    timer: Callable = cuda_median
    dtype: object = None  # default torch.bfloat16
    buffers: dict = field(default_factory=dict)

    def __post_init__(self):
        import torch

        from attnpool.kernels import get_backend

        self.backend = get_backend(self.backend_name, self.device)
        dtype = self.dtype or torch.bfloat16
        o = self.opts
        pts = attention_points(o)
        max_q = max(n * q for q, _, n in pts)
        max_k = max(n * k for _, k, n in pts)
        gen = torch.Generator(device=self.device).manual_seed(0)

        def randn(tokens, heads):
            return torch.randn(tokens, heads, o.head_dim, generator=gen, device=self.device, dtype=dtype)

        self.buffers = {"q": randn(max_q, o.n_q_heads), "dout": randn(max_q, o.n_q_heads),
                        "k": randn(max_k, o.n_kv_heads), "v": randn(max_k, o.n_kv_heads)}

    def __call__(self, q: int, k: int, n: int, phase: str) -> float:
        import torch

        b = self.buffers
        qq, dout = b["q"][: n * q], b["dout"][: n * q]
        kk, vv = b["k"][: n * k], b["v"][: n * k]
        cu_q = torch.arange(n + 1, device=self.device, dtype=torch.int32) * q
        cu_k = torch.arange(n + 1, device=self.device, dtype=torch.int32) * k
        be = self.backend

        def fwd():
            return be.forward(qq, kk, vv, cu_q, cu_k, q, k)

        def fwd_bwd():
            out, lse = be.forward(qq, kk, vv, cu_q, cu_k, q, k)
            return be.backward(dout, qq, kk, vv, out, lse, cu_q, cu_k, q, k)

        return self.timer(fwd if phase == "fwd" else fwd_bwd, self.opts)


def linear_measures(cfg, device, opts: ProfileOptions, timer: Callable = cuda_median, dtype=None):
    """(layer measure(T, phase), head measure(phase)) for one model, bf16 by default."""
    import torch
    import torch.nn.functional as F

    from attnpool.model.llama import TransformerBlock, rope_cos_sin

    dtype = dtype or torch.bfloat16
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(device=device, dtype=dtype)
    identity = lambda q, k, v, layer=None: q  # noqa: E731 - core attention is not part of the linear time

    def layer(T: int, phase: str) -> float:
        x = torch.randn(T, cfg.dim, device=device, dtype=dtype, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(T, device=device), cfg)
        grad = torch.randn(T, cfg.dim, device=device, dtype=dtype)

        def fwd():
            return block(x, cos, sin, identity)

        def fwd_bwd():
            block(x, cos, sin, identity).backward(grad)

        t = timer(fwd if phase == "fwd" else fwd_bwd, opts)
        block.zero_grad(set_to_none=True)
        return t

    def head(phase: str) -> float:
        T = opts.head_tokens
        proj = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False).to(device=device, dtype=dtype)
        x = torch.randn(T, cfg.dim, device=device, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, cfg.vocab_size, (T,), device=device)

        def fwd_bwd():
            F.cross_entropy(proj(x).float(), labels).backward()

        return timer(fwd_bwd, opts)

    return layer, head


def comm_measure(device, opts: ProfileOptions, timer: Callable = cuda_median, group=None):
    """measure(kind, bytes_per_rank) over ``group`` (default: all ranks): max over its ranks of the median."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)

    def measure(kind: str, nbytes: int) -> float:
        n = max(world, (nbytes // 2) // world * world)
        inp = torch.randn(n, device=device, dtype=torch.bfloat16)
        if kind == "all_to_all":
            out = torch.empty_like(inp)
            fn = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
        else:
            out = torch.empty(n * world, device=device, dtype=torch.bfloat16)
            fn = lambda: dist.all_gather_into_tensor(out, inp, group=group)  # noqa: E731
        dist.barrier(group=group)
        t = torch.tensor([timer(fn, opts, warmup=2)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    return measure


def measure_collectives(device, opts: ProfileOptions, timer: Callable = cuda_median, backend: str = "nccl") -> dict:
    """Collectives on groups of the first 2, 4, 8, ... ranks and on all of them (every rank calls this).

    Returns the comm section on rank 0: the largest group's rows and fit at the top
    level (what the simulator reads), every group size under ``by_world_size``.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = sorted({*(2**i for i in range(1, world.bit_length()) if 2**i <= world), world})
    by_world = {}
    for w in sizes:
        group = dist.new_group(list(range(w))) if w < world else None  # every rank takes part in new_group
        if rank < w:
            by_world[str(w)] = comm_entry(comm_measure(device, opts, timer, group), w, opts.comm_bytes, backend)
        dist.barrier()
    if rank != 0:
        return {}
    top = dict(by_world[str(world)])
    top["by_world_size"] = {k: {kk: vv for kk, vv in v.items() if kk not in ("backend",)} for k, v in by_world.items()}
    return top


def device_info() -> dict:
    import platform

    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def run_profile(opts: ProfileOptions, parts: tuple = ("attention", "linear", "comm"), *, base: dict | None = None,
                command: str = "", log: Callable[[str], None] = print,
                attention_backends: tuple = ("auto",)) -> dict | None:
    """Measure on this GPU (and, under torchrun, the collectives). Returns the profile on rank 0, None elsewhere.

    ``attention_backends``: the kernel backends whose tables to measure ("auto": the one attnpool train
    would pick here)."""
    import torch

    from attnpool.kernels import resolve_backend_name
    from attnpool.model.config import model_config

    opts.check()
    if not torch.cuda.is_available():
        raise ConfigError("device", "cpu", "attnpool profile measures a CUDA GPU; none is visible")
    started = time.time()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    # Refused before any collective: a backend that cannot run here (fa4 without flash_attn.cute, ...).
    backends = dict.fromkeys(resolve_backend_name(name, device, torch.bfloat16, field="--attention-backend")
                             for name in attention_backends) if "attention" in parts else {}
    comm = None
    if world > 1:
        from attnpool.comm import process_group

        with process_group("nccl", device_id=device):
            if "comm" in parts:
                if rank == 0:
                    log(f"collectives on {world} GPUs ...")
                comm = measure_collectives(device, opts)
        if rank != 0:
            return None
    elif "comm" in parts:
        log("one GPU: collectives skipped (run under torchrun with several GPUs to measure them)")
    attention = {}
    for backend in backends:
        bench = AttentionBench(opts, device, backend_name=backend)
        log(f"core attention, {backend} backend: {len(attention_points(opts))} (q, k) points, fwd and fwd+bwd ...")

        def progress(i, n, row):
            if i % 10 == 0 or i == n:
                log(f"  [{i}/{n}] q={row['q']} k={row['k']} x{row['tasks']}: fwd {row['fwd_tflops']:.0f}, "
                    f"fwd+bwd {row['fwd+bwd_tflops']:.0f} TFLOP/s")

        attention[backend] = attention_table(bench, opts, progress)
        del bench
        torch.cuda.empty_cache()
    linear = {}
    if "linear" in parts:
        for name in opts.models:
            cfg = model_config(name)
            log(f"linear layers of {name} at {list(opts.linear_tokens)} tokens ...")
            layer, head = linear_measures(cfg, device, opts)
            linear[name] = linear_entry(layer, cfg, opts.linear_tokens, head, opts.head_tokens)
            log(f"  {linear[name]['tflops_fwd_bwd']:.0f} TFLOP/s fwd+bwd, {linear[name]['fwd_bwd_s_per_token'] * 1e9:.1f} ns/token/layer")
            torch.cuda.empty_cache()
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "command": command,
            "seconds": round(time.time() - started, 1)}
    return assemble(attention, opts, linear=linear, comm=comm, device=device_info(), meta=meta, base=base)

