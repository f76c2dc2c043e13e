/* Loading a GGUF's weights onto devices: which buffer type each matrix takes (repacked
 * layouts, a device's own memory, host memory a device maps), filling the buffers from the
 * mapped file, slicing a matrix too large for one binding, and rows read on demand.
 * Opening the file and reading its metadata: dfl_gguf.c. */
#include "dfl_gguf.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
/* Types a weight matrix may have: float, or a quantization whose rows ggml dequantizes
 * and dot-multiplies on every backend (not the activation-only types q8_1 and q8_k). */
static bool matrix_type(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ1_S:
        case GGML_TYPE_IQ4_NL: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ4_XS:
        case GGML_TYPE_IQ1_M: case GGML_TYPE_TQ1_0: case GGML_TYPE_TQ2_0: case GGML_TYPE_MXFP4:
            return true;
        default:
            return false;
    }
}

dfl_status dfl_gguf_tensor(const dfl_gguf * g, const char * name, int n_dims, const int64_t * ne, bool required,
                           struct ggml_tensor ** out) {
    struct ggml_tensor * t = ggml_get_tensor(g->ctx, name);
    *out = NULL;
    if (!t) {
        if (required) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s' lacks tensor '%s'", g->path, name);
        }
        return DFL_OK;
    }
    if (n_dims == 1 && t->type != GGML_TYPE_F32) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tensor '%s' has type %s; vectors must be f32", g->path, name,
                        ggml_type_name(t->type));
    }
    if (n_dims > 1 && !matrix_type(t->type)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tensor '%s' has type %s, which is not a weight type ggml multiplies",
                        g->path, name, ggml_type_name(t->type));
    }
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        const int64_t want = i < n_dims ? ne[i] : 1;
        if (want != 0 && t->ne[i] != want) {
            return dfl_fail(DFL_ERR_FORMAT,
                            "'%s': tensor '%s' has shape [%lld, %lld, %lld, %lld], expected dimension %d = %lld",
                            g->path, name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                            (long long) t->ne[3], i, (long long) want);
        }
    }
    const int64_t id = gguf_find_tensor(g->meta, name);
    if (id >= 0) {
        g->used[id] = true;
    }
    *out = t;
    return DFL_OK;
}

dfl_status dfl_gguf_index_vector(const dfl_gguf * g, const char * name, int64_t n, bool required,
                                 struct ggml_tensor ** out, int64_t * values) {
    *out = NULL;
    struct ggml_tensor * t = ggml_get_tensor(g->ctx, name);
    const int64_t id = gguf_find_tensor(g->meta, name);
    if (!t || id < 0) {
        return required ? dfl_fail(DFL_ERR_FORMAT, "'%s' lacks tensor '%s'", g->path, name) : DFL_OK;
    }
    if (t->type != GGML_TYPE_I64 || ggml_n_dims(t) != 1 || t->ne[0] != n) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tensor '%s' is %s [%lld], expected i64 [%lld]", g->path, name,
                        ggml_type_name(t->type), (long long) t->ne[0], (long long) n);
    }
    /* its bytes lie within the file (checked when it was opened) */
    FILE * f = fopen(g->path, "rb");
    const long at = (long) (gguf_get_data_offset(g->meta) + gguf_get_tensor_offset(g->meta, id));
    const bool read = f && fseek(f, at, SEEK_SET) == 0 && fread(values, sizeof(int64_t), (size_t) n, f) == (size_t) n;
    if (f) {
        fclose(f);
    }
    if (!read) {
        return dfl_fail(DFL_ERR_IO, "cannot read tensor '%s' of '%s'", name, g->path);
    }
    g->used[id] = true;
    *out = t;
    return DFL_OK;
}

#define DFL_MAX_BUFTS 4

