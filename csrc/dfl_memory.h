/* The memory layer (dfl_memory.c): a model's state in sequence slots. The target has
 * one (attention caches, a sliding layer's a ring; recurrent and conv states; what a
 * verify keeps for its commit; the features it exposes to a drafter), each drafter has
 * its own (its cached layers' K/V, a state it carries per slot). Like llama.cpp's KV
 * cache with one stream per sequence and its recurrent memory with one state cell per
 * sequence, joined as its hybrid memory joins them.
 *
 * Cells: position p of slot s is row s * (R + spare) + p % R of an attention cache of R
 * rows per slot (R = n_ctx, or a windowed layer's ring), followed by `spare` rows per
 * slot that no committed position takes (a drafter's padding rows write there; the
 * target's tree rows that reach past a ring's end before their positions do, see
 * dfl_target_graph.c: ring_slot). Fixed-size states hold
 * one slice per slot along their last dimension.
 *
 * A slot's record holds what the memory holds for it: its length, and (in a memory with
 * feature rows) which committed positions' features its feature rows hold. What a
 * decoding protocol keeps between its calls (a verify waiting for its commit, ...)
 * belongs to that protocol's layer, not here. */
#ifndef DFL_MEMORY_H
#define DFL_MEMORY_H

#include "dfl_model.h"
#include "dfl_runtime.h"

#define DFL_MAX_VERIFY 256

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

replay_planes dfl_replay_planes(const dfl_recurrent_geometry * r, int n_verify);
/* Floats of one slot's replay memory. */
int64_t dfl_replay_floats(const dfl_recurrent_geometry * r, int n_verify);

/* The layers a memory keeps state for: a model's, or a drafter's cached layers. The
 * arrays are the owner's and outlive the memory. */
typedef struct dfl_memory_layout {
    int n_layer;
    const dfl_layer_kind * kind;
    const dfl_attention_geometry * attn;
    const dfl_recurrent_geometry * rec; /* when a layer is recurrent */
} dfl_memory_layout;

/* What a slot's feature rows hold: from position p0 on, `base` committed positions in
 * rows 0 .. base - 1 (earlier calls' rows the drafter had yet to take), then the rows
 * the slot's last call wrote (features of its rows, in row order) from row `base`;
 * `kept` of those are committed positions p0 + base, p0 + base + 1, ...: row
 * base + path[k] holds position p0 + base + k (row base + k when !tree). A decode keeps
 * all its rows; a verify none until its commit says which. How far a drafter has taken
 * them is the drafter's own record (its memory's n_past), which the calls below are given. */
typedef struct dfl_features_held {
    int64_t row0; /* the region's first row in the feature tensor: the slot's own, or the chunk rows */
    int base, rows, p0, kept;
    bool tree;
    int32_t path[DFL_MAX_VERIFY];
} dfl_features_held;

/* One slot's record. */
typedef struct dfl_seq {
    int n_past;             /* positions the slot holds */
    dfl_features_held feat; /* memories with feature rows */
} dfl_seq;

typedef struct dfl_memory {
    dfl_memory_layout layout;
    int n_seq;      /* slots */
    int n_ctx;      /* positions per slot */
    int n_verify;   /* rows of a verify (the recurrent layers' replay memory) */
    int swa_window; /* the window of the windowed layers (0: none) */
    int swa_ring;   /* rows per slot of their caches: the window and what a call adds, at most n_ctx */
    int spare;      /* rows per slot after a cache's ring that no committed position takes */
    int feature_rows; /* feature rows per slot: a verify and as many lacking rows */
    int chunk_rows;   /* rows after every slot's for a call larger than a slot's (a prefill chunk) of any
                         slot, the last one's (0: none; one slot holds its chunks in its own rows) */
    struct ggml_context * ctx[2]; /* [0] on the device, [1] on the CPU (layers not offloaded) */
    ggml_backend_buffer_t buf[2];
    /* attention layers: [kv_dim, (R + spare) * n_seq] */
    struct ggml_tensor * k[DFL_MAX_LAYERS], * v[DFL_MAX_LAYERS];
    /* recurrent layers */
    struct ggml_tensor * conv[DFL_MAX_LAYERS];         /* [d_conv-1, channels, n_seq]: last inputs, oldest first */
    struct ggml_tensor * ssm[DFL_MAX_LAYERS];          /* [S_v * S_v * H_v, n_seq] */
    struct ggml_tensor * replay[DFL_MAX_LAYERS];       /* [replay floats, n_seq]: what the last verify kept of each
                                                          row to rerun the accepted path at commit (planes of conv
                                                          output, q and k, g, beta: dfl_target_graph.c) */
    struct ggml_tensor * conv_scratch[DFL_MAX_LAYERS]; /* [channels, d_conv-1 + n_verify, n_seq]: conv inputs of the
                                                          last verify, committed ones first */
    struct ggml_tensor * features;                     /* [feature floats, feature_rows * n_seq + chunk_rows]:
                                                          slot s's in rows s * feature_rows .., then the chunk
                                                          rows; NULL: none */
    struct ggml_tensor * state;                        /* [state floats, n_seq]: a fixed-size state per slot (a
                                                          drafter's carried features); NULL: none */
    dfl_seq seq[DFL_MAX_SEQ];
} dfl_memory;

