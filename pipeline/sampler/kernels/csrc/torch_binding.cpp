// Torch binding for the fused sampler (dg_sampler.cu): checks tensors, then passes raw pointers and the
// current CUDA stream to the extern "C" launchers. Outputs are caller-allocated (pipeline/kernels/
// gpu_sampler.py) so a caller can reuse buffers across steps and tests can poison them.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

extern "C" {
int dg_sampler_rows(const void* logits, int logits_bf16, int batch, int length, int vocab,
                    const float* temperature, const int64_t* seed, const int64_t* request,
                    const int64_t* canvas, const int64_t* step, float* entropy, float* max_prob,
                    int64_t* argmax, int64_t* sample, void* probs, const uint8_t* mask_table,
                    const int64_t* mask_index, cudaStream_t stream);
int dg_sampler_accept(int batch, int length, int vocab, const float* entropy_in, const int64_t* argmax_in,
                      const int64_t* sample, const int64_t* templ, const float* bound, const int64_t* seed,
                      const int64_t* request, const int64_t* canvas, const int64_t* step,
                      const int64_t* prev_argmax, const int64_t* stable_in, const int64_t* stability_threshold,
                      const float* confidence_threshold, float* entropy_out, uint8_t* kept,
                      int64_t* canvas_out, int64_t* argmax_out, int64_t* stable_out, uint8_t* stop,
                      cudaStream_t stream);
}

namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
           const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(int err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Kernel A: per-position entropy, max probability, argmax, Gumbel sample; softmax(z) in bf16 if given.
// Constrained decoding: `mask_table` [M, V] bool and `mask_index` [B, L] int64 (-1 = free), both or neither;
// every index below M, which is not checked here (that would read the device): `guided.mask_rows` makes them so.
void rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& seed,
          const at::Tensor& request, const at::Tensor& canvas, const at::Tensor& step, at::Tensor& entropy,
          at::Tensor& max_prob, at::Tensor& argmax, at::Tensor& sample, std::optional<at::Tensor> probs,
          std::optional<at::Tensor> mask_table, std::optional<at::Tensor> mask_index) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 3, "logits must be a [B, L, V] CUDA tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous");
  const int64_t b = logits.size(0), l = logits.size(1), v = logits.size(2);
  // kernel A walks the vocabulary with an int index that steps past its end by up to a block's chunk
  TORCH_CHECK(v <= (int64_t{1} << 30), "vocabulary of ", v, " tokens: at most 2^30");
  TORCH_CHECK(b * l < (int64_t{1} << 31), "logits too large");
  const auto dev = logits.device();
  check(temperature, "temperature", at::kFloat, {b}, dev);
  for (const auto* t : {&seed, &request, &canvas, &step}) check(*t, "row key", at::kLong, {b}, dev);
  check(entropy, "entropy", at::kFloat, {b, l}, dev);
  check(max_prob, "max_prob", at::kFloat, {b, l}, dev);
  check(argmax, "argmax", at::kLong, {b, l}, dev);
  check(sample, "sample", at::kLong, {b, l}, dev);
  void* probs_ptr = nullptr;
  if (probs.has_value()) {
    check(*probs, "probs", at::kBFloat16, {b, l, v}, dev);
    probs_ptr = probs->data_ptr();
  }
  TORCH_CHECK(mask_table.has_value() == mask_index.has_value(), "mask_table and mask_index go together");
  const uint8_t* table_ptr = nullptr;
  const int64_t* index_ptr = nullptr;
  if (mask_table.has_value()) {
    TORCH_CHECK(mask_table->dim() == 2 && mask_table->size(0) >= 1, "mask_table must be [M, V], M >= 1");
    check(*mask_table, "mask_table", at::kBool, {mask_table->size(0), v}, dev);
    check(*mask_index, "mask_index", at::kLong, {b, l}, dev);
    table_ptr = static_cast<const uint8_t*>(mask_table->data_ptr());
    index_ptr = mask_index->data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(dev);
  const int err = dg_sampler_rows(
      logits.data_ptr(), logits.scalar_type() == at::kBFloat16, static_cast<int>(b), static_cast<int>(l),
      static_cast<int>(v), temperature.data_ptr<float>(), seed.data_ptr<int64_t>(), request.data_ptr<int64_t>(),
      canvas.data_ptr<int64_t>(), step.data_ptr<int64_t>(), entropy.data_ptr<float>(),
      max_prob.data_ptr<float>(), argmax.data_ptr<int64_t>(), sample.data_ptr<int64_t>(), probs_ptr, table_ptr,
      index_ptr, c10::cuda::getCurrentCUDAStream().stream());
  check_launch(err, "dg_sampler_rows");
}

