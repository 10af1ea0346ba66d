// Paged attention on a CPU: every query row reads its sequence's keys and values in place, through the
// block table, once. The reference backend (model/attention.py) copies them out first and reads them
// again in two matrix products: three passes over the cache instead of one, and the cache is what a
// decode step at batch 64 mostly reads. Same inputs and semantics as the Triton kernel: query rows
// flat over sequences, sequence b's rows query_start[b]..query_start[b+1]-1 being the last of its
// context_lens[b] positions (causal within a chunk).
//
// The cache is in the queries' dtype, or int8 (KV_CACHE_DTYPE=int8) with a float32 scale per token and head beside
// each block (model/attention.py, LayerKV): a key's score is its scale times q . k, the scale applied once to the
// dot product rather than to each of its D elements, and a value's weight its probability times its scale. Queries
// and outputs stay in the model's dtype. store_kv quantizes as it stores, as model/attention.py's quantize does.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int LANES = 16;  // independent partial sums: the compiler vectorises them without reassociating

// 16 floats in one vector (GCC's and Clang's vector extensions): one AVX-512 register, two AVX2 ones. The score,
// softmax and value loops below run on these rather than on scalars the compiler may or may not vectorise: the
// scalar form spent its time in a horizontal sum per key and a call to expf per score (a bfloat16 decode at batch
// 64 over 256 keys: 8 GB/s of keys and values read, where a copy moves 24; Xeon Sapphire Rapids, 2 threads).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

// 32 elements from p as two vectors, in an order that only the kernel's own vectors share: float32's as they are;
// bfloat16's (float32's top halves) even elements in `a` and odd ones in `b`, each widened by one shift or one mask
// of the same 64 bytes, where widening 16 in order takes a zero-extension and a shift per vector; int8's in order,
// each 16 a sign extension and a conversion (vpmovsxbd, vcvtdq2ps).
inline void load32(const float* p, f32x16& a, f32x16& b) {
  a = load16(p);
  b = load16(p + 16);
}

inline void load32(const at::BFloat16* p, f32x16& a, f32x16& b) {
  u32x16 w;
  std::memcpy(&w, p, sizeof w);
  const u32x16 even = w << 16, odd = w & 0xFFFF0000u;
  std::memcpy(&a, &even, sizeof a);
  std::memcpy(&b, &odd, sizeof b);
}

// 16 int8 values as floats, in order: a sign extension and a conversion (vpmovsxbd, vcvtdq2ps). In intrinsics, as GCC
// 12 compiles __builtin_convertvector from 16 int8 lanes (to floats, or to int32) lane by lane, a vcvtsi2ss each: an
// int8 decode's attention then ran 1.7x slower than bfloat16's, where it reads half the bytes. Without AVX-512 (where
// the vector path is not compiled in) a loop.
inline f32x16 widen16(const int8_t* p) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  f32x16 x;
  for (int i = 0; i < 16; ++i) x[i] = p[i];
  return x;
#endif
}

// 16 values from p as floats, in order (int8's: above), for store_kv's quantizing and the run kernel.
inline f32x16 widen16(const float* p) { return load16(p); }

inline f32x16 widen16(const at::BFloat16* p) {
  u16x16 w;
  std::memcpy(&w, p, sizeof w);
  const u32x16 bits = __builtin_convertvector(w, u32x16) << 16;
  f32x16 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <typename T>
inline f32x16 widen16(const T* p) {  // float16, float64: rows store_kv takes that the kernel never reads
  f32x16 x;
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(p[i]);
  return x;
}

inline void load32(const int8_t* p, f32x16& a, f32x16& b) {
  a = widen16(p);
  b = widen16(p + 16);
}

// 32 query elements in the order load32 gives a row of the cache (of dtype C): the query's own where the cache is
// in its dtype, else (an int8 cache, read in order) widened in order.
template <typename C, typename T>
inline void load32_as(const T* q, f32x16& a, f32x16& b) {
  if constexpr (std::is_same_v<C, T>) {
    load32(q, a, b);
  } else {
    float x[32];
    for (int i = 0; i < 32; ++i) x[i] = static_cast<float>(q[i]);
    load32(x, a, b);
  }
}

// load32's inverse for 32 results: their elements back in order (the tag: the cache's dtype, whose order they are in).
inline void store32(float* p, const f32x16& a, const f32x16& b, const float*) {
  std::memcpy(p, &a, sizeof a);
  std::memcpy(p + 16, &b, sizeof b);
}

inline void store32(float* p, const f32x16& a, const f32x16& b, const int8_t*) { store32(p, a, b, p); }

inline void store32(float* p, const f32x16& a, const f32x16& b, const at::BFloat16*) {
  for (int i = 0; i < 16; ++i) p[2 * i] = a[i], p[2 * i + 1] = b[i];
}

inline f32x16 splat(float x) { return f32x16{} + x; }

// A block's tile of keys or values (`count` elements from `p`) asked into the cache ahead of its use: tiles lie
// wherever the block table puts them, so the hardware's prefetcher, which follows addresses in sequence, misses
// the first lines of each.
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t line = 0; line < count * static_cast<int64_t>(sizeof(T)); line += 64) __builtin_prefetch(bytes + line);
}

