/* Target graphs: the layer loop over the architecture's builders, the graph services
 * those builders call (attention over the cache, short convolution and delta rule with
 * their state), the pending commit carried at the start of a graph, and the inputs. */
#include "dfl_target_impl.h"

#include <math.h>
#include <string.h>

/* What the graph services need to know about the graph being built. */
typedef struct graph_build {
    dfl_target * t;
    graph_inputs * in;
    int n_kv;
    int n_kv_swa; /* ring rows the sliding layers attend over */
    bool verify; /* a chain verify: state moves only at commit */
    bool tree;   /* a tree verify: rows follow their parents */
} graph_build;

/* A recurrent layer's replay memory: what a verify keeps of its rows for the commit's
 * rerun, in four planes of n_verify + 1 columns, the last column always zero (a tree
 * commit's identity steps gather it: decay 0, update weight 0):
 *   conv  [conv_channels]  the activated convolution output: raw q and k, then v
 *   qk    [2 S_k H_k]      q and k normalised
 *   g     [H_v]            log-decay
 *   beta  [H_v]            update weight (right after g: a commit masks or gathers both at once)
 * The ops that make these write into their plane themselves (dfl_graph_delta_net). */
typedef struct replay_planes {
    int64_t cols;                 /* columns per plane */
    int64_t conv, qk, g, beta;    /* offsets in floats */
} replay_planes;

static replay_planes replay_planes_of(const dfl_model * m, int n_verify) {
    const dfl_recurrent_geometry * r = &m->rec;
    const int64_t cols = n_verify + 1, qk = 2 * (int64_t) r->head_k_dim * r->n_k_heads;
    replay_planes P = { cols, 0, r->conv_channels * cols, 0, 0 };
    P.g = P.qk + qk * cols;
    P.beta = P.g + r->n_v_heads * cols;
    return P;
}

int64_t dfl_target_replay_floats(const dfl_model * m, int n_verify) {
    const replay_planes P = replay_planes_of(m, n_verify);
    return P.beta + m->rec.n_v_heads * P.cols;
}

/* ---- graph services ------------------------------------------------------------------ */

struct ggml_tensor * dfl_graph_attention(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, float scale) {
    const graph_build * b = g->runtime;
    dfl_target * t = b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_attention_geometry * a = &t->m.attn[il];
    const bool ring = a->window > 0;
    const int n = g->n, n_kv = ring ? b->n_kv_swa : b->n_kv;
    struct ggml_tensor * slots = ring ? b->in->slots_swa : b->in->slots;
    const int src = a->shares_kv ? a->kv_layer : il;
    const int64_t hd_k = t->m.attn[src].head_dim_k, hd_v = t->m.attn[src].head_dim_v, n_head_kv = t->m.attn[src].n_head_kv;

    struct ggml_tensor * kc, * vc;
    if (a->shares_kv) {
        kc = t->k_stored[src];
        vc = t->v_stored[src];
    } else {
        kc = ggml_set_rows(ctx, t->k_cache[il], ggml_reshape_2d(ctx, k, hd_k * n_head_kv, n), slots);
        vc = ggml_set_rows(ctx, t->v_cache[il], ggml_reshape_2d(ctx, v, hd_v * n_head_kv, n), slots);
        ggml_build_forward_expand(g->gf, kc);
        ggml_build_forward_expand(g->gf, vc);
        t->k_stored[il] = kc;
        t->v_stored[il] = vc;
    }

    struct ggml_tensor * K = ggml_view_3d(ctx, kc, hd_k, n_head_kv, n_kv, ggml_row_size(kc->type, hd_k), kc->nb[1], 0);
    struct ggml_tensor * V = ggml_view_3d(ctx, vc, hd_v, n_head_kv, n_kv, ggml_row_size(vc->type, hd_v), vc->nb[1], 0);
    struct ggml_tensor * mask = ring ? b->in->mask_swa : b->in->mask;
    struct ggml_tensor * o = ggml_flash_attn_ext(ctx, ggml_permute(ctx, q, 0, 2, 1, 3), ggml_permute(ctx, K, 0, 2, 1, 3),
                                                 ggml_permute(ctx, V, 0, 2, 1, 3), mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(o, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, o, hd_v * q->ne[1], n);
}

/* An op's result written straight into runtime memory (the start of a state tensor on
 * the same device) instead of the graph's compute memory: no copy node. The address is
 * only handed to ggml, never dereferenced here. The memory planner's placeholder state
 * has no addresses: there the result stays in compute memory, which it then measures. */
static void write_into(struct ggml_tensor * node, struct ggml_tensor * dst, size_t offset) {
    GGML_ASSERT(ggml_is_contiguous(node) && offset + ggml_nbytes(node) <= ggml_nbytes(dst));
    if (dst->data) {
        ggml_backend_tensor_alloc(dst->buffer, node, (char *) dst->data + offset);
    }
}

/* An op result of n elements that can be written into runtime memory: not a view, not
 * placed yet, contiguous. */
static bool placeable(const struct ggml_tensor * node, int64_t n) {
    return node && node->op != GGML_OP_NONE && !node->view_src && !node->data && !node->buffer &&
           ggml_is_contiguous(node) && ggml_nelements(node) == n;
}

/* x [C, L, m] (C channels a column, any column and sequence strides) as [L, C, m], time
 * along rows as ssm_conv reads it: one concat of its first W columns and the rest, both
 * permuted, copies element by element where ggml_cont of the permutation would call
 * memcpy for every element (half the instructions on the CPU backend). */
static struct ggml_tensor * time_major(struct ggml_context * ctx, struct ggml_tensor * x, int64_t W) {
    struct ggml_tensor * a = ggml_view_3d(ctx, x, x->ne[0], W, x->ne[2], x->nb[1], x->nb[2], 0);
    struct ggml_tensor * b = ggml_view_3d(ctx, x, x->ne[0], x->ne[1] - W, x->ne[2], x->nb[1], x->nb[2], W * x->nb[1]);
    return ggml_concat(ctx, ggml_permute(ctx, a, 1, 0, 2, 3), ggml_permute(ctx, b, 1, 0, 2, 3), 0);
}

/* Decode and chain verify: [last W committed inputs | this call's inputs] along time.
 * A decode moves the conv state on; a verify keeps the inputs for its commit. A tree
 * runs its spine as a sequence and the nodes off it on windows of their ancestors. */
struct ggml_tensor * dfl_graph_short_conv(dfl_graph * g, int il, struct ggml_tensor * x, struct ggml_tensor * kernel) {
    const graph_build * b = g->runtime;
    dfl_target * t = b->t;
    struct ggml_context * ctx = g->ctx;
    const int64_t C = t->m.rec.conv_channels, W = t->m.rec.d_conv - 1, n = g->n;
    const size_t f32 = sizeof(float);

