/* The sampling stage (see dfl_sampler.h). */
#include "dfl_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A stage's per-row settings, an input [n, DFL_SAMPLER_PARAMS] (one column of n per
 * setting): the row's uniform, 1 / temperature, top_p, log(min_p), and the penalties as
 * the logit arithmetic uses them (repeat - 1, 1 / repeat - repeat, frequency, presence);
 * in a stage whose rows pick differently (DFL_PICK_MIXED), the row's pick, its candidate
 * count and whether it is capped (see dfl_sampler_key). */
enum { DFL_SP_U, DFL_SP_INV_TEMP, DFL_SP_TOP_P, DFL_SP_LOG_MIN_P, DFL_SP_REP_M1, DFL_SP_REP_FLIP, DFL_SP_FREQ,
       DFL_SP_PRESENT, DFL_SP_PICK, DFL_SP_TOP_K, DFL_SP_CAPPED, DFL_SAMPLER_PARAMS };

int dfl_sampler_n_params(void) {
    return DFL_SAMPLER_PARAMS;
}

#define DEFAULT_CANDIDATES 256
/* The relative costs (bytes moved, roughly) that choose how masks are applied: a
 * disallowed entry set to -inf (a scattered write), an allowed entry kept (a gather and a
 * scattered write), a pad entry (uploaded, then the same value written again where the
 * last was: in cache), per token of every row the -inf start of keeping rows (a read and
 * a write of the logits) and the dense expansion (its byte index, the bias written, then
 * read with the logits and the sum written). A list entry costs more than its bytes: the
 * gather and the scattered write handle each as a row of its own (CPU, a 16-row chain
 * pass at a 248K vocabulary: about 8 ns an entry, pads included, 1M of them, against
 * about 1 ns a token for the dense path: results/sampling-cost-2026-11-25-0219.json
 * against -2026-11-24-2250.json), so the lists' weights are about 9 times the dense
 * token's (they were 4 and 8 times, and the dense worst case took the lists). */
#define COST_BAN_ENTRY 150
#define COST_KEEP_ENTRY 300
#define COST_PAD_ENTRY 8
#define COST_KEEP_ROWS_TOKEN 8
#define COST_DENSE_TOKEN 17
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
    return DFL_OK;
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

/* The bits of word w of an n_words-word bitmask that stand for tokens of the vocabulary
 * (the last word's tail past n_vocab is not). */
static uint32_t vocab_bits(int w, int n_words, int n_vocab) {
    return w == n_words - 1 && n_vocab % 32 ? ~(~0u << (n_vocab % 32)) : ~0u;
}

/* Whether a row allowing `allowed` of n_vocab tokens keeps its allowed list (cheaper than
 * banning the rest) rather than bans its disallowed one. */
static bool row_keeps(int allowed, int n_vocab) {
    return (int64_t) allowed * COST_KEEP_ENTRY < (int64_t) (n_vocab - allowed) * COST_BAN_ENTRY;
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
    const int masked = acc->masked > k->masked ? acc->masked : k->masked;
    const int n_keep = acc->n_keep + k->n_keep, n_ban = acc->n_ban + k->n_ban;
    const int keep_rows = acc->keep_rows || k->keep_rows;
    const int keep_width = acc->keep_width > k->keep_width ? acc->keep_width : k->keep_width;
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
    acc->masked = masked;
    acc->n_keep = n_keep;
    acc->n_ban = n_ban;
    acc->keep_rows = keep_rows;
    acc->keep_width = keep_width;
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

/* ---- the graph ------------------------------------------------------------------------- */

/* Setting `which` of every row, [1, n] (contiguous: the input holds one column per setting). */
static struct ggml_tensor * setting(struct ggml_context * ctx, struct ggml_tensor * params, int which) {
    const int64_t n = params->ne[0];
    return ggml_view_2d(ctx, params, 1, n, sizeof(float), (size_t) which * n * sizeof(float));
}

/* Column `col` of x [K, n] as [1, n]. */
static struct ggml_tensor * column(struct ggml_context * ctx, struct ggml_tensor * x, int64_t col) {
    return ggml_view_2d(ctx, x, 1, x->ne[1], x->nb[1], (size_t) col * x->nb[0]);
}

/* Logits of the tokens each row has seen, changed as llama.cpp's penalties change them:
 * divided by repeat when positive, multiplied when not, less count x frequency and, once
 * seen, presence; written back in place. Pad entries (count 0) are left as they are. */
static struct ggml_tensor * penalize(struct ggml_context * ctx, struct ggml_tensor * logits, int64_t M,
                                     dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1];
    out->pen_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, M * n);
    out->pen_cnt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, M, n);
    ggml_set_input(out->pen_idx);
    ggml_set_input(out->pen_cnt);
    struct ggml_tensor * flat = ggml_reshape_2d(ctx, logits, 1, V * n);
    struct ggml_tensor * seen = ggml_reshape_2d(ctx, ggml_get_rows(ctx, flat, out->pen_idx), M, n);
    struct ggml_tensor * active = ggml_step(ctx, out->pen_cnt);
    /* the repeat factor less one: repeat - 1 for logits <= 0, 1 / repeat - 1 above */
    struct ggml_tensor * factor = ggml_add(ctx, ggml_mul(ctx, ggml_step(ctx, seen), setting(ctx, out->params, DFL_SP_REP_FLIP)),
                                           setting(ctx, out->params, DFL_SP_REP_M1));
    struct ggml_tensor * x = ggml_add(ctx, seen, ggml_mul(ctx, ggml_mul(ctx, seen, factor), active));
    struct ggml_tensor * less = ggml_add(ctx, ggml_mul(ctx, out->pen_cnt, setting(ctx, out->params, DFL_SP_FREQ)),
                                         ggml_mul(ctx, active, setting(ctx, out->params, DFL_SP_PRESENT)));
    x = ggml_sub(ctx, x, less);
    flat = ggml_set_rows(ctx, flat, ggml_reshape_2d(ctx, x, 1, M * n), out->pen_idx);
    return ggml_reshape_2d(ctx, flat, V, n);
}

