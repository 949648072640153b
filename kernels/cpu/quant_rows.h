// The AVX2 build's tile kernel for calls of more than 8 rows of 4-, 5- and 6-bit codes: a
// tile's two halves of 8 outputs together, chunk by chunk across up to 4 activation rows, so each
// broadcast activation word feeds both halves' multiplies (quant_tiles.h's 256-bit `tile` takes
// the halves one after the other, broadcasting every word twice; it stays the kernel of decode,
// of 8-bit codes and of the AVX-VNNI build). The same integers and float steps per output as
// `tile` (quant_matmul.cpp's header comment), so the same bits. Verification's rows read the
// codes as stored; prefill's (kPairedMinRows or more) read them widened to bytes and the
// parameters as float32, both formed once per tile.
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

// A tile's parameters as float32 [groups, 2 (first, second), 16].
template <int BITS, typename S>
inline void expand_params(const uint8_t* d, const uint8_t* m, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int half = 0; half < 2; ++half) {
      __m256 first, second;
      group_params<BITS, S>(d, m, g, half, first, second);
      _mm256_storeu_ps(out + 32 * g + 8 * half, first);
      _mm256_storeu_ps(out + 32 * g + 16 + 8 * half, second);
    }
  }
}

// MT rows (first..) against one tile: codes as chunk_half reads them; parameters from
// `expanded` (expand_params') when WIDE, else from d and m. Per chunk: one broadcast of a
// row's activation word, a multiply for each half; int16 sums of K chunks as dot_chunks' (the
// bound on K there), widened to int32 D per group (Q6_K: per half-group).
template <int BITS, int MT, typename S, bool WIDE>
inline void tile_paired(const uint8_t* w, const uint8_t* d, const uint8_t* m,
                        const float* expanded, const Activations& a, int64_t first, float* y,
                        int64_t ldy, int64_t width, const float* bias) {
  constexpr bool q6 = std::is_same_v<S, Q6>;
  static_assert(BITS <= 6);
  constexpr int K = pair_chunks(BITS);
  const int64_t groups = a.kp / G, unit = unit_bytes(WIDE ? 8 : BITS);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][MT];  // [half][row]
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* u = w + g * unit;
    if constexpr (!WIDE) prefetch_span(u + groups * unit, unit);  // the next tile's group g
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
        const __m256i q0 = chunk_half<BITS, WIDE>(u, c, 0), q1 = chunk_half<BITS, WIDE>(u, c, 1);
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
      __m256 first_param, second_param;
      if constexpr (WIDE) {
        first_param = _mm256_loadu_ps(expanded + 32 * g + 8 * half);
        second_param = _mm256_loadu_ps(expanded + 32 * g + 16 + 8 * half);
      } else {
        group_params<BITS, S>(d, m, g, half, first_param, second_param);
      }
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
    store_half<MT>(acc[half], first, half, y, ldy, width, bias);
  }
}
#else
#define TANDEM_PAIRED_HALVES 0
#endif

}  // namespace
}  // namespace tandem
