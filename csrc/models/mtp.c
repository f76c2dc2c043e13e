/* The multi-token-prediction layer of Qwen3.5/3.6 (llama.cpp's 'nextn' layers, after the
 * model's own in a qwen35 or qwen35moe GGUF) as an autoregressive drafter. A row at
 * position q pairs the token there with the target's final-normed hidden state at q - 1
 * (the one that predicted it): eh_proj(concat(enorm(embed(x_q)), hnorm(h_(q-1)))) goes
 * through one full-attention Qwen3.5 block (gated attention, the layer's own KV) and
 * shared_head_norm; the target's LM head (or the layer's own) gives the next token's
 * logits. Drafting runs one pass per draft: each pass's argmax is the next pass's token
 * and its normed output the next pass's hidden state, as llama.cpp's draft-mtp does. Only
 * the first nextn layer drafts (llama.cpp runs one for Qwen3.5). */
#include "../dfl_drafter.h"
#include "../dfl_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* drafts per propose when the caller does not say (--spec-draft-n-max) */
#define MTP_DEFAULT_DRAFTS 3

typedef struct mtp_weights {
    int il;                 /* the layer's index in the file */
    int n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base;
    dfl_rope_scaling rope;  /* the target's, resolved with its overrides */
    struct ggml_tensor * eh_proj, * enorm, * hnorm, * head_norm, * head, * embed;
    const dfl_gguf * head_file;
    struct ggml_tensor * attn_norm, * post_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    /* dense FFN, or routed experts and a gated shared expert (qwen35moe) */
    struct ggml_tensor * ffn_gate, * ffn_up, * ffn_down;
    dfl_moe_weights moe;
    struct ggml_tensor * shexp_gate_inp, * shexp_gate, * shexp_up, * shexp_down;
} mtp_weights;

static dfl_status tensor(const dfl_drafter * m, const mtp_weights * w, const char * name, int64_t ne0, int64_t ne1,
                         bool required, struct ggml_tensor ** out) {
    return dfl_drafter_tensor(m, name, w->il, ne0, ne1, required, out);
}

static dfl_status load_ffn(dfl_drafter * m, mtp_weights * w) {
    const int64_t E = m->n_embd;
    const dfl_gguf * g = &m->file;
    if (strcmp(g->arch, "qwen35moe") != 0) {
        int n_ff;
        TRY(dfl_drafter_key(m, ".feed_forward_length", true, 0, &n_ff));
        TRY(tensor(m, w, "ffn_gate.weight", E, n_ff, true, &w->ffn_gate));
        TRY(tensor(m, w, "ffn_up.weight", E, n_ff, true, &w->ffn_up));
        return tensor(m, w, "ffn_down.weight", n_ff, E, true, &w->ffn_down);
    }
    int n_expert, n_used, n_ff_exp, n_ff_shexp;
    TRY(dfl_drafter_key(m, ".expert_count", true, 0, &n_expert));
    TRY(dfl_drafter_key(m, ".expert_used_count", true, 0, &n_used));
    TRY(dfl_drafter_key(m, ".expert_feed_forward_length", true, 0, &n_ff_exp));
    TRY(dfl_drafter_key(m, ".expert_shared_feed_forward_length", true, 0, &n_ff_shexp));
    if (n_used < 1 || n_used > n_expert || n_expert > 1024) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %d experts used of %d", g->path, n_used, n_expert);
    }
    dfl_moe_weights * e = &w->moe;
    e->n_expert = n_expert;
    e->n_used = n_used;
    char name[96];
    const int64_t gu[3] = { E, 2 * (int64_t) n_ff_exp, n_expert }, one[3] = { E, n_ff_exp, n_expert },
                  down[3] = { n_ff_exp, E, n_expert };
    snprintf(name, sizeof name, "blk.%d.ffn_gate_up_exps.weight", w->il);
    TRY(dfl_gguf_tensor(g, name, 3, gu, false, &e->gate_up));
    snprintf(name, sizeof name, "blk.%d.ffn_gate_exps.weight", w->il);
    TRY(dfl_gguf_tensor(g, name, 3, one, !e->gate_up, &e->gate));
    snprintf(name, sizeof name, "blk.%d.ffn_up_exps.weight", w->il);
    TRY(dfl_gguf_tensor(g, name, 3, one, !e->gate_up, &e->up));
    snprintf(name, sizeof name, "blk.%d.ffn_down_exps.weight", w->il);
    TRY(dfl_gguf_tensor(g, name, 3, down, true, &e->down));
    TRY(tensor(m, w, "ffn_gate_inp.weight", E, n_expert, true, &e->router));
    TRY(tensor(m, w, "ffn_gate_inp_shexp.weight", E, 0, true, &w->shexp_gate_inp));
    TRY(tensor(m, w, "ffn_gate_shexp.weight", E, n_ff_shexp, true, &w->shexp_gate));
    TRY(tensor(m, w, "ffn_up_shexp.weight", E, n_ff_shexp, true, &w->shexp_up));
    return tensor(m, w, "ffn_down_shexp.weight", n_ff_shexp, E, true, &w->shexp_down);
}

