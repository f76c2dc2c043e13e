/* Qwen3.5 dense (llama.cpp's qwen35 layout): Gated DeltaNet layers with gated full
 * attention every few layers, SwiGLU FFN. Norms other than the GDN output norm are
 * stored +1 in the GGUF, so they apply as plain RMSNorm weights here. */
#include "qwen35.h"

#include <math.h>
#include <stdlib.h>

dfl_status qwen35_read_hparams(dfl_model * m, qwen35_hparams * hp) {
    const char * path = m->file.path;
    int block_count, n_nextn, head_dim_v;
    TRY(dfl_model_key(m, ".embedding_length", &m->n_embd));
    TRY(dfl_model_key(m, ".block_count", &block_count));
    TRY(dfl_model_key_or(m, ".nextn_predict_layers", 0, &n_nextn));
    if (n_nextn > DFL_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid nextn_predict_layers %d", path, n_nextn);
    }
    m->n_layer = block_count - n_nextn; /* multi-token-prediction layers come last and are not run */
    if (m->n_layer <= 0 || m->n_layer > DFL_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported layer count %d", path, m->n_layer);
    }
    TRY(dfl_model_key(m, ".attention.head_count", &hp->n_head));
    TRY(dfl_model_key(m, ".attention.head_count_kv", &hp->n_head_kv));
    TRY(dfl_model_key_or(m, ".context_length", 0, &m->n_ctx_train));
    TRY(dfl_model_key_or(m, ".attention.key_length", m->n_embd / hp->n_head, &hp->head_dim));
    TRY(dfl_model_key_or(m, ".attention.value_length", hp->head_dim, &head_dim_v));
    if (head_dim_v != hp->head_dim) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key and value head sizes differ (%d vs %d)", path, hp->head_dim,
                        head_dim_v);
    }
    TRY(dfl_model_key_or(m, ".rope.dimension_count", hp->head_dim, &hp->n_rot));
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &hp->eps));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 10000.0f, &hp->rope_base));
    m->eps = hp->eps;
    if (hp->eps < 0.0f || hp->rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", path, (double) hp->eps,
                        (double) hp->rope_base);
    }
    if (hp->head_dim <= 0 || hp->head_dim > 65536 || hp->n_head % hp->n_head_kv != 0 || hp->n_rot > hp->head_dim ||
        hp->n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent attention shape (heads %d, kv heads %d, rope dims %d, head size %d)",
                        path, hp->n_head, hp->n_head_kv, hp->n_rot, hp->head_dim);
    }

    dfl_recurrent_geometry * r = &m->rec;
    int d_inner;
    TRY(dfl_model_key(m, ".ssm.conv_kernel", &r->d_conv));
    TRY(dfl_model_key(m, ".ssm.inner_size", &d_inner));
    TRY(dfl_model_key(m, ".ssm.state_size", &r->head_k_dim));
    TRY(dfl_model_key(m, ".ssm.time_step_rank", &r->n_v_heads));
    TRY(dfl_model_key(m, ".ssm.group_count", &r->n_k_heads));
    if (d_inner % r->n_v_heads != 0 || r->n_v_heads % r->n_k_heads != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent linear-attention shape (inner %d, value heads %d, key heads %d)",
                        path, d_inner, r->n_v_heads, r->n_k_heads);
    }
    r->head_v_dim = d_inner / r->n_v_heads;
    if (r->head_v_dim != r->head_k_dim) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': linear-attention key and value head sizes differ (%d vs %d)", path,
                        r->head_k_dim, r->head_v_dim);
    }
    if (r->d_conv < 2 || r->d_conv > 16) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported convolution kernel size %d (2..16)", path, r->d_conv);
    }
    r->conv_channels = d_inner + 2 * r->n_k_heads * r->head_k_dim;

    TRY(dfl_model_hybrid_layout(m));
    for (int il = 0; il < m->n_layer; il++) {
        m->attn[il] = (dfl_attention_geometry) { hp->head_dim, hp->head_dim, hp->n_head_kv };
    }
    return DFL_OK;
}

