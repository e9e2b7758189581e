// Python bindings of the CPU kernels (cpu_gemm.cpp, cpu_attention.cpp, cpu_pointwise.cpp).
#include <torch/extension.h>

at::Tensor pack(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_slots,
                           const at::Tensor& token_seq, const at::Tensor& kv_len, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_(const at::Tensor& positions, const at::Tensor& cos_sin, at::Tensor& q, at::Tensor& k);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack an [N, K] fp32 weight into 8-column panels");
  m.def("linear", &linear, "x W^T + b from a packed weight");
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("paged_attention", &paged_attention, "attention of short queries over paged fp32 KV");
}
