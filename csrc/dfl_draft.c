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
#include "dfl_draft_impl.h"
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

static dfl_status reserve_staging(dfl_draft * d, const dfl_draft_step * step);

/* Compute memory and host staging for the worst graphs at load, as the target's: taken
 * later, they would grow with the longest context seen (and fail mid-run, not at load). */
static dfl_status reserve_worst(dfl_draft * d) {
    dfl_status reserved = DFL_OK;
    TRY(dfl_draft_worst_graphs(d, dfl_runtime_reserve_visit, &reserved, NULL));
    TRY(reserved);
    const dfl_draft_step chunk = dfl_draft_worst_step(d, true), worst = dfl_draft_worst_step(d, false);
    TRY(reserve_staging(d, &chunk));
    TRY(reserve_staging(d, &worst));
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
    TRY(check_seq(d, seq));
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

/* ---- proposes ------------------------------------------------------------------------------ */

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

/* Host staging for a step's inputs: three numbers per entry or part, a token and
 * position per row of every pass, an index per drafted row, and the largest part's mask
 * (a row per block row, or per pass, over its cache rows). */
static dfl_status reserve_staging(dfl_draft * d, const dfl_draft_step * step) {
    const dfl_drafter * m = &d->m;
    const int E = dfl_draft_step_entries(step), R = dfl_draft_step_rows(m, step);
    const int n_pass = dfl_draft_step_passes(m, step), D = dfl_draft_step_drafted(step);
    int host = 3 * E;
    host = host > 3 * step->n_parts ? host : 3 * step->n_parts;
    host = host > R * (1 + n_pass) ? host : R * (1 + n_pass);
    host = host > D ? host : D;
    size_t mask = 1;
    for (int i = 0; i < step->n_parts; i++) {
        const dfl_draft_part * part = &step->part[i];
        const size_t cells = (size_t) (m->autoregressive ? m->block_size : dfl_draft_block_rows(m, part->n_block)) *
                             (size_t) part->n_kv;
        mask = cells > mask ? cells : mask;
    }
    return reserve(d, host, mask);
}

/* What a propose's part does, worked out from its block and the two memories. */
typedef struct part_plan {
    int seq;
    int p0;          /* the drafter's context positions before the step */
    int n_entries;   /* positions the target committed since: p0 .. p0 + n_entries - 1 */
    int pos;         /* the bonus's position: p0 + n_entries */
    const int32_t * tokens;
    int bonus, n_block;
} part_plan;

/* A block checked against its sequence's state, and its entries. */
static dfl_status plan_part(const dfl_draft * d, const dfl_block * b, const bool * seen, part_plan * pp) {
    const dfl_drafter * m = &d->m;
    TRY(check_seq(d, b->seq));
    if (seen[b->seq]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d appears twice in one propose", b->seq);
    }
    if (b->n_block != 0 && (b->n_block < 2 || b->n_block > m->block_size)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "block size %d is outside 2..%d (the drafter's block size)", b->n_block,
                        m->block_size);
    }
    if (b->n_block > 0 && (b->bonus < 0 || b->bonus >= m->n_vocab)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "token id %d is outside the vocabulary", b->bonus);
    }
    const int p0 = d->mem.seq[b->seq].n_past, end = dfl_target_n_past(d->target, b->seq);
    if (p0 > end) {
        return dfl_fail(DFL_ERR_STATE, "the drafter holds %d positions of sequence %d, its target %d: reset both",
                        p0, b->seq, end);
    }
    for (int pos = p0; pos < end; pos++) {
        if (dfl_target_feature_of(d->target, b->seq, pos) < 0) {
            return dfl_fail(DFL_ERR_STATE, "the target's features of position %d of sequence %d are gone (the target ran "
                            "another call of the sequence, or another sequence's prefill chunk, before the drafter read them)", pos, b->seq);
        }
    }
    const int n = end - p0;
    if (b->n_tokens < 0 || (b->n_tokens > 0 && !b->tokens)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null context tokens");
    }
    if (b->tokens && b->n_tokens != n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%d context tokens given for the %d positions sequence %d's drafter lacks",
                        b->n_tokens, n, b->seq);
    }
    if (m->reads_tokens && n > 0 && !b->tokens) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter needs the tokens of the %d positions it takes from the "
                        "target", m->registry->name, n);
    }
    for (int i = 0; b->tokens && i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "context token id %d is outside the vocabulary", b->tokens[i]);
        }
    }
    if (end + b->n_block > d->n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: drafting %d positions after %d exceeds %d", b->n_block,
                        end, d->n_ctx);
    }
    *pp = (part_plan) { b->seq, p0, n, end, b->tokens, b->bonus, b->n_block };
    return DFL_OK;
}

