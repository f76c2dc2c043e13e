/* DFlash and DFlash2 block-diffusion drafters (llama.cpp's 'dflash' layout): a few
 * Qwen3-style layers whose keys and values come from the target's hidden features
 * (context entries, projected once by fc and hidden_norm) and from a block of
 * [bonus, MASK...] embeddings, attended in one pass (non-causally unless the file says
 * otherwise; sliding layers causally within their window, as z-lab's reference does).
 * Embedding and LM head are the target's unless the file has its own. DFlash2 adds
 * grouped dynamic causal convolutions around each layer's attention and FFN, and a
 * candidate selector that chooses the greedy drafts. */
#include "dflash_backbone.h"
#include "../dfl_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct dflash_layer {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
    /* DFlash2: grouped dynamic causal convolutions around attention and FFN */
    struct ggml_tensor * attn_conv_base, * attn_conv_proj, * ffn_conv_base, * ffn_conv_proj;
} dflash_layer;

struct dflash_weights {
    int n_ff, n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base, embd_scale, logit_scale, softcap;
    dfl_rope_scaling rope_scaling;
    /* DFlash2 (conv_k > 0): convolution kernel and group sizes, candidate selector */
    int conv_k, conv_group, sel_rank, sel_top_k;
    struct ggml_tensor * sel_pred, * sel_succ, * sel_hidden;
    struct ggml_tensor * fc, * hidden_norm, * out_norm, * tok_embd, * output;
    const dfl_gguf * output_file; /* the file of the LM head (the target's, when shared) */
    dflash_layer layers[DFL_DRAFTER_MAX_LAYERS];
};

static dfl_status layer_tensor(const dfl_drafter * m, const char * name, int il, int64_t ne0, int64_t ne1,
                               struct ggml_tensor ** out) {
    return dfl_drafter_tensor(m, name, il, ne0, ne1, true, out);
}

/* DFlash2's convolutions (per layer: base kernels [E, K, 2], kernel projection to
 * 2 x K x groups) and its candidate selector (codebooks [rank, vocab], hidden
 * projection [E, rank]); nothing for a DFlash (v1) drafter. */
static dfl_status read_dflash2(dfl_drafter * m, dflash_weights * w) {
    const dfl_gguf * g = &m->file;
    if (!dfl_gguf_has(g, ".conv_kernel_size")) {
        if (ggml_get_tensor(g->ctx, "selector_hidden.weight")) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' has DFlash2 selector tensors but no dflash.conv_kernel_size", g->path);
        }
        return DFL_OK;
    }
    TRY(dfl_drafter_key(m, ".conv_kernel_size", true, 0, &w->conv_k));
    TRY(dfl_drafter_key(m, ".conv_group_size", true, 0, &w->conv_group));
    TRY(dfl_drafter_key(m, ".selector_rank", true, 0, &w->sel_rank));
    TRY(dfl_drafter_key(m, ".selector_top_k", true, 0, &w->sel_top_k));
    const int64_t E = m->n_embd, V = m->n_vocab;
    if (w->conv_k < 1 || w->conv_k > m->block_size || w->conv_group < 1 || E % w->conv_group != 0 ||
        w->sel_rank < 1 || w->sel_rank > 65536 || w->sel_top_k < 1 || w->sel_top_k > 64 || w->sel_top_k > V) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid DFlash2 settings (kernel %d, group %d, selector rank %d, top-k %d)",
                        g->path, w->conv_k, w->conv_group, w->sel_rank, w->sel_top_k);
    }
    const int64_t proj = 2 * (int64_t) w->conv_k * (E / w->conv_group);
    for (int il = 0; il < m->n_layer; il++) {
        dflash_layer * L = &w->layers[il];
        char name[96];
        const int64_t base[3] = { E, w->conv_k, 2 };
        snprintf(name, sizeof name, "blk.%d.attn_conv_base", il);
        TRY(dfl_gguf_tensor(g, name, 3, base, true, &L->attn_conv_base));
        snprintf(name, sizeof name, "blk.%d.ffn_conv_base", il);
        TRY(dfl_gguf_tensor(g, name, 3, base, true, &L->ffn_conv_base));
        TRY(layer_tensor(m, "attn_conv_proj.weight", il, E, proj, &L->attn_conv_proj));
        TRY(layer_tensor(m, "ffn_conv_proj.weight", il, E, proj, &L->ffn_conv_proj));
        if (L->attn_conv_base->type != GGML_TYPE_F32 || L->ffn_conv_base->type != GGML_TYPE_F32) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d convolution base kernels must be f32", g->path, il);
        }
    }
    TRY(dfl_gguf_tensor(g, "selector_predecessor.weight", 2, (int64_t[]) { w->sel_rank, V }, true, &w->sel_pred));
    TRY(dfl_gguf_tensor(g, "selector_successor.weight", 2, (int64_t[]) { w->sel_rank, V }, true, &w->sel_succ));
    TRY(dfl_gguf_tensor(g, "selector_hidden.weight", 2, (int64_t[]) { E, w->sel_rank }, true, &w->sel_hidden));
    m->greedy_only = true; /* the selector chooses the drafts */
    return DFL_OK;
}