    if (b->tree) {
        /* [committed conv inputs | node inputs], one column per time step, kept for
         * commit; gathered from it (tree_conv_spine): the committed inputs and the
         * spine, convolved as one sequence as the chain is, then each node off the spine
         * on its own window (its ancestors' inputs, oldest first), a sequence of one
         * step; or every node on its own window. Every node gets the chain's
         * arithmetic; the outputs are put in node order. */
        const tree_shape sh = t->tree.shape;
        struct ggml_tensor * cat = ggml_concat(ctx, ggml_transpose(ctx, t->conv_state[il]), x, 1);
        write_into(cat, t->conv_scratch[il], 0);
        struct ggml_tensor * rows = ggml_get_rows(ctx, cat, b->in->conv_rows);
        if (!b->in->conv_out) {
            struct ggml_tensor * win = time_major(ctx, ggml_reshape_3d(ctx, rows, C, W + 1, n), W);
            return ggml_reshape_2d(ctx, ggml_ssm_conv(ctx, win, kernel), C, n);
        }
        const size_t col = rows->nb[1];
        struct ggml_tensor * seq = ggml_view_3d(ctx, rows, C, W + sh.spine, 1, col, (W + sh.spine) * col, 0);
        seq = ggml_ssm_conv(ctx, time_major(ctx, seq, W), kernel);
        struct ggml_tensor * out = ggml_get_rows(ctx, ggml_reshape_2d(ctx, seq, C, sh.spine), b->in->conv_out);
        if (sh.off > 0) {
            struct ggml_tensor * win = ggml_view_3d(ctx, rows, C, W + 1, sh.off, col, (W + 1) * col, (W + sh.spine) * col);
            win = ggml_ssm_conv(ctx, time_major(ctx, win, W), kernel);
            out = ggml_set_rows(ctx, out, ggml_reshape_2d(ctx, win, C, sh.off), b->in->conv_scatter);
        }
        return ggml_view_2d(ctx, out, C, n, out->nb[1], 0);
    }
    struct ggml_tensor * conv_state = ggml_reshape_3d(ctx, t->conv_state[il], W, C, 1);
    struct ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, ggml_reshape_3d(ctx, x, C, n, 1)), 0);
    if (b->verify) {
        /* the same inputs, one column per time step, kept for the commit */
        struct ggml_tensor * saved = ggml_concat(ctx, ggml_transpose(ctx, t->conv_state[il]), x, 1);
        write_into(saved, t->conv_scratch[il], 0);
        ggml_build_forward_expand(g->gf, saved);
    } else {
        struct ggml_tensor * last = ggml_view_3d(ctx, conv_in, W, C, 1, conv_in->nb[1], conv_in->nb[2], n * f32);
        ggml_build_forward_expand(g->gf, ggml_cpy(ctx, last, conv_state));
    }
    return ggml_reshape_2d(ctx, ggml_ssm_conv(ctx, conv_in, kernel), C, n);
}

/* Keep x (its elements in order: n columns of `width` floats) in columns 0..n-1 of a
 * replay plane of `rows` rows, from row `row`: by a copy, for what its op could not write there. */
static void keep_copy(dfl_graph * g, struct ggml_tensor * rp, int64_t plane, int64_t rows, int64_t row,
                      struct ggml_tensor * x, int64_t width) {
    const size_t f32 = sizeof(float);
    struct ggml_tensor * dst = ggml_view_2d(g->ctx, rp, width, g->n, rows * f32, (size_t) (plane + row) * f32);
    ggml_build_forward_expand(g->gf, ggml_cpy(g->ctx, x, dst));
}

