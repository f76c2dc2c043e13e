/* Target runtime: loading and placement, the steps (decodes, chain and tree verifies
 * of one or several sequences in one graph), commits and graph reuse. The state lives
 * in the memory layer (dfl_memory.h); graphs are built in dfl_target_graph.c from the
 * step's descriptor over the architecture's layer builders (dfl_model.h): nothing here
 * depends on the architecture, only on the kinds of its layers. */
#include "dfl_target_impl.h"
#include "dfl_token_source.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The attention window grows in steps so that graphs of consecutive steps share shapes. */
#define KV_PAD 256


static dfl_status check_seq(const dfl_target * t, int32_t seq) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (seq < 0 || seq >= t->mem.n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d is outside 0..%d (the target has %d sequence slots)", seq,
                        t->mem.n_seq - 1, t->mem.n_seq);
    }
    return DFL_OK;
}

DFL_API void dfl_target_default_params(dfl_target_params * p) {
    memset(p, 0, sizeof *p);
    p->n_ctx = 4096;
    p->n_seq = 1;
    p->n_ubatch = 512;
    p->n_verify = 16;
    p->kv_type = GGML_TYPE_F16;
    p->kv_type_v = -1;
    p->n_gpu_layers = -1;
    p->rope_scaling_type = -1;
}

static dfl_status check_params(const dfl_model * m, dfl_target_params * p) {
    /* a bad value is refused, never replaced: dfl_target_default_params gives defaults */
    const struct { const char * name; int32_t value; } sizes[] = {
        { "n_ctx", p->n_ctx }, { "n_seq", p->n_seq }, { "n_ubatch", p->n_ubatch }, { "n_verify", p->n_verify } };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (sizes[i].value <= 0) {
            return dfl_fail(DFL_ERR_ARGUMENT, "%s must be positive, got %d", sizes[i].name, sizes[i].value);
        }
    }
    if (p->n_threads < 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_threads must be 0 (every CPU this process may use) or positive, got %d",
                        p->n_threads);
    }
    if (p->n_seq > DFL_MAX_SEQ) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_seq (%d) exceeds the supported %d sequences", p->n_seq, DFL_MAX_SEQ);
    }
    const dfl_rope_scaling * r = &m->rope;
    if (r->ext_factor != 0.0f && (double) p->n_ctx > (double) r->n_ctx_orig / r->freq_scale) {
        return dfl_fail(DFL_ERR_ARGUMENT, "context size %d is past what YaRN covers: factor %g over the original "
                        "context %d is %.0f positions", p->n_ctx, 1.0 / r->freq_scale, r->n_ctx_orig,
                        (double) r->n_ctx_orig / r->freq_scale);
    }
    /* a prompt chunk never holds more than the context: a larger n_ubatch only means whole prompts */
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

static dfl_status host_reserve(dfl_target * t, int n, size_t mask) {
    if ((size_t) n > t->host_rows) {
        free(t->host_i32);
        free(t->host_i64);
        t->host_i32 = malloc((size_t) n * sizeof(int32_t));
        t->host_i64 = malloc((size_t) n * sizeof(int64_t));
        t->host_rows = (size_t) n;
    }
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

/* A step of every sequence's rows of one kind at the end of a full context, each
 * carrying a commit (commit NULL: none), its rows sampled over the whole vocabulary
 * (the sampling stage that holds the most: a few vocabulary-wide intermediates per
 * row). */
static dfl_step full_step(const dfl_target * t, int kind, int n, const tree_plan * tree, const pending_commit * commit) {
    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = t->mem.n_seq;
    step.n_rows = step.n_out = n * t->mem.n_seq;
    step.samp.pick = DFL_PICK_FULL;
    for (int s = 0; s < step.n_seg; s++) {
        step.seg[s] = (dfl_segment) { s, kind, n, s * n, t->p.n_ctx - n, t->p.n_ctx, LOGITS_ALL, tree, commit, NULL,
                                      tree ? tree->shape : (tree_shape) { 0 }, commit ? (commit->tree ? 2 : 1) : 0,
                                      commit ? commit->n_replay : 0 };
    }
    return step;
}

/* A full step whose last sequence brings a prompt chunk of n tokens instead of its
 * verify (the chunk's last row sampled, its features kept), as a batch of running
 * sequences has a joining prompt's chunk follow their rows. */
static void shared_chunk_step(const dfl_target * t, dfl_step * step, int n) {
    const int last = step->n_seg - 1;
    const int row0 = step->seg[last].row0;
    step->seg[last] = (dfl_segment) { last, DFL_STEP_DECODE, n, row0, t->p.n_ctx - n, t->p.n_ctx, LOGITS_LAST,
                                      NULL, NULL, NULL, { 0 }, 0, 0 };
    step->n_rows = row0 + n;
    step->n_out = row0 + 1;
}

dfl_status dfl_target_worst_graphs(dfl_target * t, dfl_graph_visit visit, void * user) {
    dfl_runtime * rt = &t->rt;
    graph_inputs in;
    const int n_ctx = t->p.n_ctx;

    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = 1;
    step.n_rows = t->p.n_ubatch;
    step.n_out = 1;
    step.samp.pick = DFL_PICK_FULL;
    step.seg[0] = (dfl_segment) { 0, DFL_STEP_DECODE, t->p.n_ubatch, 0, n_ctx - t->p.n_ubatch, n_ctx, LOGITS_LAST,
                                  NULL, NULL, NULL, { 0 }, 0, 0 };
    visit(rt, 0, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, 0), &in), user);

    tree_plan * worst = calloc(1, sizeof *worst);
    if (!worst) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    const int n_tree = dfl_target_max_tree_nodes(t);
    worst->n = n_tree;
    worst->shape = dfl_tree_worst_shape(n_tree);
    const pending_commit tree_commit = { .active = true, .tree = true, .n_keep = 1, .n_replay = t->p.n_verify };
    /* a chain commit has nothing to do without recurrent layers */
    const pending_commit chain_commit = { .active = true, .tree = false, .n_keep = 1, .n_replay = t->p.n_verify };
    /* a prompt's chunk sharing the prefill slot's step with every other slot's rows, as
     * many tokens as they leave of n_ubatch (check_shared_chunk): beside their largest
     * verifies (trees, chains: the most rows sampled) and beside one-token decodes (the
     * largest chunk); the steps between hold no more */
    for (int k = 0; t->mem.n_seq > 1 && k < 3; k++) {
        const int others = t->mem.n_seq - 1;
        const int each = k == 0 ? n_tree : (k == 1 ? t->p.n_verify : 1);
        const int chunk = t->p.n_ubatch - others * each;
        if (chunk <= t->p.n_verify) {
            continue; /* a decode of a verify's size: a step slot takes it */
        }
        step = k == 0 ? full_step(t, DFL_STEP_TREE, n_tree, worst, &tree_commit)
             : k == 1 ? full_step(t, DFL_STEP_CHAIN, t->p.n_verify, NULL, t->m.n_recurrent > 0 ? &chain_commit : NULL)
                      : full_step(t, DFL_STEP_DECODE, 1, NULL, NULL);
        shared_chunk_step(t, &step, chunk);
        visit(rt, 0, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, 0), &in), user);
    }
    for (int slot = 1; slot < rt->n_slots; slot++) {
        step = full_step(t, DFL_STEP_TREE, n_tree, worst, &tree_commit);
        visit(rt, slot, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, slot), &in), user);
        step = full_step(t, DFL_STEP_CHAIN, t->p.n_verify, NULL, t->m.n_recurrent > 0 ? &chain_commit : NULL);
        visit(rt, slot, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, slot), &in), user);
    }
    free(worst);
    return DFL_OK;
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
        if (t->placed && t->placed[i]) {
            dev_of[i] = t->placed[i];
        } else if (sscanf(name, "blk.%d.", &il) == 1) {
            dev_of[i] = il < t->m.n_layer ? layer_device(t, il) : t->rt.dev_cpu;
        } else if (strcmp(name, "token_embd.weight") == 0 && t->m.output != t->m.tok_embd) {
            dev_of[i] = t->rt.dev_cpu;
        } else {
            dev_of[i] = output_device(t);
        }
    }
    return dev_of;
}

