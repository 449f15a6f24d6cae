"""The Triton FlashAttention kernels against the float64 formula, forward and backward.

Without a GPU the kernels run on the CPU under the Triton interpreter. TRITON_INTERPRET=1 must be set
before triton itself is imported and stay set while kernels run, so the measurements are taken once, in
a fresh child process (this file run as a script) that reports them as JSON; the tests assert on them
here, and nothing leaks into other tests. With a CUDA device the compiled kernels are measured in-process.

Each case compares out, dq, dk, dv with `scaled_dot_product_attention` + `build_mask` on float64 copies.
Tolerance, the FlashAttention repository's rule: our max error may be at most twice that of PyTorch's
own attention computed in the kernel's input dtype, plus a floor for cases where PyTorch happens to be
exact (T = 1: dq is exactly 0 there, ours is the difference of two fp32 dot products, ~1e-6). Measured
on the interpreter: fp32 errors ~1e-6 (floor 1e-5, ~80 fp32 ulps at magnitude 1); fp16 errors ~1e-3,
like PyTorch's fp16 (floor 1e-4, a tenth of an fp16 ulp at 1). bfloat16 is not covered: the
interpreter's tl.dot multiplies bfloat16 bit patterns as integers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import scaled_dot_product_attention
from decoderlm.model.masks import build_mask

pytest.importorskip("triton", reason="triton is not installed (pip install 'decoderlm[triton]')")

ATOL_FLOOR = {"float32": 1e-5, "float16": 1e-4}
CASES = {  # id: (B, Hq, Hkv, Tq, Tk, D, causal, dtype); the interpreter's tiles are 16–32 rows
    "t1-causal-fp32": (1, 2, 2, 1, 1, 64, True, "float32"),
    "t17-gqa-causal-fp32": (2, 4, 2, 17, 17, 64, True, "float32"),
    "t128-mqa-causal-fp16": (1, 4, 1, 128, 128, 64, True, "float16"),
    "t200-gqa-noncausal-fp32": (1, 2, 1, 200, 200, 64, False, "float32"),
    "tq17-tk200-causal-fp16": (1, 2, 2, 17, 200, 64, True, "float16"),
    "tq200-tk17-causal-fp32": (1, 2, 2, 200, 17, 64, True, "float32"),
    "t128-d128-gqa-causal-fp32": (1, 2, 1, 128, 128, 128, True, "float32"),
}


def _inputs(b, hq, hkv, t_q, t_k, d, dtype, device, seed=0, bthd=False):
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    if bthd:  # the layout attention.py hands over: (B, T, H, D) transposed to (B, H, T, D)
        q = torch.randn(b, t_q, hq, d, generator=g).to(device, dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, t_q, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, hkv, t_k, d, generator=g).to(device, dtype) for _ in range(2))
    do = torch.randn(b, hq, t_q, d, generator=g).to(device, dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _formula(q, k, v, do, causal, key_padding_mask):
    """out, dq, dk, dv of softmax(QKᵀ/√d + M)V, computed in q's dtype."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, _ = scaled_dot_product_attention(
        q, k, v, build_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)
    )
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _max_errors(tensors, reference):
    return [(a.double() - b).abs().max().item() for a, b in zip(tensors, reference, strict=True)]


def _compare(ft, q, k, v, do, causal, key_padding_mask=None):
    """Run the kernel; its errors and PyTorch's same-dtype errors against float64, and the tensors."""
    out = ft.flash_attention_triton(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    out.backward(do)
    ours = (out.detach(), q.grad, k.grad, v.grad)
    ref64 = _formula(*(x.double() for x in (q, k, v, do)), causal, key_padding_mask)
    errors = {
        "ours": _max_errors(ours, ref64),
        "torch": _max_errors(_formula(q, k, v, do, causal, key_padding_mask), ref64),
        "dtype": str(q.dtype).removeprefix("torch."),
    }
    return errors, ours


def _measure_all(device: str) -> dict:
    """Every measurement the tests assert on (JSON-serialisable)."""
    from decoderlm.model.kernels import flash_triton as ft

    results = {}
    for name, (b, hq, hkv, t_q, t_k, d, causal, dtype) in CASES.items():
        results[name], _ = _compare(ft, *_inputs(b, hq, hkv, t_q, t_k, d, dtype, device), causal)

    q, k, v, do = _inputs(2, 4, 2, 17, 17, 32, "float32", device, bthd=True)
    results["bthd-layout"], (out, *_) = _compare(ft, q, k, v, do, causal=True)
    results["bthd-layout"]["same_strides"] = out.stride() == q.stride()

    q, k, v, do = _inputs(2, 2, 1, 33, 70, 64, "float32", device, seed=1)
    key_padding_mask = (
        torch.rand(2, 70, generator=torch.Generator().manual_seed(2)).to(device) > 0.3
    )
    key_padding_mask[0] = False  # batch 0 has no key at all
    results["padding"], (out, dq, dk, dv) = _compare(ft, q, k, v, do, True, key_padding_mask)
    results["padding"]["empty_rows_max"] = max(t[0].abs().max().item() for t in (out, dq, dk, dv))
    results["padding"]["padded_keys_grad_max"] = max(
        t[1][:, ~key_padding_mask[1]].abs().max().item() for t in (dk, dv)
    )

    q, k, v, _ = _inputs(1, 4, 2, 24, 40, 16, "float32", device)
    shapes = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.add(t.shape) or t, lambda t: t):
        ft.flash_attention_triton(
            q, k, v, key_padding_mask=torch.ones(1, 40, dtype=torch.bool, device=device)
        )
    results["saved_shapes"] = sorted(list(s) for s in shapes)
    return results


