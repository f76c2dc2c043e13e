/* Qwen3 dense (llama.cpp's qwen3 layout): attention only, with per-head RMSNorm on
 * q and k, NeoX RoPE over the whole head, SwiGLU FFN. */
#include "../dfl_model.h"

#include <math.h>
#include <stdlib.h>

#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

typedef struct qwen3_layer {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
} qwen3_layer;

typedef struct qwen3_weights {
    int n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base;
    qwen3_layer layers[];
} qwen3_weights;

static dfl_status load(dfl_model * m) {
    int n_layer, n_head, n_head_kv, head_dim, head_dim_v, n_rot, n_ff;
    float eps, rope_base;
    TRY(dfl_model_key(m, ".embedding_length", &m->n_embd));
    TRY(dfl_model_key(m, ".block_count", &n_layer));
    if (n_layer > DFL_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported layer count %d", m->file.path, n_layer);
    }
    m->n_layer = n_layer;
    TRY(dfl_model_key(m, ".feed_forward_length", &n_ff));
    TRY(dfl_model_key(m, ".attention.head_count", &n_head));
    TRY(dfl_model_key(m, ".attention.head_count_kv", &n_head_kv));
    TRY(dfl_model_key_or(m, ".context_length", 0, &m->n_ctx_train));
    TRY(dfl_model_key_or(m, ".attention.key_length", m->n_embd / n_head, &head_dim));
    TRY(dfl_model_key_or(m, ".attention.value_length", head_dim, &head_dim_v));
    TRY(dfl_model_key_or(m, ".rope.dimension_count", head_dim, &n_rot));
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &eps));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 10000.0f, &rope_base));
    if (eps < 0.0f || rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", m->file.path, (double) eps,
                        (double) rope_base);
    }
    if (head_dim <= 0 || head_dim > 65536 || head_dim_v != head_dim || n_head % n_head_kv != 0 || n_rot > head_dim ||
        n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent attention shape (heads %d, kv heads %d, head sizes %d/%d, rope dims %d)",
                        m->file.path, n_head, n_head_kv, head_dim, head_dim_v, n_rot);
    }
    m->eps = eps;
    TRY(dfl_model_load_io(m));

    qwen3_weights * w = calloc(1, sizeof *w + (size_t) n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    *w = (qwen3_weights) { n_head, n_head_kv, head_dim, n_rot, eps, rope_base };
    const int64_t E = m->n_embd, q_dim = (int64_t) head_dim * n_head, kv_dim = (int64_t) head_dim * n_head_kv;
    for (int il = 0; il < n_layer; il++) {
        qwen3_layer * L = &w->layers[il];
        m->kind[il] = DFL_LAYER_ATTENTION;
        m->attn[il] = (dfl_attention_geometry) { head_dim, head_dim, n_head_kv };
        TRY(dfl_model_tensor(m, "attn_norm.weight", il, E, 0, 0, true, &L->attn_norm));
        TRY(dfl_model_tensor(m, "attn_q.weight", il, E, q_dim, 0, true, &L->wq));
        TRY(dfl_model_tensor(m, "attn_k.weight", il, E, kv_dim, 0, true, &L->wk));
        TRY(dfl_model_tensor(m, "attn_v.weight", il, E, kv_dim, 0, true, &L->wv));
        TRY(dfl_model_tensor(m, "attn_output.weight", il, q_dim, E, 0, true, &L->wo));
        TRY(dfl_model_tensor(m, "attn_q_norm.weight", il, head_dim, 0, 0, true, &L->q_norm));
        TRY(dfl_model_tensor(m, "attn_k_norm.weight", il, head_dim, 0, 0, true, &L->k_norm));
        TRY(dfl_model_tensor(m, "ffn_norm.weight", il, E, 0, 0, true, &L->ffn_norm));
        TRY(dfl_model_tensor(m, "ffn_gate.weight", il, E, n_ff, 0, true, &L->ffn_gate));
        TRY(dfl_model_tensor(m, "ffn_up.weight", il, E, n_ff, 0, true, &L->ffn_up));
        TRY(dfl_model_tensor(m, "ffn_down.weight", il, n_ff, E, 0, true, &L->ffn_down));
    }
    return DFL_OK;
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const qwen3_weights * w = m->weights;
    const qwen3_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const int hd = w->head_dim, n = g->n;

    struct ggml_tensor * cur = dfl_rms_norm(ctx, x, L->attn_norm, w->eps);
    struct ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wq, cur), hd, w->n_head, n);
    struct ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, cur), hd, w->n_head_kv, n);
    struct ggml_tensor * v = ggml_mul_mat(ctx, L->wv, cur);
    q = dfl_rms_norm(ctx, q, L->q_norm, w->eps);
    k = dfl_rms_norm(ctx, k, L->k_norm, w->eps);
    q = dfl_rope(m, ctx, q, g->pos, NULL, w->n_rot, w->rope_base);
    k = dfl_rope(m, ctx, k, g->pos, NULL, w->n_rot, w->rope_base);
    cur = dfl_graph_attention(g, il, q, k, v, 1.0f / sqrtf((float) hd));
    x = ggml_add(ctx, ggml_mul_mat(ctx, L->wo, cur), x);

    cur = dfl_rms_norm(ctx, x, L->ffn_norm, w->eps);
    return ggml_add(ctx, dfl_ffn_swiglu(ctx, cur, L->ffn_gate, L->ffn_up, L->ffn_down), x);
}

const dfl_arch dfl_arch_qwen3 = { "qwen3", "Qwen3", load, build_layer };