/* The tensor q and k are views of when they sit side by side in its rows, [q heads | k
 * heads] (as the architectures make them: one norm over both), else NULL. */
static struct ggml_tensor * qk_rows(const struct ggml_tensor * q, const struct ggml_tensor * k, int64_t hk, int64_t Hk) {
    const size_t f32 = sizeof(float);
    struct ggml_tensor * qk = q->view_src;
    const bool side_by_side = qk && k->view_src == qk && q->view_offs == 0 && k->view_offs == (size_t) (hk * Hk) * f32 &&
                              q->nb[1] == hk * f32 && k->nb[1] == q->nb[1] && q->nb[2] == (size_t) (2 * hk * Hk) * f32 &&
                              k->nb[2] == q->nb[2];
    return side_by_side ? qk : NULL;
}

/* What the commit's rerun reads of a verify's rows, kept in the layer's replay planes:
 * the ops that make v (a view of the convolution output, as the architectures make it),
 * q and k (side by side in one result), the decay and the update weight write into
 * their planes directly; anything else is copied there. */
static void keep_for_commit(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                            struct ggml_tensor * v, struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const graph_build * b = g->runtime;
    dfl_target * t = b->t;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = g->n;
    const int64_t C = r->conv_channels, QK = 2 * hk * Hk;
    const size_t f32 = sizeof(float);
    const replay_planes P = replay_planes_of(&t->m, t->p.n_verify);
    struct ggml_tensor * rp = t->replay[il];

    struct ggml_tensor * conv = v->view_src;
    if (placeable(conv, C * n) && v->view_offs == (size_t) QK * f32 && v->nb[1] == hv * f32 && v->nb[2] == C * f32) {
        write_into(conv, rp, (size_t) P.conv * f32);
    } else {
        keep_copy(g, rp, P.conv, C, QK, v, hv * Hv);
    }
    struct ggml_tensor * qk = qk_rows(q, k, hk, Hk);
    if (placeable(qk, QK * n)) {
        write_into(qk, rp, (size_t) P.qk * f32);
    } else {
        keep_copy(g, rp, P.qk, QK, 0, q, hk * Hk);
        keep_copy(g, rp, P.qk, QK, hk * Hk, k, hk * Hk);
    }
    if (placeable(gate, Hv * n)) {
        write_into(gate, rp, (size_t) P.g * f32);
    } else {
        keep_copy(g, rp, P.g, Hv, 0, gate, Hv);
    }
    if (placeable(beta, Hv * n)) {
        write_into(beta, rp, (size_t) P.beta * f32);
    } else {
        keep_copy(g, rp, P.beta, Hv, 0, beta, Hv);
    }
}

/* [ne0, ne1, n] (any strides) as the 4-D single-sequence layout ggml_gated_delta_net takes */
static struct ggml_tensor * as_sequence(struct ggml_context * ctx, struct ggml_tensor * x, int64_t ne0, int64_t ne1,
                                        int64_t n) {
    if (ggml_is_contiguous(x)) {
        return ggml_reshape_4d(ctx, x, ne0, ne1, n, 1);
    }
    return ggml_view_4d(ctx, x, ne0, ne1, n, 1, x->nb[1], x->nb[2], x->nb[2] * n, 0);
}

/* Rows gathered into step order (gather_rows), [ne0, ne1] of each from byte `offset`:
 * the spine's [ne0, ne1, spine, 1], then each group's [ne0, ne1, steps, branches] (NULL
 * when it has none), as views */
static struct ggml_tensor * split_steps(dfl_graph * g, struct ggml_tensor * rows, int64_t ne0, int64_t ne1,
                                        size_t offset, struct ggml_tensor ** groups) {
    const graph_build * b = g->runtime;
    const tree_shape sh = b->t->tree.shape;
    struct ggml_context * ctx = g->ctx;
    const size_t row = rows->nb[1], col = rows->nb[0] * ne0;
    size_t at = row * sh.spine + offset;
    for (int k = 0; k < DFL_TREE_GROUPS; k++) {
        groups[k] = sh.branches[k] == 0 ? NULL
                                        : ggml_view_4d(ctx, rows, ne0, ne1, sh.steps[k], sh.branches[k], col, row,
                                                       row * sh.steps[k], at);
        at += row * sh.steps[k] * sh.branches[k];
    }
    return ggml_view_4d(ctx, rows, ne0, ne1, sh.spine, 1, col, row, row * sh.spine, offset);
}

/* The n rows of x (`width` floats, any row stride) in step order: one row a step */
static struct ggml_tensor * gather_rows(dfl_graph * g, struct ggml_tensor * x, int64_t width, size_t stride) {
    const graph_build * b = g->runtime;
    return ggml_get_rows(g->ctx, ggml_view_2d(g->ctx, x, width, g->n, stride, 0), b->in->tree_steps);
}

/* [ne0, ne1, n] rows in step order, split as split_steps does */
static struct ggml_tensor * gather_steps(dfl_graph * g, struct ggml_tensor * x, int64_t ne0, int64_t ne1,
                                         struct ggml_tensor ** groups) {
    return split_steps(g, gather_rows(g, x, ne0 * ne1, x->nb[2]), ne0, ne1, 0, groups);
}

