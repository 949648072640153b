// Weight-only quantized matmul on CPU: y = x W^T + b with W in 4-, 5-, 6- or 8-bit codes, one
// numerics for every row whatever else shares the call (decode, verification and prefill alike).
//
// Weights: per output row n, groups g of G = 32 inputs share a scale d and an offset m, and
// w = d q + m with q the code (the affine form of GGUF's Q4_0/Q4_1/Q4_K/Q5_x/Q8_0 blocks).
// Activations: each row quantized per group to int8 (llama.cpp's Q8 activations):
// x ~= dx p with dx = max|x| / 127, p = round(x / dx), and sx = dx sum(p). Then
//     y[r, n] = sum_g  d dx D + m sx,   D = sum_{i in g} q_i p_i  (an exact int32),
// and every output element is evaluated in exactly this order, in float32:
//     acc = 0;  for g in order:  acc = fma(float(D), d * dx, acc);  acc = fma(m, sx, acc)
//     y = acc (+ b)
// Q6_K has a scale s per 16 inputs and w = s (q - 32): each half h of a group takes
//     acc = fma(float(D_h - 32 S_h), s_h * dx, acc),   S_h = sum_{i in h} p_i
// (D_h - 32 S_h an exact integer). The integers are exact on every instruction set (VNNI's
// u8 x s8 dot product, or AVX2's maddubs + madd: codes up to 6 bits keep the i16 sums below
// 2^15, 8-bit codes are split in two nibbles; simd.h dot_chunks), and the float steps are the
// same instructions, so a row's result does not depend on how many rows share the call, how they are tiled,
// which thread runs them, or which of the three paths built it.
//
// Layout (built by engine/models/quantized.py `_pack_tandem`): output rows in tiles of 16 (N padded
// with zero rows), inputs in groups of 32 (K padded with zero groups). One tile's group is a unit
// of 64-byte chunks: chunk c (inputs 4c..4c+3) holds row j's four codes in bytes 4j..4j+3, so one
// VNNI instruction against the activation's four bytes broadcast gives all 16 rows' partial sums,
// and eight of them the group's D for the whole tile, with no horizontal sums. 8 bits: 8 chunks
// (512 bytes); 4 bits: 4 chunks (256 bytes), chunk c in the low nibbles and chunk c + 4 in the high
// ones; 5 and 6 bits (Q5_x, Q6_K): the low 4 bits so, then the higher bits byte-sliced in 64-byte
// vectors (one for 5 bits, two for 6): byte b of vector c / 8 (6 bits: c / 4) holds chunk c's byte
// b's higher bits at bit c % 8 (6 bits: bits 2 (c % 4) and 2 (c % 4) + 1), so one shift and one
// mask put them in place (quant_layout.h high_bits; the codes are the same integers however they
// are stored, so D is too). d, m: see Params (quant_matmul.h): float32 or float16 tables (float16
// where every value is exact in it: the file's own for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the centered
// Q4_0, Q5_0 and Q8_0, whose m is -2^(bits - 1) d, hold d alone and m is formed from it), or a
// K-quant's super-blocks as its file holds them, float16 d per 256 inputs and 6-bit (Q6_K: int8)
// sub-scales, the kernel forming float(d) * float(sub-scale) as it reads them, a product exact in
// float32. Every form gives the same float32 d and m that a float32 table of them would, so the
// choice never changes a result. 256-bit paths take a tile as two halves of 8 rows (the first 32
// bytes of each chunk, then the last 32). A call of more than 8 rows (prefill, verification) widens
// a 5- or 6-bit tile's codes to bytes once, into the 8-bit unit's layout, and every block of 8 rows
// reads those: the unpacking is paid once per tile, not once per block of rows. The AVX2
// build takes such calls (4- to 6-bit codes) through quant_rows.h: both halves at once.
#include "quant_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "model_ends.h"
#include "quant_layout.h"
#include "quant_rows.h"
#include "quant_tiles.h"
#include "simd.h"

