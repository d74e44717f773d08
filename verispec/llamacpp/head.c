/* verispec's own output head for a llama.cpp target: logits from the final hidden states with the
 * kernel llama.cpp uses for one column, at every width.
 *
 * Why: llama.cpp's matrix products take llamafile's sgemm from 2 columns on and ggml's vec_dot for
 * one, and the two round differently. A file whose body takes vec_dot at every width (Q4_1, K-quants)
 * but whose output head is of a type sgemm takes (a Q8_0 head is common) would need a placeholder
 * position in every one-position pass for its logits not to depend on the pass: a second pass through
 * the whole body, for the head's sake. Instead, `verispec_head_callback` (llama.cpp's cb_eval) stops
 * the graph after "result_norm", the final normed hidden states of the positions with logits, copies
 * them, and `verispec_head_logits` computes every logit as ggml's one-column path does: the hidden
 * row converted by the vec_dot type's from_float, then vec_dot(n_embd, ...) per vocabulary row.
 * Bit for bit the logits llama.cpp's own head gives a one-position pass (llamacpp/head.py checks this
 * on the file before it is used), whatever the pass holds.
 *
 * Knows nothing of files, caches or speculation: head.py finds the weight and fills the struct.
 */
#include <string.h>

#include "head.h"

struct ggml_tensor;
const char *ggml_get_name(const struct ggml_tensor *tensor);
void *ggml_get_data(const struct ggml_tensor *tensor);
int64_t ggml_nelements(const struct ggml_tensor *tensor);
int64_t ggml_nrows(const struct ggml_tensor *tensor);
size_t ggml_row_size(int type, int64_t ne);

typedef void (*verispec_from_float_t)(const float *x, void *y, int64_t k);
typedef void (*verispec_vec_dot_t)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                                   int nrc);
struct ggml_type_traits_cpu { /* ggml-cpu.h's, field by field */
    verispec_from_float_t from_float;
    verispec_vec_dot_t vec_dot;
    int vec_dot_type;
    int64_t nrows;
};
const struct ggml_type_traits_cpu *ggml_get_type_traits_cpu(int type);

/* llama.cpp's cb_eval: asked for every node before it is computed (ask), told after a node it asked for. */
bool verispec_head_callback(struct ggml_tensor *t, bool ask, void *user) {
    struct verispec_head *h = (struct verispec_head *)user;
    if (h->mode == 0 || strcmp(ggml_get_name(t), "result_norm") != 0) return false;
    if (ask) return true;
    int64_t rows = ggml_nrows(t);
    if (ggml_nelements(t) != rows * h->n_embd || h->rows + rows > h->capacity) {
        h->overflow = 1;
        return h->mode == 2;
    }
    memcpy(h->hidden + (int64_t)h->rows * h->n_embd, ggml_get_data(t), sizeof(float) * rows * h->n_embd);
    h->rows += (int32_t)rows;
    h->ubatches += 1;
    return h->mode == 2; /* false: the graph stops here, llama.cpp's head is not computed */
}

/* 1 where this head can be computed here (ggml-cpu's traits take one row at a time), else 0. */
int32_t verispec_head_supported(int32_t type) {
    const struct ggml_type_traits_cpu *traits = ggml_get_type_traits_cpu(type);
    if (!traits || !traits->vec_dot || traits->nrows != 1) return 0;
    const struct ggml_type_traits_cpu *input = ggml_get_type_traits_cpu(traits->vec_dot_type);
    return traits->vec_dot_type == 0 /* F32: used as it is */ || (input && input->from_float) ? 1 : 0;
}

/* Bytes of one hidden row in the vec_dot type (the scratch `quantized` needs rows times this). */
int64_t verispec_head_row_bytes(int32_t type, int32_t n_embd) {
    return (int64_t)ggml_row_size(ggml_get_type_traits_cpu(type)->vec_dot_type, n_embd);
}

/* logits [rows, n_vocab] of the first `rows` hidden rows. */
void verispec_head_logits(const struct verispec_head *h, int32_t rows, float *logits) {
    const float *hidden = h->hidden;
    char *quantized = h->quantized;
    const int32_t n_threads = h->n_threads;
    const struct ggml_type_traits_cpu *traits = ggml_get_type_traits_cpu(h->type);
    const int vec_type = traits->vec_dot_type;
    const size_t weight_row = ggml_row_size(h->type, h->n_embd);
    const size_t input_row = ggml_row_size(vec_type, h->n_embd);
    const char *inputs = (const char *)hidden;
    if (vec_type != 0) {
        verispec_from_float_t from_float = ggml_get_type_traits_cpu(vec_type)->from_float;
        for (int32_t r = 0; r < rows; r++)
            from_float(hidden + (int64_t)r * h->n_embd, quantized + (int64_t)r * input_row, h->n_embd);
        inputs = quantized;
    }
    const int64_t n_vocab = h->n_vocab, tile = 16; /* a tile of weight rows stays in L1 for every hidden row */
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t start = 0; start < n_vocab; start += tile) {
        const int64_t end = start + tile < n_vocab ? start + tile : n_vocab;
        for (int32_t r = 0; r < rows; r++) {
            const char *x = inputs + (int64_t)r * input_row;
            float *out = logits + (int64_t)r * n_vocab;
            for (int64_t v = start; v < end; v++) traits->vec_dot(h->n_embd, out + v, 0, h->weight + v * weight_row, 0, x, 0, 1);
        }
    }
}
