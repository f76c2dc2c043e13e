/* Prefix checkpoints: the whole decoding state at a context position, copied through
 * the backend (never through tensor data pointers), so that a later request sharing the
 * prefix resumes there instead of prefilling it again.
 *
 * A position's state is more than the attention cache: recurrent layers carry their
 * Gated DeltaNet and conv states (which cannot be rolled back, only replaced), and the
 * drafter carries its projected context. Everything is saved, or nothing is usable.
 *
 * Where the copy lives: state on a device is copied device to device into a buffer of
 * the same buffer type (no transfer, and the card's memory is the fast place to come
 * back from), or to host memory when asked or when the device has no room; state in
 * host memory (CPU layers of a split) stays in host memory.
 *
 * Sharing: checkpoints of one long prompt (every N tokens, then its end) would each copy
 * the same prefix rows again. A checkpoint saved on top of a parent (an earlier
 * checkpoint of a prefix of the same tokens) keeps only the rows from the parent's
 * position on, plus the fixed-size recurrent and conv states; restoring it copies the
 * rows of the whole chain. A parent stays alive while a child needs it. */
#include "dfl_checkpoint.h"
#include "dfl_target_impl.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>

#include <stdlib.h>
#include <string.h>

#define MAX_BUFFERS 4
#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

/* One piece of state. Per-position caches (attention K or V, the drafter's K or V) keep
 * positions [first, end) in position order, position p being row p % ring of the live
 * cache; fixed-size states (ring 0) are copied whole. */
typedef struct part {
    struct ggml_tensor * live;
    int ring;
    int need;               /* the first position the checkpoint's position needs */
    int first, end;         /* the positions this checkpoint holds itself */
    struct ggml_tensor * copy;
    int buffer;             /* which of the checkpoint's buffers holds the copy */
} part;

struct dfl_checkpoint {
    const dfl_target * target; /* the pair it was taken from, and the only one it restores into */
    const dfl_draft * draft;   /* NULL: the target alone */
    dfl_checkpoint * parent;   /* holds the rows before this one's own, NULL: none needed */
    int refs;                  /* the caller's handle and every child */
    int released;              /* the caller freed its handle (children keep the state alive) */
    int32_t n_past;
    int n_parts;
    part * parts;
    /* one buffer per buffer type the copies live in, and the context of its tensors */
    int n_buffers;
    struct ggml_context * ctxs[MAX_BUFFERS];
    ggml_backend_buffer_t buffers[MAX_BUFFERS];
    size_t device_bytes, host_bytes;
};

/* Every piece of state of target (and drafter) at position n_past, in a fixed order:
 * a child's parts match its parent's index by index. Returns the count; parts may be
 * NULL to count only. */
static int list_parts(const dfl_target * t, const dfl_draft * d, int n_past, part * parts) {
    int n = 0;
    for (int il = 0; il < t->m.n_layer; il++) {
        struct ggml_tensor * pair[2];
        int ring = 0, need = 0;
        if (t->m.kind[il] == DFL_LAYER_RECURRENT) {
            pair[0] = t->conv_state[il];
            pair[1] = t->ssm_state[il];
        } else if (t->k_cache[il]) { /* layers sharing another layer's cache have none */
            pair[0] = t->k_cache[il];
            pair[1] = t->v_cache[il];
            const int window = t->m.attn[il].window;
            ring = window > 0 ? t->swa_ring : t->p.n_ctx;
            need = window > 0 && n_past > window ? n_past - window : 0;
        } else {
            continue;
        }
        for (int k = 0; k < 2; k++, n++) {
            if (parts) {
                parts[n] = (part) { pair[k], ring, need, need, n_past, NULL, 0 };
            }
        }
    }
    if (d) {
        const int ring = dfl_draft_ring(d);
        const int need = dfl_draft_first_visible(d);
        for (int il = 0; il < dfl_draft_n_layers(d); il++) {
            for (int k = 0; k < 2; k++, n++) {
                if (parts) {
                    parts[n] = (part) { dfl_draft_cache(d, il, k), ring, need, need, n_past, NULL, 0 };
                }
            }
        }
    }
    return n;
}

