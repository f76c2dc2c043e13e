/* Batch invariance of a device's matrix product and flash attention: whether a column of
 * a many-column product (a query row of a many-row attention) rounds exactly as the same
 * column (row) alone. Speculative verification is lossless only where this holds for every
 * weight type a model uses and for its attention (a verify's rows against one-row decodes),
 * so the tests ask each backend directly. */
#include "dfl_error.h"
#include "dfl_gguf.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Compute gf on backend be, its n_in inputs set from data first, and read `out` into dst:
 * the one way both probes run a graph (ctx's tensors allocated on be for the call). */
static dfl_status run_graph(ggml_backend_t be, struct ggml_context * ctx, struct ggml_cgraph * gf,
                            struct ggml_tensor * const * in, const void * const * data, int n_in,
                            struct ggml_tensor * out, void * dst, const char * what) {
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    if (!buf) {
        return dfl_fail(DFL_ERR_BACKEND, "%s: cannot allocate its graph on %s", what, ggml_backend_name(be));
    }
    for (int i = 0; i < n_in; i++) {
        ggml_backend_tensor_set(in[i], data[i], 0, ggml_nbytes(in[i]));
    }
    dfl_status st = DFL_OK;
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
        st = dfl_fail(DFL_ERR_BACKEND, "%s failed on %s", what, ggml_backend_name(be));
    } else {
        ggml_backend_tensor_get(out, dst, 0, ggml_nbytes(out));
    }
    ggml_backend_buffer_free(buf);
    return st;
}

/* y = w x on backend be, x's n_cols columns in one pass. */
static dfl_status product(ggml_backend_t be, struct ggml_tensor * w, const float * x, int64_t n_cols, float * y) {
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], n_cols);
    struct ggml_tensor * yt = ggml_mul_mat(ctx, w, xt);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, yt);
    const void * data[] = { x };
    dfl_status st = run_graph(be, ctx, gf, &xt, data, 1, yt, y, "invariance: the product");
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

/* ---- flash attention ----------------------------------------------------------------- */

/* A small deterministic generator: the probe's cache and queries from `seed` alone. */
static float uniform(uint64_t * s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float) ((*s >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}

/* out [head_dim, n_head, n] = flash attention of q [head_dim, n, n_head] over the cache
 * k, v with mask [n_kv, n] (f16), on backend be. */
static dfl_status attend(ggml_backend_t be, struct ggml_tensor * k, struct ggml_tensor * v, const float * q,
                         const ggml_fp16_t * mask, int64_t n_head, int64_t n, float * out) {
    const int64_t head_dim = k->ne[0], n_kv = k->ne[1];
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * qt = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, head_dim, n, n_head, 1);
    struct ggml_tensor * mt = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, n, 1, 1);
    struct ggml_tensor * ot = ggml_flash_attn_ext(ctx, qt, k, v, mt, 1.0f / sqrtf((float) head_dim), 0.0f, 0.0f);
    ggml_prec_set_acc(ot, GGML_PREC_F32); /* as llama.cpp builds it */
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ot);
    struct ggml_tensor * in[] = { qt, mt };
    const void * data[] = { q, mask };
    dfl_status st = run_graph(be, ctx, gf, in, data, 2, ot, out, "attention invariance: flash attention");
    ggml_free(ctx);
    return st;
}

/* Row i's output alone over a cache of just the cells it sees (`seen`, n_seen of them, in
 * order), gathered from the quantized K and V (kq, vq: [head_dim, n_kv, n_head_kv] rows)
 * into tensors of the device: its path decoded alone. */
