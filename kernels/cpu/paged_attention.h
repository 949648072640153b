// Paged attention's pieces for the C++ layers (composed by attend_rows.h): a group of query
// heads' scores over a range of keys, softmax, and value sums over a range of keys, read in
// place from the cache's blocks. A score is one chain of fmas over the head dimension in order
// and an output element one chain over the keys in order (carried in memory between ranges),
// so a row's bits depend on its own context only (never on the other rows of a call, nor on
// how many heads or keys share a load), on every instruction set: AVX-512 builds run the same
// chains 16 lanes wide over float caches (attend_wide.h).
//
// Cache layout (kernels/reference.py): [Hkv, num_blocks, block_size, D] for K and V; a slot is
// block * block_size + offset; block tables are padded with the null block 0. The elements are
// float32, or bfloat16 (EngineConfig.kv_cache_dtype="bfloat16" beside float32 weights: each
// value rounded to nearest even as it is stored, as torch's .to(torch.bfloat16), and widened
// exactly as it is read, so attention over it is attention over those rounded rows); or int8
// codes with scales (kv_int8.h): the pieces take any.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_caches.h"
#include "kv_int8.h"
#include "simd.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL
// Eight elements at p as float32 (bfloat16: its bits in the upper half, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <class T>
inline void axpy(float a, const T* x, float* y, int64_t n) {  // y += a x
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(x + i), _mm256_loadu_ps(y + i)));
  }
}

// In place: s[0:n] = exp(s - max) / sum, returned unnormalized; the sum is the result.
float softmax_unnormalized(float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);  // max is exact in any order
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 m[4];  // four chains: one would wait on each max's latency
  for (__m512& v : m) v = _mm512_set1_ps(-INFINITY);
  for (; j + 64 <= n; j += 64) {
    for (int c = 0; c < 4; ++c) m[c] = _mm512_max_ps(m[c], _mm512_loadu_ps(s + j + 16 * c));
  }
  const __m512 m16 = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
  vmax = _mm256_max_ps(_mm512_castps512_ps256(m16), upper8(m16));
#endif
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float top = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) top = std::max(top, s[j]);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();  // lane j sums s[j], s[j + 8], s[j + 16] ... in order
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 wtop = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {  // 16 exps at once, summed as two eights: the same order
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), wtop));
    _mm512_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, upper8(e));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vtop));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  if (i < n) {  // the tail through a padded buffer (same exp as the body)
    alignas(32) float buf[8] = {0};
    for (int64_t j = i; j < n; ++j) buf[j - i] = s[j];
    const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(buf), vtop));
    _mm256_store_ps(buf, e);
    for (int64_t j = i; j < n; ++j) {
      s[j] = buf[j - i];
      total += s[j];
    }
  }
  return total;
}

// Keys are stored transposed within each cache block: a (kv head, block)'s keys are a
// [D, block_size] slab (key t's element i at i * block_size + t), so eight consecutive keys'
// element i are one load and a score needs no horizontal sum; values stay [block_size, D].
template <class T>
inline T* key_slab(const Cache<T>& kc, int64_t head, int64_t block) { return kc.at(head, block, 0); }

// A token's key k [D] and value v [D] at `offset` of `block` of kv head g (bfloat16: rounded to
// nearest even, as c10::BFloat16 converts).
template <class T>
inline void store_kv(const Cache<T>& kc, const Cache<T>& vc, int64_t g, int64_t block,
                     int64_t offset, const float* k, const float* v, int64_t d) {
  T* slab = key_slab(kc, g, block);
  for (int64_t i = 0; i < d; ++i) {
    slab[i * kc.block_size + offset] = static_cast<T>(k[i]);  // transposed
  }
  T* row = vc.at(g, block, offset);
  for (int64_t i = 0; i < d; ++i) row[i] = static_cast<T>(v[i]);
}

// Lanes [0, count) of 8 elements at p (masked: a block's last chunk may hold fewer than 8 keys).
inline __m256 load_lanes(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
}
inline __m256 load_lanes(const BF16* p, int64_t count) {
  if (count >= 8) return load8(p);
  alignas(16) uint16_t buf[8] = {0};
  std::memcpy(buf, p, count * sizeof(BF16));
  return load8(reinterpret_cast<const BF16*>(buf));
}

