/* Batch invariance of a device's matrix product: whether a column of a many-column
 * product rounds exactly as the same column alone. Speculative verification is lossless
 * only where this holds for every weight type a model uses (a verify's rows against
 * one-row decodes), so the tests ask each backend directly, type by type. */
#include "dfl_error.h"
#include "dfl_gguf.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* y = w x on backend be, x's n_cols columns in one pass. */
static dfl_status product(ggml_backend_t be, struct ggml_tensor * w, const float * x, int64_t n_cols, float * y) {
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], n_cols);
    struct ggml_tensor * yt = ggml_mul_mat(ctx, w, xt);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, yt);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    dfl_status st = DFL_OK;
    if (!buf) {
        st = dfl_fail(DFL_ERR_BACKEND, "invariance: cannot allocate %lld columns", (long long) n_cols);
    } else {
        ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
        if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
            st = dfl_fail(DFL_ERR_BACKEND, "invariance: the product failed on %s", ggml_backend_name(be));
        } else {
            ggml_backend_tensor_get(yt, y, 0, ggml_nbytes(yt));
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return st;
}

DFL_API dfl_status dfl_matmul_invariance(const char * device, int type, int repack, const float * w, int64_t n_in,
                                         int64_t n_out, const float * x, int64_t n_cols, int32_t n_threads,
                                         int32_t * n_differ, float * max_diff) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size((enum ggml_type) type) == 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "invariance: unknown ggml type %d", type);
    }
    const enum ggml_type t = (enum ggml_type) type;
    if (!w || !x || !n_differ || !max_diff || n_in <= 0 || n_out <= 0 || n_cols <= 0 ||
        n_in % ggml_blck_size(t) != 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "invariance: empty input, or %lld inputs not a multiple of %s's block",
                        (long long) n_in, ggml_type_name(t));
    }
    ggml_backend_dev_t dev = device && device[0] ? ggml_backend_dev_by_name(device)
                                                 : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        return dfl_fail(DFL_ERR_ARGUMENT, "invariance: no device named '%s'", device);
    }
    ggml_backend_t be = ggml_backend_dev_init(dev, NULL);
    if (!be) {
        return dfl_fail(DFL_ERR_BACKEND, "invariance: cannot start %s", ggml_backend_dev_name(dev));
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_set_n_threads_t set_threads =
        reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : NULL;
    if (set_threads && n_threads > 0) {
        set_threads(be, n_threads);
    }

    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * wctx = ggml_init(ip);
    struct ggml_tensor * wt = ggml_new_tensor_2d(wctx, t, n_in, n_out);
    ggml_set_name(wt, "invariance.weight");
    ggml_backend_buffer_type_t buft = repack ? dfl_gguf_repack_buft(dev, wt) : NULL;
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(
        wctx, buft ? buft : ggml_backend_dev_buffer_type(dev));
    const size_t row = ggml_row_size(t, n_in);
    void * q = malloc(row * (size_t) n_out);
    float * all = malloc(sizeof(float) * (size_t) (n_out * n_cols));
    float * one = malloc(sizeof(float) * (size_t) n_out);
    dfl_status st = DFL_OK;
    if (!wbuf || !q || !all || !one) {
        st = dfl_fail(DFL_ERR_BACKEND, "invariance: out of memory for a %lld x %lld %s matrix", (long long) n_out,
                      (long long) n_in, ggml_type_name(t));
    } else {
        ggml_quantize_chunk(t, w, q, 0, n_out, n_in, NULL);
        ggml_backend_tensor_set(wt, q, 0, row * (size_t) n_out); /* whole: repacking buffers take no parts */
        st = product(be, wt, x, n_cols, all);
        *n_differ = 0;
        *max_diff = 0.0f;
        for (int64_t c = 0; c < n_cols && st == DFL_OK; c++) {
            st = product(be, wt, x + c * n_in, 1, one);
            const float * col = all + c * n_out;
            if (st == DFL_OK && memcmp(col, one, sizeof(float) * (size_t) n_out) != 0) {
                ++*n_differ;
                for (int64_t r = 0; r < n_out; r++) {
                    *max_diff = fmaxf(*max_diff, fabsf(col[r] - one[r]));
                }
            }
        }
    }
    free(one);
    free(all);
    free(q);
    if (wbuf) {
        ggml_backend_buffer_free(wbuf);
    }
    ggml_free(wctx);
    ggml_backend_free(be);
    return st;
}