/* How the propose's drafted rows choose: each part's sequence's sampling, merged. */
static dfl_status propose_sampling(dfl_draft * d, dfl_draft_step * step) {
    memset(&step->samp, 0, sizeof step->samp);
    bool first = true;
    for (int i = 0; i < step->n_parts; i++) {
        if (step->part[i].n_block == 0) {
            continue;
        }
        dfl_sampler_key k;
        TRY(dfl_sampler_key_for(&d->sampler[step->part[i].seq], step->part[i].n_block - 1, d->m.n_vocab, &k));
        if (first) {
            step->samp = k;
        } else {
            dfl_sampler_key_merge(&step->samp, &k);
        }
        first = false;
    }
    step->samp.by_sort = d->rt.top_k_by_sort;
    return DFL_OK;
}

static bool same_step(const dfl_draft_step * a, const dfl_draft_step * b) {
    return a->n_parts == b->n_parts && memcmp(a->part, b->part, (size_t) a->n_parts * sizeof a->part[0]) == 0 &&
           memcmp(&a->samp, &b->samp, sizeof a->samp) == 0;
}

/* The part's block rows' mask over n_kv cache rows of its sequence, one row per block row
 * (per pass, autoregressive): cache row j holds the latest position below the block's end
 * that maps to it, visible when in the drafter's context window (an older or stale one is
 * out of it by construction) and by the layer's rule: causal, not after the row's
 * position; window, fewer than `window` positions from it. */
