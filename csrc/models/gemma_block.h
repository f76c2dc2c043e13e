/* The transformer block Gemma 3 and Gemma 4 share (llama.cpp's tensor names): attention
 * with RMS-normed q and k, and a GELU-tanh gated FFN, each between a norm before it and a
 * norm after it on the residual stream. */
#ifndef DFL_GEMMA_BLOCK_H
#define DFL_GEMMA_BLOCK_H

#include "../dfl_model.h"

typedef struct dfl_gemma_block {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm, * post_attn_norm;
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down, * post_ffn_norm;
} dfl_gemma_block;

/* Layer il's block weights: q [hd * n_head], k and v [hd * n_head_kv]. own_kv: k and its
 * norm are required (else absent: the layer reads another's cache); v_required: v too
 * (else a missing v leaves wv NULL, Gemma 4's K = V layers). */
dfl_status dfl_gemma_block_load(const dfl_model * m, int il, int hd, int n_head, int n_head_kv, int n_ff, bool own_kv,
                                bool v_required, dfl_gemma_block * b);

/* down(gelu_tanh(gate x) * up x). ggml_gelu: ggml's fused GELU-gated op, as llama.cpp's
 * build_ffn computes it (its CPU kernel reads an f16-indexed table: equal to llama.cpp to
 * its printing, 5e-4 from transformers' f32 tanh); else the tanh form in f32 ops, as
 * transformers computes it. */
struct ggml_tensor * dfl_gemma_ffn(struct ggml_context * ctx, const dfl_gemma_block * b, struct ggml_tensor * x,
                                   bool ggml_gelu);

/* residual + post_norm(out): a sublayer's output added back to the stream. The normed
 * output and the sum are named (dfl_cb) norm_name and sum_name in layer il, as the
 * model's llama.cpp builder names them (Gemma 3: attn_post_norm and sa_out, then
 * ffn_post_norm and l_out; Gemma 4: attn_post_norm and attn_out, then ffn_post_norm); a NULL sum_name leaves
 * the sum unnamed. */
struct ggml_tensor * dfl_gemma_add_normed(struct ggml_context * ctx, struct ggml_tensor * out, struct ggml_tensor * post_norm,
                                          struct ggml_tensor * residual, float eps, int il, const char * norm_name,
                                          const char * sum_name);

/* The attention sublayer's residual + post_norm(out), named attn_post_norm and sum_name,
 * with both terms of the sum cut to the rows the FFN after it runs on
 * (dfl_graph_ffn_rows) once the norm is named: where llama.cpp cuts them. */
struct ggml_tensor * dfl_gemma_attn_residual(dfl_graph * g, struct ggml_tensor * out, struct ggml_tensor * post_norm,
                                             struct ggml_tensor * residual, float eps, int il, const char * sum_name);

#endif