/* Steps [at, at + n) of a spine's [ne0, ne1, steps, 1] */
static struct ggml_tensor * view_steps(struct ggml_context * ctx, struct ggml_tensor * x, int64_t at, int64_t n) {
    return ggml_view_4d(ctx, x, x->ne[0], x->ne[1], n, 1, x->nb[1], x->nb[2], x->nb[2] * n, at * x->nb[2]);
}

/* The first `rows` output rows of a delta-rule op written over `out` where the tree's
 * scatter input (from entry *at on) sends them */
static struct ggml_tensor * scatter_rows(dfl_graph * g, struct ggml_tensor * out, struct ggml_tensor * res,
                                         int64_t rows, int64_t * at) {
    const graph_build * b = g->runtime;
    struct ggml_tensor * idx = ggml_view_1d(g->ctx, b->in->scatter, rows, (size_t) *at * sizeof(int32_t));
    *at += rows;
    return ggml_set_rows(g->ctx, out, ggml_view_2d(g->ctx, res, res->ne[0], rows, res->nb[1], 0), idx);
}

/* Tree verify (see tree_plan): the spine from the committed state in two delta-rule
 * ops, the first keeping the states the branches start from; one op per group of
 * branches, each branch starting from the spine's state where it leaves the spine;
 * each node's output gathered from its first step. Every sequence runs the very steps
 * of the chain along its path, so each node gets the arithmetic of verifying its root
 * path as a chain, bit for bit. Steps, the branches' starts and output rows are inputs:
 * the graph depends only on the node count and the padded shape. No per-node state is
 * kept: the commit reruns the accepted path. */
static struct ggml_tensor * delta_net_tree(dfl_graph * g, int il, struct ggml_tensor * qk, struct ggml_tensor * q,
                                           struct ggml_tensor * k, struct ggml_tensor * v, struct ggml_tensor * gate,
                                           struct ggml_tensor * beta) {
    const graph_build * b = g->runtime;
    dfl_target * t = b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads;
    const tree_shape sh = t->tree.shape;
    const int64_t O = hv * Hv, S = hv * hv * Hv; /* output and state floats of a step */
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qg[DFL_TREE_GROUPS], * kg[DFL_TREE_GROUPS], * vg[DFL_TREE_GROUPS], * gg[DFL_TREE_GROUPS],
                       * bg[DFL_TREE_GROUPS];
    struct ggml_tensor * qs, * ks;
    if (qk) { /* side by side: one gather */
        struct ggml_tensor * rows = gather_rows(g, qk, 2 * hk * Hk, q->nb[2]);
        qs = split_steps(g, rows, hk, Hk, 0, qg);
        ks = split_steps(g, rows, hk, Hk, (size_t) (hk * Hk) * f32, kg);
    } else {
        qs = gather_steps(g, q, hk, Hk, qg);
        ks = gather_steps(g, k, hk, Hk, kg);
    }
    struct ggml_tensor * vs = gather_steps(g, v, hv, Hv, vg), * gs = gather_steps(g, gate, 1, Hv, gg);
    struct ggml_tensor * bs = gather_steps(g, beta, 1, Hv, bg);
    struct ggml_tensor * s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
    const int n_branches = tree_branches(&sh);
    if (n_branches == 0) {
        struct ggml_tensor * spine = ggml_gated_delta_net(ctx, qs, ks, vs, gs, bs, s0, 1);
        return ggml_reshape_3d(ctx, ggml_get_rows(ctx, ggml_view_2d(ctx, spine, O, sh.spine, spine->nb[1], 0),
                                                  b->in->out_rows), hv, Hv, g->n);
    }
    /* the spine up to its last branch's start, keeping its states from the first
     * branch's start on; the rest of it from there, keeping none */
    const int64_t kept = sh.split - sh.first, rest = sh.spine - sh.split;
    struct ggml_tensor * head = ggml_gated_delta_net(ctx, view_steps(ctx, qs, 0, sh.split),
                                                     view_steps(ctx, ks, 0, sh.split),
                                                     view_steps(ctx, vs, 0, sh.split),
                                                     view_steps(ctx, gs, 0, sh.split),
                                                     view_steps(ctx, bs, 0, sh.split), s0, kept);
    /* [O, n + spare]: the nodes' rows of the head, then the later ops' rows over them */
    struct ggml_tensor * out = ggml_get_rows(ctx, ggml_view_2d(ctx, head, O, sh.split, head->nb[1], 0),
                                             b->in->out_rows);
    int64_t at = 0;
    struct ggml_tensor * states = ggml_view_2d(ctx, head, S, kept, S * f32, sh.split * head->nb[1]);
    if (rest > 0) {
        struct ggml_tensor * s1 = ggml_view_4d(ctx, head, hv, hv, Hv, 1, hv * f32, hv * hv * f32, S * f32,
                                               sh.split * head->nb[1]);
        struct ggml_tensor * tail = ggml_gated_delta_net(ctx, view_steps(ctx, qs, sh.split, rest),
                                                         view_steps(ctx, ks, sh.split, rest),
                                                         view_steps(ctx, vs, sh.split, rest),
                                                         view_steps(ctx, gs, sh.split, rest),
                                                         view_steps(ctx, bs, sh.split, rest), s1, 1);
        out = scatter_rows(g, out, tail, rest, &at);
    }
    struct ggml_tensor * starts = ggml_get_rows(ctx, states, b->in->branch_from); /* [S, branches] */
    int64_t first = 0;
    for (int j = 0; j < DFL_TREE_GROUPS; j++) {
        if (sh.branches[j] == 0) {
            continue;
        }
        struct ggml_tensor * s1 = ggml_view_4d(ctx, starts, hv, hv, Hv, sh.branches[j], hv * f32, hv * hv * f32,
                                               S * f32, first * starts->nb[1]);
        struct ggml_tensor * res = ggml_gated_delta_net(ctx, qg[j], kg[j], vg[j], gg[j], bg[j], s1, 1);
        out = scatter_rows(g, out, res, (int64_t) sh.steps[j] * sh.branches[j], &at);
        first += sh.branches[j];
    }
    return ggml_reshape_3d(ctx, ggml_view_2d(ctx, out, O, g->n, out->nb[1], 0), hv, Hv, g->n);
}