dfl_status qwen35_load_mixer(const dfl_model * m, const qwen35_hparams * hp, int il, qwen35_mixer * L) {
    const int64_t E = m->n_embd;
    const dfl_recurrent_geometry * r = &m->rec;
    const int64_t d_inner = (int64_t) r->head_v_dim * r->n_v_heads;
    TRY(dfl_model_tensor(m, "attn_norm.weight", il, E, 0, 0, true, &L->attn_norm));
    TRY(dfl_model_tensor(m, "post_attention_norm.weight", il, E, 0, 0, true, &L->post_norm));
    if (m->kind[il] == DFL_LAYER_RECURRENT) {
        const int64_t Hv = r->n_v_heads;
        TRY(dfl_model_tensor(m, "attn_qkv.weight", il, E, r->conv_channels, 0, true, &L->wqkv));
        TRY(dfl_model_tensor(m, "attn_gate.weight", il, E, d_inner, 0, true, &L->wz));
        TRY(dfl_model_tensor(m, "ssm_conv1d.weight", il, r->d_conv, r->conv_channels, 0, true, &L->conv1d));
        TRY(dfl_model_tensor(m, "ssm_dt.bias", il, Hv, 0, 0, true, &L->dt_bias));
        TRY(dfl_model_tensor(m, "ssm_a", il, Hv, 0, 0, true, &L->ssm_a));
        TRY(dfl_model_tensor(m, "ssm_beta.weight", il, E, Hv, 0, true, &L->w_beta));
        TRY(dfl_model_tensor(m, "ssm_alpha.weight", il, E, Hv, 0, true, &L->w_alpha));
        TRY(dfl_model_tensor(m, "ssm_norm.weight", il, r->head_v_dim, 0, 0, true, &L->ssm_norm));
        TRY(dfl_model_tensor(m, "ssm_out.weight", il, d_inner, E, 0, true, &L->ssm_out));
        if (L->conv1d->type != GGML_TYPE_F32 || L->ssm_a->type != GGML_TYPE_F32 || L->dt_bias->type != GGML_TYPE_F32) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d convolution/decay tensors must be f32", m->file.path, il);
        }
    } else {
        const int64_t q_dim = (int64_t) hp->head_dim * hp->n_head, kv_dim = (int64_t) hp->head_dim * hp->n_head_kv;
        TRY(dfl_model_tensor(m, "attn_q.weight", il, E, 2 * q_dim, 0, true, &L->wq));
        TRY(dfl_model_tensor(m, "attn_k.weight", il, E, kv_dim, 0, true, &L->wk));
        TRY(dfl_model_tensor(m, "attn_v.weight", il, E, kv_dim, 0, true, &L->wv));
        TRY(dfl_model_tensor(m, "attn_output.weight", il, q_dim, E, 0, true, &L->wo));
        TRY(dfl_model_tensor(m, "attn_q_norm.weight", il, hp->head_dim, 0, 0, true, &L->q_norm));
        TRY(dfl_model_tensor(m, "attn_k_norm.weight", il, hp->head_dim, 0, 0, true, &L->k_norm));
    }
    return DFL_OK;
}

/* Gated attention: q_proj packs [q, gate] per head; the output is scaled by
 * sigmoid(gate). Qwen3.5's interleaved multi-section RoPE carries one position in
 * every section for text, which makes it the NeoX rotation over the first n_rot dims. */
static struct ggml_tensor * build_attention(const dfl_model * m, const qwen35_hparams * hp, const qwen35_mixer * L,
                                            dfl_graph * g, int il, struct ggml_tensor * cur) {
    struct ggml_context * ctx = g->ctx;
    const int hd = hp->head_dim, n = g->n;
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qg = ggml_mul_mat(ctx, L->wq, cur);
    struct ggml_tensor * q = ggml_view_3d(ctx, qg, hd, hp->n_head, n, 2 * hd * f32, qg->nb[1], 0);
    struct ggml_tensor * gate = ggml_view_3d(ctx, qg, hd, hp->n_head, n, 2 * hd * f32, qg->nb[1], hd * f32);
    q = dfl_cb(dfl_rms_norm(ctx, q, L->q_norm, hp->eps), "Qcur_normed", il);
    struct ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, cur), hd, hp->n_head_kv, n);
    k = dfl_cb(dfl_rms_norm(ctx, k, L->k_norm, hp->eps), "Kcur_normed", il);
    struct ggml_tensor * v = dfl_cb(ggml_mul_mat(ctx, L->wv, cur), "Vcur", il);
    q = dfl_cb(dfl_rope(m, ctx, q, g->pos, NULL, hp->n_rot, hp->rope_base), "Qcur", il);
    k = dfl_cb(dfl_rope(m, ctx, k, g->pos, NULL, hp->n_rot, hp->rope_base), "Kcur", il);

    struct ggml_tensor * o = dfl_cb(dfl_graph_attention(g, il, q, k, v, 1.0f / sqrtf((float) hd)), "attn_pregate", il);
    struct ggml_tensor * gate_sigmoid =
        dfl_cb(ggml_sigmoid(ctx, ggml_cont_2d(ctx, gate, (int64_t) hd * hp->n_head, n)), "gate_sigmoid", il);
    o = dfl_cb(ggml_mul(ctx, o, gate_sigmoid), "attn_gated", il);
    return dfl_cb(ggml_mul_mat(ctx, L->wo, o), "attn_output", il);
}

/* Gated DeltaNet: qkv through the short convolution and SiLU, q and k l2-normalised,
 * decay g = softplus(alpha + dt_bias) * a, update weight beta = sigmoid(b); the output
 * normed per head and gated by SiLU(z). */
