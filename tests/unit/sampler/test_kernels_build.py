"""The sampler kernels on a machine without a GPU: they compile to SASS + PTX for every target, the CUDA RNG
(csrc/dg_rng.cuh, built as host code) computes exactly what pipeline.sampler.rng computes, and kernel B's
sorting network (csrc/dg_order.cuh) orders entropies as torch.sort does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import DgpipeError
from pipeline.sampler import rng
from pipeline.sampler.kernels import build

pytestmark = pytest.mark.slow  # nvcc builds for three architectures

needs_nvcc = pytest.mark.skipif(
    build.find_nvcc() is None, reason="nvcc not found (CUDA toolkit not installed)"
)
KERNELS = (
    "dg_rows_f32x4",
    "dg_rows_f32x1",
    "dg_rows_bf16x8",
    "dg_rows_bf16x1",
    "dg_accept",
    # TensorRT AOT plugin entry points (inputs, int32 extras, outputs): pipeline/engine/plugin.py
    "dg_trt_rows_f32x4",
    "dg_trt_rows_f32x1",
    "dg_trt_rows_bf16x8",
    "dg_trt_rows_bf16x1",
    "dg_trt_accept",
)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each arch compiled once per session: three cubins and four PTX files (~10 s on two cores)."""
    return build.build_all(tmp_path_factory.mktemp("kernels"))


@needs_nvcc
@pytest.mark.parametrize("arch", build.ARCHS)
def test_cubin_holds_sass_for_its_arch(artifacts: dict[str, Path], arch: str):
    info = build.read_cubin(artifacts[f"{arch}.cubin"])
    assert info.arch == arch
    assert sorted(info.kernels) == sorted(KERNELS)  # unmangled: a TensorRT plugin launches them by name


@needs_nvcc
@pytest.mark.parametrize("arch", build.ARCHS)
def test_cuobjdump_lists_the_sass(artifacts: dict[str, Path], arch: str):
    tool = build.find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    assert build.cuobjdump_archs(artifacts[f"{arch}.cubin"], cuobjdump=tool) == {arch}


@needs_nvcc
def test_fatbin_lists_sass_with_cuobjdump(tmp_path: Path):
    tool = build.find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)")
    fatbin = build.compile_arch("sm_90a", tmp_path, "fatbin")
    assert build.cuobjdump_archs(fatbin, cuobjdump=tool) == {"sm_90a"}


@needs_nvcc
@pytest.mark.parametrize(
    ("arch", "target"),
    [("sm_90a", "sm_90a"), ("sm_100a", "sm_100a"), ("sm_120a", "sm_120a"), ("compute_90", "sm_90")],
)
def test_ptx_has_the_expected_target(artifacts: dict[str, Path], arch: str, target: str):
    path = artifacts[f"{arch}.ptx"]
    assert build.ptx_target(path) == target
    text = path.read_text()
    for kernel in KERNELS:
        assert re.search(rf"\.entry\s+{kernel}\(", text), kernel


def test_bad_arch_and_kind_are_clear_errors(tmp_path: Path):
    with pytest.raises(DgpipeError, match="unknown CUDA architecture"):
        build.compile_arch("hopper", tmp_path)
    with pytest.raises(DgpipeError, match="real architecture"):
        build.compile_arch("compute_90", tmp_path, "cubin")


def test_read_cubin_rejects_other_files(tmp_path: Path):
    bogus = tmp_path / "x.cubin"
    bogus.write_bytes(b"not an elf at all" * 8)
    with pytest.raises(DgpipeError, match="not a 64-bit CUDA ELF"):
        build.read_cubin(bogus)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_torch_extension_names_what_is_missing():
    with pytest.raises(DgpipeError, match="CUDA build of torch"):
        build.load_torch_extension()


