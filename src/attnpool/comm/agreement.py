"""Make every rank agree before the first collective that depends on what it checked.

:func:`agree_on_plan`: each rank contributes its plan fingerprint and the result of its own local checks
(tensor shapes against the plan, world size). One all-gather of a fixed-size record, then every rank raises
the same error if any rank failed or the plans differ: no rank is left waiting in a collective for another
that errored. :func:`agree` does the same for any check a rank runs on its own (a run's setup).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from attnpool.comm.all_to_all import all_gather_flat
from attnpool.errors import ConfigError, TrainingError

_RECORD = 32 + 1 + 255  # fingerprint digest, status, message


def _encode(fingerprint_hex: str, problem: str | None) -> torch.Tensor:
    rec = bytearray(_RECORD)
    rec[:32] = bytes.fromhex(fingerprint_hex)
    if problem:
        msg = problem.encode()[:254]
        rec[32] = 1
        rec[33:33 + len(msg)] = msg
    return torch.frombuffer(rec, dtype=torch.uint8).clone()


def agree_on_plan(fingerprint_hex: str, problem: str | None, group=None, device=None, *,
                  subject: str = "plans") -> None:
    """All-gather (fingerprint, local problem) and raise ConfigError on every rank if anything is off.

    ``subject`` names what the fingerprint covers, for the error message."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem:
            raise ConfigError("core_attention", "rank 0", problem)
        return
    world = dist.get_world_size(group)
    gathered = all_gather_flat(_encode(fingerprint_hex, problem).to(device or "cpu"), group)
    records = gathered.cpu().view(world, _RECORD).numpy().tobytes()
    errors = []
    prints = set()
    for r in range(world):
        rec = records[r * _RECORD:(r + 1) * _RECORD]
        prints.add(rec[:32])
        if rec[32]:
            errors.append(f"rank {r}: {rec[33:].rstrip(bytes(1)).decode(errors='replace')}")
    if errors:
        raise ConfigError("core_attention", f"{len(errors)} rank(s)", "; ".join(errors))
    if len(prints) > 1:
        raise ConfigError("plan", "fingerprints differ",
                          f"ranks hold {len(prints)} different {subject}; every rank must plan the same batch with the same options")


def agree(build):
    """``build()`` on every rank; if it raises ConfigError (bad input) or TrainingError (a run that cannot go on: a
    checkpoint's storage that does not read) on any rank, the same error is raised on every rank."""
    try:
        result, problem = build(), None
    except ConfigError as exc:
        result, problem = None, ("config", *portable(exc))
    except TrainingError as exc:
        result, problem = None, ("training", str(exc), exc.restartable)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        r, (kind, *said) = failed[0]
        where = f" (on rank {r}; {len(failed)} of {len(problems)} ranks failed)" if len(failed) < len(problems) else ""
        if kind == "training":
            raise TrainingError(said[0] + where, restartable=said[1])
        field, value, text = said
        raise ConfigError(field, value, text + where)
    return result


def portable(exc: ConfigError) -> tuple:
    """(field, value, problem) of ``exc``, the value replaced by its repr if it does not pickle: what another
    process can raise again."""
    value = exc.value
    try:
        pickle.dumps(value)
    except Exception:
        value = repr(value)
    return exc.field, value, exc.problem
