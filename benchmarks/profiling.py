"""Profile a few training steps with ``torch.profiler`` and summarise where the GPU time went.

:class:`ProfileSteps` is a Lightning callback: it starts the profiler (CPU and, on GPUs, CUDA
activities) at the start of the chosen training steps and stops it after them, writes each rank's
Chrome trace, then a short summary beside it (``rank<r>_summary.txt`` and ``.json``):

- the top kernels by self GPU time (a kernel has no children, so its time is its self time);
- the time in NCCL all-gather, reduce-scatter and all-reduce kernels, each kind's sum;
- how much of the communication ran while a compute kernel ran on another stream (the union of the
  communication kernels' intervals against the union of the compute kernels'), and the rest, the
  exposed communication that a step waits for;
- the same figures inside the update alone (the ``lit_flowgrpo.update`` range, which the benchmark's
  module marks with ``torch.profiler.record_function``), where the profiler recorded it.

An NCCL kernel's duration includes its wait for the slowest rank to arrive, so "communication time"
is time the GPU spent inside collectives, not bytes over bandwidth.

Written by hand: the profiler's own tables (``key_averages``) sum durations per name but say nothing
about concurrency across streams, which is the question for FSDP2's prefetching. The summary reads
the exported trace, whose format (``traceEvents`` with ``ph: "X"`` complete events, ``ts`` / ``dur``
in microseconds, kernels under ``cat: "kernel"`` with their stream in ``args.stream``) is stable
across PyTorch versions. On CPUs there are no kernels: the summary then reads the CPU operators
(``cat: "cpu_op"``), where gloo's collectives stand in for NCCL's, so the same code runs in tests.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UPDATE_RANGE = "lit_flowgrpo.update"

_COLLECTIVES = (
    ("all_gather", re.compile(r"all_?gather", re.I)),
    ("reduce_scatter", re.compile(r"reduce_?scatter", re.I)),
    ("all_reduce", re.compile(r"all_?reduce", re.I)),
)
_COMM = re.compile(r"nccl|gloo|c10d::", re.I)


@dataclass(frozen=True)
class Interval:
    """One timed event of the trace: a GPU kernel (``lane`` its stream) or a CPU operator (its thread)."""

    name: str
    lane: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def collective_kind(name: str) -> str | None:
    """``all_gather``, ``reduce_scatter``, ``all_reduce`` or ``other`` for a communication kernel (an
    NCCL kernel; on CPUs a c10d or gloo operator), ``None`` for compute.

    >>> collective_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    'all_gather'
    >>> collective_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(...)")
    'reduce_scatter'
    >>> collective_kind("c10d::_allgather_base_"), collective_kind("ncclDevKernel_SendRecv(...)")
    ('all_gather', 'other')
    >>> collective_kind("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>(...)") is None
    True
    """
    if not _COMM.search(name):
        return None
    for kind, pattern in _COLLECTIVES:
        if pattern.search(name):
            return kind
    return "other"


def trace_intervals(trace: dict[str, Any], category: str) -> list[Interval]:
    """The complete events of ``category`` in a Chrome trace (``"kernel"``, ``"cpu_op"``, ...)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != category or "dur" not in e:
            continue
        args = e.get("args") or {}
        lane = str(args.get("stream", e.get("tid", "")))
        out.append(Interval(str(e.get("name", "")), lane, float(e["ts"]), float(e["dur"])))
    return out


