/* Drafter graphs: the propose graph of a step's descriptor over the architecture's
 * builder, and the services that builder calls (the entries' features, storing keys and
 * values in the drafter's memory, attention over each sequence's cache, the drafted
 * rows, the blocks). A graph is a function of the drafter, its memory and the
 * descriptor: nothing here writes to the drafter. */
#include "dfl_draft_state.h"

#include <math.h>
#include <string.h>

/* What the services need to know about the graph being built. */
typedef struct draft_build {
    const dfl_draft * d;
    const dfl_draft_step * step;
    draft_inputs * in;
    /* each cached layer's K and V after the rows stored so far in this graph: the next
     * store writes after them, and attention reads them */
    struct ggml_tensor * k_stored[DFL_DRAFTER_MAX_LAYERS], * v_stored[DFL_DRAFTER_MAX_LAYERS];
} draft_build;

int dfl_draft_step_entries(const dfl_draft_step * step) {
    int n = 0;
    for (int i = 0; i < step->n_parts; i++) {
        n += step->part[i].entry_rows;
    }
    return n;
}

int dfl_draft_step_drafted(const dfl_draft_step * step) {
    int n = 0;
    for (int i = 0; i < step->n_parts; i++) {
        n += step->part[i].n_block > 0 ? step->part[i].n_block - 1 : 0;
    }
    return n;
}

int dfl_draft_block_rows(const dfl_drafter * m, int n_block) {
    return n_block == 0 ? 0 : m->autoregressive ? 1 : m->anchor_first ? n_block - 1 : n_block;
}

int dfl_draft_first_drafted(const dfl_drafter * m) {
    return m->anchor_first ? 0 : 1;
}

int dfl_draft_step_rows(const dfl_drafter * m, const dfl_draft_step * step) {
    int n = 0;
    for (int i = 0; i < step->n_parts; i++) {
        n += dfl_draft_block_rows(m, step->part[i].n_block);
    }
    return n;
}

int dfl_draft_step_passes(const dfl_drafter * m, const dfl_draft_step * step) {
    int n = 0;
    for (int i = 0; i < step->n_parts; i++) {
        const int passes = m->autoregressive ? step->part[i].n_block - 1 : step->part[i].n_block > 0;
        n = passes > n ? passes : n;
    }
    return n;
}

static int first_row(const dfl_drafter * m, const dfl_draft_step * step, int part) {
    int row = 0;
    for (int i = 0; i < part; i++) {
        row += dfl_draft_block_rows(m, step->part[i].n_block);
    }
    return row;
}

static struct ggml_tensor * new_input(struct ggml_context * ctx, enum ggml_type type, int64_t n) {
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_input(x);
    return x;
}

static struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x) {
    return acc ? ggml_concat(ctx, acc, x, 1) : x;
}

struct ggml_tensor * dfl_draft_rows(struct ggml_context * ctx, struct ggml_tensor * x, int64_t row0, int64_t n) {
    return row0 == 0 && n == x->ne[1] ? x : ggml_view_2d(ctx, x, x->ne[0], n, x->nb[1], (size_t) row0 * x->nb[1]);
}

/* ---- services ------------------------------------------------------------------------ */

struct ggml_tensor * dfl_draft_scatter_vocab(struct ggml_context * ctx, struct ggml_tensor * out,
                                             struct ggml_tensor * ids, int64_t n_vocab) {
    const int64_t n_kept = out->ne[0], n = out->ne[1];
    struct ggml_tensor * all = ggml_fill(ctx, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, n_vocab, n), -INFINITY);
    all = ggml_set_rows(ctx, all, ggml_reshape_3d(ctx, out, 1, n_kept, n), ggml_reshape_3d(ctx, ids, n_kept, 1, 1));
    return ggml_reshape_2d(ctx, all, n_vocab, n);
}

struct ggml_tensor * dfl_draft_graph_pos(dfl_draft_graph * g, int pass) {
    const draft_build * b = g->runtime;
    return ggml_view_1d(g->ctx, b->in->pos, g->n_rows, (size_t) pass * g->n_rows * sizeof(int32_t));
}

