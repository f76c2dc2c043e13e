/* DFlash block-diffusion drafter: a few Qwen3-style layers whose keys and values
 * come from the target's hidden features (context) and from a block of
 * [bonus, MASK...] embeddings (noise), attended non-causally. */
#include "dfl_gguf.h"
#include "dfl_model.h"
#include "dfl_pair.h"
#include "dfl_plan.h"
#include "dfl_runtime.h"
#include "dfl_sampler.h"
#include "dfl_target.h"
#include "dfl_token_source.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)
#define DRAFT_KV_PAD 256
#define DRAFT_MAX_LAYERS 64

typedef struct draft_layer {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
    /* DFlash2: grouped dynamic causal convolutions around attention and FFN */
    struct ggml_tensor * attn_conv_base, * attn_conv_proj, * ffn_conv_base, * ffn_conv_proj;
} draft_layer;

typedef struct append_inputs {
    struct ggml_tensor * rows;
    struct ggml_tensor * pos;
    struct ggml_tensor * slots;
} append_inputs;

/* One sequence's part of a propose: its context rows appended first (padded to the
 * block size; the rows past the real ones write to its scratch cache row), its block,
 * and its attention span. */
typedef struct propose_part {
    int seq, n_rows, n_block, n_kv;
} propose_part;

/* The propose graph of the last call, reused while its shape holds: its parts and how
 * its drafts are chosen. */
typedef struct propose_graph {
    bool valid;
    int n_parts;
    propose_part part[DFL_MAX_SEQ];
    dfl_sampler_key samp;
    struct ggml_cgraph * gf;
    append_inputs app;
    struct ggml_tensor * tokens, * pos, * slots;
    struct ggml_tensor * mask[DFL_MAX_SEQ];
    struct ggml_tensor * mask_swa[DFL_MAX_SEQ]; /* the sliding layers' masks, when there are any */
    struct ggml_tensor * out_idx;               /* the drafted rows, when the parts are several */
    struct ggml_tensor * logits, * argmax;
    /* with top_k >= 1: the softmax of the logits and the log-probabilities of the
     * argmax, [1, 1, rows], which a chain cut by confidence reads on nearly every step */
    struct ggml_tensor * probs, * argmax_lp;
    /* drafts drawn by the sampling (temperature > 0): they fill the block instead of the argmax */
    dfl_sampler_graph sampled;
} propose_graph;

/* The top_k candidates of the last propose (top_k > 1), in a graph of their own (slot 1)
 * over the propose graph's logits and softmax, run when they are first read: a chain
 * step reads only the top choices (or nothing), and the top-K over the vocabulary is
 * a few percent of its propose. */
typedef struct rank_graph {
    bool valid; /* built over the current propose graph's logits */
    bool fresh; /* run since the last propose */
    struct ggml_cgraph * gf;
    struct ggml_tensor * topk;    /* [top_k, rows] token ids, unordered */
    struct ggml_tensor * topk_lp; /* [1, top_k, rows] their log-probabilities */
} rank_graph;

struct dfl_draft {
    dfl_gguf file;
    dfl_target * target;
    dfl_draft_params p;
    dfl_runtime rt;

    int n_embd, n_layer, n_ff, n_head, n_head_kv, head_dim, n_rot, block_size, mask_id;
    int n_feat, target_layers[16];
    float eps, rope_base, embd_scale, logit_scale, softcap;
    dfl_rope_scaling rope_scaling;
    /* sliding layers attend within swa_window positions; `causal` (-1: not set) makes every
     * layer causal inside the block or none; unset, sliding layers are and full ones are
     * not (z-lab's reference drafter) */
    int swa_window, causal;
    bool swa[DRAFT_MAX_LAYERS];
    /* DFlash2 (conv_k > 0): convolution kernel and group sizes, candidate selector */
    int conv_k, conv_group, sel_rank, sel_top_k;
    struct ggml_tensor * sel_pred, * sel_succ, * sel_hidden;

    struct ggml_tensor * fc, * hidden_norm, * out_norm, * tok_embd, * output;
    draft_layer layers[DRAFT_MAX_LAYERS];

    /* the context caches of every sequence (its slot: the target's), position p of slot s
     * in row s * (ring + 1) + p % ring; row s * (ring + 1) + ring takes padding rows.
     * ring: n_ctx, or with a window W only W + block_size: the window and the block */
    struct ggml_context * ctx_state;
    ggml_backend_buffer_t buf_state;
    struct ggml_tensor * k_cache[DRAFT_MAX_LAYERS];
    struct ggml_tensor * v_cache[DRAFT_MAX_LAYERS];
    /* [block_size] each sequence's last block, bonus first, and its tokens (0: none since
     * its context changed), left for the target's verify */
    dfl_token_source blocks;
    int n_seq;
    int n_ctx;      /* context positions a sequence can hold: the target's */
    int ring;
    int n_tokens[DFL_MAX_SEQ]; /* context positions each sequence filled */

    int n_out; /* drafted rows of the last propose */

    dfl_sampler sampler[DFL_MAX_SEQ]; /* how each sequence's drafts are chosen: the argmax, or drawn */
    propose_graph graph;
    rank_graph rank;
    int n_step_nodes; /* the last propose's nodes, and its rank graph's once that ran */
    int64_t n_graphs, n_graph_builds;

    int32_t * host_i32;
    int64_t * host_i64;
    ggml_fp16_t * host_mask;
    size_t host_rows, host_mask_size;
};

DFL_API void dfl_draft_default_params(dfl_draft_params * p) {
    memset(p, 0, sizeof *p);
    p->kv_type = -1;
}

static dfl_status read_u32(const dfl_gguf * g, const char * key, bool required, uint32_t def, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(g, key, required, def, &v));
    if (v > (1u << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", g->path, g->arch, key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

static dfl_status layer_tensor(dfl_draft * d, const char * name, int il, int64_t ne0, int64_t ne1,
                               struct ggml_tensor ** out) {
    char full[128];
    snprintf(full, sizeof full, "blk.%d.%s", il, name);
    const int64_t ne[2] = { ne0, ne1 };
    return dfl_gguf_tensor(&d->file, full, ne1 > 0 ? 2 : 1, ne, true, out);
}

/* DFlash2's convolutions (per layer: base kernels [E, K, 2], kernel projection to
 * 2 x K x groups) and its candidate selector (codebooks [rank, vocab], hidden
 * projection [E, rank]); nothing for a DFlash (v1) drafter. */
static dfl_status read_dflash2(dfl_draft * d) {
    const dfl_gguf * g = &d->file;
    if (!dfl_gguf_has(g, ".conv_kernel_size")) {
        if (ggml_get_tensor(g->ctx, "selector_hidden.weight")) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' has DFlash2 selector tensors but no dflash.conv_kernel_size", g->path);
        }
        return DFL_OK;
    }
    uint32_t v;
    TRY(dfl_gguf_u32(g, ".conv_kernel_size", true, 0, &v));
    d->conv_k = (int) v;
    TRY(dfl_gguf_u32(g, ".conv_group_size", true, 0, &v));
    d->conv_group = (int) v;
    TRY(dfl_gguf_u32(g, ".selector_rank", true, 0, &v));
    d->sel_rank = (int) v;
    TRY(dfl_gguf_u32(g, ".selector_top_k", true, 0, &v));
    d->sel_top_k = (int) v;
    const int64_t E = d->n_embd, V = dfl_target_n_vocab(d->target);
    if (d->conv_k < 1 || d->conv_k > d->block_size || d->conv_group < 1 || E % d->conv_group != 0 ||
        d->sel_rank < 1 || d->sel_rank > 65536 || d->sel_top_k < 1 || d->sel_top_k > 64 || d->sel_top_k > V) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid DFlash2 settings (kernel %d, group %d, selector rank %d, top-k %d)",
                        g->path, d->conv_k, d->conv_group, d->sel_rank, d->sel_top_k);
    }
    const int64_t proj = 2 * (int64_t) d->conv_k * (E / d->conv_group);
    for (int il = 0; il < d->n_layer; il++) {
        draft_layer * L = &d->layers[il];
        char name[96];
        const int64_t base[3] = { E, d->conv_k, 2 };
        snprintf(name, sizeof name, "blk.%d.attn_conv_base", il);
        TRY(dfl_gguf_tensor(g, name, 3, base, true, &L->attn_conv_base));
        snprintf(name, sizeof name, "blk.%d.ffn_conv_base", il);
        TRY(dfl_gguf_tensor(g, name, 3, base, true, &L->ffn_conv_base));
        TRY(layer_tensor(d, "attn_conv_proj.weight", il, E, proj, &L->attn_conv_proj));
        TRY(layer_tensor(d, "ffn_conv_proj.weight", il, E, proj, &L->ffn_conv_proj));
        if (L->attn_conv_base->type != GGML_TYPE_F32 || L->ffn_conv_base->type != GGML_TYPE_F32) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d convolution base kernels must be f32", g->path, il);
        }
    }
    TRY(dfl_gguf_tensor(g, "selector_predecessor.weight", 2, (int64_t[]) { d->sel_rank, V }, true, &d->sel_pred));
    TRY(dfl_gguf_tensor(g, "selector_successor.weight", 2, (int64_t[]) { d->sel_rank, V }, true, &d->sel_succ));
    TRY(dfl_gguf_tensor(g, "selector_hidden.weight", 2, (int64_t[]) { E, d->sel_rank }, true, &d->sel_hidden));
    return DFL_OK;
}