static dfl_status load(dfl_drafter * m, const dfl_target * t, const dfl_draft_params * p) {
    const dfl_gguf * g = &m->file;
    mtp_weights * w = calloc(1, sizeof *w);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    int block_count, n_nextn, n_embd, head_dim_v;
    TRY(dfl_drafter_key(m, ".block_count", true, 0, &block_count));
    TRY(dfl_drafter_key(m, ".nextn_predict_layers", false, 0, &n_nextn));
    if (n_nextn < 1 || n_nextn >= block_count) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' (%s) has no nextn (MTP) layers: convert the checkpoint without --no-mtp",
                        g->path, g->arch);
    }
    w->il = block_count - n_nextn;
    if (w->il != dfl_target_n_layer(t)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "'%s' has %d layers before its MTP layers, the target %d: the MTP layer "
                        "drafts for the model of its own file", g->path, w->il, dfl_target_n_layer(t));
    }
    TRY(dfl_drafter_key(m, ".embedding_length", true, 0, &n_embd));
    TRY(dfl_drafter_key(m, ".attention.head_count", true, 0, &w->n_head));
    TRY(dfl_drafter_key(m, ".attention.head_count_kv", true, 0, &w->n_head_kv));
    if (w->n_head <= 0 || w->n_head_kv <= 0 || w->n_head % w->n_head_kv != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent attention heads (%d, %d kv)", g->path, w->n_head,
                        w->n_head_kv);
    }
    TRY(dfl_drafter_key(m, ".attention.key_length", false, (uint32_t) (n_embd / w->n_head), &w->head_dim));
    TRY(dfl_drafter_key(m, ".attention.value_length", false, (uint32_t) w->head_dim, &head_dim_v));
    TRY(dfl_drafter_key(m, ".rope.dimension_count", false, (uint32_t) w->head_dim, &w->n_rot));
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", true, 0.0f, &w->eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &w->rope_base));
    if (head_dim_v != w->head_dim || w->head_dim <= 0 || w->n_rot > w->head_dim || w->n_rot % 2 != 0 ||
        w->eps < 0.0f || w->rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported MTP attention shape (head size %d/%d, rope dims %d)",
                        g->path, w->head_dim, head_dim_v, w->n_rot);
    }
    /* the target's own file, or one with its tokenizer and shapes */
    char mine[65], theirs[65];
    if (n_embd != m->n_embd || (dfl_tokenizer_sha256(g, true, mine) && dfl_tokenizer_sha256(dfl_target_file(t), true, theirs) &&
                                strcmp(mine, theirs) != 0)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "'%s' is not the target's model (another tokenizer or hidden size): the MTP "
                        "layer drafts for the model of its own file", g->path);
    }
    w->rope = *dfl_target_rope_scaling(t);

    const int64_t E = n_embd, V = m->n_vocab, hd = w->head_dim;
    TRY(tensor(m, w, "nextn.eh_proj.weight", 2 * E, E, true, &w->eh_proj));
    TRY(tensor(m, w, "nextn.enorm.weight", E, 0, true, &w->enorm));
    TRY(tensor(m, w, "nextn.hnorm.weight", E, 0, true, &w->hnorm));
    TRY(tensor(m, w, "nextn.shared_head_norm.weight", E, 0, false, &w->head_norm));
    TRY(tensor(m, w, "nextn.shared_head_head.weight", E, V, false, &w->head));
    TRY(tensor(m, w, "nextn.embed_tokens.weight", E, V, false, &w->embed));
    if (!w->head_norm) {
        w->head_norm = dfl_target_output_norm(t);
    }
    w->head_file = w->head ? g : dfl_target_file(t);
    if (!w->head) {
        w->head = dfl_target_lm_head(t);
    }
    if (!w->embed) {
        w->embed = dfl_target_tok_embd(t);
    }
    TRY(tensor(m, w, "attn_norm.weight", E, 0, true, &w->attn_norm));
    TRY(tensor(m, w, "post_attention_norm.weight", E, 0, true, &w->post_norm));
    TRY(tensor(m, w, "attn_q.weight", E, 2 * hd * w->n_head, true, &w->wq));
    TRY(tensor(m, w, "attn_k.weight", E, hd * w->n_head_kv, true, &w->wk));
    TRY(tensor(m, w, "attn_v.weight", E, hd * w->n_head_kv, true, &w->wv));
    TRY(tensor(m, w, "attn_output.weight", hd * w->n_head, E, true, &w->wo));
    TRY(tensor(m, w, "attn_q_norm.weight", hd, 0, true, &w->q_norm));
    TRY(tensor(m, w, "attn_k_norm.weight", hd, 0, true, &w->k_norm));
    TRY(load_ffn(m, w));

    /* it reads the target's final-normed state (llama.cpp's feature layer n_layer) at the
     * position before each of its rows, and the rows' tokens */
    m->n_feat = 1;
    m->target_layers[0] = w->il;
    m->feat_previous = true;
    m->reads_tokens = true;
    m->greedy_only = true;
    m->block_size = p->block_size > 0 ? p->block_size : MTP_DEFAULT_DRAFTS + 1;
    dfl_drafter_one_causal_layer(m, w->head_dim, w->n_head_kv);
    m->nodes_per_pass = 96;
    return DFL_OK;
}

