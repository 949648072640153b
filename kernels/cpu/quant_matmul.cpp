// Weight-only quantized matmul for CPU decode: y = x W^T + b with W in 4- or 8-bit codes.
//
// Weights: per output row, groups of G = 32 inputs share a scale d and an offset m, and
// w = d q + m with q the code (the affine form of GGUF's Q4_0/Q4_1/Q4_K/Q5_x/Q8_0 blocks).
// Activations: each row quantized per 32 values to int8 (llama.cpp's Q8 activations):
// x ~= dx p with dx = max|x| / 127, p = round(x / dx). Then per group
//     sum_i w_i x_i ~= d dx sum_i q_i p_i + m dx sum_i p_i,
// the first sum an exact int32 dot product (one VNNI instruction per 32 values, or
// maddubs + madd on AVX2), the second precomputed once per activation group (s = dx sum p).
//
// Layouts (built by engine/models/quantized.py, widths padded to Kp, a multiple of 64):
// - 4 bits: [N, Kp / 2] bytes; in each 32-byte unit u, byte j holds the code of input 64u + j
//   in its low nibble and of input 64u + 32 + j in its high nibble, so one load, one AND and
//   one shift give two groups in input order.
// - 8 bits: [N, Kp] bytes, unsigned codes where VNNI multiplies u8 x s8 directly; on AVX2
//   (maddubs saturates u8 x s8 pairs) signed codes q - 128, with m absorbing the 128 d, and
//   the sign trick |w| x sign(p, w).
// - d, m: [N, Kp / 32] float32 (exact for every GGUF type read; padded groups are 0).
//
// Every output element is computed by the same instruction sequence whatever the number of
// rows in the call, so a row's result does not depend on what it is batched with.
#include "quant_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace tandem {
namespace {

constexpr int64_t G = 32;
constexpr int64_t kMaxGroups = 1024;  // K up to 32768

#if TANDEM_HAVE_KERNEL
// One group of 32 floats -> 32 int8 codes p, dx, dx * sum(p). Round half to even (the
// default MXCSR mode), as torch.round in the Python reference.
inline void quantize_group(const float* x, int n, int8_t* p, float* dx, float* sx) {
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
}

struct Activations {
  const int8_t* p;   // [M, Kp]
  const float* dx;   // [M, Kp / G]
  const float* sx;   // [M, Kp / G]
  int64_t kp;
};

// The groups' offset terms: sum over groups of m_g s_g, 8 at a time, then in order.
inline float offset_term(const float* m, const float* s, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(s + g), acc);
  }
  float r = hsum(acc);
  for (; g < groups; ++g) r += m[g] * s[g];
  return r;
}

// MT activation rows against one 4-bit weight row: two groups per 32-byte unit.
template <int MT>
inline void row4(const uint8_t* w, const float* d, const float* m, const Activations& a,
                 int64_t first, float* out, int64_t ldo) {
  const int64_t groups = a.kp / G;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t u = 0; u < groups / 2; ++u) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * u));
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    for (int t = 0; t < MT; ++t) {
      const int64_t r = first + t;
      const int8_t* p = a.p + r * a.kp + 64 * u;
      const float* dx = a.dx + r * groups + 2 * u;
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo, p0)),
                               _mm256_set1_ps(d[2 * u] * dx[0]), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi, p1)),
                               _mm256_set1_ps(d[2 * u + 1] * dx[1]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    out[t * ldo] = hsum(acc[t]) + offset_term(m, a.sx + (first + t) * groups, groups);
  }
}

// MT activation rows against one 8-bit weight row.
template <int MT>
inline void row8(const uint8_t* w, const float* d, const float* m, const Activations& a,
                 int64_t first, float* out, int64_t ldo) {
  const int64_t groups = a.kp / G;
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g));
    for (int t = 0; t < MT; ++t) {
      const int64_t r = first + t;
      const __m256i p =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.p + r * a.kp + 32 * g));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_w8(v, p)),
                               _mm256_set1_ps(d[g] * a.dx[r * groups + g]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    out[t * ldo] = hsum(acc[t]) + offset_term(m, a.sx + (first + t) * groups, groups);
  }
}

template <int BITS, int MT>
inline void rows(const uint8_t* w, const float* d, const float* m, int64_t row_bytes,
                 int64_t groups, const Activations& a, int64_t first, int64_t n0, int64_t n1,
                 float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    float* out = y + first * ldy + n;
    if constexpr (BITS == 4) {
      row4<MT>(wn, d + n * groups, m + n * groups, a, first, out, ldy);
    } else {
      row8<MT>(wn, d + n * groups, m + n * groups, a, first, out, ldy);
    }
  }
}

template <int BITS>
void matmul(const uint8_t* w, const float* d, const float* m, int64_t n_rows,
            const Activations& a, int64_t num_rows, float* y, int64_t ldy) {
  constexpr int64_t kBlock = 64;  // weight rows per task: re-read from cache per row tile
  const int64_t groups = a.kp / G;
  const int64_t row_bytes = BITS == 4 ? a.kp / 2 : a.kp;
  at::parallel_for(0, (n_rows + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, n1 = std::min(n_rows, n0 + kBlock);
      int64_t r = 0;
      for (; r + 4 <= num_rows; r += 4) rows<BITS, 4>(w, d, m, row_bytes, groups, a, r, n0, n1, y, ldy);
      switch (num_rows - r) {
        case 3: rows<BITS, 3>(w, d, m, row_bytes, groups, a, r, n0, n1, y, ldy); break;
        case 2: rows<BITS, 2>(w, d, m, row_bytes, groups, a, r, n0, n1, y, ldy); break;
        case 1: rows<BITS, 1>(w, d, m, row_bytes, groups, a, r, n0, n1, y, ldy); break;
        default: break;
      }
    }
  });
}

