/* EAGLE3 drafters (llama.cpp's 'eagle3' GGUF architecture, docs/eagle3.md) as an
 * autoregressive drafter. The target's features at three layers, concatenated, go through
 * fc to the drafter's width (g). A row pairs a token with a hidden state h:
 * concat(attn_norm(embed(token)), attn_norm_2(h)) feeds one Llama decoder layer (its own
 * KV), whose output (before the final norm) is the hidden state of the next row; the
 * final norm and the drafter's LM head give logits over its own vocabulary, which d2t
 * scatters into the target's (-inf elsewhere).
 *
 * Positions are llama.cpp's (common/speculative.cpp): the row pairing the token at q with
 * g of q - 1 sits at q - 1 (pos_offset -1), so the committed context is (x[q], g[q - 1])
 * at q - 1 for q >= 1 (position 0's token has no features before it: first_pos 1), and a
 * draft starts from (bonus, g of the last committed position) there; each pass's argmax
 * is the next pass's token and its output the next pass's h. */
#include "../dfl_drafter.h"
#include "../dfl_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* drafts per propose when the caller does not say (--spec-draft-n-max) */
#define EAGLE3_DEFAULT_DRAFTS 3
/* llama.cpp's EAGLE3 reads exactly three feature layers */
#define EAGLE3_N_FEAT 3

typedef struct eagle3_weights {
    int n_embd, n_head, n_head_kv, head_dim, n_rot, n_vocab_draft;
    float eps, rope_base;
    dfl_rope_scaling rope;
    bool norm_before_residual;
    struct ggml_tensor * fc, * fc_norm;             /* fc_norm: enc.output_norm (norm_before_fc) */
    struct ggml_tensor * embed, * attn_norm, * hidden_norm;
    struct ggml_tensor * wq, * wk, * wv, * wo, * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
    struct ggml_tensor * out_norm, * head, * d2t;   /* d2t: NULL when the vocabularies are one */
    const dfl_gguf * head_file;
} eagle3_weights;

static dfl_status key_bool(const dfl_gguf * g, const char * key, bool * out) {
    char full[160];
    snprintf(full, sizeof full, "%s.%s", g->arch, key);
    *out = false;
    const int64_t id = gguf_find_key(g->meta, full);
    if (id < 0) {
        return DFL_OK;
    }
    if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_BOOL) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a bool", g->path, full);
    }
    *out = gguf_get_val_bool(g->meta, id);
    return DFL_OK;
}

static dfl_status load_shape(dfl_drafter * m, eagle3_weights * w, const dfl_target * t) {
    const dfl_gguf * g = &m->file;
    int block_count, n_embd_target, head_dim_v, n_ctx_train;
    TRY(dfl_drafter_key(m, ".block_count", true, 0, &block_count));
    if (block_count != 1) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': an EAGLE3 drafter has one decoder layer, this one %d", g->path,
                        block_count);
    }
    TRY(dfl_gguf_arr_i32(g, ".target_layers", m->target_layers, 16, &m->n_feat));
    if (m->n_feat != EAGLE3_N_FEAT) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': eagle3.target_layers lists %d layers; EAGLE3 reads 3", g->path, m->n_feat);
    }
    TRY(dfl_drafter_key(m, ".target_hidden_size", true, 0, &n_embd_target));
    if (n_embd_target != dfl_target_n_embd(t)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "EAGLE3 drafter '%s' reads features %d wide, but the target's hidden size "
                        "is %d: wrong target/drafter pair", g->path, n_embd_target, dfl_target_n_embd(t));
    }
    TRY(dfl_drafter_key(m, ".embedding_length", true, 0, &w->n_embd));
    TRY(dfl_drafter_key(m, ".attention.head_count", true, 0, &w->n_head));
    TRY(dfl_drafter_key(m, ".attention.head_count_kv", false, (uint32_t) w->n_head, &w->n_head_kv));
    if (w->n_embd <= 0 || w->n_head <= 0 || w->n_head_kv <= 0 || w->n_head % w->n_head_kv != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent width %d or attention heads (%d, %d kv)", g->path,
                        w->n_embd, w->n_head, w->n_head_kv);
    }
    TRY(dfl_drafter_key(m, ".attention.key_length", false, (uint32_t) (w->n_embd / w->n_head), &w->head_dim));
    TRY(dfl_drafter_key(m, ".attention.value_length", false, (uint32_t) w->head_dim, &head_dim_v));
    TRY(dfl_drafter_key(m, ".rope.dimension_count", false, (uint32_t) w->head_dim, &w->n_rot));
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", true, 0.0f, &w->eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &w->rope_base));
    if (head_dim_v != w->head_dim || w->head_dim <= 0 || w->n_rot > w->head_dim || w->n_rot % 2 != 0 ||
        w->eps < 0.0f || w->rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported EAGLE3 attention shape (head size %d/%d, rope dims %d)",
                        g->path, w->head_dim, head_dim_v, w->n_rot);
    }
    TRY(dfl_drafter_key(m, ".context_length", false, 0, &n_ctx_train));
    const char * type;
    TRY(dfl_rope_scaling_read(g, n_ctx_train, -1, 0.0f, 0, &w->rope, &type));
    TRY(key_bool(g, "norm_before_residual", &w->norm_before_residual));
    return DFL_OK;
}

