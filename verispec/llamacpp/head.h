/* verispec's own output head (head.c): the struct llama_step.c and head.py share. */
#ifndef VERISPEC_HEAD_H
#define VERISPEC_HEAD_H
#include <stdbool.h>
#include <stdint.h>

struct verispec_head {
    const char *weight;   /* [n_vocab rows of n_embd values] in `type` (the file's bytes, as llama.cpp maps them) */
    int32_t type;         /* the weight's ggml type */
    int32_t n_embd;
    int32_t n_vocab;
    int32_t mode;         /* 0: off (llama.cpp computes its head); 1: stop after result_norm; 2: copy and go on */
    float *hidden;        /* [capacity, n_embd] out: result_norm's rows since the last reset, in ubatch order */
    int32_t capacity;
    int32_t rows;         /* rows copied since the caller reset it */
    int32_t ubatches;     /* result_norm tensors seen since the caller reset it */
    int32_t overflow;     /* 1: a decode had more rows than capacity (nothing past it was copied) */
    char *quantized;      /* [capacity * verispec_head_row_bytes] scratch: the rows in the vec_dot type */
    int32_t n_threads;
};

void verispec_head_logits(const struct verispec_head *h, int32_t rows, float *logits);
#endif