static dfl_status attend_path(ggml_backend_t be, ggml_backend_dev_t dev, enum ggml_type t, int64_t head_dim,
                              int64_t n_kv, int64_t n_head_kv, const char * kq, const char * vq, const int64_t * seen,
                              int64_t n_seen, const float * q1, int64_t n_head, float * out) {
    const size_t row = ggml_row_size(t, head_dim);
    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * k = ggml_new_tensor_3d(ctx, t, head_dim, n_seen, n_head_kv);
    struct ggml_tensor * v = ggml_new_tensor_3d(ctx, t, head_dim, n_seen, n_head_kv);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    char * gathered = malloc(row * (size_t) (n_seen * n_head_kv));
    ggml_fp16_t * mask = malloc(sizeof(ggml_fp16_t) * (size_t) n_seen);
    dfl_status st = DFL_OK;
    if (!buf || !gathered || !mask) {
        st = dfl_fail(DFL_ERR_BACKEND, "attention invariance: out of memory for a path of %lld cells", (long long) n_seen);
    } else {
        const char * src[2] = { kq, vq };
        struct ggml_tensor * dst[2] = { k, v };
        for (int w = 0; w < 2; w++) {
            for (int64_t h = 0; h < n_head_kv; h++) {
                for (int64_t j = 0; j < n_seen; j++) {
                    memcpy(gathered + (size_t) (h * n_seen + j) * row, src[w] + (size_t) (h * n_kv + seen[j]) * row, row);
                }
            }
            ggml_backend_tensor_set(dst[w], gathered, 0, ggml_nbytes(dst[w]));
        }
        for (int64_t j = 0; j < n_seen; j++) {
            mask[j] = ggml_fp32_to_fp16(0.0f);
        }
        st = attend(be, k, v, q1, mask, n_head, 1, out);
    }
    free(mask);
    free(gathered);
    if (buf) {
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return st;
}

DFL_API dfl_status dfl_attention_invariance(const char * device, int kv_type, int64_t head_dim, int64_t n_head,
                                            int64_t n_head_kv, int64_t n_kv, int64_t n_rows, int32_t tree,
                                            int32_t n_threads, uint64_t seed, int32_t * n_differ, float * max_diff) {
    if (kv_type != GGML_TYPE_F32 && kv_type != GGML_TYPE_F16 && kv_type != GGML_TYPE_BF16 && kv_type != GGML_TYPE_Q8_0 &&
        kv_type != GGML_TYPE_Q4_0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "attention invariance: K/V type %d is not a cache type", kv_type);
    }
    const enum ggml_type t = (enum ggml_type) kv_type;
    if (!n_differ || !max_diff || head_dim <= 0 || head_dim % ggml_blck_size(t) != 0 || n_head <= 0 ||
        n_head_kv <= 0 || n_head % n_head_kv != 0 || n_rows <= 0 || n_kv < n_rows) {
        return dfl_fail(DFL_ERR_ARGUMENT,
                        "attention invariance: %lld heads over %lld KV heads of %lld, %lld rows over %lld cells",
                        (long long) n_head, (long long) n_head_kv, (long long) head_dim, (long long) n_rows,
                        (long long) n_kv);
    }
    ggml_backend_dev_t dev = device && device[0] ? ggml_backend_dev_by_name(device)
                                                 : ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) {
        return dfl_fail(DFL_ERR_ARGUMENT, "attention invariance: no device named '%s'", device);
    }
    ggml_backend_t be = ggml_backend_dev_init(dev, NULL);
    if (!be) {
        return dfl_fail(DFL_ERR_BACKEND, "attention invariance: cannot start %s", ggml_backend_dev_name(dev));
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_set_n_threads_t set_threads =
        reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : NULL;
    if (set_threads && n_threads > 0) {
        set_threads(be, n_threads);
    }

    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * kctx = ggml_init(ip);
    struct ggml_tensor * k = ggml_new_tensor_3d(kctx, t, head_dim, n_kv, n_head_kv);
    struct ggml_tensor * v = ggml_new_tensor_3d(kctx, t, head_dim, n_kv, n_head_kv);
    ggml_backend_buffer_t kbuf = ggml_backend_alloc_ctx_tensors_from_buft(kctx, ggml_backend_dev_buffer_type(dev));
    const size_t n_cache = (size_t) (head_dim * n_kv * n_head_kv);
    float * f = malloc(sizeof(float) * n_cache);
    char * kq = malloc(ggml_row_size(t, head_dim) * (size_t) (n_kv * n_head_kv));
    char * vq = malloc(ggml_row_size(t, head_dim) * (size_t) (n_kv * n_head_kv));
    int64_t * parent = malloc(sizeof(int64_t) * (size_t) n_rows);
    int64_t * seen = malloc(sizeof(int64_t) * (size_t) n_kv);
    float * q = malloc(sizeof(float) * (size_t) (head_dim * n_rows * n_head));
    float * q1 = malloc(sizeof(float) * (size_t) (head_dim * n_head));
    ggml_fp16_t * mask = malloc(sizeof(ggml_fp16_t) * (size_t) (n_kv * n_rows));
    const size_t out_row = (size_t) (head_dim * n_head); /* one query row's output, every head */
    float * all = malloc(sizeof(float) * out_row * (size_t) n_rows);
    float * one = malloc(sizeof(float) * out_row);
    dfl_status st = DFL_OK;
    if (!kbuf || !f || !kq || !vq || !parent || !seen || !q || !q1 || !mask || !all || !one) {
        st = dfl_fail(DFL_ERR_BACKEND, "attention invariance: out of memory for %lld cells", (long long) n_kv);
    } else {
        uint64_t s = seed * 2654435761ULL + 1;
        for (size_t i = 0; i < n_cache; i++) {
            f[i] = 2.0f * uniform(&s); /* keys: scores of a few units, softmax neither flat nor one-hot */
        }
        ggml_quantize_chunk(t, f, kq, 0, n_kv * n_head_kv, head_dim, NULL);
        ggml_backend_tensor_set(k, kq, 0, ggml_nbytes(k));
        for (size_t i = 0; i < n_cache; i++) {
            f[i] = uniform(&s);
        }
        ggml_quantize_chunk(t, f, vq, 0, n_kv * n_head_kv, head_dim, NULL);
        ggml_backend_tensor_set(v, vq, 0, ggml_nbytes(v));
        for (size_t i = 0; i < (size_t) (head_dim * n_rows * n_head); i++) {
            q[i] = 1.5f * uniform(&s);
        }
        /* causal over the last n_rows positions: row i sees cells 0 .. n_kv - n_rows + i; a
         * tree's row sees the cells before the rows, then its ancestors' and its own */
        const int64_t p0 = n_kv - n_rows;
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), hidden = ggml_fp32_to_fp16(-INFINITY);
        for (int64_t i = 0; i < n_rows; i++) {
            parent[i] = i == 0 ? -1 : (int64_t) ((uniform(&s) * 0.5f + 0.5f) * (float) (i + 1)) - 1;
            parent[i] = parent[i] < -1 ? -1 : parent[i] >= i ? i - 1 : parent[i];
            for (int64_t j = 0; j < n_kv; j++) {
                mask[i * n_kv + j] = j <= p0 + i && (!tree || j < p0) ? zero : hidden;
            }
            for (int64_t a = i; tree && a >= 0; a = parent[a]) {
                mask[i * n_kv + p0 + a] = zero;
            }
        }
        st = attend(be, k, v, q, mask, n_head, n_rows, all);
        *n_differ = 0;
        *max_diff = 0.0f;
        for (int64_t i = 0; i < n_rows && st == DFL_OK; i++) {
            for (int64_t h = 0; h < n_head; h++) { /* q is [head_dim, n_rows, n_head] */
                memcpy(q1 + h * head_dim, q + (h * n_rows + i) * head_dim, sizeof(float) * (size_t) head_dim);
            }
            if (tree) {
                int64_t n_seen = 0;
                for (int64_t j = 0; j < n_kv; j++) {
                    if (mask[i * n_kv + j] == zero) {
                        seen[n_seen++] = j;
                    }
                }
                st = attend_path(be, dev, t, head_dim, n_kv, n_head_kv, kq, vq, seen, n_seen, q1, n_head, one);
            } else {
                st = attend(be, k, v, q1, mask + i * n_kv, n_head, 1, one);
            }
            const float * row = all + (size_t) i * out_row;
            if (st == DFL_OK && memcmp(row, one, sizeof(float) * out_row) != 0) {
                ++*n_differ;
                for (size_t e = 0; e < out_row; e++) {
                    *max_diff = fmaxf(*max_diff, fabsf(row[e] - one[e]));
                }
            }
        }
    }
    free(one);
    free(all);
    free(mask);
    free(q1);
    free(q);
    free(seen);
    free(parent);
    free(vq);
    free(kq);
    free(f);
    if (kbuf) {
        ggml_backend_buffer_free(kbuf);
    }
    ggml_free(kctx);
    ggml_backend_free(be);
    return st;
}
