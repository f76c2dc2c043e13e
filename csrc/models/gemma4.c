/* Gemma 4 text models (llama.cpp's gemma4 layout), dense and with the MoE block.
 *
 * Layers alternate between sliding-window and full attention, each type with its own
 * head size, KV head count and RoPE (full layers: NeoX over the whole head with
 * "proportional" frequencies, the unrotated pairs given factor 1e30 in rope_freqs).
 * Attention: q/k RMS norms with weights, v normed without one, scale 1; a layer
 * without attn_v uses the raw k projection as v (attention_k_eq_v); the last
 * shared_kv_layers layers project only q and attend to the cache of the last earlier
 * layer of their type. Norms after attention and after the FFN; the FFN is GELU-tanh
 * gated; MoE layers add routed experts (their own router norm and scale, per-expert
 * output scales) to the dense FFN. Each layer's output may be scaled
 * (layer_output_scale). Embeddings are scaled by sqrt(n_embd), logits soft-capped. */
#include "gemma_block.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct gemma4_layer {
    bool swa;
    int n_head, head_dim, n_rot;
    float rope_base;
    dfl_gemma_block b;
    struct ggml_tensor * out_scale; /* [1] or NULL */
    /* MoE layers (router != NULL) */
    dfl_moe_weights moe;
    struct ggml_tensor * router_scale, * moe_pre_norm, * mlp_post_norm, * moe_post_norm;
} gemma4_layer;

typedef struct gemma4_weights {
    float eps;
    struct ggml_tensor * rope_freqs; /* [head_dim_full / 2] frequency factors of full layers */
    gemma4_layer layers[];
} gemma4_weights;

/* A per-layer count stored either as one u32 or as an array with one entry per layer. */
static dfl_status per_layer_key(const dfl_model * m, const char * key, bool required, int def, int * out) {
    char full[128];
    snprintf(full, sizeof full, "%s%s", m->file.arch, key);
    const int64_t id = gguf_find_key(m->file.meta, full);
    if (id >= 0 && gguf_get_kv_type(m->file.meta, id) == GGUF_TYPE_ARRAY) {
        int n = 0;
        TRY(dfl_gguf_arr_i32(&m->file, key, out, m->n_layer, &n));
        for (int il = 0; il < m->n_layer; il++) {
            if (n != m->n_layer || out[il] < 0 || out[il] > (1 << 30)) {
                return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' needs %d entries in 0..2^30", m->file.path, full,
                                m->n_layer);
            }
        }
        return DFL_OK;
    }
    int v = def;
    TRY(required ? dfl_model_key(m, key, &v) : dfl_model_key_or(m, key, def, &v));
    for (int il = 0; il < m->n_layer; il++) {
        out[il] = v;
    }
    return DFL_OK;
}

/* Options of llama.cpp's gemma4 this runtime does not build, refused by name. */
static dfl_status refuse_unsupported(const dfl_model * m) {
    int n_per_layer = 0;
    TRY(dfl_model_key_or(m, ".embedding_length_per_layer_input", 0, &n_per_layer));
    if (n_per_layer > 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has per-layer input embeddings (embedding_length_per_layer_input %d, "
                        "hidden_size_per_layer_input in the HF config), which this version does not implement",
                        m->file.path, n_per_layer);
    }
    const char * tensors[] = { "blk.0.attn_qkv.weight", "per_layer_token_embd.weight" };
    for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++) {
        if (gguf_find_tensor(m->file.meta, tensors[i]) >= 0) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' has tensor %s, a gemma4 variant this version does not implement",
                            m->file.path, tensors[i]);
        }
    }
    return DFL_OK;
}