/* Bytes of the layers' weights that stay in host memory while the model runs on another
 * device: what its verifies compute on the CPU. */
static uint64_t host_layer_weights(const dfl_target * t, ggml_backend_dev_t const * dev_of) {
    const dfl_gguf * g = &t->m.file;
    uint64_t bytes = 0;
    int il;
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta) && t->rt.dev != t->rt.dev_cpu; i++) {
        const char * name = gguf_get_tensor_name(g->meta, i);
        if (g->used[i] && dev_of[i] == t->rt.dev_cpu && sscanf(name, "blk.%d.", &il) == 1) {
            bytes += ggml_nbytes(ggml_get_tensor(g->ctx, name));
        }
    }
    return bytes;
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
    t->host_layer_weights = host_layer_weights(t, dev_of);
    dfl_status st = dfl_gguf_load_weights(&t->m.file, dev_of, !t->p.no_repack);
    free(dev_of);
    for (int i = 0; st == DFL_OK && i < t->m.file.n_sliced; i++) {
        if (t->m.file.sliced[i].whole == t->m.tok_embd) {
            st = copy_lookup_to_host(t);
        }
    }
    return st;
}

dfl_status dfl_check_head_tokens(const int32_t * ids, int n, int n_vocab, const char * path) {
    if (n == 0) {
        return DFL_OK;
    }
    if (n < 0 || n > n_vocab || !ids) {
        return dfl_fail(DFL_ERR_ARGUMENT, "an output head cut to %d tokens: keep 1..%d (the vocabulary of '%s'), "
                        "or 0 for the whole head", n, n_vocab, path);
    }
    uint8_t * seen = calloc((size_t) n_vocab, 1);
    if (!seen) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    dfl_status st = DFL_OK;
    for (int i = 0; i < n && st == DFL_OK; i++) {
        const int32_t tok = ids[i];
        if (tok < 0 || tok >= n_vocab) {
            st = dfl_fail(DFL_ERR_ARGUMENT, "kept head token %d (entry %d) is outside the vocabulary 0..%d", tok, i,
                          n_vocab - 1);
        } else if (seen[tok]++) {
            st = dfl_fail(DFL_ERR_ARGUMENT, "kept head token %d is listed twice", tok);
        }
    }
    free(seen);
    return st;
}

/* The head cut to the kept tokens' rows of the output weight (tied: of the embedding). */
static dfl_status cut_head(dfl_target * t, const dfl_target_params * p) {
    if (!p || p->n_head_tokens == 0) {
        return DFL_OK;
    }
    TRY(dfl_gguf_weight_rows(&t->m.file, t->m.output, p->head_tokens, p->n_head_tokens, !t->p.no_repack,
                             &t->ctx_head, &t->buf_head, &t->head));
    t->n_head = p->n_head_tokens;
    return DFL_OK;
}

static void verify_reset(verify_seq * v) {
    v->pending = 0;
    v->pending_tree = false;
    v->commit.active = false;
    v->last_chain = 0;
    v->chain_steady = DFL_CHAIN_STEADY;
}

/* Caches and recurrent states live with their layer's weights (the memory's tensors on
 * the device or on the CPU), the features with the output. Tensors only: alloc_state
 * gives them memory. */
dfl_status dfl_target_define_state(dfl_target * t) {
    bool on_device[DFL_MAX_LAYERS];
    for (int il = 0; il < t->m.n_layer; il++) {
        on_device[il] = layer_device(t, il) == t->rt.dev;
    }
    const dfl_memory_layout layout = { t->m.n_layer, t->m.kind, t->m.attn, &t->m.rec };
    const int call_rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
    const dfl_memory_params mp = { .n_seq = t->p.n_seq, .n_ctx = t->p.n_ctx, .n_ubatch = t->p.n_ubatch,
                                   .n_verify = t->p.n_verify, .type_k = (enum ggml_type) t->p.kv_type,
                                   .type_v = (enum ggml_type) t->p.kv_type_v, .on_device = on_device,
                                   .window_rows = call_rows, .spare = 0,
                                   .feature_floats = t->p.n_feature_layers * t->m.n_embd,
                                   .features_on_device = output_device(t) == t->rt.dev, .state_floats = 0 };
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        verify_reset(&t->verify[s]);
    }
    return dfl_memory_define(&t->mem, &layout, &mp);
}

