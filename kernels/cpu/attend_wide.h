// Paged attention at 16 lanes (AVX-512) over float32 and bfloat16 caches, for attend_rows.h:
// the query heads of several rows of one request share each load of a tile's keys and values.
// A request's verification rows (or a prompt chunk's) attend the same keys; with one row's
// group of heads per load (3 for SmolLM2) every fma waited on a load from L2, so a 16-row
// verification step ran at a quarter of the fma rate. Here a pass scores up to 8 (row, head)
// pairs per load of 16 keys and sums up to 6 (D = 64) per load of a value row.
//
// Bits: a lane is one key (scores) or one dimension (value sums). A score is one chain of fmas
// over the head dimension in order from zero, then times the scale; an output element one
// chain of fmas over the row's keys in order, carried in memory across tiles and passes (a
// float stored and reloaded is exact). Which heads share a pass, the keys a pass scores past a
// row's context (scored, never stored) and the tile size change no chain: a row's bits depend
// on its own context only, as paged_attention.h's 8-lane pieces', whose chains these are.
#pragma once

#include <algorithm>
#include <type_traits>

#include "kv_caches.h"
#include "paged_attention.h"
#include "simd.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TANDEM_WIDE_ATTENTION 1

// One query head of one row: its keys [first, end) of the request's context.
struct HeadRow {
  const float* q;  // [D]
  float* scores;   // key t's score (then softmax numerator) at scores[t - first]
  float* o;        // [D] the value sums, carried across tiles
  int64_t first, end;
};

// Sixteen elements at p as float32 (bfloat16: its bits in the upper half, exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BF16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// RUNS runs of 16 keys from key `start` on (run v's key t element i at keys[v][i * bs + t]: a
// slab's columns), scored against heads h[0, HEADS): head r's scaled score of key start + 16 v
// + t is stored where that key is inside [h[r].first, h[r].end). HEADS x RUNS chains hide the
// fma latency.
template <int HEADS, int RUNS, class T>
inline void score_runs(const HeadRow* h, int64_t d, const T* const* keys, int64_t bs,
                       __m512 vscale, int64_t start) {
  __m512 acc[HEADS][RUNS];
  for (int r = 0; r < HEADS; ++r) {
    for (int v = 0; v < RUNS; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < d; ++i) {
    __m512 k[RUNS];
    for (int v = 0; v < RUNS; ++v) k[v] = load16(keys[v] + i * bs);
    for (int r = 0; r < HEADS; ++r) {
      const __m512 qi = _mm512_set1_ps(h[r].q[i]);
      for (int v = 0; v < RUNS; ++v) acc[r][v] = _mm512_fmadd_ps(qi, k[v], acc[r][v]);
    }
  }
  for (int v = 0; v < RUNS; ++v) {
    const int64_t at = start + 16 * v;  // the run's first key
    for (int r = 0; r < HEADS; ++r) {
      const int64_t lo = std::max<int64_t>(0, h[r].first - at);
      const int64_t hi = std::min<int64_t>(16, h[r].end - at);
      if (lo >= hi) continue;
      const __m512 out = _mm512_mul_ps(acc[r][v], vscale);
      float* row = h[r].scores + (at - h[r].first);
      if (lo == 0 && hi == 16) {
        _mm512_storeu_ps(row, out);
      } else {  // the head's keys of the run, packed to the front: stored from its key lo
        const auto mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
        _mm512_mask_compressstoreu_ps(row + lo, mask, out);
      }
    }
  }
}

// Heads h[0, HEADS) scored over keys [lo, hi) (a block size that is a multiple of 16: a run
// never straddles a block, so every load is whole).
template <int HEADS, class T>
void score_wide(const HeadRow* h, int64_t d, const Cache<T>& kc, int64_t g,
                const int64_t* table, int64_t lo, int64_t hi, __m512 vscale) {
  constexpr int kRuns = 3;  // HEADS <= 8: 24 accumulators, 3 keys, a query (32 registers)
  const int64_t bs = kc.block_size;
  for (int64_t start = lo - lo % 16; start < hi;) {
    const int runs = static_cast<int>(std::min<int64_t>(kRuns, (hi - start + 15) / 16));
    const T* keys[kRuns];
    for (int v = 0; v < runs; ++v) {
      const int64_t at = start + 16 * v;
      keys[v] = key_slab(kc, g, table[at / bs]) + at % bs;
    }
    switch (runs) {
      case 3: score_runs<HEADS, 3>(h, d, keys, bs, vscale, start); break;
      case 2: score_runs<HEADS, 2>(h, d, keys, bs, vscale, start); break;
      default: score_runs<HEADS, 1>(h, d, keys, bs, vscale, start); break;
    }
    start += 16 * runs;
  }
}

// o += sum_t p[t] v_t over keys t in [lo, hi) for heads h[0, HEADS) (p: a head's numerators,
// at scores[t - first]), in key order, each value row loaded once for all of them. ZMMS = D / 16.
template <int ZMMS, int HEADS, class T>
void sum_wide(const HeadRow* h, const Cache<T>& vc, int64_t g, const int64_t* table,
                int64_t lo, int64_t hi) {
  const int64_t bs = vc.block_size;
  __m512 acc[HEADS][ZMMS];
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < ZMMS; ++c) acc[r][c] = _mm512_loadu_ps(h[r].o + 16 * c);
  }
  for (int64_t start = lo - lo % bs; start < hi; start += bs) {  // one block
    const T* block = vc.at(g, table[start / bs], 0);
    for (int64_t pos = std::max(start, lo); pos < std::min(start + bs, hi); ++pos) {
      const T* v = block + (pos - start) * vc.slot_stride;
      __m512 w[HEADS];
      for (int r = 0; r < HEADS; ++r) w[r] = _mm512_set1_ps(h[r].scores[pos - h[r].first]);
      for (int c = 0; c < ZMMS; ++c) {
        const __m512 v16 = load16(v + 16 * c);
        for (int r = 0; r < HEADS; ++r) acc[r][c] = _mm512_fmadd_ps(w[r], v16, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < ZMMS; ++c) _mm512_storeu_ps(h[r].o + 16 * c, acc[r][c]);
  }
}

// Heads per pass that scores (3 runs of keys each: 24 accumulators).
constexpr int kWideScoreHeads = 8;
// Where the wide kernels run: float caches (int8 takes paged_attention.h's pieces), keys in
// whole runs of 16 (the block size a multiple of 16), D = 64 or 128.
template <class KV>
bool wide_attention(const KV& kc, int64_t d) {
  if constexpr (std::is_same_v<KV, Int8Cache>) {
    return false;
  } else {
    return kc.block_size % 16 == 0 && (d == 64 || d == 128);
  }
}

// f<COUNT>() for count in [1, MAX] (count heads of a pass, a template argument).
template <int MAX, class F>
inline void with_count(int count, F&& f) {
  if constexpr (MAX > 1) {
    if (count == MAX) return f.template operator()<MAX>();
    return with_count<MAX - 1>(count, f);
  } else {
    f.template operator()<1>();
  }
}

// Each of heads h[0, count)'s scores over its keys in [k0, k1) (every head's range meets it),
// up to kWideScoreHeads per load of the keys: a pass scores the union of its heads' ranges.
template <class T>
void score_tile(const HeadRow* h, int64_t count, int64_t d, const Cache<T>& kc, int64_t g,
                const int64_t* table, int64_t k0, int64_t k1, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t p = 0; p < count; p += kWideScoreHeads) {
    const int n = static_cast<int>(std::min<int64_t>(kWideScoreHeads, count - p));
    int64_t lo = k1, hi = k0;
    for (int r = 0; r < n; ++r) {
      lo = std::min(lo, std::max(k0, h[p + r].first));
      hi = std::max(hi, std::min(k1, h[p + r].end));
    }
    with_count<kWideScoreHeads>(
        n, [&]<int N>() { score_wide<N>(h + p, d, kc, g, table, lo, hi, vscale); });
  }
}

