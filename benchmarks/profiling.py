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
  module marks with ``torch.profiler.record_function``), where the profiler recorded it;
- for a speed investigation, per part of the step (``parts``: the whole ``step``, and the ``rollout``,
  its ``decode`` and the ``update`` where the benchmark marked them): the share of the wall window in
  which the GPU ran something (the rest is time the GPU waited for the host: launches, Python,
  synchronisations), the GPU time per kernel category (:data:`CATEGORY_RULES`: matrix products,
  attention, convolutions, inductor's fused Triton kernels, other elementwise and reduction kernels,
  copies, NCCL) and the top kernels with their counts and mean durations;
- where the profiler recorded shapes (``record_shapes``), the thin matrix products among them
  (:func:`thin_products`: LoRA's adapters, which kernel names do not tell apart from the base's).

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
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The update, as FlowGRPOModule's stage clock marks it (lit_flowgrpo.step_output.StageClock).
UPDATE_RANGE = "lit_flowgrpo.update"
#: The profiled training step (:class:`ProfileSteps` opens it): the wall window of the ``step`` part.
STEP_RANGE = "lit_flowgrpo.step"
#: The rollout (sampling and decoding, with the reward's chunks submitted) and its decoding, where the
#: benchmark marks them (``benchmarks/throughput.py``).
ROLLOUT_RANGE = "lit_flowgrpo.rollout"
DECODE_RANGE = "lit_flowgrpo.decode"
PART_RANGES = {"step": STEP_RANGE, "rollout": ROLLOUT_RANGE, "decode": DECODE_RANGE, "update": UPDATE_RANGE}

_COLLECTIVES = (
    ("all_gather", re.compile(r"all_?gather", re.I)),
    ("reduce_scatter", re.compile(r"reduce_?scatter", re.I)),
    ("all_reduce", re.compile(r"all_?reduce", re.I)),
)
_COMM = re.compile(r"nccl|gloo|c10d::", re.I)

#: Kernel categories by name, the first matching rule wins, so the order matters: inductor's Triton
#: matrix-product templates (max-autotune) are products before any Triton kernel is "triton"; a
#: Triton kernel is named after the aten ops it fused, and a pointwise epilogue of ``addmm`` must not
#: count as a product, so the Triton rules come before the name-based ones; attention kernels carry
#: cutlass, wgmma or fprop in their names, so attention comes before products and convolutions. A name
#: no rule matches is "elementwise" (PyTorch's own elementwise, reduction, norm and layout kernels).
#: On a CPU trace the same rules sort the operators (``aten::mm``, ``aten::scaled_dot_product_...``).
CATEGORY_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nccl", _COMM),
    ("memcpy", re.compile(r"^mem(cpy|set)\b", re.I)),
    ("gemm", re.compile(r"^triton_tem_.*mm")),
    ("attention", re.compile(r"^triton_tem_.*attention")),
    ("triton", re.compile(r"^triton_")),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("conv", re.compile(r"conv|implicit_gemm|fprop|dgrad|wgrad", re.I)),
    (
        "gemm",
        re.compile(
            r"gemm|cublas|cutlass|nvjet|xmma|wgmma|splitk|matmul|\b(?:add|b|baddb)?mm\b|\blinear\b", re.I
        ),
    ),
)
CATEGORIES = ("gemm", "attention", "conv", "triton", "elementwise", "memcpy", "nccl")
#: Kernels of the GPU timeline: compute kernels and the copy engines' work.
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


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


def kernel_category(name: str) -> str:
    """The category of a kernel (or CPU operator) by its name (:data:`CATEGORY_RULES`).

    >>> kernel_category("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT"), kernel_category("triton_tem_fused_mm_0")
    ('gemm', 'gemm')
    >>> kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0")
    'attention'
    >>> kernel_category("triton_poi_fused_addmm_gelu_3"), kernel_category("void at::native::reduce_kernel<512, 1>")
    ('triton', 'elementwise')
    """
    for category, pattern in CATEGORY_RULES:
        if pattern.search(name):
            return category
    return "elementwise"


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
    intervals, span = _clip(intervals, windows)
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


