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
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 16;  // independent partial sums: the compiler vectorises them without reassociating

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

// One (sequence, head, query row): scores over its keys, block by block, then the weighted sum of values.
template <typename T, int D>
void attend_row(const Layout& L, const T* q, const T* kp, const T* vp, const int64_t* table, int64_t keys,
                float scale, std::vector<float>& scores, T* out) {
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
