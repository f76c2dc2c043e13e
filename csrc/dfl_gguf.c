/* A GGUF file opened for the runtime: the file checked (tensor data aligned as ggml's CPU
 * buffers want it), its metadata read by key under the architecture's prefix, typed, with
 * defaults. Placing and loading its weights: dfl_gguf_weights.c. */
#include "dfl_gguf.h"

#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ggml's CPU buffers want 32-byte aligned data (TENSOR_ALIGNMENT), GGUF's default alignment */
#define DFL_TENSOR_ALIGN 32

static void full_key(const dfl_gguf * g, const char * key, char * buf, size_t n) {
    if (key[0] == '.') {
        snprintf(buf, n, "%s%s", g->arch, key);
    } else {
        snprintf(buf, n, "%s", key);
    }
}

dfl_status dfl_gguf_open(const char * path, dfl_gguf * g) {
    memset(g, 0, sizeof *g);
    snprintf(g->path, sizeof g->path, "%s", path);

    struct stat info;
    if (stat(path, &info) != 0 || !S_ISREG(info.st_mode)) {
        return dfl_fail(DFL_ERR_IO, "cannot open '%s': no such file", path);
    }
    g->file_size = (size_t) info.st_size;

    struct gguf_init_params params = { .no_alloc = true, .ctx = &g->ctx };
    g->meta = gguf_init_from_file(path, params);
    if (!g->meta) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' is not a valid GGUF file (bad magic, corrupt or truncated header)", path);
    }

    int64_t k = gguf_find_key(g->meta, "general.architecture");
    if (k < 0 || gguf_get_kv_type(g->meta, k) != GGUF_TYPE_STRING) {
        dfl_gguf_close(g);
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has no general.architecture key", path);
    }
    snprintf(g->arch, sizeof g->arch, "%s", gguf_get_val_str(g->meta, k));

    /* gguf has checked that the tensors are laid out one after the other; what it cannot
     * know is the file size (it reads no data), and ggml wants tensor data aligned */
    const size_t data_off = gguf_get_data_offset(g->meta);
    const int64_t n_tensors = gguf_get_n_tensors(g->meta);
    if (n_tensors > 0 && data_off % DFL_TENSOR_ALIGN != 0) {
        const size_t alignment = gguf_get_alignment(g->meta);
        dfl_gguf_close(g);
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tensor data starts at byte %zu, not a multiple of %d "
                        "(general.alignment %zu is not supported)", path, data_off, DFL_TENSOR_ALIGN, alignment);
    }
    for (int64_t i = 0; i < n_tensors; i++) {
        const size_t off = gguf_get_tensor_offset(g->meta, i), size = gguf_get_tensor_size(g->meta, i);
        const char * name = gguf_get_tensor_name(g->meta, i);
        dfl_status st = DFL_OK;
        if (off % DFL_TENSOR_ALIGN != 0) {
            st = dfl_fail(DFL_ERR_FORMAT, "'%s': tensor '%s' data is not aligned to %d bytes", path, name,
                          DFL_TENSOR_ALIGN);
        } else if (data_off > g->file_size || off > g->file_size - data_off || size > g->file_size - data_off - off) {
            st = dfl_fail(DFL_ERR_FORMAT, "'%s' is truncated: tensor '%s' needs bytes %zu..%zu but the file has %zu "
                          "bytes", path, name, data_off + off, data_off + off + size, g->file_size);
        }
        if (st != DFL_OK) {
            dfl_gguf_close(g); /* after the message: the name belongs to the metadata */
            return st;
        }
    }
    g->used = calloc((size_t) n_tensors + 1, sizeof *g->used);
    if (!g->used) {
        dfl_gguf_close(g);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

void dfl_gguf_close(dfl_gguf * g) {
    for (int i = 0; i < g->n_buffers; i++) {
        ggml_backend_buffer_free(g->buffers[i]);
    }
    g->n_buffers = 0;
    if (g->map) {
        munmap(g->map, g->file_size);
        g->map = NULL;
    }
    if (g->ctx) {
        ggml_free(g->ctx);
        g->ctx = NULL;
    }
    if (g->ctx_slices) {
        ggml_free(g->ctx_slices);
        g->ctx_slices = NULL;
    }
    g->n_sliced = 0;
    if (g->meta) {
        gguf_free(g->meta);
        g->meta = NULL;
    }
    free(g->used);
    g->used = NULL;
}

bool dfl_gguf_has(const dfl_gguf * g, const char * key) {
    char k[256];
    full_key(g, key, k, sizeof k);
    return gguf_find_key(g->meta, k) >= 0;
}

static dfl_status find(const dfl_gguf * g, const char * key, bool required, int64_t * id, char * kbuf, size_t kn) {
    full_key(g, key, kbuf, kn);
    *id = gguf_find_key(g->meta, kbuf);
    if (*id < 0 && required) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' lacks required key '%s'", g->path, kbuf);
    }
    return DFL_OK;
}

