/* The sampling stage (see dfl_sampler.h). */
#include "dfl_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>


int dfl_sampler_n_params(void) {
    return DFL_SAMPLER_PARAMS;
}

#define DEFAULT_CANDIDATES 256
#define MIN_LIST_BUCKET 1024
/* CANDIDATES: the largest logits a row's mask is looked up at (a row whose mask allows
 * none of them is decided again over its whole row: rare unless the allowed set is a
 * small share of the vocabulary, and a row allowing at most CAND_KEEP_MAX tokens, or a
 * sixteenth of the vocabulary if less, takes the argmax of those instead) */
#define CAND_K 32
#define CAND_KEEP_MAX 4096
/* CANDIDATES in a ranked graph: the largest logits of the unmasked row a row's top_k
 * allowed are looked for among (at least CAND_WIDE_PER_K per top_k), and what they cost
 * per token of a row against the dense expansion's (the wider top-k's pass over the row:
 * a selection, no write). Few: ggml's CPU top-k keeps a heap of k (partial_sort) that
 * takes about k ln(V/k) insertions of log k scattered reads each: with 256 candidates a
 * sampled 16-row pass at 248K took 1.10x the unmasked one, with 64 1.03-1.04x
 * (results/sampling-cost-2026-11-25-0743.json, -0804.json), and 4 x top_k leave a row
 * whose mask allows most tokens room enough */
#define CAND_WIDE 64
#define CAND_WIDE_PER_K 4
#define COST_CAND_TOKEN 2

static int cand_keep_max(int n_vocab) {
    return n_vocab / 16 < CAND_KEEP_MAX ? n_vocab / 16 : CAND_KEEP_MAX;
}

DFL_API void dfl_sampling_default(dfl_sampling * s) {
    memset(s, 0, sizeof *s);
    s->top_p = 1.0f;
    s->repeat_penalty = 1.0f;
}

void dfl_sampler_init(dfl_sampler * smp) {
    memset(smp, 0, sizeof *smp);
    dfl_sampling_default(&smp->s);
}

void dfl_sampler_free(dfl_sampler * smp) {
    free(smp->u);
    free(smp->pen_tok);
    free(smp->pen_cnt);
    free(smp->host_params);
    free(smp->host_idx);
    free(smp->host_cnt);
    free(smp->mask);
    free(smp->mask_allowed);
    free(smp->host_mask);
    free(smp->host_ban);
    free(smp->host_row_bias);
    free(smp->host_halves);
    free(smp->host_keep_tok);
    free(smp->bias_tok);
    free(smp->bias_val);
    free(smp->host_bias_idx);
    free(smp->host_bias_add);
    free(smp->host_bias_ban);
    memset(smp, 0, sizeof *smp);
}

dfl_status dfl_sampler_set(dfl_sampler * smp, const dfl_sampling * s) {
    if (!s) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null sampling settings");
    }
    if (!isfinite(s->temperature)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "temperature must be a finite number, got %g", s->temperature);
    }
    if (s->top_k < 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "top_k must be >= 0, got %d", s->top_k);
    }
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "top_p must be in (0, 1], got %g", s->top_p);
    }
    if (!(s->min_p >= 0.0f && s->min_p < 1.0f)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "min_p must be in [0, 1), got %g", s->min_p);
    }
    if (!(s->repeat_penalty > 0.0f && isfinite(s->repeat_penalty))) {
        return dfl_fail(DFL_ERR_ARGUMENT, "repeat_penalty must be a positive number, got %g", s->repeat_penalty);
    }
    if (!isfinite(s->frequency_penalty) || !isfinite(s->presence_penalty)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "frequency and presence penalties must be finite numbers");
    }
    smp->s = *s;
    smp->n_u = 0;
    smp->pen_rows = 0;
    smp->mask_rows = 0;
    smp->n_bias = 0;
    return DFL_OK;
}

