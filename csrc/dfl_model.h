/* The model interface: what an architecture tells the generic runtime, and the graph
 * services the runtime offers its layer builders.
 *
 * One file per architecture (csrc/models/<arch>.c) reads its hyperparameters and
 * weights from the GGUF and builds one transformer block at a time. The runtime
 * (dfl_target*.c) owns everything that depends on the decoding step rather than on the
 * architecture: caches and recurrent state, graph reuse, verify inputs and masks,
 * commits and feature capture. It knows layers only by kind. */
#ifndef DFL_MODEL_H
#define DFL_MODEL_H

#include "dfl_gguf.h"

#define DFL_MAX_LAYERS 256

typedef enum dfl_layer_kind {
    DFL_LAYER_ATTENTION = 0, /* KV-cached attention: rollback is truncation */
    DFL_LAYER_RECURRENT = 1  /* Gated DeltaNet with a short convolution: state and conv window */
} dfl_layer_kind;

/* KV cache geometry of an attention layer, and what it attends to. */
typedef struct dfl_attention_geometry {
    int head_dim_k, head_dim_v, n_head_kv;
    int window;      /* > 0: sliding window, a row at position p sees keys at positions > p - window */
    bool shares_kv;  /* reads the cache of layer kv_layer (an earlier one) and stores nothing */
    int kv_layer;
} dfl_attention_geometry;

/* Shape of every recurrent layer of a model: a short causal convolution over
 * conv_channels inputs, then a gated delta rule with n_v_heads square states. */
typedef struct dfl_recurrent_geometry {
    int d_conv, conv_channels;
    int head_k_dim, n_k_heads, head_v_dim, n_v_heads;
} dfl_recurrent_geometry;

typedef struct dfl_model dfl_model;
typedef struct dfl_graph dfl_graph;

/* RoPE frequency scaling as ggml_rope_ext takes it (llama.cpp's rope.scaling.* keys,
 * resolved as llama.cpp's context does): none is freq_scale 1 and ext_factor 0. */
typedef struct dfl_rope_scaling {
    float freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
    int n_ctx_orig; /* the trained context the YaRN ramps are measured against */
    /* YaRN's correction range as computed (transformers' truncate: false), not widened to
     * whole dimensions as ggml_rope_ext does; dfl_rope then passes the blend as
     * frequency factors (dfl_yarn_factors) */
    bool exact_ramp;
} dfl_rope_scaling;

/* A file's rope.scaling.* keys resolved with llama.cpp-style overrides (type -1 the file's,
 * 0 none, 1 linear, 2 yarn; freq_scale 0 and n_ctx_orig 0 the file's); *type the method.
 * The yarn_truncate key (ours) sets exact_ramp; without it the ramp is ggml's. */
dfl_status dfl_rope_scaling_read(const dfl_gguf * g, int n_ctx_train, int type, float freq_scale, int n_ctx_orig,
                                 dfl_rope_scaling * out, const char ** type_name);

typedef struct dfl_arch {
    const char * name;   /* general.architecture */
    const char * family; /* for messages */
    /* Hyperparameters, weights and their validation; the file is open, m->arch set. */
    dfl_status (*load)(dfl_model * m);
    /* One block: x [n_embd, n] in, the residual stream after the block out. */
    struct ggml_tensor * (*build_layer)(const dfl_model * m, dfl_graph * g, int il, struct ggml_tensor * x);
} dfl_arch;

struct dfl_model {
    const dfl_arch * arch;
    dfl_gguf file;
    int n_vocab, n_embd, n_layer, n_ctx_train;
    float eps;           /* of the final norm */
    float embd_scale;    /* token embeddings are multiplied by it (1: not scaled) */
    float logit_softcap; /* logits = c * tanh(logits / c) when > 0 */
    dfl_rope_scaling rope;
    bool no_rope_scaling; /* the architecture runs unscaled RoPE only */
    bool yarn_exact_ramp; /* the architecture's YaRN ramp when the file does not say (gpt-oss: exact) */
    dfl_layer_kind kind[DFL_MAX_LAYERS];
    dfl_attention_geometry attn[DFL_MAX_LAYERS]; /* attention layers */
    dfl_recurrent_geometry rec;                  /* when n_recurrent > 0 */
    int n_attention, n_recurrent;
    struct ggml_tensor * tok_embd;
    struct ggml_tensor * output_norm;
    struct ggml_tensor * output; /* the token embedding when tied */
    void * weights;              /* the architecture's own layer weights (freed with the model) */
};

/* Open a GGUF, pick its architecture and load its description (no weight data is read). */
dfl_status dfl_model_open(const char * path, dfl_model * m);
void dfl_model_close(dfl_model * m);
/* Resolve m->rope from the file's rope.scaling keys and llama.cpp-style overrides:
 * type -1 the file's (0 none, 1 linear, 2 yarn), freq_scale 0 and n_ctx_orig 0 the file's. */