/* The drafter's vocabulary: its LM head's rows, mapped to the target's by d2t (absolute
 * target ids, each within the target's vocabulary and none twice), or the target's own. */
static dfl_status load_vocab(dfl_drafter * m, eagle3_weights * w, const dfl_target * t) {
    const dfl_gguf * g = &m->file;
    const int64_t E = w->n_embd, V = m->n_vocab;
    struct ggml_tensor * d2t = ggml_get_tensor(g->ctx, "d2t");
    w->n_vocab_draft = d2t ? (int) d2t->ne[0] : (int) V;
    if (w->n_vocab_draft < 1 || w->n_vocab_draft > V) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': a draft vocabulary of %d tokens, the target's %lld", g->path,
                        w->n_vocab_draft, (long long) V);
    }
    int64_t * ids = malloc((size_t) w->n_vocab_draft * sizeof(int64_t));
    unsigned char * seen = calloc((size_t) V, 1);
    dfl_status st = ids && seen ? DFL_OK : dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    if (st == DFL_OK) {
        st = dfl_gguf_index_vector(g, "d2t", w->n_vocab_draft, false, &w->d2t, ids);
    }
    for (int i = 0; st == DFL_OK && w->d2t && i < w->n_vocab_draft; i++) {
        const int64_t id = ids[i];
        if (id < 0 || id >= V || seen[id]) {
            st = dfl_fail(DFL_ERR_FORMAT, "'%s': d2t maps draft token %d to %lld, %s", g->path, i, (long long) id,
                          id < 0 || id >= V ? "outside the target's vocabulary" : "which another maps to");
        } else {
            seen[id] = 1;
        }
    }
    free(ids);
    free(seen);
    TRY(st);
    TRY(dfl_drafter_tensor(m, "output_norm.weight", -1, E, 0, true, &w->out_norm));
    TRY(dfl_drafter_tensor(m, "output.weight", -1, E, w->n_vocab_draft, w->d2t != NULL, &w->head));
    w->head_file = g;
    if (!w->head) {
        if (E != m->n_embd) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' has no LM head of its own, and its width %lld is not the "
                            "target's %d", g->path, (long long) E, m->n_embd);
        }
        w->head = dfl_target_lm_head(t);
        w->head_file = dfl_target_file(t);
    }
    TRY(dfl_drafter_tensor(m, "token_embd.weight", -1, E, V, false, &w->embed));
    if (!w->embed) {
        if (E != m->n_embd) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' has no token embedding of its own, and its width %lld is not the "
                            "target's %d", g->path, (long long) E, m->n_embd);
        }
        w->embed = dfl_target_tok_embd(t);
    }
    return DFL_OK;
}

