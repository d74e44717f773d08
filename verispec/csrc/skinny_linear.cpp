// y[M, N] = x[M, K] @ W[N, K]^T (+ nothing: bias is added by the caller) for small M.
//
// Decoding and verification multiply a few rows (M = batch x (k+1) <= 16 positions) by a
// weight matrix far larger than the caches. BLAS kernels tuned for large M re-read or pack W
// and cost 2-4x a single row at M = 2..16 on AVX2 machines; here every weight row is streamed
// from memory once and used by all M rows, so M = 8 costs little more than M = 1 while the
// pass is bound by memory bandwidth. Rows go in groups of at most 8 (the accumulators of one
// group fill the 16 AVX2 registers); a second group reads the weight row again from L1.
// Weights in float32, or int8 per output channel, or packed int4 group-wise
// (verispec/models/quantize.py), dequantised in registers: fewer bytes to stream.
// Activations are float32; one output row of W per OpenMP iteration. The weight stream is
// prefetched PREFETCH_BYTES ahead (into the next rows at a row's end): at M >= 4 the loop
// spends enough cycles per cache line that the hardware prefetcher alone falls behind.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

static constexpr int64_t MAX_ROWS = 16;
static constexpr int64_t GROUP_ROWS = 8;
static constexpr int64_t PREFETCH_BYTES = 1024;

static inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0); }

static inline float hsum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_hadd_ps(sum, sum);
  sum = _mm_hadd_ps(sum, sum);
  return _mm_cvtss_f32(sum);
}

// One float32 weight row against M activation rows: y[m * N] = sum_k row[k] x[m * K + k].
template <int M>
static inline void rows_f32(const float* x, const float* row, float* y, int64_t N, int64_t K) {
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
    y[m * N] = sum;
  }
}

// int8 weights with one float scale per output row: y[m * N] = scale * sum_k w[k] x[m, k].
// K must be a multiple of 8.
template <int M>
static inline void rows_int8(const float* x, const int8_t* row, float scale, float* y, int64_t N, int64_t K) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if ((k & 31) == 0) prefetch(row + k);  // one per 32 bytes of int8 weights
    const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) y[m * N] = hsum(acc[m]) * scale;
}

// int4 weights, group-wise: a row is packed as K/2 bytes; within every 16 weights, byte j holds
// weight j in its low nibble and weight j+8 in its high nibble, each stored as q+8 (q in -8..7).
// row_scale[g] multiplies group g (group_size weights, a multiple of 16).
template <int M>
static inline void rows_int4(const float* x, const uint8_t* row, const float* row_scale, float* y, int64_t N, int64_t K, int64_t group) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256 eight = _mm256_set1_ps(8.0f);
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
  for (int m = 0; m < M; ++m) y[m * N] = hsum(acc[m]);
}

// For every output row n (in parallel), every group of <= 8 activation rows: CALL(R, m0) runs
// rows_*<R> on rows m0..m0+R-1.
#define FOR_ROW_GROUPS(M, N, CALL)                                           \
  _Pragma("omp parallel for schedule(static)")                               \
  for (int64_t n = 0; n < N; ++n) {                                          \
    for (int64_t m0 = 0; m0 < M; m0 += GROUP_ROWS) {                         \
      switch (std::min(GROUP_ROWS, M - m0)) {                                \
        case 1: CALL(1, m0); break;                                          \
        case 2: CALL(2, m0); break;                                          \
        case 3: CALL(3, m0); break;                                          \
        case 4: CALL(4, m0); break;                                          \
        case 5: CALL(5, m0); break;                                          \
        case 6: CALL(6, m0); break;                                          \
        case 7: CALL(7, m0); break;                                          \
        default: CALL(8, m0); break;                                         \
      }                                                                      \
    }                                                                        \
  }

static void check_rows(int64_t M) { TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "M must be 1..", MAX_ROWS, ", got ", M); }

torch::Tensor skinny_int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % 8 == 0, "skinny_int8_linear: x [M, K], w [N, K], K % 8 == 0");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "skinny_int8_linear: float32 x, int8 w, float32 scale");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && scale.numel() == w.size(0), "skinny_int8_linear: contiguous, one scale per row");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_rows(M);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#define CALL_INT8(R, m0) rows_int8<R>(xp + (m0) * K, wp + n * K, sp[n], yp + (m0) * N + n, N, K)
  FOR_ROW_GROUPS(M, N, CALL_INT8)
  return y;
}

torch::Tensor skinny_int4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == 2 * w.size(1), "skinny_int4_linear: x [M, K], w [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(group % 16 == 0 && K % group == 0, "skinny_int4_linear: group a multiple of 16 dividing K");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat, "skinny_int4_linear: float32 x, uint8 w, float32 scale");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous() && scale.numel() == N * (K / group), "skinny_int4_linear: contiguous, scale [N, K/group]");
  check_rows(M);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#define CALL_INT4(R, m0) rows_int4<R>(xp + (m0) * K, wp + n * (K / 2), sp + n * (K / group), yp + (m0) * N + n, N, K, group)
  FOR_ROW_GROUPS(M, N, CALL_INT4)
  return y;
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_rows(M);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#define CALL_FLOAT(R, m0) rows_f32<R>(xp + (m0) * K, wp + n * K, yp + (m0) * N + n, N, K)
  FOR_ROW_GROUPS(M, N, CALL_FLOAT)
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("MAX_ROWS") = MAX_ROWS;
  m.def("skinny_linear", &skinny_linear, "x @ w.T for 1..16 rows");
  m.def("skinny_int8_linear", &skinny_int8_linear, "x @ (w * scale[:, None]).T for 1..16 rows, int8 w");
  m.def("skinny_int4_linear", &skinny_int4_linear, "x @ dequant(w).T for 1..16 rows, packed group-wise int4 w");
}