/* Dense: the mask arrives as its bytes, each an index into a table of the 256 bytes'
 * biases (8 columns: 0 for a set bit, -inf for a clear one): one lookup gives the bias of
 * every token, and one add applies it. */
static struct ggml_tensor * apply_dense_mask(struct ggml_context * ctx, struct ggml_tensor * logits,
                                             dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1], bytes = 4 * dfl_mask_words((int) V);
    out->mask = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, bytes * n);
    out->byte_bias = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 8, 256);
    ggml_set_input(out->mask);
    ggml_set_input(out->byte_bias);
    struct ggml_tensor * bias = ggml_reshape_2d(ctx, ggml_get_rows(ctx, out->byte_bias, out->mask), 8 * bytes, n);
    bias = ggml_view_2d(ctx, bias, V, n, bias->nb[1], 0);
    return ggml_add_inplace(ctx, logits, bias);
}

/* -inf as [1], computed from x's first value (so that it follows x in the graph): a step
 * is 0 or 1 whatever x is, times 0 is 0. */
static struct ggml_tensor * neg_inf_after(struct ggml_context * ctx, struct ggml_tensor * x) {
    return ggml_scale_bias(ctx, ggml_step(ctx, ggml_view_1d(ctx, x, 1, 0)), 0.0f, -INFINITY);
}

/* The largest divisor of v at most 1024: the width the keeping rows' -inf is broadcast at
 * (a whole vector per add rather than one value). */
static int64_t broadcast_width(int64_t v) {
    int64_t c = v < 1024 ? v : 1024;
    while (v % c) {
        c--;
    }
    return c;
}

/* Sparse: the rows' exception lists, padded with repeats of an entry (which write the
 * same value again). Keeping rows: their allowed logits gathered, then the row's bias
 * (-inf for a keeping row, 0 for the others, made to follow the gather) added to every
 * logit, then the gathered logits written back; the other rows: -inf written at their
 * disallowed entries. */
static struct ggml_tensor * apply_sparse_mask(struct ggml_context * ctx, struct ggml_tensor * logits,
                                              const dfl_sampler_key * key, dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1];
    struct ggml_tensor * flat = ggml_reshape_2d(ctx, logits, 1, V * n);
    if (key->n_keep > 0) {
        const int64_t C = broadcast_width(V);
        out->keep_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, key->n_keep);
        out->row_bias = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, 1, n);
        ggml_set_input(out->keep_idx);
        ggml_set_input(out->row_bias);
        struct ggml_tensor * kept = ggml_get_rows(ctx, flat, out->keep_idx); /* [1, n_keep] */
        struct ggml_tensor * zero = ggml_scale(ctx, ggml_step(ctx, ggml_view_1d(ctx, kept, 1, 0)), 0.0f);
        struct ggml_tensor * bias = ggml_repeat_4d(ctx, ggml_add(ctx, out->row_bias, zero), C, 1, n, 1);
        struct ggml_tensor * x = ggml_add_inplace(ctx, ggml_reshape_3d(ctx, logits, C, V / C, n), bias);
        flat = ggml_set_rows(ctx, ggml_reshape_2d(ctx, x, 1, V * n), kept, out->keep_idx);
    }
    if (key->n_ban > 0) {
        out->ban_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, key->n_ban);
        ggml_set_input(out->ban_idx);
        struct ggml_tensor * ninf = ggml_repeat_4d(ctx, neg_inf_after(ctx, flat), 1, key->n_ban, 1, 1);
        flat = ggml_set_rows(ctx, flat, ninf, out->ban_idx);
    }
    return ggml_reshape_2d(ctx, flat, V, n);
}

/* Logits with the tokens each row's bitmask leaves out at -inf, in place (so that the
 * logits read back are those the row chose from). */
static struct ggml_tensor * apply_mask(struct ggml_context * ctx, struct ggml_tensor * logits,
                                       const dfl_sampler_key * key, dfl_sampler_graph * out) {
    return key->masked == DFL_MASK_DENSE ? apply_dense_mask(ctx, logits, out)
                                         : apply_sparse_mask(ctx, logits, key, out);
}

/* Whether each row's mask allows each of its candidates top [K, n] (i32 tokens of a
 * vocabulary of V), [K, n] f32 1 or 0: the bit looked up in the 16-bit half holding it
 * (an input, as the halves' scales), scaled so that the bit is the lowest of its integer
 * part (all exact in f32). */