def trace_windows(trace: dict[str, Any], name: str, categories: Sequence[str]) -> list[tuple[float, float]]:
    """The (start, end) of every range called ``name``, from the first of ``categories`` that holds one
    (``gpu_user_annotation`` is the range on the GPU's timeline; ``user_annotation`` on the CPU's)."""
    for category in categories:
        found = [(i.start_us, i.end_us) for i in trace_intervals(trace, category) if i.name == name]
        if found:
            return found
    return []


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint spans covering the same time.

    >>> union([(3, 5), (0, 1), (0.5, 2), (4, 6)])
    [(0, 2), (3, 6)]
    """
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The common time of two unions (:func:`union`).

    >>> intersect([(0, 2), (3, 6)], [(1, 4), (5, 10)])
    [(1, 2), (3, 4), (5, 6)]
    """
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(spans: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def summarise(
    intervals: Sequence[Interval], windows: Sequence[tuple[float, float]] | None = None, top: int = 15
) -> dict[str, Any]:
    """Where the time of ``intervals`` went, inside ``windows`` if given (clipped to them).

    Times in milliseconds. ``comm_overlapped_fraction``: the share of the communication time during
    which some compute ran; ``None`` without communication.
    """
    if windows:
        bounds = union(windows)
        clipped = []
        for i in intervals:
            for start, end in intersect([(i.start_us, i.end_us)], bounds):
                clipped.append(Interval(i.name, i.lane, start, end - start))
        intervals = clipped
        span = length(bounds)
    else:
        span = (max(i.end_us for i in intervals) - min(i.start_us for i in intervals)) if intervals else 0.0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_kind: dict[str, float] = defaultdict(float)
    comm, compute = [], []
    for i in intervals:
        row = by_name[i.name]
        row[0] += i.dur_us
        row[1] += 1
        kind = collective_kind(i.name)
        if kind is None:
            compute.append((i.start_us, i.end_us))
        else:
            per_kind[kind] += i.dur_us
            comm.append((i.start_us, i.end_us))
    comm_u, compute_u = union(comm), union(compute)
    comm_time = length(comm_u)
    overlapped = length(intersect(comm_u, compute_u))
    busy = length(union(comm + compute))
    ms = 1e-3
    return {
        "window_ms": span * ms,
        "busy_ms": busy * ms,
        "idle_fraction": 1.0 - busy / span if span else None,
        "compute_ms": length(compute_u) * ms,
        "comm_ms": comm_time * ms,
        "comm_by_kind_ms": {k: v * ms for k, v in sorted(per_kind.items())},
        "comm_overlapped_ms": overlapped * ms,
        "comm_exposed_ms": (comm_time - overlapped) * ms,
        "comm_overlapped_fraction": overlapped / comm_time if comm_time else None,
        "top": [
            {"name": name, "total_ms": total * ms, "count": int(count)}
            for name, (total, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def summarise_trace(trace: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """:func:`summarise` of a trace's GPU kernels (its CPU operators if it has no kernel), over the
    whole trace and inside the update's ranges."""
    intervals = trace_intervals(trace, "kernel")
    source = "kernel"
    if not intervals:
        intervals, source = trace_intervals(trace, "cpu_op"), "cpu_op"
    # A kernel's update range is the one on the GPU's timeline; a CPU operator's, the CPU's.
    categories = ("gpu_user_annotation",) if source == "kernel" else ("user_annotation",)
    windows = trace_windows(trace, UPDATE_RANGE, categories)
    return {
        "source": source,
        "whole": summarise(intervals, None, top),
        "update": summarise(intervals, windows, top) if windows else None,
        "update_ranges": len(windows),
    }


def format_summary(summary: dict[str, Any], title: str) -> str:
    """The summary as a short text table."""
    unit = "GPU kernels" if summary["source"] == "kernel" else "CPU operators (no GPU kernels in the trace)"
    lines = [f"== {title}: {unit}"]
    for part in ("whole", "update"):
        s = summary.get(part)
        if not s:
            lines.append(f"-- {part}: no {UPDATE_RANGE} range in the trace")
            continue
        frac = s["comm_overlapped_fraction"]
        idle = s["idle_fraction"]
        lines.append(
            f"-- {part} ({summary['update_ranges']} update ranges)" if part == "update" else f"-- {part}"
        )
        head = f"window {s['window_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms"
        lines.append(head + (f" (idle {idle:.1%})" if idle is not None else ""))
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in s["comm_by_kind_ms"].items()) or "none"
        lines.append(f"compute {s['compute_ms']:.1f} ms; communication {s['comm_ms']:.1f} ms ({kinds})")
        if frac is not None:
            lines.append(
                f"communication overlapped with compute: {s['comm_overlapped_ms']:.1f} ms ({frac:.1%}); "
                f"exposed {s['comm_exposed_ms']:.1f} ms"
            )
        lines.append(f"{'total ms':>10} {'count':>7}  name")
        for row in s["top"]:
            lines.append(f"{row['total_ms']:>10.2f} {row['count']:>7}  {row['name'][:110]}")
    return "\n".join(lines) + "\n"


def write_summary(trace_path: Path, out_stem: Path, title: str) -> dict[str, Any]:
    """Read a Chrome trace, write ``<out_stem>.json`` and ``<out_stem>.txt``; return the summary."""
    trace = json.loads(Path(trace_path).read_text())
    summary = summarise_trace(trace)
    out_stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    out_stem.with_suffix(".txt").write_text(format_summary(summary, title))
    return summary


try:  # the callback needs Lightning; the summary functions above do not
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[assignment,misc]


class ProfileSteps(Callback):
    """Profile the training steps ``first`` … ``first + count − 1`` (counted from this run's start) on
    rank 0; write its Chrome trace (``rank0_trace.json``) and the summary (:func:`write_summary`) to
    ``folder``.

    One rank: a trace of one SD3.5-M step holds hundreds of thousands of events, and reading it back
    costs seconds and gigabytes of host memory per rank; the other ranks' steps run unprofiled, and
    wait for rank 0 in the collectives, so the profiled steps are slower everywhere (the benchmark
    leaves them out of its throughput). A failure while summarising is written to the summary file,
    never raised: the run's own results must survive a profiler surprise.
    """

    def __init__(self, folder: str | Path, first: int, count: int = 1, rank: int = 0) -> None:
        self.folder = Path(folder)
        self.first, self.count, self.rank = first, count, rank
        self.steps: list[int] = []
        self._seen = 0
        self._profiler: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._seen != self.first or trainer.global_rank != self.rank:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self._profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, self._seen = self._seen, self._seen + 1
        if self.first <= step < self.first + self.count:
            self.steps.append(step)  # on every rank: each leaves the profiled steps out of its figures
        if self._profiler is None:
            return
        if self._seen < self.first + self.count:
            return
        import torch

        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._profiler.stop()
        rank = trainer.global_rank
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{rank}_trace.json"
        stem = self.folder / f"rank{rank}_summary"
        try:
            self._profiler.export_chrome_trace(str(trace))
            write_summary(trace, stem, f"rank {rank}, steps {self.steps}")
        except Exception as err:
            stem.with_suffix(".txt").write_text(f"profile summary failed: {type(err).__name__}: {err}\n")
        finally:
            self._profiler = None