namespace tandem {
namespace {

using namespace layout;

constexpr int64_t kMaxRowTile = 8;  // activation rows that share a tile's unpacked codes
// Calls of this many rows or more widen a tile for the paired halves where built (fewer: the
// widening and the parameters' expansion per tile cost more than they save; Zen 3).
constexpr int64_t kPairedMinRows = 32;

#if TANDEM_HAVE_KERNEL
// One group of 32 floats (n of them real, the rest zero) -> 32 int8 codes p, dx, dx * sum(p),
// and -32 times the sums of p over each half (Q6_K's offset terms). Round half to even (the
// default MXCSR mode), as torch.round in the Python reference.
inline void quantize_group(const float* x, int n, int8_t* p, float* dx, float* sx,
                           int32_t* halves) {
  alignas(32) float buf[G];
  for (int i = 0; i < G; ++i) buf[i] = i < n ? x[i] : 0.0f;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_load_ps(buf + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i q[4];
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
    total = _mm256_add_epi32(total, q[j]);
  }
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute undoes it
  __m256i q01 = _mm256_packs_epi32(q[0], q[1]);
  __m256i q23 = _mm256_packs_epi32(q[2], q[3]);
  __m256i bytes = _mm256_packs_epi16(q01, q23);
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bytes);
  *dx = d;
  *sx = d * static_cast<float>(hsum_i32(total));
  halves[0] = -32 * hsum_i32(_mm256_add_epi32(q[0], q[1]));
  halves[1] = -32 * hsum_i32(_mm256_add_epi32(q[2], q[3]));
}

// Rows [r0, r1) against one tile, kMaxRowTile at a time.
template <int BITS, typename S, bool WIDE>
void tile_rows(const uint8_t* codes, const uint8_t* d, const uint8_t* m, const Activations& a,
               int64_t r0, int64_t r1, float* out, int64_t ldy, int64_t width,
               const float* bias) {
  int64_t r = r0;
  for (; r + kMaxRowTile <= r1; r += kMaxRowTile) {
    tile<BITS, kMaxRowTile, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias);
  }
  switch (r1 - r) {
    case 7: tile<BITS, 7, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 6: tile<BITS, 6, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 5: tile<BITS, 5, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 4: tile<BITS, 4, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 3: tile<BITS, 3, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 2: tile<BITS, 2, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    case 1: tile<BITS, 1, S, WIDE>(codes, d, m, a, r, out, ldy, width, bias); break;
    default: break;
  }
}

#if TANDEM_PAIRED_HALVES
// Rows [0, num_rows) against one tile through tile_paired (quant_rows.h), kPairedRows at a time.
template <int BITS, typename S, bool WIDE>
void paired_rows(const uint8_t* codes, const uint8_t* d, const uint8_t* m, const float* expanded,
                 const Activations& a, int64_t num_rows, float* out, int64_t ldy, int64_t width,
                 const float* bias) {
  int64_t r = 0;
  for (; r + kPairedRows <= num_rows; r += kPairedRows) {
    tile_paired<BITS, kPairedRows, S, WIDE>(codes, d, m, expanded, a, r, out, ldy, width, bias);
  }
  const int64_t rest = num_rows - r;
  if (rest == 3) tile_paired<BITS, 3, S, WIDE>(codes, d, m, expanded, a, r, out, ldy, width, bias);
  if (rest == 2) tile_paired<BITS, 2, S, WIDE>(codes, d, m, expanded, a, r, out, ldy, width, bias);
  if (rest == 1) tile_paired<BITS, 1, S, WIDE>(codes, d, m, expanded, a, r, out, ldy, width, bias);
}
#endif

