// The elementwise math between the matmuls, one pass each, for fp32 CPU decode. In eager PyTorch each of
// these is 3-10 small kernels; at a small model's size (SmolLM2: 576 wide, 30 layers) their dispatch cost is a
// noticeable share of a decode step. Same formulas as kernels/pointwise.py.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <omp.h>

#include <cmath>

#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name, ": 2-D fp32 rows");
  TORCH_CHECK(x.size(1) % 8 == 0, name, ": width a multiple of 8");
}

}  // namespace

// weight * x / sqrt(mean(x^2) + eps), row by row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.scalar_type() == at::kFloat,
              "rms_norm: an fp32 weight of the row width");
  auto out = at::empty({T, H}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for if (T > 16)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xd + t * ld;
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(horizontal_sum(squares) / H + static_cast<float>(eps)));
    for (int64_t i = 0; i < H; i += 8)
      _mm256_storeu_ps(o + t * H + i,
                       _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(row + i), scale)));
  }
  return out;
}

// Rotate-half rotary embedding, in place on q [T, H, D] and k [T, Hkv, D] (rows may be strided views).
void rotary_(const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& q, at::Tensor& k) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos_sin.is_contiguous(), "rotary: int64 positions");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(half % 8 == 0 && cos_sin.size(1) == D, "rotary: half the head a multiple of 8");
  TORCH_CHECK(positions.is_contiguous() && positions.numel() == T && k.size(0) == T && k.size(2) == D,
              "rotary: one position per token, q and k of one length and head size");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rotary: position out of range");
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->stride(2) == 1 && x->stride(1) == D, "rotary: fp32 heads");
    const int64_t heads = x->size(1), ld = x->stride(0);
    float* xd = x->data_ptr<float>();
#pragma omp parallel for if (T > 16)
    for (int64_t t = 0; t < T; ++t) {
      const float* cos = table + pos[t] * D;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        float* head = xd + t * ld + h * D;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(head + i), x2 = _mm256_loadu_ps(head + half + i);
          const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
          _mm256_storeu_ps(head + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
          _mm256_storeu_ps(head + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
        }
      }
    }
  }
}

// silu(gate) * up for gate_up = [gate | up] ([T, 2I] -> [T, I]).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  TORCH_CHECK(I % 8 == 0, "silu_and_mul: width a multiple of 16");
  auto out = at::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for if (T > 16)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + t * ld + i), up = _mm256_loadu_ps(g + t * ld + I + i);
      // e = exp(-|x|) never overflows; silu(x) = x / (1 + e) for x >= 0 and x * e / (1 + e) below.
      const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));
      const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
      _mm256_storeu_ps(o + t * I + i, _mm256_mul_ps(_mm256_div_ps(numerator, _mm256_add_ps(one, e)), up));
    }
  }
  return out;
}
