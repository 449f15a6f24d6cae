"""The recurrences of `decoderlm.model.scans`, both forms, against a float64 step-by-step reference
written from the papers' equations (the state as the papers orient it)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from decoderlm.model.scans import (
    chunk_gated_delta_rule,
    chunk_gated_linear_attention,
    mask_padding,
    recurrent_gated_delta_rule,
    recurrent_gated_linear_attention,
)

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, DK, DV = 2, 3, 5, 4


def inputs(t: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(B, H, t, DK).to(dtype),
        "k": F.normalize(randn(B, H, t, DK), dim=-1).to(dtype),  # the delta rule's L2-normed keys
        "v": randn(B, H, t, DV).to(dtype),
        "g": -F.softplus(randn(B, H, t)).to(dtype),  # log α ≤ 0
        "beta": torch.rand(B, H, t, generator=gen, dtype=torch.float64).to(dtype),
    }


def reference_linear(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """S_t = α_t S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, in float64, one (row, head) at a time."""
    q, k, v, g = (x[n].double() for n in "qkvg")
    out = torch.zeros(B, H, q.shape[2], DV, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = torch.zeros(DK, DV, dtype=torch.float64)
            for t in range(q.shape[2]):
                s = g[b, h, t].exp() * s + torch.outer(k[b, h, t], v[b, h, t])
                out[b, h, t] = s.T @ q[b, h, t]
    return out


def reference_delta(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The paper's S (d_v × d_k): S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    out = torch.zeros(B, H, q.shape[2], DV, dtype=torch.float64)
    eye = torch.eye(DK, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = torch.zeros(DV, DK, dtype=torch.float64)
            for t in range(q.shape[2]):
                kt, bt = k[b, h, t], beta[b, h, t]
                s = g[b, h, t].exp() * s @ (eye - bt * torch.outer(kt, kt))
                s = s + bt * torch.outer(v[b, h, t], kt)
                out[b, h, t] = s @ q[b, h, t]
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(kind: str, form: str, x: dict[str, torch.Tensor], **kw):
    args = [x["q"], x["k"], x["v"], x["g"]] + ([x["beta"]] if kind == "delta" else [])
    fn = {
        ("linear", "chunk"): chunk_gated_linear_attention,
        ("linear", "recurrent"): recurrent_gated_linear_attention,
        ("delta", "chunk"): chunk_gated_delta_rule,
        ("delta", "recurrent"): recurrent_gated_delta_rule,
    }[kind, form]
    return fn(*args, **kw)


REFERENCES = {"linear": reference_linear, "delta": reference_delta}


@pytest.mark.parametrize("kind", ["linear", "delta"])
@pytest.mark.parametrize("t, chunk", [(1, 4), (7, 4), (8, 4), (13, 5), (33, 16)])
def test_both_forms_match_the_float64_reference(kind: str, t: int, chunk: int) -> None:
    x = inputs(t)
    expected = REFERENCES[kind](x)
    chunked, s_chunk = run(kind, "chunk", x, chunk=chunk)
    stepped, s_step = run(kind, "recurrent", x)
    assert chunked.dtype == stepped.dtype == torch.float32
    assert relative_error(chunked, expected) <= 1e-5
    assert relative_error(stepped, expected) <= 1e-5
    assert relative_error(s_chunk, s_step) <= 1e-5


@pytest.mark.parametrize("kind", ["linear", "delta"])
@pytest.mark.parametrize("split", [1, 5, 9])
def test_a_state_carried_across_a_split_equals_the_whole(kind: str, split: int) -> None:
    x = inputs(14, torch.float64)
    whole, s_whole = run(kind, "chunk", x, chunk=4)
    first = {n: a[:, :, :split] for n, a in x.items()}
    rest = {n: a[:, :, split:] for n, a in x.items()}
    o1, s1 = run(kind, "chunk", first, chunk=4)
    o2, s2 = run(kind, "chunk", rest, state=s1, chunk=4)
    o3, s3 = run(kind, "recurrent", rest, state=s1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=2), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o3, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, s_whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s3, s_whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["linear", "delta"])
def test_gradients_of_the_chunked_form(kind: str) -> None:
    x = {n: a[:1, :1].clone().requires_grad_() for n, a in inputs(5, torch.float64).items()}
    names = ["q", "k", "v", "g"] + (["beta"] if kind == "delta" else [])

    def f(*args: torch.Tensor) -> torch.Tensor:
        o, s = run(kind, "chunk", dict(zip(names, args, strict=True)), chunk=2)
        return torch.cat([o.flatten(), s.flatten()])

    assert torch.autograd.gradcheck(f, tuple(x[n] for n in names))


@pytest.mark.parametrize("kind", ["linear", "delta"])
def test_a_masked_token_leaves_the_state_unchanged(kind: str) -> None:
    x = inputs(6, torch.float64)
    valid = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    masked = dict(x)
    if kind == "linear":
        masked["k"], masked["g"] = mask_padding(valid, x["k"], x["g"])
    else:
        masked["beta"], masked["g"] = mask_padding(valid, x["beta"], x["g"])
    _, s = run(kind, "chunk", masked, chunk=4)
    _, alone = run(kind, "chunk", {n: a[:1, :, 2:] for n, a in x.items()}, chunk=4)
    torch.testing.assert_close(s[:1], alone, rtol=1e-12, atol=1e-12)


def test_the_delta_rule_matches_transformers_torch_path() -> None:
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x = inputs(19)
    s0 = torch.randn(B, H, DK, DV)
    args = [x[n].transpose(1, 2) for n in ("q", "k", "v", "g", "beta")]  # (B, T, H, ...)
    theirs, s_theirs = qwen3_next.torch_chunk_gated_delta_rule(
        *args, chunk_size=8, initial_state=s0, output_final_state=True
    )
    scale = DK**-0.5  # transformers scales q inside the kernel
    ours, s_ours = chunk_gated_delta_rule(
        x["q"] * scale, x["k"], x["v"], x["g"], x["beta"], s0, chunk=8
    )
    assert relative_error(ours.transpose(1, 2), theirs) <= 1e-5
    assert relative_error(s_ours, s_theirs) <= 1e-5


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.most = max(self.most, x.numel())
        return out


@pytest.mark.parametrize("kind", ["linear", "delta"])
def test_the_chunked_form_never_builds_a_t_by_t_tensor(kind: str) -> None:
    t, chunk = 512, 16
    x = {n: a[:1, :1] for n, a in inputs(t).items()}  # (1, 1, T, ...)
    with LargestTensor() as largest:
        run(kind, "chunk", x, chunk=chunk)
    assert largest.most <= t * chunk < t * t  # (N, C, C) = T·C entries at most
