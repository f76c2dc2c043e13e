/* The sampling stage's graph (see dfl_sampler.h): the device's choice per row, from the
 * staged settings, penalties and masks to the pick (argmax, a draw over the kept
 * candidates or over the full vocabulary). Its tensors are named as llama.cpp names its
 * sampler's where it has one ("sampling.*"), so that a dump lines them up. */
#include "dfl_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* The rows' logit-bias entries (bias_idx: row * V + token) plus `add` [1, entries]
 * each, written back in place: a pad entry repeats one of its row's (the same value
 * written again) or adds 0. */
static struct ggml_tensor * add_at(struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * idx,
                                   struct ggml_tensor * add) {
    const int64_t V = logits->ne[0], n = logits->ne[1];
    struct ggml_tensor * flat = ggml_reshape_2d(ctx, logits, 1, V * n);
    struct ggml_tensor * x = ggml_add(ctx, ggml_get_rows(ctx, flat, idx), ggml_reshape_2d(ctx, add, 1, idx->ne[0]));
    flat = ggml_set_rows(ctx, flat, x, idx);
    return ggml_reshape_2d(ctx, flat, V, n);
}

/* The logit bias's inputs, and its finite biases added (before the penalties, as
 * llama.cpp's chain adds them). */
static struct ggml_tensor * bias_logits(struct ggml_context * ctx, struct ggml_tensor * logits, int64_t B,
                                        dfl_sampler_graph * out) {
    const int64_t n = logits->ne[1];
    out->bias_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B * n);
    out->bias_add = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, B * n);
    out->bias_ban = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, B * n);
    ggml_set_input(out->bias_idx);
    ggml_set_input(out->bias_add);
    ggml_set_input(out->bias_ban);
    return add_at(ctx, logits, out->bias_idx, out->bias_add);
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

/* Every tensor the stage keeps a handle of, named, so that a dump of a step (DFLASH_DUMP,
 * docs/parity.md) and the parity tools reach them. */
static void name_stage(dfl_sampler_graph * out) {
    const struct { struct ggml_tensor * t; const char * name; } named[] = {
        { out->params, "sampling.params" },      { out->pen_idx, "sampling.pen_idx" },
        { out->pen_cnt, "sampling.pen_cnt" },    { out->choice, "sampling.choice" },
        { out->cand, "sampling.cand" },          { out->cand_p, "sampling.cand_p" },
        { out->mask, "sampling.mask" },          { out->byte_bias, "sampling.byte_bias" },
        { out->keep_idx, "sampling.keep_idx" },  { out->row_bias, "sampling.row_bias" },
        { out->ban_idx, "sampling.ban_idx" },    { out->halves, "sampling.halves" },
        { out->bit_scale, "sampling.bit_scale" }, { out->keep_tok, "sampling.keep_tok" },
        { out->keeps, "sampling.keeps" },        { out->bias_idx, "sampling.bias_idx" },
        { out->bias_add, "sampling.bias_add" },  { out->bias_ban, "sampling.bias_ban" },
        { out->raw, "sampling.logits_raw" },
    };
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++) {
        if (named[i].t) {
            ggml_set_name(named[i].t, named[i].name);
        }
    }
}

struct ggml_tensor * dfl_sampler_build(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * logits,
                                       const dfl_sampler_key * key, dfl_sampler_graph * out) {
    memset(out, 0, sizeof *out);
    const int64_t n = logits->ne[1];
    if (key->pick != DFL_PICK_ARGMAX || key->n_penalty > 0) {
        out->params = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, DFL_SAMPLER_PARAMS);
        ggml_set_input(out->params);
    }
    out->changes_logits = key->n_bias > 0 || key->n_penalty > 0 ||
                          (key->masked != DFL_MASK_NONE && key->masked != DFL_MASK_CANDIDATES);
    if (key->raw && out->changes_logits) {
        /* copied before anything writes into them: expanded first, it runs first */
        out->raw = ggml_cont(ctx, logits);
        ggml_set_output(out->raw);
        ggml_build_forward_expand(gf, out->raw);
    }
    if (key->n_bias > 0) {
        logits = bias_logits(ctx, logits, key->n_bias, out);
    }
    if (key->n_penalty > 0) {
        logits = penalize(ctx, logits, key->n_penalty, out);
        ggml_set_name(logits, "sampling.logits_penalized");
    }
    if (key->n_bias > 0) { /* the -inf biases, after the penalties' arithmetic */
        logits = add_at(ctx, logits, out->bias_idx, out->bias_ban);
        ggml_set_name(logits, "sampling.logits_biased");
    }
    if (key->masked == DFL_MASK_CANDIDATES) { /* the logits left as they are */
        out->choice = key->pick == DFL_PICK_ARGMAX ? pick_by_candidates(ctx, logits, key, out)
                                                   : pick_ranked_by_candidates(ctx, logits, key, out);
    } else {
        if (key->masked) {
            logits = apply_mask(ctx, logits, key, out);
            ggml_set_name(logits, "sampling.logits_masked");
        }
        switch (key->pick) {
            case DFL_PICK_FULL: out->choice = pick_full(ctx, logits, out); break;
            case DFL_PICK_RANKED: out->choice = pick_ranked(ctx, logits, key, out); break;
            case DFL_PICK_MIXED: out->choice = pick_mixed(ctx, logits, key, out); break;
            default: out->choice = ggml_argmax(ctx, logits); break;
        }
    }
    name_stage(out);
    ggml_set_output(out->choice);
    ggml_build_forward_expand(gf, out->choice);
    if (out->cand_p) {
        ggml_build_forward_expand(gf, out->cand_p);
    }
    return out->choice;
}
