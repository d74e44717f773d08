/* One speculative iteration on two llama.cpp contexts, in one call from Python.
 *
 * The iteration of verispec's engine with a ModelDrafter or a lookup (engine.py, step.py, rejection.py,
 * sampling.py and proposal.py are the reference; llamacpp/step.py loads this file):
 * the draft reads its pending tokens and proposes up to k tokens, stopping early once every
 * row's top draft probability is below p_min; the target scores [pending, x_1..x_k] in one
 * llama_decode; the accept-reject rule keeps a prefix of each row and adds the recovered or
 * bonus token; both caches are rolled back to what was committed. Row b is llama.cpp
 * sequence b in both contexts (a slot: a server's request takes a free one and leaves it);
 * rows with active[b] == 0 take no part. Each row has its own sampling settings (sampling[b]).
 *
 * temperature == 0: proposals are the draft's argmax and a proposal is accepted while it is
 * the target's argmax (rejection.verify_greedy). temperature > 0: q and p are the draft's and the
 * target's logits processed as sampling.process_logits does (`process`: temperature, top-k,
 * softmax, top-p, min-p); row b proposes x_i ~ q'_i = sharpen(q_i, tau_b) (proposal.py: q^(1/tau)
 * renormalised on q's support; tau 1: q, tau 0: q's argmax), and x_i is accepted while
 * u_i q'_i(x_i) < p_i(x_i); at the first rejection a token is drawn from max(p_i - q'_i, 0) (p_i
 * where that has no mass), after k acceptances from p_{k+1} (rejection.verify). With a grid of
 * taus (`--draft-temperature auto`) the rule also writes sum min(p_i, q'_tau,i) for every tau of
 * the grid at each verified position (proposal.acceptance_grid), from which Python picks tau_b.
 * Draws are inverse-transform in double from row b's own splitmix64 stream (rng[b]), as
 * sampling.sample with one generator per row: a row's numbers never depend on the other rows.
 * The numbers a row uses in one call, in turn: one per proposal with tau_b > 0 (none at tau_b = 0:
 * the argmax is not random), then one per test of positions 0..n, then one for the recovered or
 * bonus token. With `given` instead of a draft (a lookup: prompt lookup, suffix drafting) the proposals are
 * made outside, deterministic, so q is one-hot and the rule takes its coupled form (rejection.verify with
 * draft_probs None): the target draws y_i ~ p_i with the number plain decoding would draw there and keeps x_i
 * while y_i == x_i; the first y_i that differs (or the bonus y) is committed: one number per committed token, so
 * that a seed gives plain decoding's tokens. With `given` and a draft (a combined draft: drafters/combined.py) the rows
 * with given_rows[b] take their given proposals (the draft reads them, as it reads its own) and the others the draft's;
 * when every active row takes given ones the draft does not run and what is committed joins its pending tokens.
 * The rule itself is `verispec_rule`, exported (with `verispec_process`) so that a
 * test runs it beside rejection.verify_batch on the same logits and numbers.
 *
 * invariant != 0 (verispec's exact kernels): the target's pass never holds a gap in its sequence
 * ids: an inactive row between two active ones gets placeholder tokens after its last cell (removed after the pass),
 * so that llama.cpp runs the batch as one ubatch. With invariant == 2 (sgemm's attention) no sequence has one token in
 * it: a plain pass gives every row a placeholder after its token (with logits when it is the only row, so that the
 * output head has two columns). With invariant == 1 (flash attention) only a pass of one token gets one, from
 * position SPLIT_KV_FROM on (flash attention's split of one query's cells over the threads); with invariant == 3
 * (flash attention, a file whose matrices take sgemm from 2 columns on) every pass of one token gets one.
 * A position's logits then come from the same kernels whatever the pass holds (context.py, `Context.decode`, does the same).
 *
 * Compiled with -ffast-math (the reductions, expf and logf vectorize only with reassociation;
 * logits are finite) but linked without it, so that no flush-to-zero start-up code enters the process.
 *
 * Why C: after the target's pass (which streams its weights through the caches) Python and
 * torch run cold; the steps between two passes cost far more from Python than here.
 */
#include <llama.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "head.h"

#define TOO_MANY_TOKENS (-1) /* a batch would exceed its capacity: nothing was changed */
#define HEAD_OUT_OF_ORDER (-2) /* the own head's rows were not the batch's outputs in order (never expected) */
#define SPLIT_KV_FROM 240   /* as context.py's SPLIT_KV_FROM */

/* sampling.process_logits's settings at temperature > 0 (config.SamplingParams). */
struct verispec_sampling {
    float temperature;
    int32_t top_k; /* 0 or >= V: off */
    float top_p;   /* 1: off */
    float min_p;   /* 0: off */
};

/* The tokens a processed distribution may give mass to: ids[0..n) increasing, or ids == NULL: all n = V. */
struct support {
    const int32_t *ids;
    int32_t n;
};

static inline int32_t token_at(struct support s, int32_t j) { return s.ids ? s.ids[j] : j; }

/* A grid of proposal temperatures (proposal.TAUS, `--draft-temperature auto`); size 0: none. */
struct grid {
    const float *taus;
    int32_t size;
};

/* One draft position's proposal: x was drawn from q' = sharpen(q, tau), q the processed draft distribution
 * (dense [V]); top is q's argmax; norms[0] the sum of q'_tau's unnormalised weights, norms[1 + g] that of
 * grid tau g (1 where tau is 0 or 1). */
struct proposal {
    const float *q;
    float tau;
    int32_t top;
    const float *norms;
};

/* Scratch of one call (llamacpp/step.py allocates [4 V] floats and [3 V + 2] int32): p, and three arrays in
 * support order; the support's ids and top-p's sort keys. */