dfl_status dfl_sampler_set_bias(dfl_sampler * smp, const int32_t * tokens, const float * biases, int n, int n_vocab) {
    if (n < 0 || (n > 0 && (!tokens || !biases))) {
        return dfl_fail(DFL_ERR_ARGUMENT, "logit bias: need a token and a bias for each of %d entries", n);
    }
    if (n > n_vocab) {
        return dfl_fail(DFL_ERR_ARGUMENT, "logit bias: %d entries for a %d-token vocabulary", n, n_vocab);
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "logit bias: token %d is outside the vocabulary (0..%d)", tokens[i],
                            n_vocab - 1);
        }
        if (isnan(biases[i]) || biases[i] == INFINITY) {
            return dfl_fail(DFL_ERR_ARGUMENT, "logit bias: token %d's bias %g is neither finite nor -inf", tokens[i],
                            biases[i]);
        }
        for (int j = 0; j < i; j++) { /* a row's entries are written back at once: a token twice would race */
            if (tokens[j] == tokens[i]) {
                return dfl_fail(DFL_ERR_ARGUMENT, "logit bias: token %d appears twice", tokens[i]);
            }
        }
    }
    if (!dfl_reserve((void **) &smp->bias_tok, &smp->cap_bias_tok, n, sizeof(int32_t)) ||
        !dfl_reserve((void **) &smp->bias_val, &smp->cap_bias_val, n, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    if (n > 0) {
        memcpy(smp->bias_tok, tokens, (size_t) n * sizeof(int32_t));
        memcpy(smp->bias_val, biases, (size_t) n * sizeof(float));
    }
    smp->n_bias = n;
    return DFL_OK;
}

/* A logit bias of n entries padded to a power of two from 8 (0 stays 0), so that a few
 * graphs serve every request's bias. */
static int bias_bucket(int n) {
    int b = 8;
    while (n > 0 && b < n) {
        b *= 2;
    }
    return n > 0 ? b : 0;
}

bool dfl_reserve(void ** buf, int * cap, int n, size_t size) {
    if (n <= *cap) {
        return true;
    }
    void * grown = realloc(*buf, (size_t) n * size);
    if (!grown) {
        return false;
    }
    *buf = grown;
    *cap = n;
    return true;
}

dfl_status dfl_sampler_stage_uniforms(dfl_sampler * smp, const float * u, int n) {
    if (!u || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "uniforms: need at least one");
    }
    for (int i = 0; i < n; i++) {
        if (!(u[i] >= 0.0f && u[i] < 1.0f)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "uniform %d is %g, outside [0, 1)", i, u[i]);
        }
    }
    if (!dfl_reserve((void **) &smp->u, &smp->cap_u, n, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    memcpy(smp->u, u, (size_t) n * sizeof(float));
    smp->n_u = n;
    return DFL_OK;
}

static int cmp_i32(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

dfl_status dfl_sampler_stage_penalties(dfl_sampler * smp, const int32_t * tokens, const float * counts, int n_rows,
                                       int per_row, int n_vocab) {
    if (!tokens || !counts || n_rows <= 0 || per_row <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "penalties: need tokens and counts for at least one row and entry");
    }
    if ((int64_t) n_rows * per_row > (int64_t) 1 << 26) {
        return dfl_fail(DFL_ERR_CAPACITY, "penalties: %d rows x %d entries is too many", n_rows, per_row);
    }
    const int n = n_rows * per_row;
    if (!dfl_reserve((void **) &smp->pen_tok, &smp->cap_pen_tok, n, sizeof(int32_t)) ||
        !dfl_reserve((void **) &smp->pen_cnt, &smp->cap_pen_cnt, n, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "penalties: token %d is outside the vocabulary (0..%d)", tokens[i],
                            n_vocab - 1);
        }
        if (!(counts[i] >= 0.0f && isfinite(counts[i]))) {
            return dfl_fail(DFL_ERR_ARGUMENT, "penalties: count %g is not a count", counts[i]);
        }
    }
    /* a row's entries are written back to its logits at once: a token twice would race */
    memcpy(smp->pen_tok, tokens, (size_t) n * sizeof(int32_t));
    for (int r = 0; r < n_rows; r++) {
        int32_t * row = smp->pen_tok + (size_t) r * per_row;
        qsort(row, (size_t) per_row, sizeof(int32_t), cmp_i32);
        for (int j = 1; j < per_row; j++) {
            if (row[j] == row[j - 1]) {
                return dfl_fail(DFL_ERR_ARGUMENT, "penalties: token %d appears twice in row %d", row[j], r);
            }
        }
    }
    memcpy(smp->pen_tok, tokens, (size_t) n * sizeof(int32_t));
    memcpy(smp->pen_cnt, counts, (size_t) n * sizeof(float));
    smp->pen_rows = n_rows;
    smp->pen_per_row = per_row;
    return DFL_OK;
}

