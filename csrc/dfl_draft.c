/* The generic drafter runtime: loading (the architecture from the registry,
 * dfl_drafters.c), the drafter's memory (its caches per slot, on the memory
 * layer), proposes as descriptors (dfl_draft_step) with their graphs reused while the
 * shape holds, the inputs, the choice of the drafts, the top-K ranking and the token
 * source the target reads. What is architecture-specific lives in csrc/models/ behind
 * dfl_drafter.h; nothing here knows a drafter's layers.
 *
 * A sequence's context entries are the positions its target committed since the
 * drafter's last graph for it: their features are in that slot's feature rows of the
 * target (dfl_target_feature_of), which only the slot's own next target call replaces,
 * so they ride in the sequence's next propose graph whatever other sequences run in
 * between. */
#include "dfl_draft_state.h"
#include "dfl_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

DFL_API void dfl_draft_default_params(dfl_draft_params * p) {
    memset(p, 0, sizeof *p);
    p->kv_type = -1;
}

/* ---- loader helpers ---------------------------------------------------------------------- */

void dfl_drafter_one_causal_layer(dfl_drafter * m, int head_dim, int n_head_kv) {
    m->n_layer = 1;
    m->kind[0] = DFL_LAYER_ATTENTION;
    m->attn[0] = (dfl_attention_geometry) { head_dim, head_dim, n_head_kv, 0, false, 0 };
    m->n_masks = 1;
    m->masks[0] = (dfl_draft_mask_rule) { true, 0 };
    m->layer_mask[0] = 0;
}

void dfl_drafter_free_weights(dfl_drafter * m) {
    free(m->weights);
    m->weights = NULL;
}

dfl_status dfl_drafter_key(const dfl_drafter * m, const char * key, bool required, uint32_t def, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(&m->file, key, required, def, &v));
    if (v > (1u << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", m->file.path,
                        key[0] == '.' ? m->file.arch : "", key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

dfl_status dfl_drafter_tensor(const dfl_drafter * m, const char * name, int il, int64_t ne0, int64_t ne1,
                              bool required, struct ggml_tensor ** out) {
    char full[128];
    if (il >= 0) {
        snprintf(full, sizeof full, "blk.%d.%s", il, name);
    } else {
        snprintf(full, sizeof full, "%s", name);
    }
    const int64_t ne[2] = { ne0, ne1 };
    return dfl_gguf_tensor(&m->file, full, ne1 > 0 ? 2 : 1, ne, required, out);
}

/* ---- loading ----------------------------------------------------------------------------- */

/* The target must capture the features the drafter reads, and have them. */
static dfl_status check_features(const dfl_draft * d) {
    const dfl_drafter * m = &d->m;
    int32_t captured[16];
    bool same = dfl_target_feature_layers(d->target, captured, 16) == m->n_feat;
    for (int i = 0; same && i < m->n_feat; i++) {
        same = captured[i] == m->target_layers[i];
    }
    if (!same) {
        char want[128] = "";
        for (int i = 0, at = 0; i < m->n_feat && at < (int) sizeof want; i++) {
            at += snprintf(want + at, sizeof want - (size_t) at, "%s%d", i ? "," : "", m->target_layers[i]);
        }
        return dfl_fail(DFL_ERR_ARGUMENT, "the target captures different feature layers than the drafter reads "
                        "(load the target with feature_layers = %s, the drafter's)", want);
    }
    for (int i = 0; i < m->n_feat; i++) {
        if (m->target_layers[i] < 1 || m->target_layers[i] > dfl_target_n_layer(d->target)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter reads target layer %d, but the target has %d layers",
                            m->target_layers[i], dfl_target_n_layer(d->target));
        }
    }
    return DFL_OK;
}

/* Everything before the weights: the drafter's description checked against its target,
 * and its device. */
dfl_status dfl_draft_open(const char * path, dfl_target * target, const dfl_draft_params * params, dfl_draft ** out) {
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
    d->blocks.drafter = &d->mem;
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
    } else if (d->p.n_threads < 0 || d->p.window < 0) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "drafter %s %d is negative (0: %s)", d->p.n_threads < 0 ? "n_threads" : "window",
                      d->p.n_threads < 0 ? d->p.n_threads : d->p.window,
                      d->p.n_threads < 0 ? "the target's threads" : "the whole context");
    } else if (d->p.block_size < 0 || d->p.block_size > DFL_MAX_BLOCK) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "drafter block size %d is outside 0..%d", d->p.block_size, DFL_MAX_BLOCK);
    } else {
        st = dfl_check_head_tokens(d->p.head_tokens, d->p.n_head_tokens, dfl_target_n_vocab(target), path);
    }
    d->p.head_tokens = NULL; /* the caller's, read by the load (cut_head), not kept; the count
                                stays for a memory plan (dfl_draft_kept_count) */
    if (st == DFL_OK) {
        st = dfl_gguf_open(path, &d->m.file);
        if (st != DFL_OK) {
            free(d);
            return st;
        }
        const int kind = dfl_drafter_find(&d->m.file);
        if (kind < 0) {
            st = dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%.40s', not a drafter this build runs (%s)", path,
                          d->m.file.arch, dfl_drafter_archs());
        } else {
            d->m.registry = dfl_drafter_kind_at(kind);
            d->m.arch = dfl_drafter_arch_at(kind);
            d->m.autoregressive = d->m.registry->autoregressive;
        }
    }
    if (st == DFL_OK) {
        d->m.n_vocab = dfl_target_n_vocab(target);
        d->m.n_embd = dfl_target_n_embd(target);
        st = d->m.arch->load(&d->m, target, &d->p);
    }
    if (st == DFL_OK && d->p.block_size > 0) {
        if (!d->m.autoregressive && d->p.block_size > d->m.block_size) {
            st = dfl_fail(DFL_ERR_ARGUMENT, "block size %d exceeds the drafter's trained %d", d->p.block_size,
                          d->m.block_size);
        } else {
            d->m.block_size = d->p.block_size;
        }
    }
    if (st == DFL_OK && d->m.block_size < 2) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "a drafter block holds the bonus and at least one draft (block size %d)",
                      d->m.block_size);
    }
    if (st == DFL_OK) st = check_features(d);
    if (st == DFL_OK) {
        /* every further sequence in a propose adds its attention per layer (and a DFlash2
         * drafter its convolutions and selector); an autoregressive drafter's passes each
         * add a pass of every sequence, a DSpark drafter's rows a Markov step each */
        const size_t n_seq = (size_t) d->n_seq, B = (size_t) d->m.block_size, L = (size_t) d->m.n_layer;
        size_t graph_size = DFL_GRAPH_SIZE + L * DFL_GRAPH_NODES_PER_LAYER +
                            (n_seq - 1) * (L * DFL_GRAPH_NODES_PER_SEQ + 16 * B);
        graph_size += (B - 1) * n_seq * (size_t) d->m.nodes_per_pass;
        st = dfl_runtime_init(&d->rt, ggml_backend_dev_name(dfl_target_device(target)),
                              d->p.n_threads > 0 ? d->p.n_threads : dfl_target_n_threads(target), "drafter",
                              graph_size, d->p.top_k > 1 ? 2 : 1);
    }
    if (st != DFL_OK) {
        dfl_draft_free(d);
        return st;
    }
    *out = d;
    return DFL_OK;
}