/* Sliding layers (window and per-layer pattern) and the causal flag. */
static dfl_status read_attention_pattern(dfl_draft * d) {
    const dfl_gguf * g = &d->file;
    TRY(read_u32(g, ".attention.sliding_window", false, 0, &d->swa_window));
    if (d->swa_window > 0) {
        TRY(dfl_gguf_arr_bool(g, ".attention.sliding_window_pattern", d->swa, d->n_layer));
    }
    d->causal = -1;
    char key[96];
    snprintf(key, sizeof key, "%s.attention.causal", g->arch);
    const int64_t id = gguf_find_key(g->meta, key);
    if (id >= 0) {
        if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_BOOL) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a boolean", g->path, key);
        }
        d->causal = gguf_get_val_bool(g->meta, id) ? 1 : 0;
    }
    return DFL_OK;
}

static dfl_status read_model(dfl_draft * d) {
    const dfl_gguf * g = &d->file;
    const dfl_target * t = d->target;
    const int n_vocab = dfl_target_n_vocab(t), n_layer = dfl_target_n_layer(t);

    if (strcmp(g->arch, "dflash") != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%s'; a drafter must be 'dflash'", g->path, g->arch);
    }
    /* variants whose arithmetic this runtime does not implement: refuse rather than
     * draft with the wrong model */
    const char * unsupported[] = { ".attention.value_scale" };
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        if (dfl_gguf_has(g, unsupported[i])) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' sets %s%s, a drafter variant this version does not run", g->path,
                            g->arch, unsupported[i]);
        }
    }
    TRY(read_u32(g, ".embedding_length", true, 0, &d->n_embd));
    TRY(read_u32(g, ".block_count", true, 0, &d->n_layer));
    TRY(read_u32(g, ".feed_forward_length", true, 0, &d->n_ff));
    TRY(read_u32(g, ".attention.head_count", true, 0, &d->n_head));
    TRY(read_u32(g, ".attention.head_count_kv", true, 0, &d->n_head_kv));
    if (d->n_head <= 0 || d->n_head_kv <= 0 || d->n_head % d->n_head_kv != 0 || d->n_layer <= 0 ||
        d->n_layer > DRAFT_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported drafter shape (%d layers, %d heads, %d kv heads)", g->path,
                        d->n_layer, d->n_head, d->n_head_kv);
    }
    TRY(read_u32(g, ".attention.key_length", false, (uint32_t) (d->n_embd / d->n_head), &d->head_dim));
    TRY(read_u32(g, ".rope.dimension_count", false, (uint32_t) d->head_dim, &d->n_rot));
    TRY(read_u32(g, ".block_size", false, 16, &d->block_size));
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", true, 0.0f, &d->eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &d->rope_base));
    {
        uint32_t n_ctx_train;
        const char * type;
        TRY(dfl_gguf_u32(g, ".context_length", false, 0, &n_ctx_train));
        TRY(dfl_rope_scaling_read(g, (int) n_ctx_train, -1, 0.0f, 0, &d->rope_scaling, &type));
    }
    TRY(dfl_gguf_f32(g, ".embedding_scale", false, 1.0f, &d->embd_scale));
    TRY(dfl_gguf_f32(g, ".logit_scale", false, 1.0f, &d->logit_scale));
    TRY(dfl_gguf_f32(g, ".final_logit_softcapping", false, 0.0f, &d->softcap));
    TRY(read_u32(g, "tokenizer.ggml.mask_token_id", true, 0, &d->mask_id));
    TRY(read_attention_pattern(d));
    TRY(dfl_gguf_arr_i32(g, ".target_layers", d->target_layers, 16, &d->n_feat));
    if (d->block_size < 2 || d->n_rot > d->head_dim || d->n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid block size %d or rope dimensions %d", g->path, d->block_size,
                        d->n_rot);
    }

    TRY(dfl_pair_check(g, dfl_target_file(t), n_vocab, dfl_target_n_embd(t)));
    /* the drafter must fit its target */
    if (d->n_embd != dfl_target_n_embd(t)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter hidden size %d does not match the target's %d: wrong target/drafter pair",
                        d->n_embd, dfl_target_n_embd(t));
    }
    if (d->mask_id < 0 || d->mask_id >= n_vocab) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter mask token %d is outside the target vocabulary (%d)", d->mask_id,
                        n_vocab);
    }
    int32_t captured[16];
    bool same = dfl_target_feature_layers(t, captured, 16) == d->n_feat;
    for (int i = 0; same && i < d->n_feat; i++) {
        same = captured[i] == d->target_layers[i];
    }
    if (!same) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the target captures different feature layers than the drafter reads "
                        "(load the target with feature_layers = the drafter's dflash.target_layers)");
    }
    for (int i = 0; i < d->n_feat; i++) {
        if (d->target_layers[i] < 1 || d->target_layers[i] > n_layer) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter reads target layer %d, but the target has %d layers",
                            d->target_layers[i], n_layer);
        }
    }

    const int64_t E = d->n_embd, q_dim = (int64_t) d->head_dim * d->n_head, kv_dim = (int64_t) d->head_dim * d->n_head_kv;
    TRY(dfl_gguf_tensor(g, "fc.weight", 2, (int64_t[]) { E * d->n_feat, E }, true, &d->fc));
    TRY(dfl_gguf_tensor(g, "enc.output_norm.weight", 1, (int64_t[]) { E }, true, &d->hidden_norm));
    TRY(dfl_gguf_tensor(g, "output_norm.weight", 1, (int64_t[]) { E }, true, &d->out_norm));
    TRY(dfl_gguf_tensor(g, "token_embd.weight", 2, (int64_t[]) { E, n_vocab }, false, &d->tok_embd));
    TRY(dfl_gguf_tensor(g, "output.weight", 2, (int64_t[]) { E, n_vocab }, false, &d->output));
    if (!d->output) {
        d->output = d->tok_embd ? d->tok_embd : dfl_target_lm_head(t);
    }
    if (!d->tok_embd) {
        d->tok_embd = dfl_target_tok_embd(t);
    }
    for (int il = 0; il < d->n_layer; il++) {
        draft_layer * L = &d->layers[il];
        char name[96];
        snprintf(name, sizeof name, "blk.%d.post_attention_norm.weight", il);
        if (ggml_get_tensor(g->ctx, name)) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' uses post-attention norms, a drafter variant this version does not run",
                            g->path);
        }
        TRY(layer_tensor(d, "attn_norm.weight", il, E, 0, &L->attn_norm));
        TRY(layer_tensor(d, "attn_q.weight", il, E, q_dim, &L->wq));
        TRY(layer_tensor(d, "attn_k.weight", il, E, kv_dim, &L->wk));
        TRY(layer_tensor(d, "attn_v.weight", il, E, kv_dim, &L->wv));
        TRY(layer_tensor(d, "attn_output.weight", il, q_dim, E, &L->wo));
        TRY(layer_tensor(d, "attn_q_norm.weight", il, d->head_dim, 0, &L->q_norm));
        TRY(layer_tensor(d, "attn_k_norm.weight", il, d->head_dim, 0, &L->k_norm));
        TRY(layer_tensor(d, "ffn_norm.weight", il, E, 0, &L->ffn_norm));
        TRY(layer_tensor(d, "ffn_gate.weight", il, E, d->n_ff, &L->ffn_gate));
        TRY(layer_tensor(d, "ffn_up.weight", il, E, d->n_ff, &L->ffn_up));
        TRY(layer_tensor(d, "ffn_down.weight", il, d->n_ff, E, &L->ffn_down));
    }
    return read_dflash2(d);
}

