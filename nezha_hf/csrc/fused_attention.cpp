// NEZHA relative-position attention as one fused CPU kernel (float32), forward and backward.
//
// The maths is `nezha_hf/relative_attention.py`'s (see its module docstring):
//     s_ij  = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask,   r(i, j) = clip(j - i, -K, K) + K
//     out_i = sum_j p_ij (v_j + T[r(i, j)])
// computed like flash attention: query blocks against key blocks with an online softmax, so
// memory stays linear in the length. The relative key term is a lookup in `qt = scale * q T^T`
// (per query row, 2K + 1 numbers); the value term is accumulated as probability mass per table
// row (`bucket`, 2K + 1 numbers per query row) and added as `bucket @ T` at the end. In a key
// block each query row splits into at most three contiguous column ranges: the left tail (row 0),
// the band (rows 1 .. 2K - 1) and the right tail (row 2K).
//
// Queries sit at positions `offset .. offset + Lq - 1` against keys `0 .. Lk - 1` (with a KV cache
// the queries are the new tokens). Attention dropout multiplies p_ij by keep_ij / (1 - p) in both
// value terms; keep_ij comes from a counter-based hash of (seed, batch * heads + head, i, j), so the
// backward regenerates the forward's mask instead of storing it (`Problem::row_key` and `keep_factor` are the
// definition; tests re-derive it independently).
//
// Matrix products go to PyTorch's CPU micro-kernel (`gemm` below); the loader in fused_attention.py falls back to the
// chunked engine if this file does not build or load.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major C[M, N] = A[M, K] @ B[K, N] (+ C when `accumulate`), with leading dimensions (row strides). This is
// PyTorch's own micro-kernel for its CPU flash attention (oneDNN's brgemm where available, BLAS otherwise),
// about 30% faster than BLAS sgemm on these block sizes (benchmarks/results/attention-bfloat16.md); it takes
// no transposes, so keys and values are transposed once per call where a product needs them that way.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  if (M > 0 && N > 0) at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, false);
}

// `columns`-wide rows of a `rows` x `columns` matrix (row stride `ld`) as a contiguous `columns` x `rows` matrix.
inline void transpose_into(float* out, const float* in, int64_t rows, int64_t columns, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c) out[c * rows + r] = in[r * ld + c];
}

// expf to about 1 ulp, written so the compiler vectorises the loops that call it; 0 below -87, NaN stays NaN.
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof(float));
  return x != x ? x : x < -87.0f ? 0.0f : p * power;
}

// A 32-bit integer hash with full avalanche ("lowbias32", C. Wellons' hash prospector).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// bucket[first + c] += values[c] over a band range; a tail range (step 0) adds its total to one bucket.
template <typename Step>
inline void add_to_bucket(float* bucket, const float* values, int64_t start, int64_t stop, int64_t first, Step step,
                          float range_total) {
  if (step) {
#pragma omp simd
    for (int64_t c = start; c < stop; ++c) bucket[first + c] += values[c];
  } else {
    bucket[first] += range_total;
  }
}

struct Problem {
  int64_t B, H, Lq, Lk, d, K, R, offset;
  float scale;
  bool causal;
  const bool* key_valid;         // [B, Lk] or null
  const bool* key_source;        // [B, Lk] or null (UniLM prefix mask, with causal)
  std::vector<int64_t> key_end;      // per batch row: keys past this are never visible to a causal query block
  std::vector<int64_t> first_valid;  // per batch row: its first key that is not padding (Lk if none)
  std::vector<bool> valid_source;    // per batch row: whether a source key is not padding (a prefix mask)
  int64_t q_block, kv_block;
  bool dropout;
  uint32_t threshold, seed_lo, seed_hi;  // keep_ij when its hash >= threshold = p * 2^32
  float keep_scale;                      // 1 / (1 - p)

  // Keys a causal query block ending before absolute position `stop` may see: up to itself, or to the last source key.
  int64_t keys_for(int64_t b, int64_t stop) const { return causal ? std::min(Lk, std::max(stop, key_end[b])) : Lk; }

