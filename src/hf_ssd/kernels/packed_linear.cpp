// A float32 linear layer for a few rows of input at a time (a verify block, a draft tree, one decode step) on an
// AVX-512 CPU: y = x @ w.T with w packed once into blocks of 32 output columns, each block one contiguous stream of
// K x 32 weights. Every weight is read once per call for up to MAX_ROWS rows of x, so the call costs about what
// reading the weights costs whatever the rows: torch's GEMM on few rows reads its weights several times (packing
// them per call), and there a 3-row product cost 3x a 1-row one on the project's CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t LANES = 16;         // floats per AVX-512 register
constexpr int64_t BLOCK = 2 * LANES;  // output columns per block: two registers per row of x
constexpr int64_t MAX_ROWS = 12;      // rows of x per pass: 2 x 12 accumulators + 2 weights + 1 broadcast <= 32 registers

template <int ROWS>
void block_product(const float* x, int64_t K, const float* block, float* out /* ROWS x BLOCK */) {
  __m512 lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) { lo[r] = _mm512_setzero_ps(); hi[r] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w_lo = _mm512_loadu_ps(block + k * BLOCK), w_hi = _mm512_loadu_ps(block + k * BLOCK + LANES);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xk, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xk, w_hi, hi[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(out + r * BLOCK, lo[r]);
    _mm512_storeu_ps(out + r * BLOCK + LANES, hi[r]);
  }
}

using BlockProduct = void (*)(const float*, int64_t, const float*, float*);
const BlockProduct BY_ROWS[MAX_ROWS + 1] = {
    nullptr, block_product<1>, block_product<2>, block_product<3>, block_product<4>, block_product<5>,
    block_product<6>, block_product<7>, block_product<8>, block_product<9>, block_product<10>, block_product<11>,
    block_product<12>};

}  // namespace

// w [N, K] -> [ceil(N / BLOCK), K, BLOCK], zero columns past N.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack: a 2-D float32 weight");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + BLOCK - 1) / BLOCK;
  auto padded = torch::zeros({blocks * BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, BLOCK, K}).transpose(1, 2).contiguous();
}

// x [..., K] float32, packed from pack(w) with w [N, K] -> x @ w.T [..., N]
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.size(1) == x.size(-1), "shape mismatch");
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), blocks = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    alignas(64) float tile[MAX_ROWS * BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK, width = std::min(BLOCK, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t count = std::min(MAX_ROWS, M - m0);
        BY_ROWS[count](xp + m0 * K, K, wp + b * K * BLOCK, tile);
        for (int64_t r = 0; r < count; ++r)
          std::memcpy(yp + (m0 + r) * N + n0, tile + r * BLOCK, width * sizeof(float));
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a [N, K] float32 weight into blocks of 32 output columns");
  m.def("packed_linear", &packed_linear, "x @ w.T from pack(w)");
}