template <int BITS, typename S>
void matmul(const QuantizedMatrix& w, const Activations& a, int64_t num_rows, float* y,
            int64_t ldy) {
  const int64_t groups = a.kp / G;
  const int64_t tile_bytes = groups * unit_bytes(BITS);
  const int64_t num_tiles = (w.rows + kTile - 1) / kTile;
  // 5- and 6-bit codes for more than one block of rows: the tile's codes widened to bytes
  // once (the 8-bit unit's layout, the same integers) and read by every block of rows, not
  // unpacked again per block. 4-bit codes cost two instructions a chunk to unpack: kept as is.
  // The AVX2 build takes 4- to 6-bit codes for more than one block of rows through
  // tile_paired (quant_rows.h), widened with the parameters expanded at kPairedMinRows rows or
  // more; decode's row and verification's few keep `tile` (paired was no faster, measured).
  const bool paired = TANDEM_PAIRED_HALVES && BITS <= 6 && num_rows > kMaxRowTile;
  const bool wide = paired ? num_rows >= kPairedMinRows
                           : (BITS == 5 || BITS == 6) && num_rows > kMaxRowTile;
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<uint8_t> widened;  // [groups, 512]: one tile's codes as bytes
    thread_local std::vector<float> expanded;  // [groups, 2, 16]: its parameters (paired)
    for (int64_t i = t0; i < t1; ++i) {
      const uint8_t* codes = w.codes + i * tile_bytes;
      const uint8_t* d = static_cast<const uint8_t*>(w.d) + i * tile_param_bytes<S>(groups);
      const uint8_t* m = static_cast<const uint8_t*>(w.m) + i * tile_param_bytes<S>(groups);
      const int64_t width = std::min(kTile, w.rows - i * kTile);
      const float* bias = w.bias ? w.bias + i * kTile : nullptr;
      float* out = y + i * kTile;
      if (wide) {
        widened.resize(groups * unit_bytes(8));
        widen<BITS>(codes, groups, widened.data());
      }
#if TANDEM_PAIRED_HALVES
      if constexpr (BITS <= 6) {
        if (paired && wide) {
          expanded.resize(groups * 2 * kTile);
          expand_params<BITS, S>(d, m, groups, expanded.data());
          paired_rows<BITS, S, true>(widened.data(), d, m, expanded.data(), a, num_rows, out,
                                     ldy, width, bias);
          continue;
        }
        if (paired) {
          paired_rows<BITS, S, false>(codes, d, m, nullptr, a, num_rows, out, ldy, width, bias);
          continue;
        }
      }
#endif
      if (wide) {
        tile_rows<BITS, S, true>(widened.data(), d, m, a, 0, num_rows, out, ldy, width, bias);
      } else {
        tile_rows<BITS, S, false>(codes, d, m, a, 0, num_rows, out, ldy, width, bias);
      }
    }
  });
}

template <typename S>
void matmul_bits(const QuantizedMatrix& w, const Activations& a, int64_t num_rows, float* y,
                 int64_t ldy) {
  switch (w.bits) {
    case 4: matmul<4, S>(w, a, num_rows, y, ldy); break;
    case 5: matmul<5, S>(w, a, num_rows, y, ldy); break;
    case 6: matmul<6, S>(w, a, num_rows, y, ldy); break;
    default: matmul<8, S>(w, a, num_rows, y, ldy); break;
  }
}
#endif

}  // namespace

QuantizedMatrix matrix(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, int64_t rows, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "tandem_cpu: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3,
              "tandem_cpu: codes must be contiguous uint8 [N / 16, G, unit bytes]");
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(codes.size(2) == unit_bytes(bits) && rows > (tiles - 1) * kTile &&
                  rows <= tiles * kTile,
              "tandem_cpu: codes ", codes.sizes(), " do not hold ", rows, " rows of ", bits,
              "-bit codes");
  const at::ScalarType type = d.scalar_type();
  const bool blocks = type == at::kByte;  // K-quant super-blocks: 160 bytes, Q6_K's 288
  const bool q6 = blocks && d.dim() == 3 && d.size(2) == kQ6Bytes;
  const int64_t block_bytes = q6 ? kQ6Bytes : kSuperBytes;
  const int64_t numel =
      blocks ? tiles * groups / kSuperGroups * block_bytes : tiles * groups * kTile;
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK((type == at::kFloat || type == at::kHalf || blocks) &&
                    t->scalar_type() == type && t->is_contiguous() && t->numel() == numel &&
                    (!blocks || groups % kSuperGroups == 0) && (!q6 || bits == 6),
                "tandem_cpu: scales and offsets must be contiguous, both float32 or float16 "
                "[N / 16, G, 16] or uint8 super-blocks [N / 16, G / 8, 160] (Q6_K: 288 with "
                "6-bit codes)");
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == rows,
                "tandem_cpu: bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  // float16 d passed as m too: a centered type's, m = center(bits) d (Params::kCentered)
  const bool centered = type == at::kHalf && m.data_ptr() == d.data_ptr();
  const Params params = q6         ? Params::kQ6
                        : blocks   ? Params::kSuper
                        : centered ? Params::kCentered
                        : type == at::kHalf ? Params::kHalf
                                            : Params::kFloat;
  return {codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), b, rows, groups * G,
          static_cast<int>(bits), params};
}