static int popcount(uint32_t x) {
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    return (int) ((((x + (x >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24);
}

dfl_status dfl_sampler_stage_masks(dfl_sampler * smp, const uint32_t * words, int n_rows, int n_words, int n_vocab) {
    const int want = dfl_mask_words(n_vocab);
    if (!words || n_rows <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "masks: need words for at least one row");
    }
    if (n_words != want) {
        return dfl_fail(DFL_ERR_ARGUMENT, "masks: a row of a %d-token vocabulary is %d words, not %d", n_vocab, want,
                        n_words);
    }
    if ((int64_t) n_rows * n_words > (int64_t) 1 << 26) {
        return dfl_fail(DFL_ERR_CAPACITY, "masks: %d rows is too many", n_rows);
    }
    if (!dfl_reserve((void **) &smp->mask, &smp->cap_mask, n_rows * n_words, sizeof(uint32_t)) ||
        !dfl_reserve((void **) &smp->mask_allowed, &smp->cap_mask_allowed, n_rows, sizeof(int32_t))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int r = 0; r < n_rows; r++) {
        const uint32_t * row = words + (size_t) r * n_words;
        int allowed = 0;
        for (int w = 0; w < n_words; w++) {
            allowed += popcount(row[w] & vocab_bits(w, n_words, n_vocab));
        }
        if (!allowed) {
            return dfl_fail(DFL_ERR_ARGUMENT, "masks: row %d allows no token", r);
        }
        smp->mask_allowed[r] = allowed;
    }
    memcpy(smp->mask, words, (size_t) n_rows * n_words * sizeof(uint32_t));
    smp->mask_rows = n_rows;
    smp->mask_gen++;
    return DFL_OK;
}

dfl_status dfl_sampler_key_for(const dfl_sampler * smp, int n_rows, int n_vocab, dfl_sampler_key * key) {
    const dfl_sampling * s = &smp->s;
    memset(key, 0, sizeof *key);
    key->n_bias = bias_bucket(smp->n_bias);
    key->raw = s->raw_logits != 0;
    if (smp->pen_rows > 0) {
        if (smp->pen_rows != n_rows) {
            return dfl_fail(DFL_ERR_STATE, "penalties were staged for %d rows, the call computes %d", smp->pen_rows,
                            n_rows);
        }
        key->n_penalty = smp->pen_per_row;
    }
    if (smp->mask_rows > 0) {
        if (smp->mask_rows != n_rows) {
            return dfl_fail(DFL_ERR_STATE, "masks were staged for %d rows, the call computes %d", smp->mask_rows,
                            n_rows);
        }
        key->masked = DFL_MASK_SPARSE;
        for (int r = 0; r < n_rows; r++) {
            const int allowed = smp->mask_allowed[r];
            if (row_keeps(allowed, n_vocab)) {
                key->n_keep += allowed;
                key->keep_rows = 1;
            } else {
                key->n_ban += n_vocab - allowed;
            }
            if (allowed <= cand_keep_max(n_vocab) && allowed > key->keep_width) {
                key->keep_width = allowed;
            }
        }
    }
    if (s->temperature <= 0.0f) {
        key->pick = DFL_PICK_ARGMAX;
        return DFL_OK;
    }
    if (smp->n_u < n_rows) {
        return dfl_fail(DFL_ERR_STATE, "sampling needs a uniform for each of the %d rows of this call (%d staged)",
                        n_rows, smp->n_u);
    }
    if (s->top_k == 0 && s->top_p >= 1.0f && s->min_p <= 0.0f) {
        key->pick = DFL_PICK_FULL;
        return DFL_OK;
    }
    key->pick = DFL_PICK_RANKED;
    const int want = s->top_k > 0 ? s->top_k : (s->n_candidates > 0 ? s->n_candidates : DEFAULT_CANDIDATES);
    key->n_cand = want < n_vocab ? want : n_vocab;
    key->capped = s->top_k == 0 && key->n_cand < n_vocab;
    return DFL_OK;
}

void dfl_sampler_key_merge(dfl_sampler_key * acc, const dfl_sampler_key * k) {
    const int n_penalty = acc->n_penalty > k->n_penalty ? acc->n_penalty : k->n_penalty;
    const int n_bias = acc->n_bias > k->n_bias ? acc->n_bias : k->n_bias;
    const int masked = acc->masked > k->masked ? acc->masked : k->masked;
    const int n_keep = acc->n_keep + k->n_keep, n_ban = acc->n_ban + k->n_ban;
    const int keep_rows = acc->keep_rows || k->keep_rows;
    const int keep_width = acc->keep_width > k->keep_width ? acc->keep_width : k->keep_width;
    const int raw = acc->raw || k->raw;
    const bool same = acc->pick == k->pick && acc->n_cand == k->n_cand && acc->capped == k->capped &&
                      acc->full == k->full && acc->ranked == k->ranked;
    if (!same) {
        dfl_sampler_key m = { DFL_PICK_MIXED, 0, 0, 0, 0, 0, 0 };
        const dfl_sampler_key * both[2] = { acc, k };
        for (int i = 0; i < 2; i++) {
            const dfl_sampler_key * x = both[i];
            m.full = m.full || x->pick == DFL_PICK_FULL || x->full;
            if (x->pick == DFL_PICK_RANKED || x->ranked) {
                m.ranked = 1;
                m.n_cand = x->n_cand > m.n_cand ? x->n_cand : m.n_cand;
                m.capped = m.capped || x->capped;
            }
        }
        *acc = m;
    }
    acc->n_penalty = n_penalty;
    acc->n_bias = n_bias;
    acc->masked = masked;
    acc->n_keep = n_keep;
    acc->n_ban = n_ban;
    acc->keep_rows = keep_rows;
    acc->keep_width = keep_width;
    acc->raw = raw;
}

/* A list of n entries padded to the power of four (from MIN_LIST_BUCKET) at or above it
 * (0 stays 0): coarse, so that the few graphs a grammar's steps need stay in the slots
 * (a JSON schema's chain steps: 3), padding costing less than a rebuild. */
static int list_bucket(int n) {
    int64_t b = MIN_LIST_BUCKET;
    while (n > 0 && b < n) {
        b *= 4;
    }
    return n > 0 ? (int) b : 0;
}

/* CANDIDATES: the width of the rows' allowed lists, a power of 16 from 16 (at most
 * cand_keep_max), never 0, so that an argmax graph under masks takes few shapes. */
static int keep_bucket(int n, int n_vocab) {
    int b = 16;
    while (b < n) {
        b *= 16;
    }
    const int most = cand_keep_max(n_vocab) > 16 ? cand_keep_max(n_vocab) : 16;
    return b < most ? b : most;
}

void dfl_sampler_key_settle(dfl_sampler_key * key, int n_rows, int n_vocab, bool candidates) {
    const int keep_width = key->keep_width;
    key->keep_width = 0; /* the buckets below are the key's: steps of other exact counts share its graph */
    if (key->masked == DFL_MASK_NONE) {
        return;
    }
    if (key->n_keep == 0 && key->n_ban == 0) {
        key->masked = DFL_MASK_NONE; /* every row allows every token */
        return;
    }
    if (candidates && key->pick == DFL_PICK_ARGMAX) {
        key->masked = DFL_MASK_CANDIDATES;
        key->n_cand = CAND_K < n_vocab ? CAND_K : n_vocab;
        key->n_keep = keep_bucket(keep_width, n_vocab) < n_vocab ? keep_bucket(keep_width, n_vocab) : n_vocab;
        key->n_ban = key->keep_rows = 0;
        return;
    }
    const int64_t tokens = (int64_t) n_rows * n_vocab;
    const int n_keep = list_bucket(key->n_keep), n_ban = list_bucket(key->n_ban);
    const int64_t sparse = (int64_t) key->n_keep * COST_KEEP_ENTRY + (int64_t) key->n_ban * COST_BAN_ENTRY +
                           (int64_t) (n_keep - key->n_keep + n_ban - key->n_ban) * COST_PAD_ENTRY +
                           (key->keep_rows ? tokens * COST_KEEP_ROWS_TOKEN : 0);
    /* a ranked graph by candidates: only rows of its own top_k, no row allowing so few
     * tokens that its top_k allowed would rarely be among the candidates */
    const int64_t wide = key->n_cand * CAND_WIDE_PER_K > CAND_WIDE ? (int64_t) key->n_cand * CAND_WIDE_PER_K : CAND_WIDE;
    const int64_t by_list = sparse < tokens * COST_DENSE_TOKEN ? sparse : tokens * COST_DENSE_TOKEN;
    if (candidates && key->pick == DFL_PICK_RANKED && !key->capped && keep_width == 0 && wide < n_vocab &&
        tokens * COST_CAND_TOKEN < by_list) {
        key->masked = DFL_MASK_CANDIDATES;
        key->n_wide = (int) wide;
        key->n_keep = key->n_ban = key->keep_rows = 0;
        return;
    }
    if (sparse > tokens * COST_DENSE_TOKEN) {
        key->masked = DFL_MASK_DENSE;
        key->n_keep = key->n_ban = key->keep_rows = 0;
    } else {
        key->n_keep = n_keep;
        key->n_ban = n_ban;
    }
}