/* Sliding layers (window and per-layer pattern) and the causal flag, as the layers' mask
 * rules: `causal` unset, sliding layers are causal and full ones are not (z-lab's
 * reference drafter); set, every layer is causal inside the block or none is. */
static dfl_status read_attention_pattern(dfl_drafter * m) {
    const dfl_gguf * g = &m->file;
    int window;
    bool swa[DFL_DRAFTER_MAX_LAYERS] = { false };
    TRY(dfl_drafter_key(m, ".attention.sliding_window", false, 0, &window));
    if (window > 0) {
        TRY(dfl_gguf_arr_bool(g, ".attention.sliding_window_pattern", swa, m->n_layer));
    }
    int causal = -1;
    char key[96];
    snprintf(key, sizeof key, "%s.attention.causal", g->arch);
    const int64_t id = gguf_find_key(g->meta, key);
    if (id >= 0) {
        if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_BOOL) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a boolean", g->path, key);
        }
        causal = gguf_get_val_bool(g->meta, id) ? 1 : 0;
    }
    m->n_masks = 1;
    m->masks[0] = (dfl_draft_mask_rule) { causal == 1, 0 };
    for (int il = 0; il < m->n_layer; il++) {
        m->layer_mask[il] = window > 0 && swa[il] ? 1 : 0;
        if (m->layer_mask[il]) {
            m->n_masks = 2;
            m->masks[1] = (dfl_draft_mask_rule) { causal != 0, window };
        }
    }
    return DFL_OK;
}

