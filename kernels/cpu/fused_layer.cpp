// One Llama-family decoder layer over any rows (decode tokens, verification rows, prefill
// chunks), in one call:
//
//   h = rms_norm(x) w1;  q, k, v = h Wqkv^T (+ b);  rotate q, k (RoPE, rotate-half);
//   store k, v at the tokens' cache slots;  a = softmax(q K^T scale) V over each row's paged
//   context up to its own position (sliding window if any);  x += a Wo^T;
//   h = rms_norm(x) w2;  g, u = h Wgu^T;  x += (silu(g) u) Wdown^T
//
// the same math as engine/models/llama.py's DecoderLayer, with the four projections on the
// quantized kernel (quant_matmul.cpp). Float32 throughout (the KV cache may be int8). Every
// row goes through the same instructions whatever else is in the call, and attends its own
// context one row at a time, so a row's numbers depend only on its request's tokens: a prompt
// cached or not, chunked one way or another, recomputed after preemption, or a verification
// row in place of the same token's decode step, all give the same bits. The pieces are ops
// of their own too (rms_norm, rope_store, attend, silu_mul): the Python layer composes them
// around LoRA and tensor-parallel sums with the same results for every row those do not touch.
//
// Cache layout (kernels/reference.py): [Hkv, num_blocks, block_size, D] for K and V; a slot is
// block * block_size + offset; block tables are padded with the null block 0. Or int8 codes
// with a scale per row (kv_int8.h): every piece that touches the cache takes either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kv_int8.h"
#include "quant_matmul.h"
#include "simd.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL
// n a multiple of 8 (head_dim and hidden sizes are).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  return hsum(acc);
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
}

// out = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm in float32.
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 h = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), h));
  }
}

// x's first r dims rotated in place: x' = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
// over those r (partial rotary: the rest pass through, as their table entries cos 1, sin 0 say).
void rope(float* x, const float* cos, const float* sin, int64_t r) {
  const int64_t half = r / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// In place: s[0:n] = exp(s - max) / sum, returned unnormalized; the sum is the result.
float softmax_unnormalized(float* s, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);  // max is exact in any order
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float top = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) top = std::max(top, s[j]);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
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

// out = gelu_tanh(gate) up, gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
// with tanh(y) = 1 - 2 / (e^(2y) + 1). n % 8 == 0.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
  const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(c, _mm256_add_ps(g, _mm256_mul_ps(k, g3)));
    const __m256 e = exp256(_mm256_mul_ps(two, y));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {  // n % 8 == 0
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
}
#endif

struct Cache {
  float* data;
  int64_t head_stride, block_stride, slot_stride, block_size;
  float* at(int64_t head, int64_t block, int64_t offset) const {
    return data + head * head_stride + block * block_stride + offset * slot_stride;
  }
};

Cache view(at::Tensor& cache, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 4 &&
                  cache.size(0) == num_kv_heads && cache.size(3) == head_dim &&
                  cache.stride(3) == 1,
              "tandem_cpu: caches must be float32 [Hkv, num_blocks, block_size, D]");
  return {cache.data_ptr<float>(), cache.stride(0), cache.stride(1), cache.stride(2),
          cache.size(2)};
}

// f(k view, v view) over float32 caches or int8 ones (kv_int8.h), as the tensors are.
template <class F>
void with_caches(at::Tensor& k_cache, at::Tensor& v_cache, int64_t num_kv_heads,
                 int64_t head_dim, F&& f) {
  if (k_cache.scalar_type() == at::kChar) {
    f(int8_view(k_cache, num_kv_heads, head_dim), int8_view(v_cache, num_kv_heads, head_dim));
  } else {
    f(view(k_cache, num_kv_heads, head_dim), view(v_cache, num_kv_heads, head_dim));
  }
}

// Where each row's keys are: its request's block table and its context length.
struct Rows {
  int64_t count;
  const int64_t* slots;     // [rows] cache slot of the row's own token
  const int64_t* lens;      // [rows] context length, the row's own token included
  const int64_t* table_of;  // [rows] the row's request: a row of tables
  const int64_t* tables;    // [requests, width]
  int64_t num_tables, width;
};

