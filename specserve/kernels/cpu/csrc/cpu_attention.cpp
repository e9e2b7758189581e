// Paged attention for short queries on CPU (decode steps, chain verification), fp32.
//
// The reference path gathers every sequence's context into a padded batch and calls SDPA; for one query per
// sequence most of its time goes to copying and padding, not to the attention itself. This
// kernel reads keys and values straight from their cache slots: for each token it scores the context
// with every query head (eight slots at a time, one add tree per eight dot products), softmaxes, and sums
// the values with the output held in registers. Token t sees the first kv_len[t] entries of its sequence's
// slot row (causal within the step).
#include <immintrin.h>
#include <omp.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

// The sums of eight vectors as one vector: a transposing add tree (7 adds) instead of 8 horizontal sums.
inline __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// out[i] = scale * q . k_i for the (up to) eight keys k_i = keys + row[i] * stride: eight independent FMA
// chains over D, one add tree at the end.
void scores8(const float* q, const float* keys, const int64_t* row, int64_t count, int64_t stride, int64_t D,
             float scale, float* out) {
  const float* k[8];
  for (int i = 0; i < 8; ++i) k[i] = keys + row[std::min<int64_t>(i, count - 1)] * stride;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[0] + d), a0);
    a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[1] + d), a1);
    a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[2] + d), a2);
    a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[3] + d), a3);
    a4 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[4] + d), a4);
    a5 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[5] + d), a5);
    a6 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[6] + d), a6);
    a7 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[7] + d), a7);
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_mul_ps(_mm256_set1_ps(scale), sums8(a0, a1, a2, a3, a4, a5, a6, a7)));
  std::copy(sums, sums + count, out);
}

// out[0:8C] = sum_j p[j] * (values + row[j] * stride)[0:8C]: the output stays in C registers (a constant trip
// count, so the compiler unrolls the array into registers).
template <int C>
void weighted_sum(const float* p, const float* values, const int64_t* row, int64_t n, int64_t stride, float* out) {
  __m256 a[C];
  for (int i = 0; i < C; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* v = values + row[j] * stride;
    for (int i = 0; i < C; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[i]);
  }
  for (int i = 0; i < C; ++i) _mm256_storeu_ps(out + 8 * i, a[i]);
}

// s[j] <- e^(s[j] - peak) / sum, in place.
void softmax(float* s, int64_t n) {
  const float peak = *std::max_element(s, s + n);
  const __m256 peak_v = _mm256_set1_ps(peak);
  __m256 total_v = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), peak_v));
    _mm256_storeu_ps(s + j, e);
    total_v = _mm256_add_ps(total_v, e);
  }
  float total = horizontal_sum(total_v);
  for (; j < n; ++j) total += (s[j] = std::exp(s[j] - peak));
  const float inv = 1.0f / total;
  for (j = 0; j < n; ++j) s[j] *= inv;
}

// The same over a head of any width that is a multiple of 8, 64 columns at a time.
void weighted_sum_head(const float* p, const float* values, const int64_t* row, int64_t n, int64_t stride,
                       int64_t D, float* out) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weighted_sum<8>(p, values + d, row, n, stride, out + d);
  switch ((D - d) / 8) {
    case 0: return;
    case 1: return weighted_sum<1>(p, values + d, row, n, stride, out + d);
    case 2: return weighted_sum<2>(p, values + d, row, n, stride, out + d);
    case 3: return weighted_sum<3>(p, values + d, row, n, stride, out + d);
    case 4: return weighted_sum<4>(p, values + d, row, n, stride, out + d);
    case 5: return weighted_sum<5>(p, values + d, row, n, stride, out + d);
    case 6: return weighted_sum<6>(p, values + d, row, n, stride, out + d);
    default: return weighted_sum<7>(p, values + d, row, n, stride, out + d);
  }
}

}  // namespace

// q [T, H, D]; kv_cache [2, S, Hkv, D]; kv_slots [B, L] int64; token_seq [T] int64; kv_len [T] int64.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& kv_cache, const at::Tensor& kv_slots,
                              const at::Tensor& token_seq, const at::Tensor& kv_len, double scale) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_slots.is_contiguous(), "contiguous cache and slots");
  const auto q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv_cache.size(2), G = H / Hkv;
  const int64_t S = kv_cache.size(1), L = kv_slots.size(1);
  TORCH_CHECK(D % 8 == 0 && H % Hkv == 0 && kv_cache.size(3) == D, "head_dim a multiple of 8, H % Hkv == 0");
  TORCH_CHECK(token_seq.is_contiguous() && kv_len.is_contiguous() && token_seq.numel() == T && kv_len.numel() == T,
              "one sequence index and one context length per token");
  TORCH_CHECK(token_seq.scalar_type() == at::kLong && kv_len.scalar_type() == at::kLong &&
              kv_slots.scalar_type() == at::kLong, "int64 metadata");
  // A bad slot would read outside the cache: check them all (a few thousand integers a call).
  const int64_t* all_slots = kv_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < kv_slots.numel(); ++i) TORCH_CHECK(all_slots[i] >= 0 && all_slots[i] < S, "slot outside the cache");
  const int64_t* seq_of = token_seq.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(seq_of[t] >= 0 && seq_of[t] < kv_slots.size(0), "sequence outside the slot table");
  auto out = at::zeros_like(q);
  const float* qd = q.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + S * Hkv * D;
  const int64_t* slots = kv_slots.data_ptr<int64_t>();
  const int64_t* seq = token_seq.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One token per work item, all its heads together: a slot's keys (or values) for every head are one
  // contiguous run, and a page's slots follow each other, so the reads stream.
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = std::min(lens[t], L);
      if (n <= 0) continue;
      const int64_t* row = slots + seq[t] * L;
      const float* qt = qd + t * H * D;
      float* ot = o + t * H * D;
      scores.resize(H * n);
      // Eight slots at a time, every head: the block's keys stay in L1 across the heads.
      for (int64_t j = 0; j < n; j += 8)
        for (int64_t h = 0; h < H; ++h)
          scores8(qt + h * D, keys + (h / G) * D, row + j, std::min<int64_t>(8, n - j), Hkv * D, D, fscale,
                  scores.data() + h * n + j);
      for (int64_t h = 0; h < H; ++h) softmax(scores.data() + h * n, n);
      for (int64_t h = 0; h < H; ++h)
        weighted_sum_head(scores.data() + h * n, values + (h / G) * D, row, n, Hkv * D, D, ot + h * D);
    }
  }
  return out;
}