static size_t part_bytes(const part * p) {
    return p->ring ? p->live->nb[1] * (size_t) (p->end - p->first) : ggml_nbytes(p->live);
}

/* The parts a checkpoint at the current position holds itself: with a parent, the rows
 * of per-position caches from the parent's position on. Sets *needs_parent when some
 * part needs rows only the parent's chain holds. */
static dfl_status own_parts(const dfl_target * t, const dfl_draft * d, const dfl_checkpoint * parent, part ** out,
                            int * n_out, int * needs_parent) {
    const int n = list_parts(t, d, t->n_past, NULL);
    part * parts = calloc((size_t) (n > 0 ? n : 1), sizeof *parts);
    if (!parts) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    list_parts(t, d, t->n_past, parts);
    *needs_parent = 0;
    for (int i = 0; parent && i < n; i++) {
        if (parts[i].ring && parts[i].first < parent->n_past) {
            parts[i].first = parent->n_past;
            *needs_parent = 1;
        }
    }
    *out = parts;
    *n_out = n;
    return DFL_OK;
}

static dfl_status check_parent(const dfl_target * t, const dfl_draft * d, const dfl_checkpoint * parent) {
    if (!parent) {
        return DFL_OK;
    }
    if (parent->released) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the parent checkpoint was freed");
    }
    if (parent->target != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the parent checkpoint was taken from another target");
    }
    if (parent->draft != d) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the parent checkpoint was taken with another drafter (or none)");
    }
    if (parent->n_past >= t->n_past) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the parent checkpoint is at position %d, not before the context's %d",
                        parent->n_past, t->n_past);
    }
    return DFL_OK;
}

static bool on_host(const part * p) { return ggml_backend_buffer_is_host(p->live->buffer); }

DFL_API dfl_status dfl_checkpoint_measure(const dfl_target * t, const dfl_draft * d, const dfl_checkpoint * parent,
                                          uint64_t * device_bytes, uint64_t * host_bytes) {
    if (!t || !device_bytes || !host_bytes) {
        return dfl_fail(DFL_ERR_ARGUMENT, "measuring a checkpoint needs a target and two results");
    }
    TRY(check_parent(t, d, parent));
    part * parts;
    int n, needs_parent;
    TRY(own_parts(t, d, parent, &parts, &n, &needs_parent));
    *device_bytes = *host_bytes = 0;
    for (int i = 0; i < n; i++) {
        *(on_host(&parts[i]) ? host_bytes : device_bytes) += part_bytes(&parts[i]);
    }
    free(parts);
    return DFL_OK;
}

/* Positions [first, end) between a per-position cache and the copy of `holder` (which
 * holds positions from holder->first on), through row views: at most two runs, since a
 * ring wraps at most once over the positions one checkpoint needs. */
static dfl_status copy_rows(const part * live_part, const part * holder, int first, int end, bool to_live) {
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    struct ggml_tensor * cache = live_part->live;
    const size_t row = cache->nb[1];
    const int ring = live_part->ring;
    dfl_status st = DFL_OK;
    for (int pos = first, runs = 0; pos < end && st == DFL_OK; runs++) {
        const int slot = pos % ring;
        const int run = ring - slot < end - pos ? ring - slot : end - pos;
        struct ggml_tensor * live = ggml_view_2d(ctx, cache, cache->ne[0], run, row, (size_t) slot * row);
        struct ggml_tensor * copy = ggml_view_2d(ctx, holder->copy, cache->ne[0], run, row,
                                                 (size_t) (pos - holder->first) * row);
        if (runs == 2 || ggml_backend_view_init(live) != GGML_STATUS_SUCCESS ||
            ggml_backend_view_init(copy) != GGML_STATUS_SUCCESS) {
            st = dfl_fail(DFL_ERR_BACKEND, "cannot view the rows of a checkpoint");
        } else if (to_live) {
            ggml_backend_tensor_copy(copy, live);
        } else {
            ggml_backend_tensor_copy(live, copy);
        }
        pos += run;
    }
    ggml_free(ctx);
    return st;
}

