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
void invariant_linear(const void *x, const void *p, void *y, int64_t M, int64_t N, int64_t K, int bf16);
int64_t invariant_panel(void);
}

namespace {

// x Wᵀ: x (..., K), packed (⌈N/P⌉, K, P) = invariant.pack(W) of W (N, K), both float32 or both
// bfloat16 → (..., N).
Tensor invariant_linear_op(Tensor x, Tensor packed, int64_t out_features) {
  const ScalarType dtype = x.scalar_type();
  STD_TORCH_CHECK((dtype == ScalarType::Float || dtype == ScalarType::BFloat16) && packed.scalar_type() == dtype,
                  "invariant_linear: x and packed both float32 or both bfloat16");
  STD_TORCH_CHECK(x.dim() >= 1 && packed.dim() == 3 && x.size(x.dim() - 1) == packed.size(1),
                  "invariant_linear: x must have the packed weight's ", packed.size(1), " inputs");
  STD_TORCH_CHECK(packed.size(2) == invariant_panel() && out_features > (packed.size(0) - 1) * packed.size(2) &&
                      out_features <= packed.size(0) * packed.size(2),
                  "invariant_linear: packed is not invariant.pack of a weight of ", out_features, " outputs");
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  if (!packed.is_contiguous()) packed = torch::stable::contiguous(packed);
  const int64_t K = packed.size(1), M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  Tensor y = torch::stable::new_empty(x, shape);
  if (M) invariant_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), M, out_features, K, dtype == ScalarType::BFloat16);
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) { m.impl("invariant_linear", TORCH_BOX(&invariant_linear_op)); }

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(invariant_linear, invariant_linear_op,
               (AtenTensorHandle x, AtenTensorHandle packed, int64_t out_features),
               (x, packed, out_features))