static dfl_status load(dfl_drafter * m, const dfl_target * t, const dfl_draft_params * p) {
    const dfl_gguf * g = &m->file;
    eagle3_weights * w = calloc(1, sizeof *w);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    /* the pairing first: a drafter converted for another target says so */
    TRY(dfl_pair_check(g, dfl_target_file(t), m->n_vocab, m->n_embd));
    TRY(load_shape(m, w, t));
    TRY(load_vocab(m, w, t));
    bool norm_before_fc;
    TRY(key_bool(g, "norm_before_fc", &norm_before_fc));
    const int64_t E = w->n_embd, F3 = (int64_t) EAGLE3_N_FEAT * m->n_embd, hd = w->head_dim;
    int n_ff;
    TRY(dfl_drafter_key(m, ".feed_forward_length", true, 0, &n_ff));
    TRY(dfl_drafter_tensor(m, "fc.weight", -1, F3, E, true, &w->fc));
    TRY(dfl_drafter_tensor(m, "enc.output_norm.weight", -1, F3, 0, norm_before_fc, &w->fc_norm));
    TRY(dfl_drafter_tensor(m, "attn_norm.weight", 0, E, 0, true, &w->attn_norm));
    TRY(dfl_drafter_tensor(m, "attn_norm_2.weight", 0, E, 0, true, &w->hidden_norm));
    TRY(dfl_drafter_tensor(m, "attn_q.weight", 0, 2 * E, hd * w->n_head, true, &w->wq));
    TRY(dfl_drafter_tensor(m, "attn_k.weight", 0, 2 * E, hd * w->n_head_kv, true, &w->wk));
    TRY(dfl_drafter_tensor(m, "attn_v.weight", 0, 2 * E, hd * w->n_head_kv, true, &w->wv));
    TRY(dfl_drafter_tensor(m, "attn_output.weight", 0, hd * w->n_head, E, true, &w->wo));
    TRY(dfl_drafter_tensor(m, "ffn_norm.weight", 0, E, 0, true, &w->ffn_norm));
    TRY(dfl_drafter_tensor(m, "ffn_gate.weight", 0, E, n_ff, true, &w->ffn_gate));
    TRY(dfl_drafter_tensor(m, "ffn_up.weight", 0, E, n_ff, true, &w->ffn_up));
    TRY(dfl_drafter_tensor(m, "ffn_down.weight", 0, n_ff, E, true, &w->ffn_down));

    m->feat_previous = true;
    m->reads_tokens = true;
    m->greedy_only = true;
    m->pos_offset = -1;
    m->first_pos = 1;
    m->block_size = p->block_size > 0 ? p->block_size : EAGLE3_DEFAULT_DRAFTS + 1;
    dfl_drafter_one_causal_layer(m, w->head_dim, w->n_head_kv);
    m->nodes_per_pass = 96;
    return DFL_OK;
}

static struct ggml_tensor * rope(const eagle3_weights * w, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * pos) {
    return dfl_rope_ramped(&w->rope, ctx, x, pos, w->n_rot, w->rope_base, GGML_ROPE_TYPE_NORMAL);
}

/* g: fc over the target's concatenated features */
static struct ggml_tensor * fuse(const eagle3_weights * w, struct ggml_context * ctx, struct ggml_tensor * features) {
    /* named as llama.cpp's eagle3 graphs name them, for the parity tool */
    if (w->fc_norm) {
        features = dfl_cb(dfl_rms_norm(ctx, features, w->fc_norm, w->eps), "enc_input_norm", -1);
    }
    return dfl_cb(ggml_mul_mat(ctx, w->fc, features), "fc_out", -1);
}

/* The attention input of rows pairing tokens with hidden states h, and the residual they
 * carry (h, or its norm with norm_before_residual). */
static struct ggml_tensor * input(const eagle3_weights * w, struct ggml_context * ctx, struct ggml_tensor * tokens,
                                  struct ggml_tensor * h, struct ggml_tensor ** residual) {
    struct ggml_tensor * e = dfl_cb(dfl_rms_norm(ctx, ggml_get_rows(ctx, w->embed, tokens), w->attn_norm, w->eps),
                                    "embd_norm", 0);
    struct ggml_tensor * hn = dfl_cb(dfl_rms_norm(ctx, h, w->hidden_norm, w->eps), "g_norm", 0);
    if (residual) {
        *residual = w->norm_before_residual ? hn : h;
    }
    return dfl_cb(ggml_concat(ctx, e, hn, 0), "concat_embd", 0);
}

