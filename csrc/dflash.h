/*
 * dflash.h - plain C interface of the dflash-gguf runtime.
 *
 * Every function that can fail returns a dfl_status; on failure a readable message is
 * available from dfl_last_error() on the calling thread. No entry point aborts on bad
 * input. Objects are opaque; create/free pairs own them.
 *
 * This header is also parsed by cffi (dflash_gguf/runtime/native.py): keep it to plain
 * declarations, one per line group, with no macros in declarations.
 */
#ifndef DFLASH_H
#define DFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dfl_status {
    DFL_OK = 0,
    DFL_ERR_ARGUMENT = 1,  /* invalid argument or setting */
    DFL_ERR_IO = 2,        /* file missing or unreadable */
    DFL_ERR_FORMAT = 3,    /* corrupt, truncated or unsupported GGUF / wrong architecture */
    DFL_ERR_BACKEND = 4,   /* no usable device, allocation or compute failure */
    DFL_ERR_CAPACITY = 5,  /* context or batch size exceeded */
    DFL_ERR_STATE = 6      /* call not valid in the current state */
} dfl_status;

/* Message describing the last failure on this thread (never NULL). */
const char * dfl_last_error(void);

/* Route ggml's own messages to stderr: information, warnings and errors, and its debug
 * lines only under DFLASH_GGML_DEBUG=1 (the Python binding calls it at import). */
void dfl_ggml_log(void);

/* ---- quantization (used by the converter) ------------------------------------ */

/* Quantize nrows x n_per_row float32 values into ggml type `type` (dst must hold
 * nrows * row size bytes). Uses ggml's reference quantizers. */
dfl_status dfl_quantize(int type, const float * src, void * dst, int64_t nrows, int64_t n_per_row,
                        size_t * out_size);

/* ---- devices ------------------------------------------------------------------- */

/* Batch invariance of device `device`'s matrix product (NULL or "": the CPU): a matrix of
 * ggml type `type` quantized from w (n_out rows of n_in) times x (n_cols columns of n_in)
 * in one pass, against each column alone. repack != 0 places the matrix in the device's
 * repacked layout where it has one (as models load). Writes the columns that differ in
 * any bit and the largest difference. */
dfl_status dfl_matmul_invariance(const char * device, int type, int repack, const float * w, int64_t n_in, int64_t n_out, const float * x, int64_t n_cols, int32_t n_threads, int32_t * n_differ, float * max_diff);

/* Batch invariance of device `device`'s flash attention (NULL or "": the CPU): a random
 * cache of n_kv cells (K and V of ggml type kv_type: f32, f16, bf16, q8_0 or q4_0;
 * n_head_kv heads of head_dim) and n_rows query rows of n_head heads at its last
 * positions under a causal mask (row i sees cells 0 .. n_kv - n_rows + i), all rows in
 * one ggml_flash_attn_ext against each row alone (its own mask row, the same cache).
 * tree != 0: the rows are a random tree's nodes instead, each seeing the cells before the
 * rows and its own ancestors' (a tree verify's mask, with holes where siblings sit), and
 * each is checked against one row over a cache holding just what it sees, in order (its
 * path decoded alone). `seed` draws the cache, the queries and the tree. Writes the rows
 * whose output (every head) differs in any bit and the largest difference. */
dfl_status dfl_attention_invariance(const char * device, int kv_type, int64_t head_dim, int64_t n_head, int64_t n_head_kv, int64_t n_kv, int64_t n_rows, int32_t tree, int32_t n_threads, uint64_t seed, int32_t * n_differ, float * max_diff);

/* Threads by load (the CPU runtime's choice of thread count, dfl_threads.h), replayed on
 * made-up times: n computes, compute i of the graph built builds[i]-th (from 1; NULL: all
 * of one graph) taking seconds[i * n_levels + l] at level l (n_threads halved l times,
 * down to 1; n_levels of them). Writes the thread count each compute ran with. */
dfl_status dfl_threads_replay(int32_t n_threads, int32_t n_levels, const double * seconds, const uint64_t * builds, int64_t n, int32_t * threads_out);

/* The kept-graph check that DFLASH_CHECK_REUSE=1 turns on (every graph the runtime keeps
 * must be, at each later compute, the graph it was at its first) on a small CPU graph
 * computed once and then changed: 0 nothing, 1 a view's offset along its source, 2 an
 * op's parameters, 3 a source swapped. Returns what the check says before the second
 * compute (DFL_ERR_STATE with the node and field for a change). */
dfl_status dfl_reuse_check_probe(int change);

/* Number of devices in ggml's backend registry, and a description of device i
 * ("name|description|type", type one of cpu, gpu, igpu, accel). */
int dfl_device_count(void);
dfl_status dfl_device_describe(int i, char * buf, size_t buf_size);
/* 1 when the device's backend carries the project's batch-invariance patch (ggml built by
 * scripts/setup.sh), its patch's name written to buf; 0 for a stock backend or an unknown
 * device (NULL or "": the CPU). */
int dfl_device_batch_invariance(const char * device, char * buf, size_t buf_size);
/* The key of the ggml patch set this library was built for (dflash_gguf/data/ggml-patches,
 * hashed as scripts/llama_cpp_sources.sh does): a patched backend's name ends with
 * "patches KEY", and the runtime holds the two against each other. */
const char * dfl_ggml_patch_key(void);
/* One device's description (NULL or "": the CPU), asking no other device. */
dfl_status dfl_device_description(const char * device, char * buf, size_t buf_size);

/* Add the devices of a ggml RPC server ("host:port", as llama.cpp's rpc-server serves
 * them) to the registry; they are then named RPC0, RPC1, ... */
