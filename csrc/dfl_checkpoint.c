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
 * rows of the whole chain. A parent stays alive while a child needs it.
 *
 * A checkpoint is of one sequence slot and restores into any slot of the same target
 * (and drafter): the parts of a slot's state are listed by the memory layer in the same
 * order for every slot.
 *
 * Host memory: a checkpoint's record (its parts and their tensor metadata) and its copies
 * in plain host memory live in anonymous mappings of its own, not in the C heap, and go
 * back to the system whole when it is freed. A server's store turns over thousands of
 * checkpoints of every size; carved from the heap, their records (and buffers below
 * malloc's mapping threshold) pinned it between the short-lived allocations of requests
 * and the heap grew with the store's turnover (the soak's creep). What a mapping holds
 * is whole pages, so the bytes a checkpoint reports are what is resident for it. */
#include "dfl_draft_state.h"
#include "dfl_target_state.h"

#include <ggml-alloc.h>
#include <ggml-backend.h>

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_BUFFERS 4
/* what ggml keeps in the C heap per context or buffer besides the memory it is given:
 * its small record (counted with a margin) */
#define GGML_RECORD_BYTES 128

/* One piece of a checkpoint: a copy of a part of a slot's state (dfl_memory_part): of
 * a per-position cache, positions [first, end) in position order; of a fixed-size state,
 * all of it. */
typedef struct held {
    int ring;               /* 0: a fixed-size state */
    int need;               /* the first position the checkpoint's position needs */
    int first, end;         /* the positions this checkpoint holds itself */
    size_t bytes;           /* a fixed-size state's */
    size_t row_bytes;       /* a per-position cache's rows' */
    struct ggml_tensor * copy;
    int buffer;             /* which of the checkpoint's buffers holds the copy */
} held;

struct dfl_checkpoint {
    const dfl_target * target; /* the pair it was taken from, and the only one it restores into */
    const dfl_draft * draft;   /* NULL: the target alone */
    dfl_checkpoint * parent;   /* holds the rows before this one's own, NULL: none needed */
    int refs;                  /* the caller's handle and every child */
    int released;              /* the caller freed its handle (children keep the state alive) */
    int32_t n_past;
    int n_parts;
    /* The record lives at the start of a mapping (record_size bytes) that holds its parts
     * and the memory of its contexts too. */
    size_t record_size;
    held * parts;
    char * ctx_mem;
    /* the copies' tensors, one context per buffer type they were meant for */
    int n_ctxs;
    struct ggml_context * ctxs[MAX_BUFFERS];
    /* a buffer per buffer type, but one for all the copies in plain host memory, which
     * wraps a mapping of its own (host_map: NULL when none) */
    int n_buffers;
    ggml_backend_buffer_t buffers[MAX_BUFFERS];
    void * host_map;
    size_t host_map_size;
    size_t device_bytes, host_bytes;
    size_t overhead_bytes;     /* host memory held besides the copies (see count_overhead) */
};

static size_t page_size(void) {
    const long page = sysconf(_SC_PAGESIZE);
    return page > 0 ? (size_t) page : 4096;
}

static size_t whole_pages(size_t bytes) {
    const size_t page = page_size();
    return (bytes + page - 1) / page * page;
}

/* Zeroed anonymous memory of its own, `size` a multiple of the page size; NULL when there
 * is none. */
static void * map_pages(size_t size) {
    void * p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Every part of slot seq's state at position n_past, the target's memory's then the
 * drafter's (its caches within its window, what it carries), in a fixed order (the same
 * for every slot): a child's parts match its parent's index by index. Returns the count;
 * parts may be NULL to count only. */
static int list_parts(const dfl_target * t, const dfl_draft * d, int seq, int n_past, dfl_memory_part * parts) {
    int n = dfl_memory_seq_parts(&t->mem, seq, n_past, parts);
    if (d) {
        n += dfl_memory_seq_parts(&d->mem, seq, n_past, parts ? parts + n : NULL);
    }
    return n;
}

static size_t held_bytes(const held * h) {
    return h->ring ? h->row_bytes * (size_t) (h->end - h->first) : h->bytes;
}