const int64_t* per_row(const at::Tensor& t, int64_t count, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == count,
              "tandem_cpu: ", what, " must be contiguous int64 [", count, "]");
  return t.data_ptr<int64_t>();
}

// slots: the rows' own cache slots where they are stored, else null.
Rows rows_of(const int64_t* slots, const at::Tensor& block_tables, const at::Tensor& row_tables,
             const at::Tensor& seq_lens, int64_t count) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "tandem_cpu: block_tables must be contiguous int64 [requests, max_blocks]");
  return {count,
          slots,
          per_row(seq_lens, count, "seq_lens"),
          per_row(row_tables, count, "row_tables"),
          block_tables.data_ptr<int64_t>(),
          block_tables.size(0),
          block_tables.size(1)};
}

struct Heads {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  int64_t cols() const { return q_size() + 2 * kv_size(); }  // a qkv row
};

#if TANDEM_HAVE_KERNEL
void norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
  for (int64_t b = 0; b < rows; ++b) rms_norm(x + b * n, w, eps, n, out + b * n);
}

// Keys are stored transposed within each cache block: a (kv head, block)'s keys are a
// [D, block_size] slab (key t's element i at i * block_size + t), so eight consecutive keys'
// element i are one load and a score needs no horizontal sum; values stay [block_size, D].
inline float* key_slab(const Cache& kc, int64_t head, int64_t block) { return kc.at(head, block, 0); }

// A token's key k [D] and value v [D] at `offset` of `block` of kv head g.
inline void store_kv(const Cache& kc, const Cache& vc, int64_t g, int64_t block, int64_t offset,
                     const float* k, const float* v, int64_t d) {
  float* slab = key_slab(kc, g, block);
  for (int64_t i = 0; i < d; ++i) slab[i * kc.block_size + offset] = k[i];  // transposed
  std::copy_n(v, d, vc.at(g, block, offset));
}

// Lanes [0, count) of 8 floats at p (masked: a block's last chunk may hold fewer than 8 keys).
inline __m256 load_lanes(const float* p, int64_t count) {
  if (count >= 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane));
}

