/* The memory layer: a model's state in sequence slots (see dfl_memory.h). */
#include "dfl_memory.h"

#include <string.h>


static int max_int(int a, int b) { return a > b ? a : b; }

replay_planes dfl_replay_planes(const dfl_recurrent_geometry * r, int n_verify) {
    const int64_t cols = n_verify + 1, qk = 2 * (int64_t) r->head_k_dim * r->n_k_heads;
    replay_planes P = { cols, 0, r->conv_channels * cols, 0, 0 };
    P.g = P.qk + qk * cols;
    P.beta = P.g + r->n_v_heads * cols;
    return P;
}

int64_t dfl_replay_floats(const dfl_recurrent_geometry * r, int n_verify) {
    const replay_planes P = dfl_replay_planes(r, n_verify);
    return P.beta + r->n_v_heads * P.cols;
}

/* The first row of slot seq's own feature rows. */
static int64_t own_rows(const dfl_memory * mem, int seq) {
    return (int64_t) seq * mem->feature_rows;
}

/* The slot's feature rows hold nothing, in its own region. */
static void features_forget(const dfl_memory * mem, dfl_seq * s, int seq, int n_past) {
    s->feat.row0 = own_rows(mem, seq);
    s->feat.base = s->feat.rows = s->feat.kept = 0;
    s->feat.p0 = n_past;
    s->feat.tree = false;
}

static void seq_reset(dfl_memory * mem, int seq, int n_past) {
    dfl_seq * s = &mem->seq[seq];
    s->n_past = n_past;
    features_forget(mem, s, seq, n_past);
}

dfl_status dfl_memory_define(dfl_memory * mem, const dfl_memory_layout * layout, const dfl_memory_params * p) {
    mem->layout = *layout;
    mem->n_seq = p->n_seq;
    mem->n_ctx = p->n_ctx;
    mem->n_verify = p->n_verify;
    mem->spare = p->spare;
    mem->swa_window = 0;
    for (int il = 0; il < layout->n_layer; il++) {
        if (layout->kind[il] == DFL_LAYER_ATTENTION && layout->attn[il].window > 0) {
            mem->swa_window = layout->attn[il].window;
        }
    }
    /* a call's rows must not take the ring rows of positions still inside any of its
     * rows' windows: window - 1 + rows at least */
    mem->swa_ring = mem->swa_window > 0 && mem->swa_window + p->window_rows < p->n_ctx
                        ? mem->swa_window + p->window_rows : p->n_ctx;
    /* one slot's feature rows hold its largest call, a prefill chunk or a verify; with
     * several, each slot's hold a verify and as many rows a drafter lacks (the lag it
     * may keep over plain steps), and a prefill chunk of any slot goes to the chunk rows
     * after them, which its drafter takes before another slot's chunk replaces it: the
     * memory of one chunk, not one a slot */
    const int largest = max_int(p->n_ubatch, p->n_verify);
    const int step = 2 * p->n_verify;
    const bool chunk_apart = p->n_seq > 1 && largest > step;
    mem->feature_rows = p->feature_floats > 0 ? (chunk_apart ? step : largest) : 0;
    mem->chunk_rows = p->feature_floats > 0 && chunk_apart ? largest : 0;
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        seq_reset(mem, s, 0);
    }

    const int n_tensors = 5 * layout->n_layer + 2;
    for (int k = 0; k < 2; k++) {
        struct ggml_init_params ip = { (size_t) n_tensors * ggml_tensor_overhead(), NULL, true };
        mem->ctx[k] = ggml_init(ip);
        if (!mem->ctx[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot create the state context");
        }
    }
    const int64_t S = p->n_seq;
    for (int il = 0; il < layout->n_layer; il++) {
        struct ggml_context * ctx = mem->ctx[p->on_device[il] ? 0 : 1];
        if (layout->kind[il] == DFL_LAYER_RECURRENT) {
            const dfl_recurrent_geometry * r = layout->rec;
            const int64_t state_size = (int64_t) r->head_v_dim * r->head_v_dim * r->n_v_heads;
            mem->conv[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, r->d_conv - 1, r->conv_channels, S);
            mem->ssm[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, state_size, S);
            mem->replay[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, dfl_replay_floats(r, p->n_verify), S);
            mem->conv_scratch[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, r->conv_channels, r->d_conv - 1 + p->n_verify,
                                                       S);
        } else if (!layout->attn[il].shares_kv) {
            const dfl_attention_geometry * a = &layout->attn[il];
            const int64_t rows = (int64_t) (dfl_memory_kv_rows(mem, il) + mem->spare) * S;
            mem->k[il] = ggml_new_tensor_2d(ctx, p->type_k, (int64_t) a->head_dim_k * a->n_head_kv, rows);
            mem->v[il] = ggml_new_tensor_2d(ctx, p->type_v, (int64_t) a->head_dim_v * a->n_head_kv, rows);
        }
    }
    mem->features = NULL;
    if (p->feature_floats > 0) {
        mem->features = ggml_new_tensor_2d(mem->ctx[p->features_on_device ? 0 : 1], GGML_TYPE_F32, p->feature_floats,
                                           (int64_t) mem->feature_rows * S + mem->chunk_rows);
    }
    mem->state = p->state_floats > 0 ? ggml_new_tensor_2d(mem->ctx[0], GGML_TYPE_F32, p->state_floats, S) : NULL;
    return DFL_OK;
}

