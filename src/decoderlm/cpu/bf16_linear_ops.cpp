// The CPU kernel of the op decoderlm::bf16_linear (schema and fake kernel: bf16_linear.py): the
// product of the kernel it is built with (amx_linear.c or dpbf16_linear.c), registered through
// PyTorch's stable C ABI as gemv_ops.cpp is, so that the engine's compiled decode pass of several
// rows (decoderlm.cpu.paged_step) calls it without Python, its packed weights among the library's
// inputs.
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
int packed_linear_prepare(void);
void packed_linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                        int swiglu);
}

namespace {

// x (..., K) bfloat16 and packed (blocks, K/2, 16, 2) from bf16_linear.pack (or pack_swiglu, with
// swiglu: twice the blocks) → (..., out_features): x Wᵀ, or silu(x W_gateᵀ) ⊙ x W_upᵀ.
Tensor bf16_linear(Tensor x, Tensor packed, int64_t out_features, bool swiglu) {
  static const int granted = packed_linear_prepare();  // AMX: the tile state, once per process
  STD_TORCH_CHECK(granted == 0, "bf16_linear: Linux refused this process the AMX tile state");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16 && packed.scalar_type() == ScalarType::BFloat16 &&
                      packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
                  "bf16_linear: x and packed must be bfloat16, packed (blocks, K/2, 16, 2) contiguous");
  const int64_t K = packed.size(1) * 2, blocks = (out_features + 15) / 16 * (swiglu ? 2 : 1);
  STD_TORCH_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) == K && out_features >= 1 && packed.size(0) == blocks,
                  "bf16_linear: x's last dim must be the packed weight's ", K, " inputs, its blocks ",
                  blocks, " for ", out_features, " outputs");
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  Tensor y = torch::stable::new_empty(x, shape);
  const int64_t M = x.numel() / K;
  if (M > 0)
    packed_linear_bf16(static_cast<const uint16_t *>(x.data_ptr()), static_cast<const uint16_t *>(packed.data_ptr()),
                       static_cast<uint16_t *>(y.data_ptr()), M, out_features, K, swiglu ? 1 : 0);
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) { m.impl("bf16_linear", TORCH_BOX(&bf16_linear)); }

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(bf16_linear, bf16_linear,
               (AtenTensorHandle x, AtenTensorHandle packed, int64_t out_features, int32_t swiglu),
               (x, packed, out_features, swiglu))