// y [num_rows, ldy] = x W^T over `count` parts side by side, the activations quantized once.
static void linear_parts(const QuantizedMatrix* parts, size_t count, const float* x,
                         int64_t num_rows, int64_t k, float* y, int64_t ldy) {
#if TANDEM_HAVE_KERNEL
  const int64_t kp = parts[0].kp;
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(parts[i].kp == kp, "tandem_cpu: a projection's segments take ", kp, " and ",
                parts[i].kp, " inputs");
  }
  TORCH_CHECK(k <= kp && kp - k < G, "tandem_cpu: x has ", k,
              " columns for a weight padded to ", kp);
  const int64_t groups = kp / G;
  // Activation codes: one buffer per calling thread, grown as needed (decode reuses it).
  // (thread_local: the worker threads below must use these pointers, not their own buffers)
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> sums;
  codes.resize(num_rows * kp);
  scales.resize(2 * num_rows * groups);
  sums.resize(2 * num_rows * groups);
  int8_t* p = codes.data();
  float* dx = scales.data();
  float* sx = dx + num_rows * groups;
  int32_t* halves = sums.data();
  at::parallel_for(0, num_rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int n = static_cast<int>(std::clamp<int64_t>(k - g * G, 0, G));
        quantize_group(x + r * k + g * G, n, p + r * kp + g * G, dx + r * groups + g,
                       sx + r * groups + g, halves + (r * groups + g) * 2);
      }
    }
  });
  const Activations a{p, dx, sx, halves, kp};
  for (size_t i = 0; i < count; ++i) {
    const QuantizedMatrix& w = parts[i];
    switch (w.params) {
      case Params::kFloat: matmul_bits<float>(w, a, num_rows, y, ldy); break;
      case Params::kHalf: matmul_bits<uint16_t>(w, a, num_rows, y, ldy); break;
      case Params::kCentered: matmul_bits<Centered>(w, a, num_rows, y, ldy); break;
      case Params::kSuper: matmul_bits<Super>(w, a, num_rows, y, ldy); break;
      case Params::kQ6: matmul<6, Q6>(w, a, num_rows, y, ldy); break;
    }
    y += w.rows;
  }
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

void linear(const QuantizedMatrix& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy) {
  linear_parts(&w, 1, x, num_rows, k, y, ldy);
}

void linear(const Projection& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy) {
  linear_parts(w.parts.data(), w.parts.size(), x, num_rows, k, y, ldy);
}

Projection projection(const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                      at::IntArrayRef rows, int64_t first, int64_t count,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(count > 0 && first + count <= static_cast<int64_t>(bits.size()) &&
                  bits.size() == rows.size() &&
                  3 * static_cast<int64_t>(bits.size()) == static_cast<int64_t>(weights.size()),
              "tandem_cpu: segments are (codes, d, m) with their bits and rows each");
  Projection w;
  for (int64_t i = first; i < first + count; ++i) {
    std::optional<at::Tensor> part_bias;
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) >= w.rows + rows[i],
                  "tandem_cpu: the bias is shorter than the projection's rows");
      part_bias = bias->narrow(0, w.rows, rows[i]);
    }
    w.parts.push_back(matrix(weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], bits[i],
                             rows[i], part_bias));
    w.rows += rows[i];
  }
  TORCH_CHECK(!bias.has_value() || bias->size(0) == w.rows,
              "tandem_cpu: bias must be [N], N the projection's rows");
  return w;
}