struct ggml_tensor * dfl_graph_delta_net(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const graph_build * b = g->runtime;
    dfl_target * t = b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = g->n;
    const size_t f32 = sizeof(float);

    if (b->verify || b->tree) {
        /* the state moves only at commit, by rerunning the kept path (add_pending_commit):
         * cheaper than keeping a state per verified row */
        keep_for_commit(g, il, q, k, v, gate, beta);
    }
    struct ggml_tensor * qk = qk_rows(q, k, hk, Hk);
    q = as_sequence(ctx, q, hk, Hk, n);
    k = as_sequence(ctx, k, hk, Hk, n);
    v = as_sequence(ctx, v, hv, Hv, n);
    gate = ggml_reshape_4d(ctx, gate, 1, Hv, n, 1);
    beta = ggml_reshape_4d(ctx, beta, 1, Hv, n, 1);
    if (b->tree) {
        return delta_net_tree(g, il, qk, q, k, v, gate, beta);
    }
    struct ggml_tensor * s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
    struct ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, gate, beta, s0, 1);
    const int64_t n_out = hv * Hv * n;
    if (!b->verify) {
        struct ggml_tensor * s1 = ggml_view_1d(ctx, res, hv * hv * Hv, n_out * f32);
        ggml_build_forward_expand(g->gf, ggml_cpy(ctx, s1, t->ssm_state[il]));
    }
    return ggml_view_3d(ctx, res, hv, Hv, n, hv * f32, hv * Hv * f32, 0);
}

/* ---- the pending commit ---------------------------------------------------------------- */

/* A commit is carried out at the start of the next graph, so a decoding step costs
 * one target graph. Attention: after a tree, the accepted path's rows move to
 * consecutive slots (a chain's are already in place). Recurrent layers: the conv state
 * becomes the inputs before the next token, and the recurrent state that of the last
 * kept row, by rerunning the recurrence from the committed state over the verify's
 * rows gathered in path order (a chain's in order), the rows after the kept ones made
 * identity steps (decay exp(0) = 1, update weight 0: the state passes through
 * unchanged, bit for bit). Which rows, columns and tokens is an input, so the graph's
 * shape does not depend on the accepted length and consecutive steps reuse it. Cache rows move through a gather and a scatter: every
 * read happens before any write, and the round trip through f32 is exact for every
 * cache type (quantized rows requantize to the same bytes). */
