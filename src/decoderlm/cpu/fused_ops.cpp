// The CPU kernels of the ops decoderlm::fused_rms_norm, decoderlm::fused_rope and
// decoderlm::fused_silu_mul (schemas and fake kernels: fused.py): fused.c's kernels, registered
// through PyTorch's stable C ABI, as gemv_ops.cpp, so that a library compiled ahead of time (the
// engine's batch-invariant decode pass) calls the very code the eager passes call through ctypes.
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
void fused_rms_norm(const void *x, const void *g, void *y, int64_t rows, int64_t dim, int64_t x_stride,
                    float eps, float offset, int bf16);
void fused_rope(const void *x, const void *cos, const void *sin, void *y, int64_t B, int64_t H, int64_t T,
                int64_t D, int64_t R, int64_t sb, int64_t sh, int64_t st, int64_t cs_b, int bf16);
void fused_silu_mul(const void *g, const void *u, void *y, int64_t rows, int64_t n, int bf16);
}

namespace {

// 1 for bfloat16 operands, 0 for float32; every operand of the one dtype.
int bf16_flag(const char *op, std::initializer_list<const Tensor *> operands) {
  const ScalarType dtype = (*operands.begin())->scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16, op, ": float32 or bfloat16 only");
  for (const Tensor *t : operands) STD_TORCH_CHECK(t->scalar_type() == dtype, op, ": operands of one dtype");
  return dtype == ScalarType::BFloat16;
}

Tensor dense(const Tensor &x) { return x.is_contiguous() ? x : torch::stable::contiguous(x); }

std::vector<int64_t> shape_of(const Tensor &x) { return std::vector<int64_t>(x.sizes().begin(), x.sizes().end()); }

// RMSNorm over the last dim of x (..., dim) with gain weight (dim): fused.c's formula.
Tensor fused_rms_norm_op(Tensor x, Tensor weight, double eps, double offset) {
  const int bf16 = bf16_flag("fused_rms_norm", {&x, &weight});
  STD_TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(x.dim() - 1),
                  "fused_rms_norm: weight must have x's last dim");
  x = dense(x);
  weight = dense(weight);
  const int64_t dim = weight.size(0), rows = dim ? x.numel() / dim : 0;
  Tensor y = torch::stable::new_empty(x, shape_of(x));
  fused_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, dim, dim, static_cast<float>(eps),
                 static_cast<float>(offset), bf16);
  return y;
}

// R_m x for x (B, H, T, D), cos / sin (T, R) or (B, T, R) → (B, T, H, D) contiguous.
Tensor fused_rope_op(Tensor x, Tensor cos, Tensor sin) {
  const int bf16 = bf16_flag("fused_rope", {&x, &cos, &sin});
  STD_TORCH_CHECK(x.dim() == 4 && (cos.dim() == 2 || cos.dim() == 3) && sin.sizes().equals(cos.sizes()),
                  "fused_rope: x must be (B, H, T, D) and cos, sin (T, R) or (B, T, R)");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), R = cos.size(cos.dim() - 1);
  STD_TORCH_CHECK(cos.size(cos.dim() - 2) == T && R % 2 == 0 && R <= D && (cos.dim() == 2 || cos.size(0) == B),
                  "fused_rope: cos, sin must be (T, R) or (B, T, R) with R even, at most D");
  if (x.stride(3) != 1) x = torch::stable::contiguous(x);
  cos = dense(cos);
  sin = dense(sin);
  Tensor y = torch::stable::new_empty(x, {B, T, H, D});
  const int64_t cs_b = cos.dim() == 3 ? T * R : 0;
  fused_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), B, H, T, D, R, x.stride(0), x.stride(1),
             x.stride(2), cs_b, bf16);
  return y;
}

// silu(g) ⊙ u for g, u of one shape.
Tensor fused_silu_mul_op(Tensor g, Tensor u) {
  const int bf16 = bf16_flag("fused_silu_mul", {&g, &u});
  STD_TORCH_CHECK(g.sizes().equals(u.sizes()) && g.dim() >= 1, "fused_silu_mul: g and u of one shape");
  g = dense(g);
  u = dense(u);
  const int64_t n = g.size(g.dim() - 1), rows = n ? g.numel() / n : 0;
  Tensor y = torch::stable::new_empty(g, shape_of(g));
  fused_silu_mul(g.data_ptr(), u.data_ptr(), y.data_ptr(), rows, n, bf16);
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("fused_rms_norm", TORCH_BOX(&fused_rms_norm_op));
  m.impl("fused_rope", TORCH_BOX(&fused_rope_op));
  m.impl("fused_silu_mul", TORCH_BOX(&fused_silu_mul_op));
}

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(fused_rms_norm, fused_rms_norm_op,
               (AtenTensorHandle x, AtenTensorHandle weight, double eps, double offset),
               (x, weight, eps, offset))
DECODERLM_SHIM(fused_rope, fused_rope_op,
               (AtenTensorHandle x, AtenTensorHandle cos, AtenTensorHandle sin),
               (x, cos, sin))
DECODERLM_SHIM(fused_silu_mul, fused_silu_mul_op,
               (AtenTensorHandle g, AtenTensorHandle u),
               (g, u))
