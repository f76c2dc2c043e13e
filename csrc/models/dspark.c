/* DSpark drafters (llama.cpp's 'dflash' GGUFs with a Markov head): the DFlash backbone
 * (dflash.c) drafts the block in one pass, then a semi-autoregressive Markov head refines
 * it and an optional confidence head says how far to trust it.
 *
 * Markov head: the logits of drafted row i get the bias markov_w2 . markov_w1[prev_i]
 * (a low-rank bigram: w1 [rank, vocab] rows looked up by the previous token, w2
 * [rank, vocab] projecting back, times markov_w2.scale when the file has it); prev_0 is
 * the bonus, prev_i+1 the argmax of row i's biased logits. The drafts are those argmaxes
 * (the chain the bias followed), so the drafter drafts greedily only. Anchor-first files
 * (sample_from_anchor, llama.cpp's default) draft from the bonus's own row on: a block of
 * n drafts is n rows [bonus, mask...]; the others from the rows after it, as DFlash.
 * Confidence head: conf_i = sigmoid(conf_proj . [h_i ; markov_w1[prev_i]] + bias), h_i the
 * backbone's output-normed state of row i: the caller cuts the chain at the first draft
 * below its threshold (--spec-draft-conf-min), as llama.cpp's draft-dspark does with its
 * p-min. */
#include "dflash_backbone.h"
#include "../dfl_pair.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* graph nodes of one Markov step (bias, logits row, argmax, the confidence's) */
#define DSPARK_NODES_PER_ROW 16

typedef struct dspark_weights {
    dflash_weights * backbone;
    int rank;
    struct ggml_tensor * w1, * w2, * w2_scale, * conf, * conf_bias;
} dspark_weights;

/* A boolean key of the file's architecture, `def` when the file has none. */
static dfl_status read_bool(const dfl_gguf * g, const char * name, bool def, bool * out) {
    char key[96];
    snprintf(key, sizeof key, "%s%s", g->arch, name);
    const int64_t id = gguf_find_key(g->meta, key);
    *out = def;
    if (id < 0) {
        return DFL_OK;
    }
    if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_BOOL) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a boolean", g->path, key);
    }
    *out = gguf_get_val_bool(g->meta, id);
    return DFL_OK;
}

static dfl_status load(dfl_drafter * m, const dfl_target * t, const dfl_draft_params * p) {
    const dfl_gguf * g = &m->file;
    dspark_weights * w = calloc(1, sizeof *w);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    TRY(dflash_backbone_load(m, t, &w->backbone));
    if (dflash_backbone_is_dflash2(w->backbone)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has both DSpark's Markov head and DFlash2's selector, a drafter variant "
                        "this version does not run", g->path);
    }
    if (ggml_get_tensor(g->ctx, "d2t")) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' drafts over a reduced vocabulary (d2t), which this version does not run",
                        g->path);
    }
    /* anchor-first (llama.cpp's reading when the key is absent): the bonus's own row drafts,
     * so the trained block's rows are all drafts, after the bonus */
    TRY(read_bool(g, ".sample_from_anchor", true, &m->anchor_first));
    if (m->anchor_first) {
        m->block_size++;
    }
    if (m->block_size > DFL_MAX_BLOCK) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': block size %d is outside 2..%d", g->path, m->block_size, DFL_MAX_BLOCK);
    }
    const struct ggml_tensor * meta = ggml_get_tensor(g->ctx, "markov_w1.weight");
    w->rank = (int) meta->ne[0];
    const int64_t E = m->n_embd, V = m->n_vocab, R = w->rank;
    if (R < 1 || R > 65536) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid Markov head rank %lld", g->path, (long long) R);
    }
    TRY(dfl_drafter_tensor(m, "markov_w1.weight", -1, R, V, true, &w->w1));
    TRY(dfl_drafter_tensor(m, "markov_w2.weight", -1, R, V, true, &w->w2));
    TRY(dfl_drafter_tensor(m, "markov_w2.scale", -1, 1, 0, false, &w->w2_scale));
    TRY(dfl_drafter_tensor(m, "conf_proj.weight", -1, E + R, 1, false, &w->conf));
    if (w->conf) {
        TRY(dfl_drafter_tensor(m, "conf_proj.bias", -1, 1, 0, false, &w->conf_bias));
    }
    m->greedy_only = true; /* the drafts are the chain the Markov bias followed */
    m->has_confidence = w->conf != NULL;
    m->nodes_per_pass = DSPARK_NODES_PER_ROW;
    (void) p;
    return DFL_OK;
}

