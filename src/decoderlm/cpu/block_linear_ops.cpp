// The CPU kernels of the ops decoderlm::block_linear, decoderlm::block_dequantize and
// decoderlm::int_linear (schemas and fake kernels: block_linear.py), registered through PyTorch's stable C ABI as gemv_ops.cpp, so
// that the compiled decode step calls them without Python. `variant` picks the build of
// block_linear.c: 0 portable, 1 AVX2, 2 native (the CPU's best; block_linear.py asks each
// build's block_linear_isa_* what it runs on).
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

#define VARIANT_DECLARATIONS(V)                                                                          \
  int block_linear_##V(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N,    \
                       int64_t K, void *y);                                                            \
  void block_dequantize_##V(int type, const uint8_t *W, int64_t n0, int64_t rows, int64_t K, void *out, \
                            int out_bf16);                                                             \
  int int_linear_##V(int bits, const void *x, int x_bf16, int64_t M, const uint8_t *W, const float *scale,  \
                     const float *offset, int64_t G, int64_t N, int64_t K, void *y);                 \
  int block_panels_##V(int type, const float *x, int64_t M, const uint8_t *W, int64_t N, int64_t K, float *y); \
  int block_tiles_##V(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K, \
                      void *y);                                                                          \
  int block_strips_##V(int type, const void *x, int x_bf16, int64_t M, const uint8_t *W, int64_t N, int64_t K, \
                       void *y);                                                                         \
  int block_linear_isa_##V(void);

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
using IntLinearFn = int (*)(int, const void *, int, int64_t, const uint8_t *, const float *, const float *, int64_t,
                            int64_t, int64_t, void *);
const IntLinearFn INT_LINEAR[] = {int_linear_portable, int_linear_avx2, int_linear_native};
using PanelsFn = int (*)(int, const float *, int64_t, const uint8_t *, int64_t, int64_t, float *);
const PanelsFn PANELS[] = {block_panels_portable, block_panels_avx2, block_panels_native};
const LinearFn TILES[] = {block_tiles_portable, block_tiles_avx2, block_tiles_native};
const LinearFn STRIPS[] = {block_strips_portable, block_strips_avx2, block_strips_native};
using IsaFn = int (*)();
const IsaFn ISA[] = {block_linear_isa_portable, block_linear_isa_avx2, block_linear_isa_native};

// (weights per block, bytes per block) of each type, in the order of quant/blocks.py's BLOCK_TYPES.
const int64_t BLOCK_WEIGHTS[] = {1, 1, 32, 32, 32, 32, 32};
const int64_t BLOCK_BYTES[] = {2, 2, 34, 18, 20, 22, 24};

// y (..., N) in x's dtype for x (..., K) float32 or bfloat16; x made contiguous.
Tensor output_for(Tensor &x, int64_t N) {
  STD_TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == ScalarType::Float || x.scalar_type() == ScalarType::BFloat16),
                  "block_linear: x must be float32 or bfloat16 (..., K)");
  if (!x.is_contiguous()) x = torch::stable::contiguous(x);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return torch::stable::new_empty(x, shape);
}

// Checks the type, the variant and that `blocks` is uint8 (N, row bytes of k weights); contiguous.
Tensor checked_blocks(Tensor blocks, int64_t type, int64_t k, int64_t variant) {
  STD_TORCH_CHECK(type >= 0 && type < 7 && variant >= 0 && variant < 3, "block_linear: no such type or variant");
  STD_TORCH_CHECK(k > 0 && k % BLOCK_WEIGHTS[type] == 0, "block_linear: ", k, " inputs are not whole blocks");
  STD_TORCH_CHECK(blocks.scalar_type() == ScalarType::Byte && blocks.dim() == 2 &&
                      blocks.size(1) == k / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type],
                  "block_linear: blocks must be uint8 (N, ", k / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type], ")");
  return blocks.is_contiguous() ? blocks : torch::stable::contiguous(blocks);
}

constexpr int64_t CHUNK_WEIGHTS = int64_t{1} << 22;  // weights dequantized at a time (quant/blocks.py)
constexpr int64_t MAX_ROWS = 16, MAX_TILE_KERNEL_ROWS = 8, MAX_PANEL_ROWS = 256;  // block_linear.py's
enum class Path { kernel, strips, tiles, panels, gemm, widened };