@pytest.fixture(scope="module")
def measured() -> dict:
    if torch.cuda.is_available():
        return _measure_all("cuda")
    child = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"interpreter run failed:\n{child.stderr[-6000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def _assert_within_bound(result: dict) -> None:
    floor = ATOL_FLOOR[result["dtype"]]
    for name, ours, torch_err in zip(
        ("out", "dq", "dk", "dv"), result["ours"], result["torch"], strict=True
    ):
        bound = 2 * torch_err + floor
        assert ours <= bound, f"{name}: error {ours:.2e} > 2 × torch {torch_err:.2e} + {floor:.0e}"


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_float64_reference(measured, case):
    _assert_within_bound(measured[case])


def test_strided_bthd_inputs_give_correct_results_in_the_query_layout(measured):
    _assert_within_bound(measured["bthd-layout"])
    assert measured["bthd-layout"]["same_strides"]


def test_key_padding_mask_matches_reference_and_rows_without_keys_are_zero(measured):
    _assert_within_bound(measured["padding"])
    assert measured["padding"]["empty_rows_max"] == 0.0  # out, dq, dk, dv of the all-padded batch
    assert measured["padding"]["padded_keys_grad_max"] == 0.0


def test_backward_saves_no_tq_by_tk_tensor(measured):
    # B=1, Hq=4, Hkv=2, Tq=24, Tk=40, D=16: q|O, k|v, L₂ (B, Hq, Tq), key mask (B, Tk)
    allowed = [[1, 4, 24, 16], [1, 2, 40, 16], [1, 4, 24], [1, 40]]
    assert measured["saved_shapes"] and all(s in allowed for s in measured["saved_shapes"])


def test_gpu_kernels_compile_for_hopper_within_shared_memory():
    """The interpreter skips Triton's compiler; this runs it (and the ptxas triton ships) for sm_90,
    bf16, head_dim 128, with and without padding: no GPU needed."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton ships no ptxas here ({ptxas})")
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "flash_gpu.py"
    args = ["--compile-only", "--arch", "90", "--dtypes", "bfloat16", "--head-dims", "128"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(bench), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count(" 90 ") == 8  # 4 kernels × (plain, padded)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "dtypes", "match"),
    [
        ((1, 2, 8, 80), (1, 2, 8, 80), None, "head_dim=80"),
        ((1, 3, 8, 64), (1, 2, 8, 64), None, "multiple of key/value heads 2"),
        ((1, 2, 8, 64), (2, 2, 8, 64), None, "must share batch and head_dim"),
        ((2, 8, 64), (2, 8, 64), None, r"\(B, Hq, Tq, D\)"),
        ((1, 2, 8, 64), (1, 2, 8, 64), (torch.float32, torch.float16), "share one floating dtype"),
        ((1, 2, 8, 64), (1, 2, 8, 64), (torch.float64, torch.float64), "not one of float16"),
    ],
)
def test_rejects_unsupported_inputs_with_one_line_error(q_shape, kv_shape, dtypes, match):
    from decoderlm.model.kernels.flash_triton import flash_attention_triton

    dt_q, dt_kv = dtypes or (torch.float32, torch.float32)
    q, k = torch.zeros(q_shape, dtype=dt_q), torch.zeros(kv_shape, dtype=dt_kv)
    with pytest.raises(DecoderLMError, match=match):
        flash_attention_triton(q, k, k)


def test_rejects_key_padding_mask_of_wrong_shape():
    from decoderlm.model.kernels.flash_triton import flash_attention_triton

    q = torch.zeros(2, 2, 8, 64)
    with pytest.raises(DecoderLMError, match=r"key_padding_mask must be bool of shape \(B, Tk\)"):
        flash_attention_triton(q, q, q, key_padding_mask=torch.ones(2, 7, dtype=torch.bool))


if __name__ == "__main__":  # the child process of `measured`, under TRITON_INTERPRET=1
    print(json.dumps(_measure_all("cpu")))
