/* Target runtime: loading and placement, caches and recurrent state, the calls
 * (decode, chain and tree verify, commits) and graph reuse. Graphs themselves are
 * built in dfl_target_graph.c over the architecture's layer builders (dfl_model.h):
 * nothing here depends on the architecture, only on the kinds of its layers. */
#include "dfl_target_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

/* The attention window grows in steps so that graphs of consecutive steps share shapes. */
#define KV_PAD 256

/* Chain verifies of one length in a row after which their commits rerun every verified
 * row again (see dfl_target_commit). */
#define CHAIN_STEADY 8

DFL_API void dfl_target_default_params(dfl_target_params * p) {
    memset(p, 0, sizeof *p);
    p->n_ctx = 4096;
    p->n_ubatch = 512;
    p->n_verify = 16;
    p->kv_type = GGML_TYPE_F16;
    p->kv_type_v = -1;
    p->n_gpu_layers = -1;
}

static dfl_status check_params(const dfl_model * m, dfl_target_params * p) {
    if (p->n_ctx <= 0) p->n_ctx = 4096;
    if (p->n_ubatch <= 0) p->n_ubatch = 512;
    if (p->n_verify <= 0) p->n_verify = 16;
    if (p->n_ubatch > p->n_ctx) p->n_ubatch = p->n_ctx;
    if (p->n_verify > DFL_MAX_VERIFY) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_verify (%d) exceeds the supported %d", p->n_verify, DFL_MAX_VERIFY);
    }
    if (p->n_verify > p->n_ctx) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_verify (%d) exceeds the context size (%d)", p->n_verify, p->n_ctx);
    }
    if (p->kv_type_v < 0) {
        p->kv_type_v = p->kv_type;
    }
    const int32_t types[2] = { p->kv_type, p->kv_type_v };
    for (int i = 0; i < 2; i++) {
        const int32_t kt = types[i];
        if (kt != GGML_TYPE_F32 && kt != GGML_TYPE_F16 && kt != GGML_TYPE_Q8_0 && kt != GGML_TYPE_Q4_0 &&
            kt != GGML_TYPE_BF16) {
            return dfl_fail(DFL_ERR_ARGUMENT, "unsupported %s cache type %d (use f32, f16, bf16, q8_0 or q4_0)",
                            i == 0 ? "K" : "V", kt);
        }
        for (int il = 0; il < m->n_layer; il++) {
            const int hd = i == 0 ? m->attn[il].head_dim_k : m->attn[il].head_dim_v;
            if (m->kind[il] == DFL_LAYER_ATTENTION && hd % ggml_blck_size((enum ggml_type) kt) != 0) {
                return dfl_fail(DFL_ERR_ARGUMENT, "cache type %s needs a head size multiple of %lld (layer %d has %d)",
                                ggml_type_name((enum ggml_type) kt), (long long) ggml_blck_size((enum ggml_type) kt),
                                il, hd);
            }
        }
    }
    if (p->n_feature_layers < 0 || p->n_feature_layers > 16) {
        return dfl_fail(DFL_ERR_ARGUMENT, "between 0 and 16 feature layers are supported, got %d", p->n_feature_layers);
    }
    for (int i = 0; i < p->n_feature_layers; i++) {
        const int L = p->feature_layers[i];
        if (L < 1 || L > m->n_layer) {
            return dfl_fail(DFL_ERR_ARGUMENT, "feature layer %d is outside 1..%d", L, m->n_layer);
        }
    }
    return DFL_OK;
}

/* Trees have at most 64 nodes (their ancestor sets are 64-bit masks) and n_verify. */
int dfl_target_max_tree_nodes(const dfl_target * t) {
    return t->p.n_verify < DFL_MAX_TREE ? t->p.n_verify : DFL_MAX_TREE;
}

/* Layers il >= first_device_layer run on the device, the ones before on the CPU. */
static int first_device_layer(const dfl_target * t) {
    const int n_layer = t->m.n_layer;
    if (t->rt.dev == t->rt.dev_cpu || t->p.n_gpu_layers < 0 || t->p.n_gpu_layers >= n_layer) {
        return 0;
    }
    return n_layer - t->p.n_gpu_layers;
}

static ggml_backend_dev_t layer_device(const dfl_target * t, int il) {
    return il >= first_device_layer(t) ? t->rt.dev : t->rt.dev_cpu;
}

static ggml_backend_dev_t output_device(const dfl_target * t) {
    return t->p.n_gpu_layers < 0 || t->p.n_gpu_layers > t->m.n_layer ? t->rt.dev : t->rt.dev_cpu;
}

/* Device of each weight, in file order (NULL when out of host memory). As in
 * llama.cpp, the token embedding stays on the CPU (it is only gathered from) unless it
 * doubles as the LM head. */
ggml_backend_dev_t * dfl_target_weight_devices(const dfl_target * t) {
    const dfl_gguf * g = &t->m.file;
    const int64_t n = gguf_get_n_tensors(g->meta);
    ggml_backend_dev_t * dev_of = malloc((size_t) (n + 1) * sizeof *dev_of);
    if (!dev_of) {
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        const char * name = gguf_get_tensor_name(g->meta, i);
        int il = -1;
        if (sscanf(name, "blk.%d.", &il) == 1) {
            dev_of[i] = il < t->m.n_layer ? layer_device(t, il) : t->rt.dev_cpu;
        } else if (strcmp(name, "token_embd.weight") == 0 && t->m.output != t->m.tok_embd) {
            dev_of[i] = t->rt.dev_cpu;
        } else {
            dev_of[i] = output_device(t);
        }
    }
    return dev_of;
}

