/* Target runtime: its parameters, loading and freeing, what it reports, and the
 * sequence slots' state between steps (reset, copy, truncate, features), with what a
 * drafter may read. The rest of the target is split by job: where layers, weights and
 * state live (dfl_target_place.c), the step and graph reuse (dfl_target_step.c), a
 * verify's commit (dfl_target_commit.c), how the step's rows choose and are read
 * (dfl_target_sampling.c) and the graph of a step (dfl_target_graph.c). The state lives
 * in the memory layer (dfl_memory.h); nothing here depends on the architecture, only on
 * the kinds of its layers. */
#include "dfl_target_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    dfl_status st = dfl_target_place_weights(t);
    if (st == DFL_OK) {
        st = dfl_target_cut_head(t, params);
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
        st = dfl_target_host_reserve(t, rows, (size_t) seg_rows * (size_t) t->p.n_ctx);
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
    info->n_gpu_layers = t->rt.dev == t->rt.dev_cpu ? 0 : t->m.n_layer - dfl_target_first_device_layer(t);
    info->n_graphs = t->n_graphs;
    info->n_graph_builds = t->n_graph_builds;
    snprintf(info->device, sizeof info->device, "%s", ggml_backend_dev_name(t->rt.dev));
    info->n_threads = t->rt.n_threads;
    info->n_threads_in_use = t->rt.threads_in_use;
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
    dfl_target_last_copies(t, copies);
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
        dfl_verify_seq_reset(&t->verify[s]);
        t->sampler[s].n_u = 0;
        t->sampler[s].pen_rows = 0;
        t->sampler[s].mask_rows = 0;
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_reset(dfl_target * t, int32_t seq) {
    TRY(dfl_target_check_seq(t, seq));
    dfl_memory_seq_clear(&t->mem, seq);
    dfl_verify_seq_reset(&t->verify[seq]);
    t->sampler[seq].n_u = 0;
    t->sampler[seq].pen_rows = 0;
    t->sampler[seq].mask_rows = 0;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_copy(dfl_target * t, int32_t src, int32_t dst) {
    TRY(dfl_target_check_seq(t, src));
    TRY(dfl_target_check_seq(t, dst));
    if (!dfl_target_seq_settled(t, src)) {
        return dfl_fail(DFL_ERR_STATE, "sequence %d is between a verify and its commit: copy it after a decode", src);
    }
    TRY(dfl_memory_seq_copy(&t->mem, src, dst));
    dfl_verify_seq_reset(&t->verify[dst]);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_seq_truncate(dfl_target * t, int32_t seq, int32_t n_past) {
    TRY(dfl_target_check_seq(t, seq));
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

DFL_API int32_t dfl_target_settled(const dfl_target * t, int32_t seq) {
    return t && seq >= 0 && seq < t->mem.n_seq && dfl_target_seq_settled(t, seq);
}

DFL_API dfl_status dfl_target_features(const dfl_target * t, int32_t seq, float * dst, int32_t row0, int32_t n_rows) {
    TRY(dfl_target_check_seq(t, seq));
    if (t->p.n_feature_layers == 0) {
        return dfl_fail(DFL_ERR_STATE, "the target was loaded without feature layers");
    }
    TRY(dfl_target_check_rows(t, row0, n_rows, t->mem.seq[seq].feat.rows, "feature"));
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