static void fill_mask(dfl_draft * d, struct ggml_tensor * dst, const part_plan * pp, int rows,
                      const dfl_draft_mask_rule * rule) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), minf = ggml_fp32_to_fp16(-INFINITY);
    const int p = pp->pos, n_kv = (int) dst->ne[0], ring = dfl_memory_kv_rows(&d->mem, 0);
    const int written = d->m.autoregressive ? pp->n_block - 1 : dfl_draft_block_rows(&d->m, pp->n_block);
    int first = d->p.window > 0 && p > d->p.window ? p - d->p.window : 0;
    first = first > d->m.first_pos ? first : d->m.first_pos;
    const int end = p + written;
    for (int i = 0; i < rows; i++) {
        const int q = p + i;
        for (int j = 0; j < n_kv; j++) {
            const int pos = j < end ? j + ring * ((end - 1 - j) / ring) : -1;
            bool visible = pos >= first;
            visible = visible && (!rule->causal || pos <= q);
            visible = visible && (rule->window <= 0 || (q - pos < rule->window && (rule->causal || pos - q < rule->window)));
            d->host_mask[(size_t) i * n_kv + j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&d->rt, dst, d->host_mask, 0, (size_t) rows * n_kv * sizeof(ggml_fp16_t));
}

/* The entries' inputs: feature rows, positions, cells (padding, and entries a later one
 * of the same call replaces in the ring, write to the slot's spare cell: one scatter
 * never writes a cell twice), tokens; and what feat_previous drafters carry. */
static void stage_entries(dfl_draft * d, const dfl_draft_step * step, const part_plan * plans, const draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    const int E = dfl_draft_step_entries(step), ring = dfl_memory_kv_rows(&d->mem, 0);
    int32_t * rows = d->host_i32, * pos = d->host_i32 + E, * tok = d->host_i32 + 2 * E;
    int64_t * cells = d->host_i64;
    for (int i = 0, at = 0; i < step->n_parts; at += step->part[i].entry_rows, i++) {
        const part_plan * pp = &plans[i];
        for (int k = 0; k < step->part[i].entry_rows; k++) {
            const bool real = k < pp->n_entries;
            const int p = pp->p0 + (real ? k : 0);
            const int own = m->feat_previous ? p - 1 : p;
            rows[at + k] = real && (!m->feat_previous || k > 0) ? (int32_t) dfl_target_feature_of(d->target, pp->seq, own)
                                                                : 0;
            pos[at + k] = p + m->pos_offset;
            cells[at + k] = real && k >= pp->n_entries - ring ? dfl_memory_cell(&d->mem, 0, pp->seq, p)
                                                              : dfl_memory_spare_cell(&d->mem, 0, pp->seq);
            tok[at + k] = real && pp->tokens ? pp->tokens[k] : 0;
        }
    }
    dfl_runtime_set(&d->rt, in->entry_rows, rows, 0, (size_t) E * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->entry_pos, pos, 0, (size_t) E * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->entry_cells, cells, 0, (size_t) E * sizeof(int64_t));
    if (in->entry_tokens) {
        dfl_runtime_set(&d->rt, in->entry_tokens, tok, 0, (size_t) E * sizeof(int32_t));
    }
    if (!m->feat_previous) {
        return;
    }
    const int P = step->n_parts;
    int64_t * slots = d->host_i64, * first = d->host_i64 + P;
    int32_t * last = d->host_i32, * drafting = d->host_i32 + P, * rows_of_slots = d->host_i32 + 2 * P;
    float has[DFL_MAX_SEQ], none[DFL_MAX_SEQ];
    int n_drafting = 0;
    for (int i = 0, at = 0; i < P; at += step->part[i].entry_rows, i++) {
        const part_plan * pp = &plans[i];
        slots[i] = rows_of_slots[i] = pp->seq;
        first[i] = at;
        last[i] = pp->n_entries > 0 ? (int32_t) dfl_target_feature_of(d->target, pp->seq, pp->pos - 1) : 0;
        has[i] = pp->n_entries > 0 ? 1.0f : 0.0f;
        none[i] = 1.0f - has[i];
        if (pp->n_block > 0) {
            drafting[n_drafting++] = i;
        }
    }
    dfl_runtime_set(&d->rt, in->carry_rows, rows_of_slots, 0, (size_t) P * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->carry_slots, slots, 0, (size_t) P * sizeof(int64_t));
    dfl_runtime_set(&d->rt, in->first_entry, first, 0, (size_t) P * sizeof(int64_t));
    dfl_runtime_set(&d->rt, in->last_row, last, 0, (size_t) P * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->has_entries, has, 0, (size_t) P * sizeof(float));
    dfl_runtime_set(&d->rt, in->no_entries, none, 0, (size_t) P * sizeof(float));
    if (in->block_parts) {
        dfl_runtime_set(&d->rt, in->block_parts, drafting, 0, (size_t) n_drafting * sizeof(int32_t));
    }
}

/* The block's inputs: the first pass's tokens ([bonus, filler...] per block, or each
 * bonus), every pass's positions and cells (passes past a sequence's block write to its
 * spare cell), the masks and the drafted rows. */
static void stage_block(dfl_draft * d, const dfl_draft_step * step, const part_plan * plans, const draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    const int R = dfl_draft_step_rows(m, step), n_pass = dfl_draft_step_passes(m, step);
    int32_t * tok = d->host_i32, * pos = d->host_i32 + R;
    int64_t * cells = d->host_i64;
    for (int i = 0, row = 0; i < step->n_parts; i++) {
        const part_plan * pp = &plans[i];
        if (pp->n_block == 0) {
            continue;
        }
        dfl_runtime_set(&d->rt, d->blocks.tokens[pp->seq], &pp->bonus, 0, sizeof(int32_t));
        if (m->autoregressive) {
            tok[row] = pp->bonus;
            for (int j = 0; j < n_pass; j++) {
                pos[j * R + row] = pp->pos + j + m->pos_offset;
                cells[j * R + row] = j < pp->n_block - 1 ? dfl_memory_cell(&d->mem, 0, pp->seq, pp->pos + j)
                                                         : dfl_memory_spare_cell(&d->mem, 0, pp->seq);
            }
            row++;
        } else {
            for (int j = 0; j < dfl_draft_block_rows(m, pp->n_block); j++, row++) {
                tok[row] = j == 0 ? pp->bonus : m->filler;
                pos[row] = pp->pos + j + m->pos_offset;
                cells[row] = dfl_memory_cell(&d->mem, 0, pp->seq, pp->pos + j);
            }
        }
    }
    dfl_runtime_set(&d->rt, in->tokens, tok, 0, (size_t) R * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->pos, pos, 0, (size_t) n_pass * R * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->cells, cells, 0, (size_t) n_pass * R * sizeof(int64_t));
    for (int i = 0; i < step->n_parts; i++) {
        for (int k = 0; k < m->n_masks && plans[i].n_block > 0; k++) {
            fill_mask(d, in->mask[i][k], &plans[i], m->autoregressive ? n_pass : dfl_draft_block_rows(m, plans[i].n_block),
                      &m->masks[k]);
        }
    }
    if (in->drafted) {
        int32_t * idx = d->host_i32;
        int k = 0;
        for (int i = 0, row = 0; i < step->n_parts; i++) {
            const int n = plans[i].n_block - 1;
            if (n < 1) {
                continue;
            }
            for (int j = 0; j < n; j++) {
                idx[k++] = m->autoregressive ? j * R + row : row + dfl_draft_first_drafted(m) + j;
            }
            row += dfl_draft_block_rows(m, plans[i].n_block);
        }
        dfl_runtime_set(&d->rt, in->drafted, idx, 0, (size_t) k * sizeof(int32_t));
    }
}

DFL_API dfl_status dfl_draft_propose(dfl_draft * d, const dfl_block * blocks, int32_t n) {
    if (!d || !blocks || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose needs a drafter and at least one block");
    }
    if (n > d->n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose of %d blocks exceeds the %d sequence slots", n, d->n_seq);
    }
    const dfl_drafter * m = &d->m;
    bool seen[DFL_MAX_SEQ] = { false };
    part_plan plans[DFL_MAX_SEQ];
    dfl_draft_step step;
    memset(&step, 0, sizeof step);
    const int ring = dfl_memory_kv_rows(&d->mem, 0);
    for (int i = 0; i < n; i++) {
        part_plan pp;
        TRY(plan_part(d, &blocks[i], seen, &pp));
        seen[pp.seq] = true;
        if (pp.n_block == 0 && pp.n_entries == 0) {
            continue; /* nothing to do for it */
        }
        int n_kv = ((pp.pos + pp.n_block + DFL_DRAFT_KV_PAD - 1) / DFL_DRAFT_KV_PAD) * DFL_DRAFT_KV_PAD;
        n_kv = n_kv > ring ? ring : n_kv;
        /* entries ride along padded to the block size, so that every step has the same
         * shape; a prefill chunk's alone come as they are */
        const int rows = pp.n_block == 0 || pp.n_entries > m->block_size ? pp.n_entries : m->block_size;
        plans[step.n_parts] = pp;
        step.part[step.n_parts++] = (dfl_draft_part) { pp.seq, rows, pp.n_block, pp.n_block > 0 ? n_kv : 0 };
    }
    if (step.n_parts == 0) {
        return DFL_OK;
    }
    const int R = dfl_draft_step_rows(m, &step), D = dfl_draft_step_drafted(&step);
    TRY(reserve_staging(d, &step));
    TRY(propose_sampling(d, &step));
    d->n_graphs++;
    if (!(d->graph_valid && same_step(&d->graph_key, &step))) {
        d->n_graph_builds++;
        d->rank.valid = false;
        d->graph_valid = false;
        dfl_draft_build_graph(d, &step, dfl_runtime_begin_graph(&d->rt, 0), &d->graph);
        TRY(dfl_runtime_alloc(&d->rt, 0, d->graph.gf));
        d->graph_key = step;
        d->graph_valid = true;
    }
    const draft_inputs * in = &d->graph;
    stage_entries(d, &step, plans, in);
    if (R > 0) {
        stage_block(d, &step, plans, in);
    }
    if (D > 0 && step.samp.pick != DFL_PICK_ARGMAX) {
        /* each part's rows of the stage's inputs, from its sequence's sampler */
        dfl_sampler_part parts[DFL_MAX_SEQ];
        int k = 0;
        for (int i = 0; i < step.n_parts; i++) {
            if (plans[i].n_block > 0) {
                parts[k++] = (dfl_sampler_part) { &d->sampler[plans[i].seq], plans[i].n_block - 1 };
            }
        }
        TRY(dfl_sampler_fill_parts(parts, k, &d->rt, &in->sampled, &step.samp, m->n_vocab));
    }
    TRY(dfl_runtime_compute(&d->rt, 0, in->gf));
    d->n_step_nodes = d->rt.n_last_nodes;
    d->rank.fresh = false;
    for (int i = 0; i < step.n_parts; i++) {
        d->mem.seq[plans[i].seq].n_past = plans[i].pos;
        d->blocks.n[plans[i].seq] = plans[i].n_block;
    }
    d->n_out = D;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_append(dfl_draft * d, int32_t seq, const int32_t * tokens, int32_t n_tokens) {
    TRY(check_seq(d, seq));
    const dfl_block b = { seq, tokens, n_tokens, 0, 0 };
    return dfl_draft_propose(d, &b, 1);
}

/* ---- results ------------------------------------------------------------------------------- */

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

static dfl_status check_out_rows(const dfl_draft * d, int32_t row0, int32_t n_rows, const void * dst) {
    if (!d || !dst) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > d->n_out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "drafter rows %d..%d requested, the last propose produced %d", row0,
                        row0 + n_rows, d->n_out);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_logits(const dfl_draft * d, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_out_rows(d, row0, n_rows, dst));
    const size_t row = (size_t) d->m.n_vocab * sizeof(float);
    dfl_runtime_get(&d->rt, d->graph.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_set_sampling(dfl_draft * d, int32_t seq, const dfl_sampling * s) {
    TRY(check_seq(d, seq));
    if (!s) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or settings");
    }
    if (s->temperature > 0.0f && d->m.greedy_only) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter drafts its own choices only (greedy): it cannot draw its "
                        "drafts", d->m.registry->name);
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

static dfl_status check_ranked_rows(const dfl_draft * d, int32_t row0, int32_t n_rows, const float * logprobs) {
    if (d && d->p.top_k == 0) {
        return dfl_fail(DFL_ERR_STATE, "the drafter was loaded with top_k = 0");
    }
    return check_out_rows(d, row0, n_rows, logprobs);
}

DFL_API dfl_status dfl_draft_confidence(const dfl_draft * d, int32_t row0, int32_t n_rows, float * out) {
    TRY(check_out_rows(d, row0, n_rows, out));
    if (!d->graph.confidence) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter has no confidence head", d->m.registry->name);
    }
    dfl_runtime_get(&d->rt, d->graph.confidence, out, (size_t) row0 * sizeof(float), (size_t) n_rows * sizeof(float));
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_top1(const dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    TRY(check_ranked_rows(d, row0, n_rows, logprobs));
    if (tokens) {
        dfl_runtime_get(&d->rt, d->graph.argmax, tokens, (size_t) row0 * sizeof(int32_t), (size_t) n_rows * sizeof(int32_t));
    }
    dfl_runtime_get(&d->rt, d->graph.argmax_lp, logprobs, (size_t) row0 * sizeof(float), (size_t) n_rows * sizeof(float));
    return DFL_OK;
}

/* A leaf of ctx over a [V, rows] result of the propose graph, where that graph left it */
static struct ggml_tensor * in_place(struct ggml_context * ctx, const struct ggml_tensor * x) {
    struct ggml_tensor * in = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1]);
    return ggml_backend_tensor_alloc(x->buffer, in, x->data) == GGML_STATUS_SUCCESS ? in : NULL;
}

