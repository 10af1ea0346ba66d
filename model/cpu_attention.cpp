// Paged attention on a CPU: every query row reads its sequence's keys and values in place, through the
// block table, once. The reference backend (model/attention.py) copies them out first and reads them
// again in two matrix products: three passes over the cache instead of one, and the cache is what a
// decode step at batch 64 mostly reads. Same inputs and semantics as the Triton kernel: query rows
// flat over sequences, sequence b's rows query_start[b]..query_start[b+1]-1 being the last of its
// context_lens[b] positions (causal within a chunk).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

// 32 elements from p as two vectors, in an order that only the kernel's own vectors share: float32's as they are;
// bfloat16's (float32's top halves) even elements in `a` and odd ones in `b`, each widened by one shift or one mask
// of the same 64 bytes, where widening 16 in order takes a zero-extension and a shift per vector.
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

// load32's inverse for 32 results: their elements back in order.
inline void store32(float* p, const f32x16& a, const f32x16& b, const float*) {
  std::memcpy(p, &a, sizeof a);
  std::memcpy(p + 16, &b, sizeof b);
}

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

struct Layout {  // where a query row, a key and a value are, in elements
  int64_t B, H, bs, W, table_stride, k_nb, k_t, k_h, v_nb, v_t, v_h, q_row, q_h;
};

// attend_row on vectors of 16 floats, for head dimensions of whole pairs of vectors: scores 16 keys at a time
// (their sums in one sums16), the softmax's exponentials 16 at a time, values weighted a vector at a time. Only
// where AVX-512 holds a vector in one register (Xeon, Zen 4): with AVX2 a group's 16 partial sums would not fit
// the registers (and the scalar form was measured on Zen 3).
template <typename T, int D>
void attend_row16(const Layout& L, const T* q, const T* kp, const T* vp, const int64_t* table, int64_t keys,
                  float scale, std::vector<float>& scores, T* out) {
  constexpr int V = D / 16;  // vectors a row, in load32's order
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32x16 none = splat(-std::numeric_limits<float>::infinity());
  f32x16 qv[V], acc[V], part[16], x[V];
  for (int c = 0; c < V; c += 2) load32(q + 16 * c, qv[c], qv[c + 1]);
  for (int c = 0; c < V; ++c) qv[c] *= scale;
  scores.resize(keys + 16);  // a group's lanes past a block's last key are written, then the next block's
  f32x16 top = none;
  for (int64_t start = 0; start < keys; start += L.bs) {
    const T* k = kp + table[start / L.bs] * L.k_nb;
    const int64_t n = std::min(L.bs, keys - start);
    if (start + L.bs < keys) prefetch(kp + table[start / L.bs + 1] * L.k_nb, L.bs * L.k_t);
    for (int64_t i = 0; i < n; i += 16) {
      const int64_t m = std::min<int64_t>(16, n - i);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const T* key = k + (i + std::min<int64_t>(j, m - 1)) * L.k_t;  // past the last: the last again, unused
        for (int c = 0; c < V; c += 2) load32(key + 16 * c, x[c], x[c + 1]);
        part[j] = qv[0] * x[0];
        for (int c = 1; c < V; ++c) part[j] += qv[c] * x[c];
      }
      const f32x16 s = lane < static_cast<float>(m) ? sums16(part) : none;
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
    std::memcpy(&scores[t], &e, sizeof e);
    total += e;
  }
  for (int c = 0; c < V; ++c) acc[c] = f32x16{};
  for (int64_t start = 0; start < keys; start += L.bs) {
    const T* v = vp + table[start / L.bs] * L.v_nb;
    const int64_t n = std::min(L.bs, keys - start);
    if (start + L.bs < keys) prefetch(vp + table[start / L.bs + 1] * L.v_nb, L.bs * L.v_t);
    for (int64_t i = 0; i < n; ++i) {
      const f32x16 p = splat(scores[start + i]);
      for (int c = 0; c < V; c += 2) load32(v + i * L.v_t + 16 * c, x[c], x[c + 1]);
      for (int c = 0; c < V; ++c) acc[c] += p * x[c];
    }
  }
  float sum = 0, row[D];
  for (int j = 0; j < 16; ++j) sum += total[j];
  for (int c = 0; c < V; c += 2) store32(row + 16 * c, acc[c], acc[c + 1], q);
  for (int d = 0; d < D; ++d) out[d] = static_cast<T>(row[d] / sum);
}