// One block's keys [off, off + lanes) (block offsets), VECS vectors of eight: the scores of
// keys [lo, hi) go to scores[r * stride + key0 + t]. Each score is one chain of fmas over i in
// order, whatever VECS is (two vectors give each head two chains, hiding the fma latency).
template <int HEADS, int VECS>
inline void score_block(const float* q, int64_t d, const float* slab, int64_t bs, int64_t off,
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

template <int HEADS>
void score_keys(const float* q, int64_t d, const Cache& kc, int64_t g, const int64_t* table,
                int64_t first, int64_t n, float scale, float* scores, int64_t stride) {
  const int64_t bs = kc.block_size, end = first + n;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t start = first - first % bs; start < end; start += bs) {  // one block
    const float* slab = key_slab(kc, g, table[start / bs]);
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

// o_r[i] = (sum_t p_r[t] v_t[i]) * inv_r for heads r < HEADS (p_r = p + r * n, o_r = o + r * d)
// and keys t in [first, first + n): each element one chain of fmas in key order, a block's
// values read in sequence, each value row loaded once for the HEADS heads sharing it.
template <int CHUNKS, int HEADS>  // CHUNKS = D / 8
void sum_values(const float* p, int64_t d, const Cache& vc, int64_t g, const int64_t* table,
                int64_t first, int64_t n, const float* inv, float* o) {
  const int64_t bs = vc.block_size, end = first + n;
  __m256 acc[HEADS][CHUNKS];
  for (int r = 0; r < HEADS; ++r) {
    for (int c = 0; c < CHUNKS; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t start = first - first % bs; start < end; start += bs) {  // one block
    const float* block = vc.at(g, table[start / bs], 0);
    const int64_t lo = std::max(start, first), hi = std::min(start + bs, end);
    for (int64_t pos = lo; pos < hi; ++pos) {
      const float* v = block + (pos - start) * vc.slot_stride;
      __m256 w[HEADS];
      for (int r = 0; r < HEADS; ++r) w[r] = _mm256_set1_ps(p[r * n + pos - first]);
      for (int c = 0; c < CHUNKS; ++c) {
        const __m256 vc8 = _mm256_loadu_ps(v + 8 * c);
        for (int r = 0; r < HEADS; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], vc8, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < HEADS; ++r) {
    const __m256 vinv = _mm256_set1_ps(inv[r]);
    for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(o + r * d + 8 * c, _mm256_mul_ps(acc[r][c], vinv));
  }
}

// The same sum for any D (a multiple of 8), one head.
void sum_values_any(const float* p, int64_t d, const Cache& vc, int64_t g, const int64_t* table,
                    int64_t first, int64_t n, float inv, float* o) {
  const int64_t bs = vc.block_size, end = first + n;
  std::fill_n(o, d, 0.0f);
  for (int64_t start = first - first % bs; start < end; start += bs) {
    const float* block = vc.at(g, table[start / bs], 0);
    for (int64_t pos = std::max(start, first); pos < std::min(start + bs, end); ++pos) {
      axpy(p[pos - first], block + (pos - start) * vc.slot_stride, o, d);
    }
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vinv));
}

// Heads whose scores (values) share each load of the keys (values): as many as keep the
// accumulators in registers (32 vector registers with AVX-512VL, 16 without).
#if defined(__AVX512VL__)
constexpr int kValueHeads64 = 3, kValueHeads128 = 1, kScoreHeads = 8;
#else
constexpr int kValueHeads64 = 1, kValueHeads128 = 1, kScoreHeads = 4;
#endif

// Heads [r, r + count) of a group: their value sums, count <= kValueHeads64 for D = 64.
template <int CHUNKS, int MAXH>
void sum_heads(const float* p, int64_t d, const Cache& vc, int64_t g, const int64_t* table,
               int64_t first, int64_t n, const float* inv, float* o, int64_t count) {
  if constexpr (MAXH >= 3) {
    if (count == 3) return sum_values<CHUNKS, 3>(p, d, vc, g, table, first, n, inv, o);
  }
  if constexpr (MAXH >= 2) {
    if (count == 2) return sum_values<CHUNKS, 2>(p, d, vc, g, table, first, n, inv, o);
  }
  sum_values<CHUNKS, 1>(p, d, vc, g, table, first, n, inv, o);
}

// Per-head RMSNorms of q and k before RoPE (Qwen3), or none (null weights).
// What each q and k head goes through before the store: an RMSNorm (Qwen3, Gemma 3), RoPE.
struct HeadPrep {
  const float* q = nullptr;  // [D]
  const float* k = nullptr;  // [D]
  float eps = 0.0f;
  int64_t rotary = 0;  // the rotated dims of a head (the rest pass through); 0: all
};

// q and k of every row normed per head (if norms), rotated in place (positions' cos, sin
// [rows, D]); k, v stored.
template <class KV>
void rope_store_rows(float* qkv, const float* cs, const float* sn, const Heads& hd,
                     const Rows& rows, const KV& kc, const KV& vc, const HeadPrep& prep) {
  const int64_t d = hd.head_dim;
  for (int64_t b = 0; b < rows.count; ++b) {
    float* row = qkv + b * hd.cols();
    for (int64_t head = 0; head < hd.num_heads + hd.num_kv_heads; ++head) {
      float* x = row + head * d;
      const float* w = head < hd.num_heads ? prep.q : prep.k;
      if (w != nullptr) rms_norm(x, w, prep.eps, d, x);  // (reads x before writing it)
      rope(x, cs + b * d, sn + b * d, prep.rotary > 0 ? prep.rotary : d);
    }
    const int64_t bs = kc.block_size, block = rows.slots[b] / bs, offset = rows.slots[b] % bs;
    for (int64_t g = 0; g < hd.num_kv_heads; ++g) {
      const float* k = row + hd.q_size() + g * d;
      store_kv(kc, vc, g, block, offset, k, k + hd.kv_size(), d);
    }
  }
}

// attn [rows, q_size]: each row's query heads over its own context, one (row, kv head) at a
// time: scores in key order, softmax, then the values summed in key order. A row's steps depend
// on its context length only, never on the other rows of the call.
template <class KV>
void attend_rows(const float* qkv, const Heads& hd, const Rows& rows, const KV& kc,
                 const KV& vc, float scale, int64_t window, float* attn) {
  const int64_t d = hd.head_dim, group = hd.num_heads / hd.num_kv_heads;
  // Tasks kv-head-major: a worker's consecutive tasks read the same head's keys and values
  // (a request's rows share them), which then stay in its cache.
  at::parallel_for(0, rows.count * hd.num_kv_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, invs;  // per worker, reused across its tasks
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / rows.count, b = task % rows.count;
      const int64_t len = rows.lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      TORCH_CHECK(len >= 1 && (len - 1) / kc.block_size < rows.width &&
                      rows.table_of[b] >= 0 && rows.table_of[b] < rows.num_tables,
                  "tandem_cpu: a row's context is beyond its block table");
      const int64_t* table = rows.tables + rows.table_of[b] * rows.width;
      scores.resize(group * n);
      const float* q = qkv + b * hd.cols() + g * group * d;  // the group's query heads
      for (int64_t r = 0; r < group;) {  // up to kScoreHeads heads share each load of the keys
        const int64_t heads = std::min<int64_t>(kScoreHeads, group - r);
        float* s = scores.data() + r * n;
        const float* qr = q + r * d;
        switch (heads) {
#if defined(__AVX512VL__)
          case 8: score_keys<8>(qr, d, kc, g, table, first, n, scale, s, n); break;
          case 7: score_keys<7>(qr, d, kc, g, table, first, n, scale, s, n); break;
          case 6: score_keys<6>(qr, d, kc, g, table, first, n, scale, s, n); break;
          case 5: score_keys<5>(qr, d, kc, g, table, first, n, scale, s, n); break;
#endif
          case 4: score_keys<4>(qr, d, kc, g, table, first, n, scale, s, n); break;
          case 3: score_keys<3>(qr, d, kc, g, table, first, n, scale, s, n); break;
          case 2: score_keys<2>(qr, d, kc, g, table, first, n, scale, s, n); break;
          default: score_keys<1>(qr, d, kc, g, table, first, n, scale, s, n); break;
        }
        r += heads;
      }
      invs.resize(group);
      for (int64_t r = 0; r < group; ++r) invs[r] = 1.0f / softmax_unnormalized(scores.data() + r * n, n);
      const int64_t per = d == 64 ? kValueHeads64 : d == 128 ? kValueHeads128 : 1;
      for (int64_t r = 0; r < group; r += per) {
        const int64_t count = std::min(per, group - r);
        const float* p = scores.data() + r * n;
        float* o = attn + b * hd.q_size() + (g * group + r) * d;
        switch (d) {
          case 64: sum_heads<8, kValueHeads64>(p, d, vc, g, table, first, n, &invs[r], o, count); break;
          case 128: sum_heads<16, kValueHeads128>(p, d, vc, g, table, first, n, &invs[r], o, count); break;
          default:
            for (int64_t h = 0; h < count; ++h) {
              sum_values_any(p + h * n, d, vc, g, table, first, n, invs[r + h], o + h * d);
            }
        }
      }
    }
  });
}

template <void (*ACT)(const float*, const float*, float*, int64_t)>
void act_mul_rows(const float* gu, int64_t rows, int64_t inter, float* act) {
  for (int64_t b = 0; b < rows; ++b) ACT(gu + b * 2 * inter, gu + b * 2 * inter + inter,
                                         act + b * inter, inter);
}
#endif

HeadPrep head_prep(const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double eps, int64_t head_dim,
                   int64_t rotary_dim) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "tandem_cpu: q_norm and k_norm go together");
  TORCH_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
              "tandem_cpu: rotary_dim must be even and at most head_dim, got ", rotary_dim);
  if (!q_norm.has_value()) return {nullptr, nullptr, 0.0f, rotary_dim};
  for (const at::Tensor* t : {&*q_norm, &*k_norm}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == head_dim,
                "tandem_cpu: q_norm and k_norm must be contiguous float32 [head_dim]");
  }
  return {q_norm->data_ptr<float>(), k_norm->data_ptr<float>(), static_cast<float>(eps),
          rotary_dim};
}

