/* Target graphs: the layer loop over the architecture's builders, the graph services
 * those builders call (attention over the cache, short convolution and delta rule with
 * their state), the pending commits carried at the start of a graph, and the inputs.
 *
 * A graph is a function of the model, the memory and the step's descriptor (dfl_step):
 * nothing here writes to the target. The rows of every segment (sequence) of a step go
 * through the weights together; attention, the short convolution and the delta rule
 * run per segment, each on its own sequence's cache and states, so that a sequence's
 * rows see exactly what they would see alone. */
#include "dfl_target_state.h"

#include <math.h>
#include <string.h>

/* What the graph services need to know about the graph being built. */
typedef struct graph_build {
    const dfl_target * t;
    const dfl_step * step;
    graph_inputs * in;
    /* each attention layer's cache after this graph's rows are stored in it, what the
     * layers sharing that cache read */
    struct ggml_tensor * k_stored[DFL_MAX_LAYERS], * v_stored[DFL_MAX_LAYERS];
    bool cut;  /* the rows were cut to the logits' rows inside the last layer (dfl_graph_ffn_rows) */
} graph_build;

/* One segment's part of a service: its rows, its inputs, its sequence. */
typedef struct seg_build {
    const graph_build * b;
    const dfl_segment * s;
    const seg_inputs * in;
    bool whole; /* the segment is the step's only one: its rows are the graph's rows */
} seg_build;

static seg_build segment(const dfl_graph * g, int i) {
    const graph_build * b = g->runtime;
    return (seg_build) { b, &b->step->seg[i], &b->in->seg[i], b->step->n_seg == 1 };
}

/* Rows [s.row0, s.row0 + s.n) of x along dimension `dim` (x itself when the segment is
 * the whole step). */
static struct ggml_tensor * seg_rows(struct ggml_context * ctx, const seg_build * s, struct ggml_tensor * x, int dim) {
    if (s->whole) {
        return x;
    }
    const size_t at = (size_t) s->s->row0 * x->nb[dim];
    switch (dim) {
        case 1: return ggml_view_2d(ctx, x, x->ne[0], s->s->n, x->nb[1], at);
        default: return ggml_view_3d(ctx, x, x->ne[0], x->ne[1], s->s->n, x->nb[1], x->nb[2], at);
    }
}

/* The segments' results joined along dimension `dim`, in step order. */
static struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x, int dim) {
    return acc ? ggml_concat(ctx, acc, x, dim) : x;
}

/* ---- graph services ------------------------------------------------------------------ */

struct ggml_tensor * dfl_graph_attention(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, float scale) {
    return dfl_graph_attention_sinks(g, il, q, k, v, scale, NULL);
}

/* The cache row of a call's row j (at depth d below the call's first position p) in a
 * sliding layer's ring of R rows: (p + j) mod R, except where the row's index reaches past
 * the ring's end while its position (p + d) does not, or the other way round. Flash
 * attention sums the keys in row order, so a row must read the keys it sees in the order a
 * one-row decode of its position reads them: its position's own side of the ring's end.
 * A tree's row past the end whose position is before it takes a spare row after the ring
 * (the ring has n_verify of them); a chain's rows (d = j) are at (p + j) mod R. */
static int ring_slot(int p, int j, int d, int R) {
    const int base = p % R;
    return base + d < R ? base + j : base + j - R;
}

/* The call's row that ring_slot puts at row `slot` (-1: none), base = p mod R. depth
 * NULL: a chain's. */
static int ring_row(int base, int slot, const int32_t * depth, int n, int R) {
    const int a = slot - base, b = slot - base + R;
    if (a >= 0 && a < n && base + (depth ? depth[a] : a) < R) {
        return a;
    }
    if (b >= 0 && b < n && base + (depth ? depth[b] : b) >= R) {
        return b;
    }
    return -1;
}

/* The cache rows a segment's attention spans in a layer of `rows` rows: its n_kv, or in a
 * ring it has filled the ring and the spare rows after it. */
static int attended_rows(const dfl_memory * mem, const dfl_segment * s, int rows) {
    return s->n_kv > rows ? (rows + mem->spare < s->n_kv ? rows + mem->spare : s->n_kv) : s->n_kv;
}

struct ggml_tensor * dfl_graph_attention_sinks(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                               struct ggml_tensor * v, float scale, struct ggml_tensor * sinks) {
    graph_build * b = g->runtime;
    const dfl_target * t = b->t;
    const dfl_memory * mem = &t->mem;
    struct ggml_context * ctx = g->ctx;
    const dfl_attention_geometry * a = &t->m.attn[il];
    const bool ring = a->window > 0;
    const int n = g->n;
    const int src = a->shares_kv ? a->kv_layer : il;
    const int64_t hd_k = t->m.attn[src].head_dim_k, hd_v = t->m.attn[src].head_dim_v, n_head_kv = t->m.attn[src].n_head_kv;

    struct ggml_tensor * kc, * vc;
    if (a->shares_kv) {
        kc = b->k_stored[src];
        vc = b->v_stored[src];
    } else {
        struct ggml_tensor * slots = ring ? b->in->slots_swa : b->in->slots;
        kc = ggml_set_rows(ctx, mem->k[il], ggml_reshape_2d(ctx, k, hd_k * n_head_kv, n), slots);
        vc = ggml_set_rows(ctx, mem->v[il], ggml_reshape_2d(ctx, v, hd_v * n_head_kv, n), slots);
        ggml_build_forward_expand(g->gf, kc);
        ggml_build_forward_expand(g->gf, vc);
        b->k_stored[il] = kc;
        b->v_stored[il] = vc;
    }

