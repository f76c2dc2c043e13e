/* gpt-oss (llama.cpp's gpt-oss layout, LLM_ARCH_OPENAI_MOE).
 *
 * Layers alternate between a sliding window (even layers, unless the file lists its
 * pattern) and full attention, with one head size and RoPE for both. Attention has
 * biases on q, k, v and the output, and a learned logit per head (the sink) in every
 * row's softmax. The FFN is routed experts: a router with a bias, top-k of its logits
 * weighted by their softmax, each expert a SwiGLU with biases whose gate is clamped
 * above and whose up projection is clamped both ways and offset by one (alpha 1.702,
 * limit 7 unless swiglu_clamp_exp says otherwise). RoPE is YaRN, its correction range
 * unrounded unless the file says truncate (transformers' truncate: false, OpenAI's
 * reference). */
#include "../dfl_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* OpenAI's constants; the published configs give the limit (swiglu_limit), never alpha */
#define GPTOSS_SWIGLU_ALPHA 1.702f
#define GPTOSS_SWIGLU_LIMIT 7.0f

typedef struct gptoss_layer {
    struct ggml_tensor * attn_norm, * wq, * bq, * wk, * bk, * wv, * bv, * wo, * bo, * sinks;
    struct ggml_tensor * post_attn_norm;
    dfl_moe_weights moe;
} gptoss_layer;

typedef struct gptoss_weights {
    int n_head, head_dim, n_rot;
    float eps, rope_base;
    gptoss_layer layers[];
} gptoss_weights;

/* Which layers slide: the sliding_window_pattern key as a bool per layer, or as a period
 * n (layer il slides when il % n < n - 1, llama.cpp's set_swa_pattern), 2 by default. */
static dfl_status swa_layers(const dfl_model * m, bool * swa) {
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", m->file.arch);
    const int64_t id = gguf_find_key(m->file.meta, key);
    if (id >= 0 && gguf_get_kv_type(m->file.meta, id) == GGUF_TYPE_ARRAY) {
        return dfl_gguf_arr_bool(&m->file, ".attention.sliding_window_pattern", swa, m->n_layer);
    }
    int period = 2;
    TRY(dfl_model_key_or(m, ".attention.sliding_window_pattern", 2, &period));
    for (int il = 0; il < m->n_layer; il++) {
        swa[il] = period == 0 || il % period < period - 1;
    }
    return DFL_OK;
}

/* The experts' SwiGLU clamp per layer: swiglu_clamp_exp as one f32 or an array of them. */
static dfl_status swiglu_limits(const dfl_model * m, float * limit) {
    char key[128];
    snprintf(key, sizeof key, "%s.swiglu_clamp_exp", m->file.arch);
    const struct gguf_context * meta = m->file.meta;
    const int64_t id = gguf_find_key(meta, key);
    for (int il = 0; il < m->n_layer; il++) {
        limit[il] = GPTOSS_SWIGLU_LIMIT;
    }
    if (id < 0) {
        return DFL_OK;
    }
    const bool array = gguf_get_kv_type(meta, id) == GGUF_TYPE_ARRAY;
    if (array ? gguf_get_arr_type(meta, id) != GGUF_TYPE_FLOAT32 || gguf_get_arr_n(meta, id) != (size_t) m->n_layer
              : gguf_get_kv_type(meta, id) != GGUF_TYPE_FLOAT32) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' must be an f32 or %d of them", m->file.path, key, m->n_layer);
    }
    for (int il = 0; il < m->n_layer; il++) {
        limit[il] = array ? ((const float *) gguf_get_arr_data(meta, id))[il] : gguf_get_val_f32(meta, id);
        if (!(limit[il] > 0.0f) || !isfinite(limit[il])) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' holds %g; a positive clamp is expected", m->file.path,
                            key, (double) limit[il]);
        }
    }
    return DFL_OK;
}

