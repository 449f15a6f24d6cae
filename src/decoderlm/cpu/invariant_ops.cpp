// The CPU kernel of the op decoderlm::invariant_linear (schema and fake kernel: invariant.py):
// invariant.c's fixed-order product, registered through PyTorch's stable C ABI, as gemv_ops.cpp,
// so that a library compiled ahead of time (the engine's batch-invariant decode pass) calls the
// very code the eager passes call through ctypes.
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
void invariant_linear(const void *x, const void *w, void *y, int64_t M, int64_t N, int64_t K, int bf16);
}

namespace {

// x Wᵀ: x (..., K), weight (N, K), both float32 or both bfloat16 → (..., N).
Tensor invariant_linear_op(Tensor x, Tensor weight) {
  const ScalarType dtype = x.scalar_type();
  STD_TORCH_CHECK((dtype == ScalarType::Float || dtype == ScalarType::BFloat16) && weight.scalar_type() == dtype,
                  "invariant_linear: x and weight both float32 or both bfloat16");
  STD_TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(x.dim() - 1) == weight.size(1),
                  "invariant_linear: x must have weight's ", weight.size(weight.dim() - 1), " inputs");
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  if (!weight.is_contiguous()) weight = torch::stable::contiguous(weight);
  const int64_t N = weight.size(0), K = weight.size(1), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  Tensor y = torch::stable::new_empty(x, shape);
  if (M) invariant_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K, dtype == ScalarType::BFloat16);
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) { m.impl("invariant_linear", TORCH_BOX(&invariant_linear_op)); }

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(invariant_linear, invariant_linear_op,
               (AtenTensorHandle x, AtenTensorHandle weight),
               (x, weight))