static dfl_status define_state(dfl_draft * d) {
    d->ring = d->p.window > 0 && d->p.window + d->block_size < d->n_ctx ? d->p.window + d->block_size : d->n_ctx;
    struct ggml_init_params ip = { (size_t) (2 * d->n_layer + d->n_seq + 1) * ggml_tensor_overhead(), NULL, true };
    d->ctx_state = ggml_init(ip);
    if (!d->ctx_state) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot create the drafter state context");
    }
    const int64_t kv_dim = (int64_t) d->head_dim * d->n_head_kv, rows = (int64_t) (d->ring + 1) * d->n_seq;
    for (int il = 0; il < d->n_layer; il++) {
        d->k_cache[il] = ggml_new_tensor_2d(d->ctx_state, (enum ggml_type) d->p.kv_type, kv_dim, rows);
        d->v_cache[il] = ggml_new_tensor_2d(d->ctx_state, (enum ggml_type) d->p.kv_type, kv_dim, rows);
    }
    for (int s = 0; s < d->n_seq; s++) {
        d->blocks.tokens[s] = ggml_new_tensor_1d(d->ctx_state, GGML_TYPE_I32, d->block_size);
    }
    return DFL_OK;
}

static dfl_status alloc_state(dfl_draft * d) {
    TRY(define_state(d));
    d->buf_state = ggml_backend_alloc_ctx_tensors_from_buft(d->ctx_state, ggml_backend_get_default_buffer_type(d->rt.backend));
    if (!d->buf_state) {
        return dfl_fail(DFL_ERR_BACKEND, "out of device memory for the drafter context");
    }
    ggml_backend_buffer_clear(d->buf_state, 0);
    return DFL_OK;
}

/* Everything before the weights: the drafter's description checked against its
 * target, and its device. */
static dfl_status open_draft(const char * path, dfl_target * target, const dfl_draft_params * params, dfl_draft ** out) {
    *out = NULL;
    if (!path || !target) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a drafter needs a path and a loaded target");
    }
    dfl_draft * d = calloc(1, sizeof *d);
    if (!d) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        dfl_sampler_init(&d->sampler[s]);
    }
    d->target = target;
    d->blocks.target = target;
    if (params) {
        d->p = *params;
    } else {
        dfl_draft_default_params(&d->p);
    }
    d->n_ctx = dfl_target_n_ctx(target);
    d->n_seq = dfl_target_n_seq(target);
    if (d->p.kv_type < 0) {
        /* ggml's CPU flash attention converts every f16 key and value it reads: with the
         * drafter's small cache, f32 is the faster choice there; devices keep f16 */
        d->p.kv_type = dfl_target_on_cpu(target) ? GGML_TYPE_F32 : GGML_TYPE_F16;
    }
    dfl_status st = DFL_OK;
    if (d->p.top_k < 0 || d->p.top_k > 64 || d->p.top_k > dfl_target_n_vocab(target)) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "drafter top_k %d is outside 0..64", d->p.top_k);
    } else if (d->p.kv_type != GGML_TYPE_F32 && d->p.kv_type != GGML_TYPE_F16 && d->p.kv_type != GGML_TYPE_BF16) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "drafter cache type %d is not supported (f32, f16, bf16)", d->p.kv_type);
    }
    if (st == DFL_OK) {
        st = dfl_gguf_open(path, &d->file);
        if (st != DFL_OK) {
            free(d);
            return st;
        }
    }
    if (st == DFL_OK) st = read_model(d);
    /* every further sequence in a propose adds its attention per layer, and a DFlash2
     * drafter its convolutions and selector */
    const size_t graph_size = DFL_GRAPH_SIZE + (size_t) d->n_layer * DFL_GRAPH_NODES_PER_LAYER +
                              (size_t) (d->n_seq - 1) * ((size_t) d->n_layer * DFL_GRAPH_NODES_PER_SEQ +
                                                         (size_t) 16 * d->block_size);
    if (st == DFL_OK) st = dfl_runtime_init(&d->rt, ggml_backend_dev_name(dfl_target_device(target)),
                                            d->p.n_threads > 0 ? d->p.n_threads : dfl_target_n_threads(target), "drafter",
                                            graph_size, d->p.top_k > 1 ? 2 : 1);
    if (st != DFL_OK) {
        dfl_draft_free(d);
        return st;
    }
    *out = d;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_load(const char * path, dfl_target * target, const dfl_draft_params * params,
                                  dfl_draft ** out) {
    dfl_draft * d;
    TRY(open_draft(path, target, params, &d));
    *out = NULL;
    dfl_status st = dfl_gguf_load_weights_on(&d->file, d->rt.dev, dfl_target_repack(d->target));
    if (st == DFL_OK) st = alloc_state(d);
    if (st != DFL_OK) {
        dfl_draft_free(d);
        return st;
    }
    *out = d;
    return DFL_OK;
}

DFL_API void dfl_draft_free(dfl_draft * d) {
    if (!d) {
        return;
    }
    if (d->buf_state) ggml_backend_buffer_free(d->buf_state);
    if (d->ctx_state) ggml_free(d->ctx_state);
    dfl_runtime_free(&d->rt);
    dfl_gguf_close(&d->file);
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        dfl_sampler_free(&d->sampler[s]);
    }
    free(d->host_i32);
    free(d->host_i64);
    free(d->host_mask);
    free(d);
}

