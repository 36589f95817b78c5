"""Where a CUDA memory peak comes from: what was live at the moment of highest allocated memory.

The caching allocator records every allocation and free with the Python stack that made it
(``torch.cuda.memory._record_memory_history``). Replaying that trace finds the moment the
allocated bytes peaked and groups the allocations live then by the code that made them: the
innermost frame in attnpool, else the innermost Python frame, else none (an allocation made by
autograd's engine for a built-in operation's backward has no Python frame). The replay itself
is plain Python over the trace entries, so it is tested on CPU with synthetic traces.

    with MemoryRecorder(enabled=True) as recorder:
        train(config)
    report = recorder.breakdown()   # None where recording is off or the device is not CUDA
"""

from __future__ import annotations

import os

import torch

TRACE_ENTRIES = 1_000_000  # allocator events kept (PyTorch: several KB each); a training step makes thousands
NO_FRAME = "(no Python frame: autograd engine or C++)"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../attnpool


def allocation_site(frames: list[dict], package_dir: str = PACKAGE_DIR) -> str:
    """Where an allocation was made: the innermost frame in the attnpool package (shown relative to
    it), else the innermost Python frame."""
    for frame in frames:
        path = frame.get("filename", "")
        if path.startswith(package_dir + os.sep):
            return f"attnpool/{os.path.relpath(path, package_dir)}:{frame.get('line')} {frame.get('name')}"
    if frames:
        frame = frames[0]
        return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"
    return NO_FRAME


def peak_breakdown(trace: list[dict], top: int = 20) -> dict:
    """The peak of allocated bytes over ``trace`` (one device's entries, oldest first) and what was live then.

    Counts ``alloc`` up and ``free_requested`` down, as the allocator's allocated-bytes statistic
    (``max_memory_allocated``) moves; a block with pending stream uses completes its free later, but
    no longer counts as allocated. Sizes are as the trace records them (requested, not rounded to
    the allocator's blocks). Frees of blocks allocated before the trace began are ignored: the peak
    is above what was live when recording started. Returns peak_bytes, peak_index (the entry that
    reached it), live_blocks, and groups: [{site, bytes, blocks}] by bytes, the ``top`` largest, then
    one "(other sites)" entry for the rest.
    """
    sizes: dict[int, int] = {}
    total = peak = 0
    peak_index = -1
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "alloc":
            sizes[entry["addr"]] = entry["size"]
            total += entry["size"]
            if total > peak:
                peak, peak_index = total, i
        elif action == "free_requested":
            total -= sizes.pop(entry["addr"], 0)
    live: dict[int, dict] = {}
    for entry in trace[:peak_index + 1]:  # second pass: the live set at the peak
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
        elif entry["action"] == "free_requested":
            live.pop(entry["addr"], None)
    groups: dict[str, list[int]] = {}
    for entry in live.values():
        group = groups.setdefault(allocation_site(entry.get("frames", [])), [0, 0])
        group[0] += entry["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    rows = [dict(site=site, bytes=b, blocks=n) for site, (b, n) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append(dict(site="(other sites)", bytes=sum(b for _, (b, _) in rest), blocks=sum(n for _, (_, n) in rest)))
    return dict(peak_bytes=peak, peak_index=peak_index, entries=len(trace), live_blocks=len(live), groups=rows)


class MemoryRecorder:
    """Records the allocator's history on the current CUDA device while the block runs."""

    def __init__(self, enabled: bool, max_entries: int = TRACE_ENTRIES):
        self.enabled = enabled and torch.cuda.is_available()
        self.max_entries = max_entries
        self.start_bytes = 0
        self._trace = None

    def __enter__(self):
        if self.enabled:
            self.start_bytes = int(torch.cuda.memory_allocated())
            # Stacks of allocations only: with stacks of frees too, PyTorch 2.11 fails inside the loss's
            # recompute in backward ("cross_entropy_loss returned NULL without setting an exception").
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=self.max_entries)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self._trace = snapshot["device_traces"][torch.cuda.current_device()]
        return False

    def breakdown(self, top: int = 20) -> dict | None:
        """The peak's breakdown (``peak_breakdown``) plus what was allocated when recording began, or None."""
        if self._trace is None:
            return None
        report = peak_breakdown(self._trace, top)
        report["start_bytes"] = self.start_bytes
        report["truncated"] = len(self._trace) >= self.max_entries  # the oldest entries were dropped
        self._trace = None
        return report


def breakdown_markdown(title: str, report: dict) -> str:
    """A readable table of one breakdown."""
    gib = 2.0 ** 30
    lines = [f"# {title}", "",
             f"Peak over the whole run (model setup and warm-up steps included) "
             f"{(report['start_bytes'] + report['peak_bytes']) / gib:.2f} GiB allocated: "
             f"{report['start_bytes'] / gib:.2f} GiB live when recording began, {report['peak_bytes'] / gib:.2f} GiB "
             f"above it at trace entry {report['peak_index']} of {report['entries']}"
             + (" (the trace was truncated: its oldest entries are missing, so the peak and the live set miss "
                "what they allocated, and the first figure no longer describes the trace's start)"
                if report["truncated"] else "") + ".",
             "", "| allocated at | GiB | blocks |", "|---|---|---|"]
    lines += [f"| `{g['site']}` | {g['bytes'] / gib:.3f} | {g['blocks']} |" for g in report["groups"]]
    return "\n".join(lines) + "\n"