// The first byte of each of a row's tiles (of keys, or of values) read up front, in one loop of loads: each tile
// lies on a page of its own, and a prefetch that misses the TLB holds the loop until the page walk is done (half
// the kernel's samples sat on the prefetch), where loads in a loop of their own walk many pages at once. Then the
// prefetches of each next tile find their pages. A decode at batch 64 over 1024 keys, one thread, Xeon Sapphire
// Rapids (a VM): bfloat16 27.7 -> 23.8 ms a layer, int8 23.3 -> 17.8.
template <typename C>
inline void touch(const C* p, int64_t block_stride, const int64_t* table, int64_t keys, int64_t bs) {
  for (int64_t start = 0; start < keys; start += bs)
    (void)*reinterpret_cast<const volatile char*>(p + table[start / bs] * block_stride);
}

// Sixteen vectors' sums, one per lane of the result (lane i: the sum of a[i]'s lanes), in four rounds of halving:
// 15 shuffle pairs for 16 keys where one horizontal sum per key took four.
inline f32x16 sums16(const f32x16* a) {
  f32x16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[i]'s halves added, 8-15: a[i+8]'s
    b[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // quarters: a[i], a[i+4], a[i+8], a[i+12]
    c[i] = __builtin_shufflevector(b[i], b[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[i], b[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // pairs: a[i], a[i+2], ..., a[i+14]
    d[i] = __builtin_shufflevector(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// exp(x) for x <= 0 (a score less the largest), as Cephes' expf: x = n ln2 + r, |r| <= ln2/2, exp(r) by its
// polynomial, times 2^n built in the exponent's bits. Within 2 ulp of expf; below -87 it gives 0's neighbour 2^-126.
inline f32x16 exp16(f32x16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const f32x16 round = splat(12582912.0f);                    // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + round) - round;  // nearest integer to x / ln2
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;   // ln2 in two parts: r exact enough
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2^n
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T, int D>
inline float dot(const float* __restrict__ q, const T* __restrict__ k) {
  float acc[LANES] = {0};
  for (int d = 0; d < D; d += LANES)
    for (int j = 0; j < LANES && j < D; ++j) acc[j] += q[d + j] * static_cast<float>(k[d + j]);
  float sum = 0;
  for (int j = 0; j < LANES && j < D; ++j) sum += acc[j];
  return sum;
}

// f(begin, end) over [0, n) in chunks of 4 taken in turn (rows differ in cost: contexts differ) by the threads of
// torch's OpenMP pool, the ones its matrix products run on: built with -fopenmp where torch's parallel backend is
// OpenMP, else (the pragma ignored) in this thread alone. A pool of our own (at::launch) competed with OpenMP's
// threads, which spin a while after each product: called from a process's main thread, a decode step's attention
// took 113-134 against 86-92 ms (gpt2, batch 64, ~310 keys, Zen 3); from the server's loop thread, level.
template <typename F>
void parallel(int64_t n, const F& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)), chunk = 4;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  for (int64_t begin; (begin = next.fetch_add(chunk)) < n;) f(begin, std::min(n, begin + chunk));
}

struct Layout {  // where a query row, a key, a value and their scales are, in elements
  int64_t B, H, bs, W, table_stride, k_nb, k_t, k_h, v_nb, v_t, v_h, q_row, q_h, ks_nb, ks_t, ks_h, vs_nb, vs_t, vs_h;
};

// A cache of dtype C holds int8 rows, each with its float32 scale: the scale pointers then point at the head's.
template <typename C>
constexpr bool QUANTIZED = std::is_same_v<C, int8_t>;

// A work item's buffers, reused from one to the next: its scores, then its weights, and an int8 cache's key and
// value scales in key order; a run's keys and values widened.
struct Scratch {
  std::vector<float> scores, k_scales, v_scales, keys, values;  // keys, values: a run's, as float32 (attend_rows16)
};

// An int8 cache's scales of a row's keys, copied in key order from each block's row of scales (keys + 16 of them:
// the 16 past the last zeros, for a vector that reads a partial group), never reading a scale past the context.
// Copied up front, one block's row after another: each is a miss on a page of its own (the scales lie apart from
// the keys), and in this loop the core has many in flight, where read as the scores and weights needed them each
// stalled the kernel alone (a fifth of its samples on that load). An int8 decode at batch 64 over 1024 keys went
// from level with bfloat16's (34-36 ms a layer, one thread, Xeon Sapphire Rapids, a VM) to 29 ms.
void gather_scales(const float* s, const Layout& L, int64_t s_nb, int64_t s_t, const int64_t* table, int64_t keys,
                   std::vector<float>& out) {
  out.resize(keys + 16);
  for (int64_t start = 0; start < keys; start += L.bs) {
    const float* row = s + table[start / L.bs] * s_nb;
    const int64_t n = std::min(L.bs, keys - start);
    if (s_t == 1) {
      std::memcpy(&out[start], row, n * sizeof(float));
    } else {
      for (int64_t i = 0; i < n; ++i) out[start + i] = row[i * s_t];
    }
  }
  std::fill_n(&out[keys], 16, 0.0f);
}

// attend_row on vectors of 16 floats, for head dimensions of whole pairs of vectors: scores 16 keys at a time
// (their sums in one sums16), the softmax's exponentials 16 at a time, values weighted a vector at a time. Only
// where AVX-512 holds a vector in one register (Xeon, Zen 4): with AVX2 a group's 16 partial sums would not fit
// the registers (and the scalar form was measured on Zen 3). An int8 cache's scales: a group's 16 key scales
// times its 16 sums (one product per 16 keys), each probability times its value's scale (16 at a time).
// Tiles are asked for two ahead: the next one whole as the row starts, then while each tile is worked on the one
// after next, a row a key, so that requests go out all along rather than in a burst that waits for the core's
// fill buffers (the whole next tile at each tile's start: one thread, batch 64 over 1024 keys, int8 20.3 and
// bfloat16 25.2 ms a layer; this way 18.4 and 24.0).
template <typename T, typename C, int D>
void attend_row16(const Layout& L, const T* q, const C* kp, const C* vp, const float* ksp, const float* vsp,
                  const int64_t* table, int64_t keys, float scale, Scratch& work, T* out) {
  constexpr int V = D / 16;  // vectors a row, in load32's order
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32x16 none = splat(-std::numeric_limits<float>::infinity());
  f32x16 qv[V], acc[V], part[16], x[V];
  for (int c = 0; c < V; c += 2) load32_as<C>(q + 16 * c, qv[c], qv[c + 1]);
  for (int c = 0; c < V; ++c) qv[c] *= scale;
  std::vector<float>& scores = work.scores;
  scores.resize(keys + 16);  // a group's lanes past a block's last key are written, then the next block's
  if constexpr (QUANTIZED<C>) {
    gather_scales(ksp, L, L.ks_nb, L.ks_t, table, keys, work.k_scales);
    gather_scales(vsp, L, L.vs_nb, L.vs_t, table, keys, work.v_scales);
  }
  touch(kp, L.k_nb, table, keys, L.bs);
  f32x16 top = none;
  for (int64_t start = 0; start < keys; start += L.bs) {
    const C* k = kp + table[start / L.bs] * L.k_nb;
    const int64_t n = std::min(L.bs, keys - start);
    if (start == 0 && L.bs < keys) prefetch(kp + table[1] * L.k_nb, L.bs * L.k_t);
    const C* later = start + 2 * L.bs < keys ? kp + table[start / L.bs + 2] * L.k_nb : nullptr;
    for (int64_t i = 0; i < n; i += 16) {
      const int64_t m = std::min<int64_t>(16, n - i);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if (later && i + j < L.bs) prefetch(later + (i + j) * L.k_t, D);  // the tile after next, a row a key
        const C* key = k + (i + std::min<int64_t>(j, m - 1)) * L.k_t;  // past the last: the last again, unused
        for (int c = 0; c < V; c += 2) load32(key + 16 * c, x[c], x[c + 1]);
        part[j] = qv[0] * x[0];
        for (int c = 1; c < V; ++c) part[j] += qv[c] * x[c];
      }
      f32x16 s = sums16(part);
      if constexpr (QUANTIZED<C>) s *= load16(&work.k_scales[start + i]);  // past m: whatever, masked
      s = lane < static_cast<float>(m) ? s : none;
      std::memcpy(&scores[start + i], &s, sizeof s);
      top = top > s ? top : s;
    }
  }
  float most = top[0];
  for (int j = 1; j < 16; ++j) most = std::max(most, top[j]);
  f32x16 total{};
  for (int64_t t = 0; t < keys; t += 16) {
    f32x16 e = exp16(load16(&scores[t]) - most);
    e = lane < static_cast<float>(keys - t) ? e : f32x16{};  // past the last key: nothing
    total += e;
    if constexpr (QUANTIZED<C>) e *= load16(&work.v_scales[t]);  // the value's weight, its scale in it
    std::memcpy(&scores[t], &e, sizeof e);
  }
  for (int c = 0; c < V; ++c) acc[c] = f32x16{};
  touch(vp, L.v_nb, table, keys, L.bs);
  for (int64_t start = 0; start < keys; start += L.bs) {
    const C* v = vp + table[start / L.bs] * L.v_nb;
    const int64_t n = std::min(L.bs, keys - start);
    if (start == 0 && L.bs < keys) prefetch(vp + table[1] * L.v_nb, L.bs * L.v_t);
    const C* later = start + 2 * L.bs < keys ? vp + table[start / L.bs + 2] * L.v_nb : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      if (later) prefetch(later + i * L.v_t, D);
      const f32x16 p = splat(scores[start + i]);
      for (int c = 0; c < V; c += 2) load32(v + i * L.v_t + 16 * c, x[c], x[c + 1]);
      for (int c = 0; c < V; ++c) acc[c] += p * x[c];
    }
  }
  float sum = 0, row[D];
  for (int j = 0; j < 16; ++j) sum += total[j];
  for (int c = 0; c < V; c += 2) store32(row + 16 * c, acc[c], acc[c + 1], static_cast<const C*>(nullptr));
  for (int d = 0; d < D; ++d) out[d] = static_cast<T>(row[d] / sum);
}

// One (sequence, head, query row): scores over its keys, block by block, then the weighted sum of values.
template <typename T, typename C, int D>
void attend_row(const Layout& L, const T* q, const C* kp, const C* vp, const float* ksp, const float* vsp,
                const int64_t* table, int64_t keys, float scale, Scratch& work, T* out) {
#if defined(__AVX512F__)
  if constexpr (D % 32 == 0) return attend_row16<T, C, D>(L, q, kp, vp, ksp, vsp, table, keys, scale, work, out);
#endif
  float qf[D], acc[D];
  for (int d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]) * scale;
  std::vector<float>& scores = work.scores;
  scores.resize(keys);
  if constexpr (QUANTIZED<C>) {
    gather_scales(ksp, L, L.ks_nb, L.ks_t, table, keys, work.k_scales);
    gather_scales(vsp, L, L.vs_nb, L.vs_t, table, keys, work.v_scales);
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t start = 0; start < keys; start += L.bs) {
    const C* k = kp + table[start / L.bs] * L.k_nb;
    const int64_t n = std::min(L.bs, keys - start);
    for (int64_t i = 0; i < n; ++i) {
      float s = dot<C, D>(qf, k + i * L.k_t);
      if constexpr (QUANTIZED<C>) s *= work.k_scales[start + i];
      top = std::max(top, scores[start + i] = s);
    }
  }
  float total = 0;
  for (int64_t t = 0; t < keys; ++t) total += scores[t] = std::exp(scores[t] - top);
  if constexpr (QUANTIZED<C>)
    for (int64_t t = 0; t < keys; ++t) scores[t] *= work.v_scales[t];  // the value's weight, its scale in it
  for (int d = 0; d < D; ++d) acc[d] = 0;
  for (int64_t start = 0; start < keys; start += L.bs) {
    const C* v = vp + table[start / L.bs] * L.v_nb;
    const int64_t n = std::min(L.bs, keys - start);
    for (int64_t i = 0; i < n; ++i) {
      const float p = scores[start + i];
      const C* row = v + i * L.v_t;
      for (int d = 0; d < D; ++d) acc[d] += p * static_cast<float>(row[d]);
    }
  }
  for (int d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] / total);
}

// A head's first `keys` keys (or values) as rows of D float32 in key order, an int8 cache's each times its scale.
template <typename C, int D>
void widen_rows(const C* p, const float* sp, const Layout& L, int64_t nb, int64_t t, int64_t s_nb, int64_t s_t,
                const int64_t* table, int64_t keys, std::vector<float>& out) {
  out.resize(keys * D);
  for (int64_t k = 0; k < keys; ++k) {
    const int64_t block = table[k / L.bs], i = k % L.bs;
    const C* row = p + block * nb + i * t;
    float* o = &out[k * D];
    if constexpr (D % 16 == 0) {
      for (int c = 0; c < D; c += 16) {
        const f32x16 x = widen16(row + c);
        std::memcpy(o + c, &x, sizeof x);
      }
    } else {
      for (int d = 0; d < D; ++d) o[d] = static_cast<float>(row[d]);
    }
    if constexpr (QUANTIZED<C>)
      for (int d = 0; d < D; ++d) o[d] *= sp[block * s_nb + i * s_t];
  }
}

// Up to RUN_ROWS query rows of one sequence and head (a prompt chunk's), 16 at a time, a row per lane. attend_row16
// reads every key again for each row and sums each dot product across a vector; here each key's elements, widened
// into the scratch once for all the rows, multiply a vector of 16 rows' query elements: D multiply-adds per key for
// 16 rows, no sums across lanes, and the softmax and the weighted values 16 rows at a time. Row r sees the first
// first_keys + r keys (causal); out: row 0's output, each next row's L.H * D further.
// A gpt2 prompt's attention, 12 layers, bfloat16, 2 threads (AMD EPYC Zen 4, profiler), row by row against this way:
// 136 tokens 6.8 -> 3.7 ms, 256 tokens 13-16 -> 8.6 ms, 1,000 tokens 214 -> 118 ms.
constexpr int64_t RUN_ROWS = 64;  // a work item's: enough to widen each key once for many rows, few enough to share

template <typename T, typename C, int D>
void attend_rows16(const Layout& L, const T* q, int64_t rows, const C* kp, const C* vp, const float* ksp,
                   const float* vsp, const int64_t* table, int64_t first_keys, float scale, Scratch& work, T* out) {
  constexpr int K = 4;  // keys scored at once: independent sums (measured: 4 faster than 8 or 16)
  constexpr int J = D < 16 ? D : 16;  // output elements summed at once, a vector of 16 rows each
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32x16 none = splat(-std::numeric_limits<float>::infinity());
  widen_rows<C, D>(kp, ksp, L, L.k_nb, L.k_t, L.ks_nb, L.ks_t, table, first_keys + rows - 1, work.keys);
  widen_rows<C, D>(vp, vsp, L, L.v_nb, L.v_t, L.vs_nb, L.vs_t, table, first_keys + rows - 1, work.values);
  std::vector<float>& st = work.scores;  // key k's 16 scores at st[16k], then their weights
  st.resize((first_keys + rows - 1 + K) * 16);
  for (int64_t g = 0; g < rows; g += 16, q += 16 * L.q_row, out += 16 * L.H * D, first_keys += 16) {
    const int64_t n = std::min<int64_t>(16, rows - g), keys = first_keys + n - 1;  // keys: the group's last row's
    f32x16 qt[D];  // qt[d]: lane r the r-th row's element d, times the scale; the lanes past the rows zeros
    for (int d = 0; d < D; ++d) qt[d] = f32x16{};
    for (int64_t r = 0; r < n; ++r)
      for (int d = 0; d < D; ++d) qt[d][r] = static_cast<float>(q[r * L.q_row + d]) * scale;
    f32x16 top = none;
    for (int64_t k0 = 0; k0 < keys; k0 += K) {
      const float* key[K];
      for (int i = 0; i < K; ++i) key[i] = &work.keys[std::min(k0 + i, keys - 1) * D];  // past the last: unused
      f32x16 acc[K] = {};
      for (int d = 0; d < D; ++d)
        for (int i = 0; i < K; ++i) acc[i] += qt[d] * key[i][d];
      for (int i = 0; i < K; ++i) {
        const f32x16 s = lane > static_cast<float>(k0 + i - first_keys) ? acc[i] : none;  // a later row's: none
        top = top > s ? top : s;
        std::memcpy(&st[(k0 + i) * 16], &s, sizeof s);
      }
    }
    f32x16 total{};
    for (int64_t k = 0; k < keys; ++k) {
      f32x16 e = exp16(load16(&st[k * 16]) - top);
      e = lane > static_cast<float>(k - first_keys) ? e : f32x16{};  // exp16 gives none a tiny weight, not 0
      total += e;
      std::memcpy(&st[k * 16], &e, sizeof e);
    }
    for (int c = 0; c < D; c += J) {
      f32x16 acc[J] = {};
      for (int64_t k = 0; k < keys; ++k) {
        const f32x16 p = load16(&st[k * 16]);
        const float* value = &work.values[k * D + c];
        for (int j = 0; j < J; ++j) acc[j] += p * value[j];
      }
      for (int64_t r = 0; r < n; ++r)
        for (int j = 0; j < J; ++j) out[r * L.H * D + c + j] = static_cast<T>(acc[j][r] / total[r]);
    }
  }
}

struct Inputs {  // paged_attention's arguments; the scales undefined for a cache in the queries' dtype
  const at::Tensor &q, &k_cache, &v_cache, &query_start, &context_lens, &block_tables, &k_scale, &v_scale;
  float scale;
};

// A sequence whose query rows go to attend_rows16, RUN_ROWS a work item: a prompt chunk's, with AVX-512 (as
// attend_row16, where a vector is one register). Fewer rows (decode's one) go row by row.
constexpr bool is_run([[maybe_unused]] int64_t rows) {
#if defined(__AVX512F__)
  return rows >= 8;
#else
  return false;
#endif
}

template <typename T, typename C, int D>
void attend(const Inputs& in, at::Tensor& out) {
  const at::Tensor &q = in.q, &k = in.k_cache, &v = in.v_cache, &ks = in.k_scale, &vs = in.v_scale;
  const bool scaled = ks.defined();
  const Layout L{in.context_lens.size(0),    q.size(1),   k.size(1),   in.block_tables.size(1),
                 in.block_tables.stride(0),  k.stride(0), k.stride(1), k.stride(2),
                 v.stride(0),                v.stride(1), v.stride(2), q.stride(0),
                 q.stride(1),                scaled ? ks.stride(0) : 0, scaled ? ks.stride(1) : 0,
                 scaled ? ks.stride(2) : 0,  scaled ? vs.stride(0) : 0, scaled ? vs.stride(1) : 0,
                 scaled ? vs.stride(2) : 0};
  const int64_t* starts = in.query_start.data_ptr<int64_t>();
  const int64_t* lens = in.context_lens.data_ptr<int64_t>();
  const int64_t* tables = in.block_tables.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const C* kp = k.data_ptr<C>();
  const C* vp = v.data_ptr<C>();
  const float* ksp = scaled ? ks.data_ptr<float>() : nullptr;
  const float* vsp = scaled ? vs.data_ptr<float>() : nullptr;
  T* op = out.data_ptr<T>();
  // work items: (sequence, head, query row), or (sequence, head, RUN_ROWS rows) for a run; the rows of one
  // (sequence, head) together: their keys stay in cache
  std::vector<int64_t> item_start(L.B + 1, 0);
  for (int64_t b = 0; b < L.B; ++b) {
    const int64_t rows = starts[b + 1] - starts[b];
    TORCH_CHECK(rows >= 1 && lens[b] >= rows && lens[b] <= L.W * L.bs, "sequence ", b, ": ", rows,
                " query rows over ", lens[b], " keys in a table of ", L.W * L.bs);
    item_start[b + 1] = item_start[b] + (is_run(rows) ? (rows + RUN_ROWS - 1) / RUN_ROWS : rows) * L.H;
  }
  parallel(item_start[L.B], [&](int64_t begin, int64_t end) {
    Scratch work;
    int64_t b = std::upper_bound(item_start.begin(), item_start.end(), begin) - item_start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= item_start[b + 1]) ++b;
      const int64_t rows = starts[b + 1] - starts[b], local = item - item_start[b];
#if defined(__AVX512F__)
      if (is_run(rows)) {
        const int64_t items = (rows + RUN_ROWS - 1) / RUN_ROWS, h = local / items;
        const int64_t first = starts[b] + local % items * RUN_ROWS;
        attend_rows16<T, C, D>(L, qp + first * L.q_row + h * L.q_h, std::min(RUN_ROWS, starts[b + 1] - first),
                               kp + h * L.k_h, vp + h * L.v_h, scaled ? ksp + h * L.ks_h : nullptr,
                               scaled ? vsp + h * L.vs_h : nullptr, tables + b * L.table_stride,
                               lens[b] - (starts[b + 1] - 1 - first), in.scale, work, op + (first * L.H + h) * D);
        continue;
      }
#endif
      const int64_t h = local / rows, row = starts[b] + local % rows;
      const int64_t keys = lens[b] - (starts[b + 1] - 1 - row);  // causal: up to this row's own position
      attend_row<T, C, D>(L, qp + row * L.q_row + h * L.q_h, kp + h * L.k_h, vp + h * L.v_h,
                          scaled ? ksp + h * L.ks_h : nullptr, scaled ? vsp + h * L.vs_h : nullptr,
                          tables + b * L.table_stride, keys, in.scale, work, op + (row * L.H + h) * D);
    }
  });
}

