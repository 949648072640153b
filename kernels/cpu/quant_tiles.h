// The quantized matmul's tile kernels (the math and the layout: quant_matmul.cpp's header
// comment): MT rows of int8 activations against one 16-row tile of codes, each output one
// chain of float steps per group. AVX-512 VNNI takes the tile's 16 rows in one register; the
// 256-bit paths (AVX-VNNI, AVX2) take it as two halves of 8 rows, the same steps per lane.
#pragma once

#include <cstdint>
#include <type_traits>

#include "quant_layout.h"
#include "simd.h"

namespace tandem {
namespace {

using namespace layout;

#if TANDEM_HAVE_KERNEL
// Bytes of codes the 512-bit tile loop asks for ahead of the group it reads. Decode streams
// each tile's codes once from memory, group after group, and left to the hardware prefetchers
// one core read them at ~2/3 of its sequential rate (Qwen2.5-Coder-1.5B, 1 thread: 8.2-8.4
// tok/s; a prefetch 2 / 4 / 8 KiB ahead: 10.5-11.5 / 10.9-11.7 / 11.3-11.5, bench/RESULTS.md).
// Tiles are contiguous, so ahead of the last group is the next tile's first. (The 256-bit
// loop reads a tile twice, a half at a time, and fetches the next tile instead: `tile`.)
constexpr int64_t kAhead = 4096;

// The cache lines of [u, u + bytes).
inline void prefetch_span(const uint8_t* u, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(u) & ~uintptr_t{63};
  for (uintptr_t c = first; c < reinterpret_cast<uintptr_t>(u) + bytes; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(c), _MM_HINT_T0);
  }
}

// The unit kAhead bytes after u, ahead of its reading.
inline void prefetch_ahead(const uint8_t* u, int64_t bytes) { prefetch_span(u + kAhead, bytes); }

struct Activations {
  const int8_t* p;   // [M, Kp]
  const float* dx;   // [M, Kp / G]
  const float* sx;   // [M, Kp / G]
  const int32_t* halves;  // [M, Kp / 16]: -32 sum(p) over each 16 (Q6_K's -32 S, exact)
  int64_t kp;
};

#if TANDEM_AVX512
// One tile's group u -> its 8 chunks of codes as bytes (the low nibbles, or'ed with the higher
// bits of 5- and 6-bit codes: high_bits).
template <int BITS>
[[gnu::always_inline]] inline void unpack(const uint8_t* u, __m512i chunk[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < (BITS == 8 ? 8 : 4); ++c) {
    const __m512i v = _mm512_loadu_si512(u + 64 * c);
    if constexpr (BITS == 8) {
      chunk[c] = v;
    } else {
      chunk[c] = _mm512_and_si512(v, low);
      chunk[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
  if constexpr (BITS == 5 || BITS == 6) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(u + 256 + 64 * (c / (8 / (BITS - 4))));
      chunk[c] = _mm512_or_si512(chunk[c], high_bits<BITS>(v, c));
    }
  }
}

// A tile's codes (groups units of BITS-bit codes) as 8-bit units, one code a byte.
template <int BITS>
inline void widen(const uint8_t* w, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    __m512i chunk[8];
    unpack<BITS>(w + g * unit_bytes(BITS), chunk);
    for (int c = 0; c < 8; ++c) _mm512_storeu_si512(out + 512 * g + 64 * c, chunk[c]);
  }
}

// MT activation rows against one 16-row tile: acc[t] holds row first + t's 16 outputs. WIDE:
// the codes are `widen`'s 8-bit units (of BITS-bit values).
template <int BITS, int MT, typename S, bool WIDE>
inline void tile(const uint8_t* w, const uint8_t* d, const uint8_t* m, const Activations& a,
                 int64_t first, float* y, int64_t ldy, int64_t width, const float* bias) {
  const int64_t groups = a.kp / G;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  // The row loops unrolled whole and the group loop not at all: the MT accumulators and one
  // group's 8 chunks then stay in registers (unrolling groups too spilled acc to the stack).
#pragma GCC unroll 1
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t unit = unit_bytes(WIDE ? 8 : BITS);
    prefetch_ahead(w + g * unit, unit);
    __m512i chunk[8];
    unpack<WIDE ? 8 : BITS>(w + g * unit, chunk);
    if constexpr (std::is_same_v<S, Q6>) {  // each half: acc = fma(D - 32 S, s dx, acc)
      const __m512 s0 = q6_scales16(d, g, 0), s1 = q6_scales16(d, g, 1);
#pragma GCC unroll 16
      for (int t = 0; t < MT; ++t) {
        const int64_t r = first + t;
        const int8_t* p = a.p + r * a.kp + g * G;
        const int32_t* sums = a.halves + (r * groups + g) * 2;
        __m512i lo = _mm512_set1_epi32(sums[0]), hi = _mm512_set1_epi32(sums[1]);
        for (int c = 0; c < 4; ++c) lo = dpbusd512(lo, chunk[c], _mm512_set1_epi32(word(p + 4 * c)));
        for (int c = 4; c < 8; ++c) hi = dpbusd512(hi, chunk[c], _mm512_set1_epi32(word(p + 4 * c)));
        const __m512 dx = _mm512_set1_ps(a.dx[r * groups + g]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s0, dx), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s1, dx), acc[t]);
      }
      continue;
    }
    const __m512 dg = params16<S>(d, g);
    const __m512 mg = std::is_same_v<S, Centered>
                          ? _mm512_mul_ps(dg, _mm512_set1_ps(center(BITS)))
                          : params16<S>(m, g);