static void add_pending_commit(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf, graph_inputs * in) {
    in->commit_rows = in->commit_keep = in->commit_conv_cols = in->commit_kv_src = in->commit_kv_dst = NULL;
    in->commit_kv_src_swa = in->commit_kv_dst_swa = NULL;
    if (!t->commit.active) {
        return;
    }
    const dfl_model * m = &t->m;
    const bool tree = t->commit.tree;
    if (tree && m->n_attention > 0) {
        in->commit_kv_src = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
        in->commit_kv_dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
        ggml_set_input(in->commit_kv_src);
        ggml_set_input(in->commit_kv_dst);
        if (t->swa_window > 0) {
            in->commit_kv_src_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
            in->commit_kv_dst_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
            ggml_set_input(in->commit_kv_src_swa);
            ggml_set_input(in->commit_kv_dst_swa);
        }
    }
    const int R = t->commit.n_replay;
    if (m->n_recurrent > 0) {
        if (tree) {
            in->commit_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, R, 2); /* twice: see below */
            ggml_set_input(in->commit_rows);
        } else {
            in->commit_keep = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, R, 1);
            ggml_set_input(in->commit_keep);
        }
        in->commit_conv_cols = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, m->rec.d_conv - 1);
        ggml_set_input(in->commit_conv_cols);
    }
    const int64_t hk = m->rec.head_k_dim, hv = m->rec.head_v_dim, Hk = m->rec.n_k_heads, Hv = m->rec.n_v_heads;
    const int64_t C = m->rec.conv_channels, QK = 2 * hk * Hk;
    const size_t f32 = sizeof(float);
    const replay_planes P = replay_planes_of(m, t->p.n_verify);
    for (int il = 0; il < m->n_layer; il++) {
        if (m->kind[il] == DFL_LAYER_ATTENTION) {
            if (tree && !m->attn[il].shares_kv) {
                const bool ring = m->attn[il].window > 0;
                struct ggml_tensor * src = ring ? in->commit_kv_src_swa : in->commit_kv_src;
                struct ggml_tensor * dst = ring ? in->commit_kv_dst_swa : in->commit_kv_dst;
                struct ggml_tensor * caches[2] = { t->k_cache[il], t->v_cache[il] };
                for (int c = 0; c < 2; c++) {
                    struct ggml_tensor * rows = ggml_get_rows(ctx, caches[c], src);
                    ggml_build_forward_expand(gf, ggml_set_rows(ctx, caches[c], rows, dst));
                }
            }
            continue;
        }
        struct ggml_tensor * rp = t->replay[il];
        struct ggml_tensor * q, * k, * v, * g, * b;
        if (tree) {
            /* the path's columns of every plane, in path order; identity steps take the
             * zero column (decay 0, update weight 0). The decay and update weight planes,
             * of one width, in one gather: its index holds the columns once per plane. */
            struct ggml_tensor * cols = ggml_view_1d(ctx, in->commit_rows, R, 0);
            struct ggml_tensor * planes[2];
            const int64_t at[2] = { P.conv, P.qk }, rows[2] = { C, QK };
            for (int i = 0; i < 2; i++) {
                struct ggml_tensor * plane = ggml_view_2d(ctx, rp, rows[i], P.cols, rows[i] * f32, (size_t) at[i] * f32);
                planes[i] = ggml_get_rows(ctx, plane, cols);
            }
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, P.cols, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   (size_t) P.g * f32);
            gb = ggml_get_rows(ctx, gb, in->commit_rows); /* [Hv, R, 2] */
            v = ggml_view_4d(ctx, planes[0], hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, (size_t) QK * f32);
            q = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, 0);
            k = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, hk * Hk * f32);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        } else {
            /* a chain's rows are in order already; the decay and update weight of every row
             * times keep, in one product: [Hv, R] decays, then [Hv, R] weights */
            v = ggml_view_4d(ctx, rp, hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, (size_t) (P.conv + QK) * f32);
            q = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, (size_t) P.qk * f32);
            k = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, (size_t) (P.qk + hk * Hk) * f32);
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, R, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   (size_t) P.g * f32);
            gb = ggml_mul(ctx, gb, in->commit_keep);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        }
        struct ggml_tensor * s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
        struct ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, v, g, b, s0, 1);
        struct ggml_tensor * state = ggml_view_2d(ctx, r, hv * hv * Hv, 1, hv * hv * Hv * f32, hv * Hv * R * f32);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, state, ggml_reshape_2d(ctx, t->ssm_state[il], hv * hv * Hv, 1)));
        struct ggml_tensor * cols = ggml_get_rows(ctx, t->conv_scratch[il], in->commit_conv_cols); /* [C, W] */
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, cols), t->conv_state[il]));
    }
}

static void fill_commit_inputs(dfl_target * t, const graph_inputs * in) {
    const pending_commit * pc = &t->commit;
    if (in->commit_kv_src) {
        const int M = t->p.n_verify;
        int32_t * src = t->host_i32;
        int64_t * dst = t->host_i64;
        /* unused entries copy row p0 onto itself (path[0] is always the root, already in place) */
        for (int k = 0; k < M; k++) {
            src[k] = pc->p0 + (k < pc->n_keep ? pc->path[k] : 0);
            dst[k] = pc->p0 + (k < pc->n_keep ? k : 0);
        }
        dfl_runtime_set(&t->rt, in->commit_kv_src, src, 0, (size_t) M * sizeof(int32_t));
        dfl_runtime_set(&t->rt, in->commit_kv_dst, dst, 0, (size_t) M * sizeof(int64_t));
        if (in->commit_kv_src_swa) {
            for (int k = 0; k < M; k++) {
                src[k] %= t->swa_ring;
                dst[k] %= t->swa_ring;
            }
            dfl_runtime_set(&t->rt, in->commit_kv_src_swa, src, 0, (size_t) M * sizeof(int32_t));
            dfl_runtime_set(&t->rt, in->commit_kv_dst_swa, dst, 0, (size_t) M * sizeof(int64_t));
        }
    }
    if (in->commit_keep) {
        float keep[DFL_MAX_VERIFY];
        for (int k = 0; k < pc->n_replay; k++) {
            keep[k] = k < pc->n_keep ? 1.0f : 0.0f;
        }
        dfl_runtime_set(&t->rt, in->commit_keep, keep, 0, (size_t) pc->n_replay * sizeof(float));
    }
    if (in->commit_rows) {
        int32_t rows[2 * DFL_MAX_VERIFY];
        const int R = pc->n_replay;
        for (int k = 0; k < R; k++) {
            rows[k] = rows[R + k] = k < pc->n_keep ? pc->path[k] : t->p.n_verify; /* identity steps: the zero column */
        }
        dfl_runtime_set(&t->rt, in->commit_rows, rows, 0, (size_t) 2 * R * sizeof(int32_t));
    }
    if (in->commit_conv_cols) {
        dfl_runtime_set(&t->rt, in->commit_conv_cols, pc->conv_cols, 0, (size_t) (t->m.rec.d_conv - 1) * sizeof(int32_t));
    }
}

