// The CPU kernels of the ops decoderlm::block_linear and decoderlm::block_dequantize (schemas and
// fake kernels: block_linear.py), registered through PyTorch's stable C ABI as gemv_ops.cpp, so
// that the compiled decode step calls them without Python. `variant` picks the build of
// block_linear.c: 0 portable, 1 AVX2, 2 native (the CPU's best; block_linear.py asks each
// build's block_linear_isa_* what it runs on).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

#define VARIANT_DECLARATIONS(V)                                                                          \
  int block_linear_##V(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N,    \
                       int64_t K, void *y);                                                            \
  void block_dequantize_##V(int type, const uint8_t *W, int64_t n0, int64_t rows, int64_t K, void *out, \
                            int out_bf16);

extern "C" {
VARIANT_DECLARATIONS(portable)
VARIANT_DECLARATIONS(avx2)
VARIANT_DECLARATIONS(native)
}

namespace {

using LinearFn = int (*)(int, const void *, int, int64_t, const uint8_t *, int64_t, int64_t, void *);
using DequantizeFn = void (*)(int, const uint8_t *, int64_t, int64_t, int64_t, void *, int);
const LinearFn LINEAR[] = {block_linear_portable, block_linear_avx2, block_linear_native};
const DequantizeFn DEQUANTIZE[] = {block_dequantize_portable, block_dequantize_avx2, block_dequantize_native};

// (weights per block, bytes per block) of each type, in the order of quant/blocks.py's BLOCK_TYPES.
const int64_t BLOCK_WEIGHTS[] = {1, 1, 32, 32, 32, 32, 32};
const int64_t BLOCK_BYTES[] = {2, 2, 34, 18, 20, 22, 24};

// Checks the type, the variant and that `blocks` is uint8 (N, row bytes of k weights); contiguous.
Tensor checked_blocks(Tensor blocks, int64_t type, int64_t k, int64_t variant) {
  STD_TORCH_CHECK(type >= 0 && type < 7 && variant >= 0 && variant < 3, "block_linear: no such type or variant");
  STD_TORCH_CHECK(k > 0 && k % BLOCK_WEIGHTS[type] == 0, "block_linear: ", k, " inputs are not whole blocks");
  STD_TORCH_CHECK(blocks.scalar_type() == ScalarType::Byte && blocks.dim() == 2 &&
                      blocks.size(1) == k / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type],
                  "block_linear: blocks must be uint8 (N, ", k / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type], ")");
  return blocks.is_contiguous() ? blocks : torch::stable::contiguous(blocks);
}

Tensor block_linear(Tensor x, Tensor blocks, int64_t type, int64_t variant) {
  STD_TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == ScalarType::Float || x.scalar_type() == ScalarType::BFloat16),
                  "block_linear: x must be float32 or bfloat16 (..., K)");
  const int64_t K = x.size(x.dim() - 1), M = K ? x.numel() / K : 0;
  blocks = checked_blocks(blocks, type, K, variant);
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = blocks.size(0);
  Tensor y = torch::stable::new_empty(x, shape);
  if (M == 0 || blocks.size(0) == 0) return y;
  const int bf16 = x.scalar_type() == ScalarType::BFloat16;
  const int status = LINEAR[variant](static_cast<int>(type), x.data_ptr(), bf16, M,
                                     static_cast<const uint8_t *>(blocks.data_ptr()), blocks.size(0), K, y.data_ptr());
  STD_TORCH_CHECK(status == 0, "block_linear: no memory for the quantized activations");
  return y;
}

// Rows [start, start + rows) of the weight (N, k) in float32, or bfloat16 where `bf16`.
Tensor block_dequantize(Tensor blocks, int64_t type, int64_t k, int64_t start, int64_t rows, bool bf16,
                        int64_t variant) {
  blocks = checked_blocks(blocks, type, k, variant);
  STD_TORCH_CHECK(start >= 0 && rows >= 0 && start + rows <= blocks.size(0), "block_dequantize: rows out of range");
  std::vector<int64_t> shape = {rows, k};
  Tensor out = torch::stable::new_empty(blocks, shape, bf16 ? ScalarType::BFloat16 : ScalarType::Float);
  if (rows > 0)
    DEQUANTIZE[variant](static_cast<int>(type), static_cast<const uint8_t *>(blocks.data_ptr()), start, rows, k,
                        out.data_ptr(), bf16 ? 1 : 0);
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("block_linear", TORCH_BOX(&block_linear));
  m.impl("block_dequantize", TORCH_BOX(&block_dequantize));
}