/* A token embedding tied to the LM head lives with the LM head. When the device takes it
 * only in row slices (dfl_gguf_mul_mat), the lookup cannot gather from it whole: it gets
 * a copy in host memory, where an untied embedding would have stayed anyway. */
static dfl_status copy_lookup_to_host(dfl_target * t) {
    const struct ggml_tensor * w = t->m.tok_embd;
    struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
    t->ctx_lookup = ggml_init(ip);
    if (!t->ctx_lookup) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    struct ggml_tensor * copy = ggml_new_tensor_2d(t->ctx_lookup, w->type, w->ne[0], w->ne[1]);
    ggml_set_name(copy, ggml_get_name(w));
    t->buf_lookup = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx_lookup, ggml_backend_dev_buffer_type(t->rt.dev_cpu));
    if (!t->buf_lookup) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot allocate a host copy of the token embedding of '%s' (%zu bytes)",
                        t->m.file.path, ggml_nbytes(w));
    }
    ggml_backend_buffer_set_usage(t->buf_lookup, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_copy(t->m.tok_embd, copy);
    t->tok_lookup = copy;
    return DFL_OK;
}

static dfl_status place_weights(dfl_target * t) {
    ggml_backend_dev_t * dev_of = dfl_target_weight_devices(t);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    dfl_status st = dfl_gguf_load_weights(&t->m.file, dev_of, !t->p.no_repack);
    free(dev_of);
    for (int i = 0; st == DFL_OK && i < t->m.file.n_sliced; i++) {
        if (t->m.file.sliced[i].whole == t->m.tok_embd) {
            st = copy_lookup_to_host(t);
        }
    }
    return st;
}

/* Caches and recurrent states live with their layer's weights: ctx_state[0] on the
 * device, ctx_state[1] on the CPU. Tensors only: alloc_state gives them memory. */
dfl_status dfl_target_define_state(dfl_target * t) {
    const dfl_model * m = &t->m;
    const dfl_recurrent_geometry * r = &m->rec;
    const int n_tensors = 5 * m->n_layer + 1;
    for (int k = 0; k < 2; k++) {
        struct ggml_init_params ip = { (size_t) n_tensors * ggml_tensor_overhead(), NULL, true };
        t->ctx_state[k] = ggml_init(ip);
        if (!t->ctx_state[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot create the state context");
        }
    }
    const int64_t state_size = (int64_t) r->head_v_dim * r->head_v_dim * r->n_v_heads;
    for (int il = 0; il < m->n_layer; il++) {
        struct ggml_context * ctx = t->ctx_state[layer_device(t, il) == t->rt.dev ? 0 : 1];
        if (m->kind[il] == DFL_LAYER_RECURRENT) {
            t->conv_state[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, r->d_conv - 1, r->conv_channels);
            t->ssm_state[il] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, state_size);
            t->replay[il] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, dfl_target_replay_floats(m, t->p.n_verify));
            t->conv_scratch[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, r->conv_channels, r->d_conv - 1 + t->p.n_verify);
        } else if (!m->attn[il].shares_kv) {
            const dfl_attention_geometry * a = &m->attn[il];
            const int64_t n_rows = a->window > 0 ? t->swa_ring : t->p.n_ctx;
            t->k_cache[il] = ggml_new_tensor_2d(ctx, (enum ggml_type) t->p.kv_type, (int64_t) a->head_dim_k * a->n_head_kv,
                                                n_rows);
            t->v_cache[il] = ggml_new_tensor_2d(ctx, (enum ggml_type) t->p.kv_type_v, (int64_t) a->head_dim_v * a->n_head_kv,
                                                n_rows);
        }
    }
    const int rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
    t->features = ggml_new_tensor_2d(t->ctx_state[output_device(t) == t->rt.dev ? 0 : 1], GGML_TYPE_F32,
                                     (int64_t) m->n_embd * (t->p.n_feature_layers > 0 ? t->p.n_feature_layers : 1), rows);
    return DFL_OK;
}

static dfl_status alloc_state(dfl_target * t) {
    TRY(dfl_target_define_state(t));
    const ggml_backend_dev_t devs[2] = { t->rt.dev, t->rt.dev_cpu };
    for (int k = 0; k < 2; k++) {
        if (!ggml_get_first_tensor(t->ctx_state[k])) {
            continue;
        }
        t->buf_state[k] = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx_state[k], ggml_backend_dev_buffer_type(devs[k]));
        if (!t->buf_state[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "out of %s memory for a context of %d tokens",
                            ggml_backend_dev_name(devs[k]), t->p.n_ctx);
        }
        ggml_backend_buffer_clear(t->buf_state[k], 0);
    }
    return DFL_OK;
}