static void store(dfl_draft_graph * g, int il, struct ggml_tensor * k, struct ggml_tensor * v,
                  struct ggml_tensor * cells) {
    draft_build * b = g->runtime;
    const dfl_memory * mem = &b->d->mem;
    const int64_t n = k->ne[2], kv_dim = k->ne[0] * k->ne[1];
    struct ggml_tensor * kc = b->k_stored[il] ? b->k_stored[il] : mem->k[il];
    struct ggml_tensor * vc = b->v_stored[il] ? b->v_stored[il] : mem->v[il];
    b->k_stored[il] = ggml_set_rows(g->ctx, kc, ggml_reshape_2d(g->ctx, k, kv_dim, n), cells);
    b->v_stored[il] = ggml_set_rows(g->ctx, vc, ggml_reshape_2d(g->ctx, v, kv_dim, n), cells);
    ggml_build_forward_expand(g->gf, b->k_stored[il]);
    ggml_build_forward_expand(g->gf, b->v_stored[il]);
}

void dfl_draft_graph_store_context(dfl_draft_graph * g, int il, struct ggml_tensor * k, struct ggml_tensor * v) {
    const draft_build * b = g->runtime;
    store(g, il, k, v, b->in->entry_cells);
}

struct ggml_tensor * dfl_draft_graph_attention(dfl_draft_graph * g, int pass, int il, struct ggml_tensor * q,
                                               struct ggml_tensor * k, struct ggml_tensor * v, float scale) {
    draft_build * b = g->runtime;
    const dfl_draft * d = b->d;
    const dfl_drafter * m = &d->m;
    struct ggml_context * ctx = g->ctx;
    const size_t i64 = sizeof(int64_t);
    store(g, il, k, v, ggml_view_1d(ctx, b->in->cells, g->n_rows, (size_t) pass * g->n_rows * i64));
    struct ggml_tensor * kc = b->k_stored[il], * vc = b->v_stored[il];
    const int64_t hd = m->attn[il].head_dim_k, n_head_kv = m->attn[il].n_head_kv;
    struct ggml_tensor * out = NULL;
    for (int i = 0; i < b->step->n_parts; i++) {
        const dfl_draft_part * part = &b->step->part[i];
        if (part->n_block == 0) {
            continue;
        }
        const int rows = dfl_draft_block_rows(m, part->n_block), row0 = first_row(m, b->step, i);
        const size_t base = (size_t) dfl_memory_kv_base(&d->mem, il, part->seq) * kc->nb[1];
        struct ggml_tensor * K = ggml_view_3d(ctx, kc, hd, n_head_kv, part->n_kv, ggml_row_size(kc->type, hd),
                                              kc->nb[1], base);
        struct ggml_tensor * V = ggml_view_3d(ctx, vc, hd, n_head_kv, part->n_kv, ggml_row_size(vc->type, hd),
                                              vc->nb[1], base);
        struct ggml_tensor * qs = rows == g->n_rows ? q :
            ggml_view_3d(ctx, q, q->ne[0], q->ne[1], rows, q->nb[1], q->nb[2], (size_t) row0 * q->nb[2]);
        struct ggml_tensor * mask = b->in->mask[i][m->layer_mask[il]];
        if (m->autoregressive) {
            mask = ggml_view_2d(ctx, mask, mask->ne[0], 1, mask->nb[1], (size_t) pass * mask->nb[1]);
        }
        struct ggml_tensor * o = ggml_flash_attn_ext(ctx, ggml_permute(ctx, qs, 0, 2, 1, 3),
                                                     ggml_permute(ctx, K, 0, 2, 1, 3),
                                                     ggml_permute(ctx, V, 0, 2, 1, 3), mask, scale, 0.0f, 0.0f);
        ggml_prec_set_acc(o, GGML_PREC_F32);
        out = join(ctx, out, ggml_reshape_2d(ctx, o, hd * q->ne[1], rows));
    }
    return out;
}

struct ggml_tensor * dfl_draft_graph_drafted(dfl_draft_graph * g, struct ggml_tensor * x) {
    const draft_build * b = g->runtime;
    if (!b->in->drafted) {
        /* one sequence: its block's rows after the bonus, or all of them (its passes, or an
         * anchor-first block) */
        const int skip = b->d->m.autoregressive ? 0 : dfl_draft_first_drafted(&b->d->m);
        return skip == 0 ? x : ggml_view_2d(g->ctx, x, x->ne[0], x->ne[1] - skip, x->nb[1], (size_t) skip * x->nb[1]);
    }
    return ggml_get_rows(g->ctx, x, b->in->drafted);
}

