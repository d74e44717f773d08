// y[M, N] = x[M, K] @ W[N, K]^T (+ nothing: bias is added by the caller) for small M.
//
// Decoding and verification multiply a few rows (M = k+1 <= 8 positions) by a weight
// matrix far larger than the caches. BLAS kernels tuned for large M re-read or pack W and
// cost 2-3x a single row at M = 2..8 on AVX2 machines; here every weight is streamed from
// memory once and used M times, so M = 8 costs little more than M = 1 while the pass is
// bound by memory bandwidth. float32 only; one output row of W per OpenMP iteration.
#include <torch/extension.h>
#include <immintrin.h>

template <int M>
static void skinny(const float* x, const float* w, float* y, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = _mm256_loadu_ps(row + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      sum = _mm_hadd_ps(sum, sum);
      sum = _mm_hadd_ps(sum, sum);
      float s = _mm_cvtss_f32(sum);
      for (int64_t kk = k; kk < K; ++kk) s += row[kk] * x[m * K + kk];
      y[m * N + n] = s;
    }
  }
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: skinny<1>(xp, wp, yp, N, K); break;
    case 2: skinny<2>(xp, wp, yp, N, K); break;
    case 3: skinny<3>(xp, wp, yp, N, K); break;
    case 4: skinny<4>(xp, wp, yp, N, K); break;
    case 5: skinny<5>(xp, wp, yp, N, K); break;
    case 6: skinny<6>(xp, wp, yp, N, K); break;
    case 7: skinny<7>(xp, wp, yp, N, K); break;
    case 8: skinny<8>(xp, wp, yp, N, K); break;
    default: TORCH_CHECK(false, "skinny_linear: M must be 1..8, got ", M);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "x @ w.T for 1..8 rows"); }