    const int rows = dfl_memory_kv_rows(mem, src);
    struct ggml_tensor * out = NULL;
    for (int i = 0; i < b->step->n_seg; i++) {
        const seg_build s = segment(g, i);
        const int n_kv = attended_rows(mem, s.s, rows);
        const size_t base = (size_t) dfl_memory_kv_base(mem, src, s.s->seq) * kc->nb[1];
        struct ggml_tensor * K = ggml_view_3d(ctx, kc, hd_k, n_head_kv, n_kv, ggml_row_size(kc->type, hd_k), kc->nb[1],
                                              base);
        struct ggml_tensor * V = ggml_view_3d(ctx, vc, hd_v, n_head_kv, n_kv, ggml_row_size(vc->type, hd_v), vc->nb[1],
                                              base);
        struct ggml_tensor * qs = seg_rows(ctx, &s, q, 2);
        struct ggml_tensor * o = ggml_flash_attn_ext(ctx, ggml_permute(ctx, qs, 0, 2, 1, 3),
                                                     ggml_permute(ctx, K, 0, 2, 1, 3), ggml_permute(ctx, V, 0, 2, 1, 3),
                                                     ring ? s.in->mask_swa : s.in->mask, scale, 0.0f, 0.0f);
        ggml_prec_set_acc(o, GGML_PREC_F32);
        if (sinks) {
            ggml_flash_attn_ext_add_sinks(o, sinks);
        }
        out = join(ctx, out, ggml_reshape_2d(ctx, o, hd_v * q->ne[1], s.s->n), 1);
    }
    return out;
}

/* An op's result written straight into runtime memory (within a state tensor on the
 * same device) instead of the graph's compute memory: no copy node. The address is
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

/* One segment's short convolution over its rows x [C, n]. Decode and chain verify:
 * [last W committed inputs | this call's inputs] along time. A decode moves the conv
 * state on; a verify keeps the inputs for its commit. A tree runs its spine as a
 * sequence and the nodes off it on windows of their ancestors. */
static struct ggml_tensor * short_conv(dfl_graph * g, const seg_build * s, int il, struct ggml_tensor * x,
                                       struct ggml_tensor * kernel) {
    const dfl_target * t = s->b->t;
    const dfl_memory * mem = &t->mem;
    struct ggml_context * ctx = g->ctx;
    const int64_t C = t->m.rec.conv_channels, W = t->m.rec.d_conv - 1, n = s->s->n;
    const int seq = s->s->seq;
    const size_t f32 = sizeof(float);
    struct ggml_tensor * state = dfl_memory_slice(ctx, &t->mem, mem->conv[il], seq); /* [W, C] */
    const size_t scratch_at = dfl_memory_slice_offset(mem, mem->conv_scratch[il], seq);

    if (s->s->kind == DFL_STEP_TREE) {
        /* [committed conv inputs | node inputs], one column per time step, kept for
         * commit; gathered from it (tree_conv_spine): the committed inputs and the
         * spine, convolved as one sequence as the chain is, then each node off the spine
         * on its own window (its ancestors' inputs, oldest first), a sequence of one
         * step; or every node on its own window. Every node gets the chain's
         * arithmetic; the outputs are put in node order. */
        const tree_shape sh = s->s->shape;
        struct ggml_tensor * cat = ggml_concat(ctx, ggml_transpose(ctx, state), x, 1);
        write_into(cat, mem->conv_scratch[il], scratch_at);
        struct ggml_tensor * rows = ggml_get_rows(ctx, cat, s->in->conv_rows);
        if (!s->in->conv_out) {
            struct ggml_tensor * win = time_major(ctx, ggml_reshape_3d(ctx, rows, C, W + 1, n), W);
            return ggml_reshape_2d(ctx, ggml_ssm_conv(ctx, win, kernel), C, n);
        }
        const size_t col = rows->nb[1];
        struct ggml_tensor * seq_in = ggml_view_3d(ctx, rows, C, W + sh.spine, 1, col, (W + sh.spine) * col, 0);
        seq_in = ggml_ssm_conv(ctx, time_major(ctx, seq_in, W), kernel);
        struct ggml_tensor * out = ggml_get_rows(ctx, ggml_reshape_2d(ctx, seq_in, C, sh.spine), s->in->conv_out);
        if (sh.off > 0) {
            struct ggml_tensor * win = ggml_view_3d(ctx, rows, C, W + 1, sh.off, col, (W + 1) * col, (W + sh.spine) * col);
            win = ggml_ssm_conv(ctx, time_major(ctx, win, W), kernel);
            out = ggml_set_rows(ctx, out, ggml_reshape_2d(ctx, win, C, sh.off), s->in->conv_scatter);
        }
        return ggml_view_2d(ctx, out, C, n, out->nb[1], 0);
    }
    struct ggml_tensor * conv_state = ggml_reshape_3d(ctx, state, W, C, 1);
    struct ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, ggml_reshape_3d(ctx, x, C, n, 1)), 0);
    if (s->s->kind == DFL_STEP_CHAIN) {
        /* the same inputs, one column per time step, kept for the commit */
        struct ggml_tensor * saved = ggml_concat(ctx, ggml_transpose(ctx, state), x, 1);
        write_into(saved, mem->conv_scratch[il], scratch_at);
        ggml_build_forward_expand(g->gf, saved);
    } else {
        struct ggml_tensor * last = ggml_view_3d(ctx, conv_in, W, C, 1, conv_in->nb[1], conv_in->nb[2], n * f32);
        ggml_build_forward_expand(g->gf, ggml_cpy(ctx, last, conv_state));
    }
    return ggml_reshape_2d(ctx, ggml_ssm_conv(ctx, conv_in, kernel), C, n);
}

