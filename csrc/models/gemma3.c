/* Gemma 3 text models (llama.cpp's gemma3 layout).
 *
 * Sliding-window (local) layers and global layers in a pattern: the file's
 * attention.sliding_window_pattern (a bool per layer, or a period n: every n-th layer
 * global), llama.cpp's period 6 when absent; no sliding_window key makes every layer
 * global. Local layers rotate with rope.freq_base_swa (10,000 when absent, as
 * llama.cpp's gemma3 sets it) and no frequency scaling; global layers with
 * rope.freq_base and the file's rope.scaling (Gemma 3 4B and up: linear, factor 8).
 * Attention: q/k RMS norms with weights, NeoX RoPE over the whole head, queries scaled
 * by 1/sqrt(query_pre_attn_scalar) as llama.cpp derives it (the head size; the 27B's
 * n_embd / n_head), or our attention.scale key when the converter wrote one. Norms
 * before and after attention and the FFN, GELU-tanh gated FFN (gemma_block.h);
 * embeddings scaled by sqrt(n_embd), an optional final logit softcap, the output head
 * tied to the embedding when absent. The norm weights are stored as Gemma's (1 + w):
 * llama.cpp's converter adds the 1 (so does ours), the runtime multiplies. */
#include "gemma_block.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct gemma3_weights {
    int n_head, head_dim, n_rot;
    float eps, base_global, base_swa, attn_scale;
    bool swa[DFL_MAX_LAYERS];
    dfl_gemma_block layers[];
} gemma3_weights;

/* Which layers are local: llama.cpp's load_swa_pattern (an array, else a period). */
static dfl_status swa_pattern(const dfl_model * m, bool * swa) {
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", m->file.arch);
    const int64_t id = gguf_find_key(m->file.meta, key);
    if (id >= 0 && gguf_get_kv_type(m->file.meta, id) == GGUF_TYPE_ARRAY) {
        return dfl_gguf_arr_bool(&m->file, ".attention.sliding_window_pattern", swa, m->n_layer);
    }
    int period;
    TRY(dfl_model_key_or(m, ".attention.sliding_window_pattern", 6, &period));
    for (int il = 0; il < m->n_layer; il++) {
        swa[il] = period == 0 || il % period < period - 1;
    }
    return DFL_OK;
}

static dfl_status load(dfl_model * m) {
    int n_ff, window;
    dfl_attention_keys a;
    float eps, base_global, base_swa, scale, attn_scale;
    TRY(dfl_model_attention_keys(m, &n_ff, &a));
    const int n_layer = m->n_layer, n_head = a.n_head, n_head_kv = a.n_head_kv, head_dim = a.head_dim, n_rot = a.n_rot;
    TRY(dfl_model_key_or(m, ".attention.sliding_window", 0, &window));
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &eps));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 10000.0f, &base_global));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base_swa", false, 10000.0f, &base_swa));
    TRY(dfl_gguf_f32(&m->file, ".final_logit_softcapping", false, 0.0f, &m->logit_softcap));
    /* transformers rounds sqrt(hidden) to a 16-bit checkpoint's dtype; our converter
     * records that, llama.cpp always uses the exact value */
    TRY(dfl_gguf_f32(&m->file, ".embedding_scale", false, sqrtf((float) m->n_embd), &scale));
    /* llama.cpp's rule (gemma_pytorch's query_pre_attn_scalar): the head size, except the
     * 62-layer 27B's n_embd / n_head */
    const float pre_attn = n_layer == 62 ? (float) (m->n_embd / n_head) : (float) head_dim;
    TRY(dfl_gguf_f32(&m->file, ".attention.scale", false, 1.0f / sqrtf(pre_attn), &attn_scale));
    if (!(eps >= 0.0f) || !(base_global > 0.0f) || !(base_swa > 0.0f) || !(m->logit_softcap >= 0.0f) ||
        !(scale > 0.0f) || !isfinite(scale) || !(attn_scale > 0.0f) || !isfinite(attn_scale)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon, rope base, softcap, embedding or attention scale",
                        m->file.path);
    }
    m->eps = eps;
    m->embd_scale = scale;
    TRY(dfl_model_load_io(m));

    gemma3_weights * w = calloc(1, sizeof *w + (size_t) n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    w->n_head = n_head;
    w->head_dim = head_dim;
    w->n_rot = n_rot;
    w->eps = eps;
    w->base_global = base_global;
    w->base_swa = base_swa;
    w->attn_scale = attn_scale;
    if (window > 0) {
        TRY(swa_pattern(m, w->swa));
    }
    for (int il = 0; il < n_layer; il++) {
        m->kind[il] = DFL_LAYER_ATTENTION;
        m->attn[il] = (dfl_attention_geometry) { head_dim, head_dim, n_head_kv, w->swa[il] ? window : 0, false, il };
        TRY(dfl_gemma_block_load(m, il, head_dim, n_head, n_head_kv, n_ff, true, true, &w->layers[il]));
    }
    return DFL_OK;
}