/* The first extra buffer type of dev that runs a matrix product with weight w. */
ggml_backend_buffer_type_t dfl_gguf_repack_buft(ggml_backend_dev_t dev, struct ggml_tensor * w) {
    const int n_dims = ggml_n_dims(w);
    if ((n_dims != 2 && n_dims != 3) || strcmp(w->name, "token_embd.weight") == 0) {
        return NULL; /* the embedding is read with get_rows, which repacked layouts do not serve */
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get_extra =
        reg ? (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")
            : NULL;
    if (!get_extra) {
        return NULL;
    }
    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    /* a matrix is asked about a product, a stack of experts (3D) about a routed product */
    struct ggml_tensor * op;
    if (n_dims == 2) {
        op = ggml_mul_mat(ctx, w, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 512));
    } else {
        struct ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], 1, 512);
        op = ggml_mul_mat_id(ctx, w, x, ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, 512));
    }
    ggml_backend_buffer_type_t found = NULL;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b && !found; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "AMX") == 0) {
            /* AMX's kernels are not batch-invariant (their tiles round a verify's rows
             * otherwise than one-row decoding): its weights take the repacked or plain path */
            continue;
        }
        /* supports_op looks at the weight's buffer type: give it an empty buffer of that type */
        w->buffer = ggml_backend_buft_alloc_buffer(*b, 0);
        if (w->buffer && ggml_backend_dev_supports_op(dev, op)) {
            found = *b;
        }
        if (w->buffer) {
            ggml_backend_buffer_free(w->buffer);
        }
        w->buffer = NULL;
    }
    ggml_free(ctx);
    return found;
}

/* The largest buffer of buft to put weights in: the device's limit, or less when
 * DFLASH_WEIGHT_BUFFER_MIB asks for it (to exercise device limits on any machine). */
static size_t max_weight_buffer(ggml_backend_buffer_type_t buft) {
    size_t max = ggml_backend_buft_get_max_size(buft);
    const char * env = getenv("DFLASH_WEIGHT_BUFFER_MIB");
    if (env && atol(env) > 0 && (size_t) atol(env) << 20 < max) {
        max = (size_t) atol(env) << 20;
    }
    return max;
}

/* The mapped pages of a tensor whose data was copied out are never read again: unmap
 * them from this process (whole pages inside [src, src + n) only; the mapping stays
 * valid and would fault them back from the page cache). Without this every copied
 * weight counts twice in the resident set, once as the copy and once as file pages. */
static void drop_mapped_pages(const char * src, size_t n) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t) src + page - 1) & ~(page - 1);
    const uintptr_t hi = ((uintptr_t) src + n) & ~(page - 1);
    if (hi > lo) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
}

/* One buffer of buft for `size` bytes holding tensors [i0, i1) of those marked with
 * it, their data copied in (a repacking buffer type converts the layout as the data
 * arrives). */
static dfl_status fill_buffer(dfl_gguf * g, ggml_backend_buffer_type_t buft, ggml_backend_buffer_type_t * marks,
                              const char * base, int64_t i0, int64_t i1, size_t size) {
    if (g->n_buffers == DFL_MAX_WEIGHT_BUFFERS) {
        return dfl_fail(DFL_ERR_BACKEND, "'%s' needs more than %d weight buffers on %s", g->path,
                        DFL_MAX_WEIGHT_BUFFERS, ggml_backend_buft_name(buft));
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, size);
    if (!buf) {
        return dfl_fail(DFL_ERR_BACKEND, "out of %s memory for %zu bytes of weights of '%s'",
                        ggml_backend_buft_name(buft), size, g->path);
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    g->buffers[g->n_buffers++] = buf;
    const size_t align = ggml_backend_buft_get_alignment(buft);
    char * p = ggml_backend_buffer_get_base(buf);
    for (int64_t i = i0; i < i1; i++) {
        if (!g->used[i] || marks[i] != buft) {
            continue;
        }
        struct ggml_tensor * t = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
        if (ggml_backend_tensor_alloc(buf, t, p) != GGML_STATUS_SUCCESS) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot place tensor '%s' of '%s'", t->name, g->path);
        }
        ggml_backend_tensor_set(t, base + gguf_get_tensor_offset(g->meta, i), 0, ggml_nbytes(t));
        drop_mapped_pages(base + gguf_get_tensor_offset(g->meta, i), ggml_nbytes(t));
        p += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align);
    }
    return DFL_OK;
}

/* Every tensor marked with buft, in file order, in as few buffers as the device's
 * largest allocation allows. */