dfl_status dflash_backbone_load(dfl_drafter * m, const dfl_target * t, dflash_weights ** out) {
    const dfl_gguf * g = &m->file;
    dflash_weights * w = *out = calloc(1, sizeof *w);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    /* variants whose arithmetic this runtime does not implement: refuse rather than
     * draft with the wrong model */
    const char * unsupported[] = { ".attention.value_scale" };
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        if (dfl_gguf_has(g, unsupported[i])) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' sets %s%s, a drafter variant this version does not run", g->path,
                            g->arch, unsupported[i]);
        }
    }
    int n_embd, mask_id;
    TRY(dfl_drafter_key(m, ".embedding_length", true, 0, &n_embd));
    TRY(dfl_drafter_key(m, ".block_count", true, 0, &m->n_layer));
    TRY(dfl_drafter_key(m, ".feed_forward_length", true, 0, &w->n_ff));
    TRY(dfl_drafter_key(m, ".attention.head_count", true, 0, &w->n_head));
    TRY(dfl_drafter_key(m, ".attention.head_count_kv", true, 0, &w->n_head_kv));
    if (w->n_head <= 0 || w->n_head_kv <= 0 || w->n_head % w->n_head_kv != 0 || m->n_layer <= 0 ||
        m->n_layer > DFL_DRAFTER_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported drafter shape (%d layers, %d heads, %d kv heads)", g->path,
                        m->n_layer, w->n_head, w->n_head_kv);
    }
    TRY(dfl_drafter_key(m, ".attention.key_length", false, (uint32_t) (n_embd / w->n_head), &w->head_dim));
    TRY(dfl_drafter_key(m, ".rope.dimension_count", false, (uint32_t) w->head_dim, &w->n_rot));
    TRY(dfl_drafter_key(m, ".block_size", false, 16, &m->block_size));
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", true, 0.0f, &w->eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &w->rope_base));
    {
        uint32_t n_ctx_train;
        const char * type;
        TRY(dfl_gguf_u32(g, ".context_length", false, 0, &n_ctx_train));
        TRY(dfl_rope_scaling_read(g, (int) n_ctx_train, -1, 0.0f, 0, &w->rope_scaling, &type));
    }
    TRY(dfl_gguf_f32(g, ".embedding_scale", false, 1.0f, &w->embd_scale));
    TRY(dfl_gguf_f32(g, ".logit_scale", false, 1.0f, &w->logit_scale));
    TRY(dfl_gguf_f32(g, ".final_logit_softcapping", false, 0.0f, &w->softcap));
    TRY(dfl_drafter_key(m, "tokenizer.ggml.mask_token_id", true, 0, &mask_id));
    TRY(read_attention_pattern(m));
    TRY(dfl_gguf_arr_i32(g, ".target_layers", m->target_layers, 16, &m->n_feat));
    if (m->block_size < 2 || w->n_rot > w->head_dim || w->n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid block size %d or rope dimensions %d", g->path, m->block_size,
                        w->n_rot);
    }

    const int n_vocab = m->n_vocab;
    TRY(dfl_pair_check(g, dfl_target_file(t), n_vocab, m->n_embd));
    /* the drafter must fit its target */
    if (n_embd != m->n_embd) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter hidden size %d does not match the target's %d: wrong target/drafter pair",
                        n_embd, m->n_embd);
    }
    if (mask_id < 0 || mask_id >= n_vocab) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter mask token %d is outside the target vocabulary (%d)", mask_id,
                        n_vocab);
    }
    m->filler = mask_id;

    const int64_t E = n_embd, q_dim = (int64_t) w->head_dim * w->n_head, kv_dim = (int64_t) w->head_dim * w->n_head_kv;
    TRY(dfl_gguf_tensor(g, "fc.weight", 2, (int64_t[]) { E * m->n_feat, E }, true, &w->fc));
    TRY(dfl_gguf_tensor(g, "enc.output_norm.weight", 1, (int64_t[]) { E }, true, &w->hidden_norm));
    TRY(dfl_gguf_tensor(g, "output_norm.weight", 1, (int64_t[]) { E }, true, &w->out_norm));
    TRY(dfl_gguf_tensor(g, "token_embd.weight", 2, (int64_t[]) { E, n_vocab }, false, &w->tok_embd));
    TRY(dfl_gguf_tensor(g, "output.weight", 2, (int64_t[]) { E, n_vocab }, false, &w->output));
    if (!w->output) {
        w->output = w->tok_embd ? w->tok_embd : dfl_target_lm_head(t);
    }
    w->output_file = w->output == dfl_target_lm_head(t) ? dfl_target_file(t) : g;
    if (!w->tok_embd) {
        w->tok_embd = dfl_target_tok_embd(t);
    }
    for (int il = 0; il < m->n_layer; il++) {
        dflash_layer * L = &w->layers[il];
        char name[96];
        snprintf(name, sizeof name, "blk.%d.post_attention_norm.weight", il);
        if (ggml_get_tensor(g->ctx, name)) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' uses post-attention norms, a drafter variant this version does not run",
                            g->path);
        }
        TRY(layer_tensor(m, "attn_norm.weight", il, E, 0, &L->attn_norm));
        TRY(layer_tensor(m, "attn_q.weight", il, E, q_dim, &L->wq));
        TRY(layer_tensor(m, "attn_k.weight", il, E, kv_dim, &L->wk));
        TRY(layer_tensor(m, "attn_v.weight", il, E, kv_dim, &L->wv));
        TRY(layer_tensor(m, "attn_output.weight", il, q_dim, E, &L->wo));
        TRY(layer_tensor(m, "attn_q_norm.weight", il, w->head_dim, 0, &L->q_norm));
        TRY(layer_tensor(m, "attn_k_norm.weight", il, w->head_dim, 0, &L->k_norm));
        TRY(layer_tensor(m, "ffn_norm.weight", il, E, 0, &L->ffn_norm));
        TRY(layer_tensor(m, "ffn_gate.weight", il, E, w->n_ff, &L->ffn_gate));
        TRY(layer_tensor(m, "ffn_up.weight", il, E, w->n_ff, &L->ffn_up));
        TRY(layer_tensor(m, "ffn_down.weight", il, w->n_ff, E, &L->ffn_down));
        m->kind[il] = DFL_LAYER_ATTENTION;
        m->attn[il] = (dfl_attention_geometry) { w->head_dim, w->head_dim, w->n_head_kv };
    }
    return read_dflash2(m, w);
}

bool dflash_backbone_is_dflash2(const dflash_weights * w) {
    return w->conv_k > 0;
}

