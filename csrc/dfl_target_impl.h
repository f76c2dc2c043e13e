/* The target runtime's state, shared by its two halves: dfl_target.c (loading, calls,
 * commits' bookkeeping, graph reuse) and dfl_target_graph.c (graph building). */
#ifndef DFL_TARGET_IMPL_H
#define DFL_TARGET_IMPL_H

#include "dfl_model.h"
#include "dfl_runtime.h"
#include "dfl_sampler.h"
#include "dfl_target.h"

#define DFL_MAX_TREE 64
#define DFL_MAX_VERIFY 256

enum { LOGITS_NONE = 0, LOGITS_LAST = 1, LOGITS_ALL = 2 };

/* Branches of a tree verify run in this many delta-rule ops, each padded on its own. */
#define DFL_TREE_GROUPS 2

/* The padded shape of a tree verify's recurrence (see plan_recurrence in dfl_target.c):
 * the spine's steps, the steps of its first part (up to the last step a branch leaves
 * from) and the first step a branch leaves from, the nodes off the spine (the short
 * convolution's windows of their own), then per group of branches, branches x steps.
 * A shape without branches has split 0 and first DFL_MAX_TREE. */
typedef struct tree_shape {
    int spine, split, first, off;
    int branches[DFL_TREE_GROUPS], steps[DFL_TREE_GROUPS];
} tree_shape;

static inline int tree_branches(const tree_shape * sh) {
    int n = 0;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        n += sh->branches[g];
    }
    return n;
}

/* A tree verify's recurrence runs in up to 2 + DFL_TREE_GROUPS delta-rule ops per layer:
 * the spine (the longest root path) as one sequence in two parts, the first keeping
 * its states from the first branch's start on, the rest (after the last branch's
 * start) keeping none; then each group of the other leaves' paths from where they
 * leave the spine, one sequence each, starting from the spine's state there. Branches are
 * grouped by length, so short ones are not padded to the longest. Each node's output
 * is read from the first sequence through it. The short convolution runs the spine as
 * one sequence (as the chain does) and each node off it on its own window, or every
 * node on its own window (tree_conv_spine). */
