// Prefill on the AVX2 build: a tile's two halves against 4 activation rows at a time, so each
// broadcast activation word feeds both halves' multiplies (quant_tiles.h's 256-bit tile takes
// the halves one after the other and broadcasts every word twice). The same integers and float
// steps per output as `tile` (quant_matmul.cpp's header comment), so the same bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "quant_layout.h"
#include "quant_tiles.h"
#include "simd.h"

namespace tandem {
namespace {

using namespace layout;

#if TANDEM_HAVE_KERNEL && !TANDEM_AVX512 && !defined(__AVXVNNI__)
#define TANDEM_PAIRED_HALVES 1
constexpr int kPairedRows = 4;  // activation rows per pass over a tile (16 int16 sums live)

// A tile's group parameters as float32 [groups, 2, 16]: d then m (Q6_K: its two halves' s),
// the values `tile` forms from the stored ones (the same instructions), once per tile.
template <int BITS, typename S>
inline void expand_params(const uint8_t* d, const uint8_t* m, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int half = 0; half < 2; ++half) {
      __m256 first, second;
      if constexpr (std::is_same_v<S, Q6>) {
        first = q6_scales8(d, g, 0, half);
        second = q6_scales8(d, g, 1, half);
      } else {
        first = params8<S>(d, g, half);
        second = std::is_same_v<S, Centered>
                     ? _mm256_mul_ps(first, _mm256_set1_ps(center(BITS)))
                     : params8<S>(m, g, half);
      }
      _mm256_storeu_ps(out + 32 * g + 8 * half, first);
      _mm256_storeu_ps(out + 32 * g + 16 + 8 * half, second);
    }
  }
}

// MT rows (first..) against a tile whose codes are bytes (`widen`'s 8-bit units of BITS-bit
// values) and whose parameters are `expand_params`'. Chunk by chunk across the rows: one
// broadcast, two multiplies (one a half), int16 sums of K chunks as dot_chunks' (the bound on
// K there), widened to int32 D per group (Q6_K: per half-group). (8-bit codes, two nibble
// passes, gained nothing: not taken.)
template <int BITS, int MT, typename S>
inline void tile_paired(const uint8_t* w, const float* params, const Activations& a,
                        int64_t first, float* y, int64_t ldy, int64_t width, const float* bias) {
  constexpr bool q6 = std::is_same_v<S, Q6>;
  static_assert(BITS <= 6);
  constexpr int K = BITS <= 4 ? 8 : BITS == 5 ? 4 : 2;
  const int64_t groups = a.kp / G;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][MT];  // [half][row]
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* u = w + g * unit_bytes(8);
    const int8_t* p = a.p + first * a.kp + g * G;
    __m256i dot[q6 ? 2 : 1][2][MT];  // [part: Q6_K's half-group][half][row]
    for (int t = 0; t < MT; ++t) {
      const int32_t* sums = a.halves + ((first + t) * groups + g) * 2;
      for (int part = 0; part < (q6 ? 2 : 1); ++part) {
        const __m256i init = q6 ? _mm256_set1_epi32(sums[part]) : _mm256_setzero_si256();
        dot[part][0][t] = dot[part][1][t] = init;
      }
    }
#pragma GCC unroll 8
    for (int c0 = 0; c0 < 8; c0 += K) {
      __m256i s[2][MT];
#pragma GCC unroll 8
      for (int c = c0; c < c0 + K; ++c) {
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * c));
        const __m256i q1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * c + 32));
#pragma GCC unroll 8
        for (int t = 0; t < MT; ++t) {
          const __m256i b = _mm256_set1_epi32(word(p + t * a.kp + 4 * c));
          const __m256i x0 = _mm256_maddubs_epi16(q0, b), x1 = _mm256_maddubs_epi16(q1, b);
          s[0][t] = c == c0 ? x0 : _mm256_add_epi16(s[0][t], x0);
          s[1][t] = c == c0 ? x1 : _mm256_add_epi16(s[1][t], x1);
          // kept in registers here: without it the compiler reassociates the integer sums,
          // computing every product first and spilling them
          __asm__("" : "+x"(s[0][t]), "+x"(s[1][t]));
        }
      }
      const int part = q6 && c0 >= 4;
#pragma GCC unroll 8
      for (int t = 0; t < MT; ++t) {
        for (int half = 0; half < 2; ++half) {
          const __m256i sum = _mm256_madd_epi16(s[half][t], ones);
          dot[part][half][t] = _mm256_add_epi32(dot[part][half][t], sum);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 first_param = _mm256_loadu_ps(params + 32 * g + 8 * half);
      const __m256 second_param = _mm256_loadu_ps(params + 32 * g + 16 + 8 * half);
      for (int t = 0; t < MT; ++t) {
        const int64_t r = first + t;
        const __m256 dx = _mm256_set1_ps(a.dx[r * groups + g]);
        // acc = fma(D, d dx, acc); acc = fma(m, sx, acc)  (Q6_K: each half-group's
        // acc = fma(D - 32 S, s dx, acc))
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][half][t]),
                                     _mm256_mul_ps(first_param, dx), acc[half][t]);
        sum = q6 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[q6][half][t]),
                                   _mm256_mul_ps(second_param, dx), sum)
                 : _mm256_fmadd_ps(second_param, _mm256_set1_ps(a.sx[r * groups + g]), sum);
        acc[half][t] = sum;
      }
    }
  }
  for (int half = 0; half < 2 && 8 * half < width; ++half) {
    const int64_t n = std::min<int64_t>(8, width - 8 * half);
    for (int t = 0; t < MT; ++t) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[half][t]);
      float* row = y + (first + t) * ldy + 8 * half;
      for (int64_t j = 0; j < n; ++j) row[j] = bias ? out[j] + bias[8 * half + j] : out[j];
    }
  }
}
#else
#define TANDEM_PAIRED_HALVES 0
#endif

}  // namespace
}  // namespace tandem
