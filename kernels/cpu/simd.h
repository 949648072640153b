// The instruction-set layer the CPU kernels share: which u8 x s8 dot product this build uses,
// horizontal sums, and a vectorized exp. Compiled with -march=native for the machine it runs on.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace tandem {

#if defined(__AVX2__) && defined(__FMA__)
#define TANDEM_HAVE_KERNEL 1

// The group dot products (quant_matmul.cpp): exact int32 sums of u8 codes x s8 activations.
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
template <int BITS>
inline __m256i dot_add(__m256i acc, __m256i w, __m256i p) {  // 8 lanes += 4 products each
  return _mm256_dpbusd_avx_epi32(acc, w, p);
}
#else
constexpr const char* kIsa = "avx2";
// maddubs adds pairs of u8 x s8 products in int16, saturating past 2^15: codes of up to 6
// bits stay below it (2 * 63 * 127); 8-bit codes q = 16 hi + lo are taken as their two nibbles.
template <int BITS>
inline __m256i dot_add(__m256i acc, __m256i w, __m256i p) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS <= 6) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, p), ones));
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    const __m256i lo = _mm256_and_si256(w, low);
    const __m256i sum = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(hi, p), _mm256_set1_epi16(16)),
        _mm256_madd_epi16(_mm256_maddubs_epi16(lo, p), ones));
    return _mm256_add_epi32(acc, sum);
  }
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

// e^x for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), 2^n through the exponent bits. Inputs below -87 give 0. A NaN
// stays NaN (max/min return their second operand when either is NaN, so x goes second): a
// NaN query (a corrupt adapter) must reach the logits, where its request is failed.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
// exp256 at 16 lanes: the same operations lane by lane, so the same bits.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#else
#define TANDEM_HAVE_KERNEL 0
constexpr const char* kIsa = "none";
#endif

}  // namespace tandem