/* Give every part's copy memory: state on a device in a buffer of the same type when
 * on_device (host memory when that allocation fails), everything else in host memory;
 * one buffer per buffer type. */
static dfl_status alloc_copies(dfl_checkpoint * c, bool on_device) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        return dfl_fail(DFL_ERR_BACKEND, "no CPU device for the host copies of a checkpoint");
    }
    ggml_backend_buffer_type_t host = ggml_backend_dev_buffer_type(cpu);
    ggml_backend_buffer_type_t types[MAX_BUFFERS];
    struct ggml_init_params ip = { (size_t) c->n_parts * ggml_tensor_overhead(), NULL, true };
    for (int i = 0; i < c->n_parts; i++) {
        part * p = &c->parts[i];
        if (part_bytes(p) == 0) {
            continue;
        }
        ggml_backend_buffer_type_t type = on_device || on_host(p) ? ggml_backend_buffer_get_type(p->live->buffer) : host;
        int k = 0;
        while (k < c->n_buffers && types[k] != type) {
            k++;
        }
        if (k == c->n_buffers) {
            if (k == MAX_BUFFERS) {
                return dfl_fail(DFL_ERR_BACKEND, "the state lives in more than %d kinds of buffers", MAX_BUFFERS);
            }
            c->ctxs[k] = ggml_init(ip);
            if (!c->ctxs[k]) {
                return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
            }
            types[k] = type;
            c->n_buffers++;
        }
        p->buffer = k;
        p->copy = ggml_new_tensor_2d(c->ctxs[k], p->live->type, p->live->ne[0],
                                     p->ring ? p->end - p->first : ggml_nelements(p->live) / p->live->ne[0]);
    }
    for (int k = 0; k < c->n_buffers; k++) {
        c->buffers[k] = ggml_backend_alloc_ctx_tensors_from_buft(c->ctxs[k], types[k]);
        if (!c->buffers[k] && types[k] != host) {
            /* no room on the device: host memory, as if asked for */
            c->buffers[k] = ggml_backend_alloc_ctx_tensors_from_buft(c->ctxs[k], host);
        }
        if (!c->buffers[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "out of memory for a checkpoint at position %d", c->n_past);
        }
    }
    for (int i = 0; i < c->n_parts; i++) {
        if (c->parts[i].copy) {
            const bool host_buffer = ggml_backend_buffer_is_host(c->buffers[c->parts[i].buffer]);
            *(host_buffer ? &c->host_bytes : &c->device_bytes) += part_bytes(&c->parts[i]);
        }
    }
    return DFL_OK;
}

static void release(dfl_checkpoint * c) {
    if (!c || --c->refs > 0) {
        return;
    }
    release(c->parent);
    for (int k = 0; k < c->n_buffers; k++) {
        if (c->buffers[k]) ggml_backend_buffer_free(c->buffers[k]);
        ggml_free(c->ctxs[k]);
    }
    free(c->parts);
    free(c);
}