namespace {

// y = x W^T (+ bias): x [M, K] float32, W the projection's segments side by side (weights:
// codes, d, m per segment, with their bits and rows), y [M, N] float32 (a column slice of a
// wider output is fine: rows at y.stride(0)). The activations are quantized once for all.
void linear_out(const at::Tensor& x, const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                at::IntArrayRef rows, const std::optional<at::Tensor>& bias, at::Tensor y) {
  const Projection w = projection(weights, bits, rows, 0, bits.size(), bias);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == w.rows && y.stride(1) == 1,
              "tandem_cpu: y must be float32 [M, N] with unit column stride");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tandem_cpu: x must be contiguous float32 [M, K]");
  linear(w, x.data_ptr<float>(), x.size(0), x.size(1), y.data_ptr<float>(), y.stride(0));
}

}  // namespace

// out [R, k] float32: rows `index` of the matrix, each value d q + m as a float32 product then
// a sum (QuantizedWeight.dequantize's order): a token embedding read from its tied LM head's
// tiles, no second copy of the table.
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, int64_t rows, int64_t k, const at::Tensor& index) {
  const QuantizedMatrix w = matrix(codes, d, m, bits, rows, {});
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.is_contiguous(),
              "tandem_cpu: index must be contiguous int64 [R]");
  TORCH_CHECK(k <= w.kp && w.kp - k < G, "tandem_cpu: k ", k, " for a weight padded to ", w.kp);
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < index.numel(); ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < rows, "tandem_cpu: row ", ids[r], " is not in [0, ",
                rows, ")");
  }
  at::Tensor out = at::empty({index.numel(), k}, d.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t groups = w.kp / G, unit = unit_bytes(bits);
  // row `lane` of tile `tile`, input i of group g: the kernel's float32 d (or m), formed alike
  auto param = [&](const void* p, int64_t tile, int64_t g, int64_t lane, int64_t i) {
    if (w.params == Params::kSuper || w.params == Params::kQ6) {
      const bool q6 = w.params == Params::kQ6;
      const uint8_t* block = static_cast<const uint8_t*>(p) +
                             (tile * groups + g) / kSuperGroups * (q6 ? kQ6Bytes : kSuperBytes);
      uint16_t half;
      std::memcpy(&half, block + 2 * lane, 2);
      const int64_t sub = q6 ? 2 * (g % kSuperGroups) + i / 16 : g % kSuperGroups;
      const uint8_t byte = block[2 * kTile + sub * kTile + lane];
      return _cvtsh_ss(half) * (q6 ? static_cast<float>(static_cast<int8_t>(byte))
                                   : static_cast<float>(byte));
    }
    const int64_t at = (tile * groups + g) * kTile + lane;
    const bool half = w.params == Params::kHalf || w.params == Params::kCentered;
    return half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[at])
                : static_cast<const float*>(p)[at];
  };
  at::parallel_for(0, index.numel(), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t tile = ids[r] / kTile, lane = ids[r] % kTile;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* u = w.codes + (tile * groups + g) * unit;
        for (int64_t i = 0; i < G && g * G + i < k; ++i) {
          const int64_t c = i / 4, b = 4 * lane + i % 4;  // chunk, byte within it
          int q = bits == 8 ? u[64 * c + b] : (u[64 * (c % 4) + b] >> (4 * (c / 4))) & 15;
          if (bits == 5 || bits == 6) {  // the higher bits, byte-sliced (layout::high_bits)
            const int64_t hb = bits - 4, per = 8 / hb;
            q |= ((u[256 + 64 * (c / per) + b] >> (hb * (c % per))) & ((1 << hb) - 1)) << 4;
          }
          const float scale = param(w.d, tile, g, lane, i);
          const float offset = w.params == Params::kQ6         ? -32.0f * scale
                               : w.params == Params::kCentered ? center(bits) * scale
                                                               : param(w.m, tile, g, lane, i);
          o[r * k + g * G + i] = static_cast<float>(q) * scale + offset;
        }
      }
    }
  });
  return out;
}

namespace {
std::string isa() { return kIsa; }
}  // namespace

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def("isa() -> str", &tandem::isa);
  lib.def(
      "dequantize_rows(Tensor codes, Tensor d, Tensor m, int bits, int rows, int k, "
      "Tensor index) -> Tensor",
      &tandem::dequantize_rows);
  lib.def(
      "linear_out(Tensor x, Tensor[] weights, int[] bits, int[] rows, Tensor? bias, "
      "Tensor(a!) y) -> ()",
      &tandem::linear_out);
}
