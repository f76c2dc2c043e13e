/* The block Gemma 3 and Gemma 4 share (see gemma_block.h). */
#include "gemma_block.h"

dfl_status dfl_gemma_block_load(const dfl_model * m, int il, int hd, int n_head, int n_head_kv, int n_ff, bool own_kv,
                                bool v_required, dfl_gemma_block * b) {
    const int64_t E = m->n_embd, q_dim = (int64_t) hd * n_head, kv_dim = (int64_t) hd * n_head_kv;
    TRY(dfl_model_tensor(m, "attn_norm.weight", il, E, 0, 0, true, &b->attn_norm));
    TRY(dfl_model_tensor(m, "attn_q.weight", il, E, q_dim, 0, true, &b->wq));
    TRY(dfl_model_tensor(m, "attn_k.weight", il, E, kv_dim, 0, own_kv, &b->wk));
    TRY(dfl_model_tensor(m, "attn_v.weight", il, E, kv_dim, 0, own_kv && v_required, &b->wv));
    TRY(dfl_model_tensor(m, "attn_output.weight", il, q_dim, E, 0, true, &b->wo));
    TRY(dfl_model_tensor(m, "attn_q_norm.weight", il, hd, 0, 0, true, &b->q_norm));
    TRY(dfl_model_tensor(m, "attn_k_norm.weight", il, hd, 0, 0, own_kv, &b->k_norm));
    TRY(dfl_model_tensor(m, "post_attention_norm.weight", il, E, 0, 0, true, &b->post_attn_norm));
    TRY(dfl_model_tensor(m, "ffn_norm.weight", il, E, 0, 0, true, &b->ffn_norm));
    TRY(dfl_model_tensor(m, "ffn_gate.weight", il, E, n_ff, 0, true, &b->ffn_gate));
    TRY(dfl_model_tensor(m, "ffn_up.weight", il, E, n_ff, 0, true, &b->ffn_up));
    TRY(dfl_model_tensor(m, "ffn_down.weight", il, n_ff, E, 0, true, &b->ffn_down));
    TRY(dfl_model_tensor(m, "post_ffw_norm.weight", il, E, 0, 0, true, &b->post_ffn_norm));
    return DFL_OK;
}

struct ggml_tensor * dfl_gemma_ffn(struct ggml_context * ctx, const dfl_gemma_block * b, struct ggml_tensor * x,
                                   bool ggml_gelu) {
    struct ggml_tensor * gate = ggml_mul_mat(ctx, b->ffn_gate, x), * up = ggml_mul_mat(ctx, b->ffn_up, x);
    struct ggml_tensor * h = ggml_gelu ? ggml_geglu_split(ctx, gate, up) : ggml_mul(ctx, dfl_gelu_tanh(ctx, gate), up);
    return ggml_mul_mat(ctx, b->ffn_down, h);
}

/* residual + post_norm(out); cut: both terms through dfl_graph_ffn_rows (NULL: none) */
static struct ggml_tensor * add_normed(struct ggml_context * ctx, dfl_graph * cut, struct ggml_tensor * out,
                                       struct ggml_tensor * post_norm, struct ggml_tensor * residual, float eps, int il,
                                       const char * norm_name, const char * sum_name) {
    struct ggml_tensor * normed = dfl_cb(dfl_rms_norm(ctx, out, post_norm, eps), norm_name, il);
    if (cut) {
        normed = dfl_graph_ffn_rows(cut, il, normed);
        residual = dfl_graph_ffn_rows(cut, il, residual);
    }
    struct ggml_tensor * sum = ggml_add(ctx, normed, residual);
    return sum_name ? dfl_cb(sum, sum_name, il) : sum;
}

struct ggml_tensor * dfl_gemma_add_normed(struct ggml_context * ctx, struct ggml_tensor * out, struct ggml_tensor * post_norm,
                                          struct ggml_tensor * residual, float eps, int il, const char * norm_name,
                                          const char * sum_name) {
    return add_normed(ctx, NULL, out, post_norm, residual, eps, il, norm_name, sum_name);
}

struct ggml_tensor * dfl_gemma_attn_residual(dfl_graph * g, struct ggml_tensor * out, struct ggml_tensor * post_norm,
                                             struct ggml_tensor * residual, float eps, int il, const char * sum_name) {
    return add_normed(g->ctx, g, out, post_norm, residual, eps, il, "attn_post_norm", sum_name);
}
