/* What a target graph's builders share while one graph is built (dfl_target_graph.c builds
 * it, dfl_graph_services.c holds the services the architectures' layer builders call,
 * dfl_target_inputs.c fills its inputs): the graph being built and each segment's
 * (sequence's) part of a service. */
#ifndef DFL_GRAPH_BUILD_H
#define DFL_GRAPH_BUILD_H

#include "dfl_target_state.h"

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

static inline seg_build segment(const dfl_graph * g, int i) {
    const graph_build * b = g->runtime;
    return (seg_build) { b, &b->step->seg[i], &b->in->seg[i], b->step->n_seg == 1 };
}

/* Rows [s.row0, s.row0 + s.n) of x along dimension `dim` (x itself when the segment is
 * the whole step). */
static inline struct ggml_tensor * seg_rows(struct ggml_context * ctx, const seg_build * s, struct ggml_tensor * x, int dim) {
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
static inline struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x, int dim) {
    return acc ? ggml_concat(ctx, acc, x, dim) : x;
}

/* The cache row of a call's row j (at depth d below the call's first position p) in a
 * sliding layer's ring of R rows: (p + j) mod R, except where the row's index reaches past
 * the ring's end while its position (p + d) does not, or the other way round. Flash
 * attention sums the keys in row order, so a row must read the keys it sees in the order a
 * one-row decode of its position reads them: its position's own side of the ring's end.
 * A tree's row past the end whose position is before it takes a spare row after the ring
 * (the ring has n_verify of them); a chain's rows (d = j) are at (p + j) mod R. */
static inline int ring_slot(int p, int j, int d, int R) {
    const int base = p % R;
    return base + d < R ? base + j : base + j - R;
}

/* The call's row that ring_slot puts at row `slot` (-1: none), base = p mod R. depth
 * NULL: a chain's. */
static inline int ring_row(int base, int slot, const int32_t * depth, int n, int R) {
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
static inline int attended_rows(const dfl_memory * mem, const dfl_segment * s, int rows) {
    return s->n_kv > rows ? (rows + mem->spare < s->n_kv ? rows + mem->spare : s->n_kv) : s->n_kv;
}

/* dfl_target_graph.c: a segment's pending commit's inputs (the rows it keeps) */
void dfl_target_fill_commit_inputs(dfl_target * t, const dfl_segment * seg, const seg_inputs * in);

#endif
