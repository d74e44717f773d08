/* One speculative iteration on two llama.cpp contexts, in one call from Python.
 *
 * The iteration of verispec's engine with a ModelDrafter (engine.py, step.py, rejection.py and
 * sampling.py are the reference; llamacpp/step.py loads this file):
 * the draft reads its pending tokens and proposes up to k tokens, stopping early once every
 * row's top draft probability is below p_min; the target scores [pending, x_1..x_k] in one
 * llama_decode; the accept-reject rule keeps a prefix of each row and adds the recovered or
 * bonus token; both caches are rolled back to what was committed. Row b is llama.cpp
 * sequence b in both contexts; rows with active[b] == 0 take no part.
 *
 * temperature == 0: proposals are the draft's argmax and a proposal is accepted while it is
 * the target's argmax (rejection.verify_greedy). temperature > 0 (no other filter):
 * q = softmax(draft logits / T), p = softmax(target logits / T), x_i ~ q_i, accepted while
 * u_i q_i(x_i) < p_i(x_i); at the first rejection a token is drawn from max(p_i - q_i, 0)
 * (p_i where that has no mass), after k acceptances from p_{k+1} (rejection.verify). Draws
 * are inverse-transform in double from row b's own splitmix64 stream (rng[b]), as sampling.sample
 * with one generator per row: a row's numbers never depend on the other rows. The rule itself is
 * `verispec_rule`, exported so that a test runs it beside rejection.verify_batch on the same logits and numbers.
 *
 * invariant != 0 (verispec's exact kernels): the target's pass never holds a gap in its sequence
 * ids: an inactive row between two active ones gets placeholder tokens (removed after the pass),
 * so that llama.cpp runs the batch as one ubatch. A pass of one token gets a second placeholder
 * with logits after it: always with invariant == 2 (this file's one-token kernels differ), from
 * position SPLIT_KV_FROM on with invariant == 1 (flash attention's split of one query's cells).
 * A position's logits then come from the same kernels whatever the pass holds (context.py, `Context.decode`, does the same).
 *
 * Compiled with -ffast-math (the reductions and expf vectorize only with reassociation; logits
 * are finite) but linked without it, so that no flush-to-zero start-up code enters the process.
 *
 * Why C: after the target's pass (which streams its weights through the caches) Python and
 * torch run cold; the steps between two passes cost about 1 ms from Python, tens of
 * microseconds here.
 */
#include <llama.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define TOO_MANY_TOKENS (-1) /* a batch would exceed its capacity: nothing was changed */
#define SPLIT_KV_FROM 240   /* as context.py's SPLIT_KV_FROM */

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

/* probs[n] = softmax(x / temperature); returns the largest probability. */
static float softmax(const float *x, int32_t n, float temperature, float *probs) {
    const float best = maximum(x, n), scale = 1.0f / temperature;
    float sum = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        probs[i] = expf((x[i] - best) * scale);
        sum += probs[i];
    }
    const float norm = 1.0f / sum;
    for (int32_t i = 0; i < n; i++) probs[i] *= norm;
    return norm; /* exp(0) / sum */
}

/* One draw in proportion to weights[n] (nonnegative, positive total) with u in [0, 1): the first token
 * whose running sum (double) exceeds u * total; the last token of positive weight if rounding leaves
 * none. A token of weight 0 is never drawn. */