static dfl_status place_in_buft(dfl_gguf * g, ggml_backend_buffer_type_t buft, ggml_backend_buffer_type_t * marks,
                                const char * base) {
    const size_t align = ggml_backend_buft_get_alignment(buft), max = max_weight_buffer(buft);
    const int64_t n = gguf_get_n_tensors(g->meta);
    int64_t first = 0;
    size_t size = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!g->used[i] || marks[i] != buft) {
            continue;
        }
        struct ggml_tensor * t = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
        const size_t need = GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align);
        if (need > max) {
            return dfl_fail(DFL_ERR_BACKEND, "tensor '%s' of '%s' (%zu bytes) exceeds the largest buffer %s allows (%zu)",
                            t->name, g->path, need, ggml_backend_buft_name(buft), max);
        }
        if (size + need > max) {
            dfl_status st = fill_buffer(g, buft, marks, base, first, i, size);
            if (st != DFL_OK) {
                return st;
            }
            first = i;
            size = 0;
        }
        size += need;
    }
    return size > 0 ? fill_buffer(g, buft, marks, base, first, n, size) : DFL_OK;
}

static void add_unique(void ** set, int * n, void * x) {
    for (int k = 0; k < *n; k++) {
        if (set[k] == x) {
            return;
        }
    }
    if (*n < DFL_MAX_BUFTS) {
        set[(*n)++] = x;
    }
}

static bool maps_host_memory(ggml_backend_dev_t dev) {
    struct ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    return props.caps.buffer_from_host_ptr;
}

/* Wrap the mapping for dev and point the tensors of dev with no buffer type of their
 * own (marks[i] == NULL) into it. */
static dfl_status place_mapped(dfl_gguf * g, ggml_backend_dev_t dev, ggml_backend_dev_t const * dev_of,
                               ggml_backend_buffer_type_t const * marks, char * base, size_t data_size) {
    size_t max_tensor = 0;
    for (struct ggml_tensor * t = ggml_get_first_tensor(g->ctx); t; t = ggml_get_next_tensor(g->ctx, t)) {
        max_tensor = ggml_nbytes(t) > max_tensor ? ggml_nbytes(t) : max_tensor;
    }
    ggml_backend_buffer_t buf = ggml_backend_dev_buffer_from_host_ptr(dev, base, data_size, max_tensor);
    if (!buf) {
        return dfl_fail(DFL_ERR_BACKEND, "device %s cannot use the mapped weights of '%s'",
                        ggml_backend_dev_name(dev), g->path);
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    g->buffers[g->n_buffers++] = buf;
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta); i++) {
        if (!g->used[i] || marks[i] || dev_of[i] != dev) {
            continue;
        }
        struct ggml_tensor * t = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
        if (ggml_backend_tensor_alloc(buf, t, base + gguf_get_tensor_offset(g->meta, i)) != GGML_STATUS_SUCCESS) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot place tensor '%s' of '%s'", t->name, g->path);
        }
    }
    return DFL_OK;
}

/* GPU APIs bind a limited span of a buffer to one shader (Vulkan's maxStorageBufferRange:
 * 128 MiB on Mesa's lavapipe), and ggml's scheduler aborts on a weight its device will
 * not take as an operand — a large vocabulary's LM head (248320 rows on Qwen3.5) exceeds
 * it. Such a matrix gets row slices: tensors of whole 256-row blocks (aligned offsets on
 * any device) over the same memory, which graphs use instead (dfl_gguf_mul_mat). */
#define SLICE_ROWS 256