#pragma GCC unroll 16
    for (int t = 0; t < MT; ++t) {
      const int64_t r = first + t;
      const int8_t* p = a.p + r * a.kp + g * G;
      // D as two chains of 4 products (half the dependent latency; integer sums, D exact)
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) lo = dpbusd512(lo, chunk[c], _mm512_set1_epi32(word(p + 4 * c)));
      for (int c = 4; c < 8; ++c) hi = dpbusd512(hi, chunk[c], _mm512_set1_epi32(word(p + 4 * c)));
      const __m512i dot = _mm512_add_epi32(lo, hi);
      const __m512 scale = _mm512_mul_ps(dg, _mm512_set1_ps(a.dx[r * groups + g]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
      acc[t] = _mm512_fmadd_ps(mg, _mm512_set1_ps(a.sx[r * groups + g]), acc[t]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int t = 0; t < MT; ++t) {
    const __m512 out = bias ? _mm512_add_ps(acc[t], b) : acc[t];
    _mm512_mask_storeu_ps(y + (first + t) * ldy, mask, out);
  }
}
#else
// Chunk c's half `half` of a group unit u as bytes (as the 512-bit path's: this half's 32 bytes
// of the chunk): WIDE (`widen`'s 8-bit units) or 8-bit codes as stored; else BITS-bit codes
// unpacked, the low nibbles, then 5- and 6-bit codes' higher bits (byte-sliced: high_bits).
template <int BITS, bool WIDE>
[[gnu::always_inline]] inline __m256i chunk_half(const uint8_t* u, int c, int half) {
  auto load = [&](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + at + 32 * half));
  };
  if constexpr (WIDE || BITS == 8) {
    return load(64 * c);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F), v = load(64 * (c % 4));
    __m256i q = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi16(v, 4), low);
    if constexpr (BITS == 5 || BITS == 6) {
      q = _mm256_or_si256(q, high_bits<BITS>(load(256 + 64 * (c / (8 / (BITS - 4)))), c));
    }
    return q;
  }
}

// One tile's group u -> half `half`'s 8 chunks of codes as bytes.
template <int BITS>
[[gnu::always_inline]] inline void unpack(const uint8_t* u, int half, __m256i chunk[8]) {
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) chunk[c] = chunk_half<BITS, false>(u, c, half);
}

// Group g's parameters for half `half` as float32: d and m (Centered: m = center(BITS) d; Q6_K:
// the scales s of the group's two halves of 16 inputs).
template <int BITS, typename S>
[[gnu::always_inline]] inline void group_params(const uint8_t* d, const uint8_t* m, int64_t g,
                                                int half, __m256& first, __m256& second) {
  if constexpr (std::is_same_v<S, Q6>) {
    first = q6_scales8(d, g, 0, half);
    second = q6_scales8(d, g, 1, half);
  } else {
    first = params8<S>(d, g, half);
    second = std::is_same_v<S, Centered> ? _mm256_mul_ps(first, _mm256_set1_ps(center(BITS)))
                                         : params8<S>(m, g, half);
  }
}