static dfl_status load(dfl_model * m) {
    int n_layer, hd_full, hd_full_v, hd_swa, hd_swa_v, rot_full, rot_swa, window, n_shared, n_expert, n_used, n_ff_exp;
    float eps, base_full, base_swa, scale;
    TRY(dfl_model_block_keys(m));
    n_layer = m->n_layer;
    TRY(refuse_unsupported(m));
    int n_ff[DFL_MAX_LAYERS], n_head[DFL_MAX_LAYERS], n_head_kv[DFL_MAX_LAYERS];
    bool swa[DFL_MAX_LAYERS];
    TRY(per_layer_key(m, ".feed_forward_length", true, 0, n_ff));
    TRY(per_layer_key(m, ".attention.head_count", true, 0, n_head));
    TRY(per_layer_key(m, ".attention.head_count_kv", true, 0, n_head_kv));
    TRY(dfl_model_key_or(m, ".context_length", 0, &m->n_ctx_train));
    TRY(dfl_model_key(m, ".attention.key_length", &hd_full));
    TRY(dfl_model_key_or(m, ".attention.value_length", hd_full, &hd_full_v));
    TRY(dfl_model_key(m, ".attention.key_length_swa", &hd_swa));
    TRY(dfl_model_key_or(m, ".attention.value_length_swa", hd_swa, &hd_swa_v));
    TRY(dfl_model_key_or(m, ".rope.dimension_count", hd_full, &rot_full));
    TRY(dfl_model_key_or(m, ".rope.dimension_count_swa", hd_swa, &rot_swa));
    TRY(dfl_model_key(m, ".attention.sliding_window", &window));
    TRY(dfl_gguf_arr_bool(&m->file, ".attention.sliding_window_pattern", swa, n_layer));
    TRY(dfl_model_key_or(m, ".attention.shared_kv_layers", 0, &n_shared));
    TRY(dfl_model_key_or(m, ".expert_count", 0, &n_expert));
    TRY(dfl_model_key_or(m, ".expert_used_count", 0, &n_used));
    TRY(dfl_model_key_or(m, ".expert_feed_forward_length", 0, &n_ff_exp));
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &eps));
    m->no_rope_scaling = true; /* llama.cpp scales sliding layers by keys of their own, not read here */
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 1000000.0f, &base_full));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base_swa", false, 10000.0f, &base_swa));
    TRY(dfl_gguf_f32(&m->file, ".final_logit_softcapping", false, 0.0f, &m->logit_softcap));
    TRY(dfl_gguf_f32(&m->file, ".embedding_scale", false, sqrtf((float) m->n_embd), &scale));
    if (!(eps >= 0.0f) || !(base_full > 0.0f) || !(base_swa > 0.0f) || !(m->logit_softcap >= 0.0f) ||
        !(scale > 0.0f) || !isfinite(scale)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon, rope base, softcap or embedding scale", m->file.path);
    }
    if (hd_full != hd_full_v || hd_swa != hd_swa_v || rot_full > hd_full || rot_swa > hd_swa || rot_full % 2 ||
        rot_swa % 2 || hd_full > 65536 || hd_swa > 65536) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent head sizes (full %d/%d rope %d, sliding %d/%d rope %d)",
                        m->file.path, hd_full, hd_full_v, rot_full, hd_swa, hd_swa_v, rot_swa);
    }
    if (n_shared >= n_layer) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %d of %d layers share KV caches", m->file.path, n_shared, n_layer);
    }
    if (n_expert > 1024 || n_used > n_expert || (n_expert > 0 && (n_used == 0 || n_ff_exp == 0))) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %d experts used of %d (expert FFN %d)", m->file.path, n_used, n_expert,
                        n_ff_exp);
    }
    m->eps = eps;
    m->embd_scale = scale;
    TRY(dfl_model_load_io(m));

    gemma4_weights * w = calloc(1, sizeof *w + (size_t) n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    w->eps = eps;
    const int first_shared = n_layer - n_shared;
    bool any_full = false;
    for (int il = 0; il < n_layer; il++) {
        any_full = any_full || !swa[il];
    }
    TRY(dfl_model_tensor(m, "rope_freqs.weight", -1, hd_full / 2, 0, 0, any_full, &w->rope_freqs));

    const int64_t E = m->n_embd;
    for (int il = 0; il < n_layer; il++) {
        gemma4_layer * L = &w->layers[il];
        const int hd = swa[il] ? hd_swa : hd_full;
        if (n_head[il] == 0 || n_head_kv[il] == 0 || n_head[il] % n_head_kv[il] != 0 || n_ff[il] == 0) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d has %d heads, %d KV heads, FFN %d", m->file.path, il,
                            n_head[il], n_head_kv[il], n_ff[il]);
        }
        L->swa = swa[il];
        L->n_head = n_head[il];
        L->head_dim = hd;
        L->n_rot = swa[il] ? rot_swa : rot_full;
        L->rope_base = swa[il] ? base_swa : base_full;
        m->kind[il] = DFL_LAYER_ATTENTION;
        m->attn[il] = (dfl_attention_geometry) { hd, hd, n_head_kv[il], swa[il] ? window : 0, false, il };
        if (il >= first_shared) {
            int src = first_shared - 1;
            while (src >= 0 && swa[src] != swa[il]) {
                src--;
            }
            if (src < 0) {
                return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d shares the KV cache of an earlier %s layer, and there "
                                "is none", m->file.path, il, swa[il] ? "sliding" : "full-attention");
            }
            m->attn[il].shares_kv = true;
            m->attn[il].kv_layer = src;
        }
        const bool own_kv = !m->attn[il].shares_kv;
        TRY(dfl_gemma_block_load(m, il, hd, n_head[il], n_head_kv[il], n_ff[il], own_kv, false, &L->b));
        TRY(dfl_model_tensor(m, "layer_output_scale.weight", il, 1, 0, 0, false, &L->out_scale));
        if (own_kv && !L->b.wk) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d has no attn_k.weight", m->file.path, il);
        }

        dfl_moe_weights * e = &L->moe;
        if (n_expert > 0) {
            TRY(dfl_model_tensor(m, "ffn_gate_inp.weight", il, E, n_expert, 0, false, &e->router));
        }
        if (!e->router) {
            continue;
        }
        e->n_expert = n_expert;
        e->n_used = n_used;
        e->gelu = true;
        TRY(dfl_model_tensor(m, "ffn_gate_inp.scale", il, E, 0, 0, true, &L->router_scale));
        TRY(dfl_model_tensor(m, "pre_ffw_norm_2.weight", il, E, 0, 0, true, &L->moe_pre_norm));
        TRY(dfl_model_tensor(m, "post_ffw_norm_1.weight", il, E, 0, 0, true, &L->mlp_post_norm));
        TRY(dfl_model_tensor(m, "post_ffw_norm_2.weight", il, E, 0, 0, true, &L->moe_post_norm));
        TRY(dfl_model_tensor(m, "ffn_gate_up_exps.weight", il, E, 2 * (int64_t) n_ff_exp, n_expert, false, &e->gate_up));
        TRY(dfl_model_tensor(m, "ffn_gate_exps.weight", il, E, n_ff_exp, n_expert, !e->gate_up, &e->gate));
        TRY(dfl_model_tensor(m, "ffn_up_exps.weight", il, E, n_ff_exp, n_expert, !e->gate_up, &e->up));
        TRY(dfl_model_tensor(m, "ffn_down_exps.weight", il, n_ff_exp, E, n_expert, true, &e->down));
        TRY(dfl_model_tensor(m, "ffn_down_exps.scale", il, n_expert, 0, 0, false, &e->expert_scale));
    }
    return DFL_OK;
}