/* NeoX RoPE of layer il: a global layer's under the model's scaling, a local layer's at
 * frequency scale 1 (llama.cpp's rope_freq_scale_train_swa; its other YaRN parameters
 * then change nothing but the attention factor, which is kept as llama.cpp keeps it). */
static struct ggml_tensor * rope(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gemma3_weights * w = m->weights;
    if (!w->swa[il]) {
        return dfl_graph_rope(m, g, x, w->n_rot, w->base_global);
    }
    dfl_rope_scaling local = m->rope;
    local.freq_scale = 1.0f;
    local.exact_ramp = false;
    return dfl_rope_scaled(&local, g->ctx, x, g->pos, NULL, w->n_rot, w->base_swa);
}

static struct ggml_tensor * attention(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gemma3_weights * w = m->weights;
    const dfl_gemma_block * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const int hd = w->head_dim, n = g->n;

    struct ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wq, x), hd, w->n_head, n);
    struct ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, x), hd, m->attn[il].n_head_kv, n);
    struct ggml_tensor * v = dfl_cb(ggml_mul_mat(ctx, L->wv, x), "Vcur", il);
    q = dfl_cb(rope(m, g, il, dfl_cb(dfl_rms_norm(ctx, q, L->q_norm, w->eps), "Qcur_normed", il)), "Qcur", il);
    k = dfl_cb(rope(m, g, il, dfl_cb(dfl_rms_norm(ctx, k, L->k_norm, w->eps), "Kcur_normed", il)), "Kcur", il);
    /* the queries scaled before attention, as llama.cpp does, not the scores inside it:
     * a flash-attention kernel rounds the queries to the cache's type (f16), and scaling
     * before or after that rounding parts the two engines by 1e-3 at kqv_out (the parity
     * tool's finding on the tiny checkpoints; 5e-5, the printing, this way) */
    q = ggml_scale(ctx, q, w->attn_scale);
    /* llama.cpp's kqv_out is the heads' output before attn_output's projection */
    return ggml_mul_mat(ctx, L->wo, dfl_cb(dfl_graph_attention(g, il, q, k, v, 1.0f), "kqv_out", il));
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gemma3_weights * w = m->weights;
    const dfl_gemma_block * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;

    struct ggml_tensor * cur = attention(m, g, il, dfl_cb(dfl_rms_norm(ctx, x, L->attn_norm, w->eps), "attn_norm", il));
    x = dfl_gemma_attn_residual(g, cur, L->post_attn_norm, x, w->eps, il, "sa_out");
    /* ggml's fused GELU, as llama.cpp's: the tanh form in f32 parted the published 270M
     * from llama.cpp by 5.6e-3 at ffn_out-0, which its post-FFN norm (weights past 100)
     * and 17 more layers grew to 0.65 in the logits (the parity tool's finding) */
    cur = dfl_rms_norm(ctx, x, L->ffn_norm, w->eps);
    cur = dfl_cb(dfl_gemma_ffn(ctx, L, dfl_cb(cur, "ffn_norm", il), true), "ffn_out", il);
    return dfl_gemma_add_normed(ctx, cur, L->post_ffn_norm, x, w->eps, il, "ffn_post_norm", "l_out");
}

const dfl_arch dfl_arch_gemma3 = { "gemma3", "Gemma 3", load, build_layer };