static int32_t draw(const float *weights, int32_t n, double u) {
    double total = 0.0, running = 0.0;
    for (int32_t i = 0; i < n; i++) total += weights[i];
    const double point = u * total;
    int32_t last = 0;
    for (int32_t i = 0; i < n; i++) {
        if (weights[i] <= 0.0f) continue;
        running += weights[i];
        last = i;
        if (running > point) return i;
    }
    return last;
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

/* The accept-reject rule for one row (rejection.verify_batch on one row; exported for the tests that
 * compare the two). logits[i] is the target's raw logits row [vocab] for position i (0..drafted),
 * proposals[i] the draft's token x_i.
 * temperature == 0: accepted while x_i is the target's argmax; the argmax follows (rejection.verify_greedy);
 * beta_i = 1 where accepted, 0 at the first rejection (q one-hot at x_i, p one-hot at the argmax).
 * temperature > 0: p_i = softmax(logits[i] / T), q_i = draft_probs[i * vocab ..]; x_i is accepted while
 * u_i q_i(x_i) < p_i(x_i); at the first rejection a token is drawn from max(p_i - q_i, 0) (p_i where that
 * has no mass), after all from p_drafted (rejection.verify); beta_i = sum min(p_i, q_i). scratch holds
 * 2 * vocab floats. Random numbers: `number` (rng advances by those drawn; none at temperature 0).
 * Writes output[0..n] (the accepted proposals, then the recovered or bonus token) and beta[0..min(n, drafted - 1)]
 * (the verified positions); returns n, the number accepted. */
int32_t verispec_rule(const float *const *logits, const int32_t *proposals, const float *draft_probs, int32_t drafted,
                      int32_t vocab, float temperature, float *scratch, uint64_t *rng, const double *given,
                      int32_t *output, double *beta) {
    if (temperature <= 0.0f) {
        int32_t n = 0;
        for (;; n++) {
            output[n] = argmax(logits[n], vocab, 0);
            if (n == drafted || output[n] != proposals[n]) break;
            beta[n] = 1.0;
        }
        if (n < drafted) beta[n] = 0.0;
        return n;
    }
    float *p = scratch, *residual = scratch + vocab;
    for (int32_t i = 0; i < drafted; i++) {
        softmax(logits[i], vocab, temperature, p);
        const float *qi = draft_probs + (size_t)i * vocab;
        double overlap = 0.0;
        for (int32_t t = 0; t < vocab; t++) overlap += p[t] < qi[t] ? p[t] : qi[t];
        beta[i] = overlap;
        const int32_t x = proposals[i];
        if (number(given, i, rng) * qi[x] < (double)p[x]) { /* u < p/q, compared in double without dividing */
            output[i] = x;
            continue;
        }
        float mass = 0.0f;
        for (int32_t t = 0; t < vocab; t++) {
            residual[t] = p[t] > qi[t] ? p[t] - qi[t] : 0.0f;
            mass += residual[t];
        }
        output[i] = draw(mass > 0.0f ? residual : p, vocab, number(given, drafted, rng)); /* the recovered token */
        return i;
    }
    softmax(logits[drafted], vocab, temperature, p);
    output[drafted] = draw(p, vocab, number(given, drafted, rng)); /* the bonus token */
    return drafted;
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
    float temperature;            /* 0: greedy; > 0: softmax(logits / T), no other filter */
    uint64_t *rng;                /* [rows] each row's splitmix64 state (streams.RowStreams: key + drawn * gamma) */
    float *draft_probs;           /* [rows, k, V] q of every proposal (temperature > 0) */
    float *scratch;               /* [2 * V] p and the residual of one position (temperature > 0) */
    double *beta;                 /* [rows, k] out: sum min(p, q) at each verified position */
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
    int32_t invariant;            /* 0: ordinary passes; 1, 2: shape-invariant passes (placeholders; see above) */
};

/* One iteration. Returns the number of proposals made (0..k; 0 when k == 0: a plain step),
 * TOO_MANY_TOKENS (nothing was changed), or -1000 - llama_decode's status (the caches are then in
 * an unknown state). On return output, num_accepted and beta hold the outcome of every active row
 * and the lengths, pending tokens and counts describe the caches after rollback. With k == 0 the
 * draft reads nothing: the committed token joins its pending tokens (width must leave room). */
int32_t verispec_step(const struct verispec_step_args *a) {
    struct llama_context *draft = a->draft, *target = a->target;
    llama_batch *draft_batch = a->draft_batch, *target_batch = a->target_batch;
    const int32_t rows = a->rows, k = a->k, width = a->width;
    const uint8_t *active = a->active;
    const float p_min = a->p_min, temperature = a->temperature;
    uint64_t *rng = a->rng;
    float *draft_probs = a->draft_probs;
    int32_t *draft_pending = a->draft_pending, *draft_count = a->draft_count, *draft_length = a->draft_length;
    int32_t *target_pending = a->target_pending, *target_length = a->target_length;
    int32_t *proposals = a->proposals, *output = a->output, *num_accepted = a->num_accepted;
    double *seconds = a->seconds;
    int32_t invariant = a->invariant; /* a copy: this step may turn it off for itself */
    if (!draft && k > 0) return TOO_MANY_TOKENS; /* no draft: plain steps only */
    const int32_t draft_vocab = draft ? llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(draft))) : 0;
    const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(target)));
    const int sampled = temperature > 0.0f;
    int32_t drafted = k, live = 0, first = 0, status, lo = -1, hi = -1;
    for (int32_t b = 0; b < rows; b++) {
        if (!active[b]) continue;
        live++;
        if (lo < 0) lo = b;
        hi = b;
        first += draft_count[b];
        if (draft && k == 0 && draft_count[b] >= width) return TOO_MANY_TOKENS;
    }
    const int32_t n_ctx_seq = (int32_t)llama_n_ctx_seq(target);
    for (int32_t b = lo + 1; invariant && b < hi; b++) /* placeholders past a sequence's room: an ordinary pass instead */
        if (!active[b] && target_length[b] + k + 1 > n_ctx_seq) invariant = 0;
    if (invariant && lo == hi && target_length[lo] + 2 > n_ctx_seq) invariant = 0;
    const int32_t span = invariant && live ? hi - lo + 1 : live; /* rows in the target's pass, placeholders included */
    if (span * (k + 1) + 1 > a->capacity || (k > 0 && first > a->capacity)) return TOO_MANY_TOKENS;

    /* Draft: each row's pending tokens (logits at the last), then k - 1 single tokens. */
    for (int32_t i = 0; i < k; i++) {
        draft_batch->n_tokens = 0;
        for (int32_t b = 0; b < rows; b++) {
            if (!active[b]) continue;
            if (i == 0)
                for (int32_t j = 0; j < draft_count[b]; j++)
                    put(draft_batch, draft_pending[b * width + j], draft_length[b] + j, b, j == draft_count[b] - 1);
            else
                put(draft_batch, proposals[b * k + i - 1], draft_length[b] + draft_count[b] + i - 1, b, 1);
        }
        if ((status = decode(draft, draft_batch, &seconds[0])) != 0) return -1000 - status;
        int32_t confident = 0, index = -1; /* index: row b's place in the batch */
        for (int32_t b = 0; b < rows; b++) {
            if (!active[b]) continue;
            float top = 1.0f;
            index += i == 0 ? draft_count[b] : 1;
            const float *logits = llama_get_logits_ith(draft, index);
            if (sampled) {
                float *q = draft_probs + ((size_t)b * k + i) * draft_vocab;
                top = softmax(logits, draft_vocab, temperature, q);
                proposals[b * k + i] = draw(q, draft_vocab, uniform(rng + b));
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
    target_batch->n_tokens = 0;
    for (int32_t b = 0; b < rows; b++) {
        if (!active[b] && !(invariant && b > lo && b < hi)) continue;
        at_of[b] = target_batch->n_tokens;
        if (!active[b]) { /* a placeholder row: as many tokens, no logits, removed after the pass */
            for (int32_t i = 0; i <= drafted; i++) put(target_batch, 0, target_length[b] + i, b, 0);
            continue;
        }
        put(target_batch, target_pending[b], target_length[b], b, 1);
        for (int32_t i = 0; i < drafted; i++) put(target_batch, proposals[b * k + i], target_length[b] + 1 + i, b, 1);
    }
    if (invariant && target_batch->n_tokens == 1 && (invariant == 2 || target_length[lo] + 1 > SPLIT_KV_FROM))
        /* one token: a second, after it, removed by the rollback below */
        put(target_batch, target_pending[lo], target_length[lo] + 1, lo, 1);
    if ((status = decode(target, target_batch, &seconds[1])) != 0) return -1000 - status;

    /* The rule, then both caches back to the committed tokens. */
    llama_memory_t draft_memory = draft ? llama_get_memory(draft) : 0, target_memory = llama_get_memory(target);
    for (int32_t b = 0; b < rows; b++) {
        if (!active[b]) {
            if (invariant && b > lo && b < hi) llama_memory_seq_rm(target_memory, b, target_length[b], -1);
            continue;
        }
        const float *logits[drafted + 1]; /* the target's rows for [pending, x_1..x_drafted] */
        for (int32_t i = 0; i <= drafted; i++) logits[i] = llama_get_logits_ith(target, at_of[b] + i);
        const float *q = sampled ? draft_probs + (size_t)b * k * vocab : 0;
        const int32_t n = verispec_rule(logits, proposals + b * k, q, drafted, vocab,
                                        temperature, a->scratch, rng + b, 0, output + b * (k + 1), a->beta + b * k);
        const int32_t token = output[b * (k + 1) + n];
        num_accepted[b] = n;
        target_length[b] += 1 + n;
        target_pending[b] = token;
        llama_memory_seq_rm(target_memory, b, target_length[b], -1);
        if (!draft) continue; /* plain decoding: no draft to keep up to date */
        if (drafted == 0) { /* nothing read: the token waits with the others */
            draft_pending[b * width + draft_count[b]++] = token;
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
