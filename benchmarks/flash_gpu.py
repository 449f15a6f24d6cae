"""Our Triton FlashAttention-2 vs torch SDPA's flash backend on a CUDA GPU: TFLOP/s, causal, bf16.

    python benchmarks/flash_gpu.py                  # correctness check, then the table (CUDA + triton)
    python benchmarks/flash_gpu.py --compile-only   # no GPU needed: compile the kernels for sm_80 and
                                                    # sm_90; print shared memory, registers, spills

Every sequence length T runs B = tokens / T sequences (16k tokens, 16 heads, head_dim 128 by default),
so each row does the same work per token. FLOPs follow FlashAttention's convention: forward
4·B·H·T²·D (QKᵀ and PV), halved when causal; backward 2.5× forward (five matmuls), so fwd+bwd is 3.5×.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F


def _flops(b: int, h: int, t: int, d: int, causal: bool) -> float:
    return 4 * b * h * t * t * d / (2 if causal else 1)  # 2 matmuls × 2 FLOPs per multiply-add


def _sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def check(b: int, h: int, h_kv: int, t: int, d: int, dtype: torch.dtype) -> bool:
    """Ours vs an fp32 reference, next to torch SDPA in the same dtype: ours may err at most twice as
    much as SDPA plus 1e-3 (an eighth of a bf16 ulp at 1). Prints the max errors; True if all pass."""
    from decoderlm.model.kernels.flash_triton import flash_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(b, h, t, d, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, h_kv, t, d, device="cuda", generator=g, dtype=dtype) for _ in range(2))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != h_kv)

    ref = _grads(sdpa, *(x.float() for x in (q, k, v, do)))
    ours = _grads(flash_attention_triton, q, k, v, do)
    torch_same_dtype = _grads(_sdpa_flash if h == h_kv else sdpa, q, k, v, do)
    ok = True
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), ours, torch_same_dtype, ref, strict=True):
        err, err_torch = (a.float() - r).abs().max().item(), (s.float() - r).abs().max().item()
        passed = err <= 2 * err_torch + 1e-3
        ok &= passed
        print(
            f"  check B={b} H={h} Hkv={h_kv} T={t} {name}: ours {err:.2e}  torch {err_torch:.2e}"
            f"  {'ok' if passed else 'FAIL'}"
        )
    return ok


def _tflops(fn, q, k, v, do, flops: float) -> float:
    """Median TFLOP/s of fn(q, k, v), or of forward + backward when the output gradient do is given."""
    import triton.testing

    def step() -> None:
        out = fn(q, k, v)
        if do is not None:
            out.backward(do)

    ms = triton.testing.do_bench(step, grad_to_none=[q, k, v], return_mode="median")
    return flops * (1 if do is None else 3.5) / ms * 1e-9


def bench(args: argparse.Namespace) -> int:
    """Correctness first (MHA at T=1024, GQA with ragged T=1000), then the TFLOP/s table."""
    import triton

    from decoderlm.model.kernels.flash_triton import flash_attention_triton

    dtype, h, d = getattr(torch, args.dtype), args.heads, args.head_dim
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not (check(2, h, h, 1024, d, dtype) and check(2, h, max(1, h // 4), 1000, d, dtype)):
        print("flash_gpu.py: correctness check failed; not timing", file=sys.stderr)
        return 1
    print(
        f"\ncausal, {args.dtype}, {h} heads, head_dim {d}, {args.tokens} tokens per step; TFLOP/s"
    )
    print(f"{'T':>6} {'B':>3} | {'ours fwd':>9} {'sdpa fwd':>9} | {'ours f+b':>9} {'sdpa f+b':>9}")
    for t in args.seqlens:
        b = max(1, args.tokens // t)
        q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=dtype) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        flops = _flops(b, h, t, d, causal=True)
        row = [
            _tflops(fn, q, k, v, grad_out, flops)
            for grad_out in (None, do)
            for fn in (flash_attention_triton, _sdpa_flash)
        ]
        print(f"{t:>6} {b:>3} | {row[0]:>9.1f} {row[1]:>9.1f} | {row[2]:>9.1f} {row[3]:>9.1f}")
    return 0


# ------------------------------------------------------------------- ahead-of-time compile report

SMEM_LIMIT_KIB = {80: 163, 86: 99, 89: 99, 90: 227}  # max shared memory per block; others: 99


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, stack bytes = spills) per thread, read with the cuobjdump that triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "?", "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        )
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    return found.groups() if found else ("?", "?")


def compile_only(args: argparse.Namespace) -> int:
    """Compile every kernel as `flash_attention_triton` launches it (causal), for each sm × dtype ×
    head_dim, without and with a key-padding mask; exit 1 if one needs more shared memory than a
    block may have."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from decoderlm.model.kernels import flash_triton as ft

    if ft.INTERPRETED:
        print("flash_gpu.py: unset TRITON_INTERPRET to compile the kernels", file=sys.stderr)
        return 2
    kernels = {  # name → (kernel, float arguments, tiles from)
        "fwd": (ft._attn_fwd, ("qk_scale",), "fwd"),
        "delta": (ft._attn_bwd_delta, (), "dq"),
        "dkdv": (ft._attn_bwd_dkdv, ("qk_scale", "scale"), "dkdv"),
        "dq": (ft._attn_bwd_dq, ("qk_scale", "scale"), "dq"),
    }
    print(f"{'sm':>3} {'dtype':>8} {'D':>4} {'path':>6} {'kernel':>6} | tiles (M×N, warps, stages)"
          " | smem KiB  regs  spill B")  # fmt: skip
    ok = True
    combos = itertools.product(args.arch, args.dtypes, args.head_dims, ("plain", "padded"))
    for sm, dtype_name, d, path in combos:
        dtype = getattr(torch, dtype_name)
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype_name]
        for name, (fn, floats, tiles_of) in kernels.items():
            block_m, block_n, warps, stages = ft._tiles(tiles_of, d, dtype, sm // 10)
            flags = dict(HEAD_DIM=d, BLOCK_M=block_m)
            if name != "delta":
                flags.update(BLOCK_N=block_n, CAUSAL=True, PRECISION=ft._precision(dtype))
                flags.update(
                    HAS_PAD=path == "padded", **({} if path == "padded" else {"PAD": None})
                )
            signature = {
                a: "constexpr" if a in flags
                else "*fp32" if a in ("LSE", "DELTA")
                else "*u8" if a == "PAD"
                else f"*{short}" if a.isupper()
                else "fp32" if a in floats
                else "i32"
                for a in fn.arg_names
            }  # fmt: skip
            src = ASTSource(fn=fn, signature=signature, constexprs=flags)
            options = {"num_warps": warps, "num_stages": stages if name != "delta" else 1}
            compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=options)
            regs, spill = _resources(compiled.asm["cubin"])
            smem = compiled.metadata.shared
            fits = smem <= SMEM_LIMIT_KIB.get(sm, 99) * 1024
            ok &= fits
            print(
                f"{sm:>3} {short:>8} {d:>4} {path:>6} {name:>6} | {block_m:>3}×{block_n:<3} "
                f"{warps} {stages}{' ':>13} | {smem / 1024:>8.0f} {regs:>5} {spill:>8}"
                + ("" if fits else "  EXCEEDS SHARED MEMORY")
            )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="B·T per measurement")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile and report")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="with --compile-only")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("flash_gpu.py: triton is not installed (pip install 'decoderlm[triton]')")
    if args.compile_only:
        return compile_only(args)
    if not torch.cuda.is_available():
        sys.exit(
            "flash_gpu.py: no CUDA device found; this benchmark needs a GPU "
            "(use --compile-only to compile the kernels for sm_80/sm_90 without one)"
        )
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
