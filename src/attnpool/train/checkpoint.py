"""Checkpoints with torch.distributed.checkpoint (DCP): everything a run needs to continue exactly, written
atomically and verified when read.

One checkpoint is one directory ``OUT/checkpoints/step-NNNNNN`` that DCP writes from every rank at once:
the sharded model and optimizer state (resharded on load, so the number of ranks may change), the
learning-rate schedule, the position of the document stream, the step, each rank's RNG state and the
sparse estimator's state. It is written as ``step-NNNNNN.partial`` and renamed once complete, with a
``manifest.json`` (written last) that records the step, the run's config and every file's size and
SHA-256. A directory without its manifest is an unfinished save and is not a checkpoint. Reading one
first checks every file against the manifest (the ranks share the hashing), so a truncated, corrupted
or missing shard is found before any state is loaded, and named.

Checkpoints written before manifests existed (a DCP ``.metadata`` and no manifest), and a directory that lost
its manifest, which looks the same, are checked against the sizes DCP's metadata gives their files, and load
only with ``allow_unverified``: their bytes cannot be checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from attnpool.errors import ConfigError, TrainingError, restartable, storage_error
from attnpool.model.spec import hf_model_dir
from attnpool.train.config import load_config

_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"  # DCP's index of the tensors and where each is stored
PARTIAL_SUFFIX = ".partial"
DAMAGED_SUFFIX = ".damaged"
_HASH_CHUNK = 16 << 20
READ_ATTEMPTS = 3  # a file that exists but does not read is tried this often, a second apart, before it counts


class _Failed(str):
    """What went wrong on a rank, passed through a collective in place of its result (and whether a restart may
    get past it, as ``restartable``: the str's own attribute survives the pickling as a tuple would not)."""

    def __new__(cls, text: str, restartable: bool = True):
        made = super().__new__(cls, text)
        made.restartable = restartable
        return made

    def __reduce__(self):
        return type(self), (str(self), self.restartable)


class ReadFailure(_Failed):
    """A checkpoint's problem that is the storage's, not the checkpoint's: a file that is there but did not read (an
    I/O error, a stale network mount). A resume does not pass over such a checkpoint, as it does a damaged one: the
    one before it would redo the steps since, and the next save would set this one aside as damaged. ``restartable``
    as attnpool.errors.restartable judges the error."""

    @classmethod
    def of(cls, file: str, exc: OSError) -> "ReadFailure":
        return cls(f"{file} did not read ({exc.strerror or exc}, {READ_ATTEMPTS} attempts)", restartable(exc))

    def error(self, path: str, consequence: str = "") -> TrainingError:
        """The TrainingError that stops what read checkpoint ``path`` (``consequence``: what it means there)."""
        return TrainingError(f"{path}: {self}: a storage error{consequence}", restartable=self.restartable)


_ABSENT = (FileNotFoundError, NotADirectoryError)


def _is_file(path: str) -> bool:
    """Whether ``path`` is a file. Unlike os.path.isfile, an error other than its absence (the storage's) is raised:
    a checkpoint whose files cannot be looked at is not one that lacks them."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except _ABSENT:
        return False


def _retrying(read):
    """``read()``, tried up to READ_ATTEMPTS times, a second apart, while it raises an OSError other than a file's
    absence."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return read()
        except _ABSENT:
            raise
        except OSError:
            if attempt + 1 == READ_ATTEMPTS:
                raise
            time.sleep(1.0)


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


def checkpoint_path(out: str, step: int) -> str:
    return os.path.join(checkpoint_root(out), f"step-{step:06d}")


def finished_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in the run directory (a manifest, or a legacy DCP
    ``.metadata``), oldest first. Complete is not valid: see :func:`verify_checkpoint`."""
    root = checkpoint_root(out)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        try:
            complete = m and (_is_file(os.path.join(path, MANIFEST)) or _is_file(os.path.join(path, DCP_METADATA)))
        except OSError as exc:
            raise storage_error(exc, f"{path}: its files cannot be looked at") from None
        if complete:
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(out: str) -> str | None:
    done = finished_checkpoints(out)
    return done[-1][1] if done else None


def read_manifest(path: str) -> dict | None:
    """The checkpoint's manifest; None for a legacy checkpoint (no manifest). Refuses one that does not parse; an
    OSError (the storage's, not the checkpoint's) is raised as it is."""
    file = os.path.join(path, MANIFEST)

    def read():  # (absent: no text at all; "null" is a manifest's text, and damaged)
        if not _is_file(file):
            return None, False
        with open(file) as fh:
            return json.load(fh), True
    try:
        manifest, present = _retrying(read)
        if not present:
            return None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
        return manifest
    except ValueError as exc:  # (an OSError is the storage's: the caller's to judge)
        raise ConfigError("resume", file, f"the checkpoint's manifest is unreadable ({exc})") from None


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_config(path: str, out: str) -> dict | None:
    """The settings of the run that wrote the checkpoint: its manifest's, or (a checkpoint older than
    manifests) the run directory's config.yaml."""
    try:
        manifest = read_manifest(path)
    except OSError as exc:
        raise storage_error(exc, f"{os.path.join(path, MANIFEST)} did not read") from None
    if manifest is not None:
        settings = manifest.get("config") or None
    else:
        file = os.path.join(out, "config.yaml")
        settings = load_config(file).to_dict() if os.path.isfile(file) else None
    if settings is not None and "model_impl" not in settings:
        # Runs from before model_impl ran every hf: model through transformers' modules (their weights' names).
        settings["model_impl"] = "transformers" if hf_model_dir(settings.get("model", "")) else "auto"
    return settings


