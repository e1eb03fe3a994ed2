// Runs dg_sampler.cu's kernels A and B, the source itself (cut before its host launchers into kernels_only.cu
// by emulate.py), on the host emulation of cuda_runtime.h / cuda_bf16.h beside this file, on inputs emulate.py
// wrote into a directory; writes every output next to them. Usage: driver DIR [force_scalar]
#include "kernels_only.cu"
#include <cstdio>
#include <fstream>
#include <string>

template <class T> std::vector<T> rd(const std::string& p, size_t n) {
  std::vector<T> v(n);
  if (n == 0) return v;
  std::ifstream f(p, std::ios::binary);
  if (!f) { std::fprintf(stderr, "missing %s\n", p.c_str()); std::exit(2); }
  f.read(reinterpret_cast<char*>(v.data()), n * sizeof(T));
  return v;
}
template <class T> void wr(const std::string& p, const std::vector<T>& v) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

int main(int argc, char** argv) {
  const std::string d = argv[1];
  const bool force_scalar = argc > 2 && std::string(argv[2]) == "1";
  int B, L, V, is_bf16, M, has_tpl, want_probs;
  std::FILE* mf = std::fopen((d + "/meta.txt").c_str(), "r");
  if (std::fscanf(mf, "%d %d %d %d %d %d %d", &B, &L, &V, &is_bf16, &M, &has_tpl, &want_probs) != 7) return 2;
  std::fclose(mf);
  const size_t n = size_t(B) * L, nv = n * V;
  auto temp = rd<float>(d + "/temperature.bin", B);
  auto seed = rd<int64_t>(d + "/seed.bin", B), request = rd<int64_t>(d + "/request.bin", B);
  auto canvas = rd<int64_t>(d + "/canvas.bin", B), step = rd<int64_t>(d + "/step.bin", B);
  auto table = rd<uint8_t>(d + "/mask_table.bin", size_t(M) * V);
  auto index = rd<int64_t>(d + "/mask_index.bin", M ? n : 0);
  auto tpl = rd<int64_t>(d + "/template.bin", has_tpl ? n : 0);
  auto bound = rd<float>(d + "/bound.bin", B), conf = rd<float>(d + "/conf.bin", B);
  auto prev = rd<int64_t>(d + "/prev.bin", n);
  auto stable_in = rd<int64_t>(d + "/stable_in.bin", B), stab_k = rd<int64_t>(d + "/stab_k.bin", B);
  std::vector<float> entropy(n, -7.0f), max_prob(n, -7.0f);
  std::vector<int64_t> argmax(n, -1), sample(n, -1), canvas_out(n, -1), stable(B, -1);
  std::vector<uint8_t> kept(n, 0xAA), stop(B, 0xAA);
  std::vector<__nv_bfloat16> probs(want_probs ? nv : 0, __nv_bfloat16{0x40E0});  // poison: 7.0
  const uint8_t* tp = M ? table.data() : nullptr;
  const int64_t* ip = M ? index.data() : nullptr;
  __nv_bfloat16* pp = want_probs ? probs.data() : nullptr;
  if (is_bf16) {
    auto x = rd<__nv_bfloat16>(d + "/logits.bin", nv);
    const bool vec = !force_scalar && V % 8 == 0;
    emu_launch(unsigned(n), 512, [&] {
      if (vec) dg_rows_bf16x8(x.data(), L, V, temp.data(), seed.data(), request.data(), canvas.data(), step.data(),
                              entropy.data(), max_prob.data(), argmax.data(), sample.data(), pp, tp, ip);
      else dg_rows_bf16x1(x.data(), L, V, temp.data(), seed.data(), request.data(), canvas.data(), step.data(),
                          entropy.data(), max_prob.data(), argmax.data(), sample.data(), pp, tp, ip);
    });
  } else {
    auto x = rd<float>(d + "/logits.bin", nv);
    const bool vec = !force_scalar && V % 4 == 0;
    emu_launch(unsigned(n), 512, [&] {
      if (vec) dg_rows_f32x4(x.data(), L, V, temp.data(), seed.data(), request.data(), canvas.data(), step.data(),
                             entropy.data(), max_prob.data(), argmax.data(), sample.data(), pp, tp, ip);
      else dg_rows_f32x1(x.data(), L, V, temp.data(), seed.data(), request.data(), canvas.data(), step.data(),
                         entropy.data(), max_prob.data(), argmax.data(), sample.data(), pp, tp, ip);
    });
  }
  wr(d + "/out_entropy_a.bin", entropy);
  wr(d + "/out_max_prob.bin", max_prob);
  wr(d + "/out_argmax_a.bin", argmax);
  wr(d + "/out_sample.bin", sample);
  if (want_probs) wr(d + "/out_probs.bin", probs);
  int block = 32;
  while (block < L) block <<= 1;
  // in place, as gpu_sampler.sample_step_cuda calls it: entropy and argmax are input and output
  emu_launch(unsigned(B), unsigned(block), [&] {
    dg_accept(L, V, entropy.data(), argmax.data(), sample.data(), has_tpl ? tpl.data() : nullptr, bound.data(),
              seed.data(), request.data(), canvas.data(), step.data(), prev.data(), stable_in.data(), stab_k.data(),
              conf.data(), entropy.data(), kept.data(), canvas_out.data(), argmax.data(), stable.data(), stop.data());
  });
  wr(d + "/out_entropy.bin", entropy);
  wr(d + "/out_argmax.bin", argmax);
  wr(d + "/out_kept.bin", kept);
  wr(d + "/out_canvas.bin", canvas_out);
  wr(d + "/out_stable.bin", stable);
  wr(d + "/out_stop.bin", stop);
  return 0;
}