static struct ggml_tensor * build_delta_net(const dfl_model * m, const qwen35_hparams * hp, const qwen35_mixer * L,
                                            dfl_graph * g, int il, struct ggml_tensor * cur) {
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &m->rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = g->n;
    const size_t f32 = sizeof(float);

    struct ggml_tensor * z = dfl_cb(ggml_mul_mat(ctx, L->wz, cur), "z", il);
    struct ggml_tensor * beta = dfl_cb(ggml_sigmoid(ctx, ggml_mul_mat(ctx, L->w_beta, cur)), "beta_sigmoid", il);
    struct ggml_tensor * alpha = dfl_cb(ggml_mul_mat(ctx, L->w_alpha, cur), "alpha", il);
    struct ggml_tensor * softplus = dfl_cb(ggml_softplus(ctx, ggml_add(ctx, alpha, L->dt_bias)), "a_softplus", il);
    struct ggml_tensor * decay = dfl_cb(ggml_mul(ctx, softplus, L->ssm_a), "gate", il);

    struct ggml_tensor * conv = dfl_graph_short_conv(g, il, ggml_mul_mat(ctx, L->wqkv, cur), L->conv1d);
    conv = dfl_cb(ggml_silu(ctx, conv), "conv_output_silu", il);
    const size_t row = conv->nb[1];
    /* q and k heads sit side by side in each row: one norm over all their heads (a
     * per-head operation, the same arithmetic as two) */
    struct ggml_tensor * qk = dfl_l2_norm(ctx, ggml_view_3d(ctx, conv, hk, 2 * Hk, n, hk * f32, row, 0), hp->eps);
    struct ggml_tensor * q = ggml_view_3d(ctx, qk, hk, Hk, n, qk->nb[1], qk->nb[2], 0);
    struct ggml_tensor * k = ggml_view_3d(ctx, qk, hk, Hk, n, qk->nb[1], qk->nb[2], Hk * qk->nb[1]);
    struct ggml_tensor * v = ggml_view_3d(ctx, conv, hv, Hv, n, hv * f32, row, 2 * hk * Hk * f32);

    struct ggml_tensor * o = dfl_graph_delta_net(g, il, q, k, v, decay, beta);
    o = dfl_rms_norm(ctx, o, L->ssm_norm, hp->eps);
    o = ggml_mul(ctx, o, ggml_silu(ctx, ggml_reshape_3d(ctx, z, hv, Hv, n)));
    o = dfl_cb(ggml_reshape_2d(ctx, o, hv * Hv, n), "final_output", il);
    return dfl_cb(ggml_mul_mat(ctx, L->ssm_out, o), "linear_attn_out", il);
}

struct ggml_tensor * qwen35_build_mixer(const dfl_model * m, const qwen35_hparams * hp, const qwen35_mixer * L,
                                        dfl_graph * g, int il, struct ggml_tensor * x) {
    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(g->ctx, x, L->attn_norm, hp->eps), "attn_norm", il);
    cur = m->kind[il] == DFL_LAYER_RECURRENT ? build_delta_net(m, hp, L, g, il, cur) : build_attention(m, hp, L, g, il, cur);
    return dfl_cb(ggml_add(g->ctx, cur, x), "attn_residual", il);
}

/* ---- the dense model ------------------------------------------------------------------ */

typedef struct qwen35_layer {
    qwen35_mixer mix;
    struct ggml_tensor * ffn_gate, * ffn_up, * ffn_down;
} qwen35_layer;

typedef struct qwen35_weights {
    qwen35_hparams hp;
    qwen35_layer layers[];
} qwen35_weights;

static dfl_status load(dfl_model * m) {
    qwen35_hparams hp;
    int n_ff;
    TRY(qwen35_read_hparams(m, &hp));
    TRY(dfl_model_key(m, ".feed_forward_length", &n_ff));
    TRY(dfl_model_load_io(m));
    qwen35_weights * w = calloc(1, sizeof *w + (size_t) m->n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    w->hp = hp;
    const int64_t E = m->n_embd;
    for (int il = 0; il < m->n_layer; il++) {
        qwen35_layer * L = &w->layers[il];
        TRY(qwen35_load_mixer(m, &hp, il, &L->mix));
        TRY(dfl_model_tensor(m, "ffn_gate.weight", il, E, n_ff, 0, true, &L->ffn_gate));
        TRY(dfl_model_tensor(m, "ffn_up.weight", il, E, n_ff, 0, true, &L->ffn_up));
        TRY(dfl_model_tensor(m, "ffn_down.weight", il, n_ff, E, 0, true, &L->ffn_down));
    }
    return DFL_OK;
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const qwen35_weights * w = m->weights;
    const qwen35_layer * L = &w->layers[il];
    /* no dfl_graph_ffn_rows: llama.cpp's qwen35 runs its last layer's FFN on every row, and
     * the parity tool pairs our tensors with its by shape */
    x = qwen35_build_mixer(m, &w->hp, &L->mix, g, il, x);
    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(g->ctx, x, L->mix.post_norm, w->hp.eps), "attn_post_norm", il);
    cur = dfl_cb(dfl_ffn_swiglu(g->ctx, cur, L->ffn_gate, L->ffn_up, L->ffn_down), "ffn_out", il);
    return dfl_cb(ggml_add(g->ctx, cur, x), "l_out", il);
}

const dfl_arch dfl_arch_qwen35 = { "qwen35", "Qwen3.5", load, build_layer };