/* The last propose's candidates on the device, ranked once per propose: the rank graph
 * reads the propose graph's logits and softmax where that graph left them (slot 0 keeps
 * its memory until the next propose). */
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
        dfl_draft_build_rank(d, ctx, logits, probs, r);
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

DFL_API dfl_status dfl_draft_topk(dfl_draft * d, int32_t row0, int32_t n_rows, int32_t * tokens, float * logprobs) {
    TRY(check_ranked_rows(d, row0, n_rows, logprobs));
    if (!tokens) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null drafter or output");
    }
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

/* ---- for the memory planner ------------------------------------------------------------- */

dfl_draft_step dfl_draft_worst_step(const dfl_draft * d, bool entries_only) {
    dfl_draft_step step;
    memset(&step, 0, sizeof step);
    const int B = d->m.block_size, ring = dfl_memory_kv_rows(&d->mem, 0);
    if (entries_only) {
        step.n_parts = 1;
        step.part[0] = (dfl_draft_part) { 0, dfl_target_n_ubatch(d->target), 0, 0 };
        return step;
    }
    step.n_parts = d->n_seq;
    for (int i = 0; i < d->n_seq; i++) {
        step.part[i] = (dfl_draft_part) { i, B, B, ring < d->n_ctx ? ring : d->n_ctx };
    }
    /* drafts drawn over the whole vocabulary, unless the drafter only ever picks its own */
    step.samp.pick = d->m.greedy_only ? DFL_PICK_ARGMAX : DFL_PICK_FULL;
    step.samp.by_sort = d->rt.top_k_by_sort;
    return step;
}