static dfl_status new_parts(const dfl_target * t, const dfl_draft * d, int seq, int n_past, dfl_memory_part ** out,
                            int * n_out) {
    const int n = list_parts(t, d, seq, n_past, NULL);
    *out = calloc((size_t) (n > 0 ? n : 1), sizeof **out);
    if (!*out) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    list_parts(t, d, seq, n_past, *out);
    *n_out = n;
    return DFL_OK;
}

/* What a checkpoint of these parts at n_past holds itself (into parts[n]): with a
 * parent, the rows of per-position caches from the parent's position on. Sets
 * *needs_parent when some part needs rows only the parent's chain holds. */
static void own_parts(const dfl_memory_part * live, int n, int n_past, const dfl_checkpoint * parent, held * parts,
                      int * needs_parent) {
    *needs_parent = 0;
    for (int i = 0; i < n; i++) {
        const dfl_memory_part * p = &live[i];
        parts[i] = (held) { p->ring, p->need, p->need, n_past, p->bytes, p->tensor->nb[1], NULL, 0 };
        if (parent && p->ring && parts[i].first < parent->n_past) {
            parts[i].first = parent->n_past;
            *needs_parent = 1;
        }
    }
}

static dfl_status check_parent(const dfl_target * t, const dfl_draft * d, int seq, const dfl_checkpoint * parent) {
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
    if (parent->n_past >= t->mem.seq[seq].n_past) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the parent checkpoint is at position %d, not before the context's %d",
                        parent->n_past, t->mem.seq[seq].n_past);
    }
    return DFL_OK;
}

static dfl_status check_target_seq(const dfl_target * t, int seq) {
    if (seq < 0 || seq >= t->mem.n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d is outside 0..%d", seq, t->mem.n_seq - 1);
    }
    return DFL_OK;
}

static bool on_host(const dfl_memory_part * p) { return ggml_backend_buffer_is_host(p->tensor->buffer); }

DFL_API dfl_status dfl_checkpoint_measure(const dfl_target * t, const dfl_draft * d, int32_t seq,
                                          const dfl_checkpoint * parent, uint64_t * device_bytes, uint64_t * host_bytes) {
    if (!t || !device_bytes || !host_bytes) {
        return dfl_fail(DFL_ERR_ARGUMENT, "measuring a checkpoint needs a target and two results");
    }
    TRY(check_target_seq(t, seq));
    TRY(check_parent(t, d, seq, parent));
    const int n_past = t->mem.seq[seq].n_past;
    dfl_memory_part * live;
    int n, needs_parent;
    TRY(new_parts(t, d, seq, n_past, &live, &n));
    held * parts = calloc((size_t) (n > 0 ? n : 1), sizeof *parts);
    if (!parts) {
        free(live);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    own_parts(live, n, n_past, parent, parts, &needs_parent);
    *device_bytes = *host_bytes = 0;
    for (int i = 0; i < n; i++) {
        *(on_host(&live[i]) ? host_bytes : device_bytes) += held_bytes(&parts[i]);
    }
    free(parts);
    free(live);
    return DFL_OK;
}

/* Host memory a checkpoint keeps besides its copies' bytes: its record's mapping (the
 * record, its parts, the tensor metadata), its host mapping's padding to whole pages, the
 * padding of host buffers of other types (e.g. a device's pinned memory) to whole pages,
 * and ggml's small heap records of its context and buffers. The store's budget and the
 * server's reports count it: with the copies, it is what is resident for the checkpoint. */
static void count_overhead(dfl_checkpoint * c, const size_t * held_in) {
    c->overhead_bytes = c->record_size + GGML_RECORD_BYTES * (size_t) (c->n_ctxs + c->n_buffers);
    for (int k = 0; k < c->n_buffers; k++) {
        if (ggml_backend_buffer_is_host(c->buffers[k])) {
            c->overhead_bytes += whole_pages(ggml_backend_buffer_get_size(c->buffers[k])) - held_in[k];
        }
    }
}

/* A buffer for the copies of plain host memory (the tensors of ctxs[k] for k in
 * to_host): a mapping of the checkpoint's own, which the CPU device wraps as a buffer that
 * does not own it (release unmaps it). */
static dfl_status alloc_host_map(dfl_checkpoint * c, ggml_backend_dev_t cpu, ggml_backend_buffer_type_t host,
                                 const bool * to_host, ggml_backend_buffer_t * out) {
    const size_t align = ggml_backend_buft_get_alignment(host);
    size_t size = 0, max_tensor = 0;
    for (int k = 0; k < c->n_ctxs; k++) {
        for (struct ggml_tensor * t = to_host[k] ? ggml_get_first_tensor(c->ctxs[k]) : NULL; t;
             t = ggml_get_next_tensor(c->ctxs[k], t)) {
            const size_t bytes = ggml_backend_buft_get_alloc_size(host, t);
            size += GGML_PAD(bytes, align);
            max_tensor = bytes > max_tensor ? bytes : max_tensor;
        }
    }
    c->host_map_size = whole_pages(size);
    c->host_map = map_pages(c->host_map_size);
    if (!c->host_map) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory for a checkpoint at position %d", c->n_past);
    }
    *out = ggml_backend_dev_buffer_from_host_ptr(cpu, c->host_map, c->host_map_size, max_tensor);
    if (!*out) {
        return dfl_fail(DFL_ERR_BACKEND, "the CPU device cannot wrap host memory as a buffer");
    }
    struct ggml_tallocr alloc = ggml_tallocr_new(*out);
    for (int k = 0; k < c->n_ctxs; k++) {
        for (struct ggml_tensor * t = to_host[k] ? ggml_get_first_tensor(c->ctxs[k]) : NULL; t;
             t = ggml_get_next_tensor(c->ctxs[k], t)) {
            if (ggml_tallocr_alloc(&alloc, t) != GGML_STATUS_SUCCESS) {
                return dfl_fail(DFL_ERR_BACKEND, "cannot place a checkpoint's copy in host memory");
            }
        }
    }
    return DFL_OK;
}