DFL_API dfl_status dfl_draft_get_info(const dfl_draft * d, dfl_draft_info * info) {
    if (!d || !info) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    memset(info, 0, sizeof *info);
    info->block_size = d->block_size;
    info->mask_token_id = d->mask_id;
    info->n_layer = d->n_layer;
    info->n_embd = d->n_embd;
    info->n_target_layers = d->n_feat;
    memcpy(info->target_layers, d->target_layers, sizeof d->target_layers);
    info->n_ctx_tokens = d->n_tokens[0];
    info->n_graphs = d->n_graphs;
    info->n_graph_builds = d->n_graph_builds;
    info->compute_bytes = dfl_runtime_compute_bytes(&d->rt);
    info->n_last_nodes = d->n_step_nodes;
    info->n_host_writes = d->rt.traffic->writes;
    info->n_host_reads = d->rt.traffic->reads;
    info->n_host_write_bytes = d->rt.traffic->write_bytes;
    info->n_host_read_bytes = d->rt.traffic->read_bytes;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_last_placement(const dfl_draft * d, dfl_placement * out) {
    if (!d || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    return dfl_runtime_placement(&d->rt, out);
}

static dfl_status check_seq(const dfl_draft * d, int32_t seq) {
    if (!d) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    if (seq < 0 || seq >= d->n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d is outside 0..%d (the target has %d sequence slots)", seq,
                        d->n_seq - 1, d->n_seq);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_reset(dfl_draft * d) {
    if (!d) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    for (int s = 0; s < d->n_seq; s++) {
        d->n_tokens[s] = 0;
        d->blocks.n[s] = 0;
    }
    d->n_out = 0;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_seq_reset(dfl_draft * d, int32_t seq) {
    TRY(check_seq(d, seq));
    d->n_tokens[seq] = 0;
    d->blocks.n[seq] = 0;
    return DFL_OK;
}

DFL_API int32_t dfl_draft_n_past(const dfl_draft * d, int32_t seq) {
    return d && seq >= 0 && seq < d->n_seq ? d->n_tokens[seq] : -1;
}

/* ---- checkpoints (dfl_checkpoint.c) ----------------------------------------------- */

int dfl_draft_n_tokens(const dfl_draft * d, int seq) { return d->n_tokens[seq]; }

int dfl_draft_first_visible(const dfl_draft * d, int seq) {
    return d->p.window > 0 && d->n_tokens[seq] > d->p.window ? d->n_tokens[seq] - d->p.window : 0;
}

int dfl_draft_n_layers(const dfl_draft * d) { return d->n_layer; }

struct ggml_tensor * dfl_draft_cache(const dfl_draft * d, int il, int v) { return v ? d->v_cache[il] : d->k_cache[il]; }

int dfl_draft_ring(const dfl_draft * d) { return d->ring; }

int64_t dfl_draft_cache_base(const dfl_draft * d, int seq) { return (int64_t) seq * (d->ring + 1); }

void dfl_draft_set_n_tokens(dfl_draft * d, int seq, int n) {
    d->n_tokens[seq] = n;
    d->blocks.n[seq] = 0;
    d->n_out = 0;
}

static dfl_status reserve(dfl_draft * d, int n, size_t mask) {
    if ((size_t) n > d->host_rows) {
        free(d->host_i32);
        free(d->host_i64);
        d->host_i32 = malloc((size_t) n * sizeof(int32_t));
        d->host_i64 = malloc((size_t) n * sizeof(int64_t));
        d->host_rows = (size_t) n;
    }
    if (mask > d->host_mask_size) {
        free(d->host_mask);
        d->host_mask_size = mask;
        d->host_mask = malloc(d->host_mask_size * sizeof(ggml_fp16_t));
    }
    if (!d->host_i32 || !d->host_i64 || !d->host_mask) {
        d->host_rows = d->host_mask_size = 0;
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

static struct ggml_tensor * norm(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * w) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, d->eps), w);
}

static struct ggml_tensor * rope(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * pos) {
    const dfl_rope_scaling * r = &d->rope_scaling;
    struct ggml_tensor * factors = r->exact_ramp ? dfl_yarn_factors(ctx, r, d->n_rot, d->rope_base) : NULL;
    return dfl_rope_scaled(r, ctx, x, pos, factors, d->n_rot, d->rope_base);
}

/* Project hidden states h [E, n] to this layer's keys/values and store them at `slots`. */
static void store_kv(dfl_draft * d, struct ggml_context * ctx, struct ggml_cgraph * gf, int il, struct ggml_tensor * h,
                     struct ggml_tensor * pos, struct ggml_tensor * slots, int n, struct ggml_tensor ** kc,
                     struct ggml_tensor ** vc) {
    const draft_layer * L = &d->layers[il];
    struct ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, h), d->head_dim, d->n_head_kv, n);
    k = rope(d, ctx, norm(d, ctx, k, L->k_norm), pos);
    struct ggml_tensor * v = ggml_mul_mat(ctx, L->wv, h);
    const int64_t kv_dim = (int64_t) d->head_dim * d->n_head_kv;
    *kc = ggml_set_rows(ctx, d->k_cache[il], ggml_reshape_2d(ctx, k, kv_dim, n), slots);
    *vc = ggml_set_rows(ctx, d->v_cache[il], v, slots);
    ggml_build_forward_expand(gf, *kc);
    ggml_build_forward_expand(gf, *vc);
}

/* Positions p0.. of sequence seq and their cache rows, for n rows from host row `at`. */
static void stage_positions(dfl_draft * d, int seq, int p0, int n, int at) {
    const int64_t base = dfl_draft_cache_base(d, seq);
    for (int i = 0; i < n; i++) {
        d->host_i32[at + i] = p0 + i;
        d->host_i64[at + i] = base + (p0 + i) % d->ring;
    }
}

static dfl_status check_append(const dfl_draft * d, int seq, const int32_t * rows, int32_t n) {
    const dfl_target * t = d->target;
    for (int i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= dfl_target_feature_rows(t)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "feature row %d is not among the %d rows of the target's last call",
                            rows[i], dfl_target_feature_rows(t));
        }
    }
    if (d->n_tokens[seq] + n > d->n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "drafter context overflow: %d + %d > %d", d->n_tokens[seq], n, d->n_ctx);
    }
    return DFL_OK;
}

/* Context rows: the target's features of the given rows, projected once per layer to
 * keys and values stored at the next context positions. */
static void build_append(dfl_draft * d, struct ggml_context * ctx, struct ggml_cgraph * gf, int n, append_inputs * in) {
    in->rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    in->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    in->slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    ggml_set_input(in->rows);
    ggml_set_input(in->pos);
    ggml_set_input(in->slots);
    struct ggml_tensor * feat = ggml_get_rows(ctx, dfl_target_feature_tensor(d->target), in->rows);
    struct ggml_tensor * h = norm(d, ctx, ggml_mul_mat(ctx, d->fc, feat), d->hidden_norm);
    for (int il = 0; il < d->n_layer; il++) {
        struct ggml_tensor * kc, * vc;
        store_kv(d, ctx, gf, il, h, in->pos, in->slots, n, &kc, &vc);
    }
}

/* Sequence seq's rows[0..n) at its next context positions, in R host rows from `at`: rows
 * past n are padding (feature row 0) that write to the sequence's scratch cache row. So
 * do rows that a later row of the same call replaces in the ring: one scatter never
 * writes a row twice. */
static void stage_append(dfl_draft * d, int seq, const int32_t * rows, int n, int R, int at) {
    for (int i = 0; i < R; i++) {
        d->host_i32[at + i] = i < n ? rows[i] : 0;
    }
}

static void stage_append_slots(dfl_draft * d, int seq, int n, int R, int at) {
    stage_positions(d, seq, d->n_tokens[seq], R, at);
    for (int i = 0; i < R; i++) {
        if (i >= n || i < n - d->ring) {
            d->host_i64[at + i] = dfl_draft_cache_base(d, seq) + d->ring;
        }
    }
}

DFL_API dfl_status dfl_draft_append(dfl_draft * d, int32_t seq, const int32_t * rows, int32_t n) {
    TRY(check_seq(d, seq));
    if (!rows || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "append needs at least one feature row");
    }
    TRY(check_append(d, seq, rows, n));
    TRY(reserve(d, n, 1));
    d->graph.valid = d->rank.valid = false; /* its graph memory is about to be reused */
    d->n_graphs++;
    d->n_graph_builds++;
    struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 0);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
    append_inputs in;
    build_append(d, ctx, gf, n, &in);
    TRY(dfl_runtime_alloc(&d->rt, 0, gf));
    stage_append(d, seq, rows, n, n, 0);
    dfl_runtime_set(&d->rt, in.rows, d->host_i32, 0, (size_t) n * sizeof(int32_t));
    stage_append_slots(d, seq, n, n, 0);
    dfl_runtime_set(&d->rt, in.pos, d->host_i32, 0, (size_t) n * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in.slots, d->host_i64, 0, (size_t) n * sizeof(int64_t));
    TRY(dfl_runtime_compute(&d->rt, 0, gf));
    d->n_step_nodes = d->rt.n_last_nodes;
    d->n_tokens[seq] += n;
    d->blocks.n[seq] = 0;
    d->n_out = 0;
    return DFL_OK;
}

/* [1, K, rows]: the log of probs [V, rows] at ids [K, rows] */
static struct ggml_tensor * log_probs_at(struct ggml_context * ctx, struct ggml_tensor * probs, struct ggml_tensor * ids) {
    return ggml_log(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, probs->ne[0], probs->ne[1]), ids));
}

/* DFlash2's grouped dynamic causal convolution over a block's rows x [E, B]: row t
 * becomes sum over offsets o of (base[o] + dyn[t, o, group]) * x[t - o], zero before the
 * block's start. `dyn` is the kernel projection [groups, K, 2, B] of the layer's normed
 * input; `phase` 0 is applied before attention or FFN, 1 after. */