static dfl_status load(dfl_model * m) {
    int n_expert, n_used, n_ff_exp, window;
    dfl_attention_keys a;
    float eps, base, base_swa;
    TRY(dfl_model_attention_keys(m, NULL, &a));
    const int n_layer = m->n_layer, n_head = a.n_head, n_head_kv = a.n_head_kv, head_dim = a.head_dim, n_rot = a.n_rot;
    TRY(dfl_model_key(m, ".attention.sliding_window", &window));
    TRY(dfl_model_key(m, ".expert_count", &n_expert));
    TRY(dfl_model_key(m, ".expert_used_count", &n_used));
    TRY(dfl_model_key(m, ".expert_feed_forward_length", &n_ff_exp));
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &eps));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 10000.0f, &base));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base_swa", false, base, &base_swa));
    if (!(eps >= 0.0f) || !(base > 0.0f) || !isfinite(base)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", m->file.path, (double) eps,
                        (double) base);
    }
    if (base_swa != base) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': a RoPE base of its own for sliding layers (%g, full layers %g) is not "
                        "implemented for gpt-oss", m->file.path, (double) base_swa, (double) base);
    }
    if (n_expert > 1024 || n_used > n_expert) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %d experts used of %d", m->file.path, n_used, n_expert);
    }
    bool swa[DFL_MAX_LAYERS];
    float limit[DFL_MAX_LAYERS];
    TRY(swa_layers(m, swa));
    TRY(swiglu_limits(m, limit));
    m->eps = eps;
    m->yarn_exact_ramp = true;
    TRY(dfl_model_load_io(m));

    gptoss_weights * w = calloc(1, sizeof *w + (size_t) n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    w->n_head = n_head;
    w->head_dim = head_dim;
    w->n_rot = n_rot;
    w->eps = eps;
    w->rope_base = base;
    const int64_t E = m->n_embd, q_dim = (int64_t) head_dim * n_head, kv_dim = (int64_t) head_dim * n_head_kv;
    const int64_t F = n_ff_exp, X = n_expert;
    for (int il = 0; il < n_layer; il++) {
        gptoss_layer * L = &w->layers[il];
        dfl_moe_weights * e = &L->moe;
        m->kind[il] = DFL_LAYER_ATTENTION;
        m->attn[il] = (dfl_attention_geometry) { head_dim, head_dim, n_head_kv, swa[il] ? window : 0, false, il };
        TRY(dfl_model_tensor(m, "attn_norm.weight", il, E, 0, 0, true, &L->attn_norm));
        TRY(dfl_model_tensor(m, "attn_q.weight", il, E, q_dim, 0, true, &L->wq));
        TRY(dfl_model_tensor(m, "attn_q.bias", il, q_dim, 0, 0, true, &L->bq));
        TRY(dfl_model_tensor(m, "attn_k.weight", il, E, kv_dim, 0, true, &L->wk));
        TRY(dfl_model_tensor(m, "attn_k.bias", il, kv_dim, 0, 0, true, &L->bk));
        TRY(dfl_model_tensor(m, "attn_v.weight", il, E, kv_dim, 0, true, &L->wv));
        TRY(dfl_model_tensor(m, "attn_v.bias", il, kv_dim, 0, 0, true, &L->bv));
        TRY(dfl_model_tensor(m, "attn_output.weight", il, q_dim, E, 0, true, &L->wo));
        TRY(dfl_model_tensor(m, "attn_output.bias", il, E, 0, 0, true, &L->bo));
        TRY(dfl_model_tensor(m, "attn_sinks.weight", il, n_head, 0, 0, true, &L->sinks));
        TRY(dfl_model_tensor(m, "post_attention_norm.weight", il, E, 0, 0, true, &L->post_attn_norm));
        e->n_expert = n_expert;
        e->n_used = n_used;
        e->swiglu_alpha = GPTOSS_SWIGLU_ALPHA;
        e->swiglu_limit = limit[il];
        TRY(dfl_model_tensor(m, "ffn_gate_inp.weight", il, E, X, 0, true, &e->router));
        TRY(dfl_model_tensor(m, "ffn_gate_inp.bias", il, X, 0, 0, true, &e->router_b));
        TRY(dfl_model_tensor(m, "ffn_gate_exps.weight", il, E, F, X, true, &e->gate));
        TRY(dfl_model_tensor(m, "ffn_gate_exps.bias", il, F, X, 0, true, &e->gate_b));
        TRY(dfl_model_tensor(m, "ffn_up_exps.weight", il, E, F, X, true, &e->up));
        TRY(dfl_model_tensor(m, "ffn_up_exps.bias", il, F, X, 0, true, &e->up_b));
        TRY(dfl_model_tensor(m, "ffn_down_exps.weight", il, F, E, X, true, &e->down));
        TRY(dfl_model_tensor(m, "ffn_down_exps.bias", il, E, X, 0, true, &e->down_b));
    }
    return DFL_OK;
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gptoss_weights * w = m->weights;
    const gptoss_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const int hd = w->head_dim, n = g->n;

    /* named as llama.cpp's openai-moe graph names them, for the parity tool */
    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(ctx, x, L->attn_norm, w->eps), "attn_norm", il);
    struct ggml_tensor * q = ggml_add(ctx, ggml_mul_mat(ctx, L->wq, cur), L->bq);
    struct ggml_tensor * k = ggml_add(ctx, ggml_mul_mat(ctx, L->wk, cur), L->bk);
    struct ggml_tensor * v = dfl_cb(ggml_add(ctx, ggml_mul_mat(ctx, L->wv, cur), L->bv), "Vcur", il);
    q = dfl_cb(dfl_graph_rope(m, g, ggml_reshape_3d(ctx, q, hd, w->n_head, n), w->n_rot, w->rope_base), "Qcur", il);
    k = dfl_cb(dfl_graph_rope(m, g, ggml_reshape_3d(ctx, k, hd, m->attn[il].n_head_kv, n), w->n_rot, w->rope_base),
               "Kcur", il);
    cur = dfl_graph_attention_sinks(g, il, q, k, v, 1.0f / sqrtf((float) hd), L->sinks);
    cur = dfl_graph_ffn_rows(g, il, dfl_cb(ggml_add(ctx, ggml_mul_mat(ctx, L->wo, cur), L->bo), "attn_out", il));
    x = dfl_cb(ggml_add(ctx, cur, dfl_graph_ffn_rows(g, il, x)), "ffn_inp", il);

    cur = dfl_cb(dfl_rms_norm(ctx, x, L->post_attn_norm, w->eps), "attn_post_norm", il);
    cur = dfl_cb(dfl_moe_ffn(ctx, cur, &L->moe), "ffn_moe_out", il);
    return dfl_cb(ggml_add(ctx, cur, x), "l_out", il);
}

const dfl_arch dfl_arch_gptoss = { "gpt-oss", "gpt-oss", load, build_layer };
