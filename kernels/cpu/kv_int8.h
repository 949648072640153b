// The int8 KV cache (EngineConfig.kv_cache_dtype="int8") for the C++ layers (fused_layer.cpp):
// each (kv head, slot) row of D values is stored as D int8 codes and a float32 scale per group
// of G = 32 values (G = 16 or 8 where D is not a multiple of 32), symmetric as llama.cpp's
// Q8_0: s = max|x| / 127 over the group, code = round-half-even(x / s), x ~ code s (an error of
// at most s / 2 per value; the quality rule: engine/models/kv_cache.py). A group of 32 keeps a
// key's few large rotated dims from taking the levels of the rest, for 1/8 more bytes than a
// scale per row. rope_store writes rows this way as K and V are stored; attend
// reads them in place, widening eight codes at a time to float and applying the scales to each
// group's partial score and to each value group's softmax weight: no float copy is made.
//
// Layout (kernels/kv_int8.py, the torch reference): a layer's K or V cache is an int8 tensor
// [Hkv, num_blocks, block_size, D + 4 D / G]; each (head, block) holds the codes first, then
// the scales as float32 [D / G, block_size] (group j of slot t at j * block_size + t). Key codes
// are transposed within the block ([D, block_size], as the float cache's keys: eight keys'
// element i are one load); value codes are [block_size, D]. D is a multiple of 8, so every
// scale is 4-byte aligned.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace tandem {

// Values per scale: 32, or the largest of 16 and 8 that divides D.
inline int64_t scale_group(int64_t d) { return d % 32 == 0 ? 32 : d % 16 == 0 ? 16 : 8; }

inline int64_t int8_row_bytes(int64_t d) { return d + 4 * (d / scale_group(d)); }

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

inline Int8Cache int8_view(at::Tensor& cache, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t width = int8_row_bytes(head_dim);
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 4 &&
                  cache.size(0) == num_kv_heads && cache.size(3) == width &&
                  cache.stride(3) == 1 && cache.stride(2) == width &&
                  cache.stride(1) == cache.size(2) * width,
              "tandem_cpu: int8 caches must be [Hkv, num_blocks, block_size, D + 4 D / G], "
              "each block contiguous");
  return {cache.data_ptr<int8_t>(), cache.stride(0), cache.stride(1), cache.size(2), head_dim,
          scale_group(head_dim)};
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
        alignas(32) float s[8] = {0};
        std::copy_n(key_scales + (j / kc.group) * bs + off, lanes, s);
        const __m256 vs = _mm256_load_ps(s);
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

// As sum_values over a float cache: o[i] = (sum_t p_t s_t(i) code_t[i]) inv, in key order
// (s_t(i): the scale of the group of slot t's value that holds i).
template <int CHUNKS>  // D / 8, or 0: any D (the same steps through memory)
void sum_values(const float* p, int64_t d, const Int8Cache& vc, int64_t g, const int64_t* table,
                int64_t first, int64_t n, float inv, float* o) {
  const int64_t bs = vc.block_size;
  if constexpr (CHUNKS > 0) {
    __m256 acc[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t, block = table[pos / bs], off = pos % bs;
      const int8_t* v = vc.codes(g, block) + off * d;
      const float* s = vc.scales(g, block) + off;  // group j's at s[j * bs]
      for (int c = 0; c < CHUNKS; ++c) {
        const __m256 w = _mm256_set1_ps(p[t] * s[(8 * c / vc.group) * bs]);
        acc[c] = _mm256_fmadd_ps(w, load_codes(v + 8 * c, 8), acc[c]);
      }
    }
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
  } else {
    std::fill_n(o, d, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t, block = table[pos / bs], off = pos % bs;
      const int8_t* v = vc.codes(g, block) + off * d;
      const float* s = vc.scales(g, block) + off;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 w = _mm256_set1_ps(p[t] * s[(i / vc.group) * bs]);
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(w, load_codes(v + i, 8), _mm256_loadu_ps(o + i)));
      }
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vinv));
  }
}
#endif

}  // namespace tandem