// Where a product of M rows runs (block_linear.py's docstring says why; its `on_panels` tells its
// callers): the block kernel up to MAX_ROWS rows (MAX_TILE_KERNEL_ROWS where the build has integer
// panels); then a quantized type's integer panels on AVX-512 VNNI (block_tiles), float32 of any
// number of rows, bfloat16 up to MAX_PANEL_ROWS; else float32 up to MAX_PANEL_ROWS on dequantized
// panels (block_panels); else `gemm`. Without AVX-512 a CPU has no bfloat16 arithmetic, and
// PyTorch's bfloat16 GEMM emulates it (slower than float32's, its sums rounded more): there
// bfloat16 rows are `widened` to float32, take the float32 route and are rounded once, as
// quant/blocks.py's BlockLinear.matmul does. `invariant`: a row's bits the same at every M, so
// never the dequantized panels or a GEMM, whose sums differ from the kernel's: a quantized type,
// on AVX-512 VNNI or AVX2, on the strips (the integer tiles' arithmetic on a few rows) up to
// MAX_TILE_KERNEL_ROWS and the tiles beyond, of either dtype; else the kernel at every M.
Path path(int64_t type, int64_t variant, int64_t M, bool bf16, bool invariant) {
  const bool quantized = type >= 2, tiles = ISA[variant]() == 2 && quantized;  // tiles: AVX-512 VNNI
  if (invariant)
    return !(quantized && ISA[variant]() >= 1) ? Path::kernel
           : M <= MAX_TILE_KERNEL_ROWS         ? Path::strips
                                               : Path::tiles;
  if (M <= (tiles ? MAX_TILE_KERNEL_ROWS : MAX_ROWS)) return Path::kernel;
  if (tiles && (!bf16 || M <= MAX_PANEL_ROWS)) return Path::tiles;
  if (bf16 && ISA[variant]() < 2) return Path::widened;
  return !bf16 && M <= MAX_PANEL_ROWS ? Path::panels : Path::gemm;
}

// y (M, N) = x (M, K) Ŵᵀ by aten::matmul on Ŵ dequantized CHUNK_WEIGHTS at a time, in x's dtype.
void gemm(Tensor x, Tensor blocks, int64_t type, int64_t variant, Tensor y) {
  const int64_t K = x.size(1), N = blocks.size(0), rows = std::max<int64_t>(1, CHUNK_WEIGHTS / K);
  const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
  for (int64_t start = 0; start < N; start += rows) {
    const int64_t count = std::min(rows, N - start);
    std::vector<int64_t> shape = {count, K};
    Tensor w = torch::stable::new_empty(x, shape);
    DEQUANTIZE[variant](static_cast<int>(type), static_cast<const uint8_t *>(blocks.data_ptr()), start, count, K,
                        w.data_ptr(), bf16 ? 1 : 0);
    Tensor part = torch::stable::matmul(x, torch::stable::transpose(w, 0, 1));  // (M, count)
    Tensor columns = torch::stable::narrow(y, 1, start, count);
    torch::stable::copy_(columns, part);
  }
}