/* Everything before the weights: the model's description, checked parameters, devices. */
dfl_status dfl_target_open(const char * path, const dfl_target_params * params, dfl_target ** out) {
    *out = NULL;
    if (!path) {
        return dfl_fail(DFL_ERR_ARGUMENT, "no model path given");
    }
    dfl_target * t = calloc(1, sizeof *t);
    if (!t) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    t->chain_steady = CHAIN_STEADY;
    dfl_sampler_init(&t->sampler);
    if (params) {
        t->p = *params;
    } else {
        dfl_target_default_params(&t->p);
    }
    t->p.device = NULL; /* the caller's string is not ours to keep */

    dfl_status st = dfl_model_open(path, &t->m);
    if (st != DFL_OK) {
        free(t);
        return st;
    }
    t->tok_lookup = t->m.tok_embd;
    st = check_params(&t->m, &t->p);
    for (int il = 0; il < t->m.n_layer; il++) {
        if (t->m.kind[il] == DFL_LAYER_ATTENTION && t->m.attn[il].window > 0) {
            t->swa_window = t->m.attn[il].window;
        }
    }
    /* a call's rows must not take the ring rows of positions still inside any of its
     * rows' windows: window - 1 + rows at least */
    const int64_t rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
    t->swa_ring = t->swa_window > 0 && t->swa_window + rows < t->p.n_ctx ? (int) (t->swa_window + rows) : t->p.n_ctx;
    if (st == DFL_OK) {
        /* a tree verify's recurrence adds a few dozen graph nodes per recurrent layer,
         * whatever the tree's size */
        const size_t graph_size = DFL_GRAPH_SIZE + (size_t) t->m.n_layer * DFL_GRAPH_NODES_PER_LAYER +
                                  (size_t) t->m.n_recurrent * 48;
        st = dfl_runtime_init(&t->rt, params ? params->device : NULL, t->p.n_threads, "target", graph_size,
                              DFL_MAX_GRAPH_SLOTS);
    }
    if (st != DFL_OK) {
        dfl_target_free(t);
        return st;
    }
    *out = t;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_load(const char * path, const dfl_target_params * params, dfl_target ** out) {
    dfl_target * t;
    TRY(dfl_target_open(path, params, &t));
    *out = NULL;
    dfl_status st = place_weights(t);
    if (st == DFL_OK) {
        st = alloc_state(t);
    }
    if (st != DFL_OK) {
        dfl_target_free(t);
        return st;
    }
    *out = t;
    return DFL_OK;
}

DFL_API void dfl_target_free(dfl_target * t) {
    if (!t) {
        return;
    }
    for (int k = 0; k < 2; k++) {
        if (t->buf_state[k]) ggml_backend_buffer_free(t->buf_state[k]);
        if (t->ctx_state[k]) ggml_free(t->ctx_state[k]);
    }
    if (t->buf_lookup) ggml_backend_buffer_free(t->buf_lookup);
    if (t->ctx_lookup) ggml_free(t->ctx_lookup);
    dfl_runtime_free(&t->rt);
    dfl_model_close(&t->m);
    dfl_sampler_free(&t->sampler);
    free(t->host_i32);
    free(t->host_i64);
    free(t->host_mask);
    free(t);
}

DFL_API dfl_status dfl_target_get_info(const dfl_target * t, dfl_target_info * info) {
    if (!t || !info) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    memset(info, 0, sizeof *info);
    info->n_vocab = t->m.n_vocab;
    info->n_embd = t->m.n_embd;
    info->n_layer = t->m.n_layer;
    info->n_ctx_train = t->m.n_ctx_train;
    info->n_ctx = t->p.n_ctx;
    info->n_ubatch = t->p.n_ubatch;
    info->n_verify = t->p.n_verify;
    info->n_past = t->n_past;
    info->n_gpu_layers = t->rt.dev == t->rt.dev_cpu ? 0 : t->m.n_layer - first_device_layer(t);
    info->n_graphs = t->n_graphs;
    info->n_graph_builds = t->n_graph_builds;
    snprintf(info->device, sizeof info->device, "%s", ggml_backend_dev_name(t->rt.dev));
    info->n_threads = t->rt.n_threads;
    info->n_weight_buffers = t->m.file.n_buffers;
    info->compute_bytes = dfl_runtime_compute_bytes(&t->rt);
    snprintf(info->arch, sizeof info->arch, "%s", t->m.arch->name);
    info->n_last_nodes = t->rt.n_last_nodes;
    info->n_last_replay = t->n_last_replay;
    info->n_host_writes = t->rt.traffic->writes;
    info->n_host_reads = t->rt.traffic->reads;
    info->n_host_write_bytes = t->rt.traffic->write_bytes;
    info->n_host_read_bytes = t->rt.traffic->read_bytes;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_last_placement(const dfl_target * t, dfl_placement * out) {
    if (!t || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    return dfl_runtime_placement(&t->rt, out);
}

DFL_API dfl_status dfl_target_reset(dfl_target * t) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    for (int k = 0; k < 2; k++) {
        if (t->buf_state[k]) ggml_backend_buffer_clear(t->buf_state[k], 0);
    }
    t->n_past = 0;
    t->pending_verify = 0;
    t->commit.active = false;
    t->n_last_replay = 0;
    t->last_chain = 0;
    t->chain_steady = CHAIN_STEADY;
    /* the graphs stay: a graph's key holds everything its shape depends on (the context
     * length enters through inputs), so a new request reuses them */
    t->n_out = 0;
    t->n_rows = 0;
    t->sampler.n_u = 0;
    t->sampler.pen_rows = 0;
    return DFL_OK;
}

dfl_status dfl_host_reserve(dfl_target * t, int n, int n_kv) {
    if ((size_t) n > t->host_rows) {
        free(t->host_i32);
        free(t->host_i64);
        t->host_i32 = malloc((size_t) n * sizeof(int32_t));
        t->host_i64 = malloc((size_t) n * sizeof(int64_t));
        t->host_rows = (size_t) n;
    }
    const size_t mask = (size_t) n * (size_t) n_kv;
    if (mask > t->host_mask_size) {
        free(t->host_mask);
        t->host_mask = malloc(mask * sizeof(ggml_fp16_t));
        t->host_mask_size = mask;
    }
    if (!t->host_i32 || !t->host_i64 || !t->host_mask) {
        t->host_rows = t->host_mask_size = 0;
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

static bool same_key(const graph_key * a, const graph_key * b) {
    return a->n == b->n && a->n_kv == b->n_kv && a->logits == b->logits && a->verify == b->verify &&
           a->commit == b->commit && a->commit_replay == b->commit_replay && a->tokens_src == b->tokens_src &&
           a->tree == b->tree && memcmp(&a->shape, &b->shape, sizeof a->shape) == 0 &&
           memcmp(&a->samp, &b->samp, sizeof a->samp) == 0;
}

/* The slot holding a graph of this key, or the one to build it in (marked invalid):
 * graphs larger than a verify (prefill chunks) always take slot 0, so that the other
 * slots' compute memory stays verify-sized; the rest take the least recently used. */
static int graph_slot(dfl_target * t, const graph_key * key) {
    const int n_slots = t->rt.n_slots;
    for (int i = 0; i < n_slots; i++) {
        if (t->graphs[i].valid && same_key(&t->graphs[i].key, key)) {
            return i;
        }
    }
    int slot = 0;
    if (key->n <= t->p.n_verify) {
        uint64_t oldest = UINT64_MAX;
        for (int i = 1; i < n_slots; i++) {
            const uint64_t used = t->graphs[i].valid ? t->graphs[i].last_use : 0;
            if (used < oldest) {
                oldest = used;
                slot = i;
            }
        }
    }
    t->graphs[slot].valid = false;
    return slot;
}

/* tokens come from the host, or (tokens == NULL) from the device tensor tokens_src */
static dfl_status run(dfl_target * t, const int32_t * tokens, int n, bool verify, bool tree, int logits,
                      struct ggml_tensor * tokens_src) {
    for (int i = 0; tokens && i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= t->m.n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "token id %d at index %d is outside the vocabulary (0..%d)", tokens[i],
                            i, t->m.n_vocab - 1);
        }
    }
    if (t->n_past + n > t->p.n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: %d tokens in context + %d new > context size %d",
                        t->n_past, n, t->p.n_ctx);
    }
    int n_kv = ((t->n_past + n + KV_PAD - 1) / KV_PAD) * KV_PAD;
    if (n_kv > t->p.n_ctx) {
        n_kv = t->p.n_ctx;
    }
    TRY(dfl_host_reserve(t, n > t->p.n_verify ? n : t->p.n_verify, n_kv)); /* commit inputs have n_verify rows */

    /* steps of a shape seen lately reuse its graph and allocation, only the inputs
     * change: plain decoding, chain steps (the commit they carry is an input), tree
     * steps with as many nodes whatever the tree, and `auto` going back and forth
     * between the chain and a few tree sizes */
    const int commit = t->commit.active ? (t->commit.tree ? 2 : 1) : 0;
    const int n_out = logits == LOGITS_NONE ? 0 : (logits == LOGITS_LAST ? 1 : n);
    graph_key key = { n, n_kv, logits, verify, commit, commit ? t->commit.n_replay : 0, tokens_src,
                      tree, tree ? t->tree.shape : (tree_shape) { 0 }, { 0 } };
    if (n_out > 0) {
        TRY(dfl_sampler_key_for(&t->sampler, n_out, t->m.n_vocab, &key.samp));
    }
    const int slot = graph_slot(t, &key);
    graph_cache * gc = &t->graphs[slot];
    t->n_graphs++;
    if (!gc->valid) {
        t->n_graph_builds++;
        gc->gf = dfl_target_build_graph(t, dfl_runtime_begin_graph(&t->rt, slot), &gc->in, n, n_kv, verify, tree,
                                        logits, tokens_src, &key.samp);
        TRY(dfl_runtime_alloc(&t->rt, slot, gc->gf));
        gc->key = key;
        gc->logits = t->out_logits;
        gc->valid = true;
    }
    gc->last_use = ++t->graph_clock;
    t->out_logits = gc->logits;
    t->out_samp = &gc->in.samp;
    struct ggml_cgraph * gf = gc->gf;
    dfl_target_fill_inputs(t, &gc->in, tokens, n, n_kv, tree);
    if (n_out > 0) {
        TRY(dfl_sampler_fill(&t->sampler, &t->rt, &gc->in.samp, &key.samp, n_out, t->m.n_vocab));
    }
    TRY(dfl_runtime_compute(&t->rt, slot, gf));
    t->n_last_replay = commit && t->m.n_recurrent > 0 ? t->commit.n_replay : 0;
    t->commit.active = false;

    t->n_rows = n;
    t->n_out = n_out;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_decode(dfl_target * t, const int32_t * tokens, int32_t n, int32_t logits) {
    if (!t || !tokens || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "decode needs at least one token");
    }
    if (n > t->p.n_ubatch) {
        return dfl_fail(DFL_ERR_CAPACITY, "decode of %d tokens exceeds the ubatch size %d", n, t->p.n_ubatch);
    }
    if (logits < LOGITS_NONE || logits > LOGITS_ALL) {
        return dfl_fail(DFL_ERR_ARGUMENT, "logits mode must be 0, 1 or 2");
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "a verify is waiting for dfl_target_commit");
    }
    TRY(run(t, tokens, n, false, false, logits, NULL));
    t->n_past += n;
    return DFL_OK;
}