static dfl_status slice_for_device(dfl_gguf * g, struct ggml_tensor * t) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    if (!dev || ggml_backend_dev_supports_op(dev, t)) {
        return DFL_OK;
    }
    if (ggml_n_dims(t) == 2 && g->n_sliced < DFL_MAX_SLICED) {
        const int64_t n_rows = t->ne[1];
        for (int n = 2; n <= DFL_MAX_SLICES; n++) {
            const int64_t per = ((n_rows + n - 1) / n + SLICE_ROWS - 1) / SLICE_ROWS * SLICE_ROWS;
            struct ggml_tensor probe = *t; /* a slice's shape: supports_op reads shape and type */
            probe.ne[1] = per;
            probe.nb[2] = probe.nb[3] = (size_t) per * t->nb[1];
            if (!ggml_backend_dev_supports_op(dev, &probe)) {
                continue;
            }
            if (!g->ctx_slices) {
                struct ggml_init_params ip = { DFL_MAX_SLICED * DFL_MAX_SLICES * ggml_tensor_overhead(), NULL, true };
                g->ctx_slices = ggml_init(ip);
                if (!g->ctx_slices) {
                    return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
                }
            }
            dfl_sliced * sl = &g->sliced[g->n_sliced++];
            sl->whole = t;
            sl->n = 0;
            for (int64_t r0 = 0; r0 < n_rows; r0 += per) {
                const int64_t rows = n_rows - r0 < per ? n_rows - r0 : per;
                struct ggml_tensor * part = ggml_new_tensor_2d(g->ctx_slices, t->type, t->ne[0], rows);
                ggml_format_name(part, "%.50s#%d", t->name, sl->n);
                if (!t->data) {
                    part->buffer = t->buffer; /* a memory plan's placeholder: measured, never computed */
                } else if (ggml_backend_tensor_alloc(t->buffer, part, (char *) t->data + (size_t) r0 * t->nb[1]) !=
                           GGML_STATUS_SUCCESS) {
                    return dfl_fail(DFL_ERR_BACKEND, "cannot slice tensor '%s' of '%s'", t->name, g->path);
                }
                sl->part[sl->n++] = part;
            }
            return DFL_OK;
        }
    }
    return dfl_fail(DFL_ERR_BACKEND, "tensor '%s' of '%s' (%zu bytes) is larger than device %s takes in one operation; "
                    "keep its layer on the CPU (-ngl)", t->name, g->path, ggml_nbytes(t), ggml_backend_dev_name(dev));
}

dfl_status dfl_gguf_slice_weights(dfl_gguf * g) {
    dfl_status st = DFL_OK;
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta) && st == DFL_OK; i++) {
        if (g->used[i]) {
            st = slice_for_device(g, ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i)));
        }
    }
    return st;
}

struct ggml_tensor * dfl_gguf_mul_mat(const dfl_gguf * g, struct ggml_context * ctx, struct ggml_tensor * w,
                                      struct ggml_tensor * x) {
    for (int i = 0; i < g->n_sliced; i++) {
        const dfl_sliced * sl = &g->sliced[i];
        if (sl->whole == w) {
            struct ggml_tensor * out = ggml_mul_mat(ctx, sl->part[0], x);
            for (int k = 1; k < sl->n; k++) {
                out = ggml_concat(ctx, out, ggml_mul_mat(ctx, sl->part[k], x), 0);
            }
            return out;
        }
    }
    return ggml_mul_mat(ctx, w, x);
}

dfl_status dfl_gguf_load_weights(dfl_gguf * g, ggml_backend_dev_t const * dev_of, bool repack) {
    const int fd = open(g->path, O_RDONLY);
    if (fd < 0) {
        return dfl_fail(DFL_ERR_IO, "cannot open '%s' for reading", g->path);
    }
    g->map = mmap(NULL, g->file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (g->map == MAP_FAILED) {
        g->map = NULL;
        return dfl_fail(DFL_ERR_IO, "cannot map '%s' into memory", g->path);
    }
    char * base = (char *) g->map + gguf_get_data_offset(g->meta);
    const size_t data_size = g->file_size - gguf_get_data_offset(g->meta);
    const int64_t n_tensors = gguf_get_n_tensors(g->meta);

    /* Each tensor gets a buffer type, or NULL to stay in the mapping: devices that can
     * read host memory keep their tensors mapped, except matrices they run faster from
     * a repacked layout (the CPU backend's extra buffer types); other devices get a
     * copy in their own memory. */
    ggml_backend_buffer_type_t * marks = calloc((size_t) n_tensors + 1, sizeof *marks);
    void * bufts[DFL_MAX_BUFTS];  /* distinct buffer types in marks */
    void * mapped[DFL_MAX_BUFTS]; /* distinct devices keeping tensors mapped */
    int n_bufts = 0, n_mapped = 0;
    if (!marks) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int64_t i = 0; i < n_tensors; i++) {
        if (!g->used[i]) {
            continue; /* not part of the model (e.g. MTP layers): never placed */
        }
        struct ggml_tensor * t = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
        ggml_backend_buffer_type_t buft = NULL;
        if (!maps_host_memory(dev_of[i])) {
            buft = ggml_backend_dev_buffer_type(dev_of[i]);
        } else if (repack) {
            buft = dfl_gguf_repack_buft(dev_of[i], t);
        }
        marks[i] = buft;
        if (buft) {
            add_unique(bufts, &n_bufts, buft);
        } else {
            add_unique(mapped, &n_mapped, dev_of[i]);
        }
    }
    dfl_status st = DFL_OK;
    for (int k = 0; k < n_mapped && st == DFL_OK; k++) {
        st = place_mapped(g, (ggml_backend_dev_t) mapped[k], dev_of, marks, base, data_size);
    }
    for (int k = 0; k < n_bufts && st == DFL_OK; k++) {
        st = place_in_buft(g, (ggml_backend_buffer_type_t) bufts[k], marks, base);
    }
    free(marks);
    if (st == DFL_OK) {
        st = dfl_gguf_slice_weights(g);
    }
    if (st == DFL_OK && n_mapped == 0) {
        /* every device holds its own copy now */
        munmap(g->map, g->file_size);
        g->map = NULL;
    }
    return st;
}