Tensor block_linear(Tensor x, Tensor blocks, int64_t type, int64_t variant, bool invariant) {
  const int64_t K = x.dim() ? x.size(x.dim() - 1) : 0, M = K ? x.numel() / K : 0;
  blocks = checked_blocks(blocks, type, K, variant);
  Tensor y = output_for(x, blocks.size(0));
  if (M == 0 || blocks.size(0) == 0) return y;
  const int bf16 = x.scalar_type() == ScalarType::BFloat16;
  const auto *W = static_cast<const uint8_t *>(blocks.data_ptr());
  const Path chosen = path(type, variant, M, bf16, invariant);
  switch (chosen) {
    case Path::kernel:
    case Path::strips:
    case Path::tiles: {  // the quantized activations (and a tile's panels) in buffers of their own
      const LinearFn *fn = chosen == Path::kernel ? LINEAR : chosen == Path::strips ? STRIPS : TILES;
      STD_TORCH_CHECK(fn[variant](static_cast<int>(type), x.data_ptr(), bf16, M, W, blocks.size(0), K,
                                  y.data_ptr()) == 0,
                      "block_linear: no memory for the ",
                      chosen == Path::tiles ? "integer panels" : "quantized activations");
      break;
    }
    case Path::panels:
      STD_TORCH_CHECK(PANELS[variant](static_cast<int>(type), static_cast<const float *>(x.data_ptr()), M, W,
                                      blocks.size(0), K, static_cast<float *>(y.data_ptr())) == 0,
                      "block_linear: no memory for the dequantized panels");
      break;
    case Path::gemm: {
      std::vector<int64_t> rows_x = {M, K}, rows_y = {M, blocks.size(0)};
      gemm(torch::stable::view(x, rows_x), blocks, type, variant, torch::stable::view(y, rows_y));
      break;
    }
    case Path::widened: {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      Tensor wide = torch::stable::new_empty(x, shape, ScalarType::Float);
      torch::stable::copy_(wide, x);
      torch::stable::copy_(y, block_linear(wide, blocks, type, variant, false));
    }
  }
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

// x (..., K) · Ŵᵀ for Int8Linear (bits 8: weight_q int8 (N, K), scale (N,)) or Int4Linear (bits 4:
// weight_q uint8 (N, K/2), scale and offset float32 (N, K/group)).
Tensor int_linear(Tensor x, Tensor weight_q, Tensor scale, std::optional<Tensor> offset, int64_t bits, int64_t group,
                  int64_t variant) {
  const int64_t K = x.dim() ? x.size(x.dim() - 1) : 0, M = K ? x.numel() / K : 0, N = weight_q.size(0);
  const bool four = bits == 4;
  STD_TORCH_CHECK((bits == 8 || four) && variant >= 0 && variant < 3, "int_linear: bits 8 or 4, variant 0-2");
  STD_TORCH_CHECK(group > 0 && K % group == 0 && (!four || group % 32 == 0), "int_linear: bad group size ", group);
  STD_TORCH_CHECK(weight_q.dim() == 2 && weight_q.size(1) == (four ? K / 2 : K) &&
                      weight_q.scalar_type() == (four ? ScalarType::Byte : ScalarType::Char) && weight_q.is_contiguous(),
                  "int_linear: weight_q must be contiguous ", four ? "uint8 (N, K/2)" : "int8 (N, K)");
  const int64_t groups = K / group;
  STD_TORCH_CHECK(scale.scalar_type() == ScalarType::Float && scale.is_contiguous() && scale.numel() == N * groups,
                  "int_linear: scale must be float32 (N, K/group)");
  STD_TORCH_CHECK(four == offset.has_value(), "int_linear: int4 takes an offset, int8 none");
  if (four)
    STD_TORCH_CHECK(offset->scalar_type() == ScalarType::Float && offset->is_contiguous() &&
                        offset->numel() == N * groups,
                    "int_linear: offset must be float32 (N, K/group)");
  Tensor y = output_for(x, N);
  if (M == 0 || N == 0) return y;
  const int status = INT_LINEAR[variant](
      static_cast<int>(bits), x.data_ptr(), x.scalar_type() == ScalarType::BFloat16, M,
      static_cast<const uint8_t *>(weight_q.data_ptr()), static_cast<const float *>(scale.data_ptr()),
      four ? static_cast<const float *>(offset->data_ptr()) : nullptr, group, N, K, y.data_ptr());
  STD_TORCH_CHECK(status == 0, "int_linear: no memory for the widened activations");
  return y;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("block_linear", TORCH_BOX(&block_linear));
  m.impl("block_dequantize", TORCH_BOX(&block_dequantize));
  m.impl("int_linear", TORCH_BOX(&int_linear));
}

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(block_linear, block_linear,
               (AtenTensorHandle x, AtenTensorHandle blocks, int64_t ggml_type, int64_t variant, int32_t invariant),
               (x, blocks, ggml_type, variant, invariant))
DECODERLM_SHIM(block_dequantize, block_dequantize,
               (AtenTensorHandle blocks, int64_t ggml_type, int64_t k, int64_t start, int64_t rows, int32_t bf16,
                int64_t variant),
               (blocks, ggml_type, k, start, rows, bf16, variant))
DECODERLM_SHIM(int_linear, int_linear,
               (AtenTensorHandle x, AtenTensorHandle weight_q, AtenTensorHandle scale, AtenTensorHandle *offset,
                int64_t bits, int64_t group, int64_t variant),
               (x, weight_q, scale, offset, bits, group, variant))
