/* Whether ggml's matrix product of a weight type gives one column's results whatever the width.
 *
 * llamafile's sgemm takes a product from 2 columns on and ggml's vec_dot takes one column. For some
 * types on some CPUs the two do the same arithmetic element by element (per block an exact integer
 * dot product, one fused multiply-add into 8 lanes, the same horizontal sum), so their results are
 * equal bit for bit; for others (f32, f16 here) they round differently. `verispec_one_kernel`
 * measures it on random data through ggml's own CPU mul_mat, the code llama.cpp's passes run:
 * llamacpp/head.py treats a type that agrees as one that needs no placeholder.
 * Knows nothing of files, models or speculation.
 */
#include <ggml-cpu.h>
#include <ggml.h>
#include <stdint.h>
#include <string.h>

static uint64_t next(uint64_t *state) { /* splitmix64 */
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float normalish(uint64_t *state) { /* a sum of 4 uniforms, centred: enough spread for a kernel test */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(next(state) >> 40) * 0x1.0p-24f;
    return s - 2.0f;
}

/* 1 where mul_mat of a [m rows, k] weight of `type` by n columns gives, for every column, exactly the
 * values of the product by that column alone; 0 where not; -1 where it could not be measured. */
int32_t verispec_one_kernel(int32_t type, int32_t k, int32_t m, int32_t n, int32_t threads) {
    if (k % ggml_blck_size((enum ggml_type)type) != 0 || n < 2) return -1;
    const size_t bytes = (size_t)m * k * 4 * 3 + (size_t)k * n * 4 * 8 + (size_t)m * n * 4 * 8 + (64u << 20);
    struct ggml_init_params params = {bytes, NULL, false};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return -1;
    uint64_t state = 0x5EED0000ull + (uint64_t)type;
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, (enum ggml_type)type, k, m);
    struct ggml_tensor *floats = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    float *source = (float *)floats->data;
    for (int64_t i = 0; i < (int64_t)m * k; i++) source[i] = normalish(&state);
    ggml_quantize_chunk((enum ggml_type)type, source, w->data, 0, m, k, NULL);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    for (int64_t i = 0; i < (int64_t)k * n; i++) ((float *)x->data)[i] = normalish(&state);
    struct ggml_tensor *wide = ggml_mul_mat(ctx, w, x); /* [m, n] */
    struct ggml_cgraph *graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, wide);
    struct ggml_tensor *alone[n];
    for (int32_t j = 0; j < n; j++) {
        struct ggml_tensor *column = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 1);
        memcpy(column->data, (float *)x->data + (int64_t)j * k, sizeof(float) * k);
        alone[j] = ggml_mul_mat(ctx, w, column); /* [m, 1] */
        ggml_build_forward_expand(graph, alone[j]);
    }
    int32_t same = ggml_graph_compute_with_ctx(ctx, graph, threads) == GGML_STATUS_SUCCESS ? 1 : -1;
    for (int32_t j = 0; same == 1 && j < n; j++)
        if (memcmp((float *)wide->data + (int64_t)j * m, alone[j]->data, sizeof(float) * m) != 0) same = 0;
    ggml_free(ctx);
    return same;
}