static struct ggml_tensor * rope(const mtp_weights * w, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * pos) {
    /* Qwen3.5's multi-section RoPE carries one position in every section for text: the
     * NeoX rotation over the first n_rot dimensions, as the target's layers do it */
    return dfl_rope_ramped(&w->rope, ctx, x, pos, w->n_rot, w->rope_base, GGML_ROPE_TYPE_NEOX);
}

/* The rows' input: eh_proj of the normed embeddings of tokens and the normed hidden states h. */
static struct ggml_tensor * input(const mtp_weights * w, struct ggml_context * ctx, struct ggml_tensor * tokens,
                                  struct ggml_tensor * h) {
    /* named as llama.cpp's Qwen3.5 MTP graph names them, for the parity tool */
    struct ggml_tensor * e = dfl_cb(dfl_rms_norm(ctx, ggml_get_rows(ctx, w->embed, tokens), w->enorm, w->eps),
                                    "mtp_enorm", w->il);
    struct ggml_tensor * hn = dfl_cb(dfl_rms_norm(ctx, h, w->hnorm, w->eps), "mtp_hnorm", w->il);
    struct ggml_tensor * both = dfl_cb(ggml_concat(ctx, e, hn, 0), "mtp_concat", w->il);
    return dfl_cb(ggml_mul_mat(ctx, w->eh_proj, both), "mtp_eh_proj", w->il);
}

static void project_kv(const mtp_weights * w, struct ggml_context * ctx, struct ggml_tensor * cur,
                       struct ggml_tensor * pos, struct ggml_tensor ** k, struct ggml_tensor ** v) {
    *k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, w->wk, cur), w->head_dim, w->n_head_kv, cur->ne[1]);
    *k = rope(w, ctx, dfl_cb(dfl_rms_norm(ctx, *k, w->k_norm, w->eps), "mtp_Kcur_normed", w->il), pos);
    *v = dfl_cb(ggml_mul_mat(ctx, w->wv, cur), "mtp_Vcur", w->il);
}

static struct ggml_tensor * ffn(const mtp_weights * w, struct ggml_context * ctx, struct ggml_tensor * cur) {
    if (w->ffn_gate) {
        return dfl_ffn_swiglu(ctx, cur, w->ffn_gate, w->ffn_up, w->ffn_down);
    }
    struct ggml_tensor * shared = dfl_ffn_swiglu(ctx, cur, w->shexp_gate, w->shexp_up, w->shexp_down);
    shared = ggml_mul(ctx, shared, ggml_sigmoid(ctx, ggml_mul_mat(ctx, w->shexp_gate_inp, cur)));
    return ggml_add(ctx, dfl_moe_ffn(ctx, cur, &w->moe), shared);
}

