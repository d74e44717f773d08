// y[M, N] = x[M, K] @ W[N, K]^T (+ nothing: bias is added by the caller) for small M.
//
// Decoding and verification multiply a few rows (M = k+1 <= 8 positions) by a weight
// matrix far larger than the caches. BLAS kernels tuned for large M re-read or pack W and
// cost 2-3x a single row at M = 2..8 on AVX2 machines; here every weight is streamed from
// memory once and used M times, so M = 8 costs little more than M = 1 while the pass is
// bound by memory bandwidth. Weights in float32, or int8 per output channel, or packed int4
// group-wise (verispec/models/quantize.py), dequantised in registers: fewer bytes to stream.
// Activations are float32; one output row of W per OpenMP iteration. The weight stream is
// prefetched PREFETCH_BYTES ahead (into the next rows at a row's end): at M >= 4 the loop
// spends enough cycles per cache line that the hardware prefetcher alone falls behind.
#include <torch/extension.h>
#include <immintrin.h>

static constexpr int64_t PREFETCH_BYTES = 1024;

static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0); }

static inline float hsum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_hadd_ps(sum, sum);
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(sum);
}

template <int M>
static void skinny(const float* x, const float* w, float* y, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      prefetch(row + k);
      const __m256 wv = _mm256_loadu_ps(row + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc[m]);
      for (int64_t kk = k; kk < K; ++kk) sum += row[kk] * x[m * K + kk];
      y[m * N + n] = sum;
    }
  }
}

// int8 weights with one float scale per output row: y[m, n] = scale[n] * sum_k w[n, k] x[m, k].
// K must be a multiple of 8.
template <int M>
static void skinny_int8(const float* x, const int8_t* w, const float* scale, float* y, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* row = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      if ((k & 31) == 0) prefetch(row + k);  // one per 32 bytes of int8 weights
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) * scale[n];
  }
}

// int4 weights, group-wise: w[n] is packed as K/2 bytes; within every 16 weights, byte j holds
// weight j in its low nibble and weight j+8 in its high nibble, each stored as q+8 (q in -8..7).
// scale[n, g] multiplies group g (group_size weights, a multiple of 16).
template <int M>
static void skinny_int4(const float* x, const uint8_t* w, const float* scale, float* y, int64_t N, int64_t K, int64_t group) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(8.0f);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = w + n * (K / 2);
    const float* row_scale = scale + n * (K / group);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      if ((k & 63) == 0) prefetch(row + k / 2);  // one per 32 bytes of packed weights
      const __m256 s = _mm256_set1_ps(row_scale[k / group]);
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
      const __m128i lo = _mm_and_si128(bytes, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
      const __m256 w0 = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), eight), s);
      const __m256 w1 = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), eight), s);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), acc[m]);
        acc[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]);
  }
}

#define DISPATCH_ROWS(M, CALL)                         \
  switch (M) {                                         \
    case 1: CALL(1); break;                            \
    case 2: CALL(2); break;                            \
    case 3: CALL(3); break;                            \
    case 4: CALL(4); break;                            \
    case 5: CALL(5); break;                            \
    case 6: CALL(6); break;                            \
    case 7: CALL(7); break;                            \
    case 8: CALL(8); break;                            \
    default: TORCH_CHECK(false, "M must be 1..8, got ", M); \
  }

torch::Tensor skinny_int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % 8 == 0, "skinny_int8_linear: x [M, K], w [N, K], K % 8 == 0");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "skinny_int8_linear: float32 x, int8 w, float32 scale");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && scale.numel() == w.size(0), "skinny_int8_linear: contiguous, one scale per row");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
#define CALL_INT8(R) skinny_int8<R>(x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), N, K)
  DISPATCH_ROWS(M, CALL_INT8)
  return y;
}

torch::Tensor skinny_int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == 2 * w.size(1), "skinny_int4_linear: x [M, K], w [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(group % 16 == 0 && K % group == 0, "skinny_int4_linear: group a multiple of 16 dividing K");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat, "skinny_int4_linear: float32 x, uint8 w, float32 scale");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && scale.numel() == N * (K / group), "skinny_int4_linear: contiguous, scale [N, K/group]");
  auto y = torch::empty({M, N}, x.options());
#define CALL_INT4(R) skinny_int4<R>(x.data_ptr<float>(), w.data_ptr<uint8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), N, K, group)
  DISPATCH_ROWS(M, CALL_INT4)
  return y;
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
#define CALL_FLOAT(R) skinny<R>(xp, wp, yp, N, K)
  DISPATCH_ROWS(M, CALL_FLOAT)
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ w.T for 1..8 rows");
  m.def("skinny_int8_linear", &skinny_int8_linear, "x @ (w * scale[:, None]).T for 1..8 rows, int8 w");
  m.def("skinny_int4_linear", &skinny_int4_linear, "x @ dequant(w).T for 1..8 rows, packed group-wise int4 w");
}