static dfl_status load(dfl_drafter * m, const dfl_target * t, const dfl_draft_params * p) {
    dflash_weights * w = NULL;
    const dfl_status st = dflash_backbone_load(m, t, &w);
    m->weights = w;
    (void) p;
    if (st == DFL_OK && w->conv_k == 0) {
        /* DFlash (v1) drafts by its head's argmax, which a kept set may cut; DFlash2's
         * selector scores the whole head (and DSpark heads it with its own) */
        m->head = w->output;
        m->head_file = w->output_file;
    }
    return st;
}

static struct ggml_tensor * norm(const dflash_weights * w, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * weight) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, w->eps), weight);
}

static struct ggml_tensor * rope(const dflash_weights * w, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * pos) {
    return dfl_rope_ramped(&w->rope_scaling, ctx, x, pos, w->n_rot, w->rope_base, GGML_ROPE_TYPE_NEOX);
}

/* Layer il's keys (normed, rotated) and values of hidden states h [E, n] at positions pos. */
static void project_kv(const dflash_weights * w, struct ggml_context * ctx, int il, struct ggml_tensor * h,
                       struct ggml_tensor * pos, struct ggml_tensor ** k, struct ggml_tensor ** v) {
    const dflash_layer * L = &w->layers[il];
    const int64_t n = h->ne[1];
    *k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, h), w->head_dim, w->n_head_kv, n);
    *k = rope(w, ctx, norm(w, ctx, *k, L->k_norm), pos);
    *v = ggml_mul_mat(ctx, L->wv, h);
}

/* DFlash2's grouped dynamic causal convolution over a block's rows x [E, B]: row t
 * becomes sum over offsets o of (base[o] + dyn[t, o, group]) * x[t - o], zero before the
 * block's start. `dyn` is the kernel projection [groups, K, 2, B] of the layer's normed
 * input; `phase` 0 is applied before attention or FFN, 1 after. */
static struct ggml_tensor * dynamic_conv(const dfl_drafter * m, const dflash_weights * w, struct ggml_context * ctx,
                                         struct ggml_tensor * x, struct ggml_tensor * dyn, struct ggml_tensor * base,
                                         int phase) {
    const int64_t E = m->n_embd, gs = w->conv_group, G = E / gs, K = w->conv_k, B = x->ne[1];
    const size_t f32 = sizeof(float);
    /* x (a norm's or a matmul's result) is contiguous: a cont would only copy it */
    struct ggml_tensor * x3 = ggml_reshape_3d(ctx, ggml_is_contiguous(x) ? x : ggml_cont(ctx, x), gs, G, B);
    struct ggml_tensor * out = NULL;
    for (int64_t o = 0; o < K && o < B; o++) {
        struct ggml_tensor * shifted = o == 0 ? x3 :
            ggml_pad_ext(ctx, ggml_view_3d(ctx, x3, gs, G, B - o, x3->nb[1], x3->nb[2], 0), 0, 0, 0, 0, (int) o, 0, 0, 0);
        struct ggml_tensor * b = ggml_reshape_3d(ctx, ggml_view_1d(ctx, base, E, (size_t) ((phase * K + o) * E) * f32),
                                                 gs, G, 1);
        struct ggml_tensor * k = ggml_cont(ctx, ggml_view_3d(ctx, dyn, 1, G, B, f32, dyn->nb[3],
                                                             (size_t) ((phase * K + o) * G) * f32));
        struct ggml_tensor * term = ggml_add(ctx, ggml_mul(ctx, shifted, b), ggml_mul(ctx, shifted, k));
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return ggml_reshape_2d(ctx, out, E, B);
}

static struct ggml_tensor * conv_kernels(const dfl_drafter * m, const dflash_weights * w, struct ggml_context * ctx,
                                         struct ggml_tensor * proj, struct ggml_tensor * h) {
    const int64_t G = m->n_embd / w->conv_group;
    return ggml_reshape_4d(ctx, ggml_mul_mat(ctx, proj, h), G, w->conv_k, 2, h->ne[1]);
}

static struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x) {
    return acc ? ggml_concat(ctx, acc, x, 1) : x;
}

/* The grouped dynamic convolution of every block's rows of x, each on its own. */
static struct ggml_tensor * dynamic_conv_parts(const dfl_drafter * m, const dflash_weights * w,
                                               const dfl_draft_graph * g, struct ggml_tensor * x,
                                               struct ggml_tensor * dyn, struct ggml_tensor * base, int phase) {
    struct ggml_context * ctx = g->ctx;
    struct ggml_tensor * out = NULL;
    for (int i = 0, row0 = 0; i < g->step->n_parts; i++) {
        const int64_t B = g->step->part[i].n_block;
        if (B == 0) {
            continue;
        }
        struct ggml_tensor * k = B == g->n_rows ? dyn :
            ggml_view_4d(ctx, dyn, dyn->ne[0], dyn->ne[1], dyn->ne[2], B, dyn->nb[1], dyn->nb[2], dyn->nb[3],
                         (size_t) row0 * dyn->nb[3]);
        out = join(ctx, out, dynamic_conv(m, w, ctx, dfl_draft_rows(ctx, x, row0, B), k, base, phase));
        row0 += (int) B;
    }
    return out;
}

