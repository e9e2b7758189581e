// fp32 y = x W^T (+ b) for CPU decode, where x has few rows and W does not fit in cache.
//
// oneDNN and MKL read the weights of such shapes well below the rate a plain streaming read gets
// (docs/performance.md, "The CPU"). This kernel streams each weight once: W is packed into panels of 8 output
// columns ([N/8][K][8]), so a panel is one contiguous run; for each panel every block of up to 8 input rows
// accumulates in registers. Threads split the panels. The math is fp32 FMAs in K order, so results differ
// from oneDNN's only in rounding.
//
// Decode streams every weight once per step, so its speed is the weights' size. A weight whose every value
// is a bf16 number (a checkpoint stored in bf16, such as a draft head) is packed as bf16 and widened to fp32
// in registers: exactly the same fp32 values and math, half the bytes.
#include <immintrin.h>
#include <omp.h>
#include <ATen/ATen.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 8;  // output columns per panel: one AVX2 register

// Eight weights of a panel row as fp32: loaded, or widened from bf16 (its bits are an fp32's high half).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

__m256i tail_mask(int64_t valid) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < valid ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}

// One panel times a block of R rows. xt holds the block transposed ([K][R]) so one k reads one cache line.
// The accumulators are named variables, not an array: GCC keeps an array of __m256 on the stack and stores it
// every iteration, which made this loop store-bound.
template <int R, typename W>
void panel_block(const float* xt, int64_t K, const W* w, const float* bias, float* out, int64_t ldo,
                 int64_t valid) {
  const __m256i mask = tail_mask(valid);
  const __m256 init = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
  __m256 a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel + 512), _MM_HINT_T0);
    const __m256 wk = load8(w + k * kPanel);
    const float* xk = xt + k * R;
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk), wk, a0);
    if constexpr (R > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 1), wk, a1);
    if constexpr (R > 2) a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 2), wk, a2);
    if constexpr (R > 3) a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 3), wk, a3);
    if constexpr (R > 4) a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 4), wk, a4);
    if constexpr (R > 5) a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 5), wk, a5);
    if constexpr (R > 6) a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 6), wk, a6);
    if constexpr (R > 7) a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 7), wk, a7);
  }
  const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  for (int r = 0; r < R; ++r) {
    if (valid == kPanel) _mm256_storeu_ps(out + r * ldo, acc[r]);
    else _mm256_maskstore_ps(out + r * ldo, mask, acc[r]);
  }
}

// A single row: four panels at once, so four independent FMA chains hide the FMA latency.
template <typename W>
void four_panels_one_row(const float* x, int64_t K, const W* w, const float* bias, float* out) {
  const int64_t stride = K * kPanel;
  __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 a1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 a2 = bias ? _mm256_loadu_ps(bias + 16) : _mm256_setzero_ps();
  __m256 a3 = bias ? _mm256_loadu_ps(bias + 24) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xk = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xk, load8(w + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(xk, load8(w + stride + k * kPanel), a1);
    a2 = _mm256_fmadd_ps(xk, load8(w + 2 * stride + k * kPanel), a2);
    a3 = _mm256_fmadd_ps(xk, load8(w + 3 * stride + k * kPanel), a3);
  }
  _mm256_storeu_ps(out, a0);
  _mm256_storeu_ps(out + 8, a1);
  _mm256_storeu_ps(out + 16, a2);
  _mm256_storeu_ps(out + 24, a3);
}

// Two neighbouring full panels (contiguous in the packed weight) times a block of R <= 6 rows: 2R independent
// FMA chains instead of R, so a few rows are not bound by the FMA latency (one panel and two rows ran at
// half the weight rate of one row); 2R accumulators + 2 weights + 1 broadcast fit AVX2's 16 registers.
template <int R, typename W>
void two_panels_block(const float* xt, int64_t K, const W* w, const float* bias, float* out, int64_t ldo) {
  static_assert(R <= 6, "2R accumulators must fit the registers");
  const W* w1 = w + K * kPanel;
  const __m256 i0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 i1 = bias ? _mm256_loadu_ps(bias + kPanel) : _mm256_setzero_ps();
  __m256 a0 = i0, a1 = i0, a2 = i0, a3 = i0, a4 = i0, a5 = i0;
  __m256 c0 = i1, c1 = i1, c2 = i1, c3 = i1, c4 = i1, c5 = i1;
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + k * kPanel + 512), _MM_HINT_T0);
    const __m256 u = load8(w + k * kPanel), v = load8(w1 + k * kPanel);
    const float* xk = xt + k * R;
    __m256 x = _mm256_broadcast_ss(xk);
    a0 = _mm256_fmadd_ps(x, u, a0), c0 = _mm256_fmadd_ps(x, v, c0);
    if constexpr (R > 1) x = _mm256_broadcast_ss(xk + 1), a1 = _mm256_fmadd_ps(x, u, a1), c1 = _mm256_fmadd_ps(x, v, c1);
    if constexpr (R > 2) x = _mm256_broadcast_ss(xk + 2), a2 = _mm256_fmadd_ps(x, u, a2), c2 = _mm256_fmadd_ps(x, v, c2);
    if constexpr (R > 3) x = _mm256_broadcast_ss(xk + 3), a3 = _mm256_fmadd_ps(x, u, a3), c3 = _mm256_fmadd_ps(x, v, c3);
    if constexpr (R > 4) x = _mm256_broadcast_ss(xk + 4), a4 = _mm256_fmadd_ps(x, u, a4), c4 = _mm256_fmadd_ps(x, v, c4);
    if constexpr (R > 5) x = _mm256_broadcast_ss(xk + 5), a5 = _mm256_fmadd_ps(x, u, a5), c5 = _mm256_fmadd_ps(x, v, c5);
  }
  const __m256 left[6] = {a0, a1, a2, a3, a4, a5}, right[6] = {c0, c1, c2, c3, c4, c5};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, left[r]);
    _mm256_storeu_ps(out + r * ldo + kPanel, right[r]);
  }
}