dfl_status dfl_rpc_add_server(const char * endpoint);

/* ---- target model (any registered architecture: qwen35, qwen35moe, qwen3) ------- */

typedef struct dfl_target dfl_target;
typedef struct dfl_draft dfl_draft;
/* Tokens a proposer left on the device for a verify (dfl_draft_tokens gives a drafter's). */
typedef struct dfl_token_source dfl_token_source;

/* One weight placed by name, over the default placement (-ngl): tensor `name` of the file
 * (its GGUF name) in the memory of device `device`, which must be the model's device or
 * the CPU. The product that reads it runs where it lives (ggml's scheduler computes an op
 * on the backend of its weight's buffer), its inputs and result copied between devices. */
typedef struct dfl_weight_placement {
    const char * name;
    const char * device;
} dfl_weight_placement;

typedef struct dfl_target_params {
    int32_t n_ctx;            /* tokens the context holds (prompt + generated); > 0 (default 4096) */
    int32_t n_ubatch;         /* most tokens in one decode call (prefill chunk); > 0 (default 512; at most n_ctx is used) */
    int32_t n_verify;         /* most tokens in one verify call; 1..256 (default 16) */
    int32_t n_threads;        /* CPU threads; 0: as many as the CPUs this process may use */
    int32_t kv_type;          /* ggml type id of the attention K cache: 0 f32, 1 f16, 30 bf16, 8 q8_0, 2 q4_0 */
    int32_t kv_type_v;        /* V cache type; < 0: the same as K */
    int32_t n_feature_layers; /* hidden states captured per token for a drafter */
    int32_t feature_layers[16]; /* llama.cpp convention: L = the input of layer L (output of L-1) */
    int32_t no_repack;        /* keep quantized matrices in file layout (no CPU repacking) */
    const char * device;      /* ggml device name; NULL: the first GPU, else the CPU */
    int32_t n_gpu_layers;     /* when the device is not the CPU: the last n layers (weights and
                                 caches) go on it, the rest stays on the CPU; the LM head too
                                 when n > n_layer; < 0: everything (default) */
    int32_t n_seq;            /* sequence slots, each of n_ctx positions (1..16; default 1) */
    int32_t rope_scaling_type; /* llama.cpp's --rope-scaling: -1 the file's, 0 none, 1 linear, 2 yarn */
    float rope_freq_scale;    /* 1 / --rope-scale; 0: the file's */
    int32_t yarn_orig_ctx;    /* --yarn-orig-ctx; 0: the file's (else its training context) */
    int32_t n_weight_placements; /* weights placed by name (read at load, not kept) */
    const dfl_weight_placement * weight_placements;
    /* An output head cut to these tokens (FR-Spec's drafter head): n_head_tokens distinct
     * ids of the vocabulary, in the order of the logits' rows; 0: the whole vocabulary.
     * Logits are then n_head_tokens wide and choices, candidates, masks and penalties
     * speak of head rows (index i is token head_tokens[i]). Read at load, not kept. */
    int32_t n_head_tokens;
    const int32_t * head_tokens;
} dfl_target_params;

typedef struct dfl_target_info {
    int32_t n_vocab;
    int32_t n_head;           /* rows of the output head: the logits' width (n_vocab unless cut) */
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_ctx_train;
    int32_t n_ctx;
    int32_t n_ubatch;
    int32_t n_verify;
    int32_t n_seq;
    int32_t n_past;           /* of sequence 0 (dfl_target_n_past: of any) */
    int32_t n_gpu_layers;     /* layers whose weights and caches are on a device other than the CPU */
    int64_t n_graphs;         /* target graphs run so far ... */
    int64_t n_graph_builds;   /* ... and how many of them had to be built (the rest reused one) */
    char device[128];
    int32_t n_threads;        /* CPU threads asked for */
    int32_t n_threads_in_use; /* ... and in use now: fewer while they compute faster under load (dfl_threads.h) */
    int32_t n_weight_buffers; /* backend buffers holding the weights (devices cap their size) */
    char arch[32];            /* general.architecture of the model */
    uint64_t compute_bytes;   /* compute memory its graph slots hold now */
    int32_t n_last_nodes;     /* nodes of the last graph run */
    int64_t n_host_writes;    /* input writes to the device so far (each a blocking copy on a device) */
    int64_t n_host_reads;     /* result reads back to the host so far (each waits for the device) */
    int64_t n_host_write_bytes; /* ... and their bytes */
    int64_t n_host_read_bytes;
    int32_t n_last_replay;    /* recurrent steps the commit carried by the last graph reran (0: none) */
    uint64_t host_layer_weights; /* bytes of layer weights in host memory while the device is another */
    int32_t n_last_splits;    /* splits of the last graph (runs on one backend between copies) */
    int64_t last_copy_bytes;  /* bytes the last graph copies between backends (its split inputs) */
    int64_t copy_bytes;       /* ... summed over every graph computed so far */
} dfl_target_info;

/* Where ggml's scheduler placed the nodes of the last graph a target or drafter computed:
 * on a device other than the CPU, nodes that stayed on the CPU (the token embedding
 * lookup, ops the device cannot run, layers not offloaded; inputs and views of them are
 * data, not counted) and how many splits (runs on one backend between copies) the graph
 * took. */
typedef struct dfl_placement {
    int32_t n_nodes;
    int32_t n_splits;
    int32_t n_host_nodes;   /* nodes on the CPU backend while the device is another (0 on the CPU) */
    int64_t copy_bytes;     /* bytes its splits copy between backends per compute */
    char host_nodes[1024];  /* their "OP(first source's name)", comma-separated (cut short when long) */
} dfl_placement;