template <typename T, typename C>
void attend_any(const Inputs& in, at::Tensor& out) {
  switch (in.q.size(2)) {  // the head dimension a compile-time constant: its loops unrolled, its sums in registers
    case 8: return attend<T, C, 8>(in, out);
    case 16: return attend<T, C, 16>(in, out);
    case 32: return attend<T, C, 32>(in, out);
    case 64: return attend<T, C, 64>(in, out);
    case 128: return attend<T, C, 128>(in, out);
    default: TORCH_CHECK(false, "head dimension 8, 16, 32, 64 or 128, not ", in.q.size(2));
  }
}

// An int8 cache's scales, checked against its values: [NB, bs, H] float32, one per row.
void check_scales(const at::Tensor& cache, const std::optional<at::Tensor>& scales, const char* name) {
  TORCH_CHECK(scales.has_value(), "an int8 cache needs its ", name);
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->dim() == 3 && scales->size(0) == cache.size(0) &&
                  scales->size(1) == cache.size(1) && scales->size(2) == cache.size(2),
              name, ": float32 [NB, bs, H] as the cache's rows");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start, const at::Tensor& context_lens,
                           const at::Tensor& block_tables, double scale, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [T, H, D], caches [NB, bs, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head dimension contiguous");
  const bool quantized = k_scale.has_value() || v_scale.has_value();
  const auto cache = quantized ? at::kChar : q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == cache && v_cache.scalar_type() == cache,
              quantized ? "scales with an int8 cache" : "caches in the queries' dtype (or int8, with scales)");
  if (quantized) check_scales(k_cache, k_scale, "k_scale"), check_scales(v_cache, v_scale, "v_scale");
  TORCH_CHECK(block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kLong, "int64 block table rows");
  const auto starts = query_start.contiguous(), lens = context_lens.contiguous();
  const at::Tensor none, &ks = quantized ? *k_scale : none, &vs = quantized ? *v_scale : none;
  const Inputs in{q, k_cache, v_cache, starts, lens, block_tables, ks, vs, static_cast<float>(scale)};
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());  // [T, H*D]
  if (q.scalar_type() == at::kFloat) {
    quantized ? attend_any<float, int8_t>(in, out) : attend_any<float, float>(in, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    quantized ? attend_any<at::BFloat16, int8_t>(in, out) : attend_any<at::BFloat16, at::BFloat16>(in, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16");
  }
  return out;
}

template <typename T>
void store_rows(at::Tensor& cache, const at::Tensor& rows, const int64_t* slots, int64_t begin, int64_t end) {
  const int64_t H = rows.size(1), D = rows.size(2), bs = cache.size(1);
  T* c = cache.data_ptr<T>();
  const T* r = rows.data_ptr<T>();
  for (int64_t t = begin; t < end; ++t)
    for (int64_t h = 0; h < H; ++h)
      std::copy_n(r + t * rows.stride(0) + h * rows.stride(1), D,
                  c + (slots[t] / bs) * cache.stride(0) + (slots[t] % bs) * cache.stride(1) + h * cache.stride(2));
}

// The largest of 16 lanes, in four rounds of halving (one vmaxss after another, 16 deep, took a quarter of a row's
// quantization).
inline float max16(f32x16 a) {
  f32x16 b = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a = a > b ? a : b;
  return std::max(a[0], a[1]);
}

// std::nearbyint of each lane: the nearest integer, ties to even in the default rounding mode, as torch.round. With
// AVX-512 the instruction GCC makes of nearbyint (vrndscaleps, current mode, no exceptions), written out: GCC's own
// loop over the lanes ran it on halves, through the stack.
inline f32x16 nearbyint16(f32x16 y) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_roundscale_ps((__m512)y, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
#else
  for (int j = 0; j < 16; ++j) y[j] = std::nearbyint(y[j]);
  return y;
#endif
}

// A row of D values as model/attention.py's quantize writes it: scale = max|x| / 127 (1 for a row of zeros), each
// value x / scale rounded to the nearest integer, ties to even as torch.round, within +-127. The scale is quantize's
// to the bit; the values are x times the scale's reciprocal, which rounds to another integer than quantize's division
// where x / scale lies within a rounding error of a half: 100 values in 153.6 million differed, by one (random normal
// rows). A division per element made a decode step's store 1.5x slower (0.066 against 0.045 ms a layer at batch 64,
// bfloat16, where the plain copy takes 0.022). The row is read once into registers (D a compile-time constant).
// Returns the scale.
template <typename T, int D>
inline float quantize_row(const T* x, int8_t* out) {
  float top = 0;
  f32x16 row[D / 16 + 1];
  if constexpr (D % 16 == 0) {
    f32x16 most{};
    for (int c = 0; c < D / 16; ++c) {
      row[c] = widen16(x + 16 * c);
      u32x16 bits;
      std::memcpy(&bits, &row[c], sizeof bits);
      bits &= 0x7FFFFFFFu;  // |x|
      f32x16 magnitude;
      std::memcpy(&magnitude, &bits, sizeof magnitude);
      most = most > magnitude ? most : magnitude;
    }
    top = max16(most);
  } else {
    for (int d = 0; d < D; ++d) top = std::max(top, std::abs(static_cast<float>(x[d])));
  }
  const float scale = top / 127.0f > 0 ? top / 127.0f : 1.0f, inverse = 1.0f / scale;
  if constexpr (D % 16 == 0) {
    for (int c = 0; c < D / 16; ++c) {
      f32x16 y = nearbyint16(row[c] * inverse);
      y = y > 127.0f ? splat(127.0f) : y;  // the product can land a hair past 127
      y = y < -127.0f ? splat(-127.0f) : y;
      const i8x16 q = __builtin_convertvector(__builtin_convertvector(y, i32x16), i8x16);  // vcvttps2dq, vpmovdb
      std::memcpy(out + 16 * c, &q, sizeof q);
    }
  } else {
    for (int d = 0; d < D; ++d)
      out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[d]) * inverse), -127.0f, 127.0f));
  }
  return scale;
}