def test_a_lock_a_killed_build_left_is_cleared_and_a_live_builds_is_waited_for(tmp_path: Path, monkeypatch):
    """torch's `cpp_extension` waits, with no timeout, for the lock file a killed build leaves (in a pod, on a
    volume that outlives the container): under dgpipe's own flock, the next load removes it; while another
    process builds (holds the flock), a load waits for it rather than take its lock away."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(cpp_extension._get_build_directory(build.EXTENSION, False)) / "lock"
    lock.touch()  # a build killed mid-way
    with build.exclusive_build() as build_dir:
        assert build_dir == lock.parent and not lock.exists()
    builder = (
        "import time\n"
        "from pipeline.sampler.kernels import build\n"
        "with build.exclusive_build() as d:\n"
        "    (d / 'lock').touch()\n"
        "    print('building', flush=True)\n"
        "    time.sleep(2)\n"
        "    (d / 'lock').unlink()\n"  # torch's release
        "    (d / 'built').touch()\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    with subprocess.Popen(
        [sys.executable, "-c", builder], stdout=subprocess.PIPE, text=True, env=env
    ) as other:
        assert other.stdout.readline().strip() == "building"
        with build.exclusive_build() as build_dir:
            assert (build_dir / "built").exists()  # entered only after the other build ended
    assert other.returncode == 0


def test_gpu_sampler_imports_without_cuda():
    from pipeline.errors import SamplerError
    from pipeline.sampler.kernels.gpu_sampler import sample_step_cuda
    from pipeline.sampler.reference import RowKeys

    k = torch.zeros(1, dtype=torch.long)
    with pytest.raises(SamplerError, match="CUDA tensor"):
        sample_step_cuda(
            torch.zeros(1, 4, 8),
            torch.ones(1),
            torch.ones(1),
            RowKeys(k, k, k, k),
            None,
            torch.full((1, 4), -1),
            k,
            1,
            0.0,
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark would run")
def test_gpu_bench_exits_cleanly_without_gpu(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.gpu.sampler", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "no CUDA GPU" in proc.stderr


# ---- the RNG, as host code -----------------------------------------------------------------------------

HOST_PROGRAM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "dg_rng.cuh"

// One query per stdin line, one answer per stdout line:
//   F x                              -> fmix32(x)
//   K seed request canvas step stream -> key_hash(...)
//   T key position vocab             -> uniform_token(...)
//   U key position v                 -> bits of u (hex) and g = -log(-log(u)) for token v
int main() {
  char op;
  while (std::scanf(" %c", &op) == 1) {
    if (op == 'F') {
      unsigned long long x;
      std::scanf("%llu", &x);
      std::printf("%u\n", dg::fmix32(static_cast<uint32_t>(x)));
    } else if (op == 'K') {
      long long s, r, c, t;
      unsigned stream;
      std::scanf("%lld %lld %lld %lld %u", &s, &r, &c, &t, &stream);
      std::printf("%u\n", dg::key_hash(s, r, c, t, stream));
    } else if (op == 'T') {
      unsigned key, pos, vocab;
      std::scanf("%u %u %u", &key, &pos, &vocab);
      std::printf("%lld\n", static_cast<long long>(dg::uniform_token(key, pos, vocab)));
    } else if (op == 'U') {
      unsigned key, pos, v;
      std::scanf("%u %u %u", &key, &pos, &v);
      const float u = dg::gumbel_uniform(dg::position_bits(key, pos), v);
      uint32_t bits;
      std::memcpy(&bits, &u, 4);
      std::printf("%08x %.9g\n", bits, -std::log(-std::log(u)));
    }
  }
  return 0;
}
"""


def compile_host(d: Path, name: str, program: str) -> Path:
    """A host program over the kernels' headers: built with nvcc (as CUDA, so __host__ __device__ is
    exercised) where it exists, else with the system C++ compiler."""
    exe = d / name
    nvcc, cxx = build.find_nvcc(), shutil.which("c++") or shutil.which("g++")
    if nvcc:
        src = d / f"{name}.cu"
        cmd = [nvcc, "-O2", "-std=c++17", f"-I{build.CSRC}", "-o", str(exe), str(src)]
    elif cxx:
        src = d / f"{name}.cpp"
        cmd = [cxx, "-O2", "-std=c++17", f"-I{build.CSRC}", "-o", str(exe), str(src)]
    else:
        pytest.skip("neither nvcc nor a C++ compiler found")
    src.write_text(program)
    subprocess.run(cmd, check=True, capture_output=True)
    return exe