/* One pass over rows x (the block's input) at its positions: the block, then
 * shared_head_norm (the next pass's hidden state). */
static struct ggml_tensor * block(const mtp_weights * w, dfl_draft_graph * g, int pass, struct ggml_tensor * x) {
    struct ggml_context * ctx = g->ctx;
    const int64_t hd = w->head_dim, n = x->ne[1];
    const size_t f32 = sizeof(float);
    struct ggml_tensor * pos = dfl_draft_graph_pos(g, pass);
    const int il = w->il;
    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(ctx, x, w->attn_norm, w->eps), "mtp_attn_norm", il);
    /* gated attention: q_proj packs [q, gate] per head; the output is scaled by sigmoid(gate) */
    struct ggml_tensor * qg = dfl_cb(ggml_mul_mat(ctx, w->wq, cur), "mtp_Qcur_full", il);
    struct ggml_tensor * q = ggml_view_3d(ctx, qg, hd, w->n_head, n, 2 * hd * f32, qg->nb[1], 0);
    struct ggml_tensor * gate = ggml_view_3d(ctx, qg, hd, w->n_head, n, 2 * hd * f32, qg->nb[1], hd * f32);
    gate = dfl_cb(ggml_cont_2d(ctx, gate, hd * w->n_head, n), "mtp_gate", il);
    q = rope(w, ctx, dfl_cb(dfl_rms_norm(ctx, q, w->q_norm, w->eps), "mtp_Qcur_normed", il), pos);
    struct ggml_tensor * k, * v;
    project_kv(w, ctx, cur, pos, &k, &v);
    struct ggml_tensor * o = dfl_draft_graph_attention(g, pass, 0, q, k, v, 1.0f / sqrtf((float) hd));
    o = ggml_mul(ctx, dfl_cb(o, "mtp_attn_pregate", il), ggml_sigmoid(ctx, gate));
    x = dfl_cb(ggml_add(ctx, dfl_cb(ggml_mul_mat(ctx, w->wo, o), "mtp_attn_out", il), x), "mtp_attn_residual", il);
    struct ggml_tensor * h = dfl_cb(dfl_rms_norm(ctx, x, w->post_norm, w->eps), "mtp_attn_post_norm", il);
    x = dfl_cb(ggml_add(ctx, dfl_cb(ffn(w, ctx, h), "mtp_ffn_out", il), x), "mtp_post_ffn", il);
    return dfl_cb(dfl_rms_norm(ctx, x, w->head_norm, w->eps), "h_nextn", -1);
}

static struct ggml_tensor * build(const dfl_drafter * m, dfl_draft_graph * g, bool * own_drafts) {
    const mtp_weights * w = m->weights;
    struct ggml_context * ctx = g->ctx;
    /* the context entries: only their keys and values are kept (the next rows attend to
     * them); the layer's output at them is never read */
    if (g->n_entries > 0) {
        struct ggml_tensor * x = input(w, ctx, g->entry_tokens, g->entry_features);
        struct ggml_tensor * k, * v;
        project_kv(w, ctx, dfl_cb(dfl_rms_norm(ctx, x, w->attn_norm, w->eps), "mtp_attn_norm", w->il), g->entry_pos,
                   &k, &v);
        dfl_draft_graph_store_context(g, 0, k, v);
    }
    if (g->n_rows == 0) {
        return NULL;
    }
    struct ggml_tensor * tokens = g->tokens, * h = g->last_features, * logits = NULL;
    for (int j = 0; j < g->n_pass; j++) {
        h = block(w, g, j, input(w, ctx, tokens, h));
        struct ggml_tensor * out = dfl_cb(dfl_gguf_mul_mat(w->head_file, ctx, w->head, h), "result_output", -1);
        tokens = dfl_draft_graph_pass_drafts(g, j, out, &logits); /* the next pass's tokens */
    }
    *own_drafts = true;
    return dfl_draft_graph_drafted(g, logits);
}

const dfl_drafter_arch dfl_drafter_mtp = { load, build, dfl_drafter_free_weights, NULL };