void dfl_target_default_params(dfl_target_params * params);
dfl_status dfl_target_load(const char * path, const dfl_target_params * params, dfl_target ** out);
void dfl_target_free(dfl_target * target);
dfl_status dfl_target_get_info(const dfl_target * target, dfl_target_info * info);
dfl_status dfl_target_last_placement(const dfl_target * target, dfl_placement * out);

/* Forget every sequence's context (attention cache length and recurrent states back to empty). */
dfl_status dfl_target_reset(dfl_target * target);

/* ---- sequences and steps ----------------------------------------------------------------
 *
 * A target holds n_seq sequences, each in a slot of its own (0..n_seq-1) with its own
 * context. A step runs rows of one or several sequences in one graph:
 *   DFL_STEP_DECODE  append n tokens (n <= n_ubatch) to the sequence's context and
 *                    advance it; logits: 0 none, 1 the last row, 2 every row. A decode
 *                    of more than n_verify tokens (a prefill chunk) shares a step with
 *                    other sequences' rows when the step holds at most n_ubatch rows,
 *                    one chunk a step: a prompt joins running sequences without a pass
 *                    of its own.
 *   DFL_STEP_CHAIN   evaluate n candidate tokens (n <= n_verify) as a chain after the
 *                    context without committing them: logits for every row, features of
 *                    every row; dfl_target_commit keeps the first ones. tokens NULL: the
 *                    first n tokens of the drafter's last block for this sequence, read on
 *                    the device (drafting and verifying need no round trip through the
 *                    host).
 *   DFL_STEP_TREE    evaluate a tree of n candidate tokens (n <= n_verify, at most 64):
 *                    node 0 is the root (parents[0] = -1) and every other node's parent
 *                    comes before it. Each node sees the context and its ancestors, sits at
 *                    position n_past + depth, and continues its parent's recurrent state.
 *                    Logits and features for every node; dfl_target_commit_path keeps a
 *                    path. Trees of one size reuse a graph.
 * A sequence's rows see exactly what they would see in a step of their own. The results
 * (logits, choices, candidates, features) are rows in step order: each entry's rows
 * after the previous entries' (a decode's logits rows: none, its last, or all). A commit
 * is carried out by the next step the sequence is in. */

typedef enum dfl_step_kind {
    DFL_STEP_DECODE = 0,
    DFL_STEP_CHAIN = 1,
    DFL_STEP_TREE = 2
} dfl_step_kind;

typedef struct dfl_rows {
    int32_t seq;             /* the sequence's slot */
    int32_t kind;            /* dfl_step_kind */
    int32_t n;               /* tokens, or tree nodes */
    const int32_t * tokens;  /* NULL for a chain of the drafter's block */
    const int32_t * parents; /* a tree's */
    int32_t logits;          /* a decode's: 0 none, 1 the last row, 2 every row */
} dfl_rows;

/* One step over rows[0..n) of distinct sequences; source: the device tokens that chain
 * entries without host tokens read (a drafter's, dfl_draft_tokens; NULL when none does). */
dfl_status dfl_target_step(dfl_target * target, const dfl_token_source * source, const dfl_rows * rows, int32_t n);

/* Plain decoding in one call: each sequence seqs[i] (distinct) appends tokens[i] and its
 * row chooses the next token, written to choices[i]: a dfl_target_step of one-token
 * decodes with logits for their row, then dfl_target_choices (-1: draw it again with
 * dfl_target_redraw). u: each row's uniform for a sequence that samples, staged as
 * dfl_target_set_uniforms would (u[i] < 0, or u NULL: none staged, as for greedy);
 * penalties and masks are staged beforehand as for a step. copies (may be NULL): the
 * step graph's splits and the bytes the scheduler copied between devices in it. source:
 * the sequences' drafter (dfl_draft_tokens; may be NULL), as for a step: the feature
 * rows it still lacks are kept. */
dfl_status dfl_target_decode_next(dfl_target * target, const dfl_token_source * source, const int32_t * seqs,
                                  const int32_t * tokens, const float * u, int32_t n, int32_t * choices,
                                  int64_t * copies);

/* Keep the first n_keep tokens of the sequence's last chain verify (0 <= n_keep <= its length). */
dfl_status dfl_target_commit(dfl_target * target, int32_t seq, int32_t n_keep);

/* Keep a root-to-node path path[0..n_keep) (path[0] = 0) of the sequence's last tree verify. */
dfl_status dfl_target_commit_path(dfl_target * target, int32_t seq, const int32_t * path, int32_t n_keep);

/* Forget the sequence's positions from n_past on (n_past <= its length): the next decode
 * continues from position n_past as if the later ones had never been decoded. Only after a
 * decode (no verify or commit pending), and only for attention memories: a model with
 * recurrent layers is refused (its state cannot go back), and a sliding layer's ring
 * keeps only a few positions past its window (more are refused). */
dfl_status dfl_target_seq_truncate(dfl_target * target, int32_t seq, int32_t n_past);

/* Positions the sequence holds (-1: no such sequence). */
int32_t dfl_target_n_past(const dfl_target * target, int32_t seq);

/* 1 when the sequence's state is its position's: no verify or commit pending (a
 * recurrent target's commit is carried out by the step after it); 0 otherwise or for no
 * such sequence. Checkpoints and copies are taken only then. */
int32_t dfl_target_settled(const dfl_target * target, int32_t seq);

/* Empty one sequence's slot (its context, a pending verify and commit, staged sampling input). */
dfl_status dfl_target_seq_reset(dfl_target * target, int32_t seq);

