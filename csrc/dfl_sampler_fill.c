/* Filling the sampling stage's inputs for a step and reading its results (see
 * dfl_sampler.h): each part's staged settings, sparse masks and candidate lists laid into
 * the graph's inputs, and the kept candidates read back. */
#include "dfl_sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* The logit bias's inputs: each row its sequence's entries, the finite biases apart from
 * the -inf ones, padded with repeats of the row's first entry (a row without a bias: token
 * 0 biased by 0). */
static dfl_status fill_bias(const dfl_sampler_part * parts, int n_parts, int n_rows, const dfl_runtime * rt,
                            const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab) {
    dfl_sampler * host = parts[0].smp;
    const int B = key->n_bias, n = n_rows * B;
    if (!dfl_reserve((void **) &host->host_bias_idx, &host->cap_host_bias_idx, n, sizeof(int32_t)) ||
        !dfl_reserve((void **) &host->host_bias_add, &host->cap_host_bias_add, n, sizeof(float)) ||
        !dfl_reserve((void **) &host->host_bias_ban, &host->cap_host_bias_ban, n, sizeof(float))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int i = 0, r0 = 0; i < n_parts; r0 += parts[i].n_rows, i++) {
        const dfl_sampler * smp = parts[i].smp;
        if (smp->n_bias > B) {
            return dfl_fail(DFL_ERR_STATE, "the logit bias changed after the step's graph was chosen");
        }
        for (int r = 0; r < parts[i].n_rows; r++) {
            for (int j = 0; j < B; j++) {
                const int e = j < smp->n_bias ? j : 0, at = (r0 + r) * B + j;
                const float b = smp->n_bias > 0 ? smp->bias_val[e] : 0.0f;
                host->host_bias_idx[at] = (r0 + r) * n_vocab + (smp->n_bias > 0 ? smp->bias_tok[e] : 0);
                host->host_bias_add[at] = isinf(b) ? 0.0f : b;
                host->host_bias_ban[at] = isinf(b) ? -INFINITY : 0.0f;
            }
        }
    }
    dfl_runtime_set(rt, g->bias_idx, host->host_bias_idx, 0, (size_t) n * sizeof(int32_t));
    dfl_runtime_set(rt, g->bias_add, host->host_bias_add, 0, (size_t) n * sizeof(float));
    dfl_runtime_set(rt, g->bias_ban, host->host_bias_ban, 0, (size_t) n * sizeof(float));
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
    if (g->bias_idx) {
        TRY(fill_bias(parts, n_parts, n_rows, rt, g, key, n_vocab));
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