// One (sequence, head, query row): scores over its keys, block by block, then the weighted sum of values.
template <typename T, int D>
void attend_row(const Layout& L, const T* q, const T* kp, const T* vp, const int64_t* table, int64_t keys,
                float scale, std::vector<float>& scores, T* out) {
#if defined(__AVX512F__)
  if constexpr (D % 32 == 0) return attend_row16<T, D>(L, q, kp, vp, table, keys, scale, scores, out);
#endif
  float qf[D], acc[D];
  for (int d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]) * scale;
  scores.resize(keys);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t start = 0; start < keys; start += L.bs) {
    const T* k = kp + table[start / L.bs] * L.k_nb;
    const int64_t n = std::min(L.bs, keys - start);
    for (int64_t i = 0; i < n; ++i) top = std::max(top, scores[start + i] = dot<T, D>(qf, k + i * L.k_t));
  }
  float total = 0;
  for (int64_t t = 0; t < keys; ++t) total += scores[t] = std::exp(scores[t] - top);
  for (int d = 0; d < D; ++d) acc[d] = 0;
  for (int64_t start = 0; start < keys; start += L.bs) {
    const T* v = vp + table[start / L.bs] * L.v_nb;
    const int64_t n = std::min(L.bs, keys - start);
    for (int64_t i = 0; i < n; ++i) {
      const float p = scores[start + i];
      const T* row = v + i * L.v_t;
      for (int d = 0; d < D; ++d) acc[d] += p * static_cast<float>(row[d]);
    }
  }
  for (int d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] / total);
}

template <typename T, int D>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& query_start,
            const at::Tensor& context_lens, const at::Tensor& block_tables, float scale, at::Tensor& out) {
  const Layout L{context_lens.size(0), q.size(1),          k_cache.size(1),   block_tables.size(1),
                 block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 v_cache.stride(0),      v_cache.stride(1), v_cache.stride(2), q.stride(0),
                 q.stride(1)};
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // work items: (sequence, head, query row), the rows of one (sequence, head) together: their keys stay in cache
  std::vector<int64_t> item_start(L.B + 1, 0);
  for (int64_t b = 0; b < L.B; ++b) {
    const int64_t rows = starts[b + 1] - starts[b];
    TORCH_CHECK(rows >= 1 && lens[b] >= rows && lens[b] <= L.W * L.bs, "sequence ", b, ": ", rows,
                " query rows over ", lens[b], " keys in a table of ", L.W * L.bs);
    item_start[b + 1] = item_start[b] + rows * L.H;
  }
  parallel(item_start[L.B], [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    int64_t b = std::upper_bound(item_start.begin(), item_start.end(), begin) - item_start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= item_start[b + 1]) ++b;
      const int64_t rows = starts[b + 1] - starts[b], local = item - item_start[b];
      const int64_t h = local / rows, row = starts[b] + local % rows;
      const int64_t keys = lens[b] - (starts[b + 1] - 1 - row);  // causal: up to this row's own position
      attend_row<T, D>(L, qp + row * L.q_row + h * L.q_h, kp + h * L.k_h, vp + h * L.v_h, tables + b * L.table_stride,
                       keys, scale, scores, op + (row * L.H + h) * D);
    }
  });
}

template <typename T>
void attend_any(int64_t D, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                const at::Tensor& lens, const at::Tensor& tables, float scale, at::Tensor& out) {
  switch (D) {  // the head dimension a compile-time constant: its loops unrolled, its sums in registers
    case 8: return attend<T, 8>(q, k, v, starts, lens, tables, scale, out);
    case 16: return attend<T, 16>(q, k, v, starts, lens, tables, scale, out);
    case 32: return attend<T, 32>(q, k, v, starts, lens, tables, scale, out);
    case 64: return attend<T, 64>(q, k, v, starts, lens, tables, scale, out);
    case 128: return attend<T, 128>(q, k, v, starts, lens, tables, scale, out);
    default: TORCH_CHECK(false, "head dimension 8, 16, 32, 64 or 128, not ", D);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start, const at::Tensor& context_lens,
                           const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [T, H, D], caches [NB, bs, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head dimension contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "one dtype");
  TORCH_CHECK(block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kLong, "int64 block table rows");
  auto starts = query_start.contiguous(), lens = context_lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());  // [T, H*D]
  const int64_t D = q.size(2);
  if (q.scalar_type() == at::kFloat) {
    attend_any<float>(D, q, k_cache, v_cache, starts, lens, block_tables, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_any<at::BFloat16>(D, q, k_cache, v_cache, starts, lens, block_tables, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16");
  }
  return out;
}

template <typename T>
void store_rows(at::Tensor& cache, const at::Tensor& rows, const int64_t* slots) {
  const int64_t T_ = rows.size(0), H = rows.size(1), D = rows.size(2), bs = cache.size(1);
  T* c = cache.data_ptr<T>();
  const T* r = rows.data_ptr<T>();
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t h = 0; h < H; ++h)
      std::copy_n(r + t * rows.stride(0) + h * rows.stride(1), D,
                  c + (slots[t] / bs) * cache.stride(0) + (slots[t] % bs) * cache.stride(1) + h * cache.stride(2));
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k_cache.dim() == 4 && k.size(0) == slots.size(0), "k [T, H, D], cache [NB, bs, H, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head dimension contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "one dtype");
  auto s = slots.to(at::kLong).contiguous();
  const int64_t* slot = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0) * k_cache.size(1), "slot ", slot[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "store_kv", [&] {
    store_rows<scalar_t>(k_cache, k, slot);
    store_rows<scalar_t>(v_cache, v, slot);
  });
}

}  // namespace

TORCH_LIBRARY(gpt2_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start, Tensor context_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, TORCH_FN(store_kv));
}