struct ggml_tensor * dfl_graph_short_conv(dfl_graph * g, int il, struct ggml_tensor * x, struct ggml_tensor * kernel) {
    const graph_build * b = g->runtime;
    struct ggml_tensor * out = NULL;
    for (int i = 0; i < b->step->n_seg; i++) {
        const seg_build s = segment(g, i);
        out = join(g->ctx, out, short_conv(g, &s, il, seg_rows(g->ctx, &s, x, 1), kernel), 1);
    }
    return out;
}

/* Keep x (its elements in order: n columns of `width` floats) in columns 0..n-1 of a
 * replay plane of `rows` rows, from row `row`, in the slice from byte `slice`: by a
 * copy, for what its op could not write there. */
static void keep_copy(dfl_graph * g, struct ggml_tensor * rp, size_t slice, int64_t plane, int64_t rows, int64_t row,
                      struct ggml_tensor * x, int64_t width, int64_t n) {
    const size_t f32 = sizeof(float);
    struct ggml_tensor * dst = ggml_view_2d(g->ctx, rp, width, n, rows * f32, slice + (size_t) (plane + row) * f32);
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

/* What the commit's rerun reads of a segment's verified rows, kept in its sequence's
 * replay planes: the ops that make v (a view of the convolution output, as the
 * architectures make it), q and k (side by side in one result), the decay and the
 * update weight write into their planes directly when the segment is the whole step;
 * anything else is copied there. */
static void keep_for_commit(dfl_graph * g, const seg_build * s, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                            struct ggml_tensor * v, struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const dfl_target * t = s->b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = s->s->n;
    const int64_t C = r->conv_channels, QK = 2 * hk * Hk;
    const size_t f32 = sizeof(float);
    const replay_planes P = dfl_replay_planes(&t->m.rec, t->p.n_verify);
    struct ggml_tensor * rp = t->mem.replay[il];
    const size_t at = dfl_memory_slice_offset(&t->mem, rp, s->s->seq);

    struct ggml_tensor * conv = v->view_src;
    if (s->whole && placeable(conv, C * n) && v->view_offs == (size_t) QK * f32 && v->nb[1] == hv * f32 &&
        v->nb[2] == C * f32) {
        write_into(conv, rp, at + (size_t) P.conv * f32);
    } else {
        keep_copy(g, rp, at, P.conv, C, QK, seg_rows(ctx, s, v, 2), hv * Hv, n);
    }
    struct ggml_tensor * qk = qk_rows(q, k, hk, Hk);
    if (s->whole && placeable(qk, QK * n)) {
        write_into(qk, rp, at + (size_t) P.qk * f32);
    } else {
        keep_copy(g, rp, at, P.qk, QK, 0, seg_rows(ctx, s, q, 2), hk * Hk, n);
        keep_copy(g, rp, at, P.qk, QK, hk * Hk, seg_rows(ctx, s, k, 2), hk * Hk, n);
    }
    if (s->whole && placeable(gate, Hv * n)) {
        write_into(gate, rp, at + (size_t) P.g * f32);
    } else {
        keep_copy(g, rp, at, P.g, Hv, 0, seg_rows(ctx, s, gate, 1), Hv, n);
    }
    if (s->whole && placeable(beta, Hv * n)) {
        write_into(beta, rp, at + (size_t) P.beta * f32);
    } else {
        keep_copy(g, rp, at, P.beta, Hv, 0, seg_rows(ctx, s, beta, 1), Hv, n);
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
static struct ggml_tensor * split_steps(dfl_graph * g, const seg_build * s, struct ggml_tensor * rows, int64_t ne0,
                                        int64_t ne1, size_t offset, struct ggml_tensor ** groups) {
    const tree_shape sh = s->s->shape;
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
static struct ggml_tensor * gather_rows(dfl_graph * g, const seg_build * s, struct ggml_tensor * x, int64_t width,
                                        size_t stride) {
    return ggml_get_rows(g->ctx, ggml_view_2d(g->ctx, x, width, s->s->n, stride, 0), s->in->tree_steps);
}

/* [ne0, ne1, n] rows in step order, split as split_steps does */
static struct ggml_tensor * gather_steps(dfl_graph * g, const seg_build * s, struct ggml_tensor * x, int64_t ne0,
                                         int64_t ne1, struct ggml_tensor ** groups) {
    return split_steps(g, s, gather_rows(g, s, x, ne0 * ne1, x->nb[2]), ne0, ne1, 0, groups);
}

/* Steps [at, at + n) of a spine's [ne0, ne1, steps, 1] */
static struct ggml_tensor * view_steps(struct ggml_context * ctx, struct ggml_tensor * x, int64_t at, int64_t n) {
    return ggml_view_4d(ctx, x, x->ne[0], x->ne[1], n, 1, x->nb[1], x->nb[2], x->nb[2] * n, at * x->nb[2]);
}

/* The first `rows` output rows of a delta-rule op written over `out` where the tree's
 * scatter input (from entry *at on) sends them */
static struct ggml_tensor * scatter_rows(dfl_graph * g, const seg_build * s, struct ggml_tensor * out,
                                         struct ggml_tensor * res, int64_t rows, int64_t * at) {
    struct ggml_tensor * idx = ggml_view_1d(g->ctx, s->in->scatter, rows, (size_t) *at * sizeof(int32_t));
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
static struct ggml_tensor * delta_net_tree(dfl_graph * g, const seg_build * s, int il, struct ggml_tensor * qk,
                                           struct ggml_tensor * q, struct ggml_tensor * k, struct ggml_tensor * v,
                                           struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const dfl_target * t = s->b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = s->s->n;
    const tree_shape sh = s->s->shape;
    const int64_t O = hv * Hv, S = hv * hv * Hv; /* output and state floats of a step */
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qg[DFL_TREE_GROUPS], * kg[DFL_TREE_GROUPS], * vg[DFL_TREE_GROUPS], * gg[DFL_TREE_GROUPS],
                       * bg[DFL_TREE_GROUPS];
    struct ggml_tensor * qs, * ks;
    if (qk) { /* side by side: one gather */
        struct ggml_tensor * rows = gather_rows(g, s, qk, 2 * hk * Hk, q->nb[2]);
        qs = split_steps(g, s, rows, hk, Hk, 0, qg);
        ks = split_steps(g, s, rows, hk, Hk, (size_t) (hk * Hk) * f32, kg);
    } else {
        qs = gather_steps(g, s, q, hk, Hk, qg);
        ks = gather_steps(g, s, k, hk, Hk, kg);
    }
    struct ggml_tensor * vs = gather_steps(g, s, v, hv, Hv, vg), * gs = gather_steps(g, s, gate, 1, Hv, gg);
    struct ggml_tensor * bs = gather_steps(g, s, beta, 1, Hv, bg);
    struct ggml_tensor * s0 = ggml_reshape_4d(ctx, dfl_memory_slice(ctx, &t->mem, t->mem.ssm[il], s->s->seq), hv, hv, Hv, 1);
    const int n_branches = tree_branches(&sh);
    if (n_branches == 0) {
        struct ggml_tensor * spine = ggml_gated_delta_net(ctx, qs, ks, vs, gs, bs, s0, 1);
        return ggml_reshape_3d(ctx, ggml_get_rows(ctx, ggml_view_2d(ctx, spine, O, sh.spine, spine->nb[1], 0),
                                                  s->in->out_rows), hv, Hv, n);
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
                                             s->in->out_rows);
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
        out = scatter_rows(g, s, out, tail, rest, &at);
    }
    struct ggml_tensor * starts = ggml_get_rows(ctx, states, s->in->branch_from); /* [S, branches] */
    int64_t first = 0;
    for (int j = 0; j < DFL_TREE_GROUPS; j++) {
        if (sh.branches[j] == 0) {
            continue;
        }
        struct ggml_tensor * s1 = ggml_view_4d(ctx, starts, hv, hv, Hv, sh.branches[j], hv * f32, hv * hv * f32,
                                               S * f32, first * starts->nb[1]);
        struct ggml_tensor * res = ggml_gated_delta_net(ctx, qg[j], kg[j], vg[j], gg[j], bg[j], s1, 1);
        out = scatter_rows(g, s, out, res, (int64_t) sh.steps[j] * sh.branches[j], &at);
        first += sh.branches[j];
    }
    return ggml_reshape_3d(ctx, ggml_view_2d(ctx, out, O, n, out->nb[1], 0), hv, Hv, n);
}

/* One segment's delta rule over its rows (q, k, v [., ., n], gate and beta [Hv, n]); qk:
 * the tensor its q and k sit side by side in, or NULL. */
static struct ggml_tensor * delta_net(dfl_graph * g, const seg_build * s, int il, struct ggml_tensor * qk,
                                      struct ggml_tensor * q, struct ggml_tensor * k, struct ggml_tensor * v,
                                      struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const dfl_target * t = s->b->t;
    struct ggml_context * ctx = g->ctx;
    const dfl_recurrent_geometry * r = &t->m.rec;
    const int64_t hk = r->head_k_dim, hv = r->head_v_dim, Hk = r->n_k_heads, Hv = r->n_v_heads, n = s->s->n;
    const size_t f32 = sizeof(float);

    q = as_sequence(ctx, q, hk, Hk, n);
    k = as_sequence(ctx, k, hk, Hk, n);
    v = as_sequence(ctx, v, hv, Hv, n);
    gate = ggml_reshape_4d(ctx, gate, 1, Hv, n, 1);
    beta = ggml_reshape_4d(ctx, beta, 1, Hv, n, 1);
    if (s->s->kind == DFL_STEP_TREE) {
        return delta_net_tree(g, s, il, qk, q, k, v, gate, beta);
    }
    struct ggml_tensor * state = dfl_memory_slice(ctx, &t->mem, t->mem.ssm[il], s->s->seq);
    struct ggml_tensor * s0 = ggml_reshape_4d(ctx, state, hv, hv, Hv, 1);
    struct ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, gate, beta, s0, 1);
    const int64_t n_out = hv * Hv * n;
    if (s->s->kind == DFL_STEP_DECODE) {
        struct ggml_tensor * s1 = ggml_view_1d(ctx, res, hv * hv * Hv, n_out * f32);
        ggml_build_forward_expand(g->gf, ggml_cpy(ctx, s1, state));
    }
    return ggml_view_3d(ctx, res, hv, Hv, n, hv * f32, hv * Hv * f32, 0);
}

struct ggml_tensor * dfl_graph_delta_net(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * gate, struct ggml_tensor * beta) {
    const graph_build * b = g->runtime;
    const dfl_recurrent_geometry * r = &b->t->m.rec;
    const int64_t hk = r->head_k_dim, Hk = r->n_k_heads;
    struct ggml_tensor * qk = qk_rows(q, k, hk, Hk);
    struct ggml_tensor * out = NULL;
    for (int i = 0; i < b->step->n_seg; i++) {
        const seg_build s = segment(g, i);
        if (s.s->kind != DFL_STEP_DECODE) {
            /* the state moves only at commit, by rerunning the kept path (add_pending_commit):
             * cheaper than keeping a state per verified row */
            keep_for_commit(g, &s, il, q, k, v, gate, beta);
        }
        struct ggml_tensor * qk_s = qk && !s.whole ? seg_rows(g->ctx, &s, qk, 2) : qk;
        struct ggml_tensor * o = delta_net(g, &s, il, qk_s, seg_rows(g->ctx, &s, q, 2), seg_rows(g->ctx, &s, k, 2),
                                           seg_rows(g->ctx, &s, v, 2), seg_rows(g->ctx, &s, gate, 1),
                                           seg_rows(g->ctx, &s, beta, 1));
        out = join(g->ctx, out, o, 2);
    }
    return out;
}

/* ---- the pending commits ---------------------------------------------------------------- */

/* A sequence's commit is carried out at the start of the next graph it is in, so a
 * decoding step costs one target graph. Attention: after a tree, the accepted path's
 * rows move to consecutive cells (a chain's are already in place). Recurrent layers: the
 * conv state becomes the inputs before the next token, and the recurrent state that of
 * the last kept row, by rerunning the recurrence from the committed state over the
 * verify's rows gathered in path order (a chain's in order), the rows after the kept
 * ones made identity steps (decay exp(0) = 1, update weight 0: the state passes through
 * unchanged, bit for bit). Which rows, columns and tokens is an input, so the graph's
 * shape does not depend on the accepted length and consecutive steps reuse it. Cache
 * rows move through a gather and a scatter: every read happens before any write, and
 * the round trip through f32 is exact for every cache type (quantized rows requantize
 * to the same bytes). */
static void add_pending_commit(const dfl_target * t, const dfl_segment * seg, struct ggml_context * ctx,
                               struct ggml_cgraph * gf, seg_inputs * in) {
    in->commit_rows = in->commit_keep = in->commit_conv_cols = in->commit_kv_src = in->commit_kv_dst = NULL;
    in->commit_kv_src_swa = in->commit_kv_dst_swa = NULL;
    if (!seg->commit_kind) {
        return;
    }
    const dfl_model * m = &t->m;
    const dfl_memory * mem = &t->mem;
    const bool tree = seg->commit_kind == 2;
    if (tree && m->n_attention > 0) {
        in->commit_kv_src = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
        in->commit_kv_dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
        ggml_set_input(in->commit_kv_src);
        ggml_set_input(in->commit_kv_dst);
        if (mem->swa_window > 0) {
            in->commit_kv_src_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
            in->commit_kv_dst_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
            ggml_set_input(in->commit_kv_src_swa);
            ggml_set_input(in->commit_kv_dst_swa);
        }
    }
    const int R = seg->commit_replay;
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
    const replay_planes P = dfl_replay_planes(&m->rec, t->p.n_verify);
    for (int il = 0; il < m->n_layer; il++) {
        if (m->kind[il] == DFL_LAYER_ATTENTION) {
            if (tree && !m->attn[il].shares_kv) {
                const bool ring = m->attn[il].window > 0;
                struct ggml_tensor * src = ring ? in->commit_kv_src_swa : in->commit_kv_src;
                struct ggml_tensor * dst = ring ? in->commit_kv_dst_swa : in->commit_kv_dst;
                struct ggml_tensor * caches[2] = { mem->k[il], mem->v[il] };
                for (int c = 0; c < 2; c++) {
                    struct ggml_tensor * rows = ggml_get_rows(ctx, caches[c], src);
                    ggml_build_forward_expand(gf, ggml_set_rows(ctx, caches[c], rows, dst));
                }
            }
            continue;
        }
        const size_t at = dfl_memory_slice_offset(mem, mem->replay[il], seg->seq);
        struct ggml_tensor * rp = mem->replay[il];
        struct ggml_tensor * q, * k, * v, * g, * b;
        if (tree) {
            /* the path's columns of every plane, in path order; identity steps take the
             * zero column (decay 0, update weight 0). The decay and update weight planes,
             * of one width, in one gather: its index holds the columns once per plane. */
            struct ggml_tensor * cols = ggml_view_1d(ctx, in->commit_rows, R, 0);
            struct ggml_tensor * planes[2];
            const int64_t first[2] = { P.conv, P.qk }, rows[2] = { C, QK };
            for (int i = 0; i < 2; i++) {
                struct ggml_tensor * plane = ggml_view_2d(ctx, rp, rows[i], P.cols, rows[i] * f32,
                                                          at + (size_t) first[i] * f32);
                planes[i] = ggml_get_rows(ctx, plane, cols);
            }
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, P.cols, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   at + (size_t) P.g * f32);
            gb = ggml_get_rows(ctx, gb, in->commit_rows); /* [Hv, R, 2] */
            v = ggml_view_4d(ctx, planes[0], hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, (size_t) QK * f32);
            q = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, 0);
            k = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, hk * Hk * f32);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        } else {
            /* a chain's rows are in order already; the decay and update weight of every row
             * times keep, in one product: [Hv, R] decays, then [Hv, R] weights */
            v = ggml_view_4d(ctx, rp, hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, at + (size_t) (P.conv + QK) * f32);
            q = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, at + (size_t) P.qk * f32);
            k = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32,
                             at + (size_t) (P.qk + hk * Hk) * f32);
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, R, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   at + (size_t) P.g * f32);
            gb = ggml_mul(ctx, gb, in->commit_keep);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        }
        struct ggml_tensor * ssm = dfl_memory_slice(ctx, &t->mem, mem->ssm[il], seg->seq);
        struct ggml_tensor * s0 = ggml_reshape_4d(ctx, ssm, hv, hv, Hv, 1);
        struct ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, v, g, b, s0, 1);
        struct ggml_tensor * state = ggml_view_2d(ctx, r, hv * hv * Hv, 1, hv * hv * Hv * f32, hv * Hv * R * f32);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, state, ggml_reshape_2d(ctx, ssm, hv * hv * Hv, 1)));
        struct ggml_tensor * scratch = dfl_memory_slice(ctx, &t->mem, mem->conv_scratch[il], seg->seq);
        struct ggml_tensor * cols = ggml_get_rows(ctx, scratch, in->commit_conv_cols); /* [C, W] */
        struct ggml_tensor * conv = dfl_memory_slice(ctx, mem, mem->conv[il], seg->seq);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, cols), conv));
    }
}