static dfl_status alloc_state(dfl_target * t) {
    TRY(dfl_target_define_state(t));
    const ggml_backend_dev_t devs[2] = { t->rt.dev, t->rt.dev_cpu };
    return dfl_memory_alloc(&t->mem, devs);
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
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        dfl_sampler_init(&t->sampler[s]);
    }
    if (params) {
        t->p = *params;
    } else {
        dfl_target_default_params(&t->p);
    }
    t->p.device = NULL; /* the caller's strings are not ours to keep */
    t->p.weight_placements = NULL;
    t->p.n_weight_placements = 0;
    t->p.head_tokens = NULL;
    t->p.n_head_tokens = 0;

    dfl_status st = dfl_model_open(path, &t->m);
    if (st != DFL_OK) {
        free(t);
        return st;
    }
    t->tok_lookup = t->m.tok_embd;
    t->head = t->m.output; /* a memory plan counts the whole head */
    t->n_head = t->m.n_vocab;
    st = params ? dfl_check_head_tokens(params->head_tokens, params->n_head_tokens, t->m.n_vocab, path) : DFL_OK;
    if (st == DFL_OK) {
        st = dfl_model_rope_scaling(&t->m, t->p.rope_scaling_type, t->p.rope_freq_scale, t->p.yarn_orig_ctx);
    }
    if (st == DFL_OK) {
        st = check_params(&t->m, &t->p);
    }
    if (st == DFL_OK) {
        /* a tree verify's recurrence adds a few dozen graph nodes per recurrent layer,
         * whatever the tree's size; every further sequence in a step its own attention,
         * convolution and delta rule per layer */
        const size_t n_seq = (size_t) t->p.n_seq;
        const size_t graph_size = DFL_GRAPH_SIZE + (size_t) t->m.n_layer * DFL_GRAPH_NODES_PER_LAYER +
                                  (n_seq - 1) * (size_t) t->m.n_layer * DFL_GRAPH_NODES_PER_SEQ +
                                  n_seq * (size_t) t->m.n_recurrent * 48;
        st = dfl_runtime_init(&t->rt, params ? params->device : NULL, t->p.n_threads, "target", graph_size,
                              DFL_MAX_GRAPH_SLOTS);
    }
    /* Verifies and decodes (every slot but the prefill chunks' 0) compute a weight that
     * lives in host memory on the CPU, whatever their rows: a batch of sequences' verifies
     * would otherwise copy routed experts kept there to the device on every step. */
    if (st == DFL_OK) {
        st = dfl_runtime_set_op_offload(&t->rt, 1, false);
    }
    if (st == DFL_OK && params && params->n_weight_placements != 0) {
        t->placed = calloc((size_t) gguf_get_n_tensors(t->m.file.meta) + 1, sizeof *t->placed);
        st = t->placed ? dfl_gguf_place_by_name(&t->m.file, params->weight_placements, params->n_weight_placements,
                                                t->rt.dev, t->rt.dev_cpu, t->placed)
                       : dfl_fail(DFL_ERR_BACKEND, "out of host memory");
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
        st = cut_head(t, params);
    }
    if (st == DFL_OK) {
        st = alloc_state(t);
    }
    if (st == DFL_OK) {
        /* compute memory for the worst graphs now, as the plan counts it: taken later it
         * would grow with the longest context seen (a server's resident memory crept up
         * for thousands of requests), and fail mid-run rather than at load */
        dfl_status reserved = DFL_OK;
        st = dfl_target_worst_graphs(t, dfl_runtime_reserve_visit, &reserved);
        if (st == DFL_OK) {
            st = reserved;
        }
    }
    if (st == DFL_OK) {
        /* the same for the host staging of graph inputs: the rows of the largest step and
         * the mask of its largest segment (rows by attention span) */
        const int seg_rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
        const int batch_rows = t->mem.n_seq * t->p.n_verify;
        const int rows = batch_rows > seg_rows ? batch_rows : seg_rows;
        st = host_reserve(t, rows, (size_t) seg_rows * (size_t) t->p.n_ctx);
        if (st == DFL_OK) {
            memset(t->host_i32, 0, t->host_rows * sizeof(int32_t));
            memset(t->host_i64, 0, t->host_rows * sizeof(int64_t));
            memset(t->host_mask, 0, t->host_mask_size * sizeof(ggml_fp16_t));
        }
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
    dfl_memory_free(&t->mem);
    if (t->buf_lookup) ggml_backend_buffer_free(t->buf_lookup);
    if (t->ctx_lookup) ggml_free(t->ctx_lookup);
    if (t->buf_head) ggml_backend_buffer_free(t->buf_head);
    if (t->ctx_head) ggml_free(t->ctx_head);
    dfl_runtime_free(&t->rt);
    free(t->placed);
    dfl_model_close(&t->m);
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        dfl_sampler_free(&t->sampler[s]);
    }
    free(t->host_i32);
    free(t->host_i64);
    free(t->host_mask);
    free(t->out_choices);
    free(t->out_params);
    free(t->out_cand);
    free(t->out_cand_p);
    free(t);
}

/* The last graph computed: its splits (runs on one backend) and the bytes the scheduler
 * copies between devices per compute. */
static void last_copies(const dfl_target * t, int64_t copies[2]) {
    const int last = t->rt.last_slot;
    copies[0] = last >= 0 ? ggml_backend_sched_get_n_splits(t->rt.slots[last].sched) : 0;
    copies[1] = last >= 0 ? t->rt.slots[last].copy_bytes : 0;
}

DFL_API dfl_status dfl_target_get_info(const dfl_target * t, dfl_target_info * info) {
    if (!t || !info) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    memset(info, 0, sizeof *info);
    info->n_vocab = t->m.n_vocab;
    info->n_head = t->n_head;
    info->n_embd = t->m.n_embd;
    info->n_layer = t->m.n_layer;
    info->n_ctx_train = t->m.n_ctx_train;
    info->n_ctx = t->p.n_ctx;
    info->n_ubatch = t->p.n_ubatch;
    info->n_verify = t->p.n_verify;
    info->n_seq = t->mem.n_seq;
    info->n_past = t->mem.seq[0].n_past;
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
    info->host_layer_weights = t->host_layer_weights;
    info->copy_bytes = t->rt.traffic->copy_bytes;
    int64_t copies[2];
    last_copies(t, copies);
    info->n_last_splits = (int32_t) copies[0];
    info->last_copy_bytes = copies[1];
    return DFL_OK;
}

DFL_API dfl_status dfl_target_last_placement(const dfl_target * t, dfl_placement * out) {
    if (!t || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    return dfl_runtime_placement(&t->rt, out);
}

void dfl_target_seq_restored(dfl_target * t, int seq, int n_past) {
    dfl_memory_seq_restored(&t->mem, seq, n_past);
    verify_reset(&t->verify[seq]);
}

bool dfl_target_seq_settled(const dfl_target * t, int seq) {
    return !t->verify[seq].pending && !t->verify[seq].commit.active;
}

DFL_API dfl_status dfl_target_reset(dfl_target * t) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    dfl_memory_clear(&t->mem);
    t->n_last_replay = 0;
    /* the graphs stay: a graph's key holds everything its shape depends on (the context
     * length enters through inputs), so a new request reuses them */
    t->n_out = 0;
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        verify_reset(&t->verify[s]);
        t->sampler[s].n_u = 0;
        t->sampler[s].pen_rows = 0;
        t->sampler[s].mask_rows = 0;
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_reset(dfl_target * t, int32_t seq) {
    TRY(check_seq(t, seq));
    dfl_memory_seq_clear(&t->mem, seq);
    verify_reset(&t->verify[seq]);
    t->sampler[seq].n_u = 0;
    t->sampler[seq].pen_rows = 0;
    t->sampler[seq].mask_rows = 0;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_copy(dfl_target * t, int32_t src, int32_t dst) {
    TRY(check_seq(t, src));
    TRY(check_seq(t, dst));
    if (!dfl_target_seq_settled(t, src)) {
        return dfl_fail(DFL_ERR_STATE, "sequence %d is between a verify and its commit: copy it after a decode", src);
    }
    TRY(dfl_memory_seq_copy(&t->mem, src, dst));
    verify_reset(&t->verify[dst]);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_truncate(dfl_target * t, int32_t seq, int32_t n_past) {
    TRY(check_seq(t, seq));
    const dfl_seq * q = &t->mem.seq[seq];
    if (!dfl_target_seq_settled(t, seq)) {
        return dfl_fail(DFL_ERR_STATE, "sequence %d is between a verify and its commit: truncate it after a decode",
                        seq);
    }
    if (t->m.n_recurrent > 0) {
        return dfl_fail(DFL_ERR_STATE, "a recurrent state cannot go back to an earlier position: %s has %d "
                        "recurrent layers", t->m.arch->name, t->m.n_recurrent);
    }
    if (n_past < 0 || n_past > q->n_past) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot truncate sequence %d of %d positions to %d", seq, q->n_past, n_past);
    }
    /* a sliding layer's ring row holds the newest position written to it; the mask takes
     * a row past the kept positions for the one R positions earlier, which the window must
     * not reach: at most R - window positions can be dropped */
    const int slack = t->mem.swa_window > 0 ? t->mem.swa_ring - t->mem.swa_window : t->mem.n_ctx;
    if (t->mem.swa_ring < t->mem.n_ctx && q->n_past - n_past > slack) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot drop %d positions of sequence %d: its sliding layers' rings keep %d "
                        "past their window", q->n_past - n_past, seq, slack);
    }
    dfl_target_seq_restored(t, seq, n_past);
    return DFL_OK;
}

DFL_API int32_t dfl_target_n_past(const dfl_target * t, int32_t seq) {
    return t && seq >= 0 && seq < t->mem.n_seq ? t->mem.seq[seq].n_past : -1;
}