#endif

}  // namespace

QuantizedMatrix matrix(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 8, "tandem_cpu: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "tandem_cpu: codes must be contiguous uint8 [N, bytes]");
  const int64_t rows = codes.size(0);
  const int64_t kp = bits == 4 ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK(kp % 64 == 0 && kp / G <= kMaxGroups, "tandem_cpu: padded K ", kp,
              " must be a multiple of 64, at most ", kMaxGroups * G);
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == rows * (kp / G),
                "tandem_cpu: scales and offsets must be contiguous float32 [N, Kp / 32]");
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == rows,
                "tandem_cpu: bias must be contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  return {codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), b, rows, kp,
          static_cast<int>(bits)};
}

void linear(const QuantizedMatrix& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(k <= w.kp && w.kp - k < 64, "tandem_cpu: x has ", k,
              " columns for a weight padded to ", w.kp);
  const int64_t groups = w.kp / G;
  // Activation codes: one buffer per calling thread, grown as needed (decode reuses it).
  // (thread_local: the worker threads below must use these pointers, not their own buffers)
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scales;
  codes.resize(num_rows * w.kp);
  scales.resize(2 * num_rows * groups);
  int8_t* p = codes.data();
  float* dx = scales.data();
  float* sx = dx + num_rows * groups;
  at::parallel_for(0, num_rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int n = static_cast<int>(std::clamp<int64_t>(k - g * G, 0, G));
        quantize_group(x + r * k + g * G, n, p + r * w.kp + g * G, dx + r * groups + g,
                       sx + r * groups + g);
      }
    }
  });
  const Activations a{p, dx, sx, w.kp};
  if (w.bits == 4) {
    matmul<4>(w.codes, w.d, w.m, w.rows, a, num_rows, y, ldy);
  } else {
    matmul<8>(w.codes, w.d, w.m, w.rows, a, num_rows, y, ldy);
  }
  if (w.bias != nullptr) {
    for (int64_t r = 0; r < num_rows; ++r) {
      for (int64_t n = 0; n < w.rows; ++n) y[r * ldy + n] += w.bias[n];
    }
  }
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

namespace {

// y = x W^T (+ bias): x [M, K] float32, y [M, N] float32 (a column slice of a wider output
// is fine: rows at y.stride(0)).
void linear_out(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                const at::Tensor& m, int64_t bits, const std::optional<at::Tensor>& bias,
                at::Tensor y) {
  const QuantizedMatrix w = matrix(codes, d, m, bits, bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tandem_cpu: x must be contiguous float32 [M, K]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == w.rows && y.stride(1) == 1,
              "tandem_cpu: y must be float32 [M, N] with unit column stride");
  linear(w, x.data_ptr<float>(), x.size(0), x.size(1), y.data_ptr<float>(), y.stride(0));
}

// Round to nearest even (bf16 keeps the top 16 bits of a float32; no NaNs arise here).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// w [N, k] = d c + m over the stored codes c (d q + m exactly, but for AVX2's signed 8-bit
// codes, stored as q - 128 with m + 128 d), rounded to bf16: for GEMMs with many rows, where
// a bf16 GEMM (oneDNN, AVX512-BF16 or AMX) over weights dequantized per call beats the int8
// path (see engine/models/quantized.py).
at::Tensor dequantize_bf16(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, int64_t k) {
  const QuantizedMatrix w = matrix(codes, d, m, bits, {});
  TORCH_CHECK(k <= w.kp && w.kp - k < 64, "tandem_cpu: k ", k, " for a weight padded to ", w.kp);
  auto out = at::empty({w.rows, k}, d.options().dtype(at::kBFloat16));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t groups = w.kp / G, row_bytes = w.bits == 4 ? w.kp / 2 : w.kp;
  const bool is_signed = w.bits == 8 && kSigned8;
  at::parallel_for(0, w.rows, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float q[64];
    alignas(64) float vals[64];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = w.codes + n * row_bytes;
      for (int64_t u = 0; u < w.kp / 64; ++u) {  // 64 inputs: two groups
        if (w.bits == 4) {
          for (int j = 0; j < 32; ++j) {
            q[j] = static_cast<float>(c[32 * u + j] & 15);
            q[32 + j] = static_cast<float>(c[32 * u + j] >> 4);
          }
        } else if (is_signed) {
          for (int j = 0; j < 64; ++j) q[j] = static_cast<float>(static_cast<int8_t>(c[64 * u + j]));
        } else {
          for (int j = 0; j < 64; ++j) q[j] = static_cast<float>(c[64 * u + j]);
        }
        for (int h = 0; h < 2; ++h) {
          const float dg = w.d[n * groups + 2 * u + h], mg = w.m[n * groups + 2 * u + h];
          for (int j = 0; j < 32; ++j) vals[32 * h + j] = dg * q[32 * h + j] + mg;
        }
        const int64_t width = std::min<int64_t>(64, k - 64 * u);
        uint16_t* row = o + n * k + 64 * u;
        for (int64_t j = 0; j < width; ++j) row[j] = to_bf16(vals[j]);
      }
    }
  });
  return out;
}

std::string isa() { return kIsa; }
bool signed_8bit() { return kSigned8; }

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def("isa() -> str", &tandem::isa);
  lib.def("signed_8bit() -> bool", &tandem::signed_8bit);
  lib.def("dequantize_bf16(Tensor codes, Tensor d, Tensor m, int bits, int k) -> Tensor",
          &tandem::dequantize_bf16);
  lib.def(
      "linear_out(Tensor x, Tensor codes, Tensor d, Tensor m, int bits, Tensor? bias, "
      "Tensor(a!) y) -> ()",
      &tandem::linear_out);
}