static void fill_commit_inputs(dfl_target * t, const dfl_segment * seg, const seg_inputs * in) {
    const pending_commit * pc = seg->commit;
    const dfl_memory * mem = &t->mem;
    if (in->commit_kv_src) {
        const int M = t->p.n_verify;
        int32_t * src = t->host_i32;
        int64_t * dst = t->host_i64;
        /* unused entries copy position p0 onto itself (path[0] is always the root, already in place) */
        for (int ring = 0; ring < 2; ring++) {
            struct ggml_tensor * src_in = ring ? in->commit_kv_src_swa : in->commit_kv_src;
            struct ggml_tensor * dst_in = ring ? in->commit_kv_dst_swa : in->commit_kv_dst;
            if (!src_in) {
                continue;
            }
            const int R = ring ? mem->swa_ring : mem->n_ctx;
            const int64_t base = (int64_t) seg->seq * (R + mem->spare);
            for (int k = 0; k < M; k++) { /* the path's node k is at depth k */
                src[k] = (int32_t) (base + (k < pc->n_keep ? ring_slot(pc->p0, pc->path[k], k, R) : pc->p0 % R));
                dst[k] = base + (pc->p0 + (k < pc->n_keep ? k : 0)) % R;
            }
            dfl_runtime_set(&t->rt, src_in, src, 0, (size_t) M * sizeof(int32_t));
            dfl_runtime_set(&t->rt, dst_in, dst, 0, (size_t) M * sizeof(int64_t));
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

/* The hidden states x [n_embd, step rows] entering `layer`, where feature layers are
 * captured: each row into its slot's feature rows (in->feat_rows: where each segment's
 * rows go, dfl_memory_features_at), which stay until that slot's next call (other
 * sequences' graphs do not touch them). */
static void capture_features(const dfl_target * t, const graph_inputs * in, struct ggml_context * ctx,
                             struct ggml_cgraph * gf, struct ggml_tensor * x, int layer) {
    struct ggml_tensor * features = t->mem.features;
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] != layer) {
            continue;
        }
        struct ggml_tensor * dst = ggml_view_2d(ctx, features, t->m.n_embd, features->ne[1], features->nb[1],
                                                (size_t) f * t->m.n_embd * sizeof(float));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, dst, x, in->feat_rows));
    }
}