static struct ggml_tensor * dynamic_conv(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * x,
                                         struct ggml_tensor * dyn, struct ggml_tensor * base, int phase) {
    const int64_t E = d->n_embd, gs = d->conv_group, G = E / gs, K = d->conv_k, B = x->ne[1];
    const size_t f32 = sizeof(float);
    /* x (a norm's or a matmul's result) is contiguous: a cont would only copy it */
    struct ggml_tensor * x3 = ggml_reshape_3d(ctx, ggml_is_contiguous(x) ? x : ggml_cont(ctx, x), gs, G, B);
    struct ggml_tensor * out = NULL;
    for (int64_t o = 0; o < K && o < B; o++) {
        struct ggml_tensor * shifted = o == 0 ? x3 :
            ggml_pad_ext(ctx, ggml_view_3d(ctx, x3, gs, G, B - o, x3->nb[1], x3->nb[2], 0), 0, 0, 0, 0, (int) o, 0, 0, 0);
        struct ggml_tensor * b = ggml_reshape_3d(ctx, ggml_view_1d(ctx, base, E, (size_t) ((phase * K + o) * E) * f32),
                                                 gs, G, 1);
        struct ggml_tensor * k = ggml_cont(ctx, ggml_view_3d(ctx, dyn, 1, G, B, f32, dyn->nb[3],
                                                             (size_t) ((phase * K + o) * G) * f32));
        struct ggml_tensor * term = ggml_add(ctx, ggml_mul(ctx, shifted, b), ggml_mul(ctx, shifted, k));
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return ggml_reshape_2d(ctx, out, E, B);
}

static struct ggml_tensor * conv_kernels(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * proj,
                                         struct ggml_tensor * h) {
    const int64_t G = d->n_embd / d->conv_group;
    return ggml_reshape_4d(ctx, ggml_mul_mat(ctx, proj, h), G, d->conv_k, 2, h->ne[1]);
}

/* Rows [row0, row0 + n) of x [ne0, rows] (x itself when they are all of it). */
static struct ggml_tensor * rows_of(struct ggml_context * ctx, struct ggml_tensor * x, int64_t row0, int64_t n) {
    return row0 == 0 && n == x->ne[1] ? x : ggml_view_2d(ctx, x, x->ne[0], n, x->nb[1], (size_t) row0 * x->nb[1]);
}

static struct ggml_tensor * join(struct ggml_context * ctx, struct ggml_tensor * acc, struct ggml_tensor * x) {
    return acc ? ggml_concat(ctx, acc, x, 1) : x;
}

/* The grouped dynamic convolution of every part's block rows of x, each on its own. */
static struct ggml_tensor * dynamic_conv_parts(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * x,
                                               struct ggml_tensor * dyn, struct ggml_tensor * base, int phase) {
    const propose_graph * g = &d->graph;
    struct ggml_tensor * out = NULL;
    for (int i = 0, row0 = 0; i < g->n_parts; row0 += g->part[i].n_block, i++) {
        const int64_t B = g->part[i].n_block;
        struct ggml_tensor * k = g->n_parts == 1 ? dyn :
            ggml_view_4d(ctx, dyn, dyn->ne[0], dyn->ne[1], dyn->ne[2], B, dyn->nb[1], dyn->nb[2], dyn->nb[3],
                         (size_t) row0 * dyn->nb[3]);
        out = join(ctx, out, dynamic_conv(d, ctx, rows_of(ctx, x, row0, B), k, base, phase));
    }
    return out;
}

/* DFlash2's candidate selector, greedy: per drafted position the top sel_top_k tokens of
 * the logits, scored by their logit plus a low-rank bilinear term between the previous
 * chosen token (the bonus first) and the candidate, weighted by the projected hidden
 * state; the best of each position becomes the next position's predecessor. The chain
 * is P short steps in the graph; each chosen token goes to block[1 + p]. */
static void build_selector(dfl_draft * d, struct ggml_context * ctx, struct ggml_cgraph * gf,
                           struct ggml_tensor * logits, struct ggml_tensor * hidden, struct ggml_tensor * bonus,
                           struct ggml_tensor * block) {
    const int64_t V = logits->ne[0], P = logits->ne[1], Kc = d->sel_top_k, R = d->sel_rank;
    const size_t f32 = sizeof(float), i32 = sizeof(int32_t);
    struct ggml_tensor * cand = dfl_top_k(d->rt.top_k_by_sort, ctx, logits, (int) Kc);                /* [Kc, P] */
    struct ggml_tensor * unary = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, P), cand);      /* [1, Kc, P] */
    struct ggml_tensor * hp = ggml_mul_mat(ctx, d->sel_hidden, hidden);                               /* [R, P] */
    struct ggml_tensor * succ = ggml_get_rows(ctx, d->sel_succ, ggml_reshape_1d(ctx, cand, Kc * P)); /* [R, Kc P] */
    struct ggml_tensor * pred = bonus;
    for (int64_t p = 0; p < P; p++) {
        struct ggml_tensor * w = ggml_mul(ctx, ggml_get_rows(ctx, d->sel_pred, pred),
                                          ggml_view_2d(ctx, hp, R, 1, hp->nb[1], (size_t) p * hp->nb[1]));
        struct ggml_tensor * s = ggml_mul_mat(ctx, ggml_view_2d(ctx, succ, R, Kc, succ->nb[1], (size_t) (p * Kc) * succ->nb[1]), w);
        s = ggml_add(ctx, s, ggml_view_2d(ctx, unary, Kc, 1, Kc * f32, (size_t) (p * Kc) * f32));
        struct ggml_tensor * best = ggml_argmax(ctx, ggml_reshape_2d(ctx, s, Kc, 1));                  /* [1] */
        struct ggml_tensor * row = ggml_view_2d(ctx, cand, 1, Kc, i32, (size_t) (p * Kc) * i32);
        pred = ggml_reshape_1d(ctx, ggml_get_rows(ctx, ggml_cont(ctx, row), best), 1);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, pred, ggml_view_1d(ctx, block, 1, (size_t) (1 + p) * i32)));
    }
}

/* The propose graph of d->graph's parts: their context rows appended, then their blocks,
 * each attending to its own sequence's first n_kv cache rows. */
