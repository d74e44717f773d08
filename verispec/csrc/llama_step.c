/* One speculative iteration on two llama.cpp contexts, in one call from Python.
 *
 * The iteration of verispec's engine with a ModelDrafter (engine.py, rejection.py and
 * sampling.py are the reference; verispec/models/llamacpp_step.py loads this file):
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
 * with one generator per row: a row's numbers never depend on the other rows.
 *
 * invariant != 0 (verispec's exact kernels): the target's pass never holds a gap in its sequence
 * ids: an inactive row between two active ones gets placeholder tokens (removed after the pass),
 * so that llama.cpp runs the batch as one ubatch. A pass of one token gets a second placeholder
 * with logits after it: always with invariant == 2 (this file's one-token kernels differ), from
 * position SPLIT_KV_FROM on with invariant == 1 (flash attention's split of one query's cells).
 * A position's logits then come from the same kernels whatever the pass holds (llamacpp.py, `_Context.decode`, does the same).
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
#define SPLIT_KV_FROM 240   /* as llamacpp.py's _SPLIT_KV_FROM */

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

/* One draw in proportion to weights[n] (nonnegative, positive total): the first token whose
 * running sum (double) exceeds u * total; the last token of positive weight if rounding leaves
 * none. A token of weight 0 is never drawn. */
static int32_t draw(const float *weights, int32_t n, uint64_t *rng) {
    double total = 0.0, running = 0.0;
    for (int32_t i = 0; i < n; i++) total += weights[i];
    const double point = uniform(rng) * total;
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

/* The rule for one row at temperature > 0 (rejection.verify): writes the committed tokens to
 * output, beta_i = sum min(p_i, q_i) for each verified position; returns num_accepted.
 * logits(i) is the target's row for position i; q[i * n ..] the draft's distributions. */
static int32_t rule(struct llama_context *target, int32_t first, int32_t drafted, const int32_t *proposals,
                    const float *q, int32_t n, float temperature, float *p, float *residual, uint64_t *rng,
                    int32_t *output, double *beta) {
    for (int32_t i = 0; i < drafted; i++) {
        softmax(llama_get_logits_ith(target, first + i), n, temperature, p);
        const float *qi = q + (size_t)i * n;
        double overlap = 0.0;
        for (int32_t t = 0; t < n; t++) overlap += p[t] < qi[t] ? p[t] : qi[t];
        beta[i] = overlap;
        const int32_t x = proposals[i];
        if (uniform(rng) * qi[x] < (double)p[x]) { /* u < p/q, compared in double without dividing */
            output[i] = x;
            continue;
        }
        float mass = 0.0f;
        for (int32_t t = 0; t < n; t++) {
            residual[t] = p[t] > qi[t] ? p[t] - qi[t] : 0.0f;
            mass += residual[t];
        }
        output[i] = draw(mass > 0.0f ? residual : p, n, rng); /* the recovered token */
        return i;
    }
    softmax(llama_get_logits_ith(target, first + drafted), n, temperature, p);
    output[drafted] = draw(p, n, rng); /* the bonus token */
    return drafted;
}

/* Returns the number of proposals made (0..k; 0 when k == 0: a plain step), TOO_MANY_TOKENS,
 * or -1000 - llama_decode's status (the caches are then in an unknown state). draft (and
 * its batch and arrays) may be NULL: plain decoding, k == 0 only.
 *
 * Row b, when active: draft_pending[b * width ..] holds draft_count[b] tokens the draft has
 * not read, which it reads at draft_length[b]..; target_pending[b] is read by the target at
 * target_length[b]. On return output[b * (k + 1) ..] holds the committed tokens (num_accepted[b]
 * proposals, then the target's token), beta[b * k ..] (temperature > 0) the acceptance
 * probability of each verified position, and the lengths, pending tokens and counts describe
 * the caches after rollback. With k == 0 the draft reads nothing: the committed token joins
 * its pending tokens (width must leave room). At temperature > 0, draft_probs holds
 * rows * k * V floats and scratch 2 * V (V: the vocabulary, the same for both models).
 * seconds[0] and [1] grow by the time inside the draft's and the target's llama_decode. */
int32_t verispec_step(
    struct llama_context *draft, llama_batch *draft_batch, struct llama_context *target, llama_batch *target_batch,
    int32_t capacity, int32_t rows, const uint8_t *active, int32_t k, float p_min, float temperature, uint64_t *rng,
    float *draft_probs, float *scratch, double *beta,
    int32_t *draft_pending, int32_t width, int32_t *draft_count, int32_t *draft_length,
    int32_t *target_pending, int32_t *target_length,
    int32_t *proposals, /* [rows, k] */
    int32_t *output,    /* [rows, k + 1] */
    int32_t *num_accepted, double *seconds, int32_t invariant) {
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
    if (span * (k + 1) + 1 > capacity || (k > 0 && first > capacity)) return TOO_MANY_TOKENS;

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
                proposals[b * k + i] = draw(q, draft_vocab, rng + b);
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
        const int32_t at = at_of[b];
        int32_t n = 0;
        if (sampled) {
            n = rule(target, at, drafted, proposals + b * k, draft_probs + (size_t)b * k * vocab, vocab, temperature,
                     scratch, scratch + vocab, rng + b, output + b * (k + 1), beta + b * k);
        } else {
            for (;; n++) {
                output[b * (k + 1) + n] = argmax(llama_get_logits_ith(target, at + n), vocab, 0);
                if (n == drafted || output[b * (k + 1) + n] != proposals[b * k + n]) break;
            }
        }
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