/* Slot dst holds what slot src holds (its positions, recurrent and conv state, length);
 * src must have no verify or commit pending (copy after a decode). */
dfl_status dfl_target_seq_copy(dfl_target * target, int32_t src, int32_t dst);

/* Results of the last step: rows in step order. The logits are after the penalties
 * staged for the rows (dfl_target_set_penalties), if any, and after the rows' masks
 * (dfl_target_set_masks: -inf where disallowed) in a step that samples over the whole
 * vocabulary, or whose rows allow few tokens; a greedy step under masks, and one whose
 * rows draw from their own top_k under masks allowing many tokens, leave them as they
 * are (they look the masks up at each row's largest logits only). */
dfl_status dfl_target_logits(const dfl_target * target, float * dst, int32_t row0, int32_t n_rows);
/* The model's own logits of the last step's rows, before the logit bias, the penalties and
 * the masks (llama-server's log-probabilities are over these): the rows' as dfl_target_logits
 * reads them where nothing changed them, else the copy kept for sequences whose sampling
 * asked for it (dfl_sampling.raw_logits); a step that changed them and kept none fails. */
dfl_status dfl_target_raw_logits(const dfl_target * target, float * dst, int32_t row0, int32_t n_rows);
/* The target's choice at each row, made on the device by its sampling settings: the
 * argmax (greedy), or the draw with the row's uniform; -1 for a row whose kept set may
 * reach past the candidates ranked on the device (see dfl_sampling.n_candidates): draw it
 * again with dfl_target_redraw. A greedy row under a mask none of whose largest logits it
 * allows is decided here, over its whole masked row, when the choices are first read; so
 * is a step whose rows draw from their own top_k under masks when a row's largest logits
 * held fewer than top_k allowed tokens (the step's sampling runs again, masked in place). */
dfl_status dfl_target_choices(dfl_target * target, int32_t * dst, int32_t row0, int32_t n_rows);
/* Captured features of the rows of the sequence's last call (its rows alone, in their
 * order, whatever else ran in the step), [n_rows][n_feature_layers * n_embd] float32.
 * Each sequence keeps its own until its next call. */
dfl_status dfl_target_features(const dfl_target * target, int32_t seq, float * dst, int32_t row0, int32_t n_rows);

/* ---- tree verify layout (for tools and tests) ----------------------------------------------
 *
 * How a tree verify runs (dfl_tree.c): each node's depth and ancestors, the short
 * convolution's window of each node, and the recurrence's layout: the spine (a longest
 * root path) as one sequence in two delta-rule ops, the first (steps [0, split)) keeping
 * its states from step `first` on, the rest after it; then each group of branches (the
 * other leaves' paths from where they leave the spine), `branches[g]` sequences of
 * `steps[g]` steps, each starting from the spine's kept state `branch_from` (s: s steps
 * before the end of the first op). Outputs: node i's row of the first op is out_rows[i]
 * (rows n.. are spare); each later op's rows, in step order, go to rows scatter[..]. The
 * convolution runs the committed inputs and the spine as a sequence (conv_spine; outputs
 * gathered by conv_out, then each off-spine node's window, its result to row
 * conv_scatter[k]), or every node on its own window (conv_rows: d_conv columns each). */

typedef struct dfl_tree_layout {
    int32_t n;
    int32_t depth[64];
    uint64_t ancestors[64];       /* bit j: node j is on node i's root path (node i included) */
    int32_t windows[64 * 16];     /* per node, d_conv columns of [d_conv - 1 committed inputs | nodes], oldest first */
    int32_t spine, split, first, off;
    int32_t branches[2], steps[2];
    int32_t n_steps;              /* the node of each step: the spine's, then each group's [branches][steps] */
    int32_t step_node[64 * 65];
    int32_t n_branches;
    int32_t branch_from[64];
    int32_t n_out_rows;
    int32_t out_rows[64 * 65];
    int32_t n_scatter;
    int32_t scatter[64 * 65];
    int32_t conv_spine;
    int32_t n_conv_rows;
    int32_t conv_rows[64 * 18];
    int32_t n_conv_out;
    int32_t conv_out[128];
    int32_t n_conv_scatter;
    int32_t conv_scatter[64];
} dfl_tree_layout;

/* The layout of a tree of n nodes (parents as dfl_target_step takes them) on a model whose
 * recurrent layers have a convolution of d_conv (2..16), planned on its own (not padded to
 * earlier trees' shapes). */
dfl_status dfl_tree_describe(const int32_t * parents, int32_t n, int32_t d_conv, dfl_tree_layout * out);

/* ---- sampling, on the device ---------------------------------------------------------------- */

/* How a model chooses a row's token from its logits, inside the graph that computes
 * them, in llama.cpp's sampler order: the penalties (over the token counts staged for
 * the row), top-k, then top-p and min-p on the probabilities at temperature 1, then the
 * temperature, then a draw with the row's uniform. Only token ids (and, with top_k, the
 * kept candidates' probabilities) come back to the host. */
typedef struct dfl_sampling {
    float temperature;        /* <= 0: the argmax (greedy; the penalties still apply) */
    int32_t top_k;            /* keep the k most likely; 0: all */
    float top_p;              /* then the fewest most likely whose probability reaches top_p; 1: all */
    float min_p;              /* then those at least min_p times as likely as the most likely; 0: all */
    float repeat_penalty;     /* a seen token's logit divided by it when positive, else multiplied; 1: off */
    float frequency_penalty;  /* a seen token's logit less its count times this; 0: off */
    float presence_penalty;   /* a seen token's logit less this; 0: off */
    int32_t n_candidates;     /* top_k 0 with top_p < 1 or min_p > 0: tokens ranked per row on the device
                                 (<= 0: 256); a row whose kept set may reach past them chooses -1 */
    int32_t raw_logits;       /* nonzero: keep the rows' own logits for dfl_target_raw_logits (where the
                                 bias, penalties or a mask change the rows in place, a copy of them) */
} dfl_sampling;

