"""Which ``scaled_dot_product_attention`` kernels train each model family's attention on this GPU.

For every case (a family's joint-attention shape, or a point of a sweep over sequence lengths), each
kernel (cuDNN, flash, memory-efficient) runs a bf16 forward and backward with the layout diffusers
gives it (``(B, S, H, D)`` tensors permuted to ``(B, H, S, D)``), and its output and gradients are
compared with the math kernel in fp32 on the same inputs. A case ends as

- ``ok``: finite, and within bf16 rounding of the fp32 result (relative max error below 2⁻⁵; the
  kernels differ by accumulation order, a few bf16 ulps at most);
- ``wrong``: finite but further off; ``nan``: a non-finite output or gradient;
- ``refused``: the kernel raised a catchable error (it does not support the shape);
- ``crash``: the process died or its CUDA context did (an illegal memory access). Such an error
  cannot be caught and survived in the process where it happens, so the cases run in a child
  process, which the parent restarts after the case that killed it.

    python benchmarks/attention_probe.py --out benchmarks/results          # families and sweeps
    python benchmarks/attention_probe.py --only model_flux,flux --out /tmp/probe   # one family's shapes

Results: ``<out>/attention_probe_<device>.json`` (the versions of torch, CUDA and cuDNN, and every
case's status per kernel), and a summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BACKENDS = ("cudnn", "flash", "efficient")


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    mask: bool = False
    """A boolean key mask (Qwen-Image's padded prompts): the last ``pad`` keys masked out."""
    pad: int = 0


def family_cases() -> list[Case]:
    """The joint attention of each shipped family at 512 and 1024 px, at the micro-batches the recipes
    use (CFG doubles the batch of a forward)."""
    cases = []
    for b in (1, 2, 4, 8, 16):
        # SD3.5-M: 24 heads × 64; 333 text tokens (77 CLIP + 256 T5) + 32×32 / 64×64 image patches.
        cases.append(Case(f"sd35m_512_b{b}", b, 24, 333 + 1024, 64))
        cases.append(Case(f"sd35m_512_attn2_b{b}", b, 24, 1024, 64))
        # FLUX.1-dev: 24 heads × 128; 512 T5 tokens + image patches.
        cases.append(Case(f"flux_512_b{b}", b, 24, 512 + 1024, 128))
        # Qwen-Image: 24 heads × 128; the prompt's tokens (padded in a batch, masked) + image patches.
        cases.append(Case(f"qwenimage_512_b{b}", b, 24, 77 + 1024, 128, mask=True, pad=20))
    for b in (1, 2, 4):
        cases.append(Case(f"sd35m_1024_b{b}", b, 24, 333 + 4096, 64))
        cases.append(Case(f"flux_1024_b{b}", b, 24, 512 + 4096, 128))
        cases.append(Case(f"qwenimage_1024_b{b}", b, 24, 77 + 4096, 128, mask=True, pad=20))
    return cases


def model_cases() -> list[Case]:
    """The families' own transformers, cut to one or two blocks of the public config (random bf16
    weights, every weight trained), forward and backward at 512 px: diffusers' attention processors,
    rotary embeddings and masks on the way to the kernel, as a training step calls them."""
    return [
        Case(f"model_{family}_b{b}", b, 24, 0, 0) for family in ("sd35m", "flux", "qwenimage") for b in (1, 2)
    ]


def sweep_cases(seqs: range, head_dims: list[int], batches: list[int]) -> list[Case]:
    """24 heads at every sequence length of ``seqs``, head dim and batch."""
    return [Case(f"sweep_d{d}_b{b}_s{s}", b, 24, s, d) for d in head_dims for b in batches for s in seqs]


def poison_free_memory() -> None:
    """Fill the memory the caching allocator will hand out next with NaN, so a kernel that reads past
    its inputs (the cuDNN fault below) reads NaN and shows it, instead of reading whatever the
    process happened to leave there (zeros in a fresh process, which hides the fault)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    block = torch.full((min(free // 4, 8 << 30) // 4,), float("nan"), device="cuda")
    del block


def run_model_case(case: Case, kernel: Any) -> dict[str, Any]:
    import torch
    from torch.nn.attention import sdpa_kernel

    from lit_flowgrpo.tiny.specs import SPECS

    family, batch = case.name.split("_")[1], case.batch
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    with torch.device(dev):
        if family == "sd35m":
            from diffusers import SD3Transformer2DModel

            # SD3.5-Medium's blocks, two of them (the first with its dual attention)
            config = dict(SPECS["sd35m"]["transformer"], num_layers=2, dual_attention_layers=(0,))
            model = SD3Transformer2DModel(**config)
            inputs = dict(
                hidden_states=torch.randn(batch, 16, 64, 64),
                encoder_hidden_states=torch.randn(batch, 333, 4096),
                pooled_projections=torch.randn(batch, 2048),
                timestep=torch.full((batch,), 500.0),
            )
        elif family == "flux":
            from diffusers import FluxTransformer2DModel

            # FLUX.1-dev's blocks, one joint and one single-stream
            model = FluxTransformer2DModel(
                **dict(SPECS["flux"]["transformer"], num_layers=1, num_single_layers=1)
            )
            grid = torch.stack(torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij"), -1).reshape(
                -1, 2
            )
            inputs = dict(
                hidden_states=torch.randn(batch, 1024, 64),
                encoder_hidden_states=torch.randn(batch, 512, 4096),
                pooled_projections=torch.randn(batch, 768),
                timestep=torch.full((batch,), 0.5),
                guidance=torch.full((batch,), 3.5),
                img_ids=torch.cat([torch.zeros(1024, 1), grid.float()], 1),
                txt_ids=torch.zeros(512, 3),
            )
        else:
            from diffusers import QwenImageTransformer2DModel

            model = QwenImageTransformer2DModel(
                **dict(SPECS["qwenimage"]["transformer"], num_layers=1)
            )  # one block
            mask = torch.ones(batch, 77, dtype=torch.long)
            mask[-1, 57:] = 0  # padded prompts: one shorter than the other
            inputs = dict(
                hidden_states=torch.randn(batch, 1024, 64),
                encoder_hidden_states=torch.randn(batch, 77, 3584),
                encoder_hidden_states_mask=mask if batch > 1 else None,
                timestep=torch.full((batch,), 0.5),
                img_shapes=[[(1, 32, 32)]] * batch,
            )
    model = model.to(dtype).train()
    inputs = {
        k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()
    }
    try:
        with sdpa_kernel([kernel]):
            out = model(**inputs, return_dict=False)[0]
            out.float().square().mean().backward()
        torch.cuda.synchronize()
    except RuntimeError as err:
        text = str(err)
        if "illegal memory access" in text or "CUDA error" in text or "CUBLAS_STATUS_EXECUTION" in text:
            raise
        return {"status": "refused", "error": text.splitlines()[0][:200]}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    return {"status": "ok" if finite else "nan"}


def run_case(case: Case, backend: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]
    poison_free_memory()
    if case.name.startswith("model_"):
        return run_model_case(case, kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (case.batch, case.seq, case.heads, case.head_dim)  # diffusers' layout
    q, k, v = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32) for _ in range(3))
    grad = torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).transpose(1, 2)
    mask = None
    if case.mask:
        keep = torch.ones(case.seq, dtype=torch.bool, device="cuda")
        keep[case.seq - case.pad :] = False  # the padded text tokens (here at the end)
        mask = keep[None, None, None, :].expand(case.batch, 1, case.seq, case.seq)

    def grads(dtype: torch.dtype, kernels: list[Any]) -> list[Any]:
        leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
        with sdpa_kernel(kernels):
            out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), attn_mask=mask)
            out.backward(grad.to(dtype))
        return [out.float(), *(x.grad.float() for x in leaves)]

    try:
        got = grads(torch.bfloat16, [kernel])
        torch.cuda.synchronize()
    except RuntimeError as err:
        text = str(err)
        if "illegal memory access" in text or "CUDA error" in text or "CUBLAS_STATUS_EXECUTION" in text:
            raise  # the context is gone: let the process die, the parent records a crash
        return {"status": "refused", "error": text.splitlines()[0][:200]}
    want = grads(torch.float32, [SDPBackend.MATH])
    names = ("out", "dq", "dk", "dv")
    if not all(bool(torch.isfinite(g).all()) for g in got):
        bad = [n for n, g in zip(names, got, strict=True) if not bool(torch.isfinite(g).all())]
        return {"status": "nan", "non_finite": bad}
    rel = {
        n: float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
        for n, g, w in zip(names, got, want, strict=True)
    }
    result = {"status": "ok" if max(rel.values()) < 2**-5 else "wrong", "rel_err": rel}
    if not case.name.startswith("sweep_"):  # the families' shapes: how fast, forward and backward
        leaves = [x.to(torch.bfloat16).transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
        dout = grad.to(torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with sdpa_kernel([kernel]):
            for i in range(13):
                if i == 3:
                    start.record()
                F.scaled_dot_product_attention(*leaves, attn_mask=mask).backward(dout)
        end.record()
        torch.cuda.synchronize()
        result["fwd_bwd_ms"] = start.elapsed_time(end) / 10
    return result


def child() -> None:
    """Run the cases given on stdin, one JSON line per case start and end on stdout."""
    import torch

    jobs = json.loads(sys.stdin.read())
    print(json.dumps({"versions": versions(torch)}), flush=True)
    for i, (case, backend) in enumerate(jobs):
        print(json.dumps({"start": i}), flush=True)
        result = run_case(Case(**case), backend)
        print(json.dumps({"done": i, "result": result}), flush=True)


def versions(torch: Any) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def probe(jobs: list[tuple[Case, str]], timeout_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results: list[dict[str, Any] | None] = [None] * len(jobs)
    info: dict[str, Any] = {}
    start = 0
    while start < len(jobs):
        payload = json.dumps([(asdict(c), b) for c, b in jobs[start:]])
        proc = subprocess.run(
            [sys.executable, __file__, "--child"],
            input=payload,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        current = None
        for line in proc.stdout.splitlines():
            msg = json.loads(line)
            if "versions" in msg:
                info = msg["versions"]
            elif "start" in msg:
                current = start + msg["start"]
            elif "done" in msg:
                results[start + msg["done"]] = msg["result"]
                current = None
        if proc.returncode == 0:
            break
        if current is None:  # died before its first case: nothing to blame a case for
            raise RuntimeError(f"the probe process failed:\n{proc.stderr[-3000:]}")
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no message)"]
        results[current] = {"status": "crash", "error": tail[0][:200]}
        start = current + 1
    return info, [r or {"status": "not run"} for r in results]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--only", default=None, help="only cases whose name starts with one of these (commas)"
    )
    parser.add_argument(
        "--sweep", default="1024:1665:64", help="sequence lengths START:STOP:STEP of the sweep ('' for none)"
    )
    parser.add_argument("--sweep-dims", default="64,128", help="head dims of the sweep")
    parser.add_argument("--sweep-batches", default="1,2", help="batches of the sweep")
    parser.add_argument("--no-families", action="store_true", help="the sweep only")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per child process")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return
    cases = [] if args.no_families else model_cases() + family_cases()
    if args.sweep:
        ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
        cases += sweep_cases(
            range(*ints(args.sweep.replace(":", ","))), ints(args.sweep_dims), ints(args.sweep_batches)
        )
    if args.only:
        cases = [c for c in cases if c.name.startswith(tuple(args.only.split(",")))]
    jobs = [(c, b) for c in cases for b in args.backends.split(",")]
    info, results = probe(jobs, args.timeout)
    rows: dict[str, dict[str, Any]] = {}
    for (case, backend), result in zip(jobs, results, strict=True):
        rows.setdefault(case.name, {"case": asdict(case)})[backend] = result
    print(f"{info}")
    print(f"{'case':<26}" + "".join(f"{b:>11}" for b in args.backends.split(",")))
    for name, row in rows.items():
        print(f"{name:<26}" + "".join(f"{row[b]['status']:>11}" for b in args.backends.split(",")))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = info.get("device", "unknown").replace(" ", "_")
        path = out / f"attention_probe_{name}.json"
        path.write_text(json.dumps({"versions": info, "cases": list(rows.values())}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