static struct ggml_tensor * candidates_allowed(struct ggml_context * ctx, struct ggml_tensor * top, int64_t V,
                                               dfl_sampler_graph * out) {
    const int64_t K = top->ne[0], n = top->ne[1], H = 2 * dfl_mask_words((int) V);
    out->halves = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, H * n);
    out->bit_scale = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
    ggml_set_input(out->halves);
    ggml_set_input(out->bit_scale);
    struct ggml_tensor * tok = ggml_cast(ctx, top, GGML_TYPE_F32);
    struct ggml_tensor * half = ggml_floor(ctx, ggml_scale(ctx, tok, 1.0f / 16.0f));
    struct ggml_tensor * bit = ggml_cast(ctx, ggml_sub(ctx, tok, ggml_scale(ctx, half, 16.0f)), GGML_TYPE_I32);
    /* the half's index among all rows' halves: the row's first (row x H) added */
    struct ggml_tensor * row0 = ggml_reshape_2d(ctx, ggml_arange(ctx, 0.0f, (float) (n * H), (float) H), 1, n);
    struct ggml_tensor * at = ggml_cast(ctx, ggml_add(ctx, half, row0), GGML_TYPE_I32);
    struct ggml_tensor * h = ggml_get_rows(ctx, ggml_reshape_2d(ctx, out->halves, 1, H * n),
                                           ggml_reshape_1d(ctx, at, K * n));
    struct ggml_tensor * scale = ggml_get_rows(ctx, ggml_reshape_2d(ctx, out->bit_scale, 1, 16),
                                               ggml_reshape_1d(ctx, bit, K * n));
    struct ggml_tensor * shifted = ggml_floor(ctx, ggml_mul(ctx, ggml_reshape_2d(ctx, h, K, n),
                                                            ggml_reshape_2d(ctx, scale, K, n)));
    struct ggml_tensor * above = ggml_scale(ctx, ggml_floor(ctx, ggml_scale(ctx, shifted, 0.5f)), 2.0f);
    return ggml_sub(ctx, shifted, above); /* the bit: 1 allowed, 0 not */
}

/* CANDIDATES: each row's argmax under its mask with the logits left as they are. The
 * K largest logits of every row, each candidate's bit looked up in its row's mask
 * (candidates_allowed), -inf added where it is clear, the argmax of what is left; -1 for a row
 * none of whose candidates is allowed. A keeping row (few allowed tokens) takes the
 * argmax of its allowed logits, gathered, instead. Token ids and indices are below 2^24,
 * exact in f32, where rows are selected by arithmetic. */
static struct ggml_tensor * pick_by_candidates(struct ggml_context * ctx, struct ggml_tensor * logits,
                                               const dfl_sampler_key * key, dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1], K = key->n_cand;
    struct ggml_tensor * top = dfl_top_k(key->by_sort, ctx, logits, (int) K); /* [K, n], in no particular order */
    struct ggml_tensor * vals = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, n), top);
    vals = ggml_reshape_2d(ctx, vals, K, n);
    struct ggml_tensor * tok = ggml_cast(ctx, top, GGML_TYPE_F32);
    struct ggml_tensor * allowed = candidates_allowed(ctx, top, V, out);
    struct ggml_tensor * best = ggml_argmax(ctx, ggml_add(ctx, vals, ggml_log(ctx, allowed))); /* [n] */
    struct ggml_tensor * c = ggml_get_rows(ctx, ggml_reshape_3d(ctx, tok, 1, K, n), ggml_reshape_2d(ctx, best, 1, n));
    c = ggml_reshape_2d(ctx, c, 1, n);
    /* -1 where no candidate is allowed */
    struct ggml_tensor * none = ggml_step(ctx, ggml_scale_bias(ctx, ggml_sum_rows(ctx, allowed), -1.0f, 0.5f));
    c = ggml_sub(ctx, c, ggml_mul(ctx, none, ggml_scale_bias(ctx, c, 1.0f, 1.0f)));
    if (key->n_keep > 0) {
        const int64_t L = key->n_keep;
        out->keep_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, L * n);
        out->keep_tok = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, L, n);
        out->keeps = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n);
        ggml_set_input(out->keep_idx);
        ggml_set_input(out->keep_tok);
        ggml_set_input(out->keeps);
        struct ggml_tensor * kept = ggml_get_rows(ctx, ggml_reshape_2d(ctx, logits, 1, V * n), out->keep_idx);
        struct ggml_tensor * j = ggml_argmax(ctx, ggml_reshape_2d(ctx, kept, L, n));
        struct ggml_tensor * kc = ggml_get_rows(ctx, ggml_reshape_3d(ctx, out->keep_tok, 1, L, n),
                                                ggml_reshape_2d(ctx, j, 1, n));
        c = ggml_add(ctx, c, ggml_mul(ctx, out->keeps, ggml_sub(ctx, ggml_reshape_2d(ctx, kc, 1, n), c)));
    }
    return ggml_reshape_1d(ctx, ggml_cast(ctx, c, GGML_TYPE_I32), n);
}

/* The inverse-CDF draw over cumulative weights cw [K, n]: per row, how many of them lie at
 * or below u x their total, i.e. the index of the first that exceeds it, as [1, n] f32. */
static struct ggml_tensor * draw(struct ggml_context * ctx, struct ggml_tensor * cw, struct ggml_tensor * u) {
    const int64_t K = cw->ne[0];
    struct ggml_tensor * x = ggml_mul(ctx, column(ctx, cw, K - 1), u);
    struct ggml_tensor * above = ggml_step(ctx, ggml_sub(ctx, cw, x));
    return ggml_scale_bias(ctx, ggml_sum_rows(ctx, above), -1.0f, (float) K);
}

/* No truncation: a draw over the whole vocabulary at the row's temperature; the index is
 * the token. */
static struct ggml_tensor * pick_full(struct ggml_context * ctx, struct ggml_tensor * logits, dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1];
    struct ggml_tensor * p = ggml_soft_max(ctx, ggml_mul(ctx, logits, setting(ctx, out->params, DFL_SP_INV_TEMP)));
    struct ggml_tensor * idx = ggml_clamp(ctx, draw(ctx, ggml_cumsum(ctx, p), setting(ctx, out->params, DFL_SP_U)), 0.0f,
                                          (float) (V - 1));
    return ggml_reshape_1d(ctx, ggml_cast(ctx, idx, GGML_TYPE_I32), n);
}

/* The K largest of each row of x [C, n], largest first: their values *sv [K, n] and ids
 * *si [K, n] i32, the id of x's entry j being ids[j] (ids [C, n] i32), or j without ids. */