// Kernel B: acceptance, next canvas, argmax canvas, stability counter and stop flag. In place is fine:
// entropy_out may be entropy_in, argmax_out may be argmax_in, stable_out may be stable_in.
void accept(int64_t vocab, const at::Tensor& entropy_in, const at::Tensor& argmax_in, const at::Tensor& sample,
            std::optional<at::Tensor> templ, const at::Tensor& bound, const at::Tensor& seed,
            const at::Tensor& request, const at::Tensor& canvas, const at::Tensor& step,
            const at::Tensor& prev_argmax, const at::Tensor& stable_in, const at::Tensor& stability_threshold,
            const at::Tensor& confidence_threshold, at::Tensor& entropy_out, at::Tensor& kept,
            at::Tensor& canvas_out, at::Tensor& argmax_out, at::Tensor& stable_out, at::Tensor& stop) {
  TORCH_CHECK(entropy_in.is_cuda() && entropy_in.dim() == 2, "entropy must be a [B, L] CUDA tensor");
  const int64_t b = entropy_in.size(0), l = entropy_in.size(1);
  TORCH_CHECK(l >= 1 && l <= 1024, "canvas length must be in [1, 1024], got ", l);
  TORCH_CHECK(vocab >= 1 && vocab < (int64_t{1} << 32), "bad vocabulary size ", vocab);
  const auto dev = entropy_in.device();
  check(entropy_in, "entropy_in", at::kFloat, {b, l}, dev);
  check(argmax_in, "argmax_in", at::kLong, {b, l}, dev);
  check(sample, "sample", at::kLong, {b, l}, dev);
  const int64_t* templ_ptr = nullptr;
  if (templ.has_value()) {
    check(*templ, "template", at::kLong, {b, l}, dev);
    templ_ptr = templ->data_ptr<int64_t>();
  }
  check(bound, "bound", at::kFloat, {b}, dev);
  for (const auto* t : {&seed, &request, &canvas, &step}) check(*t, "row key", at::kLong, {b}, dev);
  check(prev_argmax, "prev_argmax", at::kLong, {b, l}, dev);
  check(stable_in, "stable_count", at::kLong, {b}, dev);
  check(stability_threshold, "stability_threshold", at::kLong, {b}, dev);
  check(confidence_threshold, "confidence_threshold", at::kFloat, {b}, dev);
  check(entropy_out, "entropy_out", at::kFloat, {b, l}, dev);
  check(kept, "kept", at::kBool, {b, l}, dev);
  check(canvas_out, "canvas_out", at::kLong, {b, l}, dev);
  check(argmax_out, "argmax_out", at::kLong, {b, l}, dev);
  check(stable_out, "stable_out", at::kLong, {b}, dev);
  check(stop, "stop", at::kBool, {b}, dev);
  const c10::cuda::CUDAGuard guard(dev);
  const int err = dg_sampler_accept(
      static_cast<int>(b), static_cast<int>(l), static_cast<int>(vocab), entropy_in.data_ptr<float>(),
      argmax_in.data_ptr<int64_t>(), sample.data_ptr<int64_t>(), templ_ptr, bound.data_ptr<float>(),
      seed.data_ptr<int64_t>(), request.data_ptr<int64_t>(), canvas.data_ptr<int64_t>(), step.data_ptr<int64_t>(),
      prev_argmax.data_ptr<int64_t>(), stable_in.data_ptr<int64_t>(), stability_threshold.data_ptr<int64_t>(),
      confidence_threshold.data_ptr<float>(), entropy_out.data_ptr<float>(),
      static_cast<uint8_t*>(kept.data_ptr()), canvas_out.data_ptr<int64_t>(), argmax_out.data_ptr<int64_t>(),
      stable_out.data_ptr<int64_t>(), static_cast<uint8_t*>(stop.data_ptr()),
      c10::cuda::getCurrentCUDAStream().stream());
  check_launch(err, "dg_sampler_accept");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dgpipe fused sampler step (see pipeline/kernels/csrc/dg_sampler.cu)";
  m.def("rows", &rows, "kernel A: entropy, max prob, argmax, Gumbel sample, bf16 softmax");
  m.def("accept", &accept, "kernel B: entropy-bound acceptance, next canvas, stability, stop");
}
