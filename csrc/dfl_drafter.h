/* The drafter interface: what a drafter architecture tells the generic drafter runtime
 * (dfl_draft.c), and the graph services the runtime offers its builder. Drafters are
 * architectures as targets are (dfl_model.h): one file per architecture in
 * csrc/models/ (dflash.c, dspark.c, mtp.c, eagle3.c) holds its loader and its propose graph, and one line in
 * csrc/models/drafters.def registers it as a kind (its --spec-type name, the GGUF architectures
 * it reads, one pass or autoregressive: dflash.h's dfl_drafter_kind).
 *
 * Every drafter drafts the same way, seen from the runtime: a propose (dfl_draft_step)
 * takes, per sequence, the context entries the target committed since the drafter's
 * last graph (each a position: its token and the target's features there, read from the
 * target's feature rows on the memory layer) and a block to draft after them (the
 * bonus token, the last the target chose, then n_block - 1 drafts); its graph stores the
 * entries in the drafter's own caches (its memory, per slot) and gives the drafts' logits.
 * The runtime owns the rest: the memory, descriptors, graph reuse, the inputs (token
 * ids, positions, cache cells, masks, feature rows), the choice of each draft (argmax, or
 * drawn by the sequence's sampling), the top-K ranking, and the token source the
 * target's chain verify reads. Nothing in the runtime depends on the architecture.
 *
 * Two kinds of pass:
 *   one pass (DFlash, DFlash2, DSpark): the block's rows [bonus, filler x (n_block - 1)]
 *     attend to the context and to each other in one pass; rows 1.. are the drafts (an
 *     anchor-first drafter: rows [bonus, filler x (n_block - 2)], every row a draft).
 *   autoregressive (MTP, EAGLE3): n_block - 1 passes of one row per sequence, pass j at
 *     the bonus's position + j, its token the pick of pass j - 1 (the bonus for pass 0);
 *     the architecture picks each pass's token itself (it feeds the next pass), all
 *     passes in one graph.
 * What a drafter reads of the target: the features of feature layers (llama.cpp's
 * convention: L is the input of layer L, n_layer the final-normed state), either at
 * each entry's own position (DFlash) or at the position before it (`feat_previous`:
 * MTP's and EAGLE3's "hidden state that predicted this token"), the runtime keeping each
 * slot's last ones in the drafter's memory for the next call. */
#ifndef DFL_DRAFTER_H
#define DFL_DRAFTER_H

#include "dfl_gguf.h"
#include "dfl_model.h"
#include "dfl_target.h"
#include "dfl_sampler.h"
#include "dflash.h"

#define DFL_DRAFTER_MAX_LAYERS 64
/* Attention visibility rules a drafter's layers use (the runtime fills a mask per rule). */
#define DFL_DRAFTER_MAX_MASKS 2

typedef struct dfl_drafter dfl_drafter;
typedef struct dfl_draft_graph dfl_draft_graph;
typedef struct dfl_draft_step dfl_draft_step;

/* How a cached layer's block rows see the cache: causally (row at position q sees
 * positions <= q) or the whole block; and within `window` positions (0: no limit). */
typedef struct dfl_draft_mask_rule {
    bool causal;
    int window;
} dfl_draft_mask_rule;

typedef struct dfl_drafter_arch {
    /* Hyperparameters and weights from m->file, checked against the target (the file is
     * open, m->arch and the target's sizes set): fills the description below. */
    dfl_status (*load)(dfl_drafter * m, const dfl_target * t, const dfl_draft_params * p);
    /* The propose graph's drafts: the entries' keys and values stored
     * (dfl_draft_graph_store_context), the block drafted; returns the logits of the
     * drafted rows [n_vocab, D], sequence after sequence, n_block - 1 rows each. An
     * architecture that chooses its drafts itself (autoregressive passes, DFlash2's
     * selector) puts them in the blocks (dfl_draft_graph_put) and sets *own_drafts. */
    struct ggml_tensor * (*build)(const dfl_drafter * m, dfl_draft_graph * g, bool * own_drafts);
    void (*free)(dfl_drafter * m);
    /* Optional: what its file says of it beyond the keys every drafter file has, read
     * before anything is loaded (DSpark's anchor-first layout adds a row to its block). */
    void (*read_meta)(const dfl_gguf * file, dfl_draft_meta * meta);
} dfl_drafter_arch;

/* ---- the registry (csrc/models/drafters.def; dfl_drafters.c) ------------------------------- */

/* drafters.def's flags */
enum { DFL_DRAFTER_AUTOREGRESSIVE = 1, DFL_DRAFTER_IN_TARGET = 2 };

/* The kind that reads this file, by its architecture and its marker tensor (see
 * drafters.def); -1: none. */
