// The tandem kernel's weight layout (quant_matmul.cpp's header comment): sizes, and the loads
// that turn a tile's stored scales or offsets (float32, float16, K-quant super-blocks) and its
// 5- and 6-bit code planes into the float32 and byte vectors the dot loop uses.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace tandem::layout {

constexpr int64_t G = 32;
constexpr int64_t kTile = 16;  // output rows per tile
constexpr int64_t kSuperGroups = 8;  // groups per K-quant super-block
constexpr int64_t kSuperBytes = 2 * kTile + kSuperGroups * kTile;  // one tile's super-block
constexpr int64_t kQ6Bytes = 2 * kTile + 2 * kSuperGroups * kTile;  // Q6_K's: 16 sub-blocks

// Bytes of one tile's group of codes: 4 bits two to a byte; 5 and 6 bits the same, then a
// 64-byte plane per higher bit; 8 bits one to a byte.
constexpr int64_t unit_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }

struct Super {};  // the parameter types of Params::kSuper and kQ6 (bytes read as they lie)
struct Q6 {};
struct Centered {};  // Params::kCentered: float16 d; m = center(bits) d is formed, not stored

// A centered type's offset per unit of scale (Q4_0, Q5_0, Q8_0: w = d (q - 2^(bits - 1))):
// a power of two, so m = center(bits) d is exact in float32, the value the file's m is.
constexpr float center(int bits) { return -static_cast<float>(1 << (bits - 1)); }

// Bytes of one tile's scales (or offsets), all its groups.
template <typename S>
constexpr int64_t tile_param_bytes(int64_t groups) {
  if constexpr (std::is_same_v<S, Super>) {
    return groups / kSuperGroups * kSuperBytes;
  } else if constexpr (std::is_same_v<S, Q6>) {
    return groups / kSuperGroups * kQ6Bytes;
  } else if constexpr (std::is_same_v<S, Centered>) {
    return groups * kTile * 2;
  } else {
    return groups * kTile * static_cast<int64_t>(sizeof(S));
  }
}

#if TANDEM_HAVE_KERNEL
// Group g's 16 (or 8, from row 8 half) scales or offsets as float32, from a tile's parameters
// p in float32, float16 or super-blocks (exact every way); Centered: its float16 d.
#if TANDEM_AVX512
template <typename S>
inline __m512 params16(const uint8_t* p, int64_t g) {
  if constexpr (std::is_same_v<S, Super>) {
    const uint8_t* block = p + g / kSuperGroups * kSuperBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    const __m128i sub = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(block + 2 * kTile + g % kSuperGroups * kTile));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub)));
  } else if constexpr (sizeof(S) == 2 || std::is_same_v<S, Centered>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * kTile * g)));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + kTile * g);
  }
}
#endif
template <typename S>
inline __m256 params8(const uint8_t* p, int64_t g, int half) {
  if constexpr (std::is_same_v<S, Super>) {
    const uint8_t* block = p + g / kSuperGroups * kSuperBytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * half)));
    const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        block + 2 * kTile + g % kSuperGroups * kTile + 8 * half));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sub)));
  } else if constexpr (sizeof(S) == 2 || std::is_same_v<S, Centered>) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * (kTile * g + 8 * half))));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + kTile * g + 8 * half);
  }
}

// Q6_K: group g's half h (sub-block 2 (g % 8) + h) scales s = d sc as float32 (exact).
#if TANDEM_AVX512
inline __m512 q6_scales16(const uint8_t* p, int64_t g, int h) {
  const uint8_t* block = p + g / kSuperGroups * kQ6Bytes;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  const __m128i sc = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(block + 2 * kTile + (2 * (g % kSuperGroups) + h) * kTile));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
}
#endif
inline __m256 q6_scales8(const uint8_t* p, int64_t g, int h, int half) {
  const uint8_t* block = p + g / kSuperGroups * kQ6Bytes;
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * half)));
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
      block + 2 * kTile + (2 * (g % kSuperGroups) + h) * kTile + 8 * half));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
}

// 32 bits of a plane -> 32 bytes, byte b `value` where bit b is set (the 256-bit paths' 5- and
// 6-bit codes).
inline __m256i plane_bytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}
#endif

}  // namespace tandem::layout