def _file_problem(path: str, name: str, expected: dict, checksum: bool) -> str | None:
    """What is wrong with one file of a checkpoint, or None. Never raises: every rank must reach the
    collective that follows, whatever its share of the files holds."""
    file = os.path.join(path, name)

    def check() -> str | None:
        if not _is_file(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{file} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
        if checksum and _sha256(file) != expected["sha256"]:
            return f"{file} does not match its SHA-256 in the manifest (corrupted)"
        return None
    try:
        return _retrying(check)
    except _ABSENT:  # (gone between the look and the read)
        return f"{file} is missing"
    except OSError as exc:
        return ReadFailure.of(file, exc)
    except (KeyError, TypeError):
        return f"the manifest's entry for {file} is malformed"


def _my_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _unverified_problem(path: str, allow_unverified: bool) -> str | None:
    """What is wrong with a checkpoint without a manifest (written before manifests, or its manifest lost): its
    files against the sizes DCP's metadata gives them; then, unless ``allow_unverified``, that its bytes cannot be
    checked."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # (unpickling a damaged file raises anything)
        return f"{os.path.join(path, DCP_METADATA)} cannot be read ({type(exc).__name__})"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) < end:
            return f"{file} has {os.path.getsize(file)} bytes, DCP's metadata needs {end} (truncated)"
    if not allow_unverified:
        return (f"{path} has no {MANIFEST} (written before manifests, or it was lost), so its bytes cannot be "
                "checked; --allow-unverified reads it anyway")
    return None


def verify_checkpoint(path: str, checksum: bool = True, distributed: bool = True,
                      allow_unverified: bool = False) -> str | None:
    """What is wrong with the checkpoint at ``path`` (naming the file), or None. Sizes always, and the hash of
    DCP's metadata (small, and read before the rest to check the model's shape); with ``checksum`` each file's
    SHA-256 too. A checkpoint without a manifest: :func:`_unverified_problem`. ``distributed`` (and a process
    group initialised): the files' hashing is shared among the ranks, and every rank gets the same answer (a
    collective: call it on every rank)."""
    distributed = distributed and dist.is_available() and dist.is_initialized()
    try:
        manifest = read_manifest(path)
    except ConfigError as exc:
        manifest, problem = None, exc.problem
    except OSError as exc:
        manifest, problem = None, ReadFailure.of(os.path.join(path, MANIFEST), exc)
    else:
        problem = None if manifest is not None else \
            _unverified_problem(path, allow_unverified) if os.path.isfile(os.path.join(path, DCP_METADATA)) else \
            f"{path} has neither a manifest nor DCP metadata"
    files = sorted(manifest["files"].items()) if manifest else []
    if problem is None:
        problem = next(filter(None, (_file_problem(path, n, e, n == DCP_METADATA) for n, e in files)), None)
    if problem is None and checksum:
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        problem = next(filter(None, (_file_problem(path, n, e, True) for n, e in _my_share(files, rank, world))), None)
    if distributed:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next(filter(None, problems), None)
    return problem


def select_checkpoint(out: str, checksum: bool = True, distributed: bool = True,
                      allow_unverified: bool = False) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest valid checkpoint of the run directory (None if there is none), and (path, problem) of
    each newer one skipped. Arguments as :func:`verify_checkpoint`'s."""
    skipped = []
    for _, path in reversed(finished_checkpoints(out)):
        problem = verify_checkpoint(path, checksum, distributed, allow_unverified)
        if problem is None:
            return path, skipped
        if isinstance(problem, ReadFailure):  # (every rank alike: verify_checkpoint's answer is agreed)
            raise problem.error(path, ", not a damaged checkpoint, so the resume stops here rather than go back to "
                                      "an older one and redo the steps since; run it again once the storage reads")
        skipped.append((path, problem))
    return None, skipped