static dfl_status verify_chain(dfl_target * t, const int32_t * tokens, int32_t n, struct ggml_tensor * tokens_src) {
    if (n > t->p.n_verify) {
        return dfl_fail(DFL_ERR_CAPACITY, "verify of %d tokens exceeds n_verify %d", n, t->p.n_verify);
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
    }
    TRY(run(t, tokens, n, true, false, LOGITS_ALL, tokens_src));
    t->pending_verify = n;
    t->pending_tree = false;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_verify(dfl_target * t, const int32_t * tokens, int32_t n) {
    if (!t || !tokens || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target and at least one token");
    }
    return verify_chain(t, tokens, n, NULL);
}

DFL_API dfl_status dfl_target_verify_draft(dfl_target * t, const dfl_draft * d, int32_t n) {
    if (!t || !d || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target, a drafter and at least one token");
    }
    if (dfl_draft_target(d) != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
    }
    struct ggml_tensor * block = dfl_draft_block_tensor(d, n);
    if (!block) {
        return dfl_fail(DFL_ERR_STATE, "the drafter's last block has fewer than %d tokens", n);
    }
    return verify_chain(t, NULL, n, block);
}

DFL_API dfl_status dfl_target_commit(dfl_target * t, int32_t n_keep) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    const int n = t->pending_verify;
    if (n == 0) {
        return dfl_fail(DFL_ERR_STATE, "commit without a preceding verify");
    }
    if (t->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "a tree verify is committed with dfl_target_commit_path");
    }
    if (n_keep < 0 || n_keep > n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d verified tokens", n_keep, n);
    }
    t->pending_verify = 0;
    t->n_out = 0;
    t->chain_steady = n == t->last_chain || t->last_chain == 0 ? t->chain_steady + 1 : 0;
    t->last_chain = n;
    /* a chain's attention rows are already in place: only recurrent layers have work */
    if (n_keep > 0 && t->m.n_recurrent > 0) {
        pending_commit * pc = &t->commit;
        pc->active = true;
        pc->tree = false;
        pc->p0 = t->n_past;
        pc->n_keep = n_keep;
        /* chain verifies of one length reuse one graph when their commits rerun every
         * verified row; while the lengths vary (a confidence cut), the graphs differ
         * anyway and only the kept rows are rerun, sparing the identity steps */
        pc->n_replay = t->chain_steady >= CHAIN_STEADY ? n : n_keep;
        for (int k = 0; k < n_keep; k++) {
            pc->path[k] = k;
        }
        for (int j = 0; j < t->m.rec.d_conv - 1; j++) {
            pc->conv_cols[j] = n_keep + j;
        }
    }
    t->n_past += n_keep;
    return DFL_OK;
}

