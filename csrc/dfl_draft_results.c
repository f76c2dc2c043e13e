/* What a drafter's last propose is read as (its block, logits, candidates, confidence,
 * top-1 and top-k), and its worst step and graphs for the memory planner. */
#include "dfl_draft_state.h"
#include "dfl_pair.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

DFL_API dfl_status dfl_draft_block(const dfl_draft * d, int32_t seq, int32_t * dst, int32_t n) {
    TRY(dfl_draft_check_seq(d, seq));
    if (!dst) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (n < 1 || n > d->blocks.n[seq]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%d block tokens requested, the last propose made %d", n, d->blocks.n[seq]);
    }
    dfl_runtime_get(&d->rt, d->blocks.tokens[seq], dst, 0, (size_t) n * sizeof(int32_t));
    return DFL_OK;
}

DFL_API const dfl_token_source * dfl_draft_tokens(const dfl_draft * d) {
    return d ? &d->blocks : NULL;
}

static dfl_status check_out_rows(const dfl_draft * d, int32_t row0, int32_t n_rows, const void * dst) {
    if (!d || !dst) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > d->n_out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter rows %d..%d requested, the last propose produced %d", row0,
                        row0 + n_rows, d->n_out);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_logits(const dfl_draft * d, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_out_rows(d, row0, n_rows, dst));
    const size_t row = (size_t) d->m.n_vocab * sizeof(float);
    dfl_runtime_get(&d->rt, d->graph.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_set_sampling(dfl_draft * d, int32_t seq, const dfl_sampling * s) {
    TRY(dfl_draft_check_seq(d, seq));
    if (!s) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or settings");
    }
    if (s->temperature > 0.0f && d->m.greedy_only) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter drafts its own choices only (greedy): it cannot draw its "
                        "drafts", d->m.registry->name);
    }
    return dfl_sampler_set(&d->sampler[seq], s);
}

DFL_API dfl_status dfl_draft_set_uniforms(dfl_draft * d, int32_t seq, const float * u, int32_t n) {
    TRY(dfl_draft_check_seq(d, seq));
    return dfl_sampler_stage_uniforms(&d->sampler[seq], u, n);
}

DFL_API dfl_status dfl_draft_candidates(const dfl_draft * d, int32_t row0, int32_t n_rows, int32_t k,
                                        int32_t * tokens, float * probs) {
    if (!d || d->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "candidates: no propose yet");
    }
    return dfl_sampler_candidates(&d->rt, &d->graph.sampled, d->n_out, row0, n_rows, k, tokens, probs);
}

typedef struct cand {
    int32_t token;
    float logprob;
} cand;

static int cand_order(const void * a, const void * b) {
    const cand * x = a, * y = b;
    if (x->logprob != y->logprob) {
        return x->logprob > y->logprob ? -1 : 1;
    }
    return x->token < y->token ? -1 : x->token > y->token;
}

static dfl_status check_ranked_rows(const dfl_draft * d, int32_t row0, int32_t n_rows, const float * logprobs) {
    if (d && d->p.top_k == 0) {
        return dfl_fail(DFL_ERR_STATE, "the drafter was loaded with top_k = 0");
    }
    return check_out_rows(d, row0, n_rows, logprobs);
}

DFL_API dfl_status dfl_draft_confidence(const dfl_draft * d, int32_t row0, int32_t n_rows, float * out) {
    TRY(check_out_rows(d, row0, n_rows, out));
    if (!d->graph.confidence) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter has no confidence head", d->m.registry->name);
    }
    dfl_runtime_get(&d->rt, d->graph.confidence, out, (size_t) row0 * sizeof(float), (size_t) n_rows * sizeof(float));
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_top1(const dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    TRY(check_ranked_rows(d, row0, n_rows, logprobs));
    if (tokens) {
        dfl_runtime_get(&d->rt, d->graph.argmax, tokens, (size_t) row0 * sizeof(int32_t), (size_t) n_rows * sizeof(int32_t));
    }
    dfl_runtime_get(&d->rt, d->graph.argmax_lp, logprobs, (size_t) row0 * sizeof(float), (size_t) n_rows * sizeof(float));
    return DFL_OK;
}

/* A leaf of ctx over a [V, rows] result of the propose graph, where that graph left it */
static struct ggml_tensor * in_place(struct ggml_context * ctx, const struct ggml_tensor * x) {
    struct ggml_tensor * in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1]);
    return ggml_backend_tensor_alloc(x->buffer, in, x->data) == GGML_STATUS_SUCCESS ? in : NULL;
}