struct work {
    float *probs, *aligned, *residual, *logs;
    int32_t *ids;
    uint64_t *keys; /* [V] */
};

static struct work work_of(float *scratch, int32_t *index, int32_t vocab) {
    uint64_t *keys = (uint64_t *)(index + ((vocab + 1) & ~1)); /* 8-byte aligned */
    return (struct work){scratch, scratch + vocab, scratch + 2 * (size_t)vocab, scratch + 3 * (size_t)vocab, index, keys};
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *state) { return (double)(splitmix64(state) >> 11) * 0x1.0p-53; } /* [0, 1), 53 bits */

static void put(llama_batch *b, llama_token token, llama_pos pos, llama_seq_id seq, int8_t output) {
    int32_t i = b->n_tokens++;
    b->token[i] = token;
    b->pos[i] = pos;
    b->n_seq_id[i] = 1;
    b->seq_id[i][0] = seq;
    b->logits[i] = output;
}

static float maximum(const float *x, int32_t n) {
    float lanes[16];
    for (int32_t j = 0; j < 16; j++) lanes[j] = x[0];
    int32_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int32_t j = 0; j < 16; j++) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
    float best = lanes[0];
    for (int32_t j = 1; j < 16; j++) best = lanes[j] > best ? lanes[j] : best;
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* argmax of x[n], the lowest id on ties (as numpy and torch); *top = its softmax probability if top. */
static int32_t argmax(const float *x, int32_t n, float *top) {
    float best = maximum(x, n);
    int32_t index = 0;
    while (index < n - 1 && x[index] != best) index++; /* (a NaN at 0 would match nothing) */
    if (top) {
        float sum = 0.0f;
        for (int32_t j = 0; j < n; j++) sum += expf(x[j] - best);
        *top = 1.0f / sum;
    }
    return index;
}

/* probs[n] = softmax(x / temperature). */
static void softmax(const float *x, int32_t n, float temperature, float *probs) {
    const float best = maximum(x, n), scale = 1.0f / temperature;
    float sum = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        probs[i] = expf((x[i] - best) * scale);
        sum += probs[i];
    }
    const float norm = 1.0f / sum;
    for (int32_t i = 0; i < n; i++) probs[i] *= norm;
}

static void renormalise(float *probs, struct support kept) {
    float sum = 0.0f;
    for (int32_t j = 0; j < kept.n; j++) sum += probs[token_at(kept, j)];
    const float norm = 1.0f / sum;
    for (int32_t j = 0; j < kept.n; j++) probs[token_at(kept, j)] *= norm;
}

static void sift_down(float *heap, int32_t n, int32_t i) {
    for (int32_t child; (child = 2 * i + 1) < n; i = child) {
        if (child + 1 < n && heap[child + 1] < heap[child]) child++;
        if (heap[i] <= heap[child]) return;
        const float swap = heap[i];
        heap[i] = heap[child];
        heap[child] = swap;
    }
}

/* The k-th largest of x[n] counting repeats (torch.topk(x, k).values[-1]), 0 < k < n, in one pass over x: a
 * min-heap of the k largest so far in heap[k]; a block of 16 whose largest is not above the heap's root is skipped. */
static float kth_largest(const float *x, int32_t n, int32_t k, float *heap) {
    memcpy(heap, x, (size_t)k * sizeof *heap);
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    int32_t i = k;
    for (; i + 16 <= n; i += 16) {
        float block = x[i];
        for (int32_t j = 1; j < 16; j++) block = x[i + j] > block ? x[i + j] : block;
        if (block <= heap[0]) continue;
        for (int32_t j = i; j < i + 16; j++)
            if (x[j] > heap[0]) heap[0] = x[j], sift_down(heap, k, 0);
    }
    for (; i < n; i++)
        if (x[i] > heap[0]) heap[0] = x[i], sift_down(heap, k, 0);
    return heap[0];
}

/* Top-k then softmax: the tokens whose logit is at least the k-th largest (ties kept), in id order into ids;
 * probs = softmax(x / temperature) over them, 0 elsewhere. */
static struct support top_k(const float *x, int32_t vocab, int32_t k, float temperature, float *probs, int32_t *ids) {
    const float kth = kth_largest(x, vocab, k, probs), best = maximum(probs, k); /* probs holds the heap for now */
    memset(probs, 0, (size_t)vocab * sizeof *probs);
    int32_t n = 0, t = 0;
    for (; t + 16 <= vocab; t += 16) { /* blocks of 16 wholly below the k-th value skipped */
        float block = x[t];
        for (int32_t j = 1; j < 16; j++) block = x[t + j] > block ? x[t + j] : block;
        if (block < kth) continue;
        for (int32_t j = t; j < t + 16; j++)
            if (x[j] >= kth) ids[n++] = j;
    }
    for (; t < vocab; t++)
        if (x[t] >= kth) ids[n++] = t;
    const float scale = 1.0f / temperature;
    for (int32_t j = 0; j < n; j++) probs[ids[j]] = expf((x[ids[j]] - best) * scale);
    struct support kept = {ids, n};
    renormalise(probs, kept);
    return kept;
}