static void build_propose(dfl_draft * d, struct ggml_context * ctx) {
    propose_graph * g = &d->graph;
    struct ggml_cgraph * gf = g->gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
    int R = 0, B = 0, D = 0;
    for (int i = 0; i < g->n_parts; i++) {
        R += g->part[i].n_rows;
        B += g->part[i].n_block;
        D += g->part[i].n_block - 1;
    }
    build_append(d, ctx, gf, R, &g->app);
    struct ggml_tensor * tokens = g->tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
    struct ggml_tensor * pos = g->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, B);
    struct ggml_tensor * slots = g->slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, B);
    ggml_set_input(tokens);
    ggml_set_input(pos);
    ggml_set_input(slots);
    bool sliding = false;
    for (int il = 0; il < d->n_layer; il++) {
        sliding = sliding || (d->swa_window > 0 && d->swa[il]);
    }
    for (int i = 0; i < g->n_parts; i++) {
        g->mask[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g->part[i].n_kv, g->part[i].n_block);
        ggml_set_input(g->mask[i]);
        g->mask_swa[i] = NULL;
        if (sliding) {
            g->mask_swa[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, g->part[i].n_kv, g->part[i].n_block);
            ggml_set_input(g->mask_swa[i]);
        }
    }

    struct ggml_tensor * x = ggml_get_rows(ctx, d->tok_embd, tokens);
    if (d->embd_scale != 1.0f) {
        x = ggml_scale(ctx, x, d->embd_scale);
    }
    for (int il = 0; il < d->n_layer; il++) {
        const draft_layer * L = &d->layers[il];
        struct ggml_tensor * h = norm(d, ctx, x, L->attn_norm);
        struct ggml_tensor * kernels = NULL;
        if (d->conv_k > 0) {
            kernels = conv_kernels(d, ctx, L->attn_conv_proj, h);
            h = dynamic_conv_parts(d, ctx, h, kernels, L->attn_conv_base, 0);
        }
        struct ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wq, h), d->head_dim, d->n_head, B);
        q = rope(d, ctx, norm(d, ctx, q, L->q_norm), pos);
        /* the blocks' own keys/values sit after their contexts; the next append overwrites them */
        struct ggml_tensor * kc, * vc;
        store_kv(d, ctx, gf, il, h, pos, slots, B, &kc, &vc);
        struct ggml_tensor * o = NULL;
        for (int i = 0, row0 = 0; i < g->n_parts; row0 += g->part[i].n_block, i++) {
            const propose_part * part = &g->part[i];
            const size_t base = (size_t) dfl_draft_cache_base(d, part->seq) * kc->nb[1];
            struct ggml_tensor * K = ggml_view_3d(ctx, kc, d->head_dim, d->n_head_kv, part->n_kv,
                                                  ggml_row_size(kc->type, d->head_dim), kc->nb[1], base);
            struct ggml_tensor * V = ggml_view_3d(ctx, vc, d->head_dim, d->n_head_kv, part->n_kv,
                                                  ggml_row_size(vc->type, d->head_dim), vc->nb[1], base);
            struct ggml_tensor * qs = g->n_parts == 1 ? q :
                ggml_view_3d(ctx, q, q->ne[0], q->ne[1], part->n_block, q->nb[1], q->nb[2], (size_t) row0 * q->nb[2]);
            struct ggml_tensor * oi = ggml_flash_attn_ext(ctx, ggml_permute(ctx, qs, 0, 2, 1, 3),
                                                          ggml_permute(ctx, K, 0, 2, 1, 3),
                                                          ggml_permute(ctx, V, 0, 2, 1, 3),
                                                          d->swa_window > 0 && d->swa[il] ? g->mask_swa[i] : g->mask[i],
                                                          1.0f / sqrtf((float) d->head_dim), 0.0f, 0.0f);
            ggml_prec_set_acc(oi, GGML_PREC_F32);
            o = join(ctx, o, ggml_reshape_2d(ctx, oi, (int64_t) d->head_dim * d->n_head, part->n_block));
        }
        o = ggml_mul_mat(ctx, L->wo, o);
        if (kernels) {
            o = dynamic_conv_parts(d, ctx, o, kernels, L->attn_conv_base, 1);
        }
        x = ggml_add(ctx, o, x);
        h = norm(d, ctx, x, L->ffn_norm);
        if (kernels) {
            kernels = conv_kernels(d, ctx, L->ffn_conv_proj, h);
            h = dynamic_conv_parts(d, ctx, h, kernels, L->ffn_conv_base, 0);
        }
        h = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L->ffn_gate, h), ggml_mul_mat(ctx, L->ffn_up, h));
        h = ggml_mul_mat(ctx, L->ffn_down, h);
        if (kernels) {
            h = dynamic_conv_parts(d, ctx, h, kernels, L->ffn_conv_base, 1);
        }
        x = ggml_add(ctx, h, x);
    }
    /* block position 0 is the bonus token itself: only positions 1.. are drafts */
    g->out_idx = NULL;
    if (g->n_parts == 1) {
        x = ggml_view_2d(ctx, x, d->n_embd, B - 1, x->nb[1], x->nb[1]);
    } else {
        g->out_idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, D);
        ggml_set_input(g->out_idx);
        x = ggml_get_rows(ctx, x, g->out_idx);
    }
    x = norm(d, ctx, x, d->out_norm);
    const dfl_gguf * owner = d->output == dfl_target_lm_head(d->target) ? dfl_target_file(d->target) : &d->file;
    struct ggml_tensor * logits = dfl_gguf_mul_mat(owner, ctx, d->output, x);
    if (d->logit_scale != 1.0f) {
        logits = ggml_scale(ctx, logits, d->logit_scale);
    }
    if (d->softcap > 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / d->softcap)), d->softcap);
    }
    g->logits = logits;
    g->argmax = ggml_argmax(ctx, logits);
    ggml_set_output(g->logits);
    ggml_set_output(g->argmax);
    g->probs = g->argmax_lp = NULL;
    if (d->p.top_k > 0) {
        g->probs = ggml_soft_max(ctx, logits);
        g->argmax_lp = log_probs_at(ctx, g->probs, ggml_reshape_2d(ctx, g->argmax, 1, D));
        ggml_set_output(g->probs); /* the rank graph reads it */
        ggml_set_output(g->argmax_lp);
        ggml_build_forward_expand(gf, g->argmax_lp);
    }
    struct ggml_tensor * drafts = g->argmax;
    if (g->samp.pick != DFL_PICK_ARGMAX) {
        drafts = dfl_sampler_build(ctx, gf, logits, &g->samp, &g->sampled);
    } else {
        memset(&g->sampled, 0, sizeof g->sampled);
    }
    for (int i = 0, row0 = 0, brow0 = 0; i < g->n_parts; brow0 += g->part[i].n_block, row0 += g->part[i].n_block - 1, i++) {
        const int n = g->part[i].n_block - 1;
        struct ggml_tensor * block = d->blocks.tokens[g->part[i].seq];
        if (d->conv_k > 0) {
            /* the block holds the selector's path */
            build_selector(d, ctx, gf, rows_of(ctx, logits, row0, n), rows_of(ctx, x, row0, n),
                           ggml_view_1d(ctx, tokens, 1, (size_t) brow0 * sizeof(int32_t)), block);
        } else {
            struct ggml_tensor * part = ggml_view_1d(ctx, drafts, n, (size_t) row0 * sizeof(int32_t));
            ggml_build_forward_expand(gf, ggml_cpy(ctx, part, ggml_view_1d(ctx, block, n, sizeof(int32_t))));
        }
    }
}

/* The rank graph over `logits` and `probs` [V, rows], leaves of ctx that hold (or stand
 * for) the propose graph's: only top_k numbers per position cross to the host, never
 * the vocabulary. */
static void build_rank(dfl_draft * d, struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * probs) {
    rank_graph * r = &d->rank;
    r->gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
    r->topk = dfl_top_k(d->rt.top_k_by_sort, ctx, logits, d->p.top_k);
    r->topk_lp = log_probs_at(ctx, probs, r->topk);
    ggml_set_output(r->topk);
    ggml_set_output(r->topk_lp);
    ggml_build_forward_expand(r->gf, r->topk_lp);
}

/* A leaf of ctx over a [V, rows] result of the propose graph, where that graph left it */
static struct ggml_tensor * in_place(struct ggml_context * ctx, const struct ggml_tensor * x) {
    struct ggml_tensor * in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1]);
    return ggml_backend_tensor_alloc(x->buffer, in, x->data) == GGML_STATUS_SUCCESS ? in : NULL;
}

/* The last propose's candidates on the device, ranked once per propose: the rank graph
 * reads the propose graph's logits and softmax where that graph left them (slot 0 keeps
 * its memory until the next propose or append). */
static dfl_status rank_last_propose(dfl_draft * d) {
    rank_graph * r = &d->rank;
    if (r->fresh) {
        return DFL_OK;
    }
    if (!r->valid) {
        struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 1);
        struct ggml_tensor * logits = in_place(ctx, d->graph.logits), * probs = in_place(ctx, d->graph.probs);
        if (!logits || !probs) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot read the drafter's logits in place");
        }
        build_rank(d, ctx, logits, probs);
        d->n_graph_builds++;
        TRY(dfl_runtime_alloc(&d->rt, 1, r->gf));
        r->valid = true;
    }
    d->n_graphs++;
    TRY(dfl_runtime_compute(&d->rt, 1, r->gf));
    d->n_step_nodes += d->rt.n_last_nodes;
    r->fresh = true;
    return DFL_OK;
}

/* A block's mask over n_kv cache rows of its sequence: row j holds the latest position
 * below p + B that maps to it, visible when that position is in the drafter's context
 * window (an older or stale one is out of it by construction); causal: not after the
 * row's position; window: fewer than `window` positions from it. */
