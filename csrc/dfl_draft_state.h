/* The drafter runtime's state, shared by dfl_draft.c (loading, calls, descriptors,
 * graph reuse, inputs, results) and dfl_draft_graph.c (the propose graph from a
 * descriptor and the services an architecture's builder calls); the memory planner
 * (dfl_plan.c) and checkpoints (dfl_checkpoint.c) read it too. A graph is a function of
 * the drafter, its memory and the propose's descriptor (dfl_draft_step). */
#ifndef DFL_DRAFT_IMPL_H
#define DFL_DRAFT_IMPL_H

#include "dfl_drafter.h"
#include "dfl_memory.h"
#include "dfl_runtime.h"
#include "dfl_sampler.h"
#include "dfl_target.h"
#include "dfl_token_source.h"

/* The context span grows in steps so that graphs of consecutive proposes share shapes. */
#define DFL_DRAFT_KV_PAD 256

/* The inputs and results of a propose graph. */
typedef struct draft_inputs {
    struct ggml_cgraph * gf;
    /* the entries */
    struct ggml_tensor * entry_rows;   /* [E] I32: rows of the target's feature tensor */
    struct ggml_tensor * entry_pos;    /* [E] I32 */
    struct ggml_tensor * entry_cells;  /* [E] I64: cache rows (a spare one for padding) */
    struct ggml_tensor * entry_tokens; /* [E] I32 (reads_tokens) */
    /* feat_previous: the features each sequence carries from its last entry */
    struct ggml_tensor * carry_rows;   /* [P] I32: each part's slot, to gather from ... */
    struct ggml_tensor * carry_slots;  /* [P] I64: ... and to scatter to */
    struct ggml_tensor * first_entry;  /* [P] I64: each part's first entry column */
    struct ggml_tensor * last_row;     /* [P] I32: the feature row of each part's last entry */
    struct ggml_tensor * has_entries;  /* [1, P] F32: 1 when the part has any, else 0 ... */
    struct ggml_tensor * no_entries;   /* ... and 1 - that */
    struct ggml_tensor * block_parts;  /* [rows] I32: the parts that draft, when some do not */
    /* the block */
    struct ggml_tensor * tokens;       /* [rows] I32: the first pass's tokens */
    struct ggml_tensor * pos;          /* [n_pass * rows] I32 */
    struct ggml_tensor * cells;        /* [n_pass * rows] I64 */
    struct ggml_tensor * mask[DFL_MAX_SEQ][DFL_DRAFTER_MAX_MASKS]; /* per part: [n_kv, its block rows or passes] */
    struct ggml_tensor * drafted;      /* [D] I32: the drafted rows, when not a view */
    /* results */
    struct ggml_tensor * logits;       /* [n_vocab, D] */
    struct ggml_tensor * argmax;       /* [D] */
    struct ggml_tensor * probs;        /* with top_k >= 1: the softmax, and the argmax's log-probability */
    struct ggml_tensor * argmax_lp;
    struct ggml_tensor * confidence;   /* [D] the architecture's acceptance estimates, when it has them */
    dfl_sampler_graph sampled;         /* drafts drawn by the sequences' sampling */
} draft_inputs;

/* The top_k candidates of the last propose (top_k > 1), in a graph of their own (slot 1)
 * over the propose graph's logits and softmax, run when they are first read: a chain
 * step reads only the top choices (or nothing), and the top-K over the vocabulary is a
 * few percent of its propose. */
typedef struct rank_graph {
    bool valid; /* built over the current propose graph's logits */
    bool fresh; /* run since the last propose */
    struct ggml_cgraph * gf;
    struct ggml_tensor * topk;    /* [top_k, rows] token ids, unordered */
    struct ggml_tensor * topk_lp; /* [1, top_k, rows] their log-probabilities */
} rank_graph;

struct dfl_draft {
    dfl_drafter m;           /* the architecture's description and weights */
    const dfl_target * target; /* read only: the drafter writes nothing of its target's */
    dfl_draft_params p;
    dfl_runtime rt;
    int n_seq, n_ctx;        /* the target's */