static void rank_top(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * ids, int64_t K,
                     bool by_sort, struct ggml_tensor ** sv, struct ggml_tensor ** si) {
    const int64_t C = x->ne[0], n = x->ne[1];
    struct ggml_tensor * at; /* [K, n] i32: where in x's row */
    if (K < C) {
        struct ggml_tensor * top = dfl_top_k(by_sort, ctx, x, (int) K); /* [K, n], in no particular order */
        struct ggml_tensor * vals = ggml_get_rows(ctx, ggml_reshape_3d(ctx, x, 1, C, n), top);
        struct ggml_tensor * order = ggml_argsort(ctx, ggml_reshape_2d(ctx, vals, K, n), GGML_SORT_ORDER_DESC);
        *sv = ggml_reshape_2d(ctx, ggml_get_rows(ctx, vals, order), K, n);
        at = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, top, 1, K, n), order), K, n);
    } else {
        at = ggml_argsort(ctx, x, GGML_SORT_ORDER_DESC);
        *sv = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, x, 1, C, n), at), K, n);
    }
    *si = ids ? ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, ids, 1, C, n), at), K, n) : at;
}

/* The ranked draw over each row's K most likely, sv [K, n] (values, largest first) and si
 * (their tokens): see pick_ranked. */
static struct ggml_tensor * draw_ranked(struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * sv,
                                        struct ggml_tensor * si, const dfl_sampler_key * key, dfl_sampler_graph * out) {
    const int64_t n = logits->ne[1], K = key->n_cand;
    const bool mixed = key->pick == DFL_PICK_MIXED;
    struct ggml_tensor * l0 = column(ctx, sv, 0);
    struct ggml_tensor * z = ggml_sub(ctx, sv, l0); /* <= 0, the most likely's 0 */
    struct ggml_tensor * e = ggml_exp(ctx, z);
    struct ggml_tensor * capped = mixed ? setting(ctx, out->params, DFL_SP_CAPPED) : NULL;
    struct ggml_tensor * keep_k = NULL;
    if (mixed) {
        /* a row ranking fewer than K keeps its own first top_k */
        struct ggml_tensor * idx = ggml_arange(ctx, 0.0f, (float) K, 1.0f);
        struct ggml_tensor * room = ggml_sub(ctx, ggml_repeat(ctx, setting(ctx, out->params, DFL_SP_TOP_K), sv), idx);
        keep_k = ggml_step(ctx, ggml_scale_bias(ctx, room, 1.0f, -0.5f));
        e = ggml_mul(ctx, e, keep_k);
    }
    struct ggml_tensor * mass;
    if (mixed && key->capped) { /* capped rows against the vocabulary, the others their candidates */
        struct ggml_tensor * whole = ggml_sum_rows(ctx, ggml_exp(ctx, ggml_sub(ctx, logits, l0)));
        struct ggml_tensor * own = ggml_sum_rows(ctx, e);
        mass = ggml_add(ctx, ggml_mul(ctx, whole, capped), ggml_sub(ctx, own, ggml_mul(ctx, own, capped)));
    } else {
        mass = key->capped ? ggml_sum_rows(ctx, ggml_exp(ctx, ggml_sub(ctx, logits, l0))) : ggml_sum_rows(ctx, e);
    }
    struct ggml_tensor * p = ggml_div(ctx, e, mass);
    struct ggml_tensor * cum = ggml_cumsum(ctx, p);
    /* top-p keeps a candidate while the mass before it is below top_p; min-p while its
     * log-probability ratio to the most likely is above log(min_p) */
    struct ggml_tensor * top_p = setting(ctx, out->params, DFL_SP_TOP_P);
    struct ggml_tensor * keep_p = ggml_step(ctx, ggml_neg(ctx, ggml_sub(ctx, ggml_sub(ctx, cum, p), top_p)));
    struct ggml_tensor * keep_m = ggml_step(ctx, ggml_sub(ctx, z, setting(ctx, out->params, DFL_SP_LOG_MIN_P)));
    struct ggml_tensor * keep = ggml_mul(ctx, keep_p, keep_m);
    if (keep_k) {
        keep = ggml_mul(ctx, keep, keep_k); /* what the row's top_k left out stays out */
    }
    struct ggml_tensor * w = ggml_mul(ctx, ggml_exp(ctx, ggml_mul(ctx, z, setting(ctx, out->params, DFL_SP_INV_TEMP))),
                                      keep);
    struct ggml_tensor * cw = ggml_cumsum(ctx, w);
    /* rounding can put u x total at the total: take the last kept candidate then */
    struct ggml_tensor * idx = draw(ctx, cw, setting(ctx, out->params, DFL_SP_U));
    struct ggml_tensor * last = ggml_scale_bias(ctx, ggml_sum_rows(ctx, keep), 1.0f, -1.0f);
    idx = ggml_sub(ctx, idx, ggml_relu(ctx, ggml_sub(ctx, idx, last)));
    struct ggml_tensor * choice = ggml_get_rows(ctx, ggml_reshape_3d(ctx, si, 1, K, n),
                                                ggml_reshape_2d(ctx, ggml_cast(ctx, idx, GGML_TYPE_I32), 1, n));
    choice = ggml_reshape_1d(ctx, choice, n);
    if (key->capped) {
        /* the kept set may reach past the K when the top-p cut lies beyond them (their
         * mass is below top_p) and min-p does not cut before (the K-th still passes it) */
        struct ggml_tensor * beyond = ggml_mul(ctx, ggml_step(ctx, ggml_neg(ctx, ggml_sub(ctx, column(ctx, cum, K - 1), top_p))),
                                               column(ctx, keep_m, K - 1));
        if (capped) {
            beyond = ggml_mul(ctx, beyond, capped);
        }
        struct ggml_tensor * c = ggml_reshape_2d(ctx, ggml_cast(ctx, choice, GGML_TYPE_F32), 1, n);
        c = ggml_sub(ctx, c, ggml_mul(ctx, beyond, ggml_scale_bias(ctx, c, 1.0f, 1.0f))); /* -1 there */
        choice = ggml_reshape_1d(ctx, ggml_cast(ctx, c, GGML_TYPE_I32), n);
    }
    out->cand = si;
    out->cand_p = ggml_div(ctx, w, column(ctx, cw, K - 1));
    ggml_set_output(out->cand);
    ggml_set_output(out->cand_p);
    return choice;
}