template <typename W>
void two_panels(int64_t R, const float* xt, int64_t K, const W* w, const float* b, float* o, int64_t ldo) {
  switch (R) {
    case 1: return two_panels_block<1>(xt, K, w, b, o, ldo);
    case 2: return two_panels_block<2>(xt, K, w, b, o, ldo);
    case 3: return two_panels_block<3>(xt, K, w, b, o, ldo);
    case 4: return two_panels_block<4>(xt, K, w, b, o, ldo);
    case 5: return two_panels_block<5>(xt, K, w, b, o, ldo);
    default: return two_panels_block<6>(xt, K, w, b, o, ldo);
  }
}

template <typename W>
void rows(int64_t R, const float* xt, int64_t K, const W* w, const float* b, float* o, int64_t ldo, int64_t v) {
  switch (R) {
    case 1: return panel_block<1>(xt, K, w, b, o, ldo, v);
    case 2: return panel_block<2>(xt, K, w, b, o, ldo, v);
    case 3: return panel_block<3>(xt, K, w, b, o, ldo, v);
    case 4: return panel_block<4>(xt, K, w, b, o, ldo, v);
    case 5: return panel_block<5>(xt, K, w, b, o, ldo, v);
    case 6: return panel_block<6>(xt, K, w, b, o, ldo, v);
    case 7: return panel_block<7>(xt, K, w, b, o, ldo, v);
    default: return panel_block<8>(xt, K, w, b, o, ldo, v);
  }
}

template <typename W>
void packed_gemm(const float* xd, int64_t M, int64_t K, const W* w, int64_t panels, const float* b, float* o,
                 int64_t N, float* xt) {
  auto valid = [N](int64_t p) { return std::min(kPanel, N - p * kPanel); };
  if (M == 1) {
#pragma omp parallel
    {
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      int64_t p = panels * t / nt;
      const int64_t end = panels * (t + 1) / nt;
      for (; p + 4 <= end && valid(p + 3) == kPanel; p += 4)
        four_panels_one_row(xd, K, w + p * K * kPanel, b ? b + p * kPanel : nullptr, o + p * kPanel);
      for (; p < end; ++p)
        rows(1, xd, K, w + p * K * kPanel, b ? b + p * kPanel : nullptr, o + p * kPanel, N, valid(p));
    }
    return;
  }
  // Rows in blocks of 8, each block transposed to [K][R].
  for (int64_t start = 0; start < M; start += kPanel) {
    const int64_t R = std::min(kPanel, M - start);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) xt[start * K + k * R + r] = xd[(start + r) * K + k];
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t end = panels * (t + 1) / nt;
    for (int64_t p = panels * t / nt; p < end;) {
      const bool pair = p + 1 < end && valid(p + 1) == kPanel;
      for (int64_t start = 0; start < M; start += kPanel) {
        const int64_t R = std::min(kPanel, M - start);
        const float* bias = b ? b + p * kPanel : nullptr;
        if (pair && R <= 6)
          two_panels(R, xt + start * K, K, w + p * K * kPanel, bias, o + start * N + p * kPanel, N);
        else
          for (int64_t q = p; q < p + (pair ? 2 : 1); ++q)
            rows(R, xt + start * K, K, w + q * K * kPanel, b ? b + q * kPanel : nullptr, o + start * N + q * kPanel,
                 N, valid(q));
      }
      p += pair ? 2 : 1;
    }
  }
}

}  // namespace

// [N, K] -> [ceil(N/8), K, 8], zero-padded past N, in the weight's dtype (fp32, or bf16 for bf16 values).
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack: a 2-D fp32 or bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2, "linear: a 2-D fp32 input");
  const auto x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == K && packed.size(2) == kPanel &&
              panels == (N + kPanel - 1) / kPanel, "linear: packed shape");
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16, "linear: packed dtype");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == N &&
                                    bias->scalar_type() == at::kFloat), "linear: an fp32 bias of out_features");
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto blocks = at::empty({M > 1 ? M * K : 0}, x.options());
  if (packed.scalar_type() == at::kBFloat16)
    packed_gemm(x.data_ptr<float>(), M, K, packed.data_ptr<at::BFloat16>(), panels, b, out.data_ptr<float>(), N,
                blocks.data_ptr<float>());
  else
    packed_gemm(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), panels, b, out.data_ptr<float>(), N,
                blocks.data_ptr<float>());
  return out;
}