Heads heads_of(int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos) {
  const int64_t d = cos.size(-1);
  TORCH_CHECK(d % 8 == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "tandem_cpu: head_dim must be a multiple of 8 and num_heads of num_kv_heads");
  return {num_heads, num_kv_heads, d};
}

void check_rows(const at::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(1) == cols,
              "tandem_cpu: ", what, " must be contiguous float32 [rows, ", cols, "], got ",
              t.sizes());
}

void fused_layer(at::Tensor x, const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                 at::IntArrayRef out_features, const std::optional<at::Tensor>& qkv_bias,
                 const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                 at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& row_tables, const at::Tensor& seq_lens, int64_t num_heads,
                 int64_t num_kv_heads, double scale, int64_t window,
                 const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                 double head_eps, int64_t rotary_dim) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4 && out_features.size() == 4,
              "tandem_cpu: weights are (codes, d, m) for qkv, o, gate_up, down");
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  const int64_t batch = x.size(0), hidden = x.size(1);
  check_rows(x, hidden, "x");
  std::vector<QuantizedMatrix> w;
  for (int i = 0; i < 4; ++i) {
    w.push_back(matrix(weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], bits[i],
                       out_features[i], i == 0 ? qkv_bias : std::nullopt));
  }
  const int64_t inter = w[2].rows / 2;
  TORCH_CHECK(w[0].rows == hd.cols() && w[1].rows == hidden && w[3].rows == hidden &&
                  hidden % 8 == 0 && inter % 8 == 0,
              "tandem_cpu: projection shapes do not match the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * hd.head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  const Rows rows =
      rows_of(per_row(slots, batch, "slots"), block_tables, row_tables, seq_lens, batch);
  float* xs = x.data_ptr<float>();

  thread_local std::vector<float> buf;
  buf.resize(batch * (hidden + hd.cols() + hd.q_size() + 3 * inter + hidden));
  float* h = buf.data();                  // [B, hidden]
  float* qkv = h + batch * hidden;        // [B, q + 2 kv]
  float* attn = qkv + batch * hd.cols();  // [B, q]
  float* gu = attn + batch * hd.q_size(); // [B, 2 inter]
  float* act = gu + batch * 2 * inter;    // [B, inter]
  float* out = act + batch * inter;       // [B, hidden]

  norm_rows(xs, norm1.data_ptr<float>(), eps, batch, hidden, h);
  linear(w[0], h, batch, hidden, qkv, hd.cols());
  const HeadPrep prep = head_prep(q_norm, k_norm, head_eps, hd.head_dim, rotary_dim);
  with_caches(k_cache, v_cache, num_kv_heads, hd.head_dim, [&](const auto& kc, const auto& vc) {
    rope_store_rows(qkv, cos.data_ptr<float>(), sin.data_ptr<float>(), hd, rows, kc, vc, prep);
    attend_rows(qkv, hd, rows, kc, vc, static_cast<float>(scale), window, attn);
  });
  linear(w[1], attn, batch, hd.q_size(), out, hidden);
  for (int64_t i = 0; i < batch * hidden; ++i) xs[i] += out[i];

  norm_rows(xs, norm2.data_ptr<float>(), eps, batch, hidden, h);
  linear(w[2], h, batch, hidden, gu, 2 * inter);
  act_mul_rows<silu_mul>(gu, batch, inter, act);
  linear(w[3], act, batch, inter, out, hidden);
  for (int64_t i = 0; i < batch * hidden; ++i) xs[i] += out[i];
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

// ---- the pieces, for the Python layer around LoRA and tensor-parallel sums ----------------
#if TANDEM_HAVE_KERNEL
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w.numel(), "x");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() % 8 == 0,
              "tandem_cpu: the norm weight must be contiguous float32, a multiple of 8");
  at::Tensor out = at::empty_like(x);
  norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), x.size(0),
            x.size(1), out.data_ptr<float>());
  return out;
}