/* ---- the graph --------------------------------------------------------------------- */

static void capture_features(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf,
                             struct ggml_tensor * x, int layer, int n) {
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] == layer) {
            struct ggml_tensor * dst = ggml_view_2d(ctx, t->features, t->m.n_embd, n, t->features->nb[1],
                                                    (size_t) f * t->m.n_embd * sizeof(float));
            ggml_build_forward_expand(gf, ggml_cpy(ctx, x, dst));
        }
    }
}

static struct ggml_tensor * new_input(struct ggml_context * ctx, enum ggml_type type, int64_t n) {
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_input(x);
    return x;
}

struct ggml_cgraph * dfl_target_build_graph(dfl_target * t, struct ggml_context * ctx, graph_inputs * in, int n,
                                            int n_kv, bool verify, bool tree, int logits,
                                            struct ggml_tensor * tokens_src, const dfl_sampler_key * samp) {
    const dfl_model * m = &t->m;
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, t->rt.graph_size, false);
    add_pending_commit(t, ctx, gf, in);

    in->tokens = tokens_src ? NULL : new_input(ctx, GGML_TYPE_I32, n);
    struct ggml_tensor * tokens = tokens_src ? ggml_view_1d(ctx, tokens_src, n, 0) : in->tokens;
    in->pos = new_input(ctx, GGML_TYPE_I32, n);
    in->slots = new_input(ctx, GGML_TYPE_I64, n);
    in->mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    ggml_set_input(in->mask);
    const int n_kv_swa = n_kv < t->swa_ring ? n_kv : t->swa_ring;
    in->slots_swa = in->mask_swa = NULL;
    if (t->swa_window > 0) {
        in->slots_swa = new_input(ctx, GGML_TYPE_I64, n);
        in->mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv_swa, n);
        ggml_set_input(in->mask_swa);
    }
    in->conv_rows = in->tree_steps = in->branch_from = in->out_rows = in->scatter = in->conv_out = NULL;
    in->conv_scatter = NULL;
    if (tree && m->n_recurrent > 0) {
        const tree_shape sh = t->tree.shape;
        const int n_branches = tree_branches(&sh);
        in->conv_rows = new_input(ctx, GGML_TYPE_I32, tree_conv_rows(&sh, n, m->rec.d_conv));
        in->tree_steps = new_input(ctx, GGML_TYPE_I32, tree_steps(&sh));
        in->branch_from = n_branches > 0 ? new_input(ctx, GGML_TYPE_I32, n_branches) : NULL;
        in->out_rows = new_input(ctx, GGML_TYPE_I32, n + tree_spare_rows(&sh));
        in->scatter = n_branches > 0 ? new_input(ctx, GGML_TYPE_I32, tree_steps(&sh) - tree_head_rows(&sh)) : NULL;
        if (tree_conv_spine(&sh, n, m->rec.d_conv)) {
            in->conv_out = new_input(ctx, GGML_TYPE_I32, n + sh.off);
            in->conv_scatter = sh.off > 0 ? new_input(ctx, GGML_TYPE_I32, sh.off) : NULL;
        }
    }

    graph_build b = { t, in, n_kv, n_kv_swa, verify && !tree, tree };
    dfl_graph g = { ctx, gf, n, in->pos, &b };
    struct ggml_tensor * x = ggml_get_rows(ctx, t->tok_lookup, tokens);
    if (m->embd_scale != 1.0f) {
        x = ggml_scale(ctx, x, m->embd_scale);
    }
    for (int il = 0; il < m->n_layer; il++) {
        capture_features(t, ctx, gf, x, il, n);
        x = m->arch->build_layer(m, &g, il, x);
    }
    /* layer n_layer is the final-normed state, as transformers' last hidden_states entry
     * (what z-lab's drafters read for the last target layer) */
    bool normed = false;
    for (int f = 0; f < t->p.n_feature_layers && !normed; f++) {
        if (t->p.feature_layers[f] == m->n_layer) {
            x = dfl_rms_norm(ctx, x, m->output_norm, m->eps);
            normed = true;
            capture_features(t, ctx, gf, x, m->n_layer, n);
        }
    }

    t->out_logits = NULL;
    memset(&in->samp, 0, sizeof in->samp);
    if (logits != LOGITS_NONE) {
        if (logits == LOGITS_LAST && n > 1) {
            x = ggml_view_2d(ctx, x, m->n_embd, 1, x->nb[1], (size_t) (n - 1) * x->nb[1]);
        }
        if (!normed) {
            x = dfl_rms_norm(ctx, x, m->output_norm, m->eps);
        }
        struct ggml_tensor * out = dfl_gguf_mul_mat(&m->file, ctx, m->output, x);
        if (m->logit_softcap > 0.0f) {
            out = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, out, 1.0f / m->logit_softcap)), m->logit_softcap);
        }
        t->out_logits = out;
        ggml_set_output(t->out_logits);
        dfl_sampler_build(ctx, gf, out, samp, &in->samp);
    }
    ggml_build_forward_expand(gf, x);
    return gf;
}

