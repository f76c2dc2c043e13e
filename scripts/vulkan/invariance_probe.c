/* Batch invariance of a ggml backend, many column counts at once: for each weight type,
 * column j of a k-column product against the same column alone (bit for bit), k = 2..K;
 * and for flash attention, query row j of an n-row call against the row alone (same
 * cache, same mask row). Prints one JSON object. The same question as csrc's
 * dfl_matmul_invariance, asked for every column count with the one-column products
 * computed once (column j alone does not depend on k), which is what makes 2..515 affordable
 * on lavapipe.
 *
 *   cc -O2 invariance_probe.c -I$GGML/include -L$BUILD/bin -lggml -lggml-base -lm -o probe
 *   GGML_VK_VISIBLE_DEVICES=0 ./probe Vulkan0 515 [types...]
 */
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return ((rng_state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static float nrand(float sd) { return (float) (sd * sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand())); }

static ggml_backend_t be;

/* y (n_out x n_cols) = w x, x's n_cols columns in one graph */
static int product(struct ggml_tensor * w, const float * x, int64_t n_cols, float * y) {
    struct ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], n_cols);
    struct ggml_tensor * yt = ggml_mul_mat(ctx, w, xt);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, yt);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    int ok = buf != NULL;
    if (ok) {
        ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
        ok = ggml_backend_graph_compute(be, gf) == GGML_STATUS_SUCCESS;
        if (ok) ggml_backend_tensor_get(yt, y, 0, ggml_nbytes(yt));
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return ok;
}

static void probe_type(enum ggml_type t, int64_t n_in, int64_t n_out, int64_t max_cols, int first) {
    float * w = malloc(sizeof(float) * n_in * n_out);
    float * x = malloc(sizeof(float) * n_in * max_cols);
    for (int64_t i = 0; i < n_in * n_out; i++) w[i] = nrand(0.05f);
    for (int64_t c = 0; c < max_cols; c++)
        for (int64_t i = 0; i < n_in; i++) x[c * n_in + i] = nrand(1.0f) * (i % 97 == 0 ? 30.0f : 1.0f);

    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * wctx = ggml_init(ip);
    struct ggml_tensor * wt = ggml_new_tensor_2d(wctx, t, n_in, n_out);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors(wctx, be);
    const size_t row = ggml_row_size(t, n_in);
    void * q = malloc(row * n_out);
    ggml_quantize_chunk(t, w, q, 0, n_out, n_in, NULL);
    ggml_backend_tensor_set(wt, q, 0, row * n_out);

    float * alone = malloc(sizeof(float) * n_out * max_cols);
    float * all = malloc(sizeof(float) * n_out * max_cols);
    for (int64_t c = 0; c < max_cols; c++) {
        if (!product(wt, x + c * n_in, 1, alone + c * n_out)) { fprintf(stderr, "product failed\n"); exit(1); }
    }
    printf("%s\n    \"%s\": {\"differ\": [", first ? "" : ",", ggml_type_name(t));
    int n_bad = 0;
    float worst = 0.0f;
    for (int64_t k = 2; k <= max_cols; k++) {
        /* every count up to 40 (five 8-column dispatches), then counts about each power of
         * two and the largest (PROBE_EVERY=1: all of them): past a few dispatches the patched
         * path repeats itself, and lavapipe on two shared cores has no time for all 514 */
        if (k > 40 && k != max_cols && !(k == 48 || k == 63 || k == 64 || k == 65 || k == 100 || k == 127 ||
                                         k == 128 || k == 129 || k == 255 || k == 256 || k == 257 || k == 511 ||
                                         k == 512 || k == 513) && !getenv("PROBE_EVERY")) {
            continue;
        }
        if (!product(wt, x, k, all)) { fprintf(stderr, "product failed\n"); exit(1); }
        int64_t d = 0;
        for (int64_t c = 0; c < k; c++) {
            if (memcmp(all + c * n_out, alone + c * n_out, sizeof(float) * n_out) != 0) {
                d++;
                for (int64_t r = 0; r < n_out; r++) worst = fmaxf(worst, fabsf(all[c * n_out + r] - alone[c * n_out + r]));
            }
        }
        if (d) { printf("%s[%lld, %lld]", n_bad ? ", " : "", (long long) k, (long long) d); n_bad++; }
    }
    printf("], \"column_counts_differing\": %d, \"max_abs_diff\": %g}", n_bad, worst);
    fflush(stdout);
    fprintf(stderr, "%s: %d of %lld column counts differ (max %g)\n", ggml_type_name(t), n_bad, (long long) max_cols - 1, worst);
    free(alone); free(all); free(q); free(w); free(x);
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
}

