"""What the simulator charges for: core attention, linear layers and the network.

Every number comes from a profile (``attnpool profile`` writes one JSON file per
GPU type) or, where the profile has no such section, from a built-in assumption
written down here. :attr:`SimCosts.sources` records which, and every report
prints it.

- Core attention: the profile's kernel tables of the attention backend simulated
  (``tables.fwd`` and ``tables["fwd+bwd"]``, TFLOP/s by query-shard length and
  KV-prefix length; one table per backend, see :func:`attnpool.plan.cost.backend_table`),
  read by :class:`attnpool.plan.cost.TableCost`. The packaged default is
  ``resources/cost_h200.json`` (H200, FlashAttention-2 varlen: the flash backend's).
  A table keeps its rate for another head count (FLOPs scale with the heads);
  a table measured for another head_dim is refused.
- Linear layers (QKV/O projections, MLP, norms, RoPE: everything of a layer
  but core attention), per token and layer on one GPU at TP=1: the profile's
  ``linear`` section for this model; for another model, the effective TFLOP/s
  measured on a profiled one applied to this model's FLOPs; without a profile
  section, :data:`DEFAULT_LINEAR_TFLOPS` (an assumption: about 60% of the
  H200's 989 TFLOP/s dense bf16 peak). The LM head (logits) is charged the same
  way, once per token.
- Network, per GPU: inside a node, the profile's all-to-all fit, else
  :data:`DEFAULT_INTRA` (260 GiB/s per rank, the NCCL all-to-all we
  measured between two H200s); between nodes :data:`DEFAULT_INTER` (50 GB/s per
  GPU, the DistCA paper appendix's assumption). Latencies are assumptions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from attnpool.errors import ConfigError, read_json_file
from attnpool.plan.cost import TOP_LEVEL_BACKEND, TableCost, backend_table, default_min_shard_tokens, for_window
from attnpool.plan.stages import layer_weights

# Assumed effective throughput of a layer's linear part (GEMMs plus norms, RoPE,
# SwiGLU) on one H200 in bf16, forward and backward. About 60% of 989 TFLOP/s.
DEFAULT_LINEAR_TFLOPS = 600.0


@dataclass(frozen=True)
class Link:
    """One GPU's share of a network: bytes per second and a fixed cost per collective."""

    bandwidth: float  # bytes/s per GPU, each direction
    latency: float  # seconds per collective
    source: str = ""
    # The GPUs share one fabric of ranks x bandwidth, so a collective takes its mean GPU's bytes, not its busiest's
    # (NCCL's socket transport over one host's loopback, the emulated inter-node network: a skewed all-to-all
    # there runs at its total bytes; a real network's links are each the GPU's own). Per collective group: groups
    # smaller than all the GPUs (percp's, Ulysses') are counted as if each had its share of the fabric to itself.
    shared: bool = False

    def check(self, name: str) -> "Link":
        if not (np.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ConfigError(f"{name}.bandwidth", self.bandwidth, "must be a positive number of bytes/s")
        if not (np.isfinite(self.latency) and self.latency >= 0):
            raise ConfigError(f"{name}.latency", self.latency, "must be >= 0 seconds")
        return self


DEFAULT_INTRA = Link(260 * 2**30, 10e-6, "assumed: NCCL all-to-all 260 GiB/s per rank (measured, 2x H200); latency 10 us assumed")
DEFAULT_INTER = Link(50e9, 20e-6, "assumed: 50 GB/s per GPU (DistCA paper appendix); latency 20 us assumed")


def layer_flops_per_token(cfg) -> tuple[float, float]:
    """Forward FLOPs per token of one layer's linear part: (before core attention, after it).

    Before: Q, K, V projections. After: output projection and SwiGLU MLP. Norms,
    RoPE and the residual adds are elementwise and not counted (a measured
    profile includes their time).
    """
    before, after = layer_weights(cfg)
    return 2.0 * before, 2.0 * after


def head_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of the output projection (logits)."""
    return 2.0 * cfg.dim * cfg.vocab_size


@dataclass(frozen=True)
class LinearCost:
    """Seconds per token on one GPU with the whole layer (TP=1)."""

    fwd: float  # one layer's linear part, forward
    bwd: float  # its backward (about 2x forward)
    head_fwd: float  # output projection + loss, forward, once per token
    head_bwd: float
    pre_fraction: float  # share of the layer's linear work before core attention
    source: str = ""

    @classmethod
    def from_flops(cls, cfg, tflops: float, source: str) -> "LinearCost":
        pre, post = layer_flops_per_token(cfg)
        rate = tflops * 1e12
        head = head_flops_per_token(cfg) / rate
        return cls((pre + post) / rate, 2 * (pre + post) / rate, head, 2 * head, pre / (pre + post), source)


@dataclass(frozen=True)
class SimCosts:
    """Everything the step-time model charges, for one model on one GPU type."""

    attn_fwd: TableCost
    attn_fwd_bwd: TableCost
    linear: LinearCost
    intra: Link
    inter: Link
    min_shard_tokens: int
    sources: dict = field(default_factory=dict)

    def attention(self, a, b, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of CA-tasks [a, b) with prefix [0, b) (under a sliding window, the window's
        keys), all heads, one GPU."""
        f = for_window(self.attn_fwd, window).cost(a, b)
        fb = for_window(self.attn_fwd_bwd, window).cost(a, b)
        return f, np.maximum(fb - f, 0.0)


def _load_profile(spec) -> tuple[dict, str]:
    if spec is None:
        text = resources.files("attnpool.resources").joinpath("cost_h200.json").read_text()
        return json.loads(text), "packaged resources/cost_h200.json"
    return read_json_file("profile", spec), str(spec)


def _tables(profile: dict, where: str, backend: str) -> tuple[TableCost, TableCost]:
    if not isinstance(profile, dict):
        raise ConfigError("profile", where, "must hold a JSON object (a cost table)")
    obj, measured_with = backend_table(profile, backend)
    if measured_with != TOP_LEVEL_BACKEND or "backends" in profile:
        where = f"{where} backends.{measured_with}"
    if "tables" not in obj or not all(p in obj.get("tables", {}) for p in ("fwd", "fwd+bwd")):
        raise ConfigError("profile", where, "cost table needs tables.fwd and tables[\"fwd+bwd\"] (attnpool profile writes both)")
    for key in ("q_grid", "k_grid", "n_q_heads", "head_dim"):
        if not isinstance(obj.get(key), (list, int, float)):
            raise ConfigError("profile", where, f"malformed cost table: {key} is missing or not a list/number")
    for p in ("fwd", "fwd+bwd"):
        if not isinstance(obj["tables"][p], dict) or not isinstance(obj["tables"][p].get("tflops"), list):
            raise ConfigError("profile", where, f"malformed cost table: tables[{p!r}].tflops is missing or not a list")
    return TableCost.from_json(profile, "fwd", backend), TableCost.from_json(profile, "fwd+bwd", backend)


def _positive(section: dict, key: str, where: str) -> float:
    try:
        value = float(section[key])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(where, key, "missing or not a number") from None
    if not (np.isfinite(value) and value > 0):
        raise ConfigError(f"{where}.{key}", value, "must be positive")
    return value


def linear_from_profile(obj: dict, cfg, model_name: str) -> LinearCost | None:
    """The profile's linear section for this model, or scaled from another profiled model; None without one."""
    section = obj.get("linear")
    if section is None:
        return None
    models = section.get("models") if isinstance(section, dict) else None
    if not isinstance(models, dict) or not models:
        raise ConfigError("profile.linear", type(section).__name__, "needs a 'models' object: {preset: {fwd_s_per_token, ...}}")
    pre, post = layer_flops_per_token(cfg)
    if model_name in models:
        m = models[model_name]
        where = f"profile.linear.models.{model_name}"
        fwd = _positive(m, "fwd_s_per_token", where)
        fwd_bwd = _positive(m, "fwd_bwd_s_per_token", where)
        if fwd_bwd <= fwd:
            raise ConfigError(f"{where}.fwd_bwd_s_per_token", fwd_bwd, f"must exceed fwd_s_per_token={fwd}")
        if "head_fwd_bwd_s_per_token" in m:
            head_fb = _positive(m, "head_fwd_bwd_s_per_token", where)
        else:
            head_fb = 3 * head_flops_per_token(cfg) * fwd_bwd / (3 * (pre + post))
        return LinearCost(fwd, fwd_bwd - fwd, head_fb / 3, 2 * head_fb / 3, pre / (pre + post),
                          f"measured ({model_name})")
    rates = []
    for name, m in sorted(models.items()):
        rates.append(_positive(m, "tflops_fwd_bwd", f"profile.linear.models.{name}"))
    tflops = float(np.mean(rates))
    return LinearCost.from_flops(cfg, tflops, f"{tflops:.0f} TFLOP/s measured on {', '.join(sorted(models))}, scaled by FLOPs")


def intra_from_profile(obj: dict) -> Link | None:
    comm = obj.get("comm")
    if not comm:
        return None
    fit = comm.get("fit", {}).get("all_to_all") if isinstance(comm, dict) else None
    if fit is None:
        return None
    bw = _positive(fit, "bandwidth_Bps", "profile.comm.fit.all_to_all")
    lat = float(fit.get("latency_s", 0.0))
    return Link(bw, max(0.0, lat), f"measured: all-to-all, {comm.get('world_size', '?')} GPUs of one node").check("intra")


def with_given(link: Link, bandwidth: float | None, latency: float | None, name: str) -> Link:
    """``link`` with the bandwidth (bytes/s) and latency (s) a user gave, either or both (None: ``link``'s own, so
    that giving one keeps a profile's measured other)."""
    if bandwidth is None and latency is None:
        return link.check(name)
    given = ([f"{bandwidth / 1e9:g} GB/s"] if bandwidth is not None else []) + \
        ([f"{latency * 1e6:g} us"] if latency is not None else [])
    rest = "" if bandwidth is not None and latency is not None else f"; otherwise {link.source}"
    return Link(link.bandwidth if bandwidth is None else bandwidth, link.latency if latency is None else latency,
                f"given: {', '.join(given)}{rest}", link.shared).check(name)


def load_sim_costs(cfg, model_name: str, profile=None, *, intra: Link | None = None, inter: Link | None = None,
                   linear_tflops: float | None = None, min_shard_tokens: int | None = None,
                   attention_backend: str = TOP_LEVEL_BACKEND, any_head_dim: bool = False,
                   intra_bandwidth: float | None = None, intra_latency: float | None = None,
                   inter_bandwidth: float | None = None, inter_latency: float | None = None) -> SimCosts:
    """Costs for ``cfg`` from ``profile`` (a path, a dict, or None for the packaged H200 table), core attention
    from the table of ``attention_backend``'s kernel (flash's where the profile has none for it). ``any_head_dim``:
    a table measured for another head_dim prices this model's FLOPs at its rates (an approximation, for comparing
    two schedules of one run) instead of being refused. ``intra``/``inter``: the links whole; ``*_bandwidth`` and
    ``*_latency`` (bytes/s, s): a part of one given, the rest the profile's or the default's (:func:`with_given`)."""
    if isinstance(profile, dict):
        obj, where = profile, "profile"
    else:
        obj, where = _load_profile(profile)
    fwd, fwd_bwd = _tables(obj, where, attention_backend)
    if int(fwd.head_dim) != int(cfg.head_dim) and not any_head_dim:
        raise ConfigError("profile", where, (f"was measured for head_dim={fwd.head_dim}; model {model_name} has head_dim={cfg.head_dim}: "
                                           f"measure one on its GPU with `attnpool profile --model {model_name} --out FILE` and "
                                           "pass --profile FILE"))
    fwd, fwd_bwd = fwd.scaled_to(cfg.n_heads, cfg.head_dim), fwd_bwd.scaled_to(cfg.n_heads, cfg.head_dim)
    if linear_tflops is not None:
        if not linear_tflops > 0:
            raise ConfigError("linear_tflops", linear_tflops, "must be positive")
        linear = LinearCost.from_flops(cfg, linear_tflops, f"given: {linear_tflops:g} TFLOP/s")
    else:
        linear = linear_from_profile(obj, cfg, model_name) or LinearCost.from_flops(
            cfg, DEFAULT_LINEAR_TFLOPS, f"assumed: {DEFAULT_LINEAR_TFLOPS:g} TFLOP/s (about 60% of H200 bf16 peak)")
    intra = with_given(intra or intra_from_profile(obj) or DEFAULT_INTRA, intra_bandwidth, intra_latency, "intra")
    inter = with_given(inter or DEFAULT_INTER, inter_bandwidth, inter_latency, "inter")
    if min_shard_tokens is None:
        min_shard_tokens = default_min_shard_tokens(fwd_bwd)
    if min_shard_tokens < 1:
        raise ConfigError("min_shard_tokens", min_shard_tokens, "must be >= 1")
    device = obj.get("device", {})
    sources = {
        "attention": f"{where}: {fwd_bwd.source}".strip(),
        "device": device.get("name", "") if isinstance(device, dict) else str(device),
        "linear": linear.source,
        "intra_node": intra.source,
        "inter_node": inter.source,
    }
    return SimCosts(fwd, fwd_bwd, linear, intra, inter, int(min_shard_tokens), sources)