/* Whether two steps build the same graph (only their inputs differ). */
static bool same_shape(const dfl_step * a, const dfl_step * b) {
    if (a->n_seg != b->n_seg || memcmp(&a->samp, &b->samp, sizeof a->samp) != 0) {
        return false;
    }
    for (int i = 0; i < a->n_seg; i++) {
        const dfl_segment * x = &a->seg[i], * y = &b->seg[i];
        const bool same = x->seq == y->seq && x->kind == y->kind && x->n == y->n && x->n_kv == y->n_kv &&
                          x->logits == y->logits && x->tokens_src == y->tokens_src &&
                          x->commit_kind == y->commit_kind && x->commit_replay == y->commit_replay &&
                          memcmp(&x->shape, &y->shape, sizeof x->shape) == 0;
        if (!same) {
            return false;
        }
    }
    return true;
}

/* A step with a prefill chunk (a decode longer than a verify). */
static bool large_step(const dfl_target * t, const dfl_step * step) {
    for (int i = 0; i < step->n_seg; i++) {
        if (step->seg[i].n > t->p.n_verify) {
            return true;
        }
    }
    return false;
}

/* The slot holding a graph of this step's shape, or the one to build it in (marked
 * invalid): graphs with a prefill chunk always take slot 0, so that the other slots'
 * compute memory stays verify-sized; the rest take the least recently used. */
static int graph_slot(dfl_target * t, const dfl_step * step) {
    const int n_slots = t->rt.n_slots;
    for (int i = 0; i < n_slots; i++) {
        if (t->graphs[i].valid && same_shape(&t->graphs[i].key, step)) {
            return i;
        }
    }
    int slot = 0;
    if (!large_step(t, step)) {
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

/* How the step's logits rows choose: each segment's sequence's sampling, merged (rows of
 * sequences that pick differently each pick their own way: see dfl_sampler_key). */
static dfl_status step_sampling(dfl_target * t, dfl_step * step) {
    memset(&step->samp, 0, sizeof step->samp);
    bool first = true;
    int n_rows = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int n_out = s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if (n_out == 0) {
            continue;
        }
        dfl_sampler_key key;
        TRY(dfl_sampler_key_for(&t->sampler[s->seq], n_out, t->n_head, &key));
        if (first) {
            step->samp = key;
        } else {
            dfl_sampler_key_merge(&step->samp, &key);
        }
        first = false;
        n_rows += n_out;
    }
    /* by candidates where top-k is a partial sort: where it sorts whole rows (Vulkan), the
     * sort would cost more than masking in place */
    dfl_sampler_key_settle(&step->samp, n_rows, t->n_head, !t->rt.top_k_by_sort);
    step->samp.by_sort = t->rt.top_k_by_sort;
    return DFL_OK;
}

static dfl_status fill_sampling(dfl_target * t, const dfl_step * step, const graph_inputs * in) {
    dfl_sampler_part parts[DFL_MAX_SEQ];
    int n = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int n_out = s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if (n_out > 0) {
            const dfl_sampler * smp = &t->sampler[s->seq];
            t->out_part[n].seq = s->seq;
            t->out_part[n].n_rows = n_out;
            t->out_part[n].mask_gen = smp->mask_rows > 0 ? smp->mask_gen : 0;
            parts[n++] = (dfl_sampler_part) { &t->sampler[s->seq], n_out };
        }
    }
    t->n_out_parts = n;
    t->choices_decided = false;
    t->out_redone = false;
    if (n == 0) {
        return DFL_OK;
    }
    TRY(dfl_sampler_fill_parts(parts, n, &t->rt, &in->samp, &step->samp, t->n_head));
    if (step->samp.masked == DFL_MASK_CANDIDATES && step->samp.pick != DFL_PICK_ARGMAX) {
        /* the host staging of the first part's sampler holds the settings just filled */
        const int m = step->n_out * DFL_SAMPLER_PARAMS;
        if (!dfl_reserve((void **) &t->out_params, &t->cap_out_params, m, sizeof(float))) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        memcpy(t->out_params, parts[0].smp->host_params, (size_t) m * sizeof(float));
    }
    return DFL_OK;
}

/* Run a step whose segments are set (sequence, kind, rows, length, logits, tree plan,
 * commit, token source): their rows, attention spans, the logits rows and the sampling
 * are worked out here; the graph of a step of this shape is reused when one is kept. */
static dfl_status run_step(dfl_target * t, dfl_step * step, const int32_t * const * tokens) {
    int rows = 0, n_out = 0;
    size_t mask = 0;
    for (int i = 0; i < step->n_seg; i++) {
        dfl_segment * s = &step->seg[i];
        s->row0 = rows;
        rows += s->n;
        s->shape = s->kind == DFL_STEP_TREE ? s->tree->shape : (tree_shape) { 0 };
        s->commit_kind = s->commit ? (s->commit->tree ? 2 : 1) : 0;
        s->commit_replay = s->commit ? s->commit->n_replay : 0;
        s->n_kv = ((s->n_past + s->n + KV_PAD - 1) / KV_PAD) * KV_PAD;
        if (s->n_kv > t->p.n_ctx) {
            s->n_kv = t->p.n_ctx;
        }
        n_out += s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if ((size_t) s->n * (size_t) s->n_kv > mask) {
            mask = (size_t) s->n * (size_t) s->n_kv;
        }
    }
    step->n_rows = rows;
    step->n_out = n_out;
    /* commit inputs have n_verify rows */
    TRY(host_reserve(t, rows > t->p.n_verify ? rows : t->p.n_verify, mask));
    TRY(step_sampling(t, step));

    /* steps of a shape seen lately reuse its graph and allocation, only the inputs
     * change: plain decoding, chain steps (the commit they carry is an input), tree
     * steps with as many nodes whatever the tree, and `auto` going back and forth
     * between the chain and a few tree sizes */
    const int slot = graph_slot(t, step);
    graph_cache * gc = &t->graphs[slot];
    t->n_graphs++;
    if (!gc->valid) {
        t->n_graph_builds++;
        gc->gf = dfl_target_build_graph(t, step, dfl_runtime_begin_graph(&t->rt, slot), &gc->in);
        TRY(dfl_runtime_alloc(&t->rt, slot, gc->gf));
        gc->key = *step;
        gc->valid = true;
    }
    gc->last_use = ++t->graph_clock;
    t->out = gc;
    dfl_target_fill_inputs(t, &gc->in, step, tokens);
    TRY(fill_sampling(t, step, &gc->in));
    TRY(dfl_runtime_compute(&t->rt, slot, gc->gf));
    t->n_last_replay = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const pending_commit * pc = step->seg[i].commit;
        if (pc && t->m.n_recurrent > 0 && pc->n_replay > t->n_last_replay) {
            t->n_last_replay = pc->n_replay;
        }
    }
    t->n_out = n_out;
    return DFL_OK;
}