#define TREE_SHAPE_RESET 64

static int max_int(int a, int b) {
    return a > b ? a : b;
}

/* Each size at its largest over the trees of n nodes: the spine has at least two nodes
 * when n > 1, so at most n - 2 leaves are off it; a branch of L steps leaves a spine
 * of more than L nodes (the spine is a longest path), so 2 L + 1 <= n. plan_recurrence
 * keeps every shape within n - 2 branches in all, so this one-group shape, keeping a
 * state of every spine step and n - 2 nodes off it, bounds the memory of every tree
 * graph of n nodes. */
tree_shape dfl_tree_worst_shape(int n) {
    tree_shape sh = { n, 0, DFL_MAX_TREE, 0, { 0 }, { 0 } };
    if (n >= 3) {
        sh.split = n;
        sh.first = 0;
        sh.off = n - 2;
        sh.branches[DFL_TREE_GROUPS - 1] = n - 2;
        sh.steps[DFL_TREE_GROUPS - 1] = (n - 1) / 2;
    }
    return sh;
}

/* What a shape costs, in delta-rule steps: its padded steps, the states it copies (a
 * kept spine state; the second part's start; per branch, the gather of its start and
 * the op's own copy of it) and one step's worth per branch op. A state copy costs
 * about a step (both touch the whole state once or twice). */
static int shape_cost(const tree_shape * sh) {
    int cost = sh->spine;
    if (tree_branches(sh) > 0) {
        cost += sh->split - sh->first + (sh->split < sh->spine ? 1 : 0);
    }
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        if (sh->branches[g] > 0) {
            cost += sh->branches[g] * (sh->steps[g] + 2) + 1;
        }
    }
    return cost;
}

/* Each size at the larger of two shapes'; the spine's kept states reach from the
 * earlier first branch to the later last one. */
static tree_shape max_shape(tree_shape a, const tree_shape * b) {
    a.spine = max_int(a.spine, b->spine);
    a.split = max_int(a.split, b->split);
    a.first = a.first < b->first ? a.first : b->first;
    a.off = max_int(a.off, b->off);
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        a.branches[g] = max_int(a.branches[g], b->branches[g]);
        a.steps[g] = max_int(a.steps[g], b->steps[g]);
    }
    return a;
}

