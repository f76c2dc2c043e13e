/* Qwen3.5 mixture of experts (llama.cpp's qwen35moe layout): Qwen3.5's mixers, and an
 * FFN of routed experts (softmax router, top-k renormalised) plus a shared expert
 * scaled by a sigmoid gate. */
#include "qwen35.h"

#include <stdlib.h>

typedef struct qwen35moe_layer {
    qwen35_mixer mix;
    dfl_moe_weights moe;
    struct ggml_tensor * shexp_gate_inp; /* [n_embd]: one logit per row */
    struct ggml_tensor * shexp_gate, * shexp_up, * shexp_down;
} qwen35moe_layer;

typedef struct qwen35moe_weights {
    qwen35_hparams hp;
    qwen35moe_layer layers[];
} qwen35moe_weights;

static dfl_status load(dfl_model * m) {
    qwen35_hparams hp;
    int n_expert, n_used, n_ff_exp, n_ff_shexp;
    TRY(qwen35_read_hparams(m, &hp));
    TRY(dfl_model_key(m, ".expert_count", &n_expert));
    TRY(dfl_model_key(m, ".expert_used_count", &n_used));
    TRY(dfl_model_key(m, ".expert_feed_forward_length", &n_ff_exp));
    TRY(dfl_model_key(m, ".expert_shared_feed_forward_length", &n_ff_shexp));
    if (n_used > n_expert || n_expert > 1024) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %d experts used of %d", m->file.path, n_used, n_expert);
    }
    TRY(dfl_model_load_io(m));
    qwen35moe_weights * w = calloc(1, sizeof *w + (size_t) m->n_layer * sizeof w->layers[0]);
    if (!w) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    m->weights = w;
    w->hp = hp;
    const int64_t E = m->n_embd;
    for (int il = 0; il < m->n_layer; il++) {
        qwen35moe_layer * L = &w->layers[il];
        dfl_moe_weights * e = &L->moe;
        TRY(qwen35_load_mixer(m, &hp, il, &L->mix));
        e->n_expert = n_expert;
        e->n_used = n_used;
        TRY(dfl_model_tensor(m, "ffn_gate_inp.weight", il, E, n_expert, 0, true, &e->router));
        TRY(dfl_model_tensor(m, "ffn_gate_up_exps.weight", il, E, 2 * (int64_t) n_ff_exp, n_expert, false, &e->gate_up));
        TRY(dfl_model_tensor(m, "ffn_gate_exps.weight", il, E, n_ff_exp, n_expert, !e->gate_up, &e->gate));
        TRY(dfl_model_tensor(m, "ffn_up_exps.weight", il, E, n_ff_exp, n_expert, !e->gate_up, &e->up));
        TRY(dfl_model_tensor(m, "ffn_down_exps.weight", il, n_ff_exp, E, n_expert, true, &e->down));
        TRY(dfl_model_tensor(m, "ffn_gate_inp_shexp.weight", il, E, 0, 0, true, &L->shexp_gate_inp));
        TRY(dfl_model_tensor(m, "ffn_gate_shexp.weight", il, E, n_ff_shexp, 0, true, &L->shexp_gate));
        TRY(dfl_model_tensor(m, "ffn_up_shexp.weight", il, E, n_ff_shexp, 0, true, &L->shexp_up));
        TRY(dfl_model_tensor(m, "ffn_down_shexp.weight", il, n_ff_shexp, E, 0, true, &L->shexp_down));
    }
    return DFL_OK;
}

static struct ggml_tensor * build_layer(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x) {
    const qwen35moe_weights * w = m->weights;
    const qwen35moe_layer * L = &w->layers[il];
    struct ggml_context * ctx = g->ctx;
    x = qwen35_build_mixer(m, &w->hp, &L->mix, g, il, x);  /* every row's FFN, as qwen35's */
    /* named as llama.cpp's qwen35moe graph names them, for the parity tool */
    struct ggml_tensor * cur = dfl_cb(dfl_rms_norm(ctx, x, L->mix.post_norm, w->hp.eps), "attn_post_norm", il);
    struct ggml_tensor * routed = dfl_cb(dfl_moe_ffn(ctx, cur, &L->moe), "ffn_moe_out", il);
    struct ggml_tensor * shared = dfl_cb(dfl_ffn_swiglu(ctx, cur, L->shexp_gate, L->shexp_up, L->shexp_down),
                                         "ffn_shexp", il);
    struct ggml_tensor * gate = dfl_cb(ggml_sigmoid(ctx, ggml_mul_mat(ctx, L->shexp_gate_inp, cur)),
                                       "shared_expert_gate_sigmoid", il);
    shared = dfl_cb(ggml_mul(ctx, shared, gate), "ffn_shexp_gated", il);
    cur = dfl_cb(ggml_add(ctx, routed, shared), "ffn_out", il);
    return dfl_cb(ggml_add(ctx, cur, x), "l_out", il);
}

const dfl_arch dfl_arch_qwen35moe = { "qwen35moe", "Qwen3.5 MoE", load, build_layer };