void dfl_sampling_default(dfl_sampling * s);

/* A sequence's sampling from its next step on (until set again); checked. */
dfl_status dfl_target_set_sampling(dfl_target * target, int32_t seq, const dfl_sampling * s);

/* The sequence's logit bias (llama.cpp's logit_bias), from its next step on until its
 * sampling is set again (which clears it): n distinct tokens (rows of a cut head), each
 * with a bias added to its logit in every row the sequence's steps choose, before the
 * penalties; -inf: the token is never chosen. The drafter's sampling takes none. n 0: none. */
dfl_status dfl_target_set_logit_bias(dfl_target * target, int32_t seq, const int32_t * tokens, const float * biases,
                                     int32_t n);

/* Uniforms in [0, 1), one per row the sequence's next step computes logits for, when
 * it samples (temperature > 0): the draws' randomness, from the caller's seeded
 * generator. Consumed by that step. */
dfl_status dfl_target_set_uniforms(dfl_target * target, int32_t seq, const float * u, int32_t n);

/* Token counts for the penalties of the sequence's rows with logits in its next step:
 * per row, per_row (token, count) entries, [n_rows][per_row] each, tokens distinct within
 * a row (pad with unseen tokens and count 0). A row's counts are of its own context: the
 * tokens before it, in the window the penalties look at, its own path included (a chain
 * row's prefix, a tree node's ancestors). Consumed by that step. */
dfl_status dfl_target_set_penalties(dfl_target * target, int32_t seq, const int32_t * tokens, const float * counts,
                                    int32_t n_rows, int32_t per_row);

/* Allowed tokens of the sequence's rows with logits in its next step (a grammar's
 * constraint): per row n_words = ceil(n_vocab / 32) words, bit t % 32 of word t / 32 set
 * when token t is allowed; [n_rows][n_words]. The rows' disallowed logits become -inf
 * on the device, after the penalties and before top-k and the pick, greedy or sampled
 * (the logits read back are masked too where the step masks them in place: see
 * dfl_target_logits). A row must allow some token. A step without
 * masks staged for any of its sequences runs no mask at all; in a step with some, the
 * other sequences' rows allow every token. Consumed by that step. */
dfl_status dfl_target_set_masks(dfl_target * target, int32_t seq, const uint32_t * words, int32_t n_rows,
                                int32_t n_words);

/* With top_k > 0: the kept candidates of the last call's rows, most likely first, and the
 * probabilities they were drawn with (0 for those the filters cut), [n_rows][k] each,
 * k = min(top_k, n_vocab). Under masks, as the masked rows give them (a step that looked
 * its masks up at its rows' largest logits and left a row undecided has its choices
 * decided first, as dfl_target_choices does). */
dfl_status dfl_target_candidates(dfl_target * target, int32_t row0, int32_t n_rows, int32_t k,
                                 int32_t * tokens, float * probs);
/* Draws again, for sequence seq, the rows of the last call whose choice was -1 (a kept
 * set of top_k 0 with top_p or min_p that reaches past the candidates the step ranked):
 * with the same uniforms u, over their logits ranked in full, on the device. Writes n
 * token ids to dst; the last call's logits, choices and candidates stay readable. */
dfl_status dfl_target_redraw(dfl_target * target, int32_t seq, const int32_t * rows, const float * u, int32_t n,
                             int32_t * dst);

/* ---- drafters --------------------------------------------------------------------------
 *
 * A drafter proposes blocks for the target to verify: a DFlash or DFlash2 drafter (a
 * 'dflash' GGUF: one pass over [bonus, MASK...]) or the multi-token-prediction layer
 * of a Qwen3.5/3.6 GGUF (its 'nextn' layers: one pass per draft). Either reads the
 * target's captured features and shares its token embedding and LM head; it keeps its
 * own context per sequence slot, which it takes from the target by itself: each
 * propose (or append) first takes the positions the sequence's target committed since
 * the drafter's last graph for it (their features stay in the target's rows of that
 * sequence until its next target call, whatever other sequences run). */

/* A drafter kind this build runs: one line of csrc/models/drafters.def, which says what
 * each field holds. The Python side reads them once (dflash_gguf/runtime/drafter_kinds.py). */
typedef struct dfl_drafter_kind {
    const char * name;          /* the kind a file is (dfl_draft_meta.kind): "dflash" */
    const char * spec_type;     /* its --spec-type name: "draft-dflash" */
    const char * title;         /* its name in prose: "DFlash" */
    const char * what;          /* what its file is: "a DFlash drafter" */
    const char * help;          /* --spec-type's words for it */
    const char * marker;        /* the tensor that makes a file of its architectures its own; NULL: none */
    const char * const * archs; /* general.architecture values of the GGUFs it reads, NULL-terminated */
    int32_t autoregressive;     /* a pass per draft: its block is the caller's drafts, not trained */
    int32_t in_target;          /* it drafts with layers of the target's own GGUF: no drafter file */
} dfl_drafter_kind;

int32_t dfl_drafter_kind_count(void);
/* Kind i, 0 .. count - 1, in drafters.def's order (NULL outside). */
const dfl_drafter_kind * dfl_drafter_kind_at(int32_t i);