/* The branches sorted by length, split at k: the k shortest in group `lo`, the rest in
 * the other (DFL_TREE_GROUPS is 2). */
static tree_shape split_shape(int spine, int split, int first, int off, const int * len, int n_branches, int k,
                              int lo) {
    tree_shape sh = { spine, split, first, off, { 0 }, { 0 } };
    sh.branches[lo] = k;
    sh.steps[lo] = k > 0 ? len[k - 1] : 0;
    sh.branches[1 - lo] = n_branches - k;
    sh.steps[1 - lo] = n_branches > k ? len[n_branches - 1] : 0;
    return sh;
}

/* The recurrence of a tree (see tree_plan): the spine follows, from the root, a child
 * with the longest path below it (the first such child), so branches are short; a
 * branch is the path from the spine to a leaf off it. Branches sorted by length are
 * split in two groups (the short ones in either) where that costs least (shape_cost).
 * The padded shape grows to the largest of each size seen for this node count (the
 * split is chosen for the cheapest such shape, within n - 2 branches in all), so trees
 * of a budget share one graph once a few steps have set it; every TREE_SHAPE_RESET trees it restarts from the
 * current tree's, so that a rare odd tree does not pad every later one (at most one
 * graph rebuild per reset). Padding steps repeat a real node after the last one read
 * (their results are never read), padding branches run the root from the last state. */
static void plan_recurrence(dfl_target * t, tree_plan * tp) {
    const int n = tp->n, W = t->m.rec.d_conv - 1;
    int height[DFL_MAX_TREE], down[DFL_MAX_TREE], spine_step[DFL_MAX_TREE];
    int leaf[DFL_MAX_TREE], from[DFL_MAX_TREE], len[DFL_MAX_TREE];
    bool inner[DFL_MAX_TREE];
    for (int i = 0; i < n; i++) {
        height[i] = 1;
        down[i] = -1;
        spine_step[i] = -1;
        inner[i] = false;
    }
    for (int i = n - 1; i > 0; i--) {
        const int p = tp->parent[i];
        inner[p] = true;
        if (height[i] + 1 >= height[p]) { /* ties: the child that comes first */
            height[p] = height[i] + 1;
            down[p] = i;
        }
    }
    const int spine = height[0];
    for (int x = 0, s = 0; x >= 0; x = down[x], s++) {
        spine_step[x] = s;
    }
    /* branches, by length (insertion sort: stable, at most 62 of them) */
    int nb = 0, first_from = DFL_MAX_TREE, last_from = -1;
    for (int i = 0; i < n; i++) {
        if (inner[i] || spine_step[i] >= 0) {
            continue;
        }
        int x = i;
        while (spine_step[x] < 0) {
            x = tp->parent[x];
        }
        const int l = tp->depth[i] - tp->depth[x];
        int j = nb++;
        for (; j > 0 && len[j - 1] > l; j--) {
            leaf[j] = leaf[j - 1];
            from[j] = from[j - 1];
            len[j] = len[j - 1];
        }
        leaf[j] = i;
        from[j] = spine_step[x];
        len[j] = l;
        first_from = from[j] < first_from ? from[j] : first_from;
        last_from = max_int(last_from, from[j]);
    }

    tree_shape * seen = &t->tree_shapes[n];
    const bool reset = ++t->tree_shape_age[n] >= TREE_SHAPE_RESET || seen->spine == 0;
    if (reset) {
        t->tree_shape_age[n] = 0;
    }
    tree_shape best = { 0 };
    int best_cost = -1, k_best = 0, lo_best = 0;
    for (int pass = reset ? 1 : 0; pass < 2 && best_cost < 0; pass++) {
        /* pass 0 within the shape seen, pass 1 (a reset, or no split fits n - 2
         * branches in all) from this tree alone; the short ones in either group */
        for (int k = 0; k <= nb; k++) {
            for (int lo = 0; lo < 2; lo++) {
                tree_shape sh = split_shape(spine, last_from + 1, first_from, n - spine, len, nb, k, lo);
                if (pass == 0) {
                    sh = max_shape(sh, seen);
                    if (tree_branches(&sh) > max_int(n - 2, 0)) {
                        continue;
                    }
                }
                const int cost = shape_cost(&sh);
                if (best_cost < 0 || cost < best_cost) {
                    best = sh;
                    best_cost = cost;
                    k_best = k;
                    lo_best = lo;
                }
            }
        }
    }
    const tree_shape sh = tp->shape = *seen = best;

    int32_t * steps = tp->steps;
    int last = 0;
    for (int x = 0; x >= 0; x = down[x]) {
        steps[spine_step[x]] = last = x;
        tp->out_rows[x] = spine_step[x];
    }
    for (int s = spine; s < sh.spine; s++) {
        steps[s] = last;
    }
    int row0 = sh.spine, seq = 0;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        /* the short branches, 0 .. k_best - 1, in group lo_best; the rest in the other */
        int b = g == lo_best ? 0 : k_best;
        const int end = g == lo_best ? k_best : nb;
        for (int j = 0; j < sh.branches[g]; j++, seq++, row0 += sh.steps[g]) {
            if (b == end) { /* padding */
                tp->branch_from[seq] = 0;
                for (int s = 0; s < sh.steps[g]; s++) {
                    steps[row0 + s] = 0;
                }
                continue;
            }
            const int i = leaf[b], d0 = tp->depth[i] - len[b];
            /* kept state s: s steps before the end of the spine's first part */
            tp->branch_from[seq] = sh.split - 1 - from[b];
            for (int y = i; tp->depth[y] > d0; y = tp->parent[y]) {
                const int row = row0 + tp->depth[y] - d0 - 1;
                steps[row] = y;
                if (tp->out_rows[y] < 0) {
                    tp->out_rows[y] = row;
                }
            }
            for (int s = len[b]; s < sh.steps[g]; s++) {
                steps[row0 + s] = i;
            }
            b++;
        }
    }
    /* rows of later ops: spare rows first, then the nodes they compute first */
    const int head = tree_head_rows(&sh);
    int bound[2 + DFL_TREE_GROUPS] = { head, sh.spine };
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        bound[g + 2] = bound[g + 1] + sh.branches[g] * sh.steps[g];
    }
    for (int o = 0; o <= DFL_TREE_GROUPS; o++) {
        for (int r = bound[o]; r < bound[o + 1]; r++) {
            tp->scatter[r - head] = n + r - bound[o];
        }
    }
    for (int i = 0; i < n; i++) {
        if (tp->out_rows[i] >= head) {
            tp->scatter[tp->out_rows[i] - head] = i;
            tp->out_rows[i] = 0;
        }
    }
    for (int i = n; i < n + tree_spare_rows(&sh); i++) {
        tp->out_rows[i] = 0;
    }
    /* conv: the committed inputs and the spine, then a window per node off it; or a
     * window per node */
    int32_t * rows = tp->conv_rows;
    if (!tree_conv_spine(&sh, n, W + 1)) {
        memcpy(rows, tp->windows, (size_t) n * (W + 1) * sizeof(int32_t));
        return;
    }
    for (int k = 0; k < W; k++) {
        rows[k] = k;
    }
    for (int s = 0; s < sh.spine; s++) {
        rows[W + s] = W + steps[s];
    }
    int off = 0;
    for (int i = 0; i < n; i++) {
        tp->conv_out[i] = spine_step[i] >= 0 ? spine_step[i] : 0;
        if (spine_step[i] < 0) {
            memcpy(&rows[W + sh.spine + off * (W + 1)], &tp->windows[(size_t) i * (W + 1)],
                   (size_t) (W + 1) * sizeof(int32_t));
            tp->conv_scatter[off++] = i;
        }
    }
    for (; off < sh.off; off++) {
        memcpy(&rows[W + sh.spine + off * (W + 1)], tp->windows, (size_t) (W + 1) * sizeof(int32_t));
        tp->conv_scatter[off] = n + off;
    }
    for (int i = n; i < n + sh.off; i++) {
        tp->conv_out[i] = 0;
    }
}