/* Part i's copy in ctx. */
static void new_copy(held * p, const struct ggml_tensor * live, struct ggml_context * ctx) {
    p->copy = p->ring ? ggml_new_tensor_2d(ctx, live->type, live->ne[0], p->end - p->first)
                      : ggml_new_tensor_1d(ctx, live->type, (int64_t) (p->bytes / ggml_type_size(live->type)));
}

/* Give every part's copy memory: state on a device in a buffer of the same type when
 * on_device (host memory when that allocation fails), everything else in host memory.
 * One context of tensors per buffer type, its memory carved from the record's mapping;
 * a buffer per type, but one mapping for all that goes to plain host memory. */
static dfl_status alloc_copies(dfl_checkpoint * c, const dfl_memory_part * live, bool on_device) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        return dfl_fail(DFL_ERR_BACKEND, "no CPU device for the host copies of a checkpoint");
    }
    ggml_backend_buffer_type_t host = ggml_backend_dev_buffer_type(cpu);
    ggml_backend_buffer_type_t types[MAX_BUFFERS];
    int counts[MAX_BUFFERS] = { 0 };
    for (int i = 0; i < c->n_parts; i++) {
        held * p = &c->parts[i];
        if (held_bytes(p) == 0) {
            continue;
        }
        const struct ggml_tensor * t = live[i].tensor;
        ggml_backend_buffer_type_t type = on_device || on_host(&live[i]) ? ggml_backend_buffer_get_type(t->buffer) : host;
        int k = 0;
        while (k < c->n_ctxs && types[k] != type) {
            k++;
        }
        if (k == c->n_ctxs) {
            if (k == MAX_BUFFERS) {
                return dfl_fail(DFL_ERR_BACKEND, "the state lives in more than %d kinds of buffers", MAX_BUFFERS);
            }
            types[c->n_ctxs++] = type;
        }
        p->buffer = k; /* its context for now; its buffer below */
        counts[k]++;
    }
    char * mem = c->ctx_mem;
    for (int k = 0; k < c->n_ctxs; k++) {
        struct ggml_init_params ip = { GGML_PAD((size_t) counts[k] * ggml_tensor_overhead(), GGML_MEM_ALIGN), mem, true };
        c->ctxs[k] = ggml_init(ip);
        if (!c->ctxs[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        mem += ip.mem_size;
    }
    for (int i = 0; i < c->n_parts; i++) {
        if (held_bytes(&c->parts[i]) > 0) {
            new_copy(&c->parts[i], live[i].tensor, c->ctxs[c->parts[i].buffer]);
        }
    }
    /* buffers of other types first: a device without room sends its copies to host memory */
    bool to_host[MAX_BUFFERS] = { false };
    bool any_to_host = false;
    int buffer_of[MAX_BUFFERS];
    for (int k = 0; k < c->n_ctxs; k++) {
        ggml_backend_buffer_t buffer = types[k] == host ? NULL : ggml_backend_alloc_ctx_tensors_from_buft(c->ctxs[k], types[k]);
        if (buffer) {
            buffer_of[k] = c->n_buffers;
            c->buffers[c->n_buffers++] = buffer;
            continue;
        }
        if (types[k] != host) {
            /* the failed allocation may have placed some of them: the context's copies anew */
            ggml_reset(c->ctxs[k]);
            for (int i = 0; i < c->n_parts; i++) {
                if (c->parts[i].copy && c->parts[i].buffer == k) {
                    new_copy(&c->parts[i], live[i].tensor, c->ctxs[k]);
                }
            }
        }
        to_host[k] = any_to_host = true;
    }
    if (any_to_host) {
        ggml_backend_buffer_t * buffer = &c->buffers[c->n_buffers];
        TRY(alloc_host_map(c, cpu, host, to_host, buffer));
        for (int k = 0; k < c->n_ctxs; k++) {
            buffer_of[k] = to_host[k] ? c->n_buffers : buffer_of[k];
        }
        c->n_buffers++;
    }
    size_t held_in[MAX_BUFFERS] = { 0 };
    for (int i = 0; i < c->n_parts; i++) {
        held * p = &c->parts[i];
        if (p->copy) {
            p->buffer = buffer_of[p->buffer];
            const bool host_buffer = ggml_backend_buffer_is_host(c->buffers[p->buffer]);
            *(host_buffer ? &c->host_bytes : &c->device_bytes) += held_bytes(p);
            held_in[p->buffer] += held_bytes(p);
        }
    }
    count_overhead(c, held_in);
    return DFL_OK;
}

/* A new checkpoint's record, its n_parts parts and the memory of as many tensors'
 * metadata, in a mapping of its own; NULL when there is no memory. */
static dfl_checkpoint * new_record(int n_parts) {
    const size_t parts_at = GGML_PAD(sizeof(dfl_checkpoint), 64);
    const size_t ctx_at = GGML_PAD(parts_at + (size_t) n_parts * sizeof(held), 64);
    const size_t size = whole_pages(ctx_at + (size_t) n_parts * ggml_tensor_overhead() + MAX_BUFFERS * GGML_MEM_ALIGN);
    char * map = map_pages(size);
    if (!map) {
        return NULL;
    }
    dfl_checkpoint * c = (dfl_checkpoint *) map;
    c->record_size = size;
    c->n_parts = n_parts;
    c->parts = (held *) (map + parts_at);
    c->ctx_mem = map + ctx_at;
    return c;
}

static void release(dfl_checkpoint * c) {
    if (!c || --c->refs > 0) {
        return;
    }
    release(c->parent);
    for (int k = 0; k < c->n_buffers; k++) {
        ggml_backend_buffer_free(c->buffers[k]);
    }
    if (c->host_map) {
        munmap(c->host_map, c->host_map_size);
    }
    for (int k = 0; k < c->n_ctxs; k++) {
        ggml_free(c->ctxs[k]);
    }
    munmap(c, c->record_size);
}

static dfl_status save_parts(dfl_checkpoint * c, const dfl_memory_part * live, bool on_device) {
    TRY(alloc_copies(c, live, on_device));
    for (int i = 0; i < c->n_parts; i++) {
        const held * p = &c->parts[i];
        if (p->copy) {
            TRY(p->ring ? dfl_memory_copy_rows(&live[i], p->copy, 0, p->first, p->end, false)
                        : dfl_memory_copy_slice(&live[i], p->copy, false));
        }
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_checkpoint_save(dfl_target * t, dfl_draft * d, int32_t seq, dfl_checkpoint * parent,
                                       int32_t on_device, dfl_checkpoint ** out) {
    if (!t || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a checkpoint needs a target");
    }
    *out = NULL;
    TRY(check_target_seq(t, seq));
    if (d && d->target != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
    }
    const dfl_seq * q = &t->mem.seq[seq];
    /* between a verify and the graph that carries its commit, the recurrent state is
     * not yet the committed position's */
    if (!dfl_target_seq_settled(t, seq)) {
        return dfl_fail(DFL_ERR_STATE, "the target is between a verify and its commit: checkpoints are taken "
                        "after a decode (a prefill)");
    }
    if (q->n_past == 0) {
        return dfl_fail(DFL_ERR_STATE, "the context is empty: nothing to checkpoint");
    }
    if (d && d->mem.seq[seq].n_past != q->n_past) {
        return dfl_fail(DFL_ERR_STATE, "the drafter holds %d context positions, the target %d: append the target's "
                        "features before taking a checkpoint", d->mem.seq[seq].n_past, q->n_past);
    }
    TRY(check_parent(t, d, seq, parent));
    dfl_memory_part * live = NULL;
    int n_parts, needs_parent = 0;
    TRY(new_parts(t, d, seq, q->n_past, &live, &n_parts));
    dfl_checkpoint * c = new_record(n_parts);
    if (!c) {
        free(live);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    c->target = t;
    c->draft = d;
    c->refs = 1;
    c->n_past = q->n_past;
    own_parts(live, n_parts, c->n_past, parent, c->parts, &needs_parent);
    const dfl_status st = save_parts(c, live, on_device != 0);
    free(live);
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

/* The rows of part i at positions from its `need` on, from the chain of holders. */
static dfl_status restore_rows(const dfl_checkpoint * c, int i, const dfl_memory_part * live) {
    const held * p = &c->parts[i];
    /* oldest rows last would be wrong in a ring only if two positions shared a row,
     * which the positions one checkpoint needs never do */
    for (const dfl_checkpoint * holder = c; holder; holder = holder->parent) {
        const held * h = &holder->parts[i];
        const int first = h->first > p->need ? h->first : p->need;
        if (first < h->end) {
            TRY(dfl_memory_copy_rows(live, h->copy, first - h->first, first, h->end, true));
        }
        if (h->first <= p->need) {
            break;
        }
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_checkpoint_restore(const dfl_checkpoint * c, dfl_target * t, dfl_draft * d, int32_t seq) {
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
    TRY(check_target_seq(t, seq));
    /* a target-only restore of a checkpoint with drafter context restores the target's
     * parts, which come first */
    dfl_memory_part * live;
    int n_parts;
    TRY(new_parts(t, d, seq, c->n_past, &live, &n_parts));
    dfl_status st = DFL_OK;
    for (int i = 0; i < n_parts && st == DFL_OK; i++) {
        if (c->parts[i].ring) {
            st = restore_rows(c, i, &live[i]);
        } else if (c->parts[i].copy) {
            st = dfl_memory_copy_slice(&live[i], c->parts[i].copy, true);
        }
    }
    free(live);
    TRY(st);
    /* the slot's own state only: other slots, and what their feature rows hold, go on */
    dfl_target_seq_restored(t, seq, c->n_past);
    if (d) {
        dfl_memory_seq_restored(&d->mem, seq, c->n_past);
        d->blocks.n[seq] = 0;
    }
    return DFL_OK;
}

DFL_API int32_t dfl_checkpoint_n_past(const dfl_checkpoint * c) { return c ? c->n_past : 0; }

DFL_API uint64_t dfl_checkpoint_device_bytes(const dfl_checkpoint * c) { return c ? (uint64_t) c->device_bytes : 0; }

DFL_API uint64_t dfl_checkpoint_host_bytes(const dfl_checkpoint * c) { return c ? (uint64_t) c->host_bytes : 0; }

DFL_API uint64_t dfl_checkpoint_overhead_bytes(const dfl_checkpoint * c) {
    return c ? (uint64_t) c->overhead_bytes : 0;
}

DFL_API int32_t dfl_checkpoint_parent_n_past(const dfl_checkpoint * c) {
    return c && c->parent ? c->parent->n_past : 0;
}

DFL_API void dfl_checkpoint_free(dfl_checkpoint * c) {
    if (c && !c->released) {
        c->released = 1;
        release(c);
    }
}