  // Whether query position `i` of batch row `b` sees no key at all (all padding, or left padding under a causal
  // mask): its output is 0, as transformers 5's BERT gives by default. Any other row that ends up with no
  // probability mass had only -inf scores (infinite inputs) and gives NaN, as eager attention does.
  bool sees_nothing(int64_t b, int64_t i) const {
    return causal ? first_valid[b] > i && !valid_source[b] : first_valid[b] == Lk;
  }

  // Calls body(start, stop, first, step) for the three column ranges of query position `i` in the key
  // block starting at `n` with `kb` keys: the left tail, the band and the right tail. Column `c` of a
  // range uses table row `first + step * c`; step is a compile-time 0 in the tails and 1 in the band.
  template <typename Body>
  void for_each_range(int64_t i, int64_t n, int64_t kb, Body&& body) const {
    const int64_t left = std::min(std::max(i - K + 1 - n, int64_t(0)), kb);
    const int64_t right = std::min(std::max(i + K - n, int64_t(0)), kb);
    body(int64_t(0), left, int64_t(0), std::integral_constant<int64_t, 0>());
    body(left, right, n - i + K, std::integral_constant<int64_t, 1>());
    body(right, kb, 2 * K, std::integral_constant<int64_t, 0>());
  }

  void apply_mask(float* row, int64_t b, int64_t i, int64_t n, int64_t kb) const {
    if (!causal && !key_valid) return;
    const bool* valid = key_valid ? key_valid + b * Lk + n : nullptr;
    const bool* source = key_source ? key_source + b * Lk + n : nullptr;
    for (int64_t c = 0; c < kb; ++c) {
      bool visible = !valid || valid[c];
      if (causal) visible = visible && (n + c <= i || (source && source[c]));
      if (!visible) row[c] = kNegInf;
    }
  }

  // The dropout stream of one query row: key ("bh" = batch * heads + head, "i" = query position).
  uint32_t row_key(int64_t bh, int64_t i) const {
    return mix32(mix32(mix32(seed_lo ^ mix32(seed_hi)) ^ static_cast<uint32_t>(bh)) ^ static_cast<uint32_t>(i));
  }

  // keep_ij / (1 - p) for key position j of the row with dropout stream `key`: 1 / (1 - p) or 0.
  inline float keep_factor(uint32_t key, int64_t j) const {
    return mix32(key ^ (static_cast<uint32_t>(j) * 0x9e3779b9U)) >= threshold ? keep_scale : 0.0f;
  }
};

Problem make_problem(const at::Tensor& q, const at::Tensor& k, int64_t K, double scale, bool causal,
                     const at::Tensor& key_valid, const at::Tensor& key_source, int64_t offset, double dropout_p,
                     int64_t seed, int64_t q_block, int64_t kv_block) {
  Problem p;
  p.B = q.size(0), p.H = q.size(1), p.Lq = q.size(2), p.Lk = k.size(2), p.d = q.size(3);
  p.K = K, p.R = 2 * K + 1, p.offset = offset;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.key_valid = key_valid.defined() ? key_valid.data_ptr<bool>() : nullptr;
  p.key_source = key_source.defined() ? key_source.data_ptr<bool>() : nullptr;
  p.key_end.assign(p.B, 0);
  p.first_valid.assign(p.B, p.key_valid ? p.Lk : 0);
  p.valid_source.assign(p.B, false);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t j = p.Lk - 1; j >= 0; --j) {
      const bool valid = !p.key_valid || p.key_valid[b * p.Lk + j];
      if (valid) p.first_valid[b] = j;
      if (causal && p.key_source && p.key_source[b * p.Lk + j]) {
        p.key_end[b] = std::max(p.key_end[b], j + 1);
        if (valid) p.valid_source[b] = true;
      }
    }
  // 0: PyTorch's own CPU flash kernel's choice (query blocks by length, 512 keys); tests pass small blocks.
  p.q_block = q_block > 0 ? q_block : p.Lq >= 768 ? 256 : p.Lq >= 192 ? 64 : 32;
  p.kv_block = kv_block > 0 ? kv_block : 512;
  p.dropout = dropout_p > 0.0;
  p.threshold = static_cast<uint32_t>(std::min(std::ldexp(dropout_p, 32), 4294967295.0));
  p.keep_scale = p.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.0f;
  p.seed_lo = static_cast<uint32_t>(static_cast<uint64_t>(seed) & 0xffffffffU);
  p.seed_hi = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  return p;
}