int dfl_drafter_find(const dfl_gguf * file);
const dfl_drafter_arch * dfl_drafter_arch_at(int kind);
/* Every kind's architectures, "dflash (dflash), qwen35 (mtp), ..." */
const char * dfl_drafter_archs(void);
/* The architectures a drafter file (-md) may have, "'dflash' or 'eagle3'" */
const char * dfl_drafter_file_archs(void);

struct dfl_drafter {
    const dfl_drafter_kind * registry; /* its line of drafters.def */
    const dfl_drafter_arch * arch;
    dfl_gguf file;                 /* its GGUF (MTP: the target's own file, opened again for its layers) */
    int n_vocab, n_embd;           /* the target's */
    /* what it reads of the target */
    int n_feat;                    /* feature layers, and which (llama.cpp's convention) */
    int32_t target_layers[16];
    bool feat_previous;            /* an entry pairs its token with the features of the position before it */
    bool reads_tokens;             /* entries need their tokens: the caller gives them */
    /* how it drafts */
    int block_size;                /* the largest block: bonus + drafts */
    bool autoregressive;           /* passes of one row (else one pass over the block): the kind's */
    int32_t filler;                /* one pass: the token of the block's rows after the bonus */
    bool anchor_first;             /* one pass: the bonus's own row drafts the next token, so a block of
                                      n_block - 1 drafts has n_block - 1 rows [bonus, filler...], each
                                      drafted (DSpark's anchor-first layout); else rows 1.. draft */
    bool greedy_only;              /* its drafts are its argmax (or its own choice): no drawn drafts */
    /* where its rows sit: a row at position q rotates at q + pos_offset (EAGLE3: -1, the
     * token at q paired with the features of q - 1 sits at q - 1, as llama.cpp places it),
     * and positions before first_pos are never attended (EAGLE3: 1, position 0 has no
     * features before it) */
    int pos_offset;
    int first_pos;
    bool has_confidence;           /* its builder gives each drafted row's confidence (g->confidence) */
    /* its cached layers, whose K/V the memory layer keeps per slot */
    int n_layer;
    dfl_layer_kind kind[DFL_DRAFTER_MAX_LAYERS];
    dfl_attention_geometry attn[DFL_DRAFTER_MAX_LAYERS];
    int n_masks;
    dfl_draft_mask_rule masks[DFL_DRAFTER_MAX_MASKS];
    int layer_mask[DFL_DRAFTER_MAX_LAYERS]; /* the rule each layer's block rows attend by */
    int nodes_per_pass;            /* graph nodes each drafted row of a sequence adds (an autoregressive
                                      pass beyond the first, a DSpark Markov step) */
    void * weights;                /* the architecture's own (freed by arch->free) */
    /* its LM head, where a kept set may cut it (a DFlash drafter's: the target's or its
     * own), and the file it is read from; NULL: this kind takes no cut */
    struct ggml_tensor * head;
    const dfl_gguf * head_file;
    /* the cut (dfl_draft_params.head_tokens, or the file's <arch>.head_tokens), made once
     * the weights are loaded: the head's rows of the kept tokens and their ids [n_head]
     * I32, which the builder's logits go through (dfl_draft_scatter_vocab); n_head 0: the
     * whole head */
    int n_head;
    struct ggml_tensor * head_rows, * head_ids;
    struct ggml_context * ctx_head_rows, * ctx_head_ids;
    ggml_backend_buffer_t buf_head_rows, buf_head_ids;
};

/* ---- graph services ------------------------------------------------------------------ */

struct dfl_draft_graph {
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    const dfl_draft_step * step;
    /* the context entries, every sequence's (padded: padding entries write to a spare
     * cell nothing reads) */
    int n_entries;
    struct ggml_tensor * entry_features; /* [n_feat * n_embd, n_entries]: the target's features at each
                                            entry (feat_previous: at the position before it) */
    struct ggml_tensor * entry_tokens;   /* [n_entries] I32, when reads_tokens */
    struct ggml_tensor * entry_pos;      /* [n_entries] I32 */
    /* the block: n_pass passes of n_rows rows (one pass: every sequence's block rows in
     * order; autoregressive: one row per sequence) */
    int n_pass, n_rows;
    struct ggml_tensor * tokens;         /* [n_rows] I32: the first pass's tokens */
    struct ggml_tensor * last_features;  /* feat_previous: [n_feat * n_embd, n_rows] the features of the
                                            position before each sequence's bonus */
    bool top_k_by_sort;                  /* how dfl_top_k ranks on this device (dfl_runtime.h) */
    struct ggml_tensor * confidence;     /* the builder's, optional: [D] F32, each drafted row's chance of
                                            acceptance as the drafter predicts it (DSpark's head) */
    void * runtime;                      /* the runtime's own state for this graph */
};