void rope_store_op(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                   int64_t num_heads, int64_t num_kv_heads,
                   const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double head_eps,
                   int64_t rotary_dim) {
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  check_rows(qkv, hd.cols(), "qkv");
  const int64_t batch = qkv.size(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * hd.head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  const Rows rows{batch, per_row(slots, batch, "slots"), nullptr, nullptr, nullptr, 0, 0};
  const HeadPrep prep = head_prep(q_norm, k_norm, head_eps, hd.head_dim, rotary_dim);
  with_caches(k_cache, v_cache, num_kv_heads, hd.head_dim, [&](const auto& kc, const auto& vc) {
    rope_store_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), hd,
                    rows, kc, vc, prep);
  });
}

at::Tensor attend_op(const at::Tensor& qkv, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& block_tables,
                     const at::Tensor& row_tables, const at::Tensor& seq_lens,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                     int64_t window) {
  TORCH_CHECK(head_dim % 8 == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "tandem_cpu: head_dim must be a multiple of 8 and num_heads of num_kv_heads");
  const Heads hd{num_heads, num_kv_heads, head_dim};
  check_rows(qkv, hd.cols(), "qkv");
  const Rows rows = rows_of(nullptr, block_tables, row_tables, seq_lens, qkv.size(0));
  at::Tensor attn = at::empty({qkv.size(0), hd.q_size()}, qkv.options());
  with_caches(k_cache, v_cache, num_kv_heads, head_dim, [&](const auto& kc, const auto& vc) {
    attend_rows(qkv.data_ptr<float>(), hd, rows, kc, vc, static_cast<float>(scale), window,
                attn.data_ptr<float>());
  });
  return attn;
}

