// The CPU kernels of the ops decoderlm::static_decode_attention and decoderlm::paged_decode_attention
// (schemas and fake kernels: paged_attention.py): decode attention read in place from the static
// cache (B, Hkv, S, D) of the compiled one-token step, or from the paged pools
// (num_blocks, block_size, Hkv, D) of the engine's compiled decode pass, by the kernel of
// paged_attention.c. Registered through PyTorch's stable C ABI, as gemv_ops.cpp, so that an
// AOTInductor library calls them without Python.
#include "aoti_shim.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

extern "C" {
int decode_attention_f32(const float *q, const float *k, const float *v, const int64_t *table,
                         const int64_t *first, const int64_t *lengths, float *out, int64_t B,
                         int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t W,
                         int64_t block_stride, int64_t head_stride, int64_t token_stride, float scale);
int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                          const int64_t *first, const int64_t *lengths, uint16_t *out, int64_t B,
                          int64_t H, int64_t Hkv, int64_t D, int64_t block_size, int64_t W,
                          int64_t block_stride, int64_t head_stride, int64_t token_stride, float scale);
}

namespace {

// softmax(q Kᵀ · scale) V for q (B, H, 1, D) over keys first[b] .. last[0] of k, v (B, Hkv, S, D).
Tensor static_decode_attention(Tensor q, Tensor k, Tensor v, Tensor first, Tensor last, double scale) {
  STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "static_decode_attention: ",
                  "q must be (B, H, 1, D) and k, v (B, Hkv, S, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  STD_TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0 && v.sizes().equals(k.sizes()) &&
                      k.is_contiguous() && v.is_contiguous(),
                  "static_decode_attention: k and v must be contiguous (B, Hkv, S, D) with H % Hkv == 0");
  const ScalarType dtype = q.scalar_type();
  STD_TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "static_decode_attention: dtypes differ");
  STD_TORCH_CHECK(first.scalar_type() == ScalarType::Long && first.numel() == B && first.is_contiguous() &&
                      last.scalar_type() == ScalarType::Long && last.numel() == 1,
                  "static_decode_attention: first must be (B,) and last (1,) int64");
  const auto *starts = static_cast<const int64_t *>(first.data_ptr());
  const int64_t end = *static_cast<const int64_t *>(last.data_ptr()) + 1;
  STD_TORCH_CHECK(end >= 1 && end <= S, "static_decode_attention: last slot outside the cache's ", S);
  for (int64_t b = 0; b < B; b++)  // the C kernel trusts its indices
    STD_TORCH_CHECK(starts[b] >= 0 && starts[b] < end, "static_decode_attention: row ", b, "'s first slot ",
                    starts[b], " is not in 0..", end - 1);
  if (!q.is_contiguous()) q = torch::stable::contiguous(q);
  Tensor out = torch::stable::new_empty(q, {B, H, 1, D});
  const std::vector<int64_t> lengths(B, end);
  int status = -3;
  if (dtype == ScalarType::Float) {
    status = decode_attention_f32(static_cast<const float *>(q.data_ptr()), static_cast<const float *>(k.data_ptr()),
                                  static_cast<const float *>(v.data_ptr()), nullptr, starts, lengths.data(),
                                  static_cast<float *>(out.data_ptr()), B, H, Hkv, D, S, 1, Hkv * S * D, S * D, D,
                                  static_cast<float>(scale));
  } else if (dtype == ScalarType::BFloat16) {
    status = decode_attention_bf16(
        static_cast<const uint16_t *>(q.data_ptr()), static_cast<const uint16_t *>(k.data_ptr()),
        static_cast<const uint16_t *>(v.data_ptr()), nullptr, starts, lengths.data(),
        static_cast<uint16_t *>(out.data_ptr()), B, H, Hkv, D, S, 1, Hkv * S * D, S * D, D, static_cast<float>(scale));
  }
  STD_TORCH_CHECK(status != -3, "static_decode_attention: float32 or bfloat16 only");
  STD_TORCH_CHECK(status != -2, "static_decode_attention: head_dim ", D, " > 512, the kernel's largest");
  STD_TORCH_CHECK(status == 0, "static_decode_attention: no memory for the scores");
  return out;
}