/* The memory: each cached layer's keys and values per slot, in a ring of the context
 * window and a block (the whole context without a window) and a spare row for padding;
 * the features a drafter that reads the previous position's carries per slot; each
 * slot's last block. */
dfl_status dfl_draft_define_state(dfl_draft * d) {
    dfl_drafter * m = &d->m;
    for (int il = 0; il < m->n_layer; il++) {
        m->attn[il].window = d->p.window > 0 ? d->p.window : 0;
    }
    bool on_device[DFL_DRAFTER_MAX_LAYERS];
    for (int il = 0; il < m->n_layer; il++) {
        on_device[il] = true;
    }
    const dfl_memory_layout layout = { m->n_layer, m->kind, m->attn, NULL };
    const dfl_memory_params mp = { .n_seq = d->n_seq, .n_ctx = d->n_ctx, .n_ubatch = 1, .n_verify = 1,
                                   .type_k = (enum ggml_type) d->p.kv_type, .type_v = (enum ggml_type) d->p.kv_type,
                                   .on_device = on_device, .window_rows = m->block_size, .spare = 1,
                                   .feature_floats = 0, .features_on_device = true,
                                   .state_floats = m->feat_previous ? m->n_feat * m->n_embd : 0 };
    TRY(dfl_memory_define(&d->mem, &layout, &mp));
    struct ggml_init_params ip = { (size_t) d->n_seq * ggml_tensor_overhead(), NULL, true };
    d->ctx_blocks = ggml_init(ip);
    if (!d->ctx_blocks) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot create the drafter's block context");
    }
    for (int s = 0; s < d->n_seq; s++) {
        d->blocks.tokens[s] = ggml_new_tensor_1d(d->ctx_blocks, GGML_TYPE_I32, m->block_size);
    }
    return DFL_OK;
}