DFL_API dfl_status dfl_checkpoint_save(dfl_target * t, dfl_draft * d, dfl_checkpoint * parent, int32_t on_device,
                                       dfl_checkpoint ** out) {
    if (!t || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a checkpoint needs a target");
    }
    *out = NULL;
    if (d && dfl_draft_target(d) != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
    }
    /* between a verify and the graph that carries its commit, the recurrent state is
     * not yet the committed position's */
    if (t->pending_verify || t->commit.active) {
        return dfl_fail(DFL_ERR_STATE, "the target is between a verify and its commit: checkpoints are taken "
                        "after a decode (a prefill)");
    }
    if (t->n_past == 0) {
        return dfl_fail(DFL_ERR_STATE, "the context is empty: nothing to checkpoint");
    }
    if (d && dfl_draft_n_tokens(d) != t->n_past) {
        return dfl_fail(DFL_ERR_STATE, "the drafter holds %d context positions, the target %d: append the target's "
                        "features before taking a checkpoint", dfl_draft_n_tokens(d), t->n_past);
    }
    TRY(check_parent(t, d, parent));
    dfl_checkpoint * c = calloc(1, sizeof *c);
    if (!c) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    c->target = t;
    c->draft = d;
    c->refs = 1;
    c->n_past = t->n_past;
    int needs_parent = 0;
    dfl_status st = own_parts(t, d, parent, &c->parts, &c->n_parts, &needs_parent);
    if (st == DFL_OK) {
        st = alloc_copies(c, on_device != 0);
    }
    for (int i = 0; st == DFL_OK && i < c->n_parts; i++) {
        const part * p = &c->parts[i];
        if (!p->copy) {
            continue;
        }
        if (p->ring) {
            st = copy_rows(p, p, p->first, p->end, false);
        } else {
            ggml_backend_tensor_copy(p->live, p->copy);
        }
    }
    if (st != DFL_OK) {
        release(c);
        return st;
    }
    if (needs_parent) {
        c->parent = parent;
        parent->refs++;
    }
    *out = c;
    return DFL_OK;
}

DFL_API dfl_status dfl_checkpoint_restore(const dfl_checkpoint * c, dfl_target * t, dfl_draft * d) {
    if (!c || !t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "restoring needs a checkpoint and a target");
    }
    if (c->released) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the checkpoint was freed");
    }
    if (c->target != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the checkpoint was taken from another target");
    }
    if (d && c->draft != d) {
        return dfl_fail(DFL_ERR_ARGUMENT, c->draft ? "the checkpoint was taken with another drafter"
                                                   : "the checkpoint holds no drafter context");
    }
    /* a target-only restore of a checkpoint with drafter context restores the target's
     * parts, which come first */
    const int n_parts = d ? c->n_parts : list_parts(t, NULL, c->n_past, NULL);
    for (int i = 0; i < n_parts; i++) {
        const part * p = &c->parts[i];
        if (!p->ring) {
            if (p->copy) {
                ggml_backend_tensor_copy(p->copy, p->live);
            }
            continue;
        }
        /* oldest rows last would be wrong in a ring only if two positions shared a slot,
         * which the positions one checkpoint needs never do */
        for (const dfl_checkpoint * holder = c; holder; holder = holder->parent) {
            const part * h = &holder->parts[i];
            const int first = h->first > p->need ? h->first : p->need;
            if (first < h->end) {
                TRY(copy_rows(p, h, first, h->end, true));
            }
            if (h->first <= p->need) {
                break;
            }
        }
    }
    t->n_past = c->n_past;
    t->pending_verify = 0;
    t->pending_tree = false;
    t->commit.active = false;
    t->n_out = 0;
    t->n_rows = 0; /* the features of the last call belong to another context */
    if (d) {
        dfl_draft_set_n_tokens(d, c->n_past);
    }
    return DFL_OK;
}

DFL_API int32_t dfl_checkpoint_n_past(const dfl_checkpoint * c) { return c ? c->n_past : 0; }

DFL_API uint64_t dfl_checkpoint_device_bytes(const dfl_checkpoint * c) { return c ? (uint64_t) c->device_bytes : 0; }

DFL_API uint64_t dfl_checkpoint_host_bytes(const dfl_checkpoint * c) { return c ? (uint64_t) c->host_bytes : 0; }

DFL_API int32_t dfl_checkpoint_parent_n_past(const dfl_checkpoint * c) {
    return c && c->parent ? c->parent->n_past : 0;
}

DFL_API void dfl_checkpoint_free(dfl_checkpoint * c) {
    if (c && !c->released) {
        c->released = 1;
        release(c);
    }
}