dfl_status dfl_model_rope_scaling(dfl_model * m, int type, float freq_scale, int n_ctx_orig);
/* Comma-separated names of the architectures this build runs. */
const char * dfl_model_arch_names(void);

/* ---- graph services for layer builders ------------------------------------------ */

struct dfl_graph {
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    int n;                    /* rows: tokens of a decode or chain, nodes of a tree */
    struct ggml_tensor * pos; /* [n] I32 position of each row */
    void * runtime;           /* the runtime's own state for this graph */
    struct ggml_tensor * rope_factors; /* dfl_graph_rope's YaRN factors, built on first use */
};

/* Attention over the cache and this graph's rows with the runtime's mask (causal, or
 * ancestors only in a tree; within the layer's window when it has one): stores k and v
 * at the rows' cache slots. A layer sharing another's cache passes k = v = NULL and
 * attends to what that layer stored.
 * q [hd_k, n_head, n], k [hd_k, n_head_kv, n], v [hd_v * n_head_kv, n] -> [hd_v * n_head, n]. */
struct ggml_tensor * dfl_graph_attention(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, float scale);
/* The same with a learned logit per head [n_head] (f32) in every row's softmax, which
 * attends to nothing (gpt-oss's attention sinks); sinks NULL: plain attention. */
struct ggml_tensor * dfl_graph_attention_sinks(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                               struct ggml_tensor * v, float scale, struct ggml_tensor * sinks);

/* A tensor of layer il's rows [width, n] (its attention's output, the residual stream)
 * cut to the rows that get logits where nothing after this layer reads the others
 * (llama.cpp's inp_out_ids): in the last layer of a pass that wants fewer rows than it
 * computes (a prompt's chunk: its last row, or none) and captures no final state for a
 * drafter, so that the FFN runs on those rows alone. Elsewhere x itself. An architecture
 * whose llama.cpp graph cuts there calls it on both operands of the residual add between
 * its attention and its FFN (all but qwen35 and qwen35moe, which llama.cpp does not cut:
 * the parity tool pairs tensors by shape). */
struct ggml_tensor * dfl_graph_ffn_rows(dfl_graph * g, int il, struct ggml_tensor * x);

/* The layer's short causal convolution (before activation) over x [conv_channels, n]
 * with kernel [d_conv, conv_channels]: each row sees the inputs before it (along the
 * tree path in a tree). -> [conv_channels, n] */
struct ggml_tensor * dfl_graph_short_conv(dfl_graph * g, int il, struct ggml_tensor * x, struct ggml_tensor * kernel);

/* The layer's gated delta rule from its committed state: q, k [head_k_dim, n_k_heads, n]
 * (normalised), v [head_v_dim, n_v_heads, n], log-decay g and beta [n_v_heads, n].
 * -> output [head_v_dim, n_v_heads, n] */
struct ggml_tensor * dfl_graph_delta_net(dfl_graph * g, int il, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * gate, struct ggml_tensor * beta);

/* ---- shared building blocks -------------------------------------------------------- */

/* Names t as llama.cpp's graph builders name their intermediates ("attn_norm-3" for
 * layer 3; il < 0: the name alone), so that a dump (dfl_dump.h) pairs with
 * llama-eval-callback's tensor by tensor. Returns t; names change nothing computed. */
struct ggml_tensor * dfl_cb(struct ggml_tensor * t, const char * name, int il);

/* NeoX-style ggml_rope_ext with the model's frequency scaling. */
struct ggml_tensor * dfl_rope(const dfl_model * m, struct ggml_context * ctx, struct ggml_tensor * x,
                              struct ggml_tensor * pos, struct ggml_tensor * freqs, int n_rot, float base);
/* The same for the rows of a graph, with an exact YaRN ramp's frequency factors built
 * once per graph (a model has one n_rot and base when its ramp is exact). */
struct ggml_tensor * dfl_graph_rope(const dfl_model * m, dfl_graph * g, struct ggml_tensor * x, int n_rot, float base);
/* NeoX ggml_rope_ext under scaling r. With r->exact_ramp, `factors` must be
 * dfl_yarn_factors(r, n_rot, base): the YaRN blend of each rotary pair as frequency
 * factors, rotated with ext_factor 0 and the attention factor applied here. */
struct ggml_tensor * dfl_rope_scaled(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                     struct ggml_tensor * pos, struct ggml_tensor * factors, int n_rot, float base);
/* The same in another of ggml's rotation modes (GGML_ROPE_TYPE_NORMAL: adjacent pairs, Llama's GGUF layout). */
struct ggml_tensor * dfl_rope_scaled_mode(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                          struct ggml_tensor * pos, struct ggml_tensor * factors, int n_rot, float base,
                                          int mode);
