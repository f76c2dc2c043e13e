/* The graph services the architectures' layer builders call (csrc/models/): attention
 * over the cache (a window's ring, a shared cache, sinks), the short convolution and the
 * delta rule with their states, each run per segment on its own sequence's cache and
 * states, so that a sequence's rows see exactly what they would see alone; and what a
 * chain or tree verify keeps of them for its commit. */
#include "dfl_graph_build.h"

#include <math.h>
#include <string.h>

struct ggml_tensor * dfl_graph_attention(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, float scale) {
    return dfl_graph_attention_sinks(g, il, q, k, v, scale, NULL);
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