/* What the memory is made of: n_seq slots of n_ctx positions, verifies of n_verify rows,
 * calls of up to n_ubatch rows on one slot; each layer's state on the device or the CPU
 * (on_device[il]), the features with the output. Tensors only: dfl_memory_alloc gives
 * them memory (the planner puts them on placeholder buffers instead). */
typedef struct dfl_memory_params {
    int n_seq, n_ctx, n_ubatch, n_verify;
    enum ggml_type type_k, type_v;
    const bool * on_device;
    int window_rows;      /* rows a windowed layer's ring keeps besides its window (the rows one call adds) */
    int spare;            /* rows per slot after each cache's ring */
    int feature_floats;   /* floats per feature row (0: no feature rows) */
    bool features_on_device;
    int state_floats;     /* floats of the per-slot state (0: none) */
} dfl_memory_params;

dfl_status dfl_memory_define(dfl_memory * mem, const dfl_memory_layout * layout, const dfl_memory_params * p);
dfl_status dfl_memory_alloc(dfl_memory * mem, const ggml_backend_dev_t devs[2]);
void dfl_memory_free(dfl_memory * mem);

/* Every slot empty (the state zeroed: a recurrence starts from zero). */
void dfl_memory_clear(dfl_memory * mem);
/* Slot seq empty. */
void dfl_memory_seq_clear(dfl_memory * mem, int seq);
/* Slot seq's state was written (a checkpoint restored into it): it holds n_past
 * positions, and its feature rows no committed position's features. */
void dfl_memory_seq_restored(dfl_memory * mem, int seq, int n_past);
/* Slot dst holds what slot src holds (its positions, states and length), src unchanged. */
dfl_status dfl_memory_seq_copy(dfl_memory * mem, int src, int dst);

/* Rows per slot of layer il's cache (n_ctx, or the ring of a windowed layer), and the
 * first row of slot seq's. */
int dfl_memory_kv_rows(const dfl_memory * mem, int il);
int64_t dfl_memory_kv_base(const dfl_memory * mem, int il, int seq);
/* The cache row of position pos of slot seq in layer il's cache, and slot seq's first spare row. */
int64_t dfl_memory_cell(const dfl_memory * mem, int il, int seq, int pos);
int64_t dfl_memory_spare_cell(const dfl_memory * mem, int il, int seq);

/* Slot seq's slice of a per-slot state tensor (conv, ssm, replay, conv_scratch, state):
 * a 2-D view of its first dimension's rows (a fixed-size state's one row), and the
 * byte offset and size of a slice. */
struct ggml_tensor * dfl_memory_slice(struct ggml_context * ctx, const dfl_memory * mem, struct ggml_tensor * state,
                                      int seq);
size_t dfl_memory_slice_offset(const dfl_memory * mem, const struct ggml_tensor * state, int seq);
size_t dfl_memory_slot_bytes(const dfl_memory * mem, const struct ggml_tensor * state);

/* ---- feature rows ------------------------------------------------------------------ */

/* The first feature row (in the whole feature tensor) of the region a call of slot seq
 * with `rows` rows writes: the slot's own rows, or the chunk rows for a call larger than
 * them (a prefill chunk), where the slot that wrote last holds them. */
int64_t dfl_memory_features_region(const dfl_memory * mem, int seq, int rows);
/* Where in that region a call of `rows` rows from position p0 writes them: after the
 * positions the slot's rows hold when the drafter, having taken those before `taken`,
 * lacks some of them, they are in the same region, the rows run on to p0 in order and
 * all fit (so that a drafter may stay behind by several calls, as it does over `auto`'s
 * plain decoding); else row 0 (what they held is let go). `taken` 0 when no drafter
 * says: whatever fits is kept. */
int dfl_memory_features_at(const dfl_memory * mem, int seq, int p0, int rows, int taken);
/* Rows slot seq's next call may have without letting go of positions a drafter that
 * has taken those before `taken` lacks (every row when it lacks none). */
int dfl_memory_features_room(const dfl_memory * mem, int seq, int taken);
/* Slot seq's last call wrote `rows` feature rows from position p0 on at row `at`
 * (dfl_memory_features_at), `kept` of them committed positions in row order (a decode:
 * all; a verify: none yet). */
void dfl_memory_features_written(dfl_memory * mem, int seq, int p0, int rows, int kept, int at);
/* The commit of slot seq's verify keeps rows path[0..n) (NULL: rows 0..n-1) as positions p0.. */
void dfl_memory_features_kept(dfl_memory * mem, int seq, const int32_t * path, int n);
/* The feature row (in the whole feature tensor) of committed position pos of slot seq,
 * or -1 when the slot's rows do not hold it. */
int64_t dfl_memory_feature_of(const dfl_memory * mem, int seq, int pos);

/* ---- checkpoints --------------------------------------------------------------------- */

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
int dfl_memory_seq_parts(const dfl_memory * mem, int seq, int n_past, dfl_memory_part * parts);

/* Rows [first, end) of positions between a per-position part and rows [0, end - first)
 * of `copy` (a tensor of the same row size, in the same order), in at most two runs;
 * to_part: copy -> part, else part -> copy. Through the backend: no data pointers. */
dfl_status dfl_memory_copy_rows(const dfl_memory_part * part, struct ggml_tensor * copy, int64_t copy_row0, int first,
                                int end, bool to_part);
/* A fixed-size part to or from `copy` (of at least part->bytes). */
dfl_status dfl_memory_copy_slice(const dfl_memory_part * part, struct ggml_tensor * copy, bool to_part);

#endif