static void project_kv(const eagle3_weights * w, struct ggml_context * ctx, struct ggml_tensor * x,
                       struct ggml_tensor * pos, struct ggml_tensor ** k, struct ggml_tensor ** v) {
    struct ggml_tensor * kx = dfl_cb(ggml_mul_mat(ctx, w->wk, x), "Kcur", 0);
    *k = dfl_cb(rope(w, ctx, ggml_reshape_3d(ctx, kx, w->head_dim, w->n_head_kv, x->ne[1]), pos), "Kcur_rope", 0);
    *v = dfl_cb(ggml_mul_mat(ctx, w->wv, x), "Vcur", 0);
}

/* One pass: the decoder layer over rows x with their residual; its output (the next
 * pass's hidden state). */
static struct ggml_tensor * layer(const eagle3_weights * w, dfl_draft_graph * g, int pass, struct ggml_tensor * x,
                                  struct ggml_tensor * residual) {
    struct ggml_context * ctx = g->ctx;
    const int64_t hd = w->head_dim, n = x->ne[1];
    struct ggml_tensor * pos = dfl_draft_graph_pos(g, pass);
    struct ggml_tensor * q = dfl_cb(ggml_mul_mat(ctx, w->wq, x), "Qcur", 0);
    q = dfl_cb(rope(w, ctx, ggml_reshape_3d(ctx, q, hd, w->n_head, n), pos), "Qcur_rope", 0);
    struct ggml_tensor * k, * v;
    project_kv(w, ctx, x, pos, &k, &v);
    struct ggml_tensor * o = dfl_draft_graph_attention(g, pass, 0, q, k, v, 1.0f / sqrtf((float) hd));
    struct ggml_tensor * y = dfl_cb(ggml_add(ctx, ggml_mul_mat(ctx, w->wo, o), residual), "ffn_inp", 0);
    struct ggml_tensor * f = dfl_ffn_swiglu(ctx, dfl_cb(dfl_rms_norm(ctx, y, w->ffn_norm, w->eps), "post_attn_norm", 0),
                                            w->ffn_gate, w->ffn_up, w->ffn_down);
    return dfl_cb(ggml_add(ctx, dfl_cb(f, "ffn_out", 0), y), "eagle3_prenorm", 0);
}

/* Logits over the target's vocabulary [V, n] of hidden states h: the drafter's head over
 * its own, scattered by d2t (-inf at target tokens it has no row for). */
static struct ggml_tensor * head(const eagle3_weights * w, struct ggml_context * ctx, int64_t n_vocab,
                                 struct ggml_tensor * h) {
    struct ggml_tensor * hn = dfl_cb(dfl_rms_norm(ctx, h, w->out_norm, w->eps), "result_norm", -1);
    struct ggml_tensor * out = dfl_gguf_mul_mat(w->head_file, ctx, w->head, hn);
    return dfl_cb(w->d2t ? dfl_draft_scatter_vocab(ctx, out, w->d2t, n_vocab) : out, "result_output", -1);
}

static struct ggml_tensor * build(const dfl_drafter * m, dfl_draft_graph * g, bool * own_drafts) {
    const eagle3_weights * w = m->weights;
    struct ggml_context * ctx = g->ctx;
    /* the context entries: only their keys and values are kept */
    if (g->n_entries > 0) {
        struct ggml_tensor * x = input(w, ctx, g->entry_tokens, fuse(w, ctx, g->entry_features), NULL);
        struct ggml_tensor * k, * v;
        project_kv(w, ctx, x, g->entry_pos, &k, &v);
        dfl_draft_graph_store_context(g, 0, k, v);
    }
    if (g->n_rows == 0) {
        return NULL;
    }
    struct ggml_tensor * tokens = g->tokens, * h = fuse(w, ctx, g->last_features), * logits = NULL;
    for (int j = 0; j < g->n_pass; j++) {
        struct ggml_tensor * residual;
        struct ggml_tensor * x = input(w, ctx, tokens, h, &residual);
        h = layer(w, g, j, x, residual);
        struct ggml_tensor * out = head(w, ctx, m->n_vocab, h);
        tokens = dfl_draft_graph_pass_drafts(g, j, out, &logits); /* the next pass's tokens */
    }
    *own_drafts = true;
    return dfl_draft_graph_drafted(g, logits);
}

const dfl_drafter_arch dfl_drafter_eagle3 = { load, build, dfl_drafter_free_weights, NULL };
