// The tandem kernel's weight layout (quant_matmul.cpp's header comment): sizes, and the loads
// that turn a tile's stored scales or offsets (float32, float16, K-quant super-blocks) and its
// 5- and 6-bit codes' higher bits into the float32 and byte vectors the dot loop uses.
#pragma once

#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace tandem::layout {

constexpr int64_t G = 32;
constexpr int64_t kTile = 16;  // output rows per tile
constexpr int64_t kSuperGroups = 8;  // groups per K-quant super-block
constexpr int64_t kSuperBytes = 2 * kTile + kSuperGroups * kTile;  // one tile's super-block
constexpr int64_t kQ6Bytes = 2 * kTile + 2 * kSuperGroups * kTile;  // Q6_K's: 16 sub-blocks

// Bytes of one tile's group of codes: 4 bits two to a byte; 5 and 6 bits the same, then their
// higher bits in 64 (5-bit) or 128 bytes (6-bit, `high_bits`); 8 bits one to a byte.
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

// The higher bits of 5- and 6-bit codes lie byte-sliced after the 256 bytes of low nibbles:
// HB = BITS - 4 bits a code, 8 / HB chunks to a byte, chunk c's bits for its byte j at bits
// HB (c % (8 / HB)) and up of byte 64 (c / (8 / HB)) + j. high_bits: chunk c's bits moved to
// bits 4.. of each byte, the rest clear, from v, the (part of the) 64 bytes holding them. A
// 16-bit lane shift, because the field read after it comes from the same byte: bits 4..3+HB
// after the shift were bits `at`..at+HB-1 before, all within 0..7.
template <int BITS, typename V>
[[gnu::always_inline]] inline V high_bits(V v, int c) {
  constexpr int hb = BITS - 4;
  const int at = hb * (c % (8 / hb));
  const char mask = static_cast<char>(((1 << hb) - 1) << 4);
  if constexpr (sizeof(V) == 32) {
    v = at <= 4 ? _mm256_slli_epi16(v, 4 - at) : _mm256_srli_epi16(v, at - 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(mask));
  } else {
#if TANDEM_AVX512
    v = at <= 4 ? _mm512_slli_epi16(v, 4 - at) : _mm512_srli_epi16(v, at - 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(mask));
#endif
  }
}
#endif

}  // namespace tandem::layout