at::Tensor optional_flags(const c10::optional<at::Tensor>& flags) {
  return flags.has_value() ? flags->to(at::kBool).contiguous() : at::Tensor();
}

// Rows of a [B, H, L, d] tensor must be distinct, unit-stride vectors for the BLAS calls (an expanded
// length dimension, stride 0, would alias them): anything else is copied first.
at::Tensor rows_usable(const at::Tensor& t) {
  return t.stride(3) == 1 && t.stride(2) >= t.size(3) ? t : t.contiguous();
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
                  int64_t K, const at::Tensor& key_valid, const at::Tensor& key_source, double dropout_p) {
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 4,
                "NEZHA kernel: expected float32 CPU tensors [batch, heads, length, head_size]");
  TORCH_CHECK(key.sizes() == value.sizes(), "NEZHA kernel: key and value must have the same shape");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(1) == query.size(1) && key.size(3) == query.size(3),
              "NEZHA kernel: query, key and value must agree in batch, heads and head size");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.size(0) == 2 * K + 1 &&
                  table.size(1) == query.size(3),
              "NEZHA kernel: the table must be float32 [2K + 1, head_size]");
  for (const at::Tensor* flags : {&key_valid, &key_source})
    TORCH_CHECK(!flags->defined() || (flags->dim() == 2 && flags->size(0) == query.size(0) && flags->size(1) == key.size(2)),
                "NEZHA kernel: key flags must be [batch, key_length]");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "NEZHA kernel: dropout must be in [0, 1)");
}

}  // namespace

