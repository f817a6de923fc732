// A float32 linear layer for a few rows of input at a time (a verify block, a draft tree, one decode step) on an
// AVX-512 or AVX2 CPU: y = x @ w.T with w packed once into blocks of 32 output columns, each block one contiguous
// stream of K x 32 weights. Every weight is read once per call for up to 12 rows of x (AVX2: 6), so the call costs
// about what reading the weights costs whatever the rows: torch's GEMM on few rows reads its weights several times (packing
// them per call), and there a 3-row product cost 3x a 1-row one on the project's CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // output columns per packed block

// AVX-512: a block is two registers per row of x; 12 rows keep 24 accumulators + 2 weights + 1 broadcast in 32.
constexpr int64_t ROWS_512 = 12;

template <int ROWS>
__attribute__((target("avx512f,fma"))) void block_product_512(const float* x, int64_t K, const float* block,
                                                                 float* out /* ROWS x BLOCK */) {
  __m512 lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) { lo[r] = _mm512_setzero_ps(); hi[r] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w_lo = _mm512_loadu_ps(block + k * BLOCK), w_hi = _mm512_loadu_ps(block + k * BLOCK + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xk, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xk, w_hi, hi[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out + r * BLOCK, lo[r]);
    _mm512_storeu_ps(out + r * BLOCK + 16, hi[r]);
  }
}

// AVX2: 16 registers, so a block goes in two halves of 16 columns (two registers per row of x), 6 rows at a time:
// 12 accumulators + 2 weights + 1 broadcast. The block's second half comes from cache (K x 32 floats, ~200 KB).
constexpr int64_t ROWS_256 = 6;

template <int ROWS>
__attribute__((target("avx2,fma"))) void block_product_256(const float* x, int64_t K, const float* block,
                                                              float* out /* ROWS x BLOCK */) {
  for (int64_t half = 0; half < BLOCK; half += 16) {
    __m256 lo[ROWS], hi[ROWS];
    for (int r = 0; r < ROWS; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; ++k) {
      const float* w = block + k * BLOCK + half;
      const __m256 w_lo = _mm256_loadu_ps(w), w_hi = _mm256_loadu_ps(w + 8);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xk = _mm256_broadcast_ss(x + r * K + k);
        lo[r] = _mm256_fmadd_ps(xk, w_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(xk, w_hi, hi[r]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      _mm256_storeu_ps(out + r * BLOCK + half, lo[r]);
      _mm256_storeu_ps(out + r * BLOCK + half + 8, hi[r]);
    }
  }
}

using BlockProduct = void (*)(const float*, int64_t, const float*, float*);
const BlockProduct BY_ROWS_512[ROWS_512 + 1] = {
    nullptr, block_product_512<1>, block_product_512<2>, block_product_512<3>, block_product_512<4>,
    block_product_512<5>, block_product_512<6>, block_product_512<7>, block_product_512<8>, block_product_512<9>,
    block_product_512<10>, block_product_512<11>, block_product_512<12>};
const BlockProduct BY_ROWS_256[ROWS_256 + 1] = {
    nullptr, block_product_256<1>, block_product_256<2>, block_product_256<3>, block_product_256<4>,
    block_product_256<5>, block_product_256<6>};

}  // namespace

// w [N, K] -> [ceil(N / BLOCK), K, BLOCK], zero columns past N. One pass over the weights, a block per task (its
// output, K x 32 floats, stays in cache while its 32 rows are scattered in): zero-fill, copy and a transposing
// copy through torch took ~7 s for the default target's 5.75 GiB.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack: a 2-D float32 weight");
  const auto rows = w.contiguous();
  const int64_t N = rows.size(0), K = rows.size(1), blocks = (N + BLOCK - 1) / BLOCK;
  auto packed = torch::empty({blocks, K, BLOCK}, rows.options());
  const float* wp = rows.data_ptr<float>();
  float* pp = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* block = pp + b * K * BLOCK;
      const int64_t width = std::min(BLOCK, N - b * BLOCK);
      const float* first = wp + b * BLOCK * K;
      for (int64_t k = 0; k < K; ++k) {  // one output line of 32 at a time, read down the block's rows
        float* line = block + k * BLOCK;
        for (int64_t c = 0; c < width; ++c) line[c] = first[c * K + k];
        for (int64_t c = width; c < BLOCK; ++c) line[c] = 0.0f;
      }
    }
  });
  return packed;
}

// x [..., K] float32, packed from pack(w) with w [N, K] -> x @ w.T [..., N]; avx512: the AVX-512 kernel, else AVX2
// (the caller checks the CPU has it).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, bool avx512) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.size(1) == x.size(-1), "shape mismatch");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), blocks = packed.size(0);
  const int64_t max_rows = avx512 ? ROWS_512 : ROWS_256;
  const BlockProduct* by_rows = avx512 ? BY_ROWS_512 : BY_ROWS_256;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // grain 1: a block is already K x 32 weights (~200 KB at K = 1536); a larger grain left small weights on one thread
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float tile[ROWS_512 * BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK, width = std::min(BLOCK, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += max_rows) {
        const int64_t count = std::min(max_rows, M - m0);
        by_rows[count](xp + m0 * K, K, wp + b * K * BLOCK, tile);
        for (int64_t r = 0; r < count; ++r)
          std::memcpy(yp + (m0 + r) * N + n0, tile + r * BLOCK, width * sizeof(float));
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// How many of torch's threads one parallel_for here runs on (the tests' check that the build has OpenMP on).
int64_t threads_used(int64_t tasks) {
  std::vector<int> seen(tasks, -1);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) seen[t] = at::get_thread_num();
  });
  std::sort(seen.begin(), seen.end());
  return std::unique(seen.begin(), seen.end()) - seen.begin();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("threads_used", &threads_used, "distinct threads one parallel_for over `tasks` ran on");
  // Python's GIL is released while they run, as torch's own operators release it: held, a thread worker's draft
  // could not run Python beside a packed verify (the default pair's measured thread overlap fell from 0.9 to ~0)
  m.def("pack", &pack, "pack a [N, K] float32 weight into blocks of 32 output columns",
        py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &packed_linear, "x @ w.T from pack(w)", py::call_guard<py::gil_scoped_release>());
}