// One block's keys [off, off + lanes) (block offsets), VECS vectors of eight: the scores of
// keys [lo, hi) go to scores[r * stride + key0 + t]. Each score is one chain of fmas over i in
// order, whatever VECS is (two vectors give each head two chains, hiding the fma latency).
template <int HEADS, int VECS, class T>
inline void score_block(const float* q, int64_t d, const T* slab, int64_t bs, int64_t off,
                        int64_t lanes, int64_t key0, int64_t lo, int64_t hi, __m256 vscale,
                        float* scores, int64_t stride) {
  __m256 acc[HEADS][VECS];
  for (int r = 0; r < HEADS; ++r) {
    for (int v = 0; v < VECS; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < d; ++i) {
    __m256 k[VECS];
    for (int v = 0; v < VECS; ++v) k[v] = load_lanes(slab + i * bs + off + 8 * v, lanes - 8 * v);
    for (int r = 0; r < HEADS; ++r) {
      const __m256 qi = _mm256_set1_ps(q[r * d + i]);
      for (int v = 0; v < VECS; ++v) acc[r][v] = _mm256_fmadd_ps(qi, k[v], acc[r][v]);
    }
  }
  alignas(32) float out[HEADS][8 * VECS];
  for (int r = 0; r < HEADS; ++r) {
    for (int v = 0; v < VECS; ++v) _mm256_store_ps(out[r] + 8 * v, _mm256_mul_ps(acc[r][v], vscale));
  }
  for (int r = 0; r < HEADS; ++r) {
    for (int64_t t = lo; t < hi; ++t) scores[r * stride + key0 + t] = out[r][t - off];
  }
}

template <int HEADS, class T>
void score_keys(const float* q, int64_t d, const Cache<T>& kc, int64_t g, const int64_t* table,
                int64_t first, int64_t n, float scale, float* scores, int64_t stride) {
  const int64_t bs = kc.block_size, end = first + n;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t start = first - first % bs; start < end; start += bs) {  // one block
    const T* slab = key_slab(kc, g, table[start / bs]);
    for (int64_t off = 0; off < bs && start + off < end;) {  // sixteen keys, else eight
      const int64_t lanes = std::min<int64_t>(16, bs - off);
      const int64_t lo = std::max<int64_t>(start + off, first) - start;
      const int64_t hi = std::min(start + off + lanes, end) - start;
      if (lanes > 8) {
        score_block<HEADS, 2>(q, d, slab, bs, off, lanes, start - first, lo, hi, vscale, scores,
                              stride);
      } else {
        score_block<HEADS, 1>(q, d, slab, bs, off, lanes, start - first, lo, hi, vscale, scores,
                              stride);
      }
      off += lanes;
    }
  }
}