/* dfl_rope_scaled_mode with the YaRN factors built here when the ramp is exact (for a
 * graph that rotates few tensors: each call builds its own). */
struct ggml_tensor * dfl_rope_ramped(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                     struct ggml_tensor * pos, int n_rot, float base, int mode);
/* [n_rot / 2] f32: 1 / (1 - ramp_i (1 - 1/factor)) for each rotary pair i, the ramp over
 * YaRN's correction range unrounded (transformers' YaRN with truncate false). */
struct ggml_tensor * dfl_yarn_factors(struct ggml_context * ctx, const dfl_rope_scaling * r, int n_rot, float base);
struct ggml_tensor * dfl_rms_norm(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * w, float eps);
/* x / sqrt(sum(x^2) + eps) per row */
struct ggml_tensor * dfl_l2_norm(struct ggml_context * ctx, struct ggml_tensor * x, float eps);
/* GELU, tanh form, in f32 (ggml_gelu reads an f16-indexed table on the CPU: ~1e-3 off) */
struct ggml_tensor * dfl_gelu_tanh(struct ggml_context * ctx, struct ggml_tensor * x);
/* down(silu(gate x) * up x) */
struct ggml_tensor * dfl_ffn_swiglu(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * gate,
                                    struct ggml_tensor * up, struct ggml_tensor * down);

/* Routed experts: softmax over the router's logits, the n_used best experts per row with
 * their probabilities renormalised to sum to 1 (then times expert_scale of the expert
 * when given), each a gated FFN (SiLU, GELU-tanh when gelu, or gpt-oss's clamped SwiGLU
 * when swiglu_limit > 0). gate_up (when not NULL) holds gate and up fused [n_embd,
 * 2 n_ff, n_expert]; else gate and up apart. Per-expert biases are added to each
 * projection when given. */
typedef struct dfl_moe_weights {
    struct ggml_tensor * router;  /* [n_embd, n_expert] */
    struct ggml_tensor * router_b; /* [n_expert] or NULL: added to the router's logits (dfl_moe_ffn) */
    struct ggml_tensor * gate, * up, * gate_up, * down;
    struct ggml_tensor * gate_b, * up_b, * down_b; /* [n_ff, n_expert], [n_embd, n_expert] or NULL */
    struct ggml_tensor * expert_scale; /* [n_expert] or NULL */
    int n_expert, n_used;
    bool gelu;
    /* > 0: min(gate, limit) * sigmoid(alpha min(gate, limit)) * (clamp(up, -limit, limit) + 1) */
    float swiglu_limit, swiglu_alpha;
} dfl_moe_weights;
struct ggml_tensor * dfl_moe_ffn(struct ggml_context * ctx, struct ggml_tensor * x, const dfl_moe_weights * w);
/* The same with the router's logits [n_expert, n] computed by the caller (from another input). */
struct ggml_tensor * dfl_moe_ffn_routed(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * logits,
                                        const dfl_moe_weights * w);

/* ---- loader helpers ----------------------------------------------------------------- */

/* A required u32 key ("." prefix: the architecture's) in 1..2^30. */
dfl_status dfl_model_key(const dfl_model * m, const char * key, int * out);
/* An optional u32 key with a default. */
dfl_status dfl_model_key_or(const dfl_model * m, const char * key, int def, int * out);
/* Tensor "blk.<il>.<name>" (il < 0: "<name>") of shape [ne0, ne1, ne2]: trailing zeros
 * end the shape (ne1 = 0: a vector), every dimension after it must be 1. */
dfl_status dfl_model_tensor(const dfl_model * m, const char * name, int il, int64_t ne0, int64_t ne1, int64_t ne2,
                            bool required, struct ggml_tensor ** out);
/* Attention hyperparameters that a model with one head layout for every layer reads. */
typedef struct dfl_attention_keys {
    int n_head, n_head_kv, head_dim, n_rot;
} dfl_attention_keys;
/* embedding_length and block_count (at most DFL_MAX_LAYERS) into m->n_embd and m->n_layer. */
dfl_status dfl_model_block_keys(dfl_model * m);
/* dfl_model_block_keys, then feed_forward_length into *n_ff (NULL: not read), the head
 * counts, context_length into m->n_ctx_train, key and value lengths (n_embd / n_head by
 * default) and the rope dimension count (the head size by default); refuses a shape the
 * runtime cannot run (value heads unlike key heads, kv heads not dividing the heads, an
 * odd or oversized rope dimension count). */
dfl_status dfl_model_attention_keys(dfl_model * m, int * n_ff, dfl_attention_keys * out);
/* token_embd, output_norm and output (tied when absent); sets n_vocab. */
dfl_status dfl_model_load_io(dfl_model * m);
/* Which layers are recurrent: the attention.recurrent_layers array, or else every
 * layer but each full_attention_interval-th. */
dfl_status dfl_model_hybrid_layout(dfl_model * m);

#endif