@pytest.fixture(scope="session")
def rng_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The RNG header compiled as host code."""
    return compile_host(tmp_path_factory.mktemp("rng_host"), "rng_host", HOST_PROGRAM)


def ask(exe: Path, queries: list[str]) -> list[str]:
    proc = subprocess.run(
        [str(exe)], input="\n".join(queries) + "\n", capture_output=True, text=True, check=True
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == len(queries)
    return lines


def test_host_rng_pinned_values(rng_host: Path):
    """The values tests/unit/sampler/test_reference.py pins for pipeline.sampler.rng."""
    key = 501821951
    got = ask(rng_host, ["F 305419896", "K 1 2 3 4 1", *[f"T {key} {p} 262144" for p in range(4)]])
    assert int(got[0]) == 0xE37CD1BC
    assert int(got[1]) == key
    assert [int(x) for x in got[2:]] == [16715, 119477, 58320, 55430]


def test_host_rng_equals_pipeline_rng(rng_host: Path):
    g = torch.Generator().manual_seed(1234)
    n = 64
    big = lambda: torch.randint(-(2**62), 2**62, (n,), generator=g)  # int64 with high bits and signs
    seed, request, canvas, step = big(), big(), torch.randint(-3, 40, (n,), generator=g), big()
    seed[:4] = torch.tensor([0, -1, 2**32, 2**32 - 1])  # masking edge cases
    xs = torch.randint(0, 2**32, (n,), generator=g)
    queries = [f"F {int(x)}" for x in xs]
    streams = (rng.STREAM_INIT, rng.STREAM_SAMPLE, rng.STREAM_RENOISE)
    for stream in streams:
        queries += [
            f"K {int(a)} {int(b)} {int(c)} {int(d)} {stream}"
            for a, b, c, d in zip(seed, request, canvas, step, strict=True)
        ]
    got = [int(x) for x in ask(rng_host, queries)]
    assert got[:n] == rng.fmix32(xs).tolist()
    for i, stream in enumerate(streams):
        assert got[n * (i + 1) : n * (i + 2)] == rng.key_hash(seed, request, canvas, step, stream).tolist()

    keys = rng.key_hash(seed[:8], request[:8], canvas[:8], step[:8], rng.STREAM_RENOISE)
    for vocab in (262_144, 1000, 7, 2**31 - 1):
        ref = rng.uniform_tokens(keys, 16, vocab)
        queries = [f"T {int(k)} {p} {vocab}" for k in keys for p in range(16)]
        assert [int(x) for x in ask(rng_host, queries)] == ref.flatten().tolist(), vocab


def test_host_gumbel_equals_pipeline_rng(rng_host: Path):
    keys = torch.tensor([501821951, 0, 0xFFFFFFFF, 123456789])
    length, vocab = 3, 64
    g_ref = rng.gumbel(keys, length, vocab)
    # u restated from rng.gumbel: ((bits >> 9) + 0.5) * 2**-23 in fp32; compared bit for bit
    bits = rng.combine(rng.position_bits(keys, length)[..., None], torch.arange(vocab))
    u_ref = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    queries = [f"U {int(k)} {p} {v}" for k in keys for p in range(length) for v in range(vocab)]
    got = [line.split() for line in ask(rng_host, queries)]
    assert [int(b, 16) for b, _ in got] == u_ref.flatten().view(torch.int32).tolist()
    g_host = torch.tensor([float(x) for _, x in got]).view_as(g_ref)
    # different libms round log differently by an ulp or so: the bits of u above are the exact check
    torch.testing.assert_close(g_host, g_ref, rtol=1e-6, atol=1e-6)


def test_gumbel_is_finite_at_the_extremes(rng_host: Path):
    """The largest and smallest 23-bit draws give finite Gumbel values on both sides (a 24-bit u used to
    round to 1.0 and give +inf for one token in 2**24)."""
    r = torch.tensor([0, (1 << 23) - 1])
    u = (r.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    keys = torch.tensor([501821951])
    assert torch.isfinite(rng.gumbel(keys, 8, 262_144)).all()


def test_gumbel_skip_bound_is_safe():
    """Kernel A skips the logs for tokens with z + bound < best; that is exact only if every finite Gumbel
    value is below the bound."""
    source = (build.CSRC / "dg_sampler.cu").read_text()
    bound = float(re.search(r"kGumbelBound = ([0-9.]+)f", source).group(1))
    r = torch.arange(0, 1 << 23, dtype=torch.int64)  # every possible draw
    g = -torch.log(-torch.log((r.to(torch.float32) + 0.5) * (1.0 / (1 << 23))))
    assert torch.isfinite(g).all() and g.max().item() < bound - 0.05


# ---- kernel B's sort, as host code ----------------------------------------------------------------------

SORT_PROGRAM = r"""
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>
#include "dg_order.cuh"