template <void (*ACT)(const float*, const float*, float*, int64_t)>
at::Tensor act_mul_op(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 16 == 0, "tandem_cpu: gate_up must be [rows, 2 I], I a multiple of 8");
  check_rows(gu, gu.size(1), "gate_up");
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({gu.size(0), inter}, gu.options());
  act_mul_rows<ACT>(gu.data_ptr<float>(), gu.size(0), inter, act.data_ptr<float>());
  return act;
}
#endif

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def(
      "fused_layer(Tensor(a!) x, Tensor[] weights, int[] bits, int[] out_features, "
      "Tensor? qkv_bias, Tensor norm1, Tensor norm2, float eps, Tensor cos, Tensor sin, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_tables, "
      "Tensor row_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, "
      "int window, Tensor? q_norm=None, Tensor? k_norm=None, float head_eps=0., "
      "int rotary_dim=0) -> ()",
      &tandem::fused_layer);
#if TANDEM_HAVE_KERNEL
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &tandem::rms_norm_op);
  lib.def(
      "rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots, int num_heads, int num_kv_heads, Tensor? q_norm=None, "
      "Tensor? k_norm=None, float head_eps=0., int rotary_dim=0) -> ()",
      &tandem::rope_store_op);
  lib.def(
      "attend(Tensor qkv, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor row_tables, Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, "
      "float scale, int window) -> Tensor",
      &tandem::attend_op);
  lib.def("silu_mul(Tensor gate_up) -> Tensor", &tandem::act_mul_op<tandem::silu_mul>);
  lib.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &tandem::act_mul_op<tandem::gelu_tanh_mul>);
#endif
}