// Returns (out [B, Lq, H, d] contiguous, lse [B, H, Lq]); a row that sees no key gets out 0, lse -inf.
std::vector<at::Tensor> forward(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                                const at::Tensor& table, int64_t K, double scale, bool causal,
                                const c10::optional<at::Tensor>& key_valid, const c10::optional<at::Tensor>& key_source,
                                int64_t offset, double dropout_p, int64_t seed, int64_t q_block, int64_t kv_block) {
  const at::Tensor query = rows_usable(query_in), key = rows_usable(key_in), value = rows_usable(value_in);
  const at::Tensor valid = optional_flags(key_valid), source = optional_flags(key_source), T = table.contiguous();
  check_inputs(query, key, value, T, K, valid, source, dropout_p);
  const Problem p = make_problem(query, key, K, scale, causal, valid, source, offset, dropout_p, seed, q_block, kv_block);
  const int64_t B = p.B, H = p.H, Lq = p.Lq, d = p.d, R = p.R;
  auto out = at::empty({B, Lq, H, d}, query.options());
  auto lse = at::empty({B, H, Lq}, query.options());
  const at::Tensor key_t = key.transpose(2, 3).contiguous(), table_t = T.t().contiguous();  // [B, H, d, Lk], [d, R]
  const float *q = query.data_ptr<float>(), *kt = key_t.data_ptr<float>(), *v = value.data_ptr<float>();
  const float *t = T.data_ptr<float>(), *tt = table_t.data_ptr<float>();
  float *o = out.data_ptr<float>(), *l = lse.data_ptr<float>();
  const int64_t qs = query.stride(2), vs = value.stride(2), Lk = p.Lk;
  const int64_t num_q_blocks = (Lq + p.q_block - 1) / p.q_block;

  // One task per (batch, head, query block); query blocks vary fastest so each thread gets whole heads.
  at::parallel_for(0, B * H * num_q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(p.q_block * p.kv_block), qt(p.q_block * R), bucket(p.q_block * R), acc(p.q_block * d);
    std::vector<float> row_max(p.q_block), row_sum(p.q_block);
    std::vector<uint32_t> row_keys(p.q_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (H * num_q_blocks), h = task / num_q_blocks % H;
      const int64_t m = task % num_q_blocks * p.q_block, qb = std::min(p.q_block, Lq - m);
      const float* qm = q + b * query.stride(0) + h * query.stride(1) + m * qs;
      const float* kth = kt + (b * H + h) * d * Lk;
      const float* vh = v + b * value.stride(0) + h * value.stride(1);
      gemm(qb, R, d, qm, qs, tt, R, qt.data(), R, false);  // q . T[p], scaled below like the scores
      for (int64_t x = 0; x < qb * R; ++x) qt[x] *= p.scale;
      std::fill(bucket.begin(), bucket.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      if (p.dropout)
        for (int64_t r = 0; r < qb; ++r) row_keys[r] = p.row_key(b * H + h, p.offset + m + r);
      const int64_t keys = p.keys_for(b, p.offset + m + qb);
      for (int64_t n = 0; n < keys; n += p.kv_block) {
        const int64_t kb = std::min(p.kv_block, keys - n);
        gemm(qb, kb, d, qm, qs, kth + n, Lk, scores.data(), kb, false);
        for (int64_t r = 0; r < qb; ++r) {
          const int64_t i = p.offset + m + r;
          float* row = scores.data() + r * kb;
          const float* terms = qt.data() + r * R;
          p.apply_mask(row, b, i, n, kb);
          float new_max = row_max[r];
          p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
            float range_max = kNegInf;  // relative key term added, masked entries stay -inf
            int not_a_number = 0;
#pragma omp simd reduction(max : range_max) reduction(| : not_a_number)
            for (int64_t c = start; c < stop; ++c) {
              row[c] = row[c] * p.scale + terms[first + step * c];
              range_max = row[c] > range_max ? row[c] : range_max;
              not_a_number |= row[c] != row[c];
            }
            // A NaN score makes the row NaN, as in eager attention (a maximum would skip it).
            new_max = not_a_number ? std::numeric_limits<float>::quiet_NaN() : std::max(new_max, range_max);
          });
          if (new_max == kNegInf) {  // nothing visible yet: this block adds nothing to the row
            std::fill(row, row + kb, 0.0f);
            continue;
          }
          const float correction = fast_exp(row_max[r] - new_max);  // 0 while the row was empty
          float* row_bucket = bucket.data() + r * R;
          float* row_acc = acc.data() + r * d;
          if (correction != 1.0f) {
            for (int64_t x = 0; x < R; ++x) row_bucket[x] *= correction;
            for (int64_t x = 0; x < d; ++x) row_acc[x] *= correction;
          }
          float sum = 0.0f;
          p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
            float range_sum = 0.0f;
#pragma omp simd reduction(+ : range_sum)
            for (int64_t c = start; c < stop; ++c) {
              row[c] = fast_exp(row[c] - new_max);
              range_sum += row[c];
            }
            sum += range_sum;  // the softmax denominator counts every probability, dropped or not
            if (p.dropout) {  // both value terms see p_ij keep_ij / (1 - p)
              const uint32_t key = row_keys[r];
              range_sum = 0.0f;
#pragma omp simd reduction(+ : range_sum)
              for (int64_t c = start; c < stop; ++c) {
                row[c] *= p.keep_factor(key, n + c);
                range_sum += row[c];
              }
            }
            add_to_bucket(row_bucket, row, start, stop, first, step, range_sum);  // value term mass
          });
          row_sum[r] = row_sum[r] * correction + sum;
          row_max[r] = new_max;
        }
        gemm(qb, d, kb, scores.data(), kb, vh + n * vs, vs, acc.data(), d, true);
      }
      gemm(qb, d, R, bucket.data(), R, t, d, acc.data(), d, true);  // value term
      for (int64_t r = 0; r < qb; ++r) {
        const bool empty = p.sees_nothing(b, p.offset + m + r);
        const float inverse = empty ? 0.0f : 1.0f / row_sum[r];  // a sum of 0 otherwise: NaN, as in eager
        float* out_row = o + ((b * Lq + m + r) * H + h) * d;
        for (int64_t x = 0; x < d; ++x) out_row[x] = empty ? 0.0f : acc[r * d + x] * inverse;
        l[(b * H + h) * Lq + m + r] = empty                ? kNegInf
                                      : row_sum[r] == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                                           : row_max[r] + std::log(row_sum[r]);
      }
    }
  });
  return {out, lse};
}