// Half `half`'s outputs (at most 8, width: the tile's real ones) of rows first .. first + MT - 1
// (acc[t]), plus the bias, into y.
template <int MT>
[[gnu::always_inline]] inline void store_half(const __m256* acc, int64_t first, int half,
                                              float* y, int64_t ldy, int64_t width,
                                              const float* bias) {
  const int64_t n = std::min<int64_t>(8, width - 8 * half);
  for (int t = 0; t < MT; ++t) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[t]);
    float* row = y + (first + t) * ldy + 8 * half;
    for (int64_t j = 0; j < n; ++j) row[j] = bias ? out[j] + bias[8 * half + j] : out[j];
  }
}

template <int BITS>
inline void widen(const uint8_t* w, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int half = 0; half < 2; ++half) {
      __m256i chunk[8];
      unpack<BITS>(w + g * unit_bytes(BITS), half, chunk);
      for (int c = 0; c < 8; ++c) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 512 * g + 64 * c + 32 * half),
                            chunk[c]);
      }
    }
  }
}

// 256 bits: the tile as two halves of 8 rows, each the same steps as the 512-bit path's lanes.
// (BITS: the codes' values, what dot_chunks needs; WIDE: stored as `widen`'s 8-bit units.)
template <int BITS, int MT, typename S, bool WIDE>
inline void tile(const uint8_t* w, const uint8_t* d, const uint8_t* m, const Activations& a,
                 int64_t first, float* y, int64_t ldy, int64_t width, const float* bias) {
  const int64_t groups = a.kp / G;
  for (int half = 0; half < 2 && 8 * half < width; ++half) {
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t unit = unit_bytes(WIDE ? 8 : BITS);
      // The next tile's codes (contiguous after this one), half a unit in each of the 2 x groups
      // steps: the memory streams while either half computes. (A distance ahead within the
      // tile, asked for in the first half only, left it idle while the second half re-read the
      // tile from cache: Qwen2.5-Coder-1.5B decoded ~20% slower on a Zen 3.)
      if constexpr (!WIDE) {
        prefetch_span(w + groups * unit + (half * groups + g) * unit / 2, unit / 2);
      }
      __m256i chunk[8];
      unpack<WIDE ? 8 : BITS>(w + g * unit, half, chunk);
      __m256 first_param, second_param;  // d and m, or Q6_K's s of each half-group
      group_params<BITS, S>(d, m, g, half, first_param, second_param);
      if constexpr (std::is_same_v<S, Q6>) {  // as the 512-bit path
        const __m256 s0 = first_param, s1 = second_param;
        for (int t = 0; t < MT; ++t) {
          const int64_t r = first + t;
          const int8_t* p = a.p + r * a.kp + g * G;
          const int32_t* sums = a.halves + (r * groups + g) * 2;
          const __m256i lo = dot_chunks<BITS, 4>(_mm256_set1_epi32(sums[0]), chunk, p);
          const __m256i hi = dot_chunks<BITS, 4>(_mm256_set1_epi32(sums[1]), chunk + 4, p + 16);
          const __m256 dx = _mm256_set1_ps(a.dx[r * groups + g]);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, dx), acc[t]);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s1, dx), acc[t]);
        }
        continue;
      }
      const __m256 dg = first_param, mg = second_param;
      for (int t = 0; t < MT; ++t) {
        const int64_t r = first + t;
        const int8_t* p = a.p + r * a.kp + g * G;
        const __m256i dot = dot_chunks<BITS, 8>(_mm256_setzero_si256(), chunk, p);
        const __m256 scale = _mm256_mul_ps(dg, _mm256_set1_ps(a.dx[r * groups + g]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[t]);
        acc[t] = _mm256_fmadd_ps(mg, _mm256_set1_ps(a.sx[r * groups + g]), acc[t]);
      }
    }
    store_half<MT>(acc, first, half, y, ldy, width, bias);
  }
}
#endif
#endif

}  // namespace
}  // namespace tandem