static struct ggml_tensor * new_input(struct ggml_context * ctx, enum ggml_type type, int64_t n) {
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_input(x);
    return x;
}

/* A segment's masks and tree tables. */
static void add_segment_inputs(const dfl_target * t, const dfl_segment * seg, struct ggml_context * ctx,
                               seg_inputs * in) {
    const dfl_model * m = &t->m;
    const int n = seg->n;
    in->mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, seg->n_kv, n);
    ggml_set_input(in->mask);
    in->mask_swa = NULL;
    if (t->mem.swa_window > 0) {
        in->mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, attended_rows(&t->mem, seg, t->mem.swa_ring), n);
        ggml_set_input(in->mask_swa);
    }
    in->conv_rows = in->tree_steps = in->branch_from = in->out_rows = in->scatter = in->conv_out = NULL;
    in->conv_scatter = NULL;
    if (seg->kind == DFL_STEP_TREE && m->n_recurrent > 0) {
        const tree_shape sh = seg->shape;
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
}

/* The step's token embeddings: one lookup over a host input when every segment's tokens
 * come from the host, else a lookup per segment joined. */
static struct ggml_tensor * embed(const dfl_target * t, const dfl_step * step, struct ggml_context * ctx,
                                  graph_inputs * in) {
    bool host = true;
    for (int i = 0; i < step->n_seg; i++) {
        host = host && !step->seg[i].tokens_src;
        in->seg[i].tokens = NULL;
    }
    in->tokens = NULL;
    if (host) {
        in->tokens = new_input(ctx, GGML_TYPE_I32, step->n_rows);
        return ggml_get_rows(ctx, t->tok_lookup, in->tokens);
    }
    struct ggml_tensor * x = NULL;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        struct ggml_tensor * tokens;
        if (s->tokens_src) {
            tokens = ggml_view_1d(ctx, s->tokens_src, s->n, 0);
        } else {
            tokens = in->seg[i].tokens = new_input(ctx, GGML_TYPE_I32, s->n);
        }
        x = join(ctx, x, ggml_get_rows(ctx, t->tok_lookup, tokens), 1);
    }
    return x;
}