/* ---- inputs ---------------------------------------------------------------------------- */

/* Tokens (unless they come from a device tensor), positions (n_past + depth; a chain's
 * depth is its index) and cache slots (n_past + index). */
static void set_token_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n,
                             const int32_t * depth) {
    int32_t * pos = t->host_i32;
    int64_t * slots = t->host_i64;
    for (int i = 0; i < n; i++) {
        pos[i] = t->n_past + (depth ? depth[i] : i);
        slots[i] = t->n_past + i;
    }
    if (in->tokens) {
        dfl_runtime_set(&t->rt, in->tokens, tokens, 0, (size_t) n * sizeof(int32_t));
    }
    dfl_runtime_set(&t->rt, in->pos, pos, 0, (size_t) n * sizeof(int32_t));
    dfl_runtime_set(&t->rt, in->slots, slots, 0, (size_t) n * sizeof(int64_t));
    if (in->slots_swa) {
        for (int i = 0; i < n; i++) {
            slots[i] %= t->swa_ring;
        }
        dfl_runtime_set(&t->rt, in->slots_swa, slots, 0, (size_t) n * sizeof(int64_t));
    }
}

/* Causal for a chain; a tree node sees the context and its ancestors. In a sliding
 * layer's ring of R rows, row j holds this call's row (j - p) mod R when that is below
 * n, else position j - p mod R + p - R (none when negative); its mask hides, in addition,
 * keys `window` or more positions behind the row's own (a node's position is p + depth). */
static void fill_mask(dfl_target * t, struct ggml_tensor * dst, int n, int n_kv, bool tree, int window, int ring) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t minf = ggml_fp32_to_fp16(-INFINITY);
    const tree_plan * tp = &t->tree;
    const int p = t->n_past;
    for (int i = 0; i < n; i++) {
        ggml_fp16_t * row = t->host_mask + (size_t) i * n_kv;
        const int pos_i = p + (tree ? tp->depth[i] : i);
        for (int j = 0; j < n_kv; j++) {
            const int node = ((j - p) % ring + ring) % ring; /* this call's row, when below n */
            const int pos_j = node < n ? p + (tree ? tp->depth[node] : node) : p + node - ring;
            bool visible;
            if (node < n) {
                visible = tree ? (tp->ancestors[i] >> node & 1) != 0 : node <= i;
            } else {
                visible = pos_j >= 0;
            }
            if (visible && window > 0) {
                visible = pos_i - pos_j < window;
            }
            row[j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&t->rt, dst, t->host_mask, 0, (size_t) n * n_kv * sizeof(ggml_fp16_t));
}

static void set_mask(dfl_target * t, const graph_inputs * in, int n, int n_kv, bool tree) {
    fill_mask(t, in->mask, n, n_kv, tree, 0, t->p.n_ctx);
    if (in->mask_swa) {
        fill_mask(t, in->mask_swa, n, (int) in->mask_swa->ne[0], tree, t->swa_window, t->swa_ring);
    }
}

static void set_tree_rows(dfl_target * t, const graph_inputs * in, int n) {
    const tree_plan * tp = &t->tree;
    const tree_shape sh = tp->shape;
    dfl_runtime_set(&t->rt, in->tree_steps, tp->steps, 0, (size_t) tree_steps(&sh) * sizeof(int32_t));
    if (in->branch_from) {
        dfl_runtime_set(&t->rt, in->branch_from, tp->branch_from, 0,
                        (size_t) (tree_branches(&sh)) * sizeof(int32_t));
    }
    dfl_runtime_set(&t->rt, in->out_rows, tp->out_rows, 0, (size_t) (n + tree_spare_rows(&sh)) * sizeof(int32_t));
    if (in->scatter) {
        dfl_runtime_set(&t->rt, in->scatter, tp->scatter, 0,
                        (size_t) (tree_steps(&sh) - tree_head_rows(&sh)) * sizeof(int32_t));
    }
    dfl_runtime_set(&t->rt, in->conv_rows, tp->conv_rows, 0,
                    (size_t) tree_conv_rows(&sh, n, t->m.rec.d_conv) * sizeof(int32_t));
    if (in->conv_out) {
        dfl_runtime_set(&t->rt, in->conv_out, tp->conv_out, 0, (size_t) (n + sh.off) * sizeof(int32_t));
    }
    if (in->conv_scatter) {
        dfl_runtime_set(&t->rt, in->conv_scatter, tp->conv_scatter, 0, (size_t) sh.off * sizeof(int32_t));
    }
}

void dfl_target_fill_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n, int n_kv, bool tree) {
    if (t->commit.active) {
        fill_commit_inputs(t, in);
    }
    set_token_inputs(t, in, tokens, n, tree ? t->tree.depth : NULL);
    set_mask(t, in, n, n_kv, tree);
    if (in->conv_rows) {
        set_tree_rows(t, in, n);
    }
}