dfl_status dfl_memory_alloc(dfl_memory * mem, const ggml_backend_dev_t devs[2]) {
    for (int k = 0; k < 2; k++) {
        if (!ggml_get_first_tensor(mem->ctx[k])) {
            continue;
        }
        mem->buf[k] = ggml_backend_alloc_ctx_tensors_from_buft(mem->ctx[k], ggml_backend_dev_buffer_type(devs[k]));
        if (!mem->buf[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "out of %s memory for %d sequences of %d tokens",
                            ggml_backend_dev_name(devs[k]), mem->n_seq, mem->n_ctx);
        }
        ggml_backend_buffer_clear(mem->buf[k], 0);
    }
    return DFL_OK;
}

void dfl_memory_free(dfl_memory * mem) {
    for (int k = 0; k < 2; k++) {
        if (mem->buf[k]) ggml_backend_buffer_free(mem->buf[k]);
        if (mem->ctx[k]) ggml_free(mem->ctx[k]);
        mem->buf[k] = NULL;
        mem->ctx[k] = NULL;
    }
}

void dfl_memory_clear(dfl_memory * mem) {
    for (int k = 0; k < 2; k++) {
        if (mem->buf[k]) ggml_backend_buffer_clear(mem->buf[k], 0);
    }
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        seq_reset(mem, s, 0);
    }
}

size_t dfl_memory_slot_bytes(const dfl_memory * mem, const struct ggml_tensor * state) {
    return ggml_nbytes(state) / (size_t) mem->n_seq;
}

size_t dfl_memory_slice_offset(const dfl_memory * mem, const struct ggml_tensor * state, int seq) {
    return (size_t) seq * dfl_memory_slot_bytes(mem, state);
}

struct ggml_tensor * dfl_memory_slice(struct ggml_context * ctx, const dfl_memory * mem, struct ggml_tensor * state,
                                      int seq) {
    const int64_t n = ggml_nelements(state) / mem->n_seq;
    return ggml_view_2d(ctx, state, state->ne[0], n / state->ne[0], state->nb[1],
                        dfl_memory_slice_offset(mem, state, seq));
}

void dfl_memory_seq_clear(dfl_memory * mem, int seq) {
    /* attention rows need no clearing: a slot's masks hide the positions it does not hold */
    for (int il = 0; il < mem->layout.n_layer; il++) {
        struct ggml_tensor * states[2] = { mem->conv[il], mem->ssm[il] };
        for (int k = 0; k < 2 && mem->layout.kind[il] == DFL_LAYER_RECURRENT; k++) {
            ggml_backend_tensor_memset(states[k], 0, dfl_memory_slice_offset(mem, states[k], seq),
                                       dfl_memory_slot_bytes(mem, states[k]));
        }
    }
    if (mem->state) {
        ggml_backend_tensor_memset(mem->state, 0, dfl_memory_slice_offset(mem, mem->state, seq),
                                   dfl_memory_slot_bytes(mem, mem->state));
    }
    seq_reset(mem, seq, 0);
}

void dfl_memory_seq_restored(dfl_memory * mem, int seq, int n_past) {
    seq_reset(mem, seq, n_past);
}

int dfl_memory_kv_rows(const dfl_memory * mem, int il) {
    return mem->layout.attn[il].window > 0 ? mem->swa_ring : mem->n_ctx;
}

int64_t dfl_memory_kv_base(const dfl_memory * mem, int il, int seq) {
    return (int64_t) seq * (dfl_memory_kv_rows(mem, il) + mem->spare);
}

int64_t dfl_memory_cell(const dfl_memory * mem, int il, int seq, int pos) {
    return dfl_memory_kv_base(mem, il, seq) + pos % dfl_memory_kv_rows(mem, il);
}

int64_t dfl_memory_spare_cell(const dfl_memory * mem, int il, int seq) {
    return dfl_memory_kv_base(mem, il, seq) + dfl_memory_kv_rows(mem, il);
}

int64_t dfl_memory_features_region(const dfl_memory * mem, int seq, int rows) {
    /* the chunk rows follow every slot's own */
    return mem->chunk_rows > 0 && rows > mem->feature_rows ? own_rows(mem, mem->n_seq) : own_rows(mem, seq);
}