static void fill_mask(dfl_draft * d, struct ggml_tensor * dst, int p, int B, int n_kv, bool causal, int window) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), minf = ggml_fp32_to_fp16(-INFINITY);
    const int first = d->p.window > 0 && p > d->p.window ? p - d->p.window : 0, end = p + B;
    for (int i = 0; i < B; i++) {
        const int q = p + i;
        for (int j = 0; j < n_kv; j++) {
            const int pos = j < end ? j + d->ring * ((end - 1 - j) / d->ring) : -1;
            bool visible = pos >= first;
            visible = visible && (!causal || pos <= q);
            visible = visible && (window <= 0 || (q - pos < window && (causal || pos - q < window)));
            d->host_mask[(size_t) i * n_kv + j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&d->rt, dst, d->host_mask, 0, (size_t) B * n_kv * sizeof(ggml_fp16_t));
}

static dfl_status check_block(const dfl_draft * d, const dfl_block * b, const bool * seen) {
    TRY(check_seq(d, b->seq));
    if (seen[b->seq]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d appears twice in one propose", b->seq);
    }
    if (b->n_rows < 0 || (b->n_rows > 0 && !b->rows)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or rows");
    }
    if (b->n_rows > 0) {
        TRY(check_append(d, b->seq, b->rows, b->n_rows));
    }
    if (b->n_block < 2 || b->n_block > d->block_size) {
        return dfl_fail(DFL_ERR_ARGUMENT, "block size %d is outside 2..%d (the drafter's trained size)", b->n_block,
                        d->block_size);
    }
    if (b->bonus < 0 || b->bonus >= dfl_target_n_vocab(d->target)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "token id %d is outside the vocabulary", b->bonus);
    }
    const int p = d->n_tokens[b->seq] + b->n_rows;
    if (p + b->n_block > d->n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: drafting %d positions after %d exceeds %d", b->n_block, p,
                        d->n_ctx);
    }
    return DFL_OK;
}

/* How the propose's drafted rows choose: each part's sequence's sampling, merged. */
static dfl_status propose_sampling(dfl_draft * d, const propose_graph * shape, dfl_sampler_key * key) {
    for (int i = 0; i < shape->n_parts; i++) {
        dfl_sampler_key k;
        TRY(dfl_sampler_key_for(&d->sampler[shape->part[i].seq], shape->part[i].n_block - 1,
                                dfl_target_n_vocab(d->target), &k));
        if (i == 0) {
            *key = k;
        } else {
            dfl_sampler_key_merge(key, &k);
        }
    }
    key->by_sort = d->rt.top_k_by_sort;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_propose(dfl_draft * d, const dfl_block * blocks, int32_t n) {
    if (!d || !blocks || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose needs a drafter and at least one block");
    }
    if (n > d->n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose of %d blocks exceeds the %d sequence slots", n, d->n_seq);
    }
    bool seen[DFL_MAX_SEQ] = { false };
    propose_graph shape = { 0 };
    shape.n_parts = n;
    int rows = 0;
    size_t mask = 0;
    for (int i = 0; i < n; i++) {
        const dfl_block * b = &blocks[i];
        TRY(check_block(d, b, seen));
        seen[b->seq] = true;
        const int p = d->n_tokens[b->seq] + b->n_rows, B = b->n_block;
        int n_kv = ((p + B + DRAFT_KV_PAD - 1) / DRAFT_KV_PAD) * DRAFT_KV_PAD;
        if (n_kv > d->ring) {
            n_kv = d->ring;
        }
        /* deferred context rows ride in the same graph, padded to the block size so that
         * every step has the same shape */
        const int R = b->n_rows <= d->block_size ? d->block_size : b->n_rows;
        shape.part[i] = (propose_part) { b->seq, R, B, n_kv };
        rows += R > B ? R : B;
        if ((size_t) B * n_kv > mask) {
            mask = (size_t) B * n_kv;
        }
    }
    TRY(reserve(d, rows, mask));
    TRY(propose_sampling(d, &shape, &shape.samp));
    propose_graph * g = &d->graph;
    d->n_graphs++;
    if (!(g->valid && g->n_parts == n && memcmp(g->part, shape.part, (size_t) n * sizeof shape.part[0]) == 0 &&
          memcmp(&g->samp, &shape.samp, sizeof shape.samp) == 0)) {
        d->n_graph_builds++;
        d->rank.valid = false;
        g->valid = false;
        g->n_parts = n;
        memcpy(g->part, shape.part, sizeof shape.part);
        g->samp = shape.samp;
        build_propose(d, dfl_runtime_begin_graph(&d->rt, 0));
        TRY(dfl_runtime_alloc(&d->rt, 0, g->gf));
        g->valid = true;
    }

    /* the context rows */
    for (int i = 0, at = 0; i < n; at += g->part[i].n_rows, i++) {
        stage_append(d, blocks[i].seq, blocks[i].rows, blocks[i].n_rows, g->part[i].n_rows, at);
    }
    int R = 0, B = 0, D = 0;
    for (int i = 0; i < n; i++) {
        R += g->part[i].n_rows;
        B += g->part[i].n_block;
        D += g->part[i].n_block - 1;
    }
    dfl_runtime_set(&d->rt, g->app.rows, d->host_i32, 0, (size_t) R * sizeof(int32_t));
    for (int i = 0, at = 0; i < n; at += g->part[i].n_rows, i++) {
        stage_append_slots(d, blocks[i].seq, blocks[i].n_rows, g->part[i].n_rows, at);
    }
    dfl_runtime_set(&d->rt, g->app.pos, d->host_i32, 0, (size_t) R * sizeof(int32_t));
    dfl_runtime_set(&d->rt, g->app.slots, d->host_i64, 0, (size_t) R * sizeof(int64_t));
    /* the blocks: [bonus, MASK...] at the positions after each context */
    for (int i = 0, at = 0; i < n; at += g->part[i].n_block, i++) {
        d->host_i32[at] = blocks[i].bonus;
        for (int j = 1; j < g->part[i].n_block; j++) {
            d->host_i32[at + j] = d->mask_id;
        }
        dfl_runtime_set(&d->rt, d->blocks.tokens[blocks[i].seq], &blocks[i].bonus, 0, sizeof(int32_t));
    }
    dfl_runtime_set(&d->rt, g->tokens, d->host_i32, 0, (size_t) B * sizeof(int32_t));
    for (int i = 0, at = 0; i < n; at += g->part[i].n_block, i++) {
        stage_positions(d, blocks[i].seq, d->n_tokens[blocks[i].seq] + blocks[i].n_rows, g->part[i].n_block, at);
    }
    dfl_runtime_set(&d->rt, g->pos, d->host_i32, 0, (size_t) B * sizeof(int32_t));
    dfl_runtime_set(&d->rt, g->slots, d->host_i64, 0, (size_t) B * sizeof(int64_t));
    for (int i = 0; i < n; i++) {
        const int p = d->n_tokens[blocks[i].seq] + blocks[i].n_rows;
        fill_mask(d, g->mask[i], p, g->part[i].n_block, g->part[i].n_kv, d->causal == 1, 0);
        if (g->mask_swa[i]) {
            fill_mask(d, g->mask_swa[i], p, g->part[i].n_block, g->part[i].n_kv, d->causal != 0, d->swa_window);
        }
    }
    if (g->out_idx) {
        for (int i = 0, at = 0, k = 0; i < n; at += g->part[i].n_block, i++) {
            for (int j = 1; j < g->part[i].n_block; j++) {
                d->host_i32[k++] = at + j;
            }
        }
        dfl_runtime_set(&d->rt, g->out_idx, d->host_i32, 0, (size_t) D * sizeof(int32_t));
    }
    if (g->samp.pick != DFL_PICK_ARGMAX) {
        /* each part's rows of the stage's inputs, from its sequence's sampler */
        dfl_sampler_part parts[DFL_MAX_SEQ];
        for (int i = 0; i < n; i++) {
            parts[i] = (dfl_sampler_part) { &d->sampler[blocks[i].seq], g->part[i].n_block - 1 };
        }
        TRY(dfl_sampler_fill_parts(parts, n, &d->rt, &g->sampled, &g->samp, dfl_target_n_vocab(d->target)));
    }
    TRY(dfl_runtime_compute(&d->rt, 0, g->gf));
    d->n_step_nodes = d->rt.n_last_nodes;
    d->rank.fresh = false;
    for (int i = 0; i < n; i++) {
        d->n_tokens[blocks[i].seq] += blocks[i].n_rows;
        d->blocks.n[blocks[i].seq] = blocks[i].n_block;
    }
    d->n_out = D;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_block(const dfl_draft * d, int32_t seq, int32_t * dst, int32_t n) {
    TRY(check_seq(d, seq));
    if (!dst) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (n < 1 || n > d->blocks.n[seq]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%d block tokens requested, the last propose made %d", n, d->blocks.n[seq]);
    }
    dfl_runtime_get(&d->rt, d->blocks.tokens[seq], dst, 0, (size_t) n * sizeof(int32_t));
    return DFL_OK;
}

DFL_API const dfl_token_source * dfl_draft_tokens(const dfl_draft * d) {
    return d ? &d->blocks : NULL;
}

DFL_API dfl_status dfl_draft_logits(const dfl_draft * d, float * dst, int32_t row0, int32_t n_rows) {
    if (!d || !dst) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > d->n_out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter logit rows %d..%d requested, the last propose produced %d", row0,
                        row0 + n_rows, d->n_out);
    }
    const size_t row = (size_t) dfl_target_n_vocab(d->target) * sizeof(float);
    dfl_runtime_get(&d->rt, d->graph.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_set_sampling(dfl_draft * d, int32_t seq, const dfl_sampling * s) {
    TRY(check_seq(d, seq));
    if (!s) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or settings");
    }
    if (s->temperature > 0.0f && d->conv_k > 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a drafter with a candidate selector (DFlash2) drafts greedily only");
    }
    return dfl_sampler_set(&d->sampler[seq], s);
}

DFL_API dfl_status dfl_draft_set_uniforms(dfl_draft * d, int32_t seq, const float * u, int32_t n) {
    TRY(check_seq(d, seq));
    return dfl_sampler_stage_uniforms(&d->sampler[seq], u, n);
}

DFL_API dfl_status dfl_draft_candidates(const dfl_draft * d, int32_t row0, int32_t n_rows, int32_t k,
                                        int32_t * tokens, float * probs) {
    if (!d || d->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "candidates: no propose yet");
    }
    return dfl_sampler_candidates(&d->rt, &d->graph.sampled, d->n_out, row0, n_rows, k, tokens, probs);
}

