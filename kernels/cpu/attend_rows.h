// attend_rows for the C++ layers (fused_layer.cpp, dense_layer.cpp): each row's query heads
// over its own context, with the rows of one request sharing each read of the cache. A
// request's verification rows (or a prompt chunk's) attend the same keys; read whole per row,
// one kv head's K and V at a few thousand tokens fall out of L2 and every row reads them from
// memory again. So the keys go a tile at a time: every row of the request scores the tile
// while it is in cache, and after each row's softmax the values go a tile at a time too, each
// row's sums carried across tiles in its output.
//
// Bits: a score is one chain of fmas over the head dimension whichever tile computes it; a
// row's softmax runs over all its scores at once, as before; an output element is one chain
// of fmas over the row's keys in order, stored after one tile and reloaded for the next (a
// float stored and reloaded is exact), then scaled once by the reciprocal sum. Keys past a
// row's context (or before its window) are never scored into its softmax nor summed: a tile
// is cut to each row's own keys. So a row's bits depend on its context only, not on the rows
// beside it, the tile size, how rows are grouped into tasks, nor the block size.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attend_wide.h"
#include "kv_caches.h"
#include "paged_attention.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL
// Keys per tile (rounded down to whole blocks): a tile's keys (D = 64, float32: 16 KiB), and
// then its values, stay in L1 while the piece's rows read them.
constexpr int64_t kTileKeys = 64;
// Rows of one request per task: their scores ([rows, group, context] floats) are held at once.
constexpr int64_t kPieceRows = 16;

// Row i of a piece: its keys [first, end) of the request's context, its scores [group, end -
// first] at offset `at` of the worker's buffer.
struct PieceRow {
  int64_t first, end, at;
};

// Starts of the pieces of a call, then rows.count: runs of consecutive rows of one request (a
// row of the block tables), a run of L rows cut into ceil(L / cap) pieces of near-equal size.
std::vector<int64_t> piece_starts(const Rows& rows, int64_t cap) {
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < rows.count;) {
    int64_t e = b + 1;
    while (e < rows.count && rows.table_of[e] == rows.table_of[b]) ++e;
    const int64_t parts = (e - b + cap - 1) / cap;
    for (int64_t i = 0; i < parts; ++i) starts.push_back(b + (e - b) * i / parts);
    b = e;
  }
  starts.push_back(rows.count);
  return starts;
}

// Per worker, reused across its tasks.
struct Scratch {
  std::vector<PieceRow> rows;
  std::vector<float> scores, invs;
#if TANDEM_WIDE_ATTENTION
  std::vector<HeadRow> heads, meet;  // the piece's (row, head) pairs; those meeting a tile
#endif
};

// f(i, first, n, off) for each row i of the piece whose keys meet the tile [k0, k0 + tile):
// its keys [first, first + n) there, at column off of its scores.
template <class F>
inline void rows_in_tile(const std::vector<PieceRow>& rows, int64_t k0, int64_t tile, F&& f) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t first = std::max(k0, rows[i].first), end = std::min(k0 + tile, rows[i].end);
    if (first < end) f(i, first, end - first, first - rows[i].first);
  }
}