/* The rows with logits: every row, one segment's last (also where none has logits: the
 * row a cut keeps), or gathered by an input. */
static struct ggml_tensor * logits_rows(const dfl_step * step, struct ggml_context * ctx, graph_inputs * in,
                                        struct ggml_tensor * x) {
    in->out_idx = NULL;
    if (step->n_out == step->n_rows) {
        return x;
    }
    if (step->n_seg == 1) { /* its last row */
        return ggml_view_2d(ctx, x, x->ne[0], 1, x->nb[1], (size_t) (step->n_rows - 1) * x->nb[1]);
    }
    in->out_idx = new_input(ctx, GGML_TYPE_I32, step->n_out);
    return ggml_get_rows(ctx, x, in->out_idx);
}

/* Whether a feature layer is n_layer: the final-normed state of every row, for a drafter. */
static bool captures_final_state(const dfl_target * t) {
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] == t->m.n_layer) {
            return true;
        }
    }
    return false;
}

struct ggml_tensor * dfl_graph_ffn_rows(dfl_graph * g, int il, struct ggml_tensor * x) {
    graph_build * b = g->runtime;
    const dfl_step * step = b->step;
    if (il != b->t->m.n_layer - 1 || step->n_out == step->n_rows || (step->n_out == 0 && step->n_seg > 1) ||
        captures_final_state(b->t)) {
        return x;
    }
    if (b->cut && b->in->out_idx) { /* a second tensor of the layer: the same rows */
        return ggml_get_rows(g->ctx, x, b->in->out_idx);
    }
    b->cut = true;
    return logits_rows(step, g->ctx, b->in, x);
}