def _clip(
    intervals: Sequence[Interval], windows: Sequence[tuple[float, float]] | None
) -> tuple[list[Interval], float]:
    """The parts of ``intervals`` inside ``windows`` and the windows' length; without windows, all of
    them and the span from the first start to the last end."""
    if not windows:
        span = (max(i.end_us for i in intervals) - min(i.start_us for i in intervals)) if intervals else 0.0
        return list(intervals), span
    bounds = union(windows)
    clipped = []
    for i in intervals:
        for start, end in intersect([(i.start_us, i.end_us)], bounds):
            clipped.append(Interval(i.name, i.lane, start, end - start))
    return clipped, length(bounds)


def breakdown(
    intervals: Sequence[Interval], windows: Sequence[tuple[float, float]] | None = None, top: int = 25
) -> dict[str, Any]:
    """Where the GPU time of a wall window went: ``intervals`` (kernels and copies) inside ``windows``
    (clipped to them; ``None``: from the first kernel to the last).

    Times in milliseconds. ``gpu_busy_fraction``: the share of the window in which some kernel ran (the
    union of their intervals, whatever the stream); the rest is time the GPU waited for the host.
    ``by_category_ms``: the sum of the kernels' durations per category (:func:`kernel_category`; with
    concurrent streams their sum can exceed the busy time). ``top_kernels``: by total time, each with its
    category, count and mean duration in microseconds.
    """
    intervals, span = _clip(intervals, windows)
    busy = length(union((i.start_us, i.end_us) for i in intervals))
    per_category: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for i in intervals:
        per_category[kernel_category(i.name)] += i.dur_us
        row = by_name[i.name]
        row[0] += i.dur_us
        row[1] += 1
    total = sum(per_category.values())
    ms = 1e-3
    return {
        "window_ms": span * ms,
        "gpu_busy_ms": busy * ms,
        "gpu_busy_fraction": busy / span if span else None,
        "kernel_ms": total * ms,
        "by_category_ms": {k: v * ms for k, v in per_category.items()},
        "by_category_fraction": {k: v / total for k, v in per_category.items()} if total else None,
        "kernels": len(intervals),
        "top_kernels": [
            {
                "name": name,
                "category": kernel_category(name),
                "count": int(count),
                "total_ms": t * ms,
                "mean_us": t / count,
            }
            for name, (t, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


#: The matrix-product operators, and where their two matrix operands are in ``Input Dims``.
_MATMUL_OPERANDS = {
    "aten::mm": (0, 1),
    "aten::bmm": (0, 1),
    "aten::_scaled_mm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::baddbmm": (1, 2),
}
#: A product is thin when its output width N or its inner dimension K is at most this: a LoRA
#: adapter's down projection (N = rank) and up projection (K = rank) at the usual ranks.
THIN_DIM = 64


def matmul_shapes(trace: dict[str, Any]) -> dict[int, tuple[int, int, int]]:
    """``(M, N, K)`` of every matrix-product operator recorded with its input shapes (``record_shapes``),
    by its ``External id`` (the id its kernels carry); a batched product's batch is folded into M."""
    out = {}
    for e in trace.get("traceEvents", []):
        operands = _MATMUL_OPERANDS.get(e.get("name", ""))
        if operands is None or e.get("cat") != "cpu_op":
            continue
        args = e.get("args") or {}
        dims, ext = args.get("Input Dims"), args.get("External id")
        try:
            a, b = dims[operands[0]], dims[operands[1]]
            rows = math.prod(a[:-1])
            out[int(ext)] = (int(rows), int(b[-1]), int(a[-1]))
        except (IndexError, TypeError, ValueError):
            continue  # no shapes recorded, or not a matrix operand
    return out


def thin_products(
    trace: dict[str, Any],
    windows: Sequence[tuple[float, float]] | None,
    source: str,
    shapes: dict[int, tuple[int, int, int]],
    max_dim: int = THIN_DIM,
) -> dict[str, Any]:
    """The thin matrix products (:data:`THIN_DIM`) among the kernels (CPU operators) starting inside
    ``windows``: their count and time, against all the matrix products whose shapes are known, and the
    costliest shapes. Only a kernel launched by a profiled operator has a shape: a CUDA graph's replay
    and inductor's own Triton kernels (a max-autotune template) have none, and are left out of both."""
    bounds = union(windows) if windows else None
    by_shape: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0.0, 0])
    known = 0.0
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != source or "dur" not in e:
            continue
        ext = (e.get("args") or {}).get("External id")
        shape = shapes.get(ext) if isinstance(ext, int) else None
        if shape is None or (source == "cpu_op" and e.get("name") not in _MATMUL_OPERANDS):
            continue
        ts = float(e["ts"])
        if bounds is not None and not any(start <= ts < end for start, end in bounds):
            continue
        known += float(e["dur"])
        if min(shape[1], shape[2]) <= max_dim:
            row = by_shape[shape]
            row[0] += float(e["dur"])
            row[1] += 1
    thin = sum(t for t, _ in by_shape.values())
    return {
        "max_dim": max_dim,
        "kernels": int(sum(c for _, c in by_shape.values())),
        "total_ms": thin * 1e-3,
        "matmul_ms": known * 1e-3,
        "share_of_matmuls": thin / known if known else None,
        "shapes": [
            {"m": m, "n": n, "k": k, "count": int(c), "total_ms": t * 1e-3}
            for (m, n, k), (t, c) in sorted(by_shape.items(), key=lambda kv: -kv[1][0])[:8]
        ],
    }


def part_windows(trace: dict[str, Any], name: str, source: str) -> list[tuple[float, float]]:
    """The wall windows of the part marked ``name``.

    The step (:data:`STEP_RANGE`) is the host's range: the whole time the step took, the GPU's waits
    included. The other parts are measured on the GPU's timeline (``gpu_user_annotation``: from the
    first kernel launched inside the range to the end of the last), because the host runs ahead of the
    GPU: the host's range of the decoding ends while the GPU still samples, and would count sampling
    kernels as decoding. Inside a part, idle GPU time is then time between its own kernels. A CPU
    trace (no kernels) uses the host's ranges throughout.
    """
    if source != "kernel" or name == STEP_RANGE:
        return trace_windows(trace, name, ("user_annotation",))
    return trace_windows(trace, name, ("gpu_user_annotation", "user_annotation"))


def summarise_trace(trace: dict[str, Any], top: int = 15, top_kernels: int = 25) -> dict[str, Any]:
    """:func:`summarise` of a trace's GPU kernels (its CPU operators if it has no kernel), over the
    whole trace and inside the update's ranges; and :func:`breakdown` of each part of the step
    (``parts``: ``None`` for a part the trace has no range of)."""
    intervals = trace_intervals(trace, "kernel")
    source = "kernel"
    if not intervals:
        intervals, source = trace_intervals(trace, "cpu_op"), "cpu_op"
    # A kernel's update range is the one on the GPU's timeline; a CPU operator's, the CPU's.
    categories = ("gpu_user_annotation",) if source == "kernel" else ("user_annotation",)
    windows = trace_windows(trace, UPDATE_RANGE, categories)
    # The busy time counts the copy engines' work too; the communication figures above keep to kernels.
    gpu = [i for c in _GPU_CATEGORIES for i in trace_intervals(trace, c)] if source == "kernel" else intervals
    shapes = matmul_shapes(trace)
    parts: dict[str, Any] = {}
    for part, name in PART_RANGES.items():
        found = part_windows(trace, name, source)
        if not found and part != "step":
            parts[part] = None
            continue
        # a trace of another harness has no step range: the whole trace is the step
        parts[part] = dict(breakdown(gpu, found or None, top_kernels), ranges=len(found))
        if shapes:
            parts[part]["thin_products"] = thin_products(trace, found or None, source, shapes)
    return {
        "source": source,
        "whole": summarise(intervals, None, top),
        "update": summarise(intervals, windows, top) if windows else None,
        "update_ranges": len(windows),
        "parts": parts,
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
    for part, b in (summary.get("parts") or {}).items():
        lines += _format_part(part, b, summary["source"])
    return "\n".join(lines) + "\n"


def _format_part(part: str, b: dict[str, Any] | None, source: str) -> list[str]:
    if b is None:
        return [f"== part {part}: no {PART_RANGES[part]} range in the trace"]
    where = (
        "the whole trace"
        if not b["ranges"]
        else f"{b['ranges']} range(s), "
        + ("host's" if part == "step" or source != "kernel" else "GPU's")
        + " timeline"
    )
    busy = b["gpu_busy_fraction"]
    lines = [
        f"== part {part} ({where}): window {b['window_ms']:.1f} ms, busy {b['gpu_busy_ms']:.1f} ms"
        + (f" ({busy:.1%}; idle {1 - busy:.1%})" if busy is not None else ""),
    ]
    fractions = b["by_category_fraction"] or {}
    lines.append(
        ("by category (CPU operators nest: the sums overlap): " if source != "kernel" else "by category: ")
        + ", ".join(
            f"{k} {v:.1f} ms ({fractions.get(k, 0.0):.0%})" for k, v in b["by_category_ms"].items() if v
        )
    )
    thin = b.get("thin_products")
    if thin:
        share = thin["share_of_matmuls"]
        lines.append(
            f"thin matrix products (N or K <= {thin['max_dim']}: LoRA's adapters): {thin['kernels']} kernels, "
            f"{thin['total_ms']:.1f} ms"
            + (
                f" ({share:.1%} of the {thin['matmul_ms']:.1f} ms of products with recorded shapes)"
                if share is not None
                else ""
            )
            + "".join(
                f"; {r['m']}x{r['n']}x{r['k']} {r['count']}x {r['total_ms']:.1f} ms"
                for r in thin["shapes"][:3]
            )
        )
    lines.append(f"{'total ms':>10} {'count':>7} {'mean us':>9}  {'category':<11} name")
    for row in b["top_kernels"]:
        lines.append(
            f"{row['total_ms']:>10.2f} {row['count']:>7} {row['mean_us']:>9.1f}  {row['category']:<11} "
            f"{row['name'][:110]}"
        )
    return lines


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace, plain or gzipped (``.gz``)."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def write_summary(trace_path: Path, out_stem: Path, title: str) -> dict[str, Any]:
    """Read a Chrome trace, write ``<out_stem>.json`` and ``<out_stem>.txt``; return the summary."""
    trace = read_trace(trace_path)
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
    ``folder``. Each profiled step is a :data:`STEP_RANGE` range (the ``step`` part's wall window).

    One rank: a trace of one SD3.5-M step holds hundreds of thousands of events, and reading it back
    costs seconds and gigabytes of host memory per rank; the other ranks' steps run unprofiled, and
    wait for rank 0 in the collectives, so the profiled steps are slower everywhere (the benchmark
    leaves them out of its throughput). A failure while summarising is written to the summary file,
    never raised: the run's own results must survive a profiler surprise.

    Args:
        folder: where the trace and the summary go.
        first: the first profiled step, counted from this run's start.
        count: how many consecutive steps.
        rank: the profiled rank.
        gzip: keep the trace gzipped (``rank0_trace.json.gz``, which Perfetto and chrome://tracing
            open as it is): a step's trace is hundreds of megabytes of repetitive JSON.
        record_shapes: record the operators' input shapes (the summary's thin matrix products), at
            some cost to the profiled step.
    """

    def __init__(
        self,
        folder: str | Path,
        first: int,
        count: int = 1,
        rank: int = 0,
        gzip: bool = False,
        record_shapes: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.first, self.count, self.rank = first, count, rank
        self.gzip, self.record_shapes = gzip, record_shapes
        self.steps: list[int] = []
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None
        self._seen = 0
        self._profiler: Any = None
        self._range: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.first <= self._seen < self.first + self.count or trainer.global_rank != self.rank:
            return
        import torch

        if self._seen == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=self.record_shapes, with_stack=False
            )
            self._profiler.start()
        # Entered here and left in on_train_batch_end: Lightning calls the two around the step.
        self._range = torch.profiler.record_function(STEP_RANGE)
        self._range.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, self._seen = self._seen, self._seen + 1
        if self.first <= step < self.first + self.count:
            self.steps.append(step)  # on every rank: each leaves the profiled steps out of its figures
        if self._profiler is None:
            return
        import torch

        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the step's range ends when its GPU work does
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._seen < self.first + self.count:
            return
        self._profiler.stop()
        rank = trainer.global_rank
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{rank}_trace.json"
        stem = self.folder / f"rank{rank}_summary"
        try:
            self._profiler.export_chrome_trace(str(trace))
            self.summary = write_summary(trace, stem, f"rank {rank}, steps {self.steps}")
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            stem.with_suffix(".txt").write_text(f"profile summary failed: {self.error}\n")
        finally:
            self._profiler = None
            if self.gzip and trace.exists():
                _gzip(trace)

    def on_exception(self, trainer, pl_module, exception) -> None:
        # A step that raised leaves no profiler running into the next run of this process.
        if self._profiler is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._profiler.stop()
        self._profiler = None
        self.error = f"the profiled step failed: {type(exception).__name__}: {exception}"


def _gzip(path: Path) -> None:
    """``path`` replaced by ``path.gz``."""
    import gzip
    import shutil

    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb", compresslevel=3) as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