void dfl_draft_graph_put(dfl_draft_graph * g, int part, int first, struct ggml_tensor * tokens) {
    const draft_build * b = g->runtime;
    struct ggml_tensor * block = b->d->blocks.tokens[b->step->part[part].seq];
    struct ggml_tensor * dst = ggml_view_1d(g->ctx, block, tokens->ne[0], (size_t) (1 + first) * sizeof(int32_t));
    ggml_build_forward_expand(g->gf, ggml_cpy(g->ctx, tokens, dst));
}

int dfl_draft_graph_part_row(const dfl_draft_graph * g, int part) {
    const draft_build * b = g->runtime;
    return first_row(&b->d->m, b->step, part);
}

/* ---- the graph ------------------------------------------------------------------------- */

/* The entries' features: the target's feature rows of each entry's position, or of the
 * position before it (feat_previous), the first entry of each part taking what its slot
 * carries from its last graph. Sets g->last_features: each drafting part's features of
 * the position before its bonus, which the slot carries on. */
static void entry_features(const dfl_draft * d, const dfl_draft_step * step, dfl_draft_graph * g,
                           draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    struct ggml_context * ctx = g->ctx;
    struct ggml_tensor * features = dfl_target_feature_tensor(d->target);
    struct ggml_tensor * x = ggml_get_rows(ctx, features, in->entry_rows);
    g->last_features = NULL;
    if (m->feat_previous) {
        const int P = step->n_parts;
        in->carry_rows = new_input(ctx, GGML_TYPE_I32, P);
        in->carry_slots = new_input(ctx, GGML_TYPE_I64, P);
        in->first_entry = new_input(ctx, GGML_TYPE_I64, P);
        in->last_row = new_input(ctx, GGML_TYPE_I32, P);
        in->has_entries = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, P);
        in->no_entries = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, P);
        ggml_set_input(in->has_entries);
        ggml_set_input(in->no_entries);
        struct ggml_tensor * carried = ggml_get_rows(ctx, d->mem.state, in->carry_rows);
        x = ggml_set_rows(ctx, x, carried, in->first_entry);
        /* a part without entries carries on what it carried (times 1, plus 0: exact) */
        struct ggml_tensor * last = ggml_add(ctx, ggml_mul(ctx, ggml_get_rows(ctx, features, in->last_row),
                                                          in->has_entries),
                                             ggml_mul(ctx, carried, in->no_entries));
        ggml_build_forward_expand(g->gf, ggml_set_rows(ctx, d->mem.state, last, in->carry_slots));
        g->last_features = last;
        if (g->n_rows > 0 && g->n_rows < P) {
            in->block_parts = new_input(ctx, GGML_TYPE_I32, g->n_rows);
            g->last_features = ggml_get_rows(ctx, last, in->block_parts);
        }
    }
    g->entry_features = x;
}