// o_r[i] += sum_t p_r[t] v_t[i] for heads r < HEADS (p_r = p + r * stride, o_r = o + r * d)
// and keys t in [first, first + n) (p_r[0] is key first's): each element one chain of fmas in
// key order, carried in o (a float stored and reloaded is exact, so summing a row's keys a tile
// at a time continues the one chain), a block's values read in sequence, each value row loaded
// once for the HEADS heads sharing it.
template <int CHUNKS, int HEADS, class T>  // CHUNKS = D / 8
void sum_values(const float* p, int64_t stride, int64_t d, const Cache<T>& vc, int64_t g,
                const int64_t* table, int64_t first, int64_t n, float* o) {
  const int64_t bs = vc.block_size, end = first + n;
  __m256 acc[HEADS][CHUNKS];
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_loadu_ps(o + r * d + 8 * c);
  }
  for (int64_t start = first - first % bs; start < end; start += bs) {  // one block
    const T* block = vc.at(g, table[start / bs], 0);
    const int64_t lo = std::max(start, first), hi = std::min(start + bs, end);
    for (int64_t pos = lo; pos < hi; ++pos) {
      const T* v = block + (pos - start) * vc.slot_stride;
      __m256 w[HEADS];
      for (int r = 0; r < HEADS; ++r) w[r] = _mm256_set1_ps(p[r * stride + pos - first]);
      for (int c = 0; c < CHUNKS; ++c) {
        const __m256 vc8 = load8(v + 8 * c);
        for (int r = 0; r < HEADS; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], vc8, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(o + r * d + 8 * c, acc[r][c]);
  }
}

// The same sum for any D (a multiple of 8), one head.
template <class T>
void sum_values_any(const float* p, int64_t d, const Cache<T>& vc, int64_t g, const int64_t* table,
                    int64_t first, int64_t n, float* o) {
  const int64_t bs = vc.block_size, end = first + n;
  for (int64_t start = first - first % bs; start < end; start += bs) {
    const T* block = vc.at(g, table[start / bs], 0);
    for (int64_t pos = std::max(start, first); pos < std::min(start + bs, end); ++pos) {
      axpy(p[pos - first], block + (pos - start) * vc.slot_stride, o, d);
    }
  }
}


// Heads whose scores (values) share each load of the keys (values): as many as keep the
// accumulators in registers (32 vector registers with AVX-512VL, 16 without).
#if defined(__AVX512VL__)
constexpr int kValueHeads64 = 3, kValueHeads128 = 1, kScoreHeads = 8;
#else
constexpr int kValueHeads64 = 1, kValueHeads128 = 1, kScoreHeads = 4;
#endif

// Heads [r, r + count) of a group: their value sums, count <= kValueHeads64 for D = 64.
template <int CHUNKS, int MAXH, class KV>
void sum_heads(const float* p, int64_t stride, int64_t d, const KV& vc, int64_t g,
               const int64_t* table, int64_t first, int64_t n, float* o, int64_t count) {
  if constexpr (MAXH >= 3) {
    if (count == 3) return sum_values<CHUNKS, 3>(p, stride, d, vc, g, table, first, n, o);
  }
  if constexpr (MAXH >= 2) {
    if (count == 2) return sum_values<CHUNKS, 2>(p, stride, d, vc, g, table, first, n, o);
  }
  sum_values<CHUNKS, 1>(p, stride, d, vc, g, table, first, n, o);
}

// o [group, D] += a group's value sums over keys [first, first + n) (a float32, bfloat16 or
// int8 cache), p [group, stride] their softmax numerators from key first's on: as many heads per
// pass as keep their sums in registers.
template <class KV>
void sum_group(const float* p, int64_t stride, int64_t d, const KV& vc, int64_t g,
               const int64_t* table, int64_t first, int64_t n, float* o, int64_t group) {
  const int64_t per = d == 64 ? kValueHeads64 : d == 128 ? kValueHeads128 : 1;
  for (int64_t r = 0; r < group; r += per) {
    const int64_t count = std::min(per, group - r);
    const float* pr = p + r * stride;
    float* out = o + r * d;
    switch (d) {
      case 64: sum_heads<8, kValueHeads64>(pr, stride, d, vc, g, table, first, n, out, count); break;
      case 128: sum_heads<16, kValueHeads128>(pr, stride, d, vc, g, table, first, n, out, count); break;
      default:
        for (int64_t h = 0; h < count; ++h) {
          sum_values_any(pr + h * stride, d, vc, g, table, first, n, out + h * d);
        }
    }
  }
}

// scores [group, stride] from column 0 = a group's scaled scores of keys [first, first + n):
// up to kScoreHeads heads share each load of the keys.
template <class KV>
void score_group(const float* q, int64_t d, const KV& kc, int64_t g, const int64_t* table,
                 int64_t first, int64_t n, float scale, float* scores, int64_t stride,
                 int64_t group) {
  for (int64_t r = 0; r < group;) {
    const int64_t heads = std::min<int64_t>(kScoreHeads, group - r);
    float* s = scores + r * stride;
    const float* qr = q + r * d;
    switch (heads) {
#if defined(__AVX512VL__)
      case 8: score_keys<8>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      case 7: score_keys<7>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      case 6: score_keys<6>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      case 5: score_keys<5>(qr, d, kc, g, table, first, n, scale, s, stride); break;
#endif
      case 4: score_keys<4>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      case 3: score_keys<3>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      case 2: score_keys<2>(qr, d, kc, g, table, first, n, scale, s, stride); break;
      default: score_keys<1>(qr, d, kc, g, table, first, n, scale, s, stride); break;
    }
    r += heads;
  }
}

#endif

}  // namespace
}  // namespace tandem