struct ggml_cgraph * dfl_target_build_graph(const dfl_target * t, const dfl_step * step, struct ggml_context * ctx,
                                            graph_inputs * in) {
    const dfl_model * m = &t->m;
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, t->rt.graph_size, false);
    for (int i = 0; i < step->n_seg; i++) {
        add_pending_commit(t, &step->seg[i], ctx, gf, &in->seg[i]);
    }

    const int n = step->n_rows;
    struct ggml_tensor * x = dfl_cb(embed(t, step, ctx, in), "inp_embd", -1);
    in->pos = new_input(ctx, GGML_TYPE_I32, n);
    in->slots = new_input(ctx, GGML_TYPE_I64, n);
    in->slots_swa = t->mem.swa_window > 0 ? new_input(ctx, GGML_TYPE_I64, n) : NULL;
    in->feat_rows = t->mem.features ? new_input(ctx, GGML_TYPE_I64, n) : NULL;
    for (int i = 0; i < step->n_seg; i++) {
        add_segment_inputs(t, &step->seg[i], ctx, &in->seg[i]);
    }

    in->out_idx = NULL;
    graph_build b = { t, step, in, { NULL }, { NULL }, false };
    dfl_graph g = { ctx, gf, n, in->pos, &b };
    if (m->embd_scale != 1.0f) {
        x = dfl_cb(ggml_scale(ctx, x, m->embd_scale), "inp_scaled", -1);  /* Gemma's name for it */
    }
    for (int il = 0; il < m->n_layer; il++) {
        capture_features(t, in, ctx, gf, x, il);
        x = m->arch->build_layer(m, &g, il, x);
    }
    /* layer n_layer is the final-normed state, as transformers' last hidden_states entry
     * (what z-lab's drafters read for the last target layer) */
    const bool normed = captures_final_state(t);
    if (normed) {
        x = dfl_cb(dfl_rms_norm(ctx, x, m->output_norm, m->eps), "result_norm", -1);
        capture_features(t, in, ctx, gf, x, m->n_layer);
    }

    in->logits = NULL;
    memset(&in->samp, 0, sizeof in->samp);
    if (step->n_out > 0) {
        if (!b.cut) {
            x = logits_rows(step, ctx, in, x);
        }
        if (!normed) {
            x = dfl_cb(dfl_rms_norm(ctx, x, m->output_norm, m->eps), "result_norm", -1);
        }
        struct ggml_tensor * out = dfl_gguf_mul_mat(&m->file, ctx, t->head, x); /* n_head wide */
        if (m->logit_softcap > 0.0f) {
            out = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, out, 1.0f / m->logit_softcap)), m->logit_softcap);
        }
        in->logits = dfl_cb(out, "result_output", -1);
        ggml_set_output(out);
        dfl_sampler_build(ctx, gf, out, &step->samp, &in->samp);
    }
    ggml_build_forward_expand(gf, x);
    return gf;
}

/* ---- inputs ---------------------------------------------------------------------------- */

/* Tokens (unless they come from a device tensor), positions (n_past + depth; a chain's
 * depth is its index) and cache rows (of position n_past + index) of every row. */
