"""The sparse kernels' cost coefficients: seconds per (tile, head) and per task, and the packaged H200 fit.

Apart from attnpool.sparse.cost (which needs torch) so that the sparse configuration, which names a
coefficients file, reads and checks it without importing the kernels' side.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from attnpool.errors import ConfigError

PHASES = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True)
class SparseCoefficients:
    """Seconds per (tile, head) and per task, forward and backward."""

    fwd_slash: float = 10.1e-9
    fwd_bar: float = 11.1e-9
    fwd_task: float = 0.0
    bwd_slash: float = 55.8e-9
    bwd_bar: float = 79.5e-9
    bwd_task: float = 0.0
    source: str = "our fit of MTraining's (arXiv 2510.18830) kernels on H200 (forward 10.1/11.1 ns, backward 55.8/79.5 ns)"

    def __post_init__(self):
        for name in ("fwd_slash", "fwd_bar", "fwd_task", "bwd_slash", "bwd_bar", "bwd_task"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"sparse_cost.{name}", value, "must be a finite number >= 0")

    def tiles_times(self, factor: float, why: str) -> "SparseCoefficients":
        """The per-tile prices times ``factor`` (the per-task ones as they are), ``why`` noted in the source."""
        return SparseCoefficients(self.fwd_slash * factor, self.fwd_bar * factor, self.fwd_task,
                                  self.bwd_slash * factor, self.bwd_bar * factor, self.bwd_task,
                                  source=f"{self.source}, x {factor:.3g} {why}")

    def phase(self, phase: str) -> tuple[float, float, float]:
        """(a, b, c) of one phase; fwd+bwd adds them."""
        if phase == "fwd":
            return self.fwd_slash, self.fwd_bar, self.fwd_task
        if phase == "bwd":
            return self.bwd_slash, self.bwd_bar, self.bwd_task
        if phase == "fwd+bwd":
            return (self.fwd_slash + self.bwd_slash, self.fwd_bar + self.bwd_bar, self.fwd_task + self.bwd_task)
        raise ConfigError("phase", phase, f"must be one of {PHASES}")

    def to_json(self) -> dict:
        return {"format": "attnpool-sparse-cost/1", **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict) -> "SparseCoefficients":
        coefficients = ("fwd_slash", "fwd_bar", "fwd_task", "bwd_slash", "bwd_bar", "bwd_task")
        missing = [k for k in coefficients if k not in obj] if isinstance(obj, dict) else list(coefficients)
        if missing:  # another JSON file (a dense cost table, say) would otherwise give the defaults
            raise ConfigError("sparse_cost", str(obj)[:60], f"not a sparse cost file: no {', '.join(missing)}")
        return cls(**{k: obj[k] for k in coefficients + ("source",) if k in obj})

    @classmethod
    def load(cls, path: str | Path) -> "SparseCoefficients":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ConfigError("sparse_cost", str(path), f"cannot read coefficients ({exc})") from None
        except ConfigError as exc:
            raise ConfigError("sparse_cost", str(path), f"{exc.field}={exc.value!r}: {exc.problem}") from None


# Our kernels on one H200 (bench/gpu_sparse.py, torch 2.11, triton 3.6, bf16, head_dim 128), with the
# backward's slash tiles in the Gluon pass: per (tile, head). The fitted per-call constant (1.5 ms
# forward, 3.0 ms backward: index building, fp32 dQ/dK/dV buffers and their casts) is the same for every
# server, so it is left out of task costs (bench/results/2026-11-22-h100-sparse-gluon-nospill.md).
H200_MEASURED = SparseCoefficients(17.9e-9, 18.0e-9, 0.0, 40.5e-9, 51.2e-9, 0.0,
                                   source="bench/gpu_sparse.py, NVIDIA H200, 2026-11-22, TMA kernels, the "
                                          "backward's slash tiles in the Gluon pass without spills (mean fit "
                                          "error 2.8% / 3.8%)")