    dfl_memory mem;          /* its caches (and carried features) per slot: position p of slot s
                                at dfl_memory_cell; the last row of each slot's takes padding */
    /* [block_size] each sequence's last block, bonus first, and its tokens (0: none since
     * its context changed), left for the target's verify */
    struct ggml_context * ctx_blocks;
    ggml_backend_buffer_t buf_blocks;
    dfl_token_source blocks;

    dfl_sampler sampler[DFL_MAX_SEQ]; /* how each sequence's drafts are chosen: the argmax, or drawn */
    /* the graph of the last propose, reused while the shape of the step holds */
    bool graph_valid;
    dfl_draft_step graph_key;
    draft_inputs graph;
    rank_graph rank;
    int n_out;               /* drafted rows of the last propose */
    int n_step_nodes;        /* the last propose's nodes, and its rank graph's once that ran */
    int64_t n_graphs, n_graph_builds;

    int32_t * host_i32;
    int64_t * host_i64;
    ggml_fp16_t * host_mask;
    size_t host_rows, host_mask_size;
};

/* dfl_draft.c: loading in steps, for the memory planner */
dfl_status dfl_draft_open(const char * path, dfl_target * target, const dfl_draft_params * params, dfl_draft ** out);
/* Its memory and blocks as tensors (dfl_draft_load gives them memory; the planner places them). */
dfl_status dfl_draft_define_state(dfl_draft * d);
/* Tokens a cut head keeps (the params' count, else the size of the file's kept set; 0:
 * the whole head, or a kind that takes no cut), before the load makes the cut. */
dfl_status dfl_draft_kept_count(const dfl_draft * d, int * n);
/* The worst propose its graphs take: every sequence drafting a whole block over the whole
 * context, or a prefill chunk's entries alone. */
dfl_draft_step dfl_draft_worst_step(const dfl_draft * d, bool entries_only);
/* Its worst graphs, each handed to visit with its slot: slot 0 a prefill chunk's entries,
 * then the worst propose; slot 1 (top_k > 1) the rank graph over that propose's logits,
 * placed on rank_inputs when given (the planner's placeholder), else read where the
 * propose graph was just allocated (a load reserves it before). */
dfl_status dfl_draft_worst_graphs(dfl_draft * d, dfl_graph_visit visit, void * user, ggml_backend_buffer_t rank_inputs);

/* dfl_draft_graph.c: the propose graph of a step, and the rank graph over its results */
void dfl_draft_build_graph(const dfl_draft * d, const dfl_draft_step * step, struct ggml_context * ctx,
                           draft_inputs * in);
void dfl_draft_build_rank(const dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * logits,
                          struct ggml_tensor * probs, rank_graph * r);
/* Block rows of a pass of the step (one pass: every part's block rows; autoregressive:
 * one per part that drafts), and its passes. */
int dfl_draft_step_rows(const dfl_drafter * m, const dfl_draft_step * step);
/* Graph rows of a part's block of n_block tokens (bonus and drafts): one pass's rows, or an
 * autoregressive pass's one; and the block row of its first draft. */
int dfl_draft_block_rows(const dfl_drafter * m, int n_block);
int dfl_draft_first_drafted(const dfl_drafter * m);
int dfl_draft_step_passes(const dfl_drafter * m, const dfl_draft_step * step);
int dfl_draft_step_entries(const dfl_draft_step * step);
int dfl_draft_step_drafted(const dfl_draft_step * step);

/* A sequence slot's index, checked: every entry point that takes one calls this first. */
static inline dfl_status dfl_draft_check_seq(const dfl_draft * d, int32_t seq) {
    if (!d) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    if (seq < 0 || seq >= d->n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d is outside 0..%d (the target has %d sequence slots)", seq,
                        d->n_seq - 1, d->n_seq);
    }
    return DFL_OK;
}


/* dfl_draft_propose.c: staging buffers for a step's inputs, grown to fit it */
dfl_status dfl_draft_reserve_staging(dfl_draft * d, const dfl_draft_step * step);

#endif