// kv head g over rows [b0, b1) of one request: scores a tile at a time, softmax per row over
// its whole context, value sums a tile at a time. Float caches on AVX-512 (attend_wide.h):
// every (row, head) of the piece that attends a tile shares its loads.
template <class KV>
void attend_piece(const float* qkv, const Heads& hd, const Rows& rows, const KV& kc,
                  const KV& vc, float scale, int64_t window, int64_t g, int64_t b0, int64_t b1,
                  Scratch& s, float* attn) {
  const int64_t d = hd.head_dim, group = hd.num_heads / hd.num_kv_heads;
  s.rows.clear();
  int64_t lo = rows.lens[b0], hi = 0, total = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t len = rows.lens[b];
    TORCH_CHECK(len >= 1 && (len - 1) / kc.block_size < rows.width &&
                    rows.table_of[b] >= 0 && rows.table_of[b] < rows.num_tables,
                "tandem_cpu: a row's context is beyond its block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    s.rows.push_back({first, len, total});
    total += group * (len - first);
    lo = std::min(lo, first);
    hi = std::max(hi, len);
  }
  s.scores.resize(total);
  const int64_t* table = rows.tables + rows.table_of[b0] * rows.width;  // the piece's request
  const int64_t tile = std::max<int64_t>(1, kTileKeys / kc.block_size) * kc.block_size;
  // Row i's group of query heads, its scores [group, stride], its outputs.
  auto q_of = [&](size_t i) { return qkv + (b0 + i) * hd.cols() + g * group * d; };
  auto o_of = [&](size_t i) { return attn + (b0 + i) * hd.q_size() + g * group * d; };
  auto stride_of = [&](size_t i) { return s.rows[i].end - s.rows[i].first; };
#if TANDEM_WIDE_ATTENTION
  bool wide = false;
  if constexpr (!std::is_same_v<KV, Int8Cache>) wide = wide_attention(kc, d);
  s.heads.clear();
  for (size_t i = 0; wide && i < s.rows.size(); ++i) {
    for (int64_t r = 0; r < group; ++r) {
      s.heads.push_back({q_of(i) + r * d, s.scores.data() + s.rows[i].at + r * stride_of(i),
                         o_of(i) + r * d, s.rows[i].first, s.rows[i].end});
    }
  }
  auto meeting = [&](int64_t k0) {  // the pairs whose keys meet the tile [k0, k0 + tile)
    s.meet.clear();
    for (const HeadRow& h : s.heads) {
      if (h.first < k0 + tile && h.end > k0) s.meet.push_back(h);
    }
  };
#endif
  for (int64_t k0 = lo - lo % tile; k0 < hi; k0 += tile) {
#if TANDEM_WIDE_ATTENTION
    if constexpr (!std::is_same_v<KV, Int8Cache>) {
      if (wide) {
        meeting(k0);
        score_tile(s.meet.data(), s.meet.size(), d, kc, g, table, k0, k0 + tile, scale);
        continue;
      }
    }
#endif
    rows_in_tile(s.rows, k0, tile, [&](size_t i, int64_t first, int64_t n, int64_t off) {
      score_group(q_of(i), d, kc, g, table, first, n, scale,
                  s.scores.data() + s.rows[i].at + off, stride_of(i), group);
    });
  }
  s.invs.resize(s.rows.size() * group);
  for (size_t i = 0; i < s.rows.size(); ++i) {
    const int64_t n = stride_of(i);
    float* scores = s.scores.data() + s.rows[i].at;  // [group, n]
    for (int64_t r = 0; r < group; ++r) {
      s.invs[i * group + r] = 1.0f / softmax_unnormalized(scores + r * n, n);
    }
    std::fill_n(o_of(i), group * d, 0.0f);
  }
  for (int64_t k0 = lo - lo % tile; k0 < hi; k0 += tile) {
#if TANDEM_WIDE_ATTENTION
    if constexpr (!std::is_same_v<KV, Int8Cache>) {
      if (wide) {
        meeting(k0);
        if (d == 64) sum_tile<4>(s.meet.data(), s.meet.size(), vc, g, table, k0, k0 + tile);
        if (d == 128) sum_tile<8>(s.meet.data(), s.meet.size(), vc, g, table, k0, k0 + tile);
        continue;
      }
    }
#endif
    rows_in_tile(s.rows, k0, tile, [&](size_t i, int64_t first, int64_t n, int64_t off) {
      sum_group(s.scores.data() + s.rows[i].at + off, stride_of(i), d, vc, g, table, first, n,
                o_of(i), group);
    });
  }
  for (size_t i = 0; i < s.rows.size(); ++i) {  // o * inv, as one multiply
    float* o = o_of(i);
    for (int64_t r = 0; r < group; ++r) {
      for (int64_t j = 0; j < d; ++j) o[r * d + j] *= s.invs[i * group + r];
    }
  }
}

// attn [rows, q_size]: each row's query heads over its own context, one (kv head, piece of a
// request's rows) at a time.
template <class KV>
void attend_rows(const float* qkv, const Heads& hd, const Rows& rows, const KV& kc,
                 const KV& vc, float scale, int64_t window, float* attn) {
  // Smaller pieces where a call's tasks would leave threads idle (a request's verification
  // rows on a model of few kv heads): each piece then reads the keys once, instead of one row.
  const int64_t threads = at::get_num_threads(), want = threads > 1 ? 2 * threads : 1;
  int64_t cap = kPieceRows;
  std::vector<int64_t> starts = piece_starts(rows, cap);
  while (cap > 1 && static_cast<int64_t>(starts.size() - 1) * hd.num_kv_heads < want) {
    cap = (cap + 1) / 2;
    starts = piece_starts(rows, cap);
  }
  const int64_t pieces = static_cast<int64_t>(starts.size()) - 1;
  // Tasks kv-head-major: a worker's consecutive tasks read the same head's keys and values.
  at::parallel_for(0, pieces * hd.num_kv_heads, 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / pieces, p = task % pieces;
      attend_piece(qkv, hd, rows, kc, vc, scale, window, g, starts[p], starts[p + 1], scratch,
                   attn);
    }
  });
}
#endif

}  // namespace
}  // namespace tandem
