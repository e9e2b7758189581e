// Paged attention for short queries on CPU (decode steps, chain verification), fp32.
//
// The reference path gathers every sequence's context into a padded batch and calls SDPA; for one query per
// sequence on a 2-core machine that spent ~0.7 ms a layer at batch 8, most of it copying and padding. This
// kernel reads keys and values straight from their cache slots: for each token it scores the context
// with every query head, softmaxes, and sums the values. Token t sees the
// first kv_len[t] entries of its sequence's slot row (causal within the step).
#include <immintrin.h>
#include <omp.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

// Four accumulators, so the FMAs of one dot product do not wait on each other.
float dot(const float* a, const float* b, int64_t D) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t d = 0;
  for (; d + 32 <= D; d += 32)
    for (int i = 0; i < 4; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8 * i), _mm256_loadu_ps(b + d + 8 * i), acc[i]);
  for (; d < D; d += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc[0]);
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
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

void axpy(float a, const float* x, float* y, int64_t D) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
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
      for (int64_t j = 0; j < n; ++j) {
        if (j + 1 < n) _mm_prefetch(reinterpret_cast<const char*>(keys + row[j + 1] * Hkv * D), _MM_HINT_T0);
        const float* kj = keys + row[j] * Hkv * D;
        for (int64_t h = 0; h < H; ++h) scores[h * n + j] = fscale * dot(qt + h * D, kj + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h) softmax(scores.data() + h * n, n);
      for (int64_t j = 0; j < n; ++j) {
        if (j + 1 < n) _mm_prefetch(reinterpret_cast<const char*>(values + row[j + 1] * Hkv * D), _MM_HINT_T0);
        const float* vj = values + row[j] * Hkv * D;
        for (int64_t h = 0; h < H; ++h) axpy(scores[h * n + j], vj + (h / G) * D, ot + h * D, D);
      }
    }
  }
  return out;
}
