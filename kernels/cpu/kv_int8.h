// The int8 KV cache (EngineConfig.kv_cache_dtype="int8") for the C++ layers (fused_layer.cpp):
// each (kv head, slot) row of D values is stored as D int8 codes and a float32 scale per group
// of G values, symmetric as llama.cpp's Q8_0: s = max|x| / 127 over the group, code =
// round-half-even(x / s), x ~ code s (an error of at most s / 2 per value; the quality rule:
// engine/models/kv_cache.py). Keys and values have their own G: a key's group is 8 values
// (kKeyGroup), a value's 32 (16 or 8 where D is not a multiple of 32). Rotated keys carry a few
// outlier dims (Qwen2.5's most of all) that take the levels of the rest of their group: with
// K in groups of 32 Qwen2.5-Coder-0.5B missed the rule (perplexity x1.018, top-1 94.0%), in
// groups of 8 it meets it; values have no such dims, and groups of 32 cost 1/8 more bytes than
// a scale per row. rope_store writes rows this way as K and V are stored; attend reads them in
// place, widening eight codes at a time to float, applying the scales to each key group's
// partial score and to each value's eight widened codes (shared by the heads that read them):
// no float copy of the cache is made.
//
// Layout (kernels/kv_int8.py, the torch reference): a layer's K cache and its V cache are int8
// tensors [Hkv, num_blocks, block_size, D + 4 D / G] (each with its own G, so the two rows
// differ in width: D = 64 gives 96 and 72 bytes); each (head, block) holds the codes first,
// then the scales as float32 [D / G, block_size] (group j of slot t at j * block_size + t). Key
// codes are transposed within the block ([D, block_size], as the float cache's keys: eight
// keys' element i are one load); value codes are [block_size, D]. D is a multiple of 8, so
// every scale is 4-byte aligned.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace tandem {

// Values per scale: a key's 8; a value's 32, or the largest of 16 and 8 that divides D.
constexpr int64_t kKeyGroup = 8;
inline int64_t value_group(int64_t d) { return d % 32 == 0 ? 32 : d % 16 == 0 ? 16 : 8; }
inline int64_t scale_group(int64_t d, bool is_key) { return is_key ? kKeyGroup : value_group(d); }

inline int64_t int8_row_bytes(int64_t d, bool is_key) { return d + 4 * (d / scale_group(d, is_key)); }

struct Int8Cache {
  int8_t* data;
  int64_t head_stride, block_stride, block_size, head_dim, group;
  int8_t* codes(int64_t head, int64_t block) const {
    return data + head * head_stride + block * block_stride;
  }
  float* scales(int64_t head, int64_t block) const {
    return reinterpret_cast<float*>(codes(head, block) + head_dim * block_size);
  }
};

inline Int8Cache int8_view(at::Tensor& cache, int64_t num_kv_heads, int64_t head_dim,
                           bool is_key) {
  const int64_t width = int8_row_bytes(head_dim, is_key);
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 4 &&
                  cache.size(0) == num_kv_heads && cache.size(3) == width &&
                  cache.stride(3) == 1 && cache.stride(2) == width &&
                  cache.stride(1) == cache.size(2) * width,
              "tandem_cpu: int8 caches must be [Hkv, num_blocks, block_size, D + 4 D / G] (G: 8 "
              "for K, 32 for V where D allows), each block contiguous");
  return {cache.data_ptr<int8_t>(), cache.stride(0), cache.stride(1), cache.size(2), head_dim,
          scale_group(head_dim, is_key)};
}

// One row x [d] in groups of `group`: codes[i * stride] = round(x[i] / s_j) with
// scales[j * scale_stride] = s_j = max|x| / 127 over group j (0 for a zero group, its codes 0).
// A group holding a non-finite value gets codes 0 and s = NaN, so the scores that read it turn
// NaN as a float cache's would (the engine then fails the request alone).
inline void quantize_row(const float* x, int64_t d, int64_t group, int8_t* codes,
                         int64_t stride, float* scales, int64_t scale_stride) {
  for (int64_t j = 0; j < d; j += group) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = j; i < j + group; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = finite ? amax / 127.0f : NAN;
    for (int64_t i = j; i < j + group; ++i) {
      // |x / s| <= 127 (to rounding), so the code fits; the default rounding mode is to even
      codes[i * stride] = scale > 0.0f ? static_cast<int8_t>(std::nearbyint(x[i] / scale)) : 0;
    }
    scales[(j / group) * scale_stride] = scale;
  }
}

// A token's key k [D] and value v [D] at `offset` of `block` of kv head g.
inline void store_kv(const Int8Cache& kc, const Int8Cache& vc, int64_t g, int64_t block,
                     int64_t offset, const float* k, const float* v, int64_t d) {
  const int64_t bs = kc.block_size;
  quantize_row(k, d, kc.group, kc.codes(g, block) + offset, bs, kc.scales(g, block) + offset, bs);
  quantize_row(v, d, vc.group, vc.codes(g, block) + offset * d, 1, vc.scales(g, block) + offset,
               bs);
}