/* An entry of a step, checked against its sequence's state; its device token source. */
static dfl_status check_entry(const dfl_target * t, const dfl_token_source * src, const dfl_rows * r,
                              struct ggml_tensor ** tokens_src) {
    TRY(check_seq(t, r->seq));
    const dfl_seq * q = &t->mem.seq[r->seq];
    const verify_seq * vq = &t->verify[r->seq];
    *tokens_src = NULL;
    switch (r->kind) {
        case DFL_STEP_DECODE:
            if (r->n <= 0 || !r->tokens) {
                return dfl_fail(DFL_ERR_ARGUMENT, "decode needs at least one token");
            }
            if (r->n > t->p.n_ubatch) {
                return dfl_fail(DFL_ERR_CAPACITY, "decode of %d tokens exceeds the ubatch size %d", r->n, t->p.n_ubatch);
            }
            if (r->logits < LOGITS_NONE || r->logits > LOGITS_ALL) {
                return dfl_fail(DFL_ERR_ARGUMENT, "logits mode must be 0, 1 or 2");
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "a verify is waiting for dfl_target_commit");
            }
            break;
        case DFL_STEP_CHAIN:
            if (r->n <= 0) {
                return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target and at least one token");
            }
            if (r->n > t->p.n_verify) {
                return dfl_fail(DFL_ERR_CAPACITY, "verify of %d tokens exceeds n_verify %d", r->n, t->p.n_verify);
            }
            if (!r->tokens) {
                if (!src) {
                    return dfl_fail(DFL_ERR_ARGUMENT, "verify needs tokens or a drafter whose block to read");
                }
                if (src->target != t) {
                    return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
                }
                if (r->n > src->n[r->seq]) {
                    return dfl_fail(DFL_ERR_STATE, "the drafter's last block has fewer than %d tokens", r->n);
                }
                *tokens_src = src->tokens[r->seq];
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
            }
            break;
        case DFL_STEP_TREE:
            if (r->n <= 0 || !r->tokens || !r->parents) {
                return dfl_fail(DFL_ERR_ARGUMENT, "tree verify needs at least one node");
            }
            if (r->n > t->p.n_verify) {
                return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds n_verify %d", r->n, t->p.n_verify);
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
            }
            break;
        default:
            return dfl_fail(DFL_ERR_ARGUMENT, "unknown step kind %d", r->kind);
    }
    for (int i = 0; r->tokens && i < r->n; i++) {
        if (r->tokens[i] < 0 || r->tokens[i] >= t->m.n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "token id %d at index %d is outside the vocabulary (0..%d)", r->tokens[i],
                            i, t->m.n_vocab - 1);
        }
    }
    if (q->n_past + r->n > t->p.n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: %d tokens in context + %d new > context size %d",
                        q->n_past, r->n, t->p.n_ctx);
    }
    return DFL_OK;
}

/* A prompt chunk (a decode of more than n_verify tokens) shares a step with other
 * sequences' rows when the step holds no more rows than a chunk alone (n_ubatch), one
 * chunk a step: the graphs the load reserves the prefill slot for. */