static void set_token_inputs(dfl_target * t, const graph_inputs * in, const dfl_step * step,
                             const int32_t * const * tokens) {
    const dfl_memory * mem = &t->mem;
    int32_t * pos = t->host_i32;
    int64_t * slots = t->host_i64;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
        for (int j = 0; j < s->n; j++) {
            pos[s->row0 + j] = s->n_past + (depth ? depth[j] : j);
        }
        if (in->tokens) {
            dfl_runtime_set(&t->rt, in->tokens, tokens[i], (size_t) s->row0 * sizeof(int32_t),
                            (size_t) s->n * sizeof(int32_t));
        } else if (in->seg[i].tokens) {
            dfl_runtime_set(&t->rt, in->seg[i].tokens, tokens[i], 0, (size_t) s->n * sizeof(int32_t));
        }
    }
    dfl_runtime_set(&t->rt, in->pos, pos, 0, (size_t) step->n_rows * sizeof(int32_t));
    for (int ring = 0; ring < 2; ring++) {
        struct ggml_tensor * dst = ring ? in->slots_swa : in->slots;
        if (!dst) {
            continue;
        }
        const int R = ring ? mem->swa_ring : mem->n_ctx;
        for (int i = 0; i < step->n_seg; i++) {
            const dfl_segment * s = &step->seg[i];
            const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
            for (int j = 0; j < s->n; j++) {
                slots[s->row0 + j] = (int64_t) s->seq * (R + mem->spare) +
                                     ring_slot(s->n_past, j, depth ? depth[j] : j, R);
            }
        }
        dfl_runtime_set(&t->rt, dst, slots, 0, (size_t) step->n_rows * sizeof(int64_t));
    }
    if (in->feat_rows) {
        for (int i = 0; i < step->n_seg; i++) {
            const dfl_segment * s = &step->seg[i];
            for (int j = 0; j < s->n; j++) {
                slots[s->row0 + j] = dfl_memory_features_region(mem, s->seq, s->n) + s->feat_at + j;
            }
        }
        dfl_runtime_set(&t->rt, in->feat_rows, slots, 0, (size_t) step->n_rows * sizeof(int64_t));
    }
}

/* Causal for a chain; a tree node sees the context and its ancestors. In a sliding
 * layer's ring of R rows (and its spare rows after it), the call's rows are where
 * ring_slot puts them; any other ring row j holds position j - p mod R + p - R (none when
 * negative), a spare row nothing; the mask hides, in addition, keys `window` or more
 * positions behind the row's own (a node's position is p + depth). */
static void fill_mask(dfl_target * t, const dfl_segment * s, struct ggml_tensor * dst, int window, int ring) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t minf = ggml_fp32_to_fp16(-INFINITY);
    const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
    const uint64_t * ancestors = depth ? s->tree->ancestors : NULL;
    const int p = s->n_past, n = s->n, n_kv = (int) dst->ne[0], base = p % ring;
    for (int i = 0; i < n; i++) {
        ggml_fp16_t * row = t->host_mask + (size_t) i * n_kv;
        const int pos_i = p + (depth ? depth[i] : i);
        for (int j = 0; j < n_kv; j++) {
            const int node = ring_row(base, j, depth, n, ring);
            bool visible;
            int pos_j;
            if (node >= 0) {
                visible = depth ? (ancestors[i] >> node & 1) != 0 : node <= i;
                pos_j = p + (depth ? depth[node] : node);
            } else {
                pos_j = p + ((j - p) % ring + ring) % ring - ring;
                visible = j < ring && pos_j >= 0;
            }
            if (visible && window > 0) {
                visible = pos_i - pos_j < window;
            }
            row[j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&t->rt, dst, t->host_mask, 0, (size_t) n * n_kv * sizeof(ggml_fp16_t));
}

static void set_tree_rows(dfl_target * t, const dfl_segment * s, const seg_inputs * in) {
    const tree_plan * tp = s->tree;
    const tree_shape sh = tp->shape;
    const int n = s->n;
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

/* Which rows have logits: each segment's last, or all of its rows. */
static void set_logits_rows(dfl_target * t, const graph_inputs * in, const dfl_step * step) {
    int32_t * idx = t->host_i32;
    int k = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        if (s->logits == LOGITS_LAST) {
            idx[k++] = s->row0 + s->n - 1;
        } else if (s->logits == LOGITS_ALL) {
            for (int j = 0; j < s->n; j++) {
                idx[k++] = s->row0 + j;
            }
        }
    }
    dfl_runtime_set(&t->rt, in->out_idx, idx, 0, (size_t) k * sizeof(int32_t));
}

void dfl_target_fill_inputs(dfl_target * t, const graph_inputs * in, const dfl_step * step,
                            const int32_t * const * tokens) {
    for (int i = 0; i < step->n_seg; i++) {
        if (step->seg[i].commit) {
            fill_commit_inputs(t, &step->seg[i], &in->seg[i]);
        }
    }
    set_token_inputs(t, in, step, tokens);
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        fill_mask(t, s, in->seg[i].mask, 0, t->mem.n_ctx);
        if (in->seg[i].mask_swa) {
            fill_mask(t, s, in->seg[i].mask_swa, t->mem.swa_window, t->mem.swa_ring);
        }
        if (in->seg[i].conv_rows) {
            set_tree_rows(t, s, &in->seg[i]);
        }
    }
    if (in->out_idx) {
        set_logits_rows(t, in, step);
    }
}