// One row per stdin line: its length, then its keys as fp32 bits in hex. Answers the positions in sorted
// order: kernel B's bitonic network over the row padded to a power of two, one compare-exchange at a time
// (a stage's pairs are disjoint, so this is what the block's threads compute between two barriers).
int main() {
  int length;
  while (std::scanf("%d", &length) == 1) {
    int n = 1;
    while (n < length) n <<= 1;
    std::vector<float> key(n);
    std::vector<int> index(n);
    for (int t = 0; t < n; ++t) {
      key[t] = dg::padding_key();
      if (t < length) {
        unsigned bits;
        std::scanf("%x", &bits);
        std::memcpy(&key[t], &bits, 4);
      }
      index[t] = t;
    }
    for (int k = 2; k <= n; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int tid = 0; tid < n; ++tid) {
          const int other = tid ^ j;
          if (other > tid && dg::sorts_after(key[tid], index[tid], key[other], index[other]) == ((tid & k) == 0)) {
            std::swap(key[tid], key[other]);
            std::swap(index[tid], index[other]);
          }
        }
      }
    }
    for (int t = 0; t < length; ++t) std::printf(t ? " %d" : "%d", index[t]);
    std::printf("\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="session")
def sort_host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_host(tmp_path_factory.mktemp("sort_host"), "sort_host", SORT_PROGRAM)


def test_kernel_b_sorts_entropies_as_torch_sort_does_nan_and_infinity_included(sort_host: Path):
    """torch.sort(stable=True) puts NaN after every number (a broken checkpoint's NaN logits make NaN
    entropies) and keeps equal keys (0.0 and -0.0 too) in position order; kernel B's network, padded to a
    power of two, must give the same permutation, every real position in the row's first places."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for length in (1, 2, 5, 37, 256, 1000, 1024):
        h = torch.rand(length, generator=g) * 5
        h[torch.rand(length, generator=g) < 0.2] = float("nan")
        h[torch.rand(length, generator=g) < 0.05] = float("inf")
        h[torch.rand(length, generator=g) < 0.1] = 0.0  # pinned cells: exact ties
        h[torch.rand(length, generator=g) < 0.05] = -0.0
        h[torch.rand(length, generator=g) < 0.1] = 1.5
        rows.append(h)
    rows.append(torch.full((37,), float("nan")))
    rows.append(torch.tensor([float("nan"), float("inf"), 1.0, float("nan"), 0.0, float("inf")]))
    queries = [
        f"{len(h)} " + " ".join(f"{b & 0xFFFFFFFF:08x}" for b in h.view(torch.int32).tolist()) for h in rows
    ]
    for h, line in zip(rows, ask(sort_host, queries), strict=True):
        expected = torch.sort(h, stable=True).indices.tolist()
        assert [int(x) for x in line.split()] == expected, h.tolist()