typedef struct tree_plan {
    int n;
    int32_t parent[DFL_MAX_TREE];
    int32_t depth[DFL_MAX_TREE];
    uint64_t ancestors[DFL_MAX_TREE];               /* bit j: node j is on the path to the root */
    /* conv window per node, d_conv columns of [committed conv inputs | nodes], oldest first */
    int32_t windows[DFL_MAX_TREE * 16];
    tree_shape shape;                               /* padded sizes (the graph's) */
    /* node of each step: the spine's, then each group's [branches][steps] */
    int32_t steps[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    int32_t branch_from[DFL_MAX_TREE];              /* per branch, groups in order: the spine snapshot it starts from */
    /* outputs: node i's row of the first op (the spine's first part), 0 for spare rows
     * and nodes first computed by a later op; then each later op's rows, in step order:
     * the node it computes first, or a spare row of its own (n + its index in the op) */
    int32_t out_rows[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    int32_t scatter[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    /* the conv's columns of [committed conv inputs | nodes] (see tree_conv_spine): the
     * committed ones and the spine's nodes (padded with its last), then the window of
     * each node off the spine (padded with the root's); or every node's window */
    int32_t conv_rows[DFL_MAX_TREE * 18];
    /* with the spine as a sequence, conv outputs: node i's step on the spine (0 for spare
     * rows and nodes off it); then each off-spine window's node, or a spare row of its
     * own (n + its index) */
    int32_t conv_out[2 * DFL_MAX_TREE];
    int32_t conv_scatter[DFL_MAX_TREE];
} tree_plan;

/* Steps of a tree's recurrence: the spine's and every group's. */
static inline int64_t tree_steps(const tree_shape * sh) {
    int64_t n = sh->spine;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        n += (int64_t) sh->branches[g] * sh->steps[g];
    }
    return n;
}

/* Rows of a tree's first delta-rule op: the spine's first part (all of it without
 * branches); the later ops' rows are scattered over those gathered from it. */
static inline int tree_head_rows(const tree_shape * sh) {
    return tree_branches(sh) > 0 ? sh->split : sh->spine;
}

/* Spare output rows: the most rows of a later op (each of its rows that is not a
 * node's first is written to a spare row of its own). */
static inline int64_t tree_spare_rows(const tree_shape * sh) {
    if (tree_branches(sh) == 0) {
        return 0;
    }
    int64_t d = sh->spine - sh->split;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        const int64_t rows = (int64_t) sh->branches[g] * sh->steps[g];
        d = rows > d ? rows : d;
    }
    return d;
}

/* Whether a tree's conv runs its spine as a sequence and each node off it on its own
 * window, or every node on its own window: whichever costs less for the padded shape,
 * counting the columns gathered and transposed and the outputs computed (an output
 * costs about 3.5 columns in instructions on the CPU backend). */
static inline bool tree_conv_spine(const tree_shape * sh, int n, int d_conv) {
    const int64_t W = d_conv - 1;
    const int64_t spine = 2 * (W + sh->spine + (W + 1) * sh->off) + 7 * (sh->spine + sh->off);
    return spine <= 2 * (W + 1) * n + 7 * n;
}

/* Entries of a tree_plan's conv_rows. */
static inline int64_t tree_conv_rows(const tree_shape * sh, int n, int d_conv) {
    return tree_conv_spine(sh, n, d_conv) ? d_conv - 1 + sh->spine + (int64_t) sh->off * d_conv : (int64_t) n * d_conv;
}

typedef struct graph_inputs {
    struct ggml_tensor * tokens;
    struct ggml_tensor * pos;
    struct ggml_tensor * slots;
    struct ggml_tensor * mask;
    /* sliding-window layers: their cache is a ring of swa_ring rows (position p in row
     * p % swa_ring), with its own slots and mask */
    struct ggml_tensor * slots_swa;
    struct ggml_tensor * mask_swa;
    /* tree verify of a model with recurrent layers */
    struct ggml_tensor * conv_rows;    /* the tree_plan's index tables, as inputs */
    struct ggml_tensor * tree_steps;
    struct ggml_tensor * branch_from;
    struct ggml_tensor * out_rows;
    struct ggml_tensor * scatter;
    struct ggml_tensor * conv_out;
    struct ggml_tensor * conv_scatter;
    /* the pending commit, when the graph carries one (fixed shapes: see add_pending_commit);
     * NULL when the model has nothing of that kind to commit */
    struct ggml_tensor * commit_rows;      /* [verified, 2] replay columns to rerun (the kept path, then any), twice */
    struct ggml_tensor * commit_keep;      /* [verified] 1 for the kept ones, 0 after */
    struct ggml_tensor * commit_conv_cols; /* [d_conv-1] columns of the conv scratch that become the conv state */
    struct ggml_tensor * commit_kv_src;    /* tree: [n_verify] cache rows to move ... */
    struct ggml_tensor * commit_kv_dst;    /* ... and where to */
    struct ggml_tensor * commit_kv_src_swa, * commit_kv_dst_swa; /* the same in the sliding layers' rings */
    dfl_sampler_graph samp;                /* the choice of each logits row (its inputs and outputs) */
} graph_inputs;

/* What makes two target graphs identical apart from their inputs. */
typedef struct graph_key {
    int n;
    int n_kv;
    int logits;
    bool verify;
    int commit;                      /* carries a pending commit: 0 none, 1 chain, 2 tree */
    int commit_replay;               /* tokens rerun by the commit */
    struct ggml_tensor * tokens_src; /* tokens read from this device tensor, not an input */
    bool tree;                       /* a tree verify (its shape is an input) ... */
    tree_shape shape;                /* ... its recurrence padded to this */
    dfl_sampler_key samp;            /* how its logits rows choose */
} graph_key;

typedef struct graph_cache {
    bool valid;
    uint64_t last_use;
    graph_key key;
    struct ggml_cgraph * gf;
    graph_inputs in;
    struct ggml_tensor * logits;
} graph_cache;

/* A commit waiting for the next graph (see add_pending_commit). */
typedef struct pending_commit {
    bool active;
    bool tree;
    int p0;                       /* context length before the commit */
    int n_keep;
    int n_replay;                 /* rows the commit reruns, identity steps after the kept ones: a
                                   * chain verify's every row (only the kept ones while chain
                                   * lengths vary); a tree's padded spine
                                   * (no root path is longer) */
    int32_t path[DFL_MAX_VERIFY]; /* the kept row of each new position (a chain's: 0, 1, ...) */
    int32_t conv_cols[16];        /* columns of the conv scratch that become the conv state */
} pending_commit;

struct dfl_target {
    dfl_model m;
    dfl_target_params p;
    dfl_runtime rt;

    struct ggml_context * ctx_state[2];   /* [0] on the device, [1] on the CPU (layers not offloaded) */
    ggml_backend_buffer_t buf_state[2];
    /* what the token lookup gathers from: the token embedding, or a host copy of it when
     * it is also an LM head too large for its device to take whole (see place_weights) */
    struct ggml_tensor * tok_lookup;
    struct ggml_context * ctx_lookup;
    ggml_backend_buffer_t buf_lookup;
    /* attention layers */
    struct ggml_tensor * k_cache[DFL_MAX_LAYERS];     /* [kv_dim, n_ctx] */
    struct ggml_tensor * v_cache[DFL_MAX_LAYERS];
    /* recurrent layers */
    struct ggml_tensor * conv_state[DFL_MAX_LAYERS];  /* [d_conv-1, channels]: last inputs, oldest first */
    struct ggml_tensor * ssm_state[DFL_MAX_LAYERS];   /* [S_v * S_v * H_v] */
    struct ggml_tensor * replay[DFL_MAX_LAYERS];      /* what the last verify (chain or tree) kept of each row to
                                                         rerun the accepted path at commit: planes of conv output,
                                                         q and k, g, beta (dfl_target_graph.c) */
    struct ggml_tensor * conv_scratch[DFL_MAX_LAYERS];/* [channels, d_conv-1 + n_verify]: conv inputs of the last
                                                         verify, committed ones first, one column per step or node */
    struct ggml_tensor * features;                    /* [n_feat * n_embd, rows] of the last call */
    /* while a graph is built: each attention layer's cache after this graph's rows are
     * stored in it, what the layers sharing that cache read */
    struct ggml_tensor * k_stored[DFL_MAX_LAYERS], * v_stored[DFL_MAX_LAYERS];

    /* host staging for graph inputs */
    int32_t * host_i32;
    int64_t * host_i64;
    ggml_fp16_t * host_mask;
    size_t host_rows, host_mask_size;
    int swa_window; /* the window of the model's sliding layers (0: none) */
    int swa_ring;   /* rows of their caches: the window and the largest call, at most n_ctx */

    dfl_sampler sampler; /* the sampling settings, and what is staged for the next call */

    /* results of the last call */
    struct ggml_tensor * out_logits;
    const dfl_sampler_graph * out_samp; /* its choices (and candidates) */
    int n_out;
    int n_rows;

    int n_past;
    int pending_verify;
    bool pending_tree;
    tree_plan tree;
    pending_commit commit;
    graph_cache graphs[DFL_MAX_GRAPH_SLOTS]; /* one per runtime slot */
    uint64_t graph_clock;
    int64_t n_graphs, n_graph_builds;
    int n_last_replay; /* see dfl_target_info */
    int last_chain;    /* rows of the last chain verify committed (0: none since the reset) */
    int chain_steady;  /* chain commits in a row of that length (a fresh target counts as steady) */
    tree_shape tree_shapes[DFL_MAX_TREE + 1]; /* per node count: the padded shape of tree graphs */
    int tree_shape_age[DFL_MAX_TREE + 1];     /* trees planned with it since it was last reset */
};

/* dfl_target.c: loading in steps, for the memory planner (dfl_plan.c) */
dfl_status dfl_target_open(const char * path, const dfl_target_params * params, dfl_target ** out);
ggml_backend_dev_t * dfl_target_weight_devices(const dfl_target * t);
dfl_status dfl_target_define_state(dfl_target * t);
int dfl_target_max_tree_nodes(const dfl_target * t);
/* The largest padded recurrence shape a tree of n nodes can take. */
tree_shape dfl_tree_worst_shape(int n);

/* dfl_target_graph.c */
struct ggml_cgraph * dfl_target_build_graph(dfl_target * t, struct ggml_context * ctx, graph_inputs * in, int n,
                                            int n_kv, bool verify, bool tree, int logits,
                                            struct ggml_tensor * tokens_src, const dfl_sampler_key * samp);
void dfl_target_fill_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n, int n_kv, bool tree);

/* Floats of a recurrent layer's replay memory: what a verify of up to n_verify rows keeps
 * to rerun the accepted path at commit. */
int64_t dfl_target_replay_floats(const dfl_model * m, int n_verify);

#endif