typedef struct dfl_draft_params {
    int32_t kv_type;   /* ggml type id of the drafter's context cache: 0 f32, 1 f16, 30 bf16;
                          < 0 (default): f32 on the CPU, f16 on other devices */
    int32_t window;    /* attend to the last `window` context positions only; 0: all */
    int32_t n_threads; /* CPU threads; 0: the target's */
    int32_t top_k;     /* candidates per position computed on the device for tree building
                          (>= 1: every propose also ranks its top choices); 0: none */
    int32_t block_size; /* the largest block a propose asks for (the bonus and its drafts); 0:
                          the drafter's own (a DFlash file's trained block) */
    int32_t n_weight_placements; /* drafter weights placed by name (read at load, not kept) */
    const dfl_weight_placement * weight_placements;
    /* A DFlash drafter's LM head cut to these tokens (FR-Spec): n_head_tokens distinct ids
     * of the target's vocabulary. Its logits are -inf at every other token, so it never
     * drafts one; the target's verify, and so the output, is unchanged. 0: the kept set
     * its file carries (the key dflash.head_tokens, which llama.cpp ignores), else the
     * whole head. Read at load, not kept. */
    int32_t n_head_tokens;
    const int32_t * head_tokens;
} dfl_draft_params;

typedef struct dfl_draft_info {
    char kind[16];              /* the drafter's kind (dfl_drafter_kind.name): "dflash", "mtp", ... */
    int32_t block_size;
    int32_t mask_token_id;      /* -1: the drafter fills no block (autoregressive) */
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_target_layers;
    int32_t target_layers[16];  /* llama.cpp convention (HF id + 1) */
    int32_t reads_tokens;       /* its context needs the committed tokens (dfl_block.tokens) */
    int32_t greedy_only;        /* it drafts its own choices only (no drawn drafts) */
    int32_t has_confidence;     /* it estimates each draft's acceptance (dfl_draft_confidence) */
    int32_t n_ctx_tokens;       /* context positions the drafter holds */
    int32_t n_head_tokens;      /* tokens its LM head keeps (a cut head), or the vocabulary */
    int64_t n_graphs;           /* graphs run so far ... */
    int64_t n_graph_builds;     /* ... and how many of them were built, not reused */
    uint64_t compute_bytes;     /* compute memory its graph slots hold now */
    int32_t n_last_nodes;       /* nodes of the last propose (with its ranking, once run) or append */
    int64_t n_host_writes;      /* input writes to the device so far */
    int64_t n_host_reads;       /* result reads back to the host so far */
    int64_t n_host_write_bytes; /* ... and their bytes */
    int64_t n_host_read_bytes;
} dfl_draft_info;

/* What a drafter file says about itself, read (and bounded) without loading it: a
 * 'dflash' GGUF, or a model GGUF with nextn layers (kind "mtp": its MTP layer drafts for
 * the model itself, reading feature layer n_layer, the final-normed state). */
typedef struct dfl_draft_meta {
    char kind[16];             /* the kind that reads it (dfl_drafter_kind.name): "dflash", "dspark" (a
                                  dflash GGUF with a Markov head), "mtp", ... */
    int32_t block_size;        /* trained block size (2..256; 16 when the file has none; 0: none, the
                                  caller's (mtp, eagle3)) */
    int32_t mask_token_id;     /* -1 when the file has none */
    int32_t n_embd;
    int32_t n_target_layers;
    int32_t target_layers[16]; /* llama.cpp convention (HF id + 1) */
    int32_t has_fingerprint;   /* converted by dflash-gguf: the target it was made for is recorded */
    int32_t target_n_embd;     /* ... that target's embedding shape */
    int32_t target_n_vocab;
    char name[128];            /* general.name (or the file name) */
    char target_name[128];     /* the recorded target's name */
    char target_tokenizer_sha256[65];
} dfl_draft_meta;

dfl_status dfl_draft_read_meta(const char * path, dfl_draft_meta * meta);

/* sha256 (hex, 64 characters and a NUL) of a GGUF's tokenizer: its tokens, merges and
 * bos/eos/unk/sep/pad ids -- the fingerprint a converted drafter records of its target. */
dfl_status dfl_tokenizer_fingerprint(const char * path, char * hex, size_t size);

void dfl_draft_default_params(dfl_draft_params * params);

/* Load a drafter that reads `target`'s captured features and shares its token embedding
 * and LM head: the kind is the file's architecture ('dflash', 'eagle3'; a target
 * architecture with nextn layers: its MTP layer, from the target's own file). The target must have been
 * loaded with feature_layers equal to the drafter's target_layers. The drafter must be
 * freed before its target. */
dfl_status dfl_draft_load(const char * path, dfl_target * target, const dfl_draft_params * params, dfl_draft ** out);
void dfl_draft_free(dfl_draft * draft);
dfl_status dfl_draft_get_info(const dfl_draft * draft, dfl_draft_info * info);
dfl_status dfl_draft_last_placement(const dfl_draft * draft, dfl_placement * out);

/* Forget every sequence's drafter context. */
dfl_status dfl_draft_reset(dfl_draft * draft);
/* Forget one sequence's drafter context. */
dfl_status dfl_draft_seq_reset(dfl_draft * draft, int32_t seq);
/* Context positions the drafter holds for a sequence (-1: no such sequence). */
int32_t dfl_draft_n_past(const dfl_draft * draft, int32_t seq);
/* 1 when the drafter must take the positions of the sequence it lacks before the
 * target's next call of up to n_rows rows in the slot, which would otherwise let their
 * feature rows go. While it need not, it may stay behind by several calls (auto's plain
 * decoding runs no drafter graph): its memory is the one record of how far it is; 0
 * also for a bad drafter or sequence. */