dfl_status dfl_gguf_u32(const dfl_gguf * g, const char * key, bool required, uint32_t def, uint32_t * out) {
    char k[256];
    int64_t id;
    dfl_status st = find(g, key, required, &id, k, sizeof k);
    if (st != DFL_OK) {
        return st;
    }
    if (id < 0) {
        *out = def;
        return DFL_OK;
    }
    switch (gguf_get_kv_type(g->meta, id)) {
        case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(g->meta, id); return DFL_OK;
        case GGUF_TYPE_INT32: {
            const int32_t v = gguf_get_val_i32(g->meta, id);
            if (v < 0) {
                break;
            }
            *out = (uint32_t) v;
            return DFL_OK;
        }
        case GGUF_TYPE_UINT64: {
            const uint64_t v = gguf_get_val_u64(g->meta, id);
            if (v > UINT32_MAX) {
                break;
            }
            *out = (uint32_t) v;
            return DFL_OK;
        }
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g->meta, id); return DFL_OK;
        case GGUF_TYPE_UINT8: *out = gguf_get_val_u8(g->meta, id); return DFL_OK;
        default: break;
    }
    return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a valid unsigned integer", g->path, k);
}

dfl_status dfl_gguf_f32(const dfl_gguf * g, const char * key, bool required, float def, float * out) {
    char k[256];
    int64_t id;
    dfl_status st = find(g, key, required, &id, k, sizeof k);
    if (st != DFL_OK) {
        return st;
    }
    if (id < 0) {
        *out = def;
        return DFL_OK;
    }
    switch (gguf_get_kv_type(g->meta, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g->meta, id); break;
        case GGUF_TYPE_FLOAT64: *out = (float) gguf_get_val_f64(g->meta, id); break;
        default: return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not a float", g->path, k);
    }
    if (!isfinite(*out)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is %g, not a finite number", g->path, k, (double) *out);
    }
    return DFL_OK;
}

dfl_status dfl_gguf_arr_i32(const dfl_gguf * g, const char * key, int32_t * out, int max_n, int * n_out) {
    char k[256];
    int64_t id;
    dfl_status st = find(g, key, true, &id, k, sizeof k);
    if (st != DFL_OK) {
        return st;
    }
    if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_ARRAY) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not an array", g->path, k);
    }
    const enum gguf_type t = gguf_get_arr_type(g->meta, id);
    const size_t n = gguf_get_arr_n(g->meta, id);
    if (n > (size_t) max_n) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': array '%s' has %zu entries, at most %d expected", g->path, k, n, max_n);
    }
    const void * data = gguf_get_arr_data(g->meta, id);
    for (size_t i = 0; i < n; i++) {
        if (t == GGUF_TYPE_INT32) {
            out[i] = ((const int32_t *) data)[i];
        } else if (t == GGUF_TYPE_UINT32) {
            out[i] = (int32_t) ((const uint32_t *) data)[i];
        } else {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': array '%s' is not of 32-bit integers", g->path, k);
        }
    }
    *n_out = (int) n;
    return DFL_OK;
}

dfl_status dfl_gguf_arr_bool(const dfl_gguf * g, const char * key, bool * out, int n) {
    char k[256];
    int64_t id;
    dfl_status st = find(g, key, true, &id, k, sizeof k);
    if (st != DFL_OK) {
        return st;
    }
    if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g->meta, id) != GGUF_TYPE_BOOL) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' is not an array of booleans", g->path, k);
    }
    if (gguf_get_arr_n(g->meta, id) < (size_t) n) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': array '%s' has %zu entries, %d expected", g->path, k,
                        gguf_get_arr_n(g->meta, id), n);
    }
    const int8_t * data = gguf_get_arr_data(g->meta, id);
    for (int i = 0; i < n; i++) {
        out[i] = data[i] != 0;
    }
    return DFL_OK;
}

