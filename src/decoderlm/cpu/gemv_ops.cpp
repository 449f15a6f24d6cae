// The CPU kernels of the ops decoderlm::gemv and decoderlm::gemv_int8 (schemas and fake kernels:
// gemv.py), registered through PyTorch's stable C ABI, so that a library compiled ahead of time
// (the AOTInductor decode step) calls them without Python and the build needs only torch's
// header-only API: a few seconds to compile.
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
void gemv_f32(const float *x, const float *W, float *y, int64_t N, int64_t K);
void gemv_bf16(const uint16_t *x, const uint16_t *W, uint16_t *y, int64_t N, int64_t K);
void gemv_f32_bf16(const float *x, const uint16_t *W, float *y, int64_t N, int64_t K);
void gemv_int8_f32(const float *x, const int8_t *W, const float *s, float *y, int64_t N, int64_t K);
int gemv_int8_bf16(const uint16_t *x, const int8_t *W, const float *s, uint16_t *y, int64_t N, int64_t K);
}

namespace {

// y (..., N) for x (..., K) of one row in all and weight (N, K); x and weight made contiguous.
Tensor one_row_output(Tensor &x, Tensor &weight) {
  STD_TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.numel() == weight.size(1) &&
                      x.size(x.dim() - 1) == weight.size(1),
                  "gemv: x must be one row of weight's ", weight.size(weight.dim() - 1), " inputs");
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  if (!weight.is_contiguous()) weight = torch::stable::contiguous(weight);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return torch::stable::new_empty(x, shape);
}

Tensor gemv(Tensor x, Tensor weight) {
  Tensor y = one_row_output(x, weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const ScalarType dtype = x.scalar_type();
  if (dtype == ScalarType::Float && weight.scalar_type() == ScalarType::BFloat16) {
    gemv_f32_bf16(static_cast<const float *>(x.data_ptr()), static_cast<const uint16_t *>(weight.data_ptr()),
                  static_cast<float *>(y.data_ptr()), N, K);
    return y;
  }
  STD_TORCH_CHECK(weight.scalar_type() == dtype, "gemv: x and weight differ in dtype");
  if (dtype == ScalarType::Float) {
    gemv_f32(static_cast<const float *>(x.data_ptr()), static_cast<const float *>(weight.data_ptr()),
             static_cast<float *>(y.data_ptr()), N, K);
#ifdef __AVX512BF16__
  } else if (dtype == ScalarType::BFloat16) {
    gemv_bf16(static_cast<const uint16_t *>(x.data_ptr()), static_cast<const uint16_t *>(weight.data_ptr()),
              static_cast<uint16_t *>(y.data_ptr()), N, K);
#endif
  } else {
    STD_TORCH_CHECK(false, "gemv: no kernel for this dtype on this CPU");
  }
  return y;
}

Tensor gemv_int8(Tensor x, Tensor weight_q, Tensor scale) {
  Tensor y = one_row_output(x, weight_q);
  const int64_t N = weight_q.size(0), K = weight_q.size(1);
  STD_TORCH_CHECK(weight_q.scalar_type() == ScalarType::Char && scale.scalar_type() == ScalarType::Float &&
                      scale.is_contiguous() && scale.numel() == N,
                  "gemv_int8: weight_q must be int8 (N, K) and scale float32 (N,)");
  const auto *w = static_cast<const int8_t *>(weight_q.data_ptr());
  const auto *s = static_cast<const float *>(scale.data_ptr());
  if (x.scalar_type() == ScalarType::Float) {
    gemv_int8_f32(static_cast<const float *>(x.data_ptr()), w, s, static_cast<float *>(y.data_ptr()), N, K);
  } else if (x.scalar_type() == ScalarType::BFloat16) {
    const int status = gemv_int8_bf16(static_cast<const uint16_t *>(x.data_ptr()), w, s,
                                      static_cast<uint16_t *>(y.data_ptr()), N, K);
    STD_TORCH_CHECK(status == 0, "gemv_int8: no memory for the float32 copy of x");
  } else {
    STD_TORCH_CHECK(false, "gemv_int8: x must be float32 or bfloat16");
  }
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("gemv", TORCH_BOX(&gemv));
  m.impl("gemv_int8", TORCH_BOX(&gemv_int8));
}

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(gemv, gemv,
               (AtenTensorHandle x, AtenTensorHandle weight),
               (x, weight))
DECODERLM_SHIM(gemv_int8, gemv_int8,
               (AtenTensorHandle x, AtenTensorHandle weight_q, AtenTensorHandle scale),
               (x, weight_q, scale))