/* Rows are read from the file rather than from w: a repacked layout cannot be read back
 * (the CPU backend's repack buffers have no get_tensor), and the mapping may be gone. */
static dfl_status read_rows(const dfl_gguf * g, const struct ggml_tensor * w, const int32_t * rows, int n, char * dst) {
    const int64_t id = gguf_find_tensor(g->meta, w->name);
    if (id < 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "tensor '%s' is not in '%s'", w->name, g->path);
    }
    const off_t base = (off_t) (gguf_get_data_offset(g->meta) + gguf_get_tensor_offset(g->meta, id));
    const size_t row = w->nb[1];
    const int fd = open(g->path, O_RDONLY);
    if (fd < 0) {
        return dfl_fail(DFL_ERR_IO, "cannot open '%s' for reading", g->path);
    }
    dfl_status st = DFL_OK;
    for (int i = 0, run; i < n && st == DFL_OK; i += run) {
        for (run = 1; i + run < n && rows[i + run] == rows[i] + run; run++) {
        } /* consecutive rows: one read */
        const size_t size = (size_t) run * row;
        if (pread(fd, dst + (size_t) i * row, size, base + (off_t) rows[i] * (off_t) row) != (ssize_t) size) {
            st = dfl_fail(DFL_ERR_IO, "cannot read rows of tensor '%s' of '%s'", w->name, g->path);
        }
    }
    close(fd);
    return st;
}

dfl_status dfl_gguf_weight_rows(const dfl_gguf * g, const struct ggml_tensor * w, const int32_t * rows, int n,
                                bool repack, struct ggml_context ** ctx, ggml_backend_buffer_t * buf,
                                struct ggml_tensor ** out) {
    *ctx = NULL;
    *buf = NULL;
    *out = NULL;
    if (ggml_n_dims(w) != 2 || !w->buffer || n < 1 || n > w->ne[1]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot take %d rows of tensor '%s' of '%s'", n, w->name, g->path);
    }
    for (int i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= w->ne[1]) {
            return dfl_fail(DFL_ERR_ARGUMENT, "row %d of tensor '%s' is outside 0..%lld", rows[i], w->name,
                            (long long) w->ne[1] - 1);
        }
    }
    struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
    *ctx = ggml_init(ip);
    if (!*ctx) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    struct ggml_tensor * t = ggml_new_tensor_2d(*ctx, w->type, w->ne[0], n);
    ggml_format_name(t, "%.50s#rows", w->name);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(w->buffer));
    ggml_backend_buffer_type_t buft = NULL;
    if (dev && maps_host_memory(dev) && repack) {
        buft = dfl_gguf_repack_buft(dev, t);
    }
    if (!buft) {
        buft = dev ? ggml_backend_dev_buffer_type(dev) : ggml_backend_buffer_get_type(w->buffer);
    }
    char * host = malloc(ggml_nbytes(t));
    dfl_status st = host ? read_rows(g, w, rows, n, host) : dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    if (st == DFL_OK) {
        *buf = ggml_backend_alloc_ctx_tensors_from_buft(*ctx, buft);
        if (!*buf) {
            st = dfl_fail(DFL_ERR_BACKEND, "cannot allocate %zu bytes for %d rows of tensor '%s' of '%s'",
                          ggml_nbytes(t), n, w->name, g->path);
        }
    }
    if (st == DFL_OK && dev && !ggml_backend_dev_supports_op(dev, t)) {
        st = dfl_fail(DFL_ERR_BACKEND, "%d rows of tensor '%s' of '%s' (%zu bytes) are more than device %s takes "
                      "in one operation: keep fewer", n, w->name, g->path, ggml_nbytes(t), ggml_backend_dev_name(dev));
    }
    if (st == DFL_OK) {
        ggml_backend_buffer_set_usage(*buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(t, host, 0, ggml_nbytes(t)); /* whole: repacking buffers take no parts */
        *out = t;
    }
    free(host);
    if (st != DFL_OK) {
        if (*buf) ggml_backend_buffer_free(*buf);
        ggml_free(*ctx);
        *ctx = NULL;
        *buf = NULL;
    }
    return st;
}