void dfl_draft_build_graph(const dfl_draft * d, const dfl_draft_step * step, struct ggml_context * ctx,
                           draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    memset(in, 0, sizeof *in);
    struct ggml_cgraph * gf = in->gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
    draft_build b = { d, step, in, { NULL }, { NULL } };
    dfl_draft_graph g = { ctx, gf, step, dfl_draft_step_entries(step), NULL, NULL, NULL,
                          dfl_draft_step_passes(m, step), dfl_draft_step_rows(m, step), NULL, NULL,
                          d->rt.top_k_by_sort, NULL, &b };
    const int E = g.n_entries, R = g.n_rows, D = dfl_draft_step_drafted(step);
    if (E > 0) {
        in->entry_rows = new_input(ctx, GGML_TYPE_I32, E);
        in->entry_pos = g.entry_pos = new_input(ctx, GGML_TYPE_I32, E);
        in->entry_cells = new_input(ctx, GGML_TYPE_I64, E);
        if (m->reads_tokens) {
            in->entry_tokens = g.entry_tokens = new_input(ctx, GGML_TYPE_I32, E);
        }
        entry_features(d, step, &g, in);
    }
    int n_parts_drafting = 0;
    if (R > 0) {
        in->tokens = g.tokens = new_input(ctx, GGML_TYPE_I32, R);
        in->pos = new_input(ctx, GGML_TYPE_I32, (int64_t) g.n_pass * R);
        in->cells = new_input(ctx, GGML_TYPE_I64, (int64_t) g.n_pass * R);
        for (int i = 0; i < step->n_parts; i++) {
            const dfl_draft_part * part = &step->part[i];
            if (part->n_block == 0) {
                continue;
            }
            n_parts_drafting++;
            for (int k = 0; k < m->n_masks; k++) {
                const int rows = m->autoregressive ? g.n_pass : dfl_draft_block_rows(m, part->n_block);
                in->mask[i][k] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, part->n_kv, rows);
                ggml_set_input(in->mask[i][k]);
            }
        }
        if (n_parts_drafting > 1) {
            in->drafted = new_input(ctx, GGML_TYPE_I32, D);
        }
    }
    bool own = false;
    struct ggml_tensor * logits = m->arch->build(m, &g, &own);
    if (!logits) {
        return; /* entries only */
    }
    in->logits = logits;
    if (g.confidence) {
        in->confidence = g.confidence;
        ggml_set_output(g.confidence);
        ggml_build_forward_expand(gf, g.confidence);
    }
    in->argmax = ggml_argmax(ctx, logits);
    ggml_set_output(logits);
    ggml_set_output(in->argmax);
    ggml_build_forward_expand(gf, in->argmax);
    if (d->p.top_k > 0) {
        in->probs = ggml_soft_max(ctx, logits);
        /* [1, 1, D]: the log of the softmax at the argmax */
        in->argmax_lp = ggml_log(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, in->probs, 1, logits->ne[0], D),
                                                    ggml_reshape_2d(ctx, in->argmax, 1, D)));
        ggml_set_output(in->probs); /* the rank graph reads it */
        ggml_set_output(in->argmax_lp);
        ggml_build_forward_expand(gf, in->argmax_lp);
    }
    if (own) {
        return;
    }
    struct ggml_tensor * drafts = in->argmax;
    if (step->samp.pick != DFL_PICK_ARGMAX) {
        drafts = dfl_sampler_build(ctx, gf, logits, &step->samp, &in->sampled);
    }
    for (int i = 0, row0 = 0; i < step->n_parts; i++) {
        const int n = step->part[i].n_block - 1;
        if (n > 0) {
            dfl_draft_graph_put(&g, i, 0, ggml_view_1d(ctx, drafts, n, (size_t) row0 * sizeof(int32_t)));
            row0 += n;
        }
    }
}

/* The rank graph over `logits` and `probs` [V, rows], leaves of ctx that hold (or stand
 * for) the propose graph's: only top_k numbers per position cross to the host, never
 * the vocabulary. */
void dfl_draft_build_rank(const dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * logits,
                          struct ggml_tensor * probs, rank_graph * r) {
    r->gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
    r->topk = dfl_top_k(d->rt.top_k_by_sort, ctx, logits, d->p.top_k);
    r->topk_lp = ggml_log(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, probs->ne[0], probs->ne[1]), r->topk));
    ggml_set_output(r->topk);
    ggml_set_output(r->topk_lp);
    ggml_build_forward_expand(r->gf, r->topk_lp);
}

struct ggml_tensor * dfl_draft_graph_pass_drafts(dfl_draft_graph * g, int pass, struct ggml_tensor * out,
                                                 struct ggml_tensor ** logits) {
    struct ggml_context * ctx = g->ctx;
    struct ggml_tensor * picks = ggml_argmax(ctx, out);
    for (int i = 0; i < g->step->n_parts; i++) {
        if (pass < g->step->part[i].n_block - 1) {
            dfl_draft_graph_put(g, i, pass, ggml_view_1d(ctx, picks, 1,
                                                         (size_t) dfl_draft_graph_part_row(g, i) * sizeof(int32_t)));
        }
    }
    *logits = *logits ? ggml_concat(ctx, *logits, out, 1) : out;
    return picks;
}