/* Truncation: the K most likely (the row's top_k, or K as a cap), most likely first;
 * top-p and min-p on their probabilities at temperature 1 (within the K for top_k, of
 * the vocabulary for a cap), then the temperature, then the draw. */
static struct ggml_tensor * pick_ranked(struct ggml_context * ctx, struct ggml_tensor * logits,
                                        const dfl_sampler_key * key, dfl_sampler_graph * out) {
    struct ggml_tensor * sv, * si;
    rank_top(ctx, logits, NULL, key->n_cand, key->by_sort, &sv, &si);
    return draw_ranked(ctx, logits, sv, si, key, out);
}

/* CANDIDATES in a ranked graph: the ranked draw of each row under its mask with the logits
 * left as they are. The n_wide largest logits of the row, each candidate's bit looked up
 * (candidates_allowed), the disallowed ones at -FLT_MAX (last, and finite: a row with none
 * allowed stays a number), then the ranked draw over the top_k largest of them. A row
 * with at least top_k allowed among the candidates holds its masked row's top-k there
 * (any allowed token beyond them is below them all), so it draws exactly as the masked
 * row would; another chooses -1. */
static struct ggml_tensor * pick_ranked_by_candidates(struct ggml_context * ctx, struct ggml_tensor * logits,
                                                      const dfl_sampler_key * key, dfl_sampler_graph * out) {
    const int64_t V = logits->ne[0], n = logits->ne[1], C = key->n_wide, K = key->n_cand;
    struct ggml_tensor * top = dfl_top_k(key->by_sort, ctx, logits, (int) C); /* [C, n], in no particular order */
    struct ggml_tensor * vals = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, n), top), C, n);
    struct ggml_tensor * allowed = candidates_allowed(ctx, top, V, out);
    vals = ggml_add(ctx, vals, ggml_scale_bias(ctx, allowed, FLT_MAX, -FLT_MAX));
    struct ggml_tensor * sv, * si;
    rank_top(ctx, vals, top, K, key->by_sort, &sv, &si);
    struct ggml_tensor * choice = draw_ranked(ctx, logits, sv, si, key, out);
    /* -1 where fewer than K are allowed */
    struct ggml_tensor * few = ggml_step(ctx, ggml_scale_bias(ctx, ggml_sum_rows(ctx, allowed), -1.0f, (float) K - 0.5f));
    struct ggml_tensor * c = ggml_reshape_2d(ctx, ggml_cast(ctx, choice, GGML_TYPE_F32), 1, n);
    c = ggml_sub(ctx, c, ggml_mul(ctx, few, ggml_scale_bias(ctx, c, 1.0f, 1.0f)));
    return ggml_reshape_1d(ctx, ggml_cast(ctx, c, GGML_TYPE_I32), n);
}

/* Rows of several picks: each row's own (its pick setting: 0 the argmax, 1 the full draw,
 * 2 the ranked draw), selected by arithmetic on the token ids (exact in f32: ids are
 * below 2^24), the argmax computed for every row. */
static struct ggml_tensor * pick_mixed(struct ggml_context * ctx, struct ggml_tensor * logits,
                                       const dfl_sampler_key * key, dfl_sampler_graph * out) {
    const int64_t n = logits->ne[1];
    struct ggml_tensor * pick = setting(ctx, out->params, DFL_SP_PICK);
    struct ggml_tensor * as_f32[3] = { ggml_cast(ctx, ggml_argmax(ctx, logits), GGML_TYPE_F32), NULL, NULL };
    if (key->full) {
        as_f32[1] = ggml_cast(ctx, pick_full(ctx, logits, out), GGML_TYPE_F32);
    }
    if (key->ranked) {
        as_f32[2] = ggml_cast(ctx, pick_ranked(ctx, logits, key, out), GGML_TYPE_F32);
    }
    struct ggml_tensor * c = NULL;
    for (int k = 0; k < 3; k++) {
        if (!as_f32[k]) {
            continue;
        }
        /* 1 where the row's pick is k: the steps at k - 0.5 and k + 0.5 differ */
        struct ggml_tensor * is_k = ggml_sub(ctx, ggml_step(ctx, ggml_scale_bias(ctx, pick, 1.0f, 0.5f - (float) k)),
                                             ggml_step(ctx, ggml_scale_bias(ctx, pick, 1.0f, -0.5f - (float) k)));
        struct ggml_tensor * term = ggml_mul(ctx, ggml_reshape_2d(ctx, as_f32[k], 1, n), is_k);
        c = c ? ggml_add(ctx, c, term) : term;
    }
    return ggml_reshape_1d(ctx, ggml_cast(ctx, c, GGML_TYPE_I32), n);
}

