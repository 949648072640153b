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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIsa = "avx512-vnni";
constexpr bool kSigned8 = false;
inline __m256i dot_u8s8(__m256i a, __m256i b) {  // 8 lanes, each sum of 4 products
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}
#elif defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
constexpr bool kSigned8 = false;
inline __m256i dot_u8s8(__m256i a, __m256i b) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
}
#else
constexpr const char* kIsa = "avx2";
constexpr bool kSigned8 = true;
inline __m256i dot_u8s8(__m256i a, __m256i b) {  // exact while |a b + a' b'| < 2^15
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
#endif

// 8-bit weights against int8 activations.
inline __m256i dot_w8(__m256i w, __m256i p) {
  if constexpr (kSigned8) {  // |w| <= 128, |p| <= 127: pairs stay below 2^15
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(p, w));
  } else {
    return dot_u8s8(w, p);
  }
}

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
// (relative error < 2e-7), 2^n through the exponent bits. Inputs below -87 give 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
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

#else
#define TANDEM_HAVE_KERNEL 0
constexpr const char* kIsa = "none";
constexpr bool kSigned8 = false;
#endif

}  // namespace tandem
