/* The target's memory, in sequence slots (dfl_memory.c): attention caches (a sliding
 * layer's a ring), recurrent and conv states, and what a verify keeps for its commit (the
 * replay rows and conv inputs), each per slot; the features of the last step; and each
 * slot's bookkeeping (its length, the verify waiting for a commit, the commit waiting
 * for a graph). Like llama.cpp's KV cache with one stream per sequence and its recurrent
 * memory with one state cell per sequence, joined as its hybrid memory joins them.
 *
 * Cells: position p of slot s is row s * R + p % R of an attention cache of R rows per
 * slot (R = n_ctx, or a sliding layer's ring). Fixed-size states hold one slice per slot
 * along their last dimension. */
#ifndef DFL_MEMORY_H
#define DFL_MEMORY_H

#include "dfl_model.h"
#include "dfl_runtime.h"
#include "dfl_tree.h"

#define DFL_MAX_VERIFY 256

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

replay_planes dfl_replay_planes(const dfl_model * m, int n_verify);
/* Floats of one slot's replay memory. */
int64_t dfl_replay_floats(const dfl_model * m, int n_verify);

/* One slot's bookkeeping. */
typedef struct dfl_seq {
    int n_past;          /* positions the slot holds */
    int pending_verify;  /* rows of a verify waiting for its commit (0: none) */
    bool pending_tree;
    tree_plan tree;      /* the last tree verify's plan */
    pending_commit commit;
    int last_chain;      /* rows of the last chain verify committed (0: none since the reset) */
    int chain_steady;    /* chain commits in a row of that length (a fresh slot counts as steady) */
} dfl_seq;

typedef struct dfl_memory {
    int n_seq;     /* slots */
    int n_ctx;     /* positions per slot */
    int n_verify;  /* rows of a verify */
    int swa_window; /* the window of the model's sliding layers (0: none) */
    int swa_ring;   /* rows per slot of their caches: the window and the largest call, at most n_ctx */
    int step_rows;  /* rows of a step (the features it keeps) */
    struct ggml_context * ctx[2]; /* [0] on the device, [1] on the CPU (layers not offloaded) */
    ggml_backend_buffer_t buf[2];
    /* attention layers: [kv_dim, R * n_seq] */
    struct ggml_tensor * k[DFL_MAX_LAYERS], * v[DFL_MAX_LAYERS];
    /* recurrent layers */
    struct ggml_tensor * conv[DFL_MAX_LAYERS];         /* [d_conv-1, channels, n_seq]: last inputs, oldest first */
    struct ggml_tensor * ssm[DFL_MAX_LAYERS];          /* [S_v * S_v * H_v, n_seq] */
    struct ggml_tensor * replay[DFL_MAX_LAYERS];       /* [replay floats, n_seq]: what the last verify kept of each
                                                          row to rerun the accepted path at commit (planes of conv
                                                          output, q and k, g, beta: dfl_target_graph.c) */
    struct ggml_tensor * conv_scratch[DFL_MAX_LAYERS]; /* [channels, d_conv-1 + n_verify, n_seq]: conv inputs of the
                                                          last verify, committed ones first */
    struct ggml_tensor * features;                     /* [n_feat * n_embd, step_rows] of the last step */
    dfl_seq seq[DFL_MAX_SEQ];
} dfl_memory;

/* What the memory is made of: n_seq slots of n_ctx positions, verifies of n_verify rows,
 * calls of up to n_ubatch rows on one slot; each layer's state on the device or the CPU
 * (on_device[il]), the features with the output. Tensors only: dfl_memory_alloc gives
 * them memory (the planner puts them on placeholder buffers instead). */
typedef struct dfl_memory_params {
    int n_seq, n_ctx, n_ubatch, n_verify;
    enum ggml_type type_k, type_v;
    int n_features; /* feature layers captured per row (0: none) */
    const bool * on_device;
    bool features_on_device;
} dfl_memory_params;

dfl_status dfl_memory_define(dfl_memory * mem, const dfl_model * m, const dfl_memory_params * p);
dfl_status dfl_memory_alloc(dfl_memory * mem, const ggml_backend_dev_t devs[2]);
void dfl_memory_free(dfl_memory * mem);

/* Every slot empty (the state zeroed: a recurrence starts from zero). */
void dfl_memory_clear(dfl_memory * mem);
/* Slot seq empty. */
void dfl_memory_seq_clear(dfl_memory * mem, const dfl_model * m, int seq);
/* Slot seq's state was written (a checkpoint restored into it): it holds n_past
 * positions, with no verify or commit pending. */
void dfl_memory_seq_restored(dfl_memory * mem, int seq, int n_past);
/* Slot dst holds what slot src holds (its positions, states and length), src unchanged;
 * src must have no verify or commit pending. */
dfl_status dfl_memory_seq_copy(dfl_memory * mem, const dfl_model * m, int src, int dst);

/* Rows per slot of layer il's cache (n_ctx, or the ring of a sliding layer). */
int dfl_memory_kv_rows(const dfl_memory * mem, const dfl_model * m, int il);
/* The cache row of position pos of slot seq in layer il's cache. */
int64_t dfl_memory_cell(const dfl_memory * mem, const dfl_model * m, int il, int seq, int pos);

/* Slot seq's slice of a per-slot state tensor (conv, ssm, replay, conv_scratch): a 2-D
 * view of its first dimension's rows (a fixed-size state's one row), and the byte
 * offset and size of a slice. */
struct ggml_tensor * dfl_memory_slice(struct ggml_context * ctx, const dfl_memory * mem, struct ggml_tensor * state,
                                      int seq);
size_t dfl_memory_slice_offset(const dfl_memory * mem, const struct ggml_tensor * state, int seq);
size_t dfl_memory_slot_bytes(const dfl_memory * mem, const struct ggml_tensor * state);

/* One piece of a slot's state, as checkpoints copy it: a per-position cache (rows of
 * `tensor`: position p at row base + p % ring, those from `need` on still read), or a
 * fixed-size slice (ring 0: `bytes` at byte `offset`). */
typedef struct dfl_memory_part {
    struct ggml_tensor * tensor;
    int64_t base;
    int ring;
    int need;
    size_t offset, bytes;
} dfl_memory_part;

/* Slot seq's parts at length n_past, in a fixed order (parts may be NULL to count them). */
int dfl_memory_seq_parts(const dfl_memory * mem, const dfl_model * m, int seq, int n_past, dfl_memory_part * parts);

/* Rows [first, end) of positions between a per-position part and rows [0, end - first)
 * of `copy` (a tensor of the same row size, in the same order), in at most two runs;
 * to_part: copy -> part, else part -> copy. Through the backend: no data pointers. */
dfl_status dfl_memory_copy_rows(const dfl_memory_part * part, struct ggml_tensor * copy, int64_t copy_row0, int first,
                                int end, bool to_part);
/* A fixed-size part to or from `copy` (of at least part->bytes). */
dfl_status dfl_memory_copy_slice(const dfl_memory_part * part, struct ggml_tensor * copy, bool to_part);

#endif