/* Validate a tree and derive what its graph needs on the host: depths (positions), the
 * ancestor mask, conv windows and the layout of its recurrence. */
static dfl_status plan_tree(dfl_target * t, const int32_t * parents, int n) {
    tree_plan * tp = &t->tree;
    const int W = t->m.rec.d_conv - 1; /* -1 without recurrent layers: no windows */
    if (n > DFL_MAX_TREE) {
        return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds the supported %d", n, DFL_MAX_TREE);
    }
    tp->n = n;
    for (int i = 0; i < n; i++) {
        const int p = parents[i];
        if (i == 0 ? p != -1 : (p < 0 || p >= i)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "tree node %d has parent %d: node 0 is the root (parent -1) and every "
                            "other node's parent must come before it", i, p);
        }
        tp->parent[i] = p;
        tp->depth[i] = i == 0 ? 0 : tp->depth[p] + 1;
        tp->ancestors[i] = (i == 0 ? 0 : tp->ancestors[p]) | (1ull << i);
        /* conv window: the last W+1 inputs along the path, oldest first; columns 0..W-1
         * of the concatenation are the committed inputs, W+j is node j */
        int32_t * w = &tp->windows[(size_t) i * (W + 1)];
        int node = i;
        for (int k = W; k >= 0; k--) {
            if (node >= 0) {
                w[k] = W + node;
                node = tp->parent[node];
            } else {
                w[k] = w[k + 1] - 1; /* walked past the root: into the committed inputs */
            }
        }
        tp->out_rows[i] = -1;
    }
    if (t->m.n_recurrent > 0) {
        plan_recurrence(t, tp);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_verify_tree(dfl_target * t, const int32_t * tokens, const int32_t * parents, int32_t n) {
    if (!t || !tokens || !parents || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "tree verify needs at least one node");
    }
    if (n > t->p.n_verify) {
        return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds n_verify %d", n, t->p.n_verify);
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
    }
    TRY(plan_tree(t, parents, n));
    TRY(run(t, tokens, n, true, true, LOGITS_ALL, NULL));
    t->pending_verify = n;
    t->pending_tree = true;
    return DFL_OK;
}

/* Keep a root-to-node path of the last tree verify: its KV rows move to consecutive
 * slots, the recurrent state becomes the last node's, the conv state the inputs along
 * the path. */
