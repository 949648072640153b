// The instruction-set layer the CPU kernels share: which u8 x s8 dot product this build uses,
// horizontal sums, and a vectorized exp. Compiled with -march=native for the machine it runs on.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

#if defined(__AVX2__) && defined(__FMA__)
#define TANDEM_HAVE_KERNEL 1

// The group dot products (quant_matmul.cpp): exact int32 sums of u8 codes x s8 activations.
inline int32_t word(const int8_t* p) {  // four activation codes as one int32 (to broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TANDEM_AVX512 1
constexpr const char* kIsa = "avx512-vnni";
inline __m512i dpbusd512(__m512i acc, __m512i a, __m512i b) {  // 16 lanes += 4 products each
  return _mm512_dpbusd_epi32(acc, a, b);
}
#else
#define TANDEM_AVX512 0
#if defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
// acc + the dot products of N chunks of codes with the activation words p[4c .. 4c + 3]: 8
// lanes, each 4 N products.
template <int BITS, int N>
[[gnu::always_inline]] inline __m256i dot_chunks(__m256i acc, const __m256i* chunk,
                                                 const int8_t* p) {
  for (int c = 0; c < N; ++c) {
    acc = _mm256_dpbusd_avx_epi32(acc, chunk[c], _mm256_set1_epi32(word(p + 4 * c)));
  }
  return acc;
}
#else
constexpr const char* kIsa = "avx2";
// maddubs adds pairs of u8 x s8 products in int16 (saturating past 2^15); the pairs of K chunks
// are summed in int16 before one madd widens them, as long as K pairs stay below 2^15: codes
// < 2^BITS against activations in [-128, 127], |pair| <= 2 (2^BITS - 1) 128, so 8 chunks of
// 4-bit codes (30,720), 4 of 5-bit (31,744), 2 of 6-bit (32,256). Exact: the same integers as
// widening every chunk, in a third fewer multiplies on the two ports that run them. 8-bit
// codes q = 16 hi + lo are taken as their two nibbles, each summed as 4-bit codes.
// int16 lanes: pairs of products
[[gnu::always_inline]] inline __m256i pairs(__m256i w, const int8_t* p) {
  return _mm256_maddubs_epi16(w, _mm256_set1_epi32(word(p)));
}

// Chunks whose pairs may be summed in int16 before widening (the bound above).
constexpr int pair_chunks(int bits) { return bits <= 4 ? 8 : bits == 5 ? 4 : 2; }

template <int BITS, int N>
[[gnu::always_inline]] inline __m256i dot_chunks(__m256i acc, const __m256i* chunk,
                                                 const int8_t* p) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS <= 6) {
    constexpr int K = pair_chunks(BITS);
    for (int c0 = 0; c0 < N; c0 += K) {
      __m256i sum = pairs(chunk[c0], p + 4 * c0);
      for (int c = c0 + 1; c < c0 + K && c < N; ++c) {
        sum = _mm256_add_epi16(sum, pairs(chunk[c], p + 4 * c));
      }
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(sum, ones));
    }
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
    for (int c = 0; c < N; ++c) {
      hi = _mm256_add_epi16(hi, pairs(_mm256_and_si256(_mm256_srli_epi16(chunk[c], 4), low),
                                         p + 4 * c));
      lo = _mm256_add_epi16(lo, pairs(_mm256_and_si256(chunk[c], low), p + 4 * c));
    }
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, ones));
  }
  return acc;
}
#endif
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The vector operations exp_lanes takes, 8 lanes a vector (Lanes16 below: 16).
struct Lanes8 {
  using V = __m256;
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for integral n, through the exponent bits
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static V pow2(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
};

// The upper 8 lanes of 16.
inline __m256 upper8(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
#endif

// e^x lane by lane: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), 2^n through the exponent bits. Inputs below -87 give 0. A NaN
// stays NaN (max/min return their second operand when either is NaN, so x goes second): a
// NaN query (a corrupt adapter) must reach the logits, where its request is failed. Written
// once for every width, so exp256 and exp512 give the same bits lane for lane.
template <class L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::max(L::set1(-87.0f), x);
  x = L::min(L::set1(88.0f), x);
  const typename L::V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  typename L::V r = L::fnmadd(n, L::set1(0.693359375f), x);  // ln2 in two parts
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  typename L::V p = L::set1(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = L::fmadd(p, r, L::set1(c));
  }
  return L::mul(p, L::pow2(n));
}

inline __m256 exp256(__m256 x) { return exp_lanes<Lanes8>(x); }
#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) { return exp_lanes<Lanes16>(x); }
#endif

#else
#define TANDEM_HAVE_KERNEL 0
constexpr const char* kIsa = "none";
#endif

}  // namespace tandem