static dfl_status alloc_state(dfl_draft * d) {
    TRY(dfl_draft_define_state(d));
    const ggml_backend_dev_t devs[2] = { d->rt.dev, d->rt.dev_cpu };
    TRY(dfl_memory_alloc(&d->mem, devs));
    d->buf_blocks = ggml_backend_alloc_ctx_tensors_from_buft(d->ctx_blocks, ggml_backend_dev_buffer_type(d->rt.dev));
    if (!d->buf_blocks) {
        return dfl_fail(DFL_ERR_BACKEND, "out of device memory for the drafter's blocks");
    }
    ggml_backend_buffer_clear(d->buf_blocks, 0);
    return DFL_OK;
}


/* Compute memory and host staging for the worst graphs at load, as the target's: taken
 * later, they would grow with the longest context seen (and fail mid-run, not at load). */
static dfl_status reserve_worst(dfl_draft * d) {
    dfl_status reserved = DFL_OK;
    TRY(dfl_draft_worst_graphs(d, dfl_runtime_reserve_visit, &reserved, NULL));
    TRY(reserved);
    const dfl_draft_step chunk = dfl_draft_worst_step(d, true), worst = dfl_draft_worst_step(d, false);
    TRY(dfl_draft_reserve_staging(d, &chunk));
    TRY(dfl_draft_reserve_staging(d, &worst));
    memset(d->host_i32, 0, d->host_rows * sizeof(int32_t));
    memset(d->host_i64, 0, d->host_rows * sizeof(int64_t));
    memset(d->host_mask, 0, d->host_mask_size * sizeof(ggml_fp16_t));
    return DFL_OK;
}

/* The kept set the file carries (<arch>.head_tokens): *ids allocated (free() it; NULL
 * and *n 0 where the file has none). */
static dfl_status file_kept_set(const dfl_drafter * m, int32_t ** ids, int * n) {
    *ids = NULL;
    *n = 0;
    if (!dfl_gguf_has(&m->file, ".head_tokens")) {
        return DFL_OK;
    }
    *ids = malloc((size_t) m->n_vocab * sizeof(int32_t));
    if (!*ids) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    const dfl_status st = dfl_gguf_arr_i32(&m->file, ".head_tokens", *ids, m->n_vocab, n);
    if (st != DFL_OK) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    return st;
}

dfl_status dfl_draft_kept_count(const dfl_draft * d, int * n) {
    *n = 0;
    if (!d->m.head) {
        return DFL_OK;
    }
    if (d->p.n_head_tokens > 0) {
        *n = d->p.n_head_tokens;
        return DFL_OK;
    }
    int32_t * ids;
    const dfl_status st = file_kept_set(&d->m, &ids, n);
    free(ids);
    return st;
}

/* The LM head cut to the kept tokens (the params', else the file's <arch>.head_tokens),
 * once the weights it takes rows of are loaded: those rows, and the ids the logits
 * scatter to, on the head's device. */
static dfl_status cut_head(dfl_draft * d, const int32_t * ids, int n) {
    dfl_drafter * m = &d->m;
    int32_t * from_file = NULL;
    if (n == 0) {
        TRY(file_kept_set(m, &from_file, &n));
        ids = from_file;
    }
    dfl_status st = DFL_OK;
    if (n > 0 && !m->head) {
        st = dfl_fail(DFL_ERR_ARGUMENT, "a cut drafter head (kept tokens) applies to DFlash drafters; '%s' is a %s "
                      "drafter%s", m->file.path, m->registry->name,
                      strcmp(m->registry->name, "dflash") == 0 ? " with DFlash2's selector" : "");
    }
    if (st == DFL_OK && n > 0) st = dfl_check_head_tokens(ids, n, m->n_vocab, m->file.path);
    if (st == DFL_OK && n > 0) {
        st = dfl_gguf_weight_rows(m->head_file, m->head, ids, n, dfl_target_repack(d->target), &m->ctx_head_rows,
                                  &m->buf_head_rows, &m->head_rows);
    }
    if (st == DFL_OK && n > 0) {
        struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
        m->ctx_head_ids = ggml_init(ip);
        if (!m->ctx_head_ids) {
            st = dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
    }
    if (st == DFL_OK && n > 0) {
        m->head_ids = ggml_new_tensor_1d(m->ctx_head_ids, GGML_TYPE_I32, n);
        ggml_set_name(m->head_ids, "head_tokens");
        /* beside the rows, in the device's plain memory (the rows' may be a repacked type) */
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(m->head_rows->buffer));
        ggml_backend_buffer_type_t buft = dev ? ggml_backend_dev_buffer_type(dev)
                                                : ggml_backend_buffer_get_type(m->head_rows->buffer);
        m->buf_head_ids = ggml_backend_alloc_ctx_tensors_from_buft(m->ctx_head_ids, buft);
        if (!m->buf_head_ids) {
            st = dfl_fail(DFL_ERR_BACKEND, "cannot allocate the drafter's kept head tokens");
        } else {
            ggml_backend_tensor_set(m->head_ids, ids, 0, (size_t) n * sizeof(int32_t));
            m->n_head = n;
        }
    }
    free(from_file);
    return st;
}