/* Whether the committed positions a slot's feature rows hold lie in row order (a tree
 * commit's path may skip rows). */
static bool held_in_order(const dfl_features_held * f) {
    for (int k = 0; f->tree && k < f->kept; k++) {
        if (f->path[k] != k) {
            return false;
        }
    }
    return true;
}

/* The region's rows: a slot's own, or the chunk rows. */
static int region_rows(const dfl_memory * mem, const dfl_features_held * f, int seq) {
    return f->row0 == own_rows(mem, seq) ? mem->feature_rows : mem->chunk_rows;
}

int dfl_memory_features_at(const dfl_memory * mem, int seq, int p0, int rows, int taken) {
    const dfl_features_held * f = &mem->seq[seq].feat;
    const int held = f->base + f->kept, end = f->p0 + held;
    const bool lacking = taken < end;
    const bool same_region = f->row0 == dfl_memory_features_region(mem, seq, rows);
    return lacking && same_region && end == p0 && held_in_order(f) && held + rows <= region_rows(mem, f, seq) ? held
                                                                                                             : 0;
}

int dfl_memory_features_room(const dfl_memory * mem, int seq, int taken) {
    const dfl_features_held * f = &mem->seq[seq].feat;
    const int held = f->base + f->kept;
    if (taken >= f->p0 + held) {
        return mem->feature_rows;
    }
    /* what the chunk rows hold, the slot's next verify (in its own rows) lets go */
    return held_in_order(f) && f->row0 == own_rows(mem, seq) ? mem->feature_rows - held : 0;
}

void dfl_memory_features_written(dfl_memory * mem, int seq, int p0, int rows, int kept, int at) {
    dfl_features_held * f = &mem->seq[seq].feat;
    f->row0 = dfl_memory_features_region(mem, seq, rows);
    if (f->row0 != own_rows(mem, seq)) {
        /* the chunk rows are this slot's now: another slot that held them holds nothing */
        for (int s = 0; s < mem->n_seq; s++) {
            if (s != seq && mem->seq[s].feat.row0 == f->row0) {
                features_forget(mem, &mem->seq[s], s, mem->seq[s].n_past);
            }
        }
    }
    f->base = at;
    f->rows = rows;
    f->p0 = p0 - at;
    f->kept = kept;
    f->tree = false;
}

void dfl_memory_features_kept(dfl_memory * mem, int seq, const int32_t * path, int n) {
    dfl_features_held * f = &mem->seq[seq].feat;
    f->kept = n;
    f->tree = path != NULL;
    if (path) {
        memcpy(f->path, path, (size_t) n * sizeof(int32_t));
    }
}

int64_t dfl_memory_feature_of(const dfl_memory * mem, int seq, int pos) {
    const dfl_features_held * f = &mem->seq[seq].feat;
    const int k = pos - f->p0;
    if (!mem->features || k < 0 || k >= f->base + f->kept) {
        return -1;
    }
    const int j = k - f->base; /* a row of the last call's, when not negative */
    return f->row0 + (j < 0 ? k : f->base + (f->tree ? f->path[j] : j));
}

int dfl_memory_seq_parts(const dfl_memory * mem, int seq, int n_past, dfl_memory_part * parts) {
    const dfl_memory_layout * L = &mem->layout;
    int n = 0;
    for (int il = 0; il < L->n_layer; il++) {
        if (L->kind[il] == DFL_LAYER_RECURRENT) {
            struct ggml_tensor * states[2] = { mem->conv[il], mem->ssm[il] };
            for (int k = 0; k < 2; k++, n++) {
                if (parts) {
                    parts[n] = (dfl_memory_part) { states[k], 0, 0, 0, dfl_memory_slice_offset(mem, states[k], seq),
                                                   dfl_memory_slot_bytes(mem, states[k]) };
                }
            }
        } else if (mem->k[il]) { /* layers sharing another layer's cache have none */
            const int window = L->attn[il].window;
            const int need = window > 0 && n_past > window ? n_past - window : 0;
            struct ggml_tensor * caches[2] = { mem->k[il], mem->v[il] };
            for (int k = 0; k < 2; k++, n++) {
                if (parts) {
                    parts[n] = (dfl_memory_part) { caches[k], dfl_memory_kv_base(mem, il, seq),
                                                   dfl_memory_kv_rows(mem, il), need, 0, 0 };
                }
            }
        }
    }
    if (mem->state) {
        if (parts) {
            parts[n] = (dfl_memory_part) { mem->state, 0, 0, 0, dfl_memory_slice_offset(mem, mem->state, seq),
                                           dfl_memory_slot_bytes(mem, mem->state) };
        }
        n++;
    }
    return n;
}