/* DFlash2's candidate selector, greedy: per drafted position the top sel_top_k tokens of
 * the logits, scored by their logit plus a low-rank bilinear term between the previous
 * chosen token (the bonus first) and the candidate, weighted by the projected hidden
 * state; the best of each position becomes the next position's predecessor. The chain
 * is P short steps in the graph; each chosen token is the sequence's next draft. */
static void build_selector(const dflash_weights * w, dfl_draft_graph * g, int part, struct ggml_tensor * logits,
                           struct ggml_tensor * hidden, struct ggml_tensor * bonus) {
    struct ggml_context * ctx = g->ctx;
    const int64_t V = logits->ne[0], P = logits->ne[1], Kc = w->sel_top_k, R = w->sel_rank;
    const size_t f32 = sizeof(float), i32 = sizeof(int32_t);
    struct ggml_tensor * cand = dfl_top_k(g->top_k_by_sort, ctx, logits, (int) Kc);                   /* [Kc, P] */
    struct ggml_tensor * unary = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, P), cand);      /* [1, Kc, P] */
    struct ggml_tensor * hp = ggml_mul_mat(ctx, w->sel_hidden, hidden);                               /* [R, P] */
    struct ggml_tensor * succ = ggml_get_rows(ctx, w->sel_succ, ggml_reshape_1d(ctx, cand, Kc * P)); /* [R, Kc P] */
    struct ggml_tensor * pred = bonus;
    for (int64_t p = 0; p < P; p++) {
        struct ggml_tensor * wt = ggml_mul(ctx, ggml_get_rows(ctx, w->sel_pred, pred),
                                           ggml_view_2d(ctx, hp, R, 1, hp->nb[1], (size_t) p * hp->nb[1]));
        struct ggml_tensor * s = ggml_mul_mat(ctx, ggml_view_2d(ctx, succ, R, Kc, succ->nb[1], (size_t) (p * Kc) * succ->nb[1]), wt);
        s = ggml_add(ctx, s, ggml_view_2d(ctx, unary, Kc, 1, Kc * f32, (size_t) (p * Kc) * f32));
        struct ggml_tensor * best = ggml_argmax(ctx, ggml_reshape_2d(ctx, s, Kc, 1));                  /* [1] */
        struct ggml_tensor * row = ggml_view_2d(ctx, cand, 1, Kc, i32, (size_t) (p * Kc) * i32);
        pred = ggml_reshape_1d(ctx, ggml_get_rows(ctx, ggml_cont(ctx, row), best), 1);
        dfl_draft_graph_put(g, part, (int) p, pred);
    }
}