DFL_API dfl_status dfl_draft_load(const char * path, dfl_target * target, const dfl_draft_params * params,
                                  dfl_draft ** out) {
    dfl_draft * d;
    TRY(dfl_draft_open(path, target, params, &d));
    *out = NULL;
    ggml_backend_dev_t * dev_of = NULL;
    dfl_status st = dfl_gguf_devices(&d->m.file, d->p.weight_placements, d->p.n_weight_placements, d->rt.dev,
                                     d->rt.dev_cpu, &dev_of);
    d->p.weight_placements = NULL; /* the caller's, not kept */
    d->p.n_weight_placements = 0;
    if (st == DFL_OK) st = dfl_gguf_load_weights(&d->m.file, dev_of, dfl_target_repack(d->target));
    free(dev_of);
    if (st == DFL_OK) st = cut_head(d, params ? params->head_tokens : NULL, params ? params->n_head_tokens : 0);
    if (st == DFL_OK) st = alloc_state(d);
    if (st == DFL_OK) st = reserve_worst(d);
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
    dfl_memory_free(&d->mem);
    if (d->buf_blocks) ggml_backend_buffer_free(d->buf_blocks);
    if (d->ctx_blocks) ggml_free(d->ctx_blocks);
    dfl_runtime_free(&d->rt);
    if (d->m.buf_head_rows) ggml_backend_buffer_free(d->m.buf_head_rows);
    if (d->m.ctx_head_rows) ggml_free(d->m.ctx_head_rows);
    if (d->m.buf_head_ids) ggml_backend_buffer_free(d->m.buf_head_ids);
    if (d->m.ctx_head_ids) ggml_free(d->m.ctx_head_ids);
    if (d->m.arch && d->m.arch->free) {
        d->m.arch->free(&d->m);
    }
    dfl_gguf_close(&d->m.file);
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
    const dfl_drafter * m = &d->m;
    memset(info, 0, sizeof *info);
    snprintf(info->kind, sizeof info->kind, "%s", m->registry->name);
    info->block_size = m->block_size;
    info->mask_token_id = m->autoregressive ? -1 : m->filler;
    info->n_layer = m->n_layer;
    info->n_embd = m->n_embd;
    info->n_target_layers = m->n_feat;
    memcpy(info->target_layers, m->target_layers, sizeof m->target_layers);
    info->reads_tokens = m->reads_tokens;
    info->greedy_only = m->greedy_only;
    info->has_confidence = m->has_confidence;
    info->n_ctx_tokens = d->mem.seq[0].n_past;
    info->n_head_tokens = m->n_head > 0 ? m->n_head : m->n_vocab;
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

DFL_API dfl_status dfl_draft_reset(dfl_draft * d) {
    if (!d) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter");
    }
    /* slot by slot: what a slot carries is zeroed; its caches need no clearing (masks
     * hide the positions a slot does not hold) */
    for (int s = 0; s < d->n_seq; s++) {
        dfl_memory_seq_clear(&d->mem, s);
        d->blocks.n[s] = 0;
    }
    d->n_out = 0;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_seq_reset(dfl_draft * d, int32_t seq) {
    TRY(dfl_draft_check_seq(d, seq));
    dfl_memory_seq_clear(&d->mem, seq);
    d->blocks.n[seq] = 0;
    return DFL_OK;
}

DFL_API int32_t dfl_draft_n_past(const dfl_draft * d, int32_t seq) {
    return d && seq >= 0 && seq < d->n_seq ? d->mem.seq[seq].n_past : -1;
}

DFL_API int32_t dfl_draft_catch_up_due(const dfl_draft * d, int32_t seq, int32_t n_rows) {
    if (!d || seq < 0 || seq >= d->n_seq || d->mem.seq[seq].n_past >= dfl_target_n_past(d->target, seq)) {
        return 0;
    }
    return dfl_target_feature_room(d->target, seq, d->mem.seq[seq].n_past) < n_rows ? 1 : 0;
}