dfl_status dfl_gguf_load_weights_on(dfl_gguf * g, ggml_backend_dev_t dev, bool repack) {
    const int64_t n = gguf_get_n_tensors(g->meta);
    ggml_backend_dev_t * dev_of = malloc((size_t) (n + 1) * sizeof *dev_of);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int64_t i = 0; i < n; i++) {
        dev_of[i] = dev;
    }
    dfl_status st = dfl_gguf_load_weights(g, dev_of, repack);
    free(dev_of);
    return st;
}

dfl_status dfl_gguf_place_by_name(const dfl_gguf * g, const dfl_weight_placement * placements, int n,
                                  ggml_backend_dev_t dev, ggml_backend_dev_t cpu, ggml_backend_dev_t * dev_of) {
    if (n < 0 || (n > 0 && !placements)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "invalid weight placement list (%d entries)", n);
    }
    for (int k = 0; k < n; k++) {
        const dfl_weight_placement * p = &placements[k];
        const int64_t i = p->name ? gguf_find_tensor(g->meta, p->name) : -1;
        if (i < 0) {
            return dfl_fail(DFL_ERR_ARGUMENT, "weight placement: '%s' has no tensor named '%s'", g->path,
                            p->name ? p->name : "(null)");
        }
        ggml_backend_dev_t d = p->device ? ggml_backend_dev_by_name(p->device) : NULL;
        if (!d) {
            return dfl_fail(DFL_ERR_ARGUMENT, "weight placement of '%s': no device named '%s'", p->name,
                            p->device ? p->device : "(null)");
        }
        if (d != dev && d != cpu) {
            return dfl_fail(DFL_ERR_ARGUMENT, "weight placement of '%s' on %s: this model runs on %s%s%s", p->name,
                            p->device, ggml_backend_dev_name(dev), dev != cpu ? " and " : "",
                            dev != cpu ? ggml_backend_dev_name(cpu) : "");
        }
        dev_of[i] = d;
    }
    return DFL_OK;
}

dfl_status dfl_gguf_devices(const dfl_gguf * g, const dfl_weight_placement * placements, int n, ggml_backend_dev_t dev,
                            ggml_backend_dev_t cpu, ggml_backend_dev_t ** out) {
    const int64_t n_tensors = gguf_get_n_tensors(g->meta);
    ggml_backend_dev_t * dev_of = malloc((size_t) (n_tensors + 1) * sizeof *dev_of);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int64_t i = 0; i < n_tensors; i++) {
        dev_of[i] = dev;
    }
    const dfl_status st = dfl_gguf_place_by_name(g, placements, n, dev, cpu, dev_of);
    if (st != DFL_OK) {
        free(dev_of);
        return st;
    }
    *out = dev_of;
    return DFL_OK;
}

bool dfl_gguf_is_expert(const char * name) {
    int il, at = 0;
    return sscanf(name, "blk.%d.ffn_%n", &il, &at) == 1 && at > 0 &&
           (strstr(name + at, "_exps.") != NULL || strstr(name + at, "_chexps.") != NULL);
}