dfl_status dfl_draft_worst_graphs(dfl_draft * d, dfl_graph_visit visit, void * user, ggml_backend_buffer_t rank_inputs) {
    draft_inputs in;
    const dfl_draft_step chunk = dfl_draft_worst_step(d, true), worst = dfl_draft_worst_step(d, false);
    dfl_draft_build_graph(d, &chunk, dfl_runtime_begin_graph(&d->rt, 0), &in);
    visit(&d->rt, 0, in.gf, user);
    dfl_draft_build_graph(d, &worst, dfl_runtime_begin_graph(&d->rt, 0), &in);
    visit(&d->rt, 0, in.gf, user);
    if (d->p.top_k <= 1) {
        return DFL_OK;
    }
    struct ggml_context * ctx = dfl_runtime_begin_graph(&d->rt, 1);
    struct ggml_tensor * logits, * probs;
    if (rank_inputs) {
        logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d->m.n_vocab, dfl_draft_step_drafted(&worst));
        probs = ggml_dup_tensor(ctx, logits);
        dfl_runtime_place_dummy(logits, rank_inputs);
        dfl_runtime_place_dummy(probs, rank_inputs);
    } else {
        logits = in_place(ctx, in.logits);
        probs = in_place(ctx, in.probs);
        if (!logits || !probs) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot read the drafter's logits in place");
        }
    }
    rank_graph r;
    dfl_draft_build_rank(d, ctx, logits, probs, &r);
    visit(&d->rt, 1, r.gf, user);
    return DFL_OK;
}