// store_rows for an int8 cache: each (row, head) quantized straight into its slot, its scale beside it.
template <typename T, int D>
void store_quantized(at::Tensor& cache, at::Tensor& scales, const at::Tensor& rows, const int64_t* slots,
                     int64_t begin, int64_t end) {
  const int64_t H = rows.size(1), bs = cache.size(1), r_t = rows.stride(0), r_h = rows.stride(1);
  const int64_t c_nb = cache.stride(0), c_t = cache.stride(1), c_h = cache.stride(2);
  const int64_t s_nb = scales.stride(0), s_t = scales.stride(1), s_h = scales.stride(2);
  int8_t* c = cache.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  const T* r = rows.data_ptr<T>();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    for (int64_t h = 0; h < H; ++h)
      s[block * s_nb + offset * s_t + h * s_h] =
          quantize_row<T, D>(r + t * r_t + h * r_h, c + block * c_nb + offset * c_t + h * c_h);
  }
}

template <typename T>
void store_quantized(at::Tensor& cache, at::Tensor& scales, const at::Tensor& rows, const int64_t* slots,
                     int64_t begin, int64_t end) {
  switch (rows.size(2)) {
    case 8: return store_quantized<T, 8>(cache, scales, rows, slots, begin, end);
    case 16: return store_quantized<T, 16>(cache, scales, rows, slots, begin, end);
    case 32: return store_quantized<T, 32>(cache, scales, rows, slots, begin, end);
    case 64: return store_quantized<T, 64>(cache, scales, rows, slots, begin, end);
    case 128: return store_quantized<T, 128>(cache, scales, rows, slots, begin, end);
    default: assert(false);  // store_kv checks the head dimension before its threads start
  }
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k.dim() == 3 && k_cache.dim() == 4 && k.size(0) == slots.size(0), "k [T, H, D], cache [NB, bs, H, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head dimension contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "keys and values in one dtype");
  const bool quantized = k_scale.has_value() || v_scale.has_value();
  const auto cache = quantized ? at::kChar : k.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == cache && v_cache.scalar_type() == cache,
              quantized ? "scales with an int8 cache" : "caches in the rows' dtype (or int8, with scales)");
  if (quantized) {
    check_scales(k_cache, k_scale, "k_scale"), check_scales(v_cache, v_scale, "v_scale");
    const int64_t D = k.size(2);
    TORCH_CHECK(D == 8 || D == 16 || D == 32 || D == 64 || D == 128,
                "an int8 cache's head dimension 8, 16, 32, 64 or 128, not ", D);
  }
  auto s = slots.to(at::kLong).contiguous();
  const int64_t* slot = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0) * k_cache.size(1), "slot ", slot[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv", [&] {
    at::Tensor k_scales = quantized ? *k_scale : at::Tensor(), v_scales = quantized ? *v_scale : at::Tensor();
    // On torch's threads, each a contiguous share of the rows (a prompt chunk's rows then fill whole lines of each
    // head's block from one core). One thread spent 0.031-0.042 ms a layer on a decode step's 64 rows, now
    // 0.018-0.028; a 256-token chunk 0.069-0.080, now 0.036-0.040 (gpt2, bfloat16, 2 threads, Xeon Sapphire
    // Rapids, benchmarks.decode_step --ops); fewer than 16 rows stay on this thread, where the threads' wake-up
    // would cost more than they save.
    auto body = [&](int64_t begin, int64_t end) {
      if (quantized) {
        store_quantized<scalar_t>(k_cache, k_scales, k, slot, begin, end);
        store_quantized<scalar_t>(v_cache, v_scales, v, slot, begin, end);
      } else {
        store_rows<scalar_t>(k_cache, k, slot, begin, end);
        store_rows<scalar_t>(v_cache, v, slot, begin, end);
      }
    };
    at::parallel_for(0, s.size(0), 16, body);
  });
}

}  // namespace

TORCH_LIBRARY(gpt2_cpu, m) {
  // k_scale, v_scale: an int8 cache's [NB, bs, H] float32 scales (model/attention.py, LayerKV); None: the cache
  // is in the queries' dtype
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start, Tensor context_lens, "
        "Tensor block_tables, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
}