// Gradients of query [B, Lq, H, d], key and value [B, Lk, H, d] (contiguous), given the forward's output and lse.
std::vector<at::Tensor> backward(const at::Tensor& grad_out_in, const at::Tensor& query_in, const at::Tensor& key_in,
                                 const at::Tensor& value_in, const at::Tensor& out_in, const at::Tensor& lse,
                                 const at::Tensor& table, int64_t K, double scale, bool causal,
                                 const c10::optional<at::Tensor>& key_valid, const c10::optional<at::Tensor>& key_source,
                                 int64_t offset, double dropout_p, int64_t seed, int64_t q_block, int64_t kv_block) {
  const at::Tensor query = rows_usable(query_in), key = rows_usable(key_in), value = rows_usable(value_in);
  const at::Tensor grad_out = rows_usable(grad_out_in), out = rows_usable(out_in);
  const at::Tensor valid = optional_flags(key_valid), source = optional_flags(key_source), T = table.contiguous();
  check_inputs(query, key, value, T, K, valid, source, dropout_p);
  TORCH_CHECK(grad_out.sizes() == query.sizes() && out.sizes() == query.sizes() && grad_out.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "NEZHA kernel: the output and its gradient must be float32 and shaped like the query");
  const at::Tensor row_lse = lse.contiguous();
  const Problem p = make_problem(query, key, K, scale, causal, valid, source, offset, dropout_p, seed, q_block, kv_block);
  const int64_t B = p.B, H = p.H, Lq = p.Lq, Lk = p.Lk, d = p.d, R = p.R;
  auto grad_query = at::empty({B, Lq, H, d}, query.options());
  // Key and value gradients accumulate transposed, [B, H, d, Lk], as the products give them.
  auto grad_key_t = at::zeros({B, H, d, Lk}, query.options()), grad_value_t = at::zeros({B, H, d, Lk}, query.options());
  const at::Tensor key_t = key.transpose(2, 3).contiguous(), value_t = value.transpose(2, 3).contiguous();
  const at::Tensor table_t = T.t().contiguous();
  const float *q = query.data_ptr<float>(), *k = key.data_ptr<float>(), *kt = key_t.data_ptr<float>();
  const float *vt = value_t.data_ptr<float>(), *tt = table_t.data_ptr<float>();
  const float *go = grad_out.data_ptr<float>(), *o = out.data_ptr<float>(), *t = T.data_ptr<float>();
  const float* lse_data = row_lse.data_ptr<float>();
  float *gq = grad_query.data_ptr<float>(), *gkt = grad_key_t.data_ptr<float>(), *gvt = grad_value_t.data_ptr<float>();
  const int64_t qs = query.stride(2), ks = key.stride(2), gos = grad_out.stride(2);
  const int64_t os = out.stride(2), gs = H * d;  // the query gradient is [B, L, H, d]

  // One task per (batch, head): key and value gradients of a head are summed over its query blocks.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(p.q_block * p.kv_block), grad_scores(p.q_block * p.kv_block);
    std::vector<float> qt(p.q_block * R), grad_terms(p.q_block * R), grad_bucket(p.q_block * R);
    std::vector<float> acc(p.q_block * d), row_dot(p.q_block), row_lse_inf(p.q_block);
    std::vector<float> query_t(d * p.q_block), grad_out_t(d * p.q_block);  // the query block's rows, transposed
    std::vector<uint32_t> row_keys(p.q_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const float* qh = q + b * query.stride(0) + h * query.stride(1);
      const float* kh = k + b * key.stride(0) + h * key.stride(1);
      const float *kth = kt + (b * H + h) * d * Lk, *vth = vt + (b * H + h) * d * Lk;
      const float* goh = go + b * grad_out.stride(0) + h * grad_out.stride(1);
      const float* oh = o + b * out.stride(0) + h * out.stride(1);
      float* gqh = gq + b * Lq * gs + h * d;
      float *gkth = gkt + (b * H + h) * d * Lk, *gvth = gvt + (b * H + h) * d * Lk;
      for (int64_t m = 0; m < Lq; m += p.q_block) {
        const int64_t qb = std::min(p.q_block, Lq - m);
        const float* qm = qh + m * qs;
        const float* gom = goh + m * gos;
        gemm(qb, R, d, qm, qs, tt, R, qt.data(), R, false);
        for (int64_t x = 0; x < qb * R; ++x) qt[x] *= p.scale;
        gemm(qb, R, d, gom, gos, tt, R, grad_terms.data(), R, false);  // dO . T[p]
        transpose_into(query_t.data(), qm, qb, d, qs);
        transpose_into(grad_out_t.data(), gom, qb, d, gos);
        for (int64_t r = 0; r < qb; ++r) {
          row_dot[r] = 0.0f;  // D_i = dO_i . O_i (the output already holds the dropped probabilities)
          for (int64_t x = 0; x < d; ++x) row_dot[r] += gom[r * gos + x] * oh[(m + r) * os + x];
          const float value_lse = lse_data[(b * H + h) * Lq + m + r];
          row_lse_inf[r] = value_lse == kNegInf ? -kNegInf : value_lse;  // empty rows: every probability 0
          if (p.dropout) row_keys[r] = p.row_key(b * H + h, p.offset + m + r);
        }
        std::fill(grad_bucket.begin(), grad_bucket.end(), 0.0f);
        std::fill(acc.begin(), acc.end(), 0.0f);
        const int64_t keys = p.keys_for(b, p.offset + m + qb);
        for (int64_t n = 0; n < keys; n += p.kv_block) {
          const int64_t kb = std::min(p.kv_block, keys - n);
          gemm(qb, kb, d, qm, qs, kth + n, Lk, probs.data(), kb, false);
          gemm(qb, kb, d, gom, gos, vth + n, Lk, grad_scores.data(), kb, false);
          for (int64_t r = 0; r < qb; ++r) {
            const int64_t i = p.offset + m + r;
            float* prob = probs.data() + r * kb;
            float* grad = grad_scores.data() + r * kb;
            const float *terms = qt.data() + r * R, *value_terms = grad_terms.data() + r * R;
            const float lse_i = row_lse_inf[r], dot = row_dot[r];
            p.apply_mask(prob, b, i, n, kb);
            p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
#pragma omp simd
              for (int64_t c = start; c < stop; ++c) {
                prob[c] = fast_exp(prob[c] * p.scale + terms[first + step * c] - lse_i);
                grad[c] += value_terms[first + step * c];  // dP~_ij = dO_i . (v_j + T[r(i, j)])
              }
              if (p.dropout) {  // dP_ij = dP~_ij z_ij with z = keep / (1 - p); the value gradient takes P z
                const uint32_t key = row_keys[r];
#pragma omp simd
                for (int64_t c = start; c < stop; ++c) {
                  const float z = p.keep_factor(key, n + c);
                  grad[c] = prob[c] * (z * grad[c] - dot);
                  prob[c] *= z;
                }
              } else {
#pragma omp simd
                for (int64_t c = start; c < stop; ++c) grad[c] = prob[c] * (grad[c] - dot);  // dS = P (dP - D)
              }
              float range_sum = 0.0f;
#pragma omp simd reduction(+ : range_sum)
              for (int64_t c = start; c < stop; ++c) range_sum += grad[c];
              add_to_bucket(grad_bucket.data() + r * R, grad, start, stop, first, step, range_sum);
            });
          }
          gemm(d, kb, qb, grad_out_t.data(), qb, probs.data(), kb, gvth + n, Lk, true);  // dV^T += dO^T P
          gemm(qb, d, kb, grad_scores.data(), kb, kh + n * ks, ks, acc.data(), d, true);
          gemm(d, kb, qb, query_t.data(), qb, grad_scores.data(), kb, gkth + n, Lk, true);  // dK^T += Q^T dS
        }
        // dq_i = scale * (sum_j dS_ij k_j + sum_p bucket_ip T[p])
        gemm(qb, d, R, grad_bucket.data(), R, t, d, acc.data(), d, true);
        for (int64_t r = 0; r < qb; ++r)
          for (int64_t x = 0; x < d; ++x) gqh[(m + r) * gs + x] = p.scale * acc[r * d + x];
      }
    }
  });
  // dK = scale * dS^T Q; both back to [B, Lk, H, d].
  return {grad_query, grad_key_t.mul_(scale).permute({0, 3, 1, 2}).contiguous(),
          grad_value_t.permute({0, 3, 1, 2}).contiguous()};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The GIL is released while the kernel runs: other Python threads go on meanwhile.
  module.def("forward", &forward, "NEZHA relative attention forward: (out [B, Lq, H, d], lse [B, H, Lq])",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("backward", &backward, "NEZHA relative attention backward: grads of query, key, value as [B, L, H, d]",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