// Each of heads h[0, count)'s value sums over its keys in [k0, k1), a pass of heads sharing
// each load over the keys all of them attend; a head's keys before (after) those are summed
// alone before (after) them, so every chain stays in key order.
template <int ZMMS, class T>
void sum_tile(const HeadRow* h, int64_t count, const Cache<T>& vc, int64_t g,
              const int64_t* table, int64_t k0, int64_t k1) {
  constexpr int kHeads = 24 / ZMMS;  // 24 accumulators
  for (int64_t p = 0; p < count; p += kHeads) {
    const int n = static_cast<int>(std::min<int64_t>(kHeads, count - p));
    int64_t lo = k0, hi = k1;  // the keys all n attend in the tile
    for (int r = 0; r < n; ++r) {
      lo = std::max(lo, h[p + r].first);
      hi = std::min(hi, h[p + r].end);
    }
    for (int r = 0; r < n; ++r) {  // each head's keys before the shared ones (all, if none)
      const int64_t a = std::max(k0, h[p + r].first), b = lo < hi ? lo : std::min(k1, h[p + r].end);
      if (a < b) sum_wide<ZMMS, 1>(h + p + r, vc, g, table, a, b);
    }
    if (lo >= hi) continue;
    with_count<kHeads>(n, [&]<int N>() { sum_wide<ZMMS, N>(h + p, vc, g, table, lo, hi); });
    for (int r = 0; r < n; ++r) {  // and after them
      const int64_t b = std::min(k1, h[p + r].end);
      if (hi < b) sum_wide<ZMMS, 1>(h + p + r, vc, g, table, hi, b);
    }
  }
}
#endif

}  // namespace
}  // namespace tandem