def _rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def check_compatible(path: str, expected: dict[str, tuple]) -> None:
    """Refuse a checkpoint whose model weights do not fit this model before loading it: ``expected``, the model's
    weights' names and shapes (its spec's ``state_shapes()``)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # a corrupt or foreign directory
        raise ConfigError("resume", path, f"not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    saved = {key[len("model."):]: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(meta, "size")}
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    wrong = [k for k in expected if k in saved and saved[k] != expected[k]]
    if not (missing or extra or wrong):
        return
    if wrong:
        k = wrong[0]
        detail = f"{k} is {list(saved[k])} in the checkpoint but {list(expected[k])} in this model"
    elif missing:
        detail = f"{len(missing)} weights of this model are not in the checkpoint (first: {missing[0]})"
    else:
        detail = f"the checkpoint holds {len(extra)} weights this model lacks (first: {extra[0]})"
    raise ConfigError("resume", path, f"the checkpoint is of another model shape: {detail}")


def fsync_dir(path: str) -> None:
    """A directory's entries on disk (a rename or a new file in it survives a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomically(file: str, obj) -> None:
    tmp = file + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)


def save_checkpoint(path: str, model, optimizer, scheduler, stream, step: int, extra: dict | None = None,
                    device: torch.device | None = None, config: dict | None = None, keep: int = 0) -> None:
    """Write a checkpoint from every rank (a collective: call it on all ranks), atomically: DCP writes
    into ``path.partial``, the ranks hash their share of the files, rank 0 writes the manifest and
    renames the directory to ``path``; checkpoints of this step or later (skipped by the resume as damaged) are
    renamed ``step-NNNNNN.damaged``.
    ``keep`` > 0: then delete all but the newest ``keep`` checkpoints, this one always among them.

    ``extra``: more state by name, each an object with ``state_dict()`` (e.g. the sparse planning prior).
    ``device``: the rank's compute device, whose RNG is saved (default: the parameters', which
    optimizer offload keeps on the CPU). ``config``: the run's settings, kept in the manifest (a resume
    compares them with its own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
    device = device or next(model.parameters()).device
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(),
             "data": stream.state_dict(), "step": step, _rng_key(rank): _rng_state(device)}
    state.update({name: obj.state_dict() for name, obj in (extra or {}).items()})
    partial = path + PARTIAL_SUFFIX
    root = os.path.dirname(path)
    if rank == 0:  # saves that did not finish (a crash during a save)
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.endswith(PARTIAL_SUFFIX):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    dist.barrier()
    try:
        dcp.save(state, checkpoint_id=partial)  # returns on every rank once DCP's metadata is written
    except (Exception, CheckpointException) as exc:  # (DCP gathers every rank's failure and raises it on each)
        raise TrainingError(f"{path}: the checkpoint was not written{_dcp_failure(exc)}",
                            restartable=restartable(_dcp_rank_failure(exc)[1])) from None
    # Each step below that touches files on one rank passes what went wrong through the collective after it, so
    # that every rank raises it rather than wait for the one that did.
    box = [None]
    if rank == 0:
        box = [_attempt(lambda: sorted(os.listdir(partial)))]
    dist.broadcast_object_list(box, src=0)
    names = _raise_any([box[0]], path)
    mine = _attempt(lambda: {name: {"bytes": os.path.getsize(os.path.join(partial, name)),
                                    "sha256": _sha256(os.path.join(partial, name))}
                             for name in _my_share(names, rank, world)})  # (DCP's writer has synced them to disk)
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    files = {name: entry for share in _raise_any(shares, path, each=True) for name, entry in share.items()}
    box = [None]
    if rank == 0:
        box = [_attempt(lambda: _put_in_place(partial, path, step, config, files, keep))]
    dist.broadcast_object_list(box, src=0)  # no rank goes on (or ends the run) before the checkpoint is in place
    _raise_any([box[0]], path)


def _put_in_place(partial: str, path: str, step: int, config: dict | None, files: dict, keep: int) -> None:
    """Rank 0's part of a save once every file is written: the manifest, the checkpoint renamed into place, older
    ones beyond ``keep`` deleted."""
    root = os.path.dirname(path)
    _write_json_atomically(os.path.join(partial, MANIFEST),
                           {"format": 1, "step": step, "config": config or {}, "files": files})
    fsync_dir(partial)  # (the manifest's entry on disk before the rename makes the checkpoint count)
    # Checkpoints of this step or later are ones a resume skipped as damaged (it takes the newest valid
    # one, and a run saves each step once): left as they are, later ones would stay the "newest" and outlive
    # `keep`, and this step's would be lost under the new one. Kept aside, for a look.
    out = os.path.dirname(root)
    damaged = [later for later_step, later in finished_checkpoints(out) if later_step > step]
    for old in damaged + ([path] if os.path.isdir(path) else []):
        shutil.rmtree(old + DAMAGED_SUFFIX, ignore_errors=True)
        os.replace(old, old + DAMAGED_SUFFIX)
    os.replace(partial, path)
    fsync_dir(root)
    if keep > 0:
        finished = finished_checkpoints(out)
        for _, old in finished[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        prune_damaged(out, finished[-keep:][0][0])


def prune_damaged(out: str, below_step: int) -> None:
    """Delete the checkpoints set aside as damaged (``step-NNNNNN.damaged``) of steps before ``below_step``, the
    oldest one kept: kept for a look while the run still holds checkpoints around them, not for ever."""
    root = checkpoint_root(out)
    for name in os.listdir(root):
        m = _STEP_DIR.match(name.removesuffix(DAMAGED_SUFFIX))
        if name.endswith(DAMAGED_SUFFIX) and m and int(m.group(1)) < below_step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _attempt(fn):
    """``fn()``, or a _Failed naming what it raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (every rank raises it after the collective)
        return _Failed(f"{type(exc).__name__}: {exc}", restartable(exc))