struct ggml_tensor * dfl_sampler_build(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * logits,
                                       const dfl_sampler_key * key, dfl_sampler_graph * out) {
    memset(out, 0, sizeof *out);
    const int64_t n = logits->ne[1];
    if (key->pick != DFL_PICK_ARGMAX || key->n_penalty > 0) {
        out->params = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, DFL_SAMPLER_PARAMS);
        ggml_set_input(out->params);
    }
    if (key->n_penalty > 0) {
        logits = penalize(ctx, logits, key->n_penalty, out);
    }
    if (key->masked == DFL_MASK_CANDIDATES) { /* the logits left as they are */
        out->choice = key->pick == DFL_PICK_ARGMAX ? pick_by_candidates(ctx, logits, key, out)
                                                   : pick_ranked_by_candidates(ctx, logits, key, out);
    } else {
        if (key->masked) {
            logits = apply_mask(ctx, logits, key, out);
        }
        switch (key->pick) {
            case DFL_PICK_FULL: out->choice = pick_full(ctx, logits, out); break;
            case DFL_PICK_RANKED: out->choice = pick_ranked(ctx, logits, key, out); break;
            case DFL_PICK_MIXED: out->choice = pick_mixed(ctx, logits, key, out); break;
            default: out->choice = ggml_argmax(ctx, logits); break;
        }
    }
    ggml_set_output(out->choice);
    ggml_build_forward_expand(gf, out->choice);
    if (out->cand_p) {
        ggml_build_forward_expand(gf, out->cand_p);
    }
    return out->choice;
}

/* The j-th pad entry of a row whose staged entries (if any) are row r's: the j-th token
 * not among them, so that a row's entries stay distinct. */
static int32_t pad_token(const dfl_sampler * smp, int r, int j, int n_vocab) {
    int32_t tok = -1;
    for (int k = 0; k <= j; k++) {
        bool taken = true;
        while (taken) {
            tok = (tok + 1) % n_vocab;
            taken = false;
            for (int m = 0; smp->pen_rows > 0 && m < smp->pen_per_row && !taken; m++) {
                taken = smp->pen_tok[r * smp->pen_per_row + m] == tok;
            }
        }
    }
    return tok;
}

/* Appends row * V + t for each token t whose bit in the row's mask is `bit`. */
static int32_t * append_tokens(int32_t * at, const uint32_t * row, int n_vocab, int64_t row0, bool bit) {
    const int W = dfl_mask_words(n_vocab);
    for (int w = 0; w < W; w++) {
        uint32_t x = (bit ? row[w] : ~row[w]) & vocab_bits(w, W, n_vocab);
        for (int b = 0; x; b++, x >>= 1) {
            if (x & 1u) {
                *at++ = (int32_t) (row0 + 32 * w + b);
            }
        }
    }
    return at;
}

/* The list's n entries padded to `bucket` with repeats of its last. */
static void pad_list(int32_t * list, int n, int bucket) {
    for (int i = n; i < bucket; i++) {
        list[i] = list[n - 1];
    }
}

/* The SPARSE mask's inputs: each masked row's exception list (the rule of
 * dfl_sampler_key_for), and with keeping rows, each row's bias. */