struct ggml_tensor * dflash_backbone_hidden(const dfl_drafter * m, const dflash_weights * w, dfl_draft_graph * g) {
    struct ggml_context * ctx = g->ctx;
    /* the context entries: the target's features, projected once per layer to keys and
     * values stored at their positions */
    if (g->n_entries > 0) {
        struct ggml_tensor * h = dfl_cb(norm(w, ctx, ggml_mul_mat(ctx, w->fc, g->entry_features), w->hidden_norm),
                                        "inp_g_embeddings", -1);
        for (int il = 0; il < m->n_layer; il++) {
            struct ggml_tensor * k, * v;
            project_kv(w, ctx, il, h, g->entry_pos, &k, &v);
            dfl_draft_graph_store_context(g, il, dfl_cb(k, "Kcur_injected", il), dfl_cb(v, "Vcur_injected", il));
        }
    }
    if (g->n_rows == 0) {
        return NULL;
    }
    const int64_t B = g->n_rows;
    struct ggml_tensor * pos = dfl_draft_graph_pos(g, 0);
    struct ggml_tensor * x = ggml_get_rows(ctx, w->tok_embd, g->tokens);
    if (w->embd_scale != 1.0f) {
        x = ggml_scale(ctx, x, w->embd_scale);
    }
    /* named as llama.cpp's dflash graph names them, for the parity tool */
    x = dfl_cb(x, "inp_noise_embd", -1);
    for (int il = 0; il < m->n_layer; il++) {
        const dflash_layer * L = &w->layers[il];
        struct ggml_tensor * h = dfl_cb(norm(w, ctx, x, L->attn_norm), "noise_norm", il);
        struct ggml_tensor * kernels = NULL;
        if (w->conv_k > 0) {
            kernels = conv_kernels(m, w, ctx, L->attn_conv_proj, h);
            h = dynamic_conv_parts(m, w, g, h, kernels, L->attn_conv_base, 0);
        }
        struct ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wq, h), w->head_dim, w->n_head, B);
        q = dfl_cb(rope(w, ctx, norm(w, ctx, q, L->q_norm), pos), "Qcur", il);
        struct ggml_tensor * k, * v;
        project_kv(w, ctx, il, h, pos, &k, &v);
        struct ggml_tensor * o = dfl_draft_graph_attention(g, 0, il, q, dfl_cb(k, "Kcur", il), dfl_cb(v, "Vcur", il),
                                                           1.0f / sqrtf((float) w->head_dim));
        o = dfl_cb(ggml_mul_mat(ctx, L->wo, o), "attn_out", il);
        if (kernels) {
            o = dynamic_conv_parts(m, w, g, o, kernels, L->attn_conv_base, 1);
        }
        x = dfl_cb(ggml_add(ctx, o, x), "ffn_inp", il);
        h = dfl_cb(norm(w, ctx, x, L->ffn_norm), "ffn_norm", il);
        if (kernels) {
            kernels = conv_kernels(m, w, ctx, L->ffn_conv_proj, h);
            h = dynamic_conv_parts(m, w, g, h, kernels, L->ffn_conv_base, 0);
        }
        h = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L->ffn_gate, h), ggml_mul_mat(ctx, L->ffn_up, h));
        h = dfl_cb(ggml_mul_mat(ctx, L->ffn_down, h), "ffn_out", il);
        if (kernels) {
            h = dynamic_conv_parts(m, w, g, h, kernels, L->ffn_conv_base, 1);
        }
        x = dfl_cb(ggml_add(ctx, h, x), "l_out", il);
    }
    /* block row 0 is the bonus token itself: only rows 1.. are drafts */
    return dfl_cb(norm(w, ctx, dfl_draft_graph_drafted(g, x), w->out_norm), "result_norm", -1);
}

struct ggml_tensor * dflash_backbone_head(const dflash_weights * w, struct ggml_context * ctx, struct ggml_tensor * x) {
    return dfl_gguf_mul_mat(w->output_file, ctx, w->output, x);
}


static struct ggml_tensor * build(const dfl_drafter * m, dfl_draft_graph * g, bool * own_drafts) {
    const dflash_weights * w = m->weights;
    struct ggml_context * ctx = g->ctx;
    struct ggml_tensor * x = dflash_backbone_hidden(m, w, g);
    if (!x) {
        return NULL;
    }
    /* a cut head: the kept rows (a tensor of their own, never sliced), their logits scaled
     * and capped as the whole head's, then scattered to their tokens (-inf at the others,
     * which a cap would have lifted to -softcap) */
    struct ggml_tensor * logits = m->n_head > 0 ? ggml_mul_mat(ctx, m->head_rows, x) : dflash_backbone_head(w, ctx, x);
    if (w->logit_scale != 1.0f) {
        logits = ggml_scale(ctx, logits, w->logit_scale);
    }
    if (w->softcap > 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / w->softcap)), w->softcap);
    }
    if (m->n_head > 0) {
        logits = dfl_draft_scatter_vocab(ctx, logits, m->head_ids, m->n_vocab);
    }
    dfl_cb(logits, "result_output", -1);
    if (w->conv_k > 0) {
        /* each block holds the selector's path */
        for (int i = 0, row0 = 0; i < g->step->n_parts; i++) {
            const int n = g->step->part[i].n_block - 1;
            if (n < 1) {
                continue;
            }
            struct ggml_tensor * bonus = ggml_view_1d(ctx, g->tokens, 1,
                                                      (size_t) dfl_draft_graph_part_row(g, i) * sizeof(int32_t));
            build_selector(w, g, i, dfl_draft_rows(ctx, logits, row0, n), dfl_draft_rows(ctx, x, row0, n), bonus);
            row0 += n;
        }
        *own_drafts = true;
    }
    return logits;
}

const dfl_drafter_arch dfl_drafter_dflash = { load, build, dfl_drafter_free_weights, NULL };