int32_t dfl_draft_catch_up_due(const dfl_draft * draft, int32_t seq, int32_t n_rows);

/* Take the positions the sequence's target committed since the drafter's last graph
 * for it (after a prefill chunk, or to catch up before the sequence's next target call),
 * in a graph of its own (none when there are none). tokens: their tokens, n_tokens of
 * them, which a drafter that reads them needs (dfl_draft_info.reads_tokens); may be NULL
 * for the others. */
dfl_status dfl_draft_append(dfl_draft * draft, int32_t seq, const int32_t * tokens, int32_t n_tokens);

/* One sequence's part of a propose: the positions its target committed since the
 * drafter's last graph for it taken first (as dfl_draft_append does; tokens as there),
 * then the block of n_block tokens drafted at the next positions: the bonus (the last
 * token the target chose), then n_block - 1 drafts. n_block 0: the positions alone. */
typedef struct dfl_block {
    int32_t seq;
    const int32_t * tokens;
    int32_t n_tokens;
    int32_t bonus;
    int32_t n_block;
} dfl_block;

/* Draft blocks of distinct sequences in one graph: each block's drafts (greedy, or drawn
 * by the sequence's sampling) stay on the device, for dfl_target_step's chain entries to
 * read (dfl_draft_tokens); dfl_draft_block reads them. The drafted rows of the results
 * (top1, topk, candidates, logits) are in block order, n_block - 1 each (blocks of
 * n_block 0 have none). */
dfl_status dfl_draft_propose(dfl_draft * draft, const dfl_block * blocks, int32_t n);

/* The first n tokens of the sequence's last proposed block: the bonus, then the drafts. */
dfl_status dfl_draft_block(const dfl_draft * draft, int32_t seq, int32_t * dst, int32_t n);

/* The drafter's last blocks as device tokens, for dfl_target_step's chain entries (valid
 * while the drafter lives; each propose updates them). */
const dfl_token_source * dfl_draft_tokens(const dfl_draft * draft);

/* The top_k candidates per drafted position of the last propose: tokens and their
 * log-probabilities (full-vocabulary log-softmax), [n_rows][top_k] each, best first
 * (ties: lower token id first). With top_k > 1 the first call after a propose ranks its
 * logits on the device (a graph of its own, so that a propose whose candidates are only
 * read as far as the top choice does not pay for the top-K). */
dfl_status dfl_draft_topk(dfl_draft * draft, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs);

/* The top choice per drafted position of the last propose and its log-probability,
 * [n_rows] each (tokens may be NULL: log-probabilities only): topk's first column, which
 * every propose of a drafter loaded with top_k >= 1 computes (a chain cut by confidence
 * reads it on nearly every step). */
dfl_status dfl_draft_top1(const dfl_draft * draft, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs);
/* Each drafted row's acceptance estimate (0..1) from the drafter's confidence head, rows
 * row0..row0 + n_rows - 1 of the last propose (DSpark drafters with conf_proj; others
 * fail). */
dfl_status dfl_draft_confidence(const dfl_draft * draft, int32_t row0, int32_t n_rows, float * out);

/* A sequence's drafter sampling for its next proposes: with temperature > 0, each drafted
 * position's token is drawn on the device (penalties are not applied to drafts), and
 * dfl_draft_candidates gives the distribution it was drawn from. A drafter that chooses
 * its drafts itself (DFlash2's selector, MTP's passes; dfl_draft_info.greedy_only) drafts
 * greedily only. */
dfl_status dfl_draft_set_sampling(dfl_draft * draft, int32_t seq, const dfl_sampling * s);

/* One uniform per drafted position (n_block - 1) of the sequence's next block, when it samples. */
dfl_status dfl_draft_set_uniforms(dfl_draft * draft, int32_t seq, const float * u, int32_t n);

/* With sampling and top_k > 0: the kept candidates of the last propose's drafted
 * positions and their probabilities, as dfl_target_candidates. */
dfl_status dfl_draft_candidates(const dfl_draft * draft, int32_t row0, int32_t n_rows, int32_t k,
                                int32_t * tokens, float * probs);

/* Logits [n_block-1][n_vocab] of the last propose (after scale/softcap). */
dfl_status dfl_draft_logits(const dfl_draft * draft, float * dst, int32_t row0, int32_t n_rows);

/* ---- a greedy chain step, fused ---------------------------------------------------------- */

/* One sequence's part of dfl_chain_step: the drafter first takes the positions its target
 * committed since the drafter's last graph for it (tokens, as for dfl_block), then drafts
 * a block of n_block (2..the drafter's block size) after the bonus. Written by the call:
 * out[0..n_out) the accepted drafts, then the target's own next token (out has room for
 * n_block); n_verified the rows the target verified (the bonus and the drafts kept by
 * the p_min cut). */
typedef struct dfl_chain_seq {
    int32_t seq;
    const int32_t * tokens;
    int32_t n_tokens;
    int32_t bonus;
    int32_t n_block;
    int32_t * out;
    int32_t n_out;
    int32_t n_verified;
} dfl_chain_seq;

/* A greedy chain step of seqs[0..n) (distinct slots), what a step crosses into the library
 * for six times in one call: one drafter graph proposes every block; each chain is cut
 * before the first draft whose top-1 probability is below p_min (p_min 0: none; a drafter
 * loaded with top_k >= 1 otherwise); one target graph verifies them, reading the drafts on
 * the device; each row's argmax keeps the drafts it agrees with; the kept rows are
 * committed (carried out by the sequence's next step, as dfl_target_commit's). Greedy
 * only: sampled rows, penalties, grammars and a cut head take the separate calls.
 * copies (may be NULL): the target graph's splits and bytes copied, as decode_next's;
 * us (may be NULL): microseconds spent drafting, then verifying and accepting. */