/* A view of `rows` rows of a 2-D tensor from row `row0`, ready for the backend's copies. */
static struct ggml_tensor * row_view(struct ggml_context * ctx, struct ggml_tensor * t, int64_t row0, int64_t rows) {
    struct ggml_tensor * v = ggml_view_2d(ctx, t, t->ne[0], rows, t->nb[1], (size_t) row0 * t->nb[1]);
    return ggml_backend_view_init(v) == GGML_STATUS_SUCCESS ? v : NULL;
}

dfl_status dfl_memory_copy_rows(const dfl_memory_part * part, struct ggml_tensor * copy, int64_t copy_row0, int first,
                                int end, bool to_part) {
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    const int ring = part->ring;
    dfl_status st = DFL_OK;
    for (int pos = first, runs = 0; pos < end && st == DFL_OK; runs++) {
        const int slot = pos % ring;
        const int run = ring - slot < end - pos ? ring - slot : end - pos;
        struct ggml_tensor * live = row_view(ctx, part->tensor, part->base + slot, run);
        struct ggml_tensor * held = row_view(ctx, copy, copy_row0 + (pos - first), run);
        if (runs == 2 || !live || !held) {
            st = dfl_fail(DFL_ERR_BACKEND, "cannot view the rows of a sequence's state");
        } else if (to_part) {
            ggml_backend_tensor_copy(held, live);
        } else {
            ggml_backend_tensor_copy(live, held);
        }
        pos += run;
    }
    ggml_free(ctx);
    return st;
}

dfl_status dfl_memory_copy_slice(const dfl_memory_part * part, struct ggml_tensor * copy, bool to_part) {
    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    const int64_t n = (int64_t) (part->bytes / ggml_type_size(part->tensor->type));
    struct ggml_tensor * live = ggml_view_1d(ctx, part->tensor, n, part->offset);
    struct ggml_tensor * held = ggml_view_1d(ctx, copy, n, 0);
    dfl_status st = DFL_OK;
    if (ggml_backend_view_init(live) != GGML_STATUS_SUCCESS || ggml_backend_view_init(held) != GGML_STATUS_SUCCESS) {
        st = dfl_fail(DFL_ERR_BACKEND, "cannot view a sequence's state");
    } else if (to_part) {
        ggml_backend_tensor_copy(held, live);
    } else {
        ggml_backend_tensor_copy(live, held);
    }
    ggml_free(ctx);
    return st;
}

dfl_status dfl_memory_seq_copy(dfl_memory * mem, int src, int dst) {
    const dfl_seq * s = &mem->seq[src];
    if (src == dst) {
        return DFL_OK;
    }
    const int n = dfl_memory_seq_parts(mem, src, s->n_past, NULL);
    dfl_memory_part from[2 * DFL_MAX_LAYERS + 1], to[2 * DFL_MAX_LAYERS + 1];
    dfl_memory_seq_parts(mem, src, s->n_past, from);
    dfl_memory_seq_parts(mem, dst, s->n_past, to);
    for (int i = 0; i < n; i++) {
        if (from[i].ring == 0) {
            /* a slice of the same tensor: its bytes through a view of the source */
            struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
            struct ggml_context * ctx = ggml_init(ip);
            if (!ctx) {
                return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
            }
            struct ggml_tensor * view = ggml_view_1d(ctx, from[i].tensor,
                                                     (int64_t) (from[i].bytes / ggml_type_size(from[i].tensor->type)),
                                                     from[i].offset);
            dfl_status st = ggml_backend_view_init(view) == GGML_STATUS_SUCCESS
                                ? dfl_memory_copy_slice(&to[i], view, true)
                                : dfl_fail(DFL_ERR_BACKEND, "cannot view a sequence's state");
            ggml_free(ctx);
            if (st != DFL_OK) {
                return st;
            }
            continue;
        }
        /* the positions still read, through a view of the source rows in position order */
        const int first = from[i].need;
        if (first >= s->n_past) {
            continue;
        }
        struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
        struct ggml_context * ctx = ggml_init(ip);
        if (!ctx) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        /* a ring holds them in at most two runs: copy run by run */
        dfl_status st = DFL_OK;
        for (int pos = first; pos < s->n_past && st == DFL_OK;) {
            const int slot = pos % from[i].ring;
            const int run = from[i].ring - slot < s->n_past - pos ? from[i].ring - slot : s->n_past - pos;
            struct ggml_tensor * rows = row_view(ctx, from[i].tensor, from[i].base + slot, run);
            st = rows ? dfl_memory_copy_rows(&to[i], rows, 0, pos, pos + run, true)
                      : dfl_fail(DFL_ERR_BACKEND, "cannot view a sequence's state");
            pos += run;
        }
        ggml_free(ctx);
        if (st != DFL_OK) {
            return st;
        }
    }
    seq_reset(mem, dst, s->n_past);
    return DFL_OK;
}