static void free_weights(dfl_drafter * m) {
    dspark_weights * w = m->weights;
    if (w) {
        free(w->backbone);
        free(w);
    }
    m->weights = NULL;
}

static struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x) {
    return acc ? ggml_concat(ctx, acc, x, 1) : x;
}

static struct ggml_tensor * build(const dfl_drafter * m, dfl_draft_graph * g, bool * own_drafts) {
    const dspark_weights * w = m->weights;
    struct ggml_context * ctx = g->ctx;
    struct ggml_tensor * h = dflash_backbone_hidden(m, w->backbone, g);
    if (!h) {
        return NULL;
    }
    struct ggml_tensor * base = dflash_backbone_head(w->backbone, ctx, h);
    struct ggml_tensor * logits = NULL, * conf = NULL;
    /* each sequence's chain: row i biased by the token before it (the bonus, then the
     * previous row's argmax) */
    for (int i = 0, row0 = 0; i < g->step->n_parts; i++) {
        const int n = g->step->part[i].n_block - 1;
        if (n < 1) {
            continue;
        }
        struct ggml_tensor * prev = ggml_view_1d(ctx, g->tokens, 1, (size_t) dfl_draft_graph_part_row(g, i) * sizeof(int32_t));
        /* named per draft row (the step's row r = row0 + j), for the dumps and parity tools */
        for (int j = 0; j < n; j++) {
            const int r = row0 + j;
            struct ggml_tensor * w1_prev = dfl_cb(ggml_get_rows(ctx, w->w1, prev), "markov_prev", r);        /* [R, 1] */
            struct ggml_tensor * bias = dfl_gguf_mul_mat(&m->file, ctx, w->w2, w1_prev);                     /* [V, 1] */
            if (w->w2_scale) {
                bias = ggml_mul(ctx, bias, w->w2_scale);
            }
            bias = dfl_cb(bias, "markov_bias", r);
            struct ggml_tensor * row = dfl_cb(ggml_add(ctx, dfl_draft_rows(ctx, base, r, 1), bias), "markov_logits", r);
            logits = join(ctx, logits, row);
            if (w->conf) {
                struct ggml_tensor * feat = dfl_cb(ggml_concat(ctx, ggml_cont(ctx, dfl_draft_rows(ctx, h, r, 1)), w1_prev, 0),
                                                   "conf_inp", r);
                struct ggml_tensor * c = ggml_mul_mat(ctx, w->conf, feat);                                   /* [1, 1] */
                if (w->conf_bias) {
                    c = ggml_add(ctx, c, w->conf_bias);
                }
                conf = join(ctx, conf, dfl_cb(ggml_sigmoid(ctx, dfl_cb(c, "conf_logit", r)), "conf", r));
            }
            if (j + 1 < n) {
                prev = ggml_argmax(ctx, row);
            }
        }
        row0 += n;
    }
    if (conf) {
        g->confidence = ggml_reshape_1d(ctx, conf, conf->ne[1]);
    }
    *own_drafts = false; /* the runtime's argmax of these logits is the chain itself */
    return logits;
}

/* Anchor-first (sample_from_anchor true or absent, llama.cpp's reading) its bonus row
 * drafts too: its largest block is the trained rows' drafts and the bonus. */
static void read_meta(const dfl_gguf * g, dfl_draft_meta * meta) {
    const int64_t anchor = gguf_find_key(g->meta, "dflash.sample_from_anchor");
    if (anchor < 0 || (gguf_get_kv_type(g->meta, anchor) == GGUF_TYPE_BOOL && gguf_get_val_bool(g->meta, anchor))) {
        meta->block_size++;
    }
}

const dfl_drafter_arch dfl_drafter_dspark = { load, build, free_weights, read_meta };