static struct ggml_tensor * rope(struct ggml_context * ctx, const gemma4_weights * w, const gemma4_layer * L,
                                 const dfl_graph * g, struct ggml_tensor * x) {
    return ggml_rope_ext(ctx, x, g->pos, L->swa ? NULL : w->rope_freqs, L->n_rot, GGML_ROPE_TYPE_NEOX, 0, L->rope_base,
                         1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
}

static struct ggml_tensor * attention(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gemma4_weights * w = m->weights;
    const gemma4_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const int hd = L->head_dim, n = g->n;

    struct ggml_tensor * q = dfl_cb(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->b.wq, x), hd, L->n_head, n), "Qcur", il);
    q = dfl_cb(rope(ctx, w, L, g, dfl_cb(dfl_rms_norm(ctx, q, L->b.q_norm, w->eps), "Qcur_normed", il)), "Qcur_pos", il);
    struct ggml_tensor * k = NULL, * v = NULL;
    if (!m->attn[il].shares_kv) {
        const int n_head_kv = m->attn[il].n_head_kv;
        struct ggml_tensor * kp = dfl_cb(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->b.wk, x), hd, n_head_kv, n), "Kcur", il);
        v = L->b.wv ? dfl_cb(ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->b.wv, x), hd, n_head_kv, n), "Vcur", il) : kp;
        v = dfl_cb(ggml_rms_norm(ctx, v, w->eps), "Vcur_normed", il);
        k = dfl_cb(rope(ctx, w, L, g, dfl_cb(dfl_rms_norm(ctx, kp, L->b.k_norm, w->eps), "Kcur_normed", il)), "Kcur_pos", il);
    }
    return ggml_mul_mat(ctx, L->b.wo, dfl_graph_attention(g, il, q, k, v, 1.0f));
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const gemma4_weights * w = m->weights;
    const gemma4_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const float eps = w->eps;

    struct ggml_tensor * cur = attention(m, g, il, dfl_cb(dfl_rms_norm(ctx, x, L->b.attn_norm, eps), "attn_norm", il));
    x = dfl_gemma_attn_residual(g, cur, L->b.post_attn_norm, x, eps, il, "attn_out");

    /* llama.cpp names the dense FFN's input and output ffn_norm and ffn_out only in layers
     * without experts (with them: ffn_norm_1 and ffn_mlp, not named here) */
    const bool dense = L->moe.router == NULL;
    struct ggml_tensor * normed = dfl_rms_norm(ctx, x, L->b.ffn_norm, eps);
    /* the tanh GELU in f32 ops: ggml's fused one was not measured on Gemma 4 yet */
    cur = dfl_gemma_ffn(ctx, &L->b, dense ? dfl_cb(normed, "ffn_norm", il) : normed, false);
    cur = dense ? dfl_cb(cur, "ffn_out", il) : cur;
    if (L->moe.router) {
        /* the router reads the unweighted-normed stream, scaled by its own vector / sqrt(n_embd) */
        struct ggml_tensor * r = ggml_scale(ctx, ggml_rms_norm(ctx, x, eps), 1.0f / sqrtf((float) m->n_embd));
        struct ggml_tensor * logits = ggml_mul_mat(ctx, L->moe.router, ggml_mul(ctx, r, L->router_scale));
        struct ggml_tensor * experts = dfl_moe_ffn_routed(ctx, dfl_rms_norm(ctx, x, L->moe_pre_norm, eps), logits, &L->moe);
        cur = ggml_add(ctx, dfl_rms_norm(ctx, cur, L->mlp_post_norm, eps), dfl_rms_norm(ctx, experts, L->moe_post_norm, eps));
    }
    /* llama.cpp names the residual sum only after the per-layer embedding (l_out) */
    x = dfl_gemma_add_normed(ctx, cur, L->b.post_ffn_norm, x, eps, il, "ffn_post_norm", NULL);
    return dfl_cb(L->out_scale ? dfl_cb(ggml_mul(ctx, x, L->out_scale), "out_scaled", il) : x, "l_out", il);
}

const dfl_arch dfl_arch_gemma4 = { "gemma4", "Gemma 4", load, build_layer };
