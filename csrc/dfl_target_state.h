/* The target runtime's state, shared by its files, and the step descriptor between
 * them: dfl_target.c (parameters, loading, sequence slots, what a drafter reads),
 * dfl_target_place.c (where layers, weights and state live), dfl_target_step.c (the
 * step and graph reuse), dfl_target_commit.c (a verify's commit), dfl_target_sampling.c
 * (how the step's rows choose, and reading them) and dfl_target_graph.c (graph
 * building): a graph is a function of the model, the memory (dfl_memory.h) and the
 * descriptor of its step. */
#ifndef DFL_TARGET_STATE_H
#define DFL_TARGET_STATE_H

#include "dfl_memory.h"
#include "dfl_model.h"
#include "dfl_runtime.h"
#include "dfl_sampler.h"
#include "dfl_target.h"
#include "dfl_tree.h"

enum { LOGITS_NONE = 0, LOGITS_LAST = 1, LOGITS_ALL = 2 };

/* Chain verifies of one length in a row after which their commits rerun every verified
 * row again (see dfl_target_commit). */
#define DFL_CHAIN_STEADY 8

/* A commit waiting for the next graph its sequence is in (see dfl_target_graph.c). */
typedef struct pending_commit {
    bool active;
    bool tree;
    int p0;                       /* the sequence's length before the commit */
    int n_keep;
    int n_replay;                 /* rows the commit reruns, identity steps after the kept ones: a
                                   * chain verify's every row (only the kept ones while chain
                                   * lengths vary); a tree's padded spine
                                   * (no root path is longer) */
    int32_t path[DFL_MAX_VERIFY]; /* the kept row of each new position (a chain's: 0, 1, ...) */
    int32_t conv_cols[16];        /* columns of the conv scratch that become the conv state */
} pending_commit;

/* The verify protocol of one slot, between its calls: the verify waiting for its
 * commit, the last tree's plan, the commit waiting for the next graph, and how steady
 * the chain's lengths have been. The memory (dfl_memory.h) holds the slot's state; this
 * is what the target's step and commit calls owe each other. */
typedef struct verify_seq {
    int pending;         /* rows of a verify waiting for its commit (0: none) */
    bool pending_tree;
    tree_plan tree;      /* the last tree verify's plan */
    pending_commit commit;
    int last_chain;      /* rows of the last chain verify committed (0: none since the reset) */
    int chain_steady;    /* chain commits in a row of that length (a fresh slot counts as steady) */
} verify_seq;

/* One sequence's rows in a step: what they are, where they sit. */
typedef struct dfl_segment {
    int seq;
    int kind;       /* DFL_STEP_DECODE (append; a prefill chunk or a token), DFL_STEP_CHAIN, DFL_STEP_TREE */
    int n;          /* rows: tokens of a decode or chain, nodes of a tree */
    int row0;       /* its first row in the step */
    int n_past;     /* the sequence's length before the step: positions n_past + (index or depth) */
    int n_kv;       /* cache positions its attention spans (padded so that steps share shapes) */
    int logits;     /* LOGITS_* (a verify's: every row) */
    const tree_plan * tree;           /* a tree's plan */
    const pending_commit * commit;    /* the sequence's commit, carried at the start of the graph (NULL: none) */
    struct ggml_tensor * tokens_src;  /* tokens read from this device tensor (a drafter's block), not an input */
    /* what the graph's shape depends on, kept with it (the plan and commit change later) */
    tree_shape shape;                 /* a tree's padded recurrence */
    int commit_kind;                  /* 0 none, 1 chain, 2 tree */
    int commit_replay;                /* rows the commit reruns */
    int feat_at;                      /* its first row in its slot's feature rows (an input, not the shape) */
} dfl_segment;

