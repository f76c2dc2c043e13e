/* Qwen3.5 hybrid target: hyperparameters and weights as llama.cpp's qwen35 GGUF
 * layout stores them. */
#ifndef DFL_QWEN35_H
#define DFL_QWEN35_H

#include "dfl_gguf.h"

#define DFL_MAX_LAYERS 256

typedef struct dfl_qwen35_layer {
    bool recurrent;
    struct ggml_tensor * attn_norm;
    struct ggml_tensor * post_norm;
    /* full attention */
    struct ggml_tensor * wq;      /* [n_embd, 2 * head_dim * n_head]: per head [q, gate] */
    struct ggml_tensor * wk;
    struct ggml_tensor * wv;
    struct ggml_tensor * wo;
    struct ggml_tensor * q_norm;
    struct ggml_tensor * k_norm;
    /* gated delta net */
    struct ggml_tensor * wqkv;    /* [n_embd, conv_channels] */
    struct ggml_tensor * wz;      /* [n_embd, d_inner] */
    struct ggml_tensor * conv1d;  /* [d_conv, conv_channels] */
    struct ggml_tensor * dt_bias; /* [n_v_heads] */
    struct ggml_tensor * ssm_a;   /* [n_v_heads] = -exp(A_log) */
    struct ggml_tensor * w_beta;  /* [n_embd, n_v_heads] */
    struct ggml_tensor * w_alpha; /* [n_embd, n_v_heads] */
    struct ggml_tensor * ssm_norm;/* [head_v_dim] */
    struct ggml_tensor * ssm_out; /* [d_inner, n_embd] */
    /* feed-forward */
    struct ggml_tensor * ffn_gate;
    struct ggml_tensor * ffn_up;
    struct ggml_tensor * ffn_down;
} dfl_qwen35_layer;

typedef struct dfl_qwen35 {
    dfl_gguf file;
    int n_vocab, n_embd, n_layer, n_ff, n_ctx_train;
    int n_head, n_head_kv, head_dim, n_rot;
    float eps, rope_base;
    int d_conv, d_inner, n_k_heads, n_v_heads, head_k_dim, head_v_dim, conv_channels;
    int n_attn_layers, n_recurrent_layers;
    struct ggml_tensor * tok_embd;
    struct ggml_tensor * output_norm;
    struct ggml_tensor * output;  /* token embedding when tied */
    dfl_qwen35_layer layers[DFL_MAX_LAYERS];
} dfl_qwen35;

/* Read and validate metadata and tensor shapes (no weight data is touched). */
dfl_status dfl_qwen35_open(const char * path, dfl_qwen35 * m);

#endif