static dfl_status fill_sparse_mask(const dfl_sampler_part * parts, int n_parts, int n_rows, const dfl_runtime * rt,
                                   const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab) {
    dfl_sampler * host = parts[0].smp;
    if (!dfl_reserve((void **) &host->host_mask, &host->cap_host_mask, key->n_keep, sizeof(int32_t)) ||
        !dfl_reserve((void **) &host->host_ban, &host->cap_host_ban, key->n_ban, sizeof(int32_t)) ||
        !dfl_reserve((void **) &host->host_row_bias, &host->cap_host_row_bias, n_rows, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    int32_t * keep = host->host_mask, * ban = host->host_ban;
    const int W = dfl_mask_words(n_vocab);
    for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
        const dfl_sampler * smp = parts[i].smp;
        for (int r = 0; r < parts[i].n_rows; r++) {
            /* a row without a constraint allows every token: it bans none */
            const bool keeps = smp->mask_rows > 0 && row_keeps(smp->mask_allowed[r], n_vocab);
            const int allowed = smp->mask_rows > 0 ? smp->mask_allowed[r] : n_vocab;
            const int64_t base = (int64_t) (r0 + r) * n_vocab;
            int32_t ** list = keeps ? &keep : &ban;
            const int64_t room = keeps ? key->n_keep - (keep - host->host_mask) : key->n_ban - (ban - host->host_ban);
            if ((keeps ? allowed : n_vocab - allowed) > room) {
                return dfl_fail(DFL_ERR_STATE, "masks changed after the step's graph was chosen");
            }
            if (smp->mask_rows > 0) {
                *list = append_tokens(*list, smp->mask + (size_t) r * W, n_vocab, base, keeps);
            }
            host->host_row_bias[r0 + r] = keeps ? -INFINITY : 0.0f;
        }
    }
    if (g->keep_idx) {
        pad_list(host->host_mask, (int) (keep - host->host_mask), key->n_keep);
        dfl_runtime_set(rt, g->keep_idx, host->host_mask, 0, (size_t) key->n_keep * sizeof(int32_t));
        dfl_runtime_set(rt, g->row_bias, host->host_row_bias, 0, (size_t) n_rows * sizeof(float));
    }
    if (g->ban_idx) {
        pad_list(host->host_ban, (int) (ban - host->host_ban), key->n_ban);
        dfl_runtime_set(rt, g->ban_idx, host->host_ban, 0, (size_t) key->n_ban * sizeof(int32_t));
    }
    return DFL_OK;
}

/* The CANDIDATES inputs: every row's mask as 16-bit halves (all set for a row without
 * one), and each keeping row's allowed tokens (see pick_by_candidates). */
static dfl_status fill_candidates(const dfl_sampler_part * parts, int n_parts, int n_rows, const dfl_runtime * rt,
                                  const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab) {
    dfl_sampler * host = parts[0].smp;
    const int W = dfl_mask_words(n_vocab), L = key->n_keep;
    if (!dfl_reserve((void **) &host->host_halves, &host->cap_host_halves, 2 * W * n_rows, sizeof(float)) ||
        !dfl_reserve((void **) &host->host_mask, &host->cap_host_mask, L * n_rows, sizeof(int32_t)) ||
        !dfl_reserve((void **) &host->host_keep_tok, &host->cap_host_keep_tok, L * n_rows, sizeof(float)) ||
        !dfl_reserve((void **) &host->host_row_bias, &host->cap_host_row_bias, n_rows, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
        const dfl_sampler * smp = parts[i].smp;
        for (int r = 0; r < parts[i].n_rows; r++) {
            const uint32_t * row = smp->mask_rows > 0 ? smp->mask + (size_t) r * W : NULL;
            float * halves = host->host_halves + (size_t) (r0 + r) * 2 * W;
            for (int w = 0; w < W; w++) {
                const uint32_t x = row ? row[w] : 0xFFFFFFFFu;
                halves[2 * w] = (float) (x & 0xFFFFu);
                halves[2 * w + 1] = (float) (x >> 16);
            }
            const int64_t base = (int64_t) (r0 + r) * n_vocab;
            int32_t * idx = host->host_mask + (size_t) (r0 + r) * L;
            float * tok = host->host_keep_tok + (size_t) (r0 + r) * L;
            const bool keeps = row && smp->mask_allowed[r] <= L;
            int k = 0;
            if (keeps) {
                k = (int) (append_tokens(idx, row, n_vocab, base, true) - idx);
                for (int j = 0; j < k; j++) {
                    tok[j] = (float) (idx[j] - base);
                }
            }
            for (int j = k; j < L; j++) { /* pads: the first again (a row that does not keep: token 0) */
                idx[j] = k ? idx[0] : (int32_t) base;
                tok[j] = k ? tok[0] : 0.0f;
            }
            host->host_row_bias[r0 + r] = keeps ? 1.0f : 0.0f;
        }
    }
    float scale[16];
    for (int b = 0; b < 16; b++) {
        scale[b] = ldexpf(1.0f, -b);
    }
    dfl_runtime_set(rt, g->halves, host->host_halves, 0, (size_t) 2 * W * n_rows * sizeof(float));
    dfl_runtime_set(rt, g->bit_scale, scale, 0, sizeof scale);
    if (g->keep_idx) {
        dfl_runtime_set(rt, g->keep_idx, host->host_mask, 0, (size_t) L * n_rows * sizeof(int32_t));
        dfl_runtime_set(rt, g->keep_tok, host->host_keep_tok, 0, (size_t) L * n_rows * sizeof(float));
        dfl_runtime_set(rt, g->keeps, host->host_row_bias, 0, (size_t) n_rows * sizeof(float));
    }
    return DFL_OK;
}

dfl_status dfl_sampler_fill(dfl_sampler * smp, const dfl_runtime * rt, const dfl_sampler_graph * g,
                            const dfl_sampler_key * key, int n_rows, int n_vocab) {
    const dfl_sampler_part part = { smp, n_rows };
    return dfl_sampler_fill_parts(&part, 1, rt, g, key, n_vocab);
}

dfl_status dfl_sampler_fill_parts(const dfl_sampler_part * parts, int n_parts, const dfl_runtime * rt,
                                  const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab) {
    dfl_sampler * host = parts[0].smp; /* its staging buffers hold the inputs */
    int n_rows = 0;
    for (int i = 0; i < n_parts; i++) {
        n_rows += parts[i].n_rows;
    }
    if (g->params) {
        if (!dfl_reserve((void **) &host->host_params, &host->cap_params, n_rows * DFL_SAMPLER_PARAMS, sizeof(float))) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
            const dfl_sampler * smp = parts[i].smp;
            const dfl_sampling * s = &smp->s;
            const float rep = s->repeat_penalty;
            dfl_sampler_key own;
            TRY(dfl_sampler_key_for(smp, parts[i].n_rows, n_vocab, &own));
            const float values[DFL_SAMPLER_PARAMS] = {
                [DFL_SP_U] = 0.0f,
                [DFL_SP_INV_TEMP] = s->temperature > 0.0f ? 1.0f / s->temperature : 1.0f,
                /* top_p 1 keeps all: above any mass rounding may sum to */
                [DFL_SP_TOP_P] = s->top_p < 1.0f ? s->top_p : 2.0f,
                [DFL_SP_LOG_MIN_P] = s->min_p > 0.0f ? logf(s->min_p) : -FLT_MAX,
                [DFL_SP_REP_M1] = rep - 1.0f,
                [DFL_SP_REP_FLIP] = 1.0f / rep - rep,
                [DFL_SP_FREQ] = s->frequency_penalty,
                [DFL_SP_PRESENT] = s->presence_penalty,
                [DFL_SP_PICK] = (float) own.pick,
                /* a row that does not rank runs the ranked draw over every candidate (unread) */
                [DFL_SP_TOP_K] = (float) (own.pick == DFL_PICK_RANKED ? own.n_cand : key->n_cand),
                [DFL_SP_CAPPED] = (float) own.capped,
            };
            for (int k = 0; k < DFL_SAMPLER_PARAMS; k++) {
                for (int r = 0; r < parts[i].n_rows; r++) {
                    const bool drawn = k == DFL_SP_U && key->pick != DFL_PICK_ARGMAX && smp->n_u > 0;
                    host->host_params[k * n_rows + r0 + r] = drawn ? smp->u[r] : values[k];
                }
            }
        }
        dfl_runtime_set(rt, g->params, host->host_params, 0, (size_t) n_rows * DFL_SAMPLER_PARAMS * sizeof(float));
    }
    if (g->pen_idx) {
        const int M = key->n_penalty, n = n_rows * M;
        if (!dfl_reserve((void **) &host->host_idx, &host->cap_idx, n, sizeof(int32_t)) ||
            !dfl_reserve((void **) &host->host_cnt, &host->cap_cnt, n, sizeof(float))) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
            const dfl_sampler * smp = parts[i].smp;
            for (int r = 0; r < parts[i].n_rows; r++) {
                for (int j = 0; j < M; j++) {
                    /* a part without penalties (or narrower ones) gets pad entries: distinct
                     * tokens of count 0 */
                    const bool staged = smp->pen_rows > 0 && j < smp->pen_per_row;
                    const int at = (r0 + r) * M + j;
                    const int32_t tok = staged ? smp->pen_tok[r * smp->pen_per_row + j] : -1;
                    host->host_idx[at] = (r0 + r) * n_vocab + (staged ? tok : pad_token(smp, r, j, n_vocab));
                    host->host_cnt[at] = staged ? smp->pen_cnt[r * smp->pen_per_row + j] : 0.0f;
                }
            }
        }
        dfl_runtime_set(rt, g->pen_idx, host->host_idx, 0, (size_t) n * sizeof(int32_t));
        dfl_runtime_set(rt, g->pen_cnt, host->host_cnt, 0, (size_t) n * sizeof(float));
    }
    TRY(dfl_sampler_fill_masks(parts, n_parts, rt, g, key, n_vocab));
    for (int i = 0; i < n_parts; i++) {
        parts[i].smp->n_u = 0;
        parts[i].smp->pen_rows = 0;
        parts[i].smp->mask_rows = 0;
    }
    return DFL_OK;
}