/* A step: segments of distinct sequences, one graph. */
typedef struct dfl_step {
    int n_seg;
    int n_rows;            /* every segment's */
    int n_out;             /* rows with logits: the segments' in order */
    dfl_segment seg[DFL_MAX_SEQ];
    dfl_sampler_key samp;  /* how its logits rows choose */
} dfl_step;

/* Inputs of one segment. */
typedef struct seg_inputs {
    struct ggml_tensor * tokens;       /* its tokens, when the step takes them per segment */
    struct ggml_tensor * mask;
    /* sliding-window layers: their cache is a ring (see dfl_memory.h), with its own mask */
    struct ggml_tensor * mask_swa;
    /* tree verify of a model with recurrent layers: the tree_plan's index tables */
    struct ggml_tensor * conv_rows;
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
} seg_inputs;

typedef struct graph_inputs {
    struct ggml_tensor * tokens;    /* [n_rows], when every segment's come from the host */
    struct ggml_tensor * pos;       /* [n_rows] */
    struct ggml_tensor * slots;     /* [n_rows] cache rows */
    struct ggml_tensor * slots_swa; /* [n_rows] rows in the sliding layers' rings */
    struct ggml_tensor * feat_rows; /* [n_rows] each row's feature row (NULL: no feature layers) */
    struct ggml_tensor * out_idx;   /* rows with logits, when they are not all rows or one segment's last */
    seg_inputs seg[DFL_MAX_SEQ];
    struct ggml_tensor * logits;    /* [n_vocab, n_out] */
    dfl_sampler_graph samp;         /* the choice of each logits row (its inputs and outputs) */
} graph_inputs;

typedef struct graph_cache {
    bool valid;
    uint64_t last_use;
    dfl_step key; /* the step it was built for: steps of the same shape reuse it */
    struct ggml_cgraph * gf;
    graph_inputs in;
} graph_cache;

struct dfl_target {
    dfl_model m;
    dfl_target_params p;
    dfl_runtime rt;

    /* what the token lookup gathers from: the token embedding, or a host copy of it when
     * it is also an LM head too large for its device to take whole (see
     * dfl_target_place_weights) */
    struct ggml_tensor * tok_lookup;
    struct ggml_context * ctx_lookup;
    ggml_backend_buffer_t buf_lookup;
    /* the logits' weight: m.output, or its rows of the kept tokens (params.head_tokens) */
    struct ggml_tensor * head;
    int n_head; /* its rows: the logits' width */
    struct ggml_context * ctx_head;
    ggml_backend_buffer_t buf_head;

    dfl_memory mem;
    verify_seq verify[DFL_MAX_SEQ];

    ggml_backend_dev_t * placed;  /* per file tensor: its device when placed by name (NULL: by its layer) */
    uint64_t host_layer_weights;  /* see dfl_target_info */

    /* host staging for graph inputs */
    int32_t * host_i32;
    int64_t * host_i64;
    ggml_fp16_t * host_mask;
    size_t host_rows, host_mask_size;

    dfl_sampler sampler[DFL_MAX_SEQ]; /* each sequence's sampling settings, and what is staged for its next rows */
    dfl_tree_shapes tree_shapes;      /* the padded shapes trees took lately (shared: trees of a budget share graphs) */

    /* results of the last step */
    const graph_cache * out;
    int n_out;
    /* its sampled rows by sequence, in order, with the masks they were filled with (a
     * greedy row the masks' candidates left undecided is decided again from them) */
    struct {
        int seq, n_rows;
        uint64_t mask_gen; /* 0: no masks */
    } out_part[DFL_MAX_SEQ];
    int n_out_parts;
    int32_t * out_choices;  /* CANDIDATES: the choices, read once and decided */
    int cap_out_choices;
    bool choices_decided;
    /* CANDIDATES in a ranked step: its settings as filled (its stage runs again with them
     * when a row's candidates held too few allowed tokens), and the candidates and their
     * probabilities of that run, read back (out_redone: they are the step's) */
    float * out_params;
    int32_t * out_cand;
    float * out_cand_p;
    int cap_out_params, cap_out_cand, cap_out_cand_p;
    bool out_redone;