static dfl_status check_shared_chunk(const dfl_target * t, const dfl_rows * rows, int n) {
    int chunks = 0, total = 0;
    for (int i = 0; i < n; i++) {
        chunks += rows[i].kind == DFL_STEP_DECODE && rows[i].n > t->p.n_verify;
        total += rows[i].n;
    }
    if (n > 1 && chunks > 1) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step takes one prompt chunk (a decode of more than n_verify %d), got %d",
                        t->p.n_verify, chunks);
    }
    if (n > 1 && chunks && total > t->p.n_ubatch) {
        return dfl_fail(DFL_ERR_CAPACITY, "a step with a prompt chunk holds at most the ubatch size %d rows, got %d",
                        t->p.n_ubatch, total);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_step(dfl_target * t, const dfl_token_source * source, const dfl_rows * rows,
                                   int32_t n) {
    if (!t || !rows || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step needs a target and at least one sequence's rows");
    }
    if (n > t->mem.n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step of %d sequences exceeds the target's %d slots", n, t->mem.n_seq);
    }
    TRY(check_shared_chunk(t, rows, n));
    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = n;
    const int32_t * tokens[DFL_MAX_SEQ];
    bool seen[DFL_MAX_SEQ] = { false };
    for (int i = 0; i < n; i++) {
        const dfl_rows * r = &rows[i];
        struct ggml_tensor * src;
        TRY(check_entry(t, source, r, &src));
        if (seen[r->seq]) {
            return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d appears twice in one step", r->seq);
        }
        seen[r->seq] = true;
        const dfl_seq * q = &t->mem.seq[r->seq];
        verify_seq * vq = &t->verify[r->seq];
        if (r->kind == DFL_STEP_TREE) {
            TRY(dfl_tree_plan(&vq->tree, &t->tree_shapes, r->parents, r->n, t->m.n_recurrent > 0 ? t->m.rec.d_conv : 0));
        }
        step.seg[i] = (dfl_segment) { r->seq, r->kind, r->n, 0, q->n_past, 0,
                                      r->kind == DFL_STEP_DECODE ? r->logits : LOGITS_ALL,
                                      r->kind == DFL_STEP_TREE ? &vq->tree : NULL,
                                      vq->commit.active ? &vq->commit : NULL, src, { 0 }, 0, 0 };
        step.seg[i].feat_at = dfl_memory_features_at(&t->mem, r->seq, q->n_past, r->n,
                                                     dfl_token_source_taken(source, t, r->seq));
        tokens[i] = r->tokens;
    }
    TRY(run_step(t, &step, tokens));
    for (int i = 0; i < n; i++) {
        const dfl_segment * s = &step.seg[i];
        dfl_seq * q = &t->mem.seq[s->seq];
        verify_seq * vq = &t->verify[s->seq];
        vq->commit.active = false;
        /* the slot's feature rows hold this call's rows now: a decode's are committed, a
         * verify's wait for its commit */
        dfl_memory_features_written(&t->mem, s->seq, q->n_past, s->n, s->kind == DFL_STEP_DECODE ? s->n : 0,
                                    s->feat_at);
        if (s->kind == DFL_STEP_DECODE) {
            q->n_past += s->n;
        } else {
            vq->pending = s->n;
            vq->pending_tree = s->kind == DFL_STEP_TREE;
        }
    }
    return DFL_OK;
}

/* Plain decoding's step, one call a token: the host loop crosses into the library once
 * per step instead of once per input staged and result read. */
DFL_API dfl_status dfl_target_decode_next(dfl_target * t, const dfl_token_source * source, const int32_t * seqs,
                                          const int32_t * tokens, const float * u, int32_t n, int32_t * choices,
                                          int64_t * copies) {
    if (!t || !seqs || !tokens || !choices || n <= 0 || n > DFL_MAX_SEQ) {
        return dfl_fail(DFL_ERR_ARGUMENT, "decode_next needs a target and 1..%d sequences' tokens and choices",
                        DFL_MAX_SEQ);
    }
    dfl_rows rows[DFL_MAX_SEQ];
    for (int i = 0; i < n; i++) {
        TRY(check_seq(t, seqs[i]));
        if (u && u[i] >= 0.0f) {
            TRY(dfl_sampler_stage_uniforms(&t->sampler[seqs[i]], &u[i], 1));
        }
        rows[i] = (dfl_rows) { seqs[i], DFL_STEP_DECODE, 1, &tokens[i], NULL, LOGITS_LAST };
    }
    TRY(dfl_target_step(t, source, rows, n));
    TRY(dfl_target_choices(t, choices, 0, n));
    if (copies) {
        last_copies(t, copies);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_commit(dfl_target * t, int32_t seq, int32_t n_keep) {
    TRY(check_seq(t, seq));
    dfl_seq * q = &t->mem.seq[seq];
    verify_seq * vq = &t->verify[seq];
    const int n = vq->pending;
    if (n == 0) {
        return dfl_fail(DFL_ERR_STATE, "commit without a preceding verify");
    }
    if (vq->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "a tree verify is committed with dfl_target_commit_path");
    }
    if (n_keep < 0 || n_keep > n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d verified tokens", n_keep, n);
    }
    vq->pending = 0;
    vq->chain_steady = n == vq->last_chain || vq->last_chain == 0 ? vq->chain_steady + 1 : 0;
    vq->last_chain = n;
    /* a chain's attention rows are already in place: only recurrent layers have work */
    if (n_keep > 0 && t->m.n_recurrent > 0) {
        pending_commit * pc = &vq->commit;
        pc->active = true;
        pc->tree = false;
        pc->p0 = q->n_past;
        pc->n_keep = n_keep;
        /* chain verifies of one length reuse one graph when their commits rerun every
         * verified row; while the lengths vary (a confidence cut), the graphs differ
         * anyway and only the kept rows are rerun, sparing the identity steps */
        pc->n_replay = vq->chain_steady >= DFL_CHAIN_STEADY ? n : n_keep;
        for (int k = 0; k < n_keep; k++) {
            pc->path[k] = k;
        }
        for (int j = 0; j < t->m.rec.d_conv - 1; j++) {
            pc->conv_cols[j] = n_keep + j;
        }
    }
    dfl_memory_features_kept(&t->mem, seq, NULL, n_keep);
    q->n_past += n_keep;
    return DFL_OK;
}

/* Keep a root-to-node path of the last tree verify: its KV rows move to consecutive
 * cells, the recurrent state becomes the last node's, the conv state the inputs along
 * the path. */
DFL_API dfl_status dfl_target_commit_path(dfl_target * t, int32_t seq, const int32_t * path, int32_t n_keep) {
    TRY(check_seq(t, seq));
    dfl_seq * q = &t->mem.seq[seq];
    verify_seq * vq = &t->verify[seq];
    if (vq->pending == 0 || !vq->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "commit_path needs a preceding tree verify");
    }
    const tree_plan * tp = &vq->tree;
    if (n_keep < 0 || n_keep > tp->n || (n_keep > 0 && !path)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d tree nodes", n_keep, tp->n);
    }
    for (int k = 0; k < n_keep; k++) {
        const bool ok = path[k] >= 0 && path[k] < tp->n && (k == 0 ? path[k] == 0 : tp->parent[path[k]] == path[k - 1]);
        if (!ok) {
            return dfl_fail(DFL_ERR_ARGUMENT, "path entry %d (node %d) does not continue a root-to-node path", k, path[k]);
        }
    }
    vq->pending = 0;
    vq->pending_tree = false;
    dfl_memory_features_kept(&t->mem, seq, path, n_keep);
    if (n_keep > 0) {
        const int W = t->m.rec.d_conv - 1, last = path[n_keep - 1];
        pending_commit * pc = &vq->commit;
        pc->active = true;
        pc->tree = true;
        pc->p0 = q->n_past;
        pc->n_keep = n_keep;
        /* the kept path is no longer than the spine: a larger tree's other rows would be
         * identity steps, each as dear as a real one */
        pc->n_replay = t->m.n_recurrent > 0 ? tp->shape.spine : tp->n;
        memcpy(pc->path, path, (size_t) n_keep * sizeof(int32_t));
        for (int j = 0; j < W; j++) {
            pc->conv_cols[j] = tp->windows[(size_t) last * (W + 1) + j + 1];
        }
        q->n_past += n_keep;
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
    const size_t row = (size_t) t->n_head * sizeof(float);
    dfl_runtime_get(&t->rt, t->out->in.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

static int spare_slot(dfl_target * t);

/* The step's logits as a leaf of a new graph in `slot`, in the memory they are in
 * (through the step's own tensor the new graph would run the whole step again), the rows
 * `which` (an input, [n]) gathered from them. */
static dfl_status step_logits_rows(dfl_target * t, struct ggml_context * ctx, int n, struct ggml_tensor ** which,
                                   struct ggml_tensor ** rows) {
    const struct ggml_tensor * step_logits = t->out->in.logits;
    struct ggml_tensor * logits = ggml_new_tensor_2d(ctx, step_logits->type, step_logits->ne[0], step_logits->ne[1]);
    if (ggml_backend_tensor_alloc(step_logits->buffer, logits, step_logits->data) != GGML_STATUS_SUCCESS) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot reach the step's logits");
    }
    *which = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(*which);
    *rows = ggml_get_rows(ctx, logits, *which);
    return DFL_OK;
}

/* A sampling stage over n rows of the step's logits (`which`, an input, chooses them) in a
 * graph of its own in `slot`, beside the step's, allocated. */
static dfl_status rows_sampler_graph(dfl_target * t, int slot, int n, const dfl_sampler_key * key,
                                     dfl_sampler_graph * g, struct ggml_cgraph ** gf, struct ggml_tensor ** which) {
    t->graphs[slot].valid = false;
    struct ggml_context * ctx = dfl_runtime_begin_graph(&t->rt, slot);
    *gf = ggml_new_graph_custom(ctx, DFL_GRAPH_SIZE, false);
    struct ggml_tensor * logits;
    TRY(step_logits_rows(t, ctx, n, which, &logits));
    dfl_sampler_build(ctx, *gf, logits, key, g);
    return dfl_runtime_alloc(&t->rt, slot, *gf);
}

/* The step's choices read into out_choices; *undecided: how many are -1. */
static dfl_status read_choices(dfl_target * t, int * undecided) {
    const int n = t->n_out;
    if (!dfl_reserve((void **) &t->out_choices, &t->cap_out_choices, n, sizeof(int32_t))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    dfl_runtime_get(&t->rt, t->out->in.samp.choice, t->out_choices, 0, (size_t) n * sizeof(int32_t));
    *undecided = 0;
    for (int r = 0; r < n; r++) {
        *undecided += t->out_choices[r] < 0;
    }
    return DFL_OK;
}

/* A greedy step under masks by candidates (DFL_MASK_CANDIDATES): its choices read, and
 * the rows none of whose candidates their mask allows decided again over their whole
 * rows, masked as a sampling step masks them (exact whatever the mask), in a graph of
 * their rows beside the step's. */
static dfl_status decide_choices(dfl_target * t) {
    const int n = t->n_out, V = t->n_head, W = dfl_mask_words(V);
    int m;
    TRY(read_choices(t, &m));
    if (m == 0) {
        t->choices_decided = true;
        return DFL_OK;
    }
    int32_t * rows = malloc((size_t) 2 * m * sizeof(int32_t)), * decided = rows + m; /* which rows, their choices */
    uint32_t * words = malloc((size_t) m * W * sizeof(uint32_t));
    if (!rows || !words) {
        free(rows);
        free(words);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int r = 0, i = 0; r < n; r++) {
        if (t->out_choices[r] < 0) {
            rows[i++] = r;
        }
    }
    for (int i = 0; i < m; i++) { /* each row's mask, in its sequence's staging still */
        int p = 0, r0 = 0;
        while (rows[i] >= r0 + t->out_part[p].n_rows) {
            r0 += t->out_part[p++].n_rows;
        }
        const dfl_sampler * smp = &t->sampler[t->out_part[p].seq];
        if (t->out_part[p].mask_gen == 0 || smp->mask_gen != t->out_part[p].mask_gen) {
            free(rows);
            free(words);
            return dfl_fail(DFL_ERR_STATE, "masks were staged again before the last step's choices were read");
        }
        memcpy(words + (size_t) i * W, smp->mask + (size_t) (rows[i] - r0) * W, (size_t) W * sizeof(uint32_t));
    }
    dfl_sampler again;
    dfl_sampler_init(&again); /* greedy */
    dfl_status st = dfl_sampler_stage_masks(&again, words, m, W, V);
    free(words);
    dfl_sampler_key key;
    if (st == DFL_OK) {
        st = dfl_sampler_key_for(&again, m, V, &key);
    }
    const int slot = spare_slot(t);
    if (st == DFL_OK && slot < 0) {
        st = dfl_fail(DFL_ERR_STATE, "deciding a masked row again: the runtime keeps no second graph");
    }
    if (st == DFL_OK) {
        dfl_sampler_key_settle(&key, m, V, false);
        key.by_sort = t->rt.top_k_by_sort;
        struct ggml_cgraph * gf;
        struct ggml_tensor * which;
        dfl_sampler_graph g;
        st = rows_sampler_graph(t, slot, m, &key, &g, &gf, &which);
        if (st == DFL_OK) {
            dfl_runtime_set(&t->rt, which, rows, 0, (size_t) m * sizeof(int32_t));
            st = dfl_sampler_fill(&again, &t->rt, &g, &key, m, V);
        }
        if (st == DFL_OK) {
            st = dfl_runtime_compute(&t->rt, slot, gf);
        }
        if (st == DFL_OK) {
            dfl_runtime_get(&t->rt, g.choice, decided, 0, (size_t) m * sizeof(int32_t));
            for (int i = 0; i < m; i++) {
                t->out_choices[rows[i]] = decided[i];
            }
            t->choices_decided = true;
        }
    }
    dfl_sampler_free(&again);
    free(rows);
    return st;
}

/* The masks the step's part p was filled with, staged again in `again` (a part without
 * masks stages none). */
static dfl_status restage_masks(const dfl_target * t, int p, dfl_sampler * again) {
    const int V = t->n_head, W = dfl_mask_words(V);
    const dfl_sampler * smp = &t->sampler[t->out_part[p].seq];
    if (t->out_part[p].mask_gen == 0) {
        return DFL_OK;
    }
    if (smp->mask_gen != t->out_part[p].mask_gen) {
        return dfl_fail(DFL_ERR_STATE, "masks were staged again before the last step's choices were read");
    }
    return dfl_sampler_stage_masks(again, smp->mask, t->out_part[p].n_rows, W, V);
}

/* The sampling stage of a ranked step under masks by candidates, run again over all its
 * rows with the masks applied in place (SPARSE or DENSE: exact whatever the mask), in a
 * graph beside the step's: over the step's logits (which its graph penalized in place
 * already: no penalties again), with the settings and uniforms it was filled with. Its
 * choices, candidates and probabilities, read back, are the step's. */
static dfl_status sample_again(dfl_target * t) {
    const int n = t->n_out, V = t->n_head, P = t->n_out_parts;
    dfl_sampler again[DFL_MAX_SEQ];
    dfl_sampler_part parts[DFL_MAX_SEQ];
    dfl_sampler_key masks;
    dfl_status st = DFL_OK;
    for (int p = 0; p < P; p++) {
        dfl_sampler_init(&again[p]); /* greedy: the key of its masks alone */
        parts[p] = (dfl_sampler_part) { &again[p], t->out_part[p].n_rows };
        dfl_sampler_key k;
        if (st == DFL_OK) {
            st = restage_masks(t, p, &again[p]);
        }
        if (st == DFL_OK) {
            st = dfl_sampler_key_for(&again[p], t->out_part[p].n_rows, V, &k);
        }
        if (st == DFL_OK && p == 0) {
            masks = k;
        } else if (st == DFL_OK) {
            dfl_sampler_key_merge(&masks, &k);
        }
    }
    const int slot = spare_slot(t);
    if (st == DFL_OK && slot < 0) {
        st = dfl_fail(DFL_ERR_STATE, "sampling a masked step again: the runtime keeps no second graph");
    }
    if (st == DFL_OK) {
        dfl_sampler_key_settle(&masks, n, V, false);
        dfl_sampler_key key = t->out->key.samp;
        key.masked = masks.masked;
        key.n_keep = masks.n_keep;
        key.n_ban = masks.n_ban;
        key.keep_rows = masks.keep_rows;
        key.n_wide = 0;
        key.n_penalty = 0;
        const int K = key.n_cand;
        struct ggml_cgraph * gf;
        struct ggml_tensor * which;
        dfl_sampler_graph g;
        /* the rows gathered: the mask is applied to the copy, the step's logits stay as they are */
        st = rows_sampler_graph(t, slot, n, &key, &g, &gf, &which);
        if (st == DFL_OK && (!dfl_reserve((void **) &t->out_cand, &t->cap_out_cand, n * K, sizeof(int32_t)) ||
                             !dfl_reserve((void **) &t->out_cand_p, &t->cap_out_cand_p, n * K, sizeof(float)))) {
            st = dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        if (st == DFL_OK) {
            for (int r = 0; r < n; r++) {
                t->out_choices[r] = r; /* the rows in order (the choices are read over them below) */
            }
            dfl_runtime_set(&t->rt, which, t->out_choices, 0, (size_t) n * sizeof(int32_t));
            dfl_runtime_set(&t->rt, g.params, t->out_params, 0, (size_t) n * DFL_SAMPLER_PARAMS * sizeof(float));
            st = dfl_sampler_fill_masks(parts, P, &t->rt, &g, &key, V);
        }
        if (st == DFL_OK) {
            st = dfl_runtime_compute(&t->rt, slot, gf);
        }
        if (st == DFL_OK) {
            dfl_runtime_get(&t->rt, g.choice, t->out_choices, 0, (size_t) n * sizeof(int32_t));
            dfl_runtime_get(&t->rt, g.cand, t->out_cand, 0, (size_t) n * K * sizeof(int32_t));
            dfl_runtime_get(&t->rt, g.cand_p, t->out_cand_p, 0, (size_t) n * K * sizeof(float));
            t->out_redone = true;
        }
    }
    for (int p = 0; p < P; p++) {
        dfl_sampler_free(&again[p]);
    }
    return st;
}

/* The step's choices decided (once): under masks by candidates, a greedy step's undecided
 * rows decided again, a ranked step's stage run again when some row is undecided. */
static dfl_status decide(dfl_target * t) {
    if (t->choices_decided) {
        return DFL_OK;
    }
    if (t->out->key.samp.pick == DFL_PICK_ARGMAX) {
        return decide_choices(t);
    }
    int m;
    TRY(read_choices(t, &m));
    if (m > 0) {
        TRY(sample_again(t));
    }
    t->choices_decided = true;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_choices(dfl_target * t, int32_t * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_out : 0, "choices"));
    if (t->out->key.samp.masked == DFL_MASK_CANDIDATES) {
        TRY(decide(t));
        memcpy(dst, t->out_choices + row0, (size_t) n_rows * sizeof(int32_t));
        return DFL_OK;
    }
    dfl_runtime_get(&t->rt, t->out->in.samp.choice, dst, (size_t) row0 * sizeof(int32_t),
                    (size_t) n_rows * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_candidates(dfl_target * t, int32_t row0, int32_t n_rows, int32_t k, int32_t * tokens,
                                        float * probs) {
    if (!t || t->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "candidates: the last call computed no logits");
    }
    if (t->out->key.samp.masked == DFL_MASK_CANDIDATES && t->out->key.samp.pick != DFL_PICK_ARGMAX) {
        TRY(decide(t));
    }
    if (!t->out_redone) {
        return dfl_sampler_candidates(&t->rt, &t->out->in.samp, t->n_out, row0, n_rows, k, tokens, probs);
    }
    /* the step's stage ran again: its candidates were read back */
    const int K = t->out->key.samp.n_cand;
    TRY(dfl_sampler_check_candidates(K, t->n_out, row0, n_rows, k, tokens, probs));
    for (int r = 0; r < n_rows; r++) {
        memcpy(tokens + (size_t) r * k, t->out_cand + (size_t) (row0 + r) * K, (size_t) k * sizeof(int32_t));
        memcpy(probs + (size_t) r * k, t->out_cand_p + (size_t) (row0 + r) * K, (size_t) k * sizeof(float));
    }
    return DFL_OK;
}

/* A slot for a graph beside the one whose results are being read: the least recently
 * used other than it (its graph is rebuilt when its shape comes again). */
static int spare_slot(dfl_target * t) {
    int slot = -1;
    for (int i = 0; i < t->rt.n_slots; i++) {
        if (&t->graphs[i] == t->out) {
            continue;
        }
        if (slot < 0 || !t->graphs[i].valid ||
            (t->graphs[slot].valid && t->graphs[i].last_use < t->graphs[slot].last_use)) {
            slot = i;
        }
    }
    return slot;
}

DFL_API dfl_status dfl_target_redraw(dfl_target * t, int32_t seq, const int32_t * rows, const float * u, int32_t n,
                                     int32_t * dst) {
    TRY(check_seq(t, seq));
    if (!rows || !u || !dst || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "redraw: needs rows, a uniform for each and room for the tokens");
    }
    if (t->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "redraw: the last call computed no logits");
    }
    for (int i = 0; i < n; i++) {
        TRY(check_rows(t, rows[i], 1, t->n_out, "redraw"));
    }
    dfl_sampler * smp = &t->sampler[seq];
    if (smp->s.temperature <= 0.0f) {
        return dfl_fail(DFL_ERR_STATE, "redraw: sequence %d does not sample (temperature 0)", seq);
    }
    const int slot = spare_slot(t);
    if (slot < 0) {
        return dfl_fail(DFL_ERR_STATE, "redraw: the runtime keeps no second graph");
    }
    t->graphs[slot].valid = false;
    /* the rows' logits (their penalties applied in place by the step's graph) ranked in
     * full: the draw then sees every token the kept set may hold, at any vocabulary size */
    const int V = t->n_head;
    const dfl_sampler_key key = { DFL_PICK_RANKED, V, 0, 0, 0, 0 };
    struct ggml_context * ctx = dfl_runtime_begin_graph(&t->rt, slot);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, DFL_GRAPH_SIZE, false);
    struct ggml_tensor * which, * logits;
    TRY(step_logits_rows(t, ctx, n, &which, &logits));
    dfl_sampler_graph g;
    struct ggml_tensor * choice = dfl_sampler_build(ctx, gf, logits, &key, &g);
    ggml_set_output(choice);
    ggml_build_forward_expand(gf, choice);
    TRY(dfl_runtime_alloc(&t->rt, slot, gf));
    dfl_runtime_set(&t->rt, which, rows, 0, (size_t) n * sizeof(int32_t));
    TRY(dfl_sampler_stage_uniforms(smp, u, n));
    TRY(dfl_sampler_fill(smp, &t->rt, &g, &key, n, V));
    TRY(dfl_runtime_compute(&t->rt, slot, gf));
    dfl_runtime_get(&t->rt, choice, dst, 0, (size_t) n * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_set_sampling(dfl_target * t, int32_t seq, const dfl_sampling * s) {
    TRY(check_seq(t, seq));
    return dfl_sampler_set(&t->sampler[seq], s);
}

DFL_API dfl_status dfl_target_set_uniforms(dfl_target * t, int32_t seq, const float * u, int32_t n) {
    TRY(check_seq(t, seq));
    return dfl_sampler_stage_uniforms(&t->sampler[seq], u, n);
}

DFL_API dfl_status dfl_target_set_penalties(dfl_target * t, int32_t seq, const int32_t * tokens, const float * counts,
                                           int32_t n_rows, int32_t per_row) {
    TRY(check_seq(t, seq));
    return dfl_sampler_stage_penalties(&t->sampler[seq], tokens, counts, n_rows, per_row, t->n_head);
}

DFL_API dfl_status dfl_target_set_masks(dfl_target * t, int32_t seq, const uint32_t * words, int32_t n_rows,
                                       int32_t n_words) {
    TRY(check_seq(t, seq));
    return dfl_sampler_stage_masks(&t->sampler[seq], words, n_rows, n_words, t->n_head);
}

DFL_API dfl_status dfl_target_features(const dfl_target * t, int32_t seq, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_seq(t, seq));
    if (t->p.n_feature_layers == 0) {
        return dfl_fail(DFL_ERR_STATE, "the target was loaded without feature layers");
    }
    TRY(check_rows(t, row0, n_rows, t->mem.seq[seq].feat.rows, "feature"));
    const size_t row = t->mem.features->nb[1];
    const size_t at = (size_t) (t->mem.seq[seq].feat.row0 + t->mem.seq[seq].feat.base) * row;
    dfl_runtime_get(&t->rt, t->mem.features, dst, at + (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

/* ---- what a drafter may read --------------------------------------------------------- */

const dfl_gguf * dfl_target_file(const dfl_target * t) { return &t->m.file; }
int dfl_target_n_vocab(const dfl_target * t) { return t->m.n_vocab; }
int dfl_target_n_embd(const dfl_target * t) { return t->m.n_embd; }
int dfl_target_n_layer(const dfl_target * t) { return t->m.n_layer; }
int dfl_target_n_ctx(const dfl_target * t) { return t->p.n_ctx; }
int dfl_target_n_seq(const dfl_target * t) { return t->mem.n_seq; }
int dfl_target_n_ubatch(const dfl_target * t) { return t->p.n_ubatch; }
int dfl_target_n_threads(const dfl_target * t) { return t->rt.n_threads; }
bool dfl_target_repack(const dfl_target * t) { return !t->p.no_repack; }
ggml_backend_dev_t dfl_target_device(const dfl_target * t) { return t->rt.dev; }
bool dfl_target_on_cpu(const dfl_target * t) { return t->rt.dev == t->rt.dev_cpu; }
struct ggml_tensor * dfl_target_tok_embd(const dfl_target * t) { return t->tok_lookup; }
struct ggml_tensor * dfl_target_lm_head(const dfl_target * t) { return t->m.output; }
struct ggml_tensor * dfl_target_output_norm(const dfl_target * t) { return t->m.output_norm; }
const dfl_rope_scaling * dfl_target_rope_scaling(const dfl_target * t) { return &t->m.rope; }
struct ggml_tensor * dfl_target_feature_tensor(const dfl_target * t) { return t->mem.features; }
int64_t dfl_target_feature_of(const dfl_target * t, int seq, int pos) { return dfl_memory_feature_of(&t->mem, seq, pos); }
int dfl_target_feature_room(const dfl_target * t, int seq, int taken) {
    return t->mem.features ? dfl_memory_features_room(&t->mem, seq, taken) : 0;
}

int dfl_target_feature_layers(const dfl_target * t, int32_t * layers, int max_n) {
    const int n = t->p.n_feature_layers < max_n ? t->p.n_feature_layers : max_n;
    memcpy(layers, t->p.feature_layers, (size_t) n * sizeof(int32_t));
    return t->p.n_feature_layers;
}