dfl_status dfl_chain_step(dfl_target * target, dfl_draft * draft, dfl_chain_seq * seqs, int32_t n, float p_min,
                          int64_t * copies, int64_t * us);

/* The greedy chain's two rules, here once for dfl_chain_step and the Python step alike:
 * the drafts of block[1..b) that agree with the target's choice after each position
 * (choice[i] follows block[i]), counted up to the first that does not; */
int32_t dfl_agreed_drafts(const int32_t * block, const int32_t * choice, int32_t b);
/* and of n drafts, those to verify: all before the first whose top-1 log-probability
 * top1_lp[i] is below log(p_min) (n when p_min is 0). */
int32_t dfl_confident_drafts(const float * top1_lp, int32_t n, float p_min);

/* ---- prefix checkpoints ----------------------------------------------------------------- */

typedef struct dfl_checkpoint dfl_checkpoint;

/* Copy the decoding state of sequence seq at its current position: attention K/V rows,
 * the recurrent and conv states, and (with a drafter) the drafter's context positions a
 * later draft can still attend to (its window). Taken after a decode (e.g. the end of
 * a prefill), never between a verify and the graph that carries its commit; the
 * drafter must hold as many positions as the target.
 *
 * on_device != 0: state that lives on a device is copied into that device's memory
 * (device to device, no transfer; host memory when the device has no room); 0: into
 * host memory. State in host memory is always copied to host memory.
 *
 * parent (or NULL): a checkpoint of the same target and drafter at an earlier position
 * whose tokens are a prefix of the current context's (the caller vouches for that).
 * The new checkpoint then keeps per-position rows only from the parent's position on,
 * and restoring it reads the parent's rows too: the parent's state stays alive, even
 * after dfl_checkpoint_free of its handle, until its last child is freed. */
dfl_status dfl_checkpoint_save(dfl_target * target, dfl_draft * draft, int32_t seq, dfl_checkpoint * parent,
                               int32_t on_device, dfl_checkpoint ** out);

/* The bytes dfl_checkpoint_save(target, draft, seq, parent, 1) would copy now: of state
 * on a device, and of state in host memory. */
dfl_status dfl_checkpoint_measure(const dfl_target * target, const dfl_draft * draft, int32_t seq,
                                  const dfl_checkpoint * parent, uint64_t * device_bytes, uint64_t * host_bytes);

/* Put sequence seq of the target (and drafter, when not NULL) at the checkpoint's
 * position, whichever sequence it was taken from: the next decode continues from there
 * exactly as from the original context. Only into the target and drafter it was taken
 * from. */
dfl_status dfl_checkpoint_restore(const dfl_checkpoint * checkpoint, dfl_target * target, dfl_draft * draft,
                                  int32_t seq);

int32_t dfl_checkpoint_n_past(const dfl_checkpoint * checkpoint);
/* The position of the parent whose rows it reads (0: it holds all its rows itself). */
int32_t dfl_checkpoint_parent_n_past(const dfl_checkpoint * checkpoint);
/* What the checkpoint holds itself (not its parent's part), by where it lives: device
 * memory, host memory. Tensor data bytes; buffers add their alignment. */
uint64_t dfl_checkpoint_device_bytes(const dfl_checkpoint * checkpoint);
uint64_t dfl_checkpoint_host_bytes(const dfl_checkpoint * checkpoint);
/* Host memory it keeps besides the copies above: its record, tensor metadata and its host
 * buffers' padding to whole pages. */
uint64_t dfl_checkpoint_overhead_bytes(const dfl_checkpoint * checkpoint);
/* Releases the caller's handle (the state lives on while a child checkpoint needs it). */
void dfl_checkpoint_free(dfl_checkpoint * checkpoint);

/* ---- memory plan ------------------------------------------------------------------------ */

/* What a configuration needs on one device, in bytes. */
typedef struct dfl_plan_device {
    char name[64];
    uint64_t free;            /* memory the device reports free, and its total */
    uint64_t total;
    uint64_t target_weights;  /* target weights placed on this device; on the CPU also the host copy
                                 of a tied embedding the device takes only in row slices */
    uint64_t target_embd;     /* ... of which the token embedding (and that host copy) */
    uint64_t target_output;   /* ... of which the LM head and output norm (untied) */
    uint64_t target_experts;  /* ... of which routed experts (blk.N.*_exps.*, *_chexps.*) */
    uint64_t draft_weights;   /* drafter weights (it shares the target's embedding and LM head) */
    uint64_t kv_cache;        /* attention K and V for n_ctx tokens */
    uint64_t recurrent_state; /* recurrent and conv states */
    uint64_t verify_scratch;  /* a verify's kept recurrence inputs and conv inputs per row; features */
    uint64_t draft_cache;     /* the drafter's context cache (n_ctx positions, or its window) */
    uint64_t target_compute;  /* the target's graph slots, as ggml's allocator reserves them */
    uint64_t draft_compute;   /* the drafter's graph slots (propose or append; ranking) */
} dfl_plan_device;

typedef struct dfl_plan {
    int32_t n_devices;           /* the target's device, then the CPU when that is another */
    dfl_plan_device devices[2];
} dfl_plan;

/* Plan a target (and a drafter when draft_path is not NULL) with these parameters
 * without allocating anything: only metadata is read, graphs are measured, not run. */
dfl_status dfl_plan_memory(const char * target_path, const dfl_target_params * target_params,
                           const char * draft_path, const dfl_draft_params * draft_params, dfl_plan * plan);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_H */