/* flash attention: out (D x n_head x n_rows) for queries q (D x n_rows x n_head), a causal
 * mask whose row j sees the first n_kv - n_rows + j + 1 positions */
static int attention(int64_t D, int64_t n_head, int64_t n_head_kv, int64_t n_kv, enum ggml_type kv_type,
                     const float * q, int64_t n_rows, int64_t first_row, int64_t total_rows,
                     const void * k, const void * v, float * out) {
    struct ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * qt = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, n_rows, n_head);
    struct ggml_tensor * kt = ggml_new_tensor_3d(ctx, kv_type, D, n_kv, n_head_kv);
    struct ggml_tensor * vt = ggml_new_tensor_3d(ctx, kv_type, D, n_kv, n_head_kv);
    struct ggml_tensor * mt = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_rows);
    struct ggml_tensor * ot = ggml_flash_attn_ext(ctx, qt, kt, vt, mt, 1.0f / sqrtf((float) D), 0.0f, 0.0f);
    ggml_prec_set_acc(ot, GGML_PREC_F32);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ot);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    int ok = buf != NULL;
    if (ok) {
        /* q is given as (D, total_rows, n_head): take rows first_row.. */
        float * qs = malloc(sizeof(float) * D * n_rows * n_head);
        for (int64_t h = 0; h < n_head; h++)
            memcpy(qs + (h * n_rows) * D, q + (h * total_rows + first_row) * D, sizeof(float) * D * n_rows);
        ggml_backend_tensor_set(qt, qs, 0, ggml_nbytes(qt));
        free(qs);
        ggml_backend_tensor_set(kt, k, 0, ggml_nbytes(kt));
        ggml_backend_tensor_set(vt, v, 0, ggml_nbytes(vt));
        ggml_fp16_t * m = malloc(sizeof(ggml_fp16_t) * n_kv * n_rows);
        for (int64_t j = 0; j < n_rows; j++)
            for (int64_t i = 0; i < n_kv; i++)
                m[j * n_kv + i] = ggml_fp32_to_fp16(i <= n_kv - total_rows + first_row + j ? 0.0f : -INFINITY);
        ggml_backend_tensor_set(mt, m, 0, ggml_nbytes(mt));
        free(m);
        ok = ggml_backend_graph_compute(be, gf) == GGML_STATUS_SUCCESS;
        if (ok) ggml_backend_tensor_get(ot, out, 0, ggml_nbytes(ot));
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return ok;
}

static void probe_fa(int64_t D, int64_t n_head, int64_t n_head_kv, int64_t n_kv, enum ggml_type kv_type,
                     const int64_t * rows, int n_counts, int first) {
    int64_t max_rows = 0;
    for (int i = 0; i < n_counts; i++) max_rows = rows[i] > max_rows ? rows[i] : max_rows;
    float * q = malloc(sizeof(float) * D * max_rows * n_head);
    for (int64_t i = 0; i < D * max_rows * n_head; i++) q[i] = nrand(1.0f);
    const size_t kv_row = ggml_row_size(kv_type, D);
    float * kf = malloc(sizeof(float) * D * n_kv * n_head_kv);
    float * vf = malloc(sizeof(float) * D * n_kv * n_head_kv);
    for (int64_t i = 0; i < D * n_kv * n_head_kv; i++) { kf[i] = nrand(1.0f); vf[i] = nrand(1.0f); }
    void * k = malloc(kv_row * n_kv * n_head_kv);
    void * v = malloc(kv_row * n_kv * n_head_kv);
    ggml_quantize_chunk(kv_type, kf, k, 0, n_kv * n_head_kv, D, NULL);
    ggml_quantize_chunk(kv_type, vf, v, 0, n_kv * n_head_kv, D, NULL);
    printf("%s\n    \"D%lld_h%lld_kv%lld_nkv%lld_%s\": {\"differ\": [", first ? "" : ",", (long long) D, (long long) n_head,
           (long long) n_head_kv, (long long) n_kv, ggml_type_name(kv_type));
    const int64_t per_row = D * n_head;
    float * one = malloc(sizeof(float) * per_row);
    float * all = malloc(sizeof(float) * per_row * max_rows);
    int n_bad = 0;
    float worst = 0.0f;
    for (int i = 0; i < n_counts; i++) {
        const int64_t n = rows[i];
        /* the n rows are the last n of max_rows: row j of them sees n_kv - n + j + 1 positions */
        if (!attention(D, n_head, n_head_kv, n_kv, kv_type, q, n, max_rows - n, max_rows, k, v, all)) { fprintf(stderr, "fa failed\n"); exit(1); }
        int64_t d = 0;
        for (int64_t j = 0; j < n; j++) {
            if (!attention(D, n_head, n_head_kv, n_kv, kv_type, q, 1, max_rows - n + j, max_rows, k, v, one)) { fprintf(stderr, "fa failed\n"); exit(1); }
            if (memcmp(all + j * per_row, one, sizeof(float) * per_row) != 0) {
                d++;
                for (int64_t r = 0; r < per_row; r++) worst = fmaxf(worst, fabsf(all[j * per_row + r] - one[r]));
            }
        }
        if (d) { printf("%s[%lld, %lld]", n_bad ? ", " : "", (long long) n, (long long) d); n_bad++; }
    }
    printf("], \"row_counts_tested\": %d, \"row_counts_differing\": %d, \"max_abs_diff\": %g}", n_counts, n_bad, worst);
    fflush(stdout);
    fprintf(stderr, "FA D=%lld heads %lld/%lld kv %lld %s: %d of %d row counts differ (max %g)\n", (long long) D,
            (long long) n_head, (long long) n_head_kv, (long long) n_kv, ggml_type_name(kv_type), n_bad, n_counts, worst);
    free(q); free(kf); free(vf); free(k); free(v); free(one); free(all);
}