typedef struct cand {
    int32_t token;
    float logprob;
} cand;

static int cand_order(const void * a, const void * b) {
    const cand * x = a, * y = b;
    if (x->logprob != y->logprob) {
        return x->logprob > y->logprob ? -1 : 1;
    }
    return x->token < y->token ? -1 : x->token > y->token;
}

static dfl_status check_ranked_rows(const dfl_draft * d, int32_t row0, int32_t n_rows, const int32_t * tokens,
                                    const float * logprobs) {
    if (!d || !tokens || !logprobs) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (d->p.top_k == 0) {
        return dfl_fail(DFL_ERR_STATE, "the drafter was loaded with top_k = 0");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > d->n_out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter rows %d..%d requested, the last propose produced %d", row0,
                        row0 + n_rows, d->n_out);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_top1(const dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    static int32_t unread;
    TRY(check_ranked_rows(d, row0, n_rows, tokens ? tokens : &unread, logprobs));
    if (tokens) {
        dfl_runtime_get(&d->rt, d->graph.argmax, tokens, (size_t) row0 * sizeof(int32_t), (size_t) n_rows * sizeof(int32_t));
    }
    dfl_runtime_get(&d->rt, d->graph.argmax_lp, logprobs, (size_t) row0 * sizeof(float), (size_t) n_rows * sizeof(float));
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_topk(dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    TRY(check_ranked_rows(d, row0, n_rows, tokens, logprobs));
    const int K = d->p.top_k;
    if (K == 1) {
        return dfl_draft_top1(d, row0, n_rows, tokens, logprobs);
    }
    TRY(rank_last_propose(d));
    dfl_runtime_get(&d->rt, d->rank.topk, tokens, (size_t) row0 * K * sizeof(int32_t), (size_t) n_rows * K * sizeof(int32_t));
    dfl_runtime_get(&d->rt, d->rank.topk_lp, logprobs, (size_t) row0 * K * sizeof(float), (size_t) n_rows * K * sizeof(float));
    cand c[64];
    for (int r = 0; r < n_rows; r++) {
        for (int i = 0; i < K; i++) {
            c[i].token = tokens[r * K + i];
            c[i].logprob = logprobs[r * K + i];
        }
        qsort(c, (size_t) K, sizeof c[0], cand_order); /* ggml_top_k leaves them unordered */
        for (int i = 0; i < K; i++) {
            tokens[r * K + i] = c[i].token;
            logprobs[r * K + i] = c[i].logprob;
        }
    }
    return DFL_OK;
}

/* ---- memory plan ---------------------------------------------------------------------- */

dfl_status dfl_draft_plan(const char * path, dfl_target * target, const dfl_draft_params * params,
                          dfl_part_sizes * out) {
    memset(out, 0, sizeof *out);
    dfl_draft * d;
    TRY(open_draft(path, target, params, &d));
    dfl_status st = define_state(d);
    ggml_backend_buffer_t dummy = st == DFL_OK ? dfl_runtime_dummy_buffer(d->rt.dev) : NULL;
    if (st == DFL_OK && !dummy) {
        st = dfl_fail(DFL_ERR_BACKEND, "cannot plan for device %s", ggml_backend_dev_name(d->rt.dev));
    }
    if (st == DFL_OK) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d->rt.dev);
        for (int64_t i = 0; i < gguf_get_n_tensors(d->file.meta); i++) {
            if (d->file.used[i]) {
                struct ggml_tensor * w = ggml_get_tensor(d->file.ctx, gguf_get_tensor_name(d->file.meta, i));
                out->weights += ggml_backend_buft_get_alloc_size(buft, w);
                dfl_runtime_place_dummy(w, dummy);
            }
        }
        for (struct ggml_tensor * c = ggml_get_first_tensor(d->ctx_state); c; c = ggml_get_next_tensor(d->ctx_state, c)) {
            out->cache += ggml_backend_buft_get_alloc_size(buft, c);
            dfl_runtime_place_dummy(c, dummy);
        }
        /* slot 0 holds the larger of a prefill chunk's context append and a propose of
         * every sequence over the whole attention span (with its softmax when
         * top_k >= 1); slot 1 the rank graph over that propose's logits and softmax
         * (top_k > 1) */
        const int B = d->block_size, n_kv = d->ring < d->n_ctx ? d->ring : d->n_ctx;
        propose_graph * g = &d->graph;
        g->n_parts = d->n_seq;
        for (int i = 0; i < d->n_seq; i++) {
            g->part[i] = (propose_part) { i, B, B, n_kv };
        }
        build_propose(d, dfl_runtime_begin_graph(&d->rt, 0));
        size_t propose[2] = { 0, 0 }, append[2] = { 0, 0 }, rank[2] = { 0, 0 };
        dfl_runtime_measure(&d->rt, 0, d->graph.gf, propose);
        {
            struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 0);
            struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, d->rt.graph_size, false);
            append_inputs in;
            build_append(d, ctx, gf, dfl_target_n_ubatch(target), &in);
            dfl_runtime_measure(&d->rt, 0, gf, append);
        }
        if (d->p.top_k > 1) {
            struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 1);
            struct ggml_tensor * logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, dfl_target_n_vocab(target),
                                                             (int64_t) (B - 1) * d->n_seq);
            struct ggml_tensor * probs = ggml_dup_tensor(ctx, logits);
            dfl_runtime_place_dummy(logits, dummy); /* slot 0's, counted there */
            dfl_runtime_place_dummy(probs, dummy);
            build_rank(d, ctx, logits, probs);
            dfl_runtime_measure(&d->rt, 1, d->rank.gf, rank);
        }
        for (int k = 0; k < 2; k++) {
            out->compute[k] = (propose[k] > append[k] ? propose[k] : append[k]) + rank[k];
        }
    }
    if (dummy) {
        ggml_backend_buffer_free(dummy);
    }
    dfl_draft_free(d);
    return st;
}