static int compare_keys(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* sampling._top_p on the kept tokens (listed): sorted by probability, descending, a token is kept while the mass
 * of those before it (cumsum in double, as torch's, minus its own, in float) is below `mass` (top_p); the rest
 * get 0 and the kept ones are renormalised. Sorts only the kept tokens. Equal probabilities go by id (torch's
 * sort leaves their order open: at a tie across the boundary the two paths may keep different tokens). */
static struct support top_p(float *probs, struct support kept, float mass, uint64_t *keys, int32_t *ids) {
    for (int32_t j = 0; j < kept.n; j++) {
        uint32_t bits;
        memcpy(&bits, &probs[kept.ids[j]], sizeof bits); /* a nonnegative float's order is its bits' */
        keys[j] = (uint64_t)(~bits) << 32 | (uint32_t)kept.ids[j];
    }
    qsort(keys, kept.n, sizeof *keys, compare_keys);
    double running = 0.0;
    for (int32_t j = 0; j < kept.n; j++) {
        const int32_t t = (int32_t)(uint32_t)keys[j];
        running += probs[t];
        if (!((float)running - probs[t] < mass)) probs[t] = 0.0f;
    }
    int32_t n = 0;
    for (int32_t j = 0; j < kept.n; j++)
        if (probs[kept.ids[j]] > 0.0f) ids[n++] = kept.ids[j];
    struct support left = {ids, n};
    renormalise(probs, left);
    return left;
}

/* Min-p on the kept tokens: those with probs >= fraction * max stay (listed into ids), the rest get 0; renormalised. */
static struct support min_p(float *probs, struct support kept, float fraction, int32_t *ids) {
    float best = 0.0f;
    for (int32_t j = 0; j < kept.n; j++) best = probs[token_at(kept, j)] > best ? probs[token_at(kept, j)] : best;
    const float floor = fraction * best;
    int32_t n = 0;
    for (int32_t j = 0; j < kept.n; j++) {
        const int32_t t = token_at(kept, j);
        if (probs[t] >= floor) ids[n++] = t;
        else probs[t] = 0.0f;
    }
    struct support left = {ids, n};
    renormalise(probs, left);
    return left;
}

/* probs [V] = sampling.process_logits(x, s) at temperature > 0, 0 outside the returned support: temperature,
 * top-k (ties at the k-th value kept), softmax, top-p, min-p, each renormalising. With top-k the vocabulary is
 * read in one pass (kth_largest) and only the kept tokens are sorted (top-p); min-p alone needs no sort; top-p
 * without top-k sorts the whole vocabulary (llamacpp/step.py leaves that setting to the Python path). */
static struct support process(const float *x, int32_t vocab, const struct verispec_sampling *s, struct work *w,
                              float *probs) {
    struct support kept = {0, vocab};
    if (s->top_k > 0 && s->top_k < vocab)
        kept = top_k(x, vocab, s->top_k, s->temperature, probs, w->ids);
    else
        softmax(x, vocab, s->temperature, probs);
    if (s->top_p < 1.0f) {
        if (!kept.ids)
            for (int32_t t = 0; t < vocab; t++) w->ids[t] = t;
        kept = top_p(probs, (struct support){w->ids, kept.n}, s->top_p, w->keys, w->ids);
    }
    if (s->min_p > 0.0f) kept = min_p(probs, kept, s->min_p, w->ids);
    return kept;
}

/* dense[t] for the support's tokens, in support order: dense itself where the support is every token, else copied. */
static const float *on_support(const float *dense, struct support s, float *into) {
    if (!s.ids) return dense;
    for (int32_t j = 0; j < s.n; j++) into[j] = dense[s.ids[j]];
    return into;
}

/* One draw in proportion to weights[j] (in support order; nonnegative, positive total) with u in [0, 1): the
 * token of the first j whose running sum (double) exceeds u * total; the last of positive weight if rounding
 * leaves none (sampling.sample). A token of weight 0 is never drawn. */
static int32_t draw(const float *weights, struct support s, double u) {
    double total = 0.0, running = 0.0;
    for (int32_t j = 0; j < s.n; j++) total += weights[j];
    const double point = u * total;
    int32_t last = 0;
    for (int32_t j = 0; j < s.n; j++) {
        if (weights[j] <= 0.0f) continue;
        running += weights[j];
        last = j;
        if (running > point) break;
    }
    return token_at(s, last);
}

/* q's argmax over its support, the lowest id on ties. */
static int32_t top_of(const float *q, struct support s) {
    int32_t top = token_at(s, 0);
    for (int32_t j = 1; j < s.n; j++)
        if (q[token_at(s, j)] > q[top]) top = token_at(s, j);
    return top;
}

/* logs[j] = log(q_t / q_top) for the support's tokens t: sharpen(q, tau) is proportional to exp(logs / tau) there
 * (proposal.sharpen's exp((log q - log max q) / tau)); NO_MASS where q_t = 0: below any float's log ratio (>= -104),
 * its exp is 0 for every tau <= 1 and stays finite when divided by the smallest tau. */
#define NO_MASS (-1e4f)
static void log_ratios(const float *q, int32_t top, struct support s, float *logs) {
    const float scale = 1.0f / q[top];
    for (int32_t j = 0; j < s.n; j++) {
        const float qt = q[token_at(s, j)];
        logs[j] = qt > 0.0f ? logf(qt * scale) : NO_MASS;
    }
}

/* 1 / tau, tau at least 1e-6 (as proposal.sharpen clamps it). */
static float inverse_of(float tau) { return 1.0f / (tau > 1e-6f ? tau : 1e-6f); }

/* sum_j exp(logs[j] / tau), 0 < tau < 1: the normaliser of sharpen(q, tau); w[j] = the terms if w. */
static float sharpened(const float *logs, int32_t n, float tau, float *w) {
    const float inverse = inverse_of(tau);
    float sum = 0.0f;
    if (!w)
        for (int32_t j = 0; j < n; j++) sum += expf(logs[j] * inverse);
    else
        for (int32_t j = 0; j < n; j++) sum += w[j] = expf(logs[j] * inverse);
    return sum;
}

/* The record of a proposal from sharpen(q, tau), q over `kept`: returns q's argmax; norms[1 + g] for each tau of
 * the grid, norms[0] for tau (1 where tau is 0 or 1); w then holds tau's unnormalised weights in support order
 * where 0 < tau < 1. logs: [V] scratch. */
static int32_t describe(const float *q, struct support kept, float tau, struct grid grid, float *norms, float *w,
                        float *logs) {
    const int32_t top = top_of(q, kept);
    if (grid.size || (tau > 0.0f && tau < 1.0f)) log_ratios(q, top, kept, logs);
    for (int32_t g = 0; g < grid.size; g++)
        norms[1 + g] = grid.taus[g] > 0.0f && grid.taus[g] < 1.0f ? sharpened(logs, kept.n, grid.taus[g], 0) : 1.0f;
    norms[0] = tau > 0.0f && tau < 1.0f ? sharpened(logs, kept.n, tau, w) : 1.0f;
    return top;
}

/* out[j] = sharpen(q, tau) at the support's tokens: q itself at tau 1, one-hot at q's argmax at tau 0, else
 * exp(logs[j] / tau) / norm (logs: log_ratios on the same support). */
static void sharp_on(const float *q, int32_t top, float tau, float norm, struct support s, const float *logs,
                     float *out) {
    if (tau >= 1.0f) {
        for (int32_t j = 0; j < s.n; j++) out[j] = q[token_at(s, j)];
    } else if (tau <= 0.0f) {
        for (int32_t j = 0; j < s.n; j++) out[j] = token_at(s, j) == top ? 1.0f : 0.0f;
    } else {
        const float inverse = inverse_of(tau), unit = 1.0f / norm;
        for (int32_t j = 0; j < s.n; j++) out[j] = expf(logs[j] * inverse) * unit;
    }
}

/* q'(x) of a proposal at one token x: sharp_on at x alone. */
static float declared_at(const struct proposal *d, int32_t x) {
    float logs[1], out[1];
    const struct support one = {&x, 1};
    log_ratios(d->q, d->top, one, logs);
    sharp_on(d->q, d->top, d->tau, d->norms[0], one, logs, out);
    return out[0];
}

/* sum_j min(p_t, q[j]) in double, t the support's j-th token: 1 - TV(p, q) where both live on the support. */
static double overlap(const float *p, struct support s, const float *q) {
    double sum = 0.0;
    for (int32_t j = 0; j < s.n; j++) {
        const float pt = p[token_at(s, j)];
        sum += pt < q[j] ? pt : q[j];
    }
    return sum;
}

/* One proposal of a row: q = process(the draft's logits) into q (dense, the row's slot), its record, and a token
 * drawn from sharpen(q, tau): from q'_tau with one number of rng, or q's argmax at tau 0 (no number). *top_prob:
 * q's largest probability (the confidence stop's). */
static int32_t propose(const float *logits, int32_t vocab, const struct verispec_sampling *s, float tau,
                       struct grid grid, struct work *w, uint64_t *rng, float *q, int32_t *top, float *norms,
                       float *top_prob) {
    const struct support kept = process(logits, vocab, s, w, q);
    *top = describe(q, kept, tau, grid, norms, w->aligned, w->logs);
    *top_prob = q[*top];
    if (tau <= 0.0f) return *top;
    const float *weights = tau >= 1.0f ? on_support(q, kept, w->aligned) : w->aligned;
    return draw(weights, kept, uniform(rng));
}

/* sum_t min(p_t, q'_tau,t) for every tau of the grid (proposal.acceptance_grid at one position), over p's
 * support; logs: log_ratios of the proposal's q on that support; out: [V] scratch. */
static void acceptance_grid(const float *p, struct support kept, const struct proposal *d, struct grid grid,
                            const float *logs, float *scratch, double *out) {
    for (int32_t g = 0; g < grid.size; g++) {
        sharp_on(d->q, d->top, grid.taus[g], d->norms[1 + g], kept, logs, scratch);
        out[g] = overlap(p, kept, scratch);
    }
}

/* How many tokens of the batch so far ask for logits. */
static int32_t outputs_before(const llama_batch *b) {
    int32_t n = 0;
    for (int32_t i = 0; i < b->n_tokens; i++) n += b->logits[i] != 0;
    return n;
}

static int32_t decode(struct llama_context *ctx, llama_batch *batch, double *seconds) {
    double started = now();
    int32_t status = llama_decode(ctx, *batch);
    *seconds += now() - started;
    return status;
}

/* A uniform number of the rule: given[role] when the caller gives them (a test: the roles of
 * rejection.verify, role i for the test of position i and role `drafted` for the recovered or bonus
 * draw), else the row's next number (the step: the tests of positions 0..n in turn, then the draw). */
static double number(const double *given, int32_t role, uint64_t *rng) { return given ? given[role] : uniform(rng); }

/* One row's rule: the target's raw logits rows [drafted + 1][V] for [pending, x_1..x_drafted], its proposals
 * and what they were drawn from; the outcome: output [drafted + 1], beta [drafted], grid [drafted, G] (or NULL). */
struct row {
    const float *const *logits;
    const int32_t *proposals;
    const struct proposal *drawn; /* [drafted] (temperature > 0) */
    int32_t drafted;
    int32_t coupled; /* the proposals were made outside (q one-hot): the coupled form at temperature > 0 */
    uint64_t *rng;
    const double *given; /* the rule's numbers by role, or NULL: from rng */
    int32_t *output;
    double *beta, *grid;
};

/* The accept-reject rule for one row (rejection.verify_batch on one row).
 * temperature == 0: accepted while x_i is the target's argmax; the argmax follows (rejection.verify_greedy);
 * beta_i = 1 where accepted, 0 at the first rejection (q one-hot at x_i, p one-hot at the argmax).
 * temperature > 0: p_i = process(logits[i]), q'_i = what x_i was drawn from; x_i is accepted while
 * u_i q'_i(x_i) < p_i(x_i); at the first rejection a token is drawn from max(p_i - q'_i, 0) (p_i where that
 * has no mass), after all from p_drafted (rejection.verify); beta_i = sum min(p_i, q'_i), and grid[i] the
 * same for every tau of the grid. Loops run over p_i's support. Random numbers: `number` (rng advances by
 * those drawn; none at temperature 0). Writes output[0..n] (the accepted proposals, then the recovered or
 * bonus token), beta and grid at the verified positions 0..min(n, drafted - 1); returns n, the number accepted. */
static int32_t rule(const struct row *r, int32_t vocab, const struct verispec_sampling *s, struct grid grid,
                    struct work *w) {
    const int32_t drafted = r->drafted;
    if (s->temperature <= 0.0f) {
        int32_t n = 0;
        for (;; n++) {
            r->output[n] = argmax(r->logits[n], vocab, 0);
            if (n == drafted || r->output[n] != r->proposals[n]) break;
            r->beta[n] = 1.0;
        }
        if (n < drafted) r->beta[n] = 0.0;
        return n;
    }
    const float *p = w->probs;
    for (int32_t i = 0; r->coupled && i <= drafted; i++) { /* the target's own draws, kept while they are x_i */
        const struct support kept = process(r->logits[i], vocab, s, w, w->probs);
        r->output[i] = draw(on_support(p, kept, w->residual), kept, number(r->given, i, r->rng));
        if (i == drafted) return drafted; /* every proposal kept: the bonus token */
        r->beta[i] = p[r->proposals[i]]; /* sum min(p, q) with q one-hot at x_i */
        if (r->output[i] != r->proposals[i]) return i;
    }
    for (int32_t i = 0; i < drafted; i++) {
        const struct support kept = process(r->logits[i], vocab, s, w, w->probs);
        const struct proposal *d = &r->drawn[i];
        float *q = w->aligned, *residual = w->residual; /* q'_i and max(p_i - q'_i, 0) in support order */
        if (r->grid || (d->tau > 0.0f && d->tau < 1.0f)) log_ratios(d->q, d->top, kept, w->logs);
        sharp_on(d->q, d->top, d->tau, d->norms[0], kept, w->logs, q);
        r->beta[i] = overlap(p, kept, q);
        if (r->grid) acceptance_grid(p, kept, d, grid, w->logs, residual, r->grid + (size_t)i * grid.size);
        const int32_t x = r->proposals[i];
        if (number(r->given, i, r->rng) * declared_at(d, x) < (double)p[x]) { /* u < p/q, in double without dividing */
            r->output[i] = x;
            continue;
        }
        float mass = 0.0f;
        for (int32_t j = 0; j < kept.n; j++) {
            const float pt = p[token_at(kept, j)];
            residual[j] = pt > q[j] ? pt - q[j] : 0.0f;
            mass += residual[j];
        }
        const float *weights = mass > 0.0f ? residual : on_support(p, kept, residual);
        r->output[i] = draw(weights, kept, number(r->given, drafted, r->rng)); /* the recovered token */
        return i;
    }
    const struct support kept = process(r->logits[drafted], vocab, s, w, w->probs);
    r->output[drafted] = draw(on_support(p, kept, w->residual), kept, number(r->given, drafted, r->rng)); /* bonus */
    return drafted;
}

/* verispec_rule's argument (llamacpp/step.py mirrors it): one row's rule on given logits, for the tests. */
struct verispec_rule_args {
    const float *const *logits;   /* [drafted + 1] the target's raw logits rows [vocab] */
    const int32_t *proposals;     /* [drafted] */
    const float *draft_probs;     /* [drafted, vocab] q, processed, not sharpened (temperature > 0) */
    int32_t drafted, vocab;
    struct verispec_sampling sampling;
    float tau;                    /* the proposals were drawn from sharpen(q, tau) */
    const float *grid_taus;       /* [grid_size] */
    int32_t grid_size;            /* 0: no grid */
    float *scratch;               /* [4 vocab] */
    int32_t *index;               /* [3 vocab + 2] */
    uint64_t *rng;                /* the row's splitmix64 state */
    const double *given;          /* [drafted + 1] the numbers by role, or NULL: from rng */
    int32_t *output;              /* [drafted + 1] out */
    double *beta;                 /* [drafted] out */
    double *grid;                 /* [drafted, grid_size] out, or NULL */
    int32_t coupled;              /* 1: q one-hot at the proposals (draft_probs unread): the coupled form */
};

/* The rule the step runs, on one row given its logits, proposals and q (exported for the tests that compare it
 * with rejection.verify_batch): each proposal's record is made from q (its support: where q > 0) as the draft
 * makes it. Returns n, the number accepted; see `rule`. */
int32_t verispec_rule(const struct verispec_rule_args *a) {
    const int32_t drafted = a->drafted, vocab = a->vocab, size = a->grid_size;
    const struct grid grid = {a->grid_taus, size};
    struct work w = work_of(a->scratch, a->index, vocab);
    struct proposal drawn[drafted + 1];
    float norms[(drafted + 1) * (1 + size)];
    for (int32_t i = 0; a->sampling.temperature > 0.0f && !a->coupled && i < drafted; i++) {
        const float *q = a->draft_probs + (size_t)i * vocab;
        int32_t n = 0;
        for (int32_t t = 0; t < vocab; t++)
            if (q[t] > 0.0f) w.ids[n++] = t;
        float *mine = norms + i * (1 + size);
        const int32_t top = describe(q, (struct support){w.ids, n}, a->tau, grid, mine, w.aligned, w.logs);
        drawn[i] = (struct proposal){q, a->tau, top, mine};
    }
    const struct row r = {a->logits, a->proposals, drawn, drafted, a->coupled, a->rng, a->given, a->output, a->beta,
                          a->grid};
    return rule(&r, vocab, &a->sampling, size ? grid : (struct grid){0, 0}, &w);
}

/* probs [vocab] = sampling.process_logits(logits) at temperature > 0 (`process`), exported for the tests; the
 * support's ids into index[0..n) (index: [3 vocab + 2]); returns n. */
int32_t verispec_process(const float *logits, int32_t vocab, const struct verispec_sampling *s, float *probs,
                         int32_t *index) {
    struct work w = work_of(probs, index, vocab); /* (only probs, ids and keys are used) */
    const struct support kept = process(logits, vocab, s, &w, probs);
    if (!kept.ids)
        for (int32_t t = 0; t < vocab; t++) index[t] = t;
    else if (kept.ids != index)
        memmove(index, kept.ids, (size_t)kept.n * sizeof *index);
    return kept.n;
}

/* verispec_step's argument: the two contexts, their batches, and the arrays both sides read and write
 * (llamacpp/step.py mirrors it as a ctypes.Structure, field by field; keep the two in the same order).
 * Row b, when active: draft_pending[b * width ..] holds draft_count[b] tokens the draft has not read,
 * which it reads at draft_length[b]..; target_pending[b] is read by the target at target_length[b]. */
struct verispec_step_args {
    struct llama_context *draft;  /* the draft's context, or NULL: plain decoding (k == 0 only) */
    llama_batch *draft_batch;     /* the draft's batch, `capacity` tokens (NULL without a draft) */
    struct llama_context *target; /* the target's context */
    llama_batch *target_batch;    /* the target's batch, `capacity` tokens */
    int32_t capacity;             /* tokens one batch holds: a step that needs more returns TOO_MANY_TOKENS */
    int32_t rows;                 /* rows of the batch; row b is llama.cpp sequence b in both contexts */
    const uint8_t *active;        /* [rows] 0: the row takes no part (it finished) */
    int32_t k;                    /* proposals wanted this step (0: a plain step) */
    float p_min;                  /* the confidence threshold: drafting stops once every row's top q is below it */
    const struct verispec_sampling *sampling; /* [rows] each row's settings: temperature 0 greedy, else sampled */
    uint64_t *rng;                /* [rows] each row's splitmix64 state (streams.RowStreams: key + drawn * gamma) */
    float *draft_probs;           /* [rows, k, V] q (processed, not sharpened) of every proposal (temperature > 0) */
    float *scratch;               /* [4 V] floats of one position (struct work; temperature > 0) */
    double *beta;                 /* [rows, k] out: sum min(p, q') at each verified position, q' what x was drawn from */
    int32_t *draft_pending;       /* [rows, width] in/out: tokens the draft has not read */
    int32_t width;                /* columns of draft_pending */
    int32_t *draft_count;         /* [rows] in/out: how many of them */
    int32_t *draft_length;        /* [rows] in/out: the draft cache's length */
    int32_t *target_pending;      /* [rows] in/out: the token the target reads next */
    int32_t *target_length;       /* [rows] in/out: the target cache's length */
    int32_t *proposals;           /* [rows, k] out: the draft's tokens */
    int32_t *output;              /* [rows, k + 1] out: the committed tokens (num_accepted[b] proposals, then one) */
    int32_t *num_accepted;        /* [rows] out */
    double *seconds;              /* [2] grow by the time inside the draft's and the target's llama_decode */
    int32_t invariant;            /* 0: ordinary passes; 1, 2, 3: shape-invariant passes (placeholders; see above) */
    const float *taus;            /* [rows] each row's proposal temperature (proposal.py), or NULL: 1 (q itself) */
    const float *grid_taus;       /* [grid_size] the grid whose acceptance the rule measures */
    int32_t grid_size;            /* 0: none (a fixed tau) */
    double *grid;                 /* [rows, k, grid_size] out: sum min(p, q'_tau) at each verified position */
    int32_t *draft_top;           /* [rows, k] q's argmax at every proposal (temperature > 0) */
    float *draft_norms;           /* [rows, k, 1 + grid_size] the proposals' normalisers (struct proposal) */
    int32_t *index;               /* [3 V + 2] int32 scratch (struct work; temperature > 0) */
    int32_t tell_q;               /* 1: the rule is told q whatever tau drew the proposal: inexact, the tests' negative control */
    int32_t *first_at;            /* [rows] out: row b's first place in the target's batch (-1: not in it), whose
                                     logits (llama_get_logits_ith) stay readable until the next decode */
    const int32_t *given;         /* [rows, k] proposals made outside (a lookup, q one-hot): every row's with draft NULL,
                                     with a draft those of the rows given_rows names; or NULL */
    const uint8_t *given_rows;    /* [rows] with a draft and `given`: 1 where row b takes given[b] (or NULL: none) */
    struct verispec_head *head;   /* verispec's own output head of the target (head.c), or NULL: llama.cpp's */
    float *head_logits;           /* [outputs, V] with `head`: the target's logits, in the batch's order of outputs;
                                     first_at then indexes its rows */
};

/* Row b's proposals for position i, drawn by verispec_step: the pointers into its arrays. */
static struct proposal drawn_at(const struct verispec_step_args *a, int32_t b, int32_t i, int32_t vocab) {
    const size_t at = (size_t)b * a->k + i;
    const float tau = a->tell_q ? 1.0f : a->taus ? a->taus[b] : 1.0f;
    return (struct proposal){a->draft_probs + at * vocab, tau, a->draft_top[at], a->draft_norms + at * (1 + a->grid_size)};
}

/* One iteration. Returns the number of proposals made (0..k; 0 when k == 0: a plain step),
 * TOO_MANY_TOKENS (nothing was changed), HEAD_OUT_OF_ORDER or -1000 - llama_decode's status (the caches
 * are then in an unknown state). On return output, num_accepted and beta hold the outcome of every active row
 * and the lengths, pending tokens and counts describe the caches after rollback. With k == 0 the
 * draft reads nothing: the committed token joins its pending tokens (width must leave room). */
int32_t verispec_step(const struct verispec_step_args *a) {
    struct llama_context *draft = a->draft, *target = a->target;
    llama_batch *draft_batch = a->draft_batch, *target_batch = a->target_batch;
    const int32_t rows = a->rows, k = a->k, width = a->width;
    const uint8_t *active = a->active;
    const float p_min = a->p_min;
    const struct verispec_sampling *sampling = a->sampling;
    uint64_t *rng = a->rng;
    int32_t *draft_pending = a->draft_pending, *draft_count = a->draft_count, *draft_length = a->draft_length;
    int32_t *target_pending = a->target_pending, *target_length = a->target_length;
    int32_t *proposals = a->proposals, *output = a->output, *num_accepted = a->num_accepted;
    double *seconds = a->seconds;
    /* 4: as 1, with a lone row's placeholder in the sequence after the row where that one is empty (`rows`, the
     * context's spare, or a free slot): ggml splits the cells of one query of one stream only, and the placeholder
     * then attends to its one cell instead of the row's (context.py, `_in_spare`) */
    const int32_t spare = a->invariant == 4;
    int32_t invariant = a->invariant == 4 ? 1 : a->invariant; /* a copy: this step may turn it off for itself */
    const int32_t *given = draft && !a->given_rows ? 0 : a->given; /* proposals made outside */
    if (!draft && !given && k > 0) return TOO_MANY_TOKENS;
    uint8_t takes[rows > 0 ? rows : 1]; /* row b verifies given[b]: q one-hot, the coupled form */
    int32_t drafting = 0;               /* active rows the draft proposes for */
    for (int32_t b = 0; b < rows; b++) {
        takes[b] = given && (!draft || a->given_rows[b]);
        drafting += active[b] && !takes[b];
    }
    const int32_t run_draft = draft && k > 0 && drafting > 0; /* else what is committed joins its pending tokens */
    const int32_t draft_vocab = draft ? llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(draft))) : 0;
    const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(target)));
    const struct grid grid = {a->grid_taus, a->grid ? a->grid_size : 0};
    int32_t drafted = k, live = 0, first = 0, status, lo = -1, hi = -1, sampled = 0;
    for (int32_t b = 0; b < rows; b++) {
        a->first_at[b] = -1;
        if (!active[b]) continue;
        sampled |= sampling[b].temperature > 0.0f;
        live++;
        if (lo < 0) lo = b;
        hi = b;
        first += draft_count[b];
        if (draft && !run_draft && draft_count[b] + k >= width) return TOO_MANY_TOKENS;
    }
    struct work w = sampled ? work_of(a->scratch, a->index, vocab) : (struct work){0};
    llama_memory_t draft_memory = draft ? llama_get_memory(draft) : 0, target_memory = llama_get_memory(target);
    const int32_t n_ctx_seq = (int32_t)llama_n_ctx_seq(target);
    /* positions of every row in the target's pass: k + 1, at least 2 under sgemm's attention (a placeholder after a
     * lone token) and for a lone row under flash attention: past SPLIT_KV_FROM, or always over sgemm's weights */
    const int32_t lone = invariant == 2 || (invariant == 3 && live == 1) ||
                         (invariant == 1 && live == 1 && target_length[lo] + 1 > SPLIT_KV_FROM);
    const int32_t per_row = lone && k == 0 ? 2 : k + 1;
    int32_t pad_at[rows > 0 ? rows : 1]; /* an inactive row's placeholders go after its last cell (as context.py's) */
    for (int32_t b = lo + 1; invariant && b < hi; b++) { /* past a sequence's room: an ordinary pass instead */
        if (active[b]) continue;
        pad_at[b] = (int32_t)llama_memory_seq_pos_max(target_memory, b) + 1;
        if (pad_at[b] + per_row > n_ctx_seq) invariant = 0;
    }
    for (int32_t b = lo; invariant && lone && k == 0 && b <= hi; b++)
        if (active[b] && target_length[b] + 2 > n_ctx_seq) invariant = 0;
    const int32_t span = invariant && live ? hi - lo + 1 : live; /* rows in the target's pass, placeholders included */
    if (span * per_row > a->capacity || (run_draft && first > a->capacity)) return TOO_MANY_TOKENS;

    for (int32_t b = 0; b < rows; b++)
        if (takes[b] && k > 0) memcpy(proposals + b * k, given + b * k, (size_t)k * sizeof *proposals);
    /* Draft: each row's pending tokens (logits at the last), then k - 1 single tokens (a given row's: its given). */
    for (int32_t i = 0; run_draft && i < k; i++) {
        draft_batch->n_tokens = 0;
        for (int32_t b = 0; b < rows; b++) {
            if (!active[b]) continue;
            if (i == 0)
                for (int32_t j = 0; j < draft_count[b]; j++)
                    put(draft_batch, draft_pending[b * width + j], draft_length[b] + j, b,
                        j == draft_count[b] - 1 && !takes[b]);
            else
                put(draft_batch, proposals[b * k + i - 1], draft_length[b] + draft_count[b] + i - 1, b, !takes[b]);
        }
        if ((status = decode(draft, draft_batch, &seconds[0])) != 0) return -1000 - status;
        int32_t confident = 0, index = -1; /* index: row b's place in the batch */
        for (int32_t b = 0; b < rows; b++) {
            if (!active[b]) continue;
            index += i == 0 ? draft_count[b] : 1;
            if (takes[b]) continue; /* it reads its given tokens */
            float top = 1.0f;
            const float *logits = llama_get_logits_ith(draft, index);
            if (sampling[b].temperature > 0.0f) {
                const size_t at = (size_t)b * k + i;
                proposals[at] = propose(logits, draft_vocab, &sampling[b], a->taus ? a->taus[b] : 1.0f, grid, &w, rng + b,
                                        a->draft_probs + at * draft_vocab, a->draft_top + at,
                                        a->draft_norms + at * (1 + grid.size), &top);
            } else {
                proposals[b * k + i] = argmax(logits, draft_vocab, p_min > 0 ? &top : 0);
            }
            confident |= top >= p_min;
        }
        if (p_min > 0 && !confident) {
            drafted = i + 1;
            break;
        }
    }

    /* Target: [pending, x_1..x_drafted] of every row in one pass, logits at every position. */
    int32_t at_of[rows]; /* row b's first place in the target's batch */
    int32_t out_of[rows]; /* row b's first row among the batch's outputs (own head) */
    target_batch->n_tokens = 0;
    const int32_t positions = invariant && lone && drafted == 0 ? 2 : drafted + 1; /* per row in the pass */
    const int32_t in_spare = positions > drafted + 1 && spare && live == 1 &&
                             (hi == rows - 1 || llama_memory_seq_pos_max(target_memory, hi + 1) < 0);
    const int32_t pad_seq = hi + 1; /* the spare, or the free slot after the lone row (active rows hold cells) */
    for (int32_t b = 0; b < rows; b++) {
        if (!active[b] && !(invariant && b > lo && b < hi)) continue;
        at_of[b] = target_batch->n_tokens;
        if (!active[b]) { /* a placeholder row: as many tokens, no logits, removed after the pass */
            for (int32_t i = 0; i < positions; i++) put(target_batch, 0, pad_at[b] + i, b, 0);
            continue;
        }
        out_of[b] = outputs_before(target_batch);
        a->first_at[b] = a->head ? out_of[b] : at_of[b];
        put(target_batch, target_pending[b], target_length[b], b, 1);
        for (int32_t i = 0; i < drafted; i++) put(target_batch, proposals[b * k + i], target_length[b] + 1 + i, b, 1);
        if (in_spare) /* a lone token under flash attention: a second in the spare sequence, no logits, removed after */
            put(target_batch, target_pending[b], 0, pad_seq, 0);
        else if (positions > drafted + 1) /* a lone token: a second after it, removed by the rollback below */
            put(target_batch, target_pending[b], target_length[b] + 1, b, live == 1);
    }
    struct verispec_head *head = a->head;
    if (head) head->rows = head->ubatches = head->overflow = 0;
    if ((status = decode(target, target_batch, &seconds[1])) != 0) return -1000 - status;
    if (in_spare) llama_memory_seq_rm(target_memory, pad_seq, -1, -1);
    if (head) { /* the head's rows are the batch's outputs in order only where llama.cpp ran it as one ubatch */
        const int32_t outputs = outputs_before(target_batch);
        if (head->overflow || head->rows != outputs || (head->ubatches > 1 && span > 1)) return HEAD_OUT_OF_ORDER;
        verispec_head_logits(head, outputs, a->head_logits);
    }

    /* The rule, then both caches back to the committed tokens. */
    for (int32_t b = 0; b < rows; b++) {
        if (!active[b]) {
            if (invariant && b > lo && b < hi) llama_memory_seq_rm(target_memory, b, pad_at[b], -1);
            continue;
        }
        const float *logits[drafted + 1]; /* the target's rows for [pending, x_1..x_drafted] */
        for (int32_t i = 0; i <= drafted; i++)
            logits[i] = head ? a->head_logits + (size_t)(out_of[b] + i) * vocab : llama_get_logits_ith(target, at_of[b] + i);
        struct proposal drawn[drafted + 1];
        const int row_sampled = sampling[b].temperature > 0.0f;
        for (int32_t i = 0; row_sampled && !takes[b] && i < drafted; i++) drawn[i] = drawn_at(a, b, i, vocab);
        const struct row r = {logits, proposals + b * k, drawn, drafted, takes[b], rng + b, 0, output + b * (k + 1),
                              a->beta + b * k, grid.size && !takes[b] ? a->grid + (size_t)b * k * grid.size : 0};
        const int32_t n = rule(&r, vocab, &sampling[b], row_sampled ? grid : (struct grid){0, 0}, &w);
        const int32_t token = output[b * (k + 1) + n];
        num_accepted[b] = n;
        target_length[b] += 1 + n;
        target_pending[b] = token;
        llama_memory_seq_rm(target_memory, b, target_length[b], -1);
        if (!draft) continue; /* plain decoding: no draft to keep up to date */
        if (!run_draft) { /* nothing read: what was committed waits with the others */
            for (int32_t i = 0; i <= n; i++) draft_pending[b * width + draft_count[b]++] = output[b * (k + 1) + i];
            continue;
        }
        /* The draft read its pending tokens and x_1..x_{drafted-1}; valid are those and x_1..x_n. */
        draft_length[b] += draft_count[b] + (n < drafted - 1 ? n : drafted - 1);
        llama_memory_seq_rm(draft_memory, b, draft_length[b], -1);
        if (n == drafted) { /* x_drafted was never read: it is pending with the bonus token */
            draft_pending[b * width] = proposals[b * k + drafted - 1];
            draft_pending[b * width + 1] = token;
            draft_count[b] = 2;
        } else {
            draft_pending[b * width] = token;
            draft_count[b] = 1;
        }
    }
    return drafted;
}