DFL_API dfl_status dfl_target_commit_path(dfl_target * t, const int32_t * path, int32_t n_keep) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (t->pending_verify == 0 || !t->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "commit_path needs a preceding tree verify");
    }
    const tree_plan * tp = &t->tree;
    if (n_keep < 0 || n_keep > tp->n || (n_keep > 0 && !path)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d tree nodes", n_keep, tp->n);
    }
    for (int k = 0; k < n_keep; k++) {
        const bool ok = path[k] >= 0 && path[k] < tp->n && (k == 0 ? path[k] == 0 : tp->parent[path[k]] == path[k - 1]);
        if (!ok) {
            return dfl_fail(DFL_ERR_ARGUMENT, "path entry %d (node %d) does not continue a root-to-node path", k, path[k]);
        }
    }
    t->pending_verify = 0;
    t->pending_tree = false;
    t->n_out = 0;
    if (n_keep > 0) {
        const int W = t->m.rec.d_conv - 1, last = path[n_keep - 1];
        pending_commit * pc = &t->commit;
        pc->active = true;
        pc->tree = true;
        pc->p0 = t->n_past;
        pc->n_keep = n_keep;
        /* the kept path is no longer than the spine: a larger tree's other rows would be
         * identity steps, each as dear as a real one */
        pc->n_replay = t->m.n_recurrent > 0 ? t->tree.shape.spine : tp->n;
        memcpy(pc->path, path, (size_t) n_keep * sizeof(int32_t));
        for (int j = 0; j < W; j++) {
            pc->conv_cols[j] = tp->windows[(size_t) last * (W + 1) + j + 1];
        }
        t->n_past += n_keep;
    }
    return DFL_OK;
}

static dfl_status check_rows(const dfl_target * t, int32_t row0, int32_t n_rows, int32_t have, const char * what) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > have) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%s rows %d..%d requested, the last call produced %d", what, row0,
                        row0 + n_rows, have);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_logits(const dfl_target * t, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_out : 0, "logit"));
    const size_t row = (size_t) t->m.n_vocab * sizeof(float);
    dfl_runtime_get(&t->rt, t->out_logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_choices(const dfl_target * t, int32_t * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_out : 0, "choices"));
    dfl_runtime_get(&t->rt, t->out_samp->choice, dst, (size_t) row0 * sizeof(int32_t), (size_t) n_rows * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_candidates(const dfl_target * t, int32_t row0, int32_t n_rows, int32_t k,
                                        int32_t * tokens, float * probs) {
    if (!t || t->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "candidates: the last call computed no logits");
    }
    return dfl_sampler_candidates(&t->rt, t->out_samp, t->n_out, row0, n_rows, k, tokens, probs);
}

DFL_API dfl_status dfl_target_set_sampling(dfl_target * t, const dfl_sampling * s) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    return dfl_sampler_set(&t->sampler, s);
}

DFL_API dfl_status dfl_target_set_uniforms(dfl_target * t, const float * u, int32_t n) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    return dfl_sampler_stage_uniforms(&t->sampler, u, n);
}

DFL_API dfl_status dfl_target_set_penalties(dfl_target * t, const int32_t * tokens, const float * counts,
                                           int32_t n_rows, int32_t per_row) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    return dfl_sampler_stage_penalties(&t->sampler, tokens, counts, n_rows, per_row, t->m.n_vocab);
}

DFL_API dfl_status dfl_target_features(const dfl_target * t, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_rows : 0, "feature"));
    if (t->p.n_feature_layers == 0) {
        return dfl_fail(DFL_ERR_STATE, "the target was loaded without feature layers");
    }
    const size_t row = t->features->nb[1];
    dfl_runtime_get(&t->rt, t->features, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

/* ---- what the drafter may read ------------------------------------------------------- */

const dfl_gguf * dfl_target_file(const dfl_target * t) { return &t->m.file; }
int dfl_target_n_vocab(const dfl_target * t) { return t->m.n_vocab; }
int dfl_target_n_embd(const dfl_target * t) { return t->m.n_embd; }
int dfl_target_n_layer(const dfl_target * t) { return t->m.n_layer; }
int dfl_target_n_ctx(const dfl_target * t) { return t->p.n_ctx; }
int dfl_target_n_ubatch(const dfl_target * t) { return t->p.n_ubatch; }
int dfl_target_n_threads(const dfl_target * t) { return t->rt.n_threads; }
bool dfl_target_repack(const dfl_target * t) { return !t->p.no_repack; }
ggml_backend_dev_t dfl_target_device(const dfl_target * t) { return t->rt.dev; }
bool dfl_target_on_cpu(const dfl_target * t) { return t->rt.dev == t->rt.dev_cpu; }
struct ggml_tensor * dfl_target_tok_embd(const dfl_target * t) { return t->tok_lookup; }
struct ggml_tensor * dfl_target_lm_head(const dfl_target * t) { return t->m.output; }
struct ggml_tensor * dfl_target_feature_tensor(const dfl_target * t) { return t->features; }
int dfl_target_feature_rows(const dfl_target * t) { return t->n_rows; }

int dfl_target_feature_layers(const dfl_target * t, int32_t * layers, int max_n) {
    const int n = t->p.n_feature_layers < max_n ? t->p.n_feature_layers : max_n;
    memcpy(layers, t->p.feature_layers, (size_t) n * sizeof(int32_t));
    return t->p.n_feature_layers;
}