#if TANDEM_HAVE_KERNEL
// Codes [0, count) of eight at p widened to float (the rest 0).
inline __m256 load_codes(const int8_t* p, int64_t count) {
  __m128i bytes;
  if (count >= 8) {
    bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {
    int64_t buf = 0;
    std::memcpy(&buf, p, count);
    bytes = _mm_cvtsi64_si128(buf);
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Scales [0, count) of eight at p (the rest 0: a block's last eight may be fewer).
inline __m256 load_scales(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
}

// As score_keys over a float cache: scores[r * stride + t - first] = (sum_j s_tj sum_{i in
// group j} q_r[i] code_t[i]) scale, each group's sum one chain of fmas over i in order, eight
// keys at a time.
template <int HEADS>
void score_keys(const float* q, int64_t d, const Int8Cache& kc, int64_t g, const int64_t* table,
                int64_t first, int64_t n, float scale, float* scores, int64_t stride) {
  const int64_t bs = kc.block_size, end = first + n;
  for (int64_t start = first - first % bs; start < end; start += bs) {  // one block
    const int64_t block = table[start / bs];
    const int8_t* slab = kc.codes(g, block);
    const float* key_scales = kc.scales(g, block);
    for (int64_t off = 0; off < bs && start + off < end; off += 8) {  // eight keys
      const int64_t lanes = std::min<int64_t>(8, bs - off);
      __m256 total[HEADS];
      for (int r = 0; r < HEADS; ++r) total[r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += kc.group) {
        __m256 acc[HEADS];
        for (int r = 0; r < HEADS; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t i = j; i < j + kc.group; ++i) {
          const __m256 k = load_codes(slab + i * bs + off, lanes);
          for (int r = 0; r < HEADS; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(q[r * d + i]), k, acc[r]);
        }
        const __m256 vs = load_scales(key_scales + (j / kc.group) * bs + off, lanes);
        for (int r = 0; r < HEADS; ++r) total[r] = _mm256_fmadd_ps(acc[r], vs, total[r]);
      }
      alignas(32) float out[HEADS][8];
      for (int r = 0; r < HEADS; ++r) _mm256_store_ps(out[r], _mm256_mul_ps(total[r], _mm256_set1_ps(scale)));
      const int64_t lo = std::max<int64_t>(start + off, first), hi = std::min(start + off + lanes, end);
      for (int r = 0; r < HEADS; ++r) {
        for (int64_t t = lo; t < hi; ++t) scores[r * stride + t - first] = out[r][t - start - off];
      }
    }
  }
}

// As sum_values over a float cache, over the rows as stored: o_r[i] += sum_t p_r[t] (code_t[i]
// s_t(i)) for heads r < HEADS (p_r = p + r * stride, o_r = o + r * d), in key order (s_t(i):
// the scale of the group of slot t's value that holds i): each row's eight codes widened and
// scaled once for the HEADS heads sharing it, each element one chain of fmas carried in o, as
// the float cache's sum over the dequantized rows.
template <int CHUNKS, int HEADS>  // CHUNKS = D / 8
void sum_values(const float* p, int64_t stride, int64_t d, const Int8Cache& vc, int64_t g,
                const int64_t* table, int64_t first, int64_t n, float* o) {
  const int64_t bs = vc.block_size, group = vc.group;
  __m256 acc[HEADS][CHUNKS];
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_loadu_ps(o + r * d + 8 * c);
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t, block = table[pos / bs], off = pos % bs;
    const int8_t* v = vc.codes(g, block) + off * d;
    const float* s = vc.scales(g, block) + off;  // group j's at s[j * bs]
    __m256 w[HEADS];
    for (int r = 0; r < HEADS; ++r) w[r] = _mm256_set1_ps(p[r * stride + t]);
    for (int c = 0; c < CHUNKS; ++c) {
      const __m256 x = _mm256_mul_ps(load_codes(v + 8 * c, 8), _mm256_set1_ps(s[(8 * c / group) * bs]));
      for (int r = 0; r < HEADS; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(o + r * d + 8 * c, acc[r][c]);
  }
}

// The same sum for any D (a multiple of 8), one head.
inline void sum_values_any(const float* p, int64_t d, const Int8Cache& vc, int64_t g,
                           const int64_t* table, int64_t first, int64_t n, float* o) {
  const int64_t bs = vc.block_size;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t, block = table[pos / bs], off = pos % bs;
    const int8_t* v = vc.codes(g, block) + off * d;
    const float* s = vc.scales(g, block) + off;
    const __m256 w = _mm256_set1_ps(p[t]);
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 x = _mm256_mul_ps(load_codes(v + i, 8), _mm256_set1_ps(s[(i / vc.group) * bs]));
      _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, x, _mm256_loadu_ps(o + i)));
    }
  }
}
#endif

}  // namespace tandem