def _raise_any(results: list, path: str, each: bool = False):
    """The first of ``results`` (every one with ``each``), or, where a rank's is a _Failed, a TrainingError on this
    rank naming it (restartable unless attnpool.errors.PERMANENT_ERRNOS says otherwise)."""
    for rank, result in enumerate(results):
        if isinstance(result, _Failed):
            where = f" on rank {rank}" if each else ""
            raise TrainingError(f"{path}: the checkpoint was not written{where} ({result})",
                                restartable=result.restartable)
    return results if each else results[0]


# The optimizer's state and its param groups' settings keyed by each parameter's name ("param_groups.<name>.lr"):
# pipeline ranks hold different parameters, and param groups saved as lists (one per rank, under the same keys)
# came back on another rank's parameters (a resume at the same pp failed in AdamW's step).
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def read_dcp(state: dict, path: str) -> None:
    """dcp.load of ``state`` from the checkpoint at ``path``; a file that does not read (a checkpoint without a
    manifest, damaged: nothing checked its bytes) refused in one line, not DCP's traceback of every read."""
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # (DCP's gathers every rank's failure; a BaseException)
        raise TrainingError(f"{path}: the checkpoint's files do not read{_dcp_failure(exc)}: damaged?") from None


def _dcp_rank_failure(exc: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the first failure a DCP exception holds (itself where it holds none)."""
    failures = getattr(exc, "failures", None) or {}
    rank, inner = next(iter(failures.items()), (None, exc))
    return rank, inner[0] if isinstance(inner, tuple) else inner  # (DCP keeps each rank's with its traceback)


def _dcp_failure(exc: BaseException) -> str:
    """The first failure a DCP exception holds, in a few words: " on rank R (Type: first line)"."""
    rank, inner = _dcp_rank_failure(exc)
    said = next((line for line in str(inner).splitlines() if line.strip()), "")
    where = f" on rank {rank}" if rank is not None else ""
    return f"{where} ({type(inner).__name__}: {said[:160]})"


def _optimizer_options(keys) -> StateDictOptions | None:
    """How the checkpoint with these keys holds its optimizer: by parameter name, or (checkpoints written before)
    its param groups as lists."""
    listed = any(k.startswith("optim.param_groups.") and k.split(".")[2].isdigit() for k in keys)
    return None if listed else FLAT_OPTIMIZER


def load_checkpoint(path: str, model, optimizer, scheduler, stream, extra: dict | None = None,
                    device: torch.device | None = None, same_data: bool = True) -> int:
    """Restore everything :func:`save_checkpoint` wrote; returns the step it was taken after. ``same_data``: the
    stream's documents are the checkpoint's (False where the run changed its data on purpose: not compared).

    Each ``extra`` object the checkpoint holds state for gets ``load_state_dict``; one it
    holds none for (a checkpoint of a run without it) keeps its fresh state."""
    rank = dist.get_rank()
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    options = _optimizer_options(keys)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    device = device or next(model.parameters()).device
    # (the stream's entries the checkpoint holds: one from before its fingerprint lacks that)
    state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(),
             "data": {k: v for k, v in stream.state_dict().items() if f"data.{k}" in keys}, "step": 0}
    # The RNG state is per rank; a run resumed on more ranks than it was saved from
    # keeps its fresh seed on the new ones.
    has_rng = any(k.startswith(_rng_key(rank) + ".") for k in keys)
    if has_rng:
        state[_rng_key(rank)] = _rng_state(device)
    saved_extra = {name: obj for name, obj in (extra or {}).items() if any(k.startswith(name + ".") for k in keys)}
    # Only the entries the checkpoint holds (DCP refuses a missing one): an object that has gained state since the
    # checkpoint was written (the sparse prior's sizes by length) gets what there is, and keeps the rest fresh.
    state.update({name: {k: v for k, v in obj.state_dict().items()
                         if any(key == f"{name}.{k}" or key.startswith(f"{name}.{k}.") for key in keys)}
                  for name, obj in saved_extra.items()})
    read_dcp(state, path)
    for name, obj in saved_extra.items():
        obj.load_state_dict(state[name])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"], same_documents=same_data)
    if has_rng:
        rng = state[_rng_key(rank)]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    return int(state["step"])
