// Python bindings of the CPU ops in this directory (one extension module).
#include <torch/extension.h>

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale);
void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor start_pos, double scale);
bool paged_prefill_supported(int64_t head_dim);
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_write_kv_bf16(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                        int64_t num_kv_heads);
torch::Tensor argmax_rows(torch::Tensor logits);
bool linear_bf16_supported();
torch::Tensor pack_linear_bf16(torch::Tensor w, bool interleave);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
torch::Tensor linear_logits_bf16(torch::Tensor x, torch::Tensor packed);
torch::Tensor linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill", &paged_prefill, "paged causal attention for prompt chunks (bf16, CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_supported", &paged_prefill_supported, "whether paged_prefill runs at this head_dim on this build");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm, bf16 in and out, HF's rounding (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual += x (in place), then RMSNorm of it (bf16, CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "row-wise argmax of fp32 logits, as torch.argmax(dim=-1) (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16_supported", &linear_bf16_supported, "whether the bf16 projection kernels run on this build (AVX512-BF16)");
  m.def("pack_linear_bf16", &pack_linear_bf16, "a [N, K] bf16 weight in linear_bf16's layout (interleave: gate/up halves block by block)",
        py::arg("w"), py::arg("interleave") = false);
  m.def("linear_bf16", &linear_bf16, "x @ w^T (+ bias), bf16, for a packed weight (CPU)", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("linear_logits_bf16", &linear_logits_bf16, "fp32 logits rounded through bf16, for a packed weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_silu_mul_bf16", &linear_silu_mul_bf16, "silu(gate) * up of a fused gate/up projection, for an interleaved packed weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv_bf16", &rope_write_kv_bf16, "RoPE on q/k in place + k/v rows to their cache slots (bf16, CPU)", py::call_guard<py::gil_scoped_release>());
}
