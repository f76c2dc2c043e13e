/* The dense Qwen models in llama.cpp's layouts, two registered architectures that
 * differ only in how attention conditions q and k:
 *   qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): biases on the q, k and v
 *         projections (every Qwen2 checkpoint has them; a file without them is broken,
 *         not a variant), no norm on q and k;
 *   qwen3: per-head RMSNorm on q and k, no biases.
 * Both: NeoX RoPE over the whole head, SwiGLU FFN, tied or separate output head. */
#include "../dfl_model.h"

#include <math.h>
#include <stdlib.h>

typedef struct qwen3_layer {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo;
    struct ggml_tensor * bq, * bk, * bv;     /* qwen2 only */
    struct ggml_tensor * q_norm, * k_norm;   /* qwen3 only */
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
} qwen3_layer;

typedef struct qwen3_weights {
    int n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base;
    qwen3_layer layers[];
} qwen3_weights;

/* qkv_bias: qwen2's biases; qk_norm: qwen3's norms. */
static dfl_status load_dense(dfl_model * m, bool qkv_bias, bool qk_norm) {
    int n_ff;
    dfl_attention_keys a;
    float eps, rope_base;
    TRY(dfl_model_attention_keys(m, &n_ff, &a));
    const int n_layer = m->n_layer, n_head = a.n_head, n_head_kv = a.n_head_kv, head_dim = a.head_dim, n_rot = a.n_rot;
    TRY(dfl_gguf_f32(&m->file, ".attention.layer_norm_rms_epsilon", true, 0.0f, &eps));
    TRY(dfl_gguf_f32(&m->file, ".rope.freq_base", false, 10000.0f, &rope_base));
    if (eps < 0.0f || rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", m->file.path, (double) eps,
                        (double) rope_base);
    }
    m->eps = eps;
    TRY(dfl_model_load_io(m));
    /* llama.cpp's qwen2 takes an optional bias on the output head; no Qwen checkpoint
     * has one and the runtime's LM head has none, so refuse it rather than drop it */
    struct ggml_tensor * output_b = NULL;
    TRY(dfl_model_tensor(m, "output.bias", -1, m->n_vocab, 0, 0, false, &output_b));
    if (output_b) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': output.bias (a bias on the output head) is not supported", m->file.path);
    }

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
        if (qkv_bias) {
            TRY(dfl_model_tensor(m, "attn_q.bias", il, q_dim, 0, 0, true, &L->bq));
            TRY(dfl_model_tensor(m, "attn_k.bias", il, kv_dim, 0, 0, true, &L->bk));
            TRY(dfl_model_tensor(m, "attn_v.bias", il, kv_dim, 0, 0, true, &L->bv));
        }
        if (qk_norm) {
            TRY(dfl_model_tensor(m, "attn_q_norm.weight", il, head_dim, 0, 0, true, &L->q_norm));
            TRY(dfl_model_tensor(m, "attn_k_norm.weight", il, head_dim, 0, 0, true, &L->k_norm));
        }
        TRY(dfl_model_tensor(m, "ffn_norm.weight", il, E, 0, 0, true, &L->ffn_norm));
        TRY(dfl_model_tensor(m, "ffn_gate.weight", il, E, n_ff, 0, true, &L->ffn_gate));
        TRY(dfl_model_tensor(m, "ffn_up.weight", il, E, n_ff, 0, true, &L->ffn_up));
        TRY(dfl_model_tensor(m, "ffn_down.weight", il, n_ff, E, 0, true, &L->ffn_down));
    }
    return DFL_OK;
}

static dfl_status load_qwen2(dfl_model * m) { return load_dense(m, true, false); }
static dfl_status load_qwen3(dfl_model * m) { return load_dense(m, false, true); }

/* w x (+ b when the layer has a bias) */
static struct ggml_tensor * linear(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * b,
                                   struct ggml_tensor * x) {
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    return b ? ggml_add(ctx, y, b) : y;
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const qwen3_weights * w = m->weights;
    const qwen3_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    const int hd = w->head_dim, n = g->n;

    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(ctx, x, L->attn_norm, w->eps), "attn_norm", il);
    struct ggml_tensor * q = ggml_reshape_3d(ctx, linear(ctx, L->wq, L->bq, cur), hd, w->n_head, n);
    struct ggml_tensor * k = ggml_reshape_3d(ctx, linear(ctx, L->wk, L->bk, cur), hd, w->n_head_kv, n);
    struct ggml_tensor * v = dfl_cb(linear(ctx, L->wv, L->bv, cur), "Vcur", il);
    if (L->q_norm) {
        q = dfl_cb(dfl_rms_norm(ctx, q, L->q_norm, w->eps), "Qcur_normed", il);
        k = dfl_cb(dfl_rms_norm(ctx, k, L->k_norm, w->eps), "Kcur_normed", il);
    }
    /* llama.cpp's Qcur and Kcur are the rotated ones */
    q = dfl_cb(dfl_rope(m, ctx, q, g->pos, NULL, w->n_rot, w->rope_base), "Qcur", il);
    k = dfl_cb(dfl_rope(m, ctx, k, g->pos, NULL, w->n_rot, w->rope_base), "Kcur", il);
    cur = dfl_cb(dfl_graph_attention(g, il, q, k, v, 1.0f / sqrtf((float) hd)), "kqv_out", il);
    cur = dfl_graph_ffn_rows(g, il, ggml_mul_mat(ctx, L->wo, cur));
    x = dfl_cb(ggml_add(ctx, cur, dfl_graph_ffn_rows(g, il, x)), "ffn_inp", il);

    cur = dfl_cb(dfl_rms_norm(ctx, x, L->ffn_norm, w->eps), "ffn_norm", il);
    cur = dfl_cb(dfl_ffn_swiglu(ctx, cur, L->ffn_gate, L->ffn_up, L->ffn_down), "ffn_out", il);
    return dfl_cb(ggml_add(ctx, cur, x), "l_out", il);
}

const dfl_arch dfl_arch_qwen2 = { "qwen2", "Qwen2", load_qwen2, build_layer };
const dfl_arch dfl_arch_qwen3 = { "qwen3", "Qwen3", load_qwen3, build_layer };