/* Positions [n_rows] of pass j's rows. */
struct ggml_tensor * dfl_draft_graph_pos(dfl_draft_graph * g, int pass);
/* Store the entries' keys k [head_dim, n_head_kv, n_entries] and values
 * v [head_dim * n_head_kv, n_entries] of cached layer il at their cells. */
void dfl_draft_graph_store_context(dfl_draft_graph * g, int il, struct ggml_tensor * k, struct ggml_tensor * v);
/* Attention of pass j's rows q [head_dim, n_head, n_rows] over their sequences' caches
 * (the context, and the block rows of this graph up to this pass) by the layer's mask
 * rule: their own k and v stored at their cells first. -> [head_dim * n_head, n_rows] */
struct ggml_tensor * dfl_draft_graph_attention(dfl_draft_graph * g, int pass, int il, struct ggml_tensor * q,
                                               struct ggml_tensor * k, struct ggml_tensor * v, float scale);
/* The drafted rows of x: one pass, x [ne0, n_rows] the block rows: rows 1.. of each
 * block; autoregressive, x [ne0, n_pass * n_rows] the passes' rows in pass order: each
 * sequence's first n_block - 1 passes. Sequence after sequence. -> [ne0, D] */
struct ggml_tensor * dfl_draft_graph_drafted(dfl_draft_graph * g, struct ggml_tensor * x);
/* Logits over a kept set out [n_kept, n] scattered to the vocabulary by ids [n_kept]
 * (I32 or I64 token ids): [n_vocab, n], -inf at the tokens not kept. */
struct ggml_tensor * dfl_draft_scatter_vocab(struct ggml_context * ctx, struct ggml_tensor * out,
                                             struct ggml_tensor * ids, int64_t n_vocab);
/* Rows [row0, row0 + n) of x [ne0, rows] (x itself when they are all of it). */
struct ggml_tensor * dfl_draft_rows(struct ggml_context * ctx, struct ggml_tensor * x, int64_t row0, int64_t n);
/* Sequence `part`'s drafts first..first + n - 1 (0: the first draft) are tokens [n] I32:
 * they go to its block (after the bonus), for the target's verify and the host. */
void dfl_draft_graph_put(dfl_draft_graph * g, int part, int first, struct ggml_tensor * tokens);
/* Sequence `part`'s first row among a pass's n_rows rows (autoregressive: its one row;
 * one pass: its bonus's row). */
int dfl_draft_graph_part_row(const dfl_draft_graph * g, int part);
/* Autoregressive pass j's picks: the argmax of its logits `out` [V, rows], each part's
 * draft j while its block has one (dfl_draft_graph_put), and `out` appended to *logits
 * (the passes' rows, pass after pass); returns the picks, the next pass's tokens. */
struct ggml_tensor * dfl_draft_graph_pass_drafts(dfl_draft_graph * g, int pass, struct ggml_tensor * out,
                                                 struct ggml_tensor ** logits);

/* ---- the propose descriptor ------------------------------------------------------------ */

/* One sequence's part of a propose: the entries appended first (n_entries real, padded
 * to entry_rows), then its block; its attention span. */
typedef struct dfl_draft_part {
    int seq;
    int entry_rows;  /* graph rows of its entries */
    int n_block;     /* tokens of its block: the bonus and n_block - 1 drafts (0: entries only) */
    int n_kv;        /* cache rows its block attends to */
} dfl_draft_part;

/* A propose: the parts of distinct sequences, one graph; what its shape depends on. */
struct dfl_draft_step {
    int n_parts;
    dfl_draft_part part[DFL_MAX_SEQ];
    dfl_sampler_key samp;  /* how its drafted rows choose (the runtime's choice stage) */
};

/* ---- loader helpers ---------------------------------------------------------------------- */

/* A u32 key ("." prefix: the file's architecture) in 0..2^30. */
/* An autoregressive drafter's one cached layer: causal full attention of the given head
 * size and KV heads, its passes' K/V kept in the drafter's ring (MTP's, EAGLE3's). */
void dfl_drafter_one_causal_layer(dfl_drafter * m, int head_dim, int n_head_kv);
/* An architecture's free_weights when its weights are one allocation. */
void dfl_drafter_free_weights(dfl_drafter * m);
dfl_status dfl_drafter_key(const dfl_drafter * m, const char * key, bool required, uint32_t def, int * out);
/* Tensor "blk.<il>.<name>" (il < 0: "<name>") of shape [ne0, ne1] (ne1 0: a vector). */
dfl_status dfl_drafter_tensor(const dfl_drafter * m, const char * name, int il, int64_t ne0, int64_t ne1,
                              bool required, struct ggml_tensor ** out);

#endif