// softmax(q Kᵀ · scale) V for q (B, H, 1, D) over each row's first lengths[b] keys of the pools
// k, v (num_blocks, block_size, Hkv, D), in the blocks table[b, 0], table[b, 1], ...
Tensor paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor lengths, double scale) {
  STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && table.dim() == 2,
                  "paged_decode_attention: q must be (B, H, 1, D), k, v (num_blocks, block_size, Hkv, D), "
                  "table (B, W)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t num_blocks = k.size(0), block_size = k.size(1), Hkv = k.size(2), W = table.size(1);
  STD_TORCH_CHECK(k.size(3) == D && H % Hkv == 0 && v.sizes().equals(k.sizes()) && k.is_contiguous() &&
                      v.is_contiguous(),
                  "paged_decode_attention: k and v must be contiguous (num_blocks, block_size, Hkv, D), H % Hkv == 0");
  const ScalarType dtype = q.scalar_type();
  STD_TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "paged_decode_attention: dtypes differ");
  STD_TORCH_CHECK(table.scalar_type() == ScalarType::Long && table.size(0) == B && table.is_contiguous() &&
                      lengths.scalar_type() == ScalarType::Long && lengths.numel() == B && lengths.is_contiguous(),
                  "paged_decode_attention: table must be (B, W) and lengths (B,) contiguous int64");
  const auto *blocks = static_cast<const int64_t *>(table.data_ptr());
  const auto *lens = static_cast<const int64_t *>(lengths.data_ptr());
  for (int64_t b = 0; b < B; b++) {  // the C kernel trusts its indices
    STD_TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "paged_decode_attention: row ", b, "'s length ",
                    lens[b], " is not in 1..", W * block_size);
    for (int64_t j = 0; j * block_size < lens[b]; j++)
      STD_TORCH_CHECK(blocks[b * W + j] >= 0 && blocks[b * W + j] < num_blocks, "paged_decode_attention: row ",
                      b, "'s block ", blocks[b * W + j], " is outside the pool's ", num_blocks);
  }
  if (!q.is_contiguous()) q = torch::stable::contiguous(q);
  Tensor out = torch::stable::new_empty(q, {B, H, 1, D});
  const int64_t block_stride = block_size * Hkv * D, head_stride = D, token_stride = Hkv * D;
  int status = -3;
  if (dtype == ScalarType::Float) {
    status = decode_attention_f32(static_cast<const float *>(q.data_ptr()), static_cast<const float *>(k.data_ptr()),
                                  static_cast<const float *>(v.data_ptr()), blocks, nullptr, lens,
                                  static_cast<float *>(out.data_ptr()), B, H, Hkv, D, block_size, W, block_stride,
                                  head_stride, token_stride, static_cast<float>(scale));
  } else if (dtype == ScalarType::BFloat16) {
    status = decode_attention_bf16(
        static_cast<const uint16_t *>(q.data_ptr()), static_cast<const uint16_t *>(k.data_ptr()),
        static_cast<const uint16_t *>(v.data_ptr()), blocks, nullptr, lens, static_cast<uint16_t *>(out.data_ptr()),
        B, H, Hkv, D, block_size, W, block_stride, head_stride, token_stride, static_cast<float>(scale));
  }
  STD_TORCH_CHECK(status != -3, "paged_decode_attention: float32 or bfloat16 only");
  STD_TORCH_CHECK(status != -2, "paged_decode_attention: head_dim ", D, " > 512, the kernel's largest");
  STD_TORCH_CHECK(status == 0, "paged_decode_attention: no memory for the scores");
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(decoderlm, CPU, m) {
  m.impl("static_decode_attention", TORCH_BOX(&static_decode_attention));
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
}

// Called directly by the compiled decode passes (aoti_shim.h).
DECODERLM_SHIM(static_decode_attention, static_decode_attention,
               (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle first, AtenTensorHandle
                last, double scale),
               (q, k, v, first, last, scale))
DECODERLM_SHIM(paged_decode_attention, paged_decode_attention,
               (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle table, AtenTensorHandle
                lengths, double scale),
               (q, k, v, table, lengths, scale))