/* The last propose's candidates on the device, ranked once per propose: the rank graph
 * reads the propose graph's logits and softmax where that graph left them (slot 0 keeps
 * its memory until the next propose). */
static dfl_status rank_last_propose(dfl_draft * d) {
    rank_graph * r = &d->rank;
    if (r->fresh) {
        return DFL_OK;
    }
    if (!r->valid) {
        struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 1);
        struct ggml_tensor * logits = in_place(ctx, d->graph.logits), * probs = in_place(ctx, d->graph.probs);
        if (!logits || !probs) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot read the drafter's logits in place");
        }
        dfl_draft_build_rank(d, ctx, logits, probs, r);
        d->n_graph_builds++;
        TRY(dfl_runtime_alloc(&d->rt, 1, r->gf));
        r->valid = true;
    }
    d->n_graphs++;
    TRY(dfl_runtime_compute(&d->rt, 1, r->gf));
    d->n_step_nodes += d->rt.n_last_nodes;
    r->fresh = true;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_topk(dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    TRY(check_ranked_rows(d, row0, n_rows, logprobs));
    if (!tokens) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    const int K = d->p.top_k;
    if (K == 1) {
        return dfl_draft_top1(d, row0, n_rows, tokens, logprobs);
    }
    TRY(rank_last_propose(d));
    dfl_runtime_get(&d->rt, d->rank.topk, tokens, (size_t) row0 * K * sizeof(int32_t), (size_t) n_rows * K * sizeof(int32_t));
    dfl_runtime_get(&d->rt, d->rank.topk_lp, logprobs, (size_t) row0 * K * sizeof(float), (size_t) n_rows * K * sizeof(float));
    cand c[64];
    for (int r = 0; r < n_rows; r++) {
        for (int i = 0; i < K; i++) {
            c[i].token = tokens[r * K + i];
            c[i].logprob = logprobs[r * K + i];
        }
        qsort(c, (size_t) K, sizeof c[0], cand_order); /* ggml_top_k leaves them unordered */
        for (int i = 0; i < K; i++) {
            tokens[r * K + i] = c[i].token;
            logprobs[r * K + i] = c[i].logprob;
        }
    }
    return DFL_OK;
}

/* ---- for the memory planner ------------------------------------------------------------- */

dfl_draft_step dfl_draft_worst_step(const dfl_draft * d, bool entries_only) {
    dfl_draft_step step;
    memset(&step, 0, sizeof step);
    const int B = d->m.block_size, ring = dfl_memory_kv_rows(&d->mem, 0);
    if (entries_only) {
        step.n_parts = 1;
        step.part[0] = (dfl_draft_part) { 0, dfl_target_n_ubatch(d->target), 0, 0 };
        return step;
    }
    step.n_parts = d->n_seq;
    for (int i = 0; i < d->n_seq; i++) {
        step.part[i] = (dfl_draft_part) { i, B, B, ring < d->n_ctx ? ring : d->n_ctx };
    }
    /* drafts drawn over the whole vocabulary, unless the drafter only ever picks its own */
    step.samp.pick = d->m.greedy_only ? DFL_PICK_ARGMAX : DFL_PICK_FULL;
    step.samp.by_sort = d->rt.top_k_by_sort;
    return step;
}

dfl_status dfl_draft_worst_graphs(dfl_draft * d, dfl_graph_visit visit, void * user, ggml_backend_buffer_t rank_inputs) {
    draft_inputs in;
    const dfl_draft_step chunk = dfl_draft_worst_step(d, true), worst = dfl_draft_worst_step(d, false);
    dfl_draft_build_graph(d, &chunk, dfl_runtime_begin_graph(&d->rt, 0), &in);
    visit(&d->rt, 0, in.gf, user);
    dfl_draft_build_graph(d, &worst, dfl_runtime_begin_graph(&d->rt, 0), &in);
    visit(&d->rt, 0, in.gf, user);
    if (d->p.top_k <= 1) {
        return DFL_OK;
    }
    struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 1);
    struct ggml_tensor * logits, * probs;
    if (rank_inputs) {
        logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d->m.n_vocab, dfl_draft_step_drafted(&worst));
        probs = ggml_dup_tensor(ctx, logits);
        dfl_runtime_place_dummy(logits, rank_inputs);
        dfl_runtime_place_dummy(probs, rank_inputs);
    } else {
        logits = in_place(ctx, in.logits);
        probs = in_place(ctx, in.probs);
        if (!logits || !probs) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot read the drafter's logits in place");
        }
    }
    rank_graph r;
    dfl_draft_build_rank(d, ctx, logits, probs, &r);
    visit(&d->rt, 1, r.gf, user);
    return DFL_OK;
}
