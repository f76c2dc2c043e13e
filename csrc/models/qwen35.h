/* Qwen3.5's token mixers (gated full attention and Gated DeltaNet), shared by the dense
 * (qwen35) and the mixture-of-experts (qwen35moe) models, which differ only in the FFN. */
#ifndef DFL_MODELS_QWEN35_H
#define DFL_MODELS_QWEN35_H

#include "../dfl_model.h"

typedef struct qwen35_hparams {
    int n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base;
} qwen35_hparams;

typedef struct qwen35_mixer {
    struct ggml_tensor * attn_norm, * post_norm;
    /* full attention */
    struct ggml_tensor * wq;      /* [n_embd, 2 * head_dim * n_head]: per head [q, gate] */
    struct ggml_tensor * wk, * wv, * wo, * q_norm, * k_norm;
    /* gated delta net */
    struct ggml_tensor * wqkv;    /* [n_embd, conv_channels] */
    struct ggml_tensor * wz;      /* [n_embd, d_inner] */
    struct ggml_tensor * conv1d;  /* [d_conv, conv_channels] */
    struct ggml_tensor * dt_bias; /* [n_v_heads] */
    struct ggml_tensor * ssm_a;   /* [n_v_heads] = -exp(A_log) */
    struct ggml_tensor * w_beta, * w_alpha; /* [n_embd, n_v_heads] */
    struct ggml_tensor * ssm_norm;/* [head_v_dim] */
    struct ggml_tensor * ssm_out; /* [d_inner, n_embd] */
} qwen35_mixer;

/* Everything but the FFN's hyperparameters: sizes, the layer pattern, the recurrent
 * geometry (sets m->n_embd, n_layer, n_ctx_train, eps, kind[], attn[], rec). */
dfl_status qwen35_read_hparams(dfl_model * m, qwen35_hparams * hp);
dfl_status qwen35_load_mixer(const dfl_model * m, const qwen35_hparams * hp, int il, qwen35_mixer * L);
/* x + mixer(attn_norm(x)); the caller adds its FFN over post_norm of the result. */
struct ggml_tensor * qwen35_build_mixer(const dfl_model * m, const qwen35_hparams * hp, const qwen35_mixer * L,
                                        dfl_graph * g, int il, struct ggml_tensor * x);

#endif