    graph_cache graphs[DFL_MAX_GRAPH_SLOTS]; /* one per runtime slot */
    uint64_t graph_clock;
    int64_t n_graphs, n_graph_builds;
    int n_last_replay; /* see dfl_target_info */
};

/* dfl_target.c: loading in steps, for the memory planner (dfl_plan.c) */
dfl_status dfl_target_open(const char * path, const dfl_target_params * params, dfl_target ** out);
/* A sequence slot's index, checked: every entry point that takes one calls this first. */
static inline dfl_status dfl_target_check_seq(const dfl_target * t, int32_t seq) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (seq < 0 || seq >= t->mem.n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d is outside 0..%d (the target has %d sequence slots)", seq,
                        t->mem.n_seq - 1, t->mem.n_seq);
    }
    return DFL_OK;
}

/* dfl_target_step.c: the splits and copies of the last graph computed */
void dfl_target_last_copies(const dfl_target * t, int64_t copies[2]);

/* dfl_target_place.c: where layers, weights and state live */
int dfl_target_first_device_layer(const dfl_target * t);
ggml_backend_dev_t * dfl_target_weight_devices(const dfl_target * t);
dfl_status dfl_target_place_weights(dfl_target * t);
dfl_status dfl_target_cut_head(dfl_target * t, const dfl_target_params * p);
dfl_status dfl_target_define_state(dfl_target * t);

/* dfl_target_step.c: the step, its graph slots and the graphs a load reserves */
int dfl_target_max_tree_nodes(const dfl_target * t);
/* Host staging for the inputs of a step of n rows whose largest mask has `mask` entries. */
dfl_status dfl_target_host_reserve(dfl_target * t, int n, size_t mask);
/* The largest graph each of the target's runtime slots can be asked to hold, each handed
 * to visit with its slot: slot 0 a prefill chunk, the others a step of every sequence
 * (a tree of the most nodes, or a chain of n_verify rows, each carrying its commit),
 * all at the end of a full context and sampled over the whole vocabulary. The planner
 * measures them; a load reserves them, so that compute memory does not creep up as
 * contexts lengthen. */
dfl_status dfl_target_worst_graphs(dfl_target * t, dfl_graph_visit visit, void * user);

/* dfl_target_commit.c: the verify protocol of each slot */
/* No verify pending, no commit waiting, the chain lengths counted steady. */
void dfl_verify_seq_reset(verify_seq * v);
/* Slot seq was written from outside (a checkpoint restored into it): it holds n_past
 * positions, no verify or commit pending. */
void dfl_target_seq_restored(dfl_target * t, int seq, int n_past);
/* No verify of slot seq waits for its commit, and no commit for a graph. */
bool dfl_target_seq_settled(const dfl_target * t, int seq);

/* dfl_target_sampling.c: how a step's rows choose */
dfl_status dfl_target_step_sampling(dfl_target * t, dfl_step * step);
/* The step's sampling inputs filled, and which sequences' rows its results are. */
dfl_status dfl_target_fill_sampling(dfl_target * t, const dfl_step * step, const graph_inputs * in);
/* Rows row0..row0+n_rows of `have` (`what` names them in the message). */
dfl_status dfl_target_check_rows(const dfl_target * t, int32_t row0, int32_t n_rows, int32_t have,
                                 const char * what);

/* dfl_target_graph.c: the graph of a step, and its inputs */
struct ggml_cgraph * dfl_target_build_graph(const dfl_target * t, const dfl_step * step, struct ggml_context * ctx,
                                            graph_inputs * in);
/* tokens[i]: segment i's host tokens (unused for a segment reading a device tensor) */
void dfl_target_fill_inputs(dfl_target * t, const graph_inputs * in, const dfl_step * step,
                            const int32_t * const * tokens);

#endif