int main(int argc, char ** argv) {
    const char * device = argc > 1 ? argv[1] : "Vulkan0";
    const int64_t max_cols = argc > 2 ? atoll(argv[2]) : 515;
    ggml_backend_load_all();
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(device);
    if (!dev) { fprintf(stderr, "no device %s\n", device); return 1; }
    be = ggml_backend_dev_init(dev, NULL);
    /* 1536 inputs (six K-quant super blocks) as the project's test; PROBE_ROWS outputs (16) */
    const int64_t n_out = getenv("PROBE_ROWS") ? atoll(getenv("PROBE_ROWS")) : 16;
    printf("{\"device\": \"%s\", \"description\": \"%s\", \"max_columns\": %lld, \"matmul\": {\"inputs\": 1536, \"outputs\": %lld, \"types\": {",
           device, ggml_backend_dev_description(dev), (long long) max_cols, (long long) n_out);
    /* the project's test's TYPES, those of its device test first */
    static const char * names[] = { "f16", "q4_K", "q8_0", "q6_K", "f32", "q4_0", "bf16", "q4_1", "q5_0", "q5_1",
                                    "q2_K", "q3_K", "q5_K", "iq4_nl", "iq4_xs", "mxfp4" };
    int first = 1;
    int fa_only = getenv("PROBE_FA_ONLY") != NULL;
    /* the types named after the column count, or all of names[] */
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !fa_only; i++) {
        int wanted = argc <= 3;
        for (int a = 3; a < argc; a++) wanted |= strcmp(argv[a], names[i]) == 0;
        if (!wanted) continue;
        for (int t = 0; t < GGML_TYPE_COUNT; t++) {
            if (ggml_get_type_traits((enum ggml_type) t)->type_name && strcmp(ggml_type_name((enum ggml_type) t), names[i]) == 0) {
                probe_type((enum ggml_type) t, 1536, n_out, max_cols, first);
                first = 0;
            }
        }
    }
    printf("\n  }}, \"flash_attn\": {");
    if (!getenv("PROBE_NO_FA")) {
        /* grouped heads (8 query heads on 2 KV heads) and plain (4 on 4), f16 and q8_0 caches */
        static const int64_t rows[] = { 2, 3, 4, 8, 9, 16, 17, 33, 65 };
        const int nr = sizeof(rows) / sizeof(rows[0]);
        probe_fa(128, 8, 2, 300, GGML_TYPE_F16, rows, nr, 1);
        probe_fa(64, 4, 4, 700, GGML_TYPE_F16, rows, nr, 0);
        probe_fa(128, 8, 2, 300, GGML_TYPE_Q8_0, rows, nr, 0);
    }
    printf("\n  }\n}\n");
    ggml_backend_free(be);
    return 0;
}