dfl_status dfl_sampler_fill_masks(const dfl_sampler_part * parts, int n_parts, const dfl_runtime * rt,
                                  const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab) {
    dfl_sampler * host = parts[0].smp;
    int n_rows = 0;
    for (int i = 0; i < n_parts; i++) {
        n_rows += parts[i].n_rows;
    }
    if (g->mask) {
        const int W = dfl_mask_words(n_vocab), B = 4 * W;
        if (!dfl_reserve((void **) &host->host_mask, &host->cap_host_mask, n_rows * B, sizeof(int32_t))) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
            const dfl_sampler * smp = parts[i].smp;
            for (int r = 0; r < parts[i].n_rows; r++) {
                int32_t * dst = host->host_mask + (size_t) (r0 + r) * B;
                for (int w = 0; w < W; w++) {
                    /* a row without a constraint allows every token */
                    const uint32_t x = smp->mask_rows > 0 ? smp->mask[(size_t) r * W + w] : 0xFFFFFFFFu;
                    for (int k = 0; k < 4; k++) { /* byte k holds tokens 32 w + 8 k .. + 7, low bit first */
                        dst[4 * w + k] = (int32_t) ((x >> (8 * k)) & 0xFFu);
                    }
                }
            }
        }
        float table[256 * 8];
        for (int v = 0; v < 256; v++) {
            for (int b = 0; b < 8; b++) {
                table[v * 8 + b] = (v >> b) & 1 ? 0.0f : -INFINITY;
            }
        }
        dfl_runtime_set(rt, g->mask, host->host_mask, 0, (size_t) n_rows * B * sizeof(int32_t));
        dfl_runtime_set(rt, g->byte_bias, table, 0, sizeof table);
    }
    if (g->halves) {
        TRY(fill_candidates(parts, n_parts, n_rows, rt, g, key, n_vocab));
    } else if (g->keep_idx || g->ban_idx) {
        TRY(fill_sparse_mask(parts, n_parts, n_rows, rt, g, key, n_vocab));
    }
    return DFL_OK;
}

dfl_status dfl_sampler_check_candidates(int K, int n_out, int32_t row0, int32_t n_rows, int32_t k,
                                        const int32_t * tokens, const float * probs) {
    if (k < 1 || k > K) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the last call ranked %d candidates per row, not %d", K, k);
    }
    if (!tokens || !probs || row0 < 0 || n_rows <= 0 || row0 + n_rows > n_out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "candidates: rows %d..%d are outside the last call's %d", row0,
                        row0 + n_rows - 1, n_out);
    }
    return DFL_OK;
}

dfl_status dfl_sampler_candidates(const dfl_runtime * rt, const dfl_sampler_graph * g, int n_out, int32_t row0,
                                  int32_t n_rows, int32_t k, int32_t * tokens, float * probs) {
    if (!g->cand) {
        return dfl_fail(DFL_ERR_STATE, "the last call did not rank candidates (sampling with top_k > 0 does)");
    }
    TRY(dfl_sampler_check_candidates((int) g->cand->ne[0], n_out, row0, n_rows, k, tokens, probs));
    const int64_t K = g->cand->ne[0];
    const size_t row_i = (size_t) k * sizeof(int32_t), row_f = (size_t) k * sizeof(float);
    if (k == K) {
        dfl_runtime_get(rt, g->cand, tokens, (size_t) row0 * row_i, (size_t) n_rows * row_i);
        dfl_runtime_get(rt, g->cand_p, probs, (size_t) row0 * row_f, (size_t) n_rows * row_f);
        return DFL_OK;
    }
    for (int r = 0; r < n_rows; r++) { /* the first k of each row of K */
        dfl_runtime_get(rt, g->cand, tokens + (size_t) r * k, (size_t) (row0 + r) * K * sizeof(int32_t), row_i);
        dfl_runtime_get(rt, g->cand_p, probs + (size_t) r * k, (size_t) (row0 + r) * K * sizeof(float), row_f);
    }
    return DFL_OK;
}
