/* Batch invariance of ggml's CPU matrix product, standalone (no Python): for every weight
 * type the CPU backend quantizes without an importance matrix, plain and repacked (through
 * the CPU's extra buffer types, as ggml places weights), a column of a k-column
 * ggml_mul_mat must be bit-identical to the same column computed alone, for every k.
 * The same check as csrc/dfl_invariance.c (dfl_matmul_invariance), for cross-compiled
 * ggml run under qemu-user (scripts/arm/invariance.sh).
 *
 * Prints one line per type, layout and column count:
 *   RESULT <type> <plain|repacked|repacked-unavailable> <k> <columns differing> <max |diff|>
 * and a FEATURES line with what the CPU backend detected. */
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const enum ggml_type TYPES[] = {
    GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,   GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
    GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4,
};

/* deterministic normal-ish numbers (no libc rand: same operands on every host) */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float uniform(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float) ((rng_state >> 11) * (1.0 / 9007199254740992.0));
}
static float normal(float sd) {
    float s = 0;
    for (int i = 0; i < 12; i++) {
        s += uniform();
    }
    return (s - 6.0f) * sd;
}

/* The CPU extra buffer type (repacking) that would take w for a product, as ggml's model
 * loader asks: supports_op with the weight in an (empty) buffer of that type. */
static ggml_backend_buffer_type_t repack_buft(ggml_backend_dev_t dev, struct ggml_tensor * w) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get_extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) {
        return NULL;
    }
    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * op = ggml_mul_mat(ctx, w, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 512));
    ggml_backend_buffer_type_t found = NULL;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b && !found; b++) {
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

/* y = w x, x's n_cols columns in one pass */
static int product(ggml_backend_t be, struct ggml_tensor * w, const float * x, int64_t n_cols, float * y) {
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
        if (ok) {
            ggml_backend_tensor_get(yt, y, 0, ggml_nbytes(yt));
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return ok;
}

int main(int argc, char ** argv) {
    int n_threads = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t n_in = 1536, n_out = 64; /* six K-quant super blocks; eight 8-row groups */
    static const int64_t COLS[] = { 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 129 };
    const int n_counts = (int) (sizeof(COLS) / sizeof(COLS[0]));
    const int64_t max_cols = COLS[n_counts - 1];

    ggml_cpu_init();
    printf("FEATURES neon=%d arm_fma=%d fp16_va=%d dotprod=%d i8mm=%d sve=%d sve_bytes=%d sme=%d llamafile=%d\n",
           ggml_cpu_has_neon(), ggml_cpu_has_arm_fma(), ggml_cpu_has_fp16_va(), ggml_cpu_has_dotprod(),
           ggml_cpu_has_matmul_int8(), ggml_cpu_has_sve(), ggml_cpu_get_sve_cnt(), ggml_cpu_has_sme(),
           ggml_cpu_has_llamafile());

    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t be = ggml_backend_dev_init(dev, NULL);
    ggml_backend_cpu_set_n_threads(be, n_threads);

    float * w = malloc(sizeof(float) * n_in * n_out);
    float * x = malloc(sizeof(float) * n_in * max_cols);
    for (int64_t i = 0; i < n_in * n_out; i++) {
        w[i] = normal(0.05f);
    }
    for (int64_t c = 0; c < max_cols; c++) {
        for (int64_t i = 0; i < n_in; i++) {
            /* outliers, as real activations have: every 97th input x30 */
            x[c * n_in + i] = normal(1.0f) * (i % 97 == 0 ? 30.0f : 1.0f);
        }
    }
    float * alone = malloc(sizeof(float) * n_out * max_cols);
    float * all = malloc(sizeof(float) * n_out * max_cols);
    int failures = 0;

    for (size_t ti = 0; ti < sizeof(TYPES) / sizeof(TYPES[0]); ti++) {
        const enum ggml_type t = TYPES[ti];
        const size_t row = ggml_row_size(t, n_in);
        void * q = malloc(row * n_out);
        ggml_quantize_chunk(t, w, q, 0, n_out, n_in, NULL);
        for (int repack = 0; repack <= 1; repack++) {
            struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
            struct ggml_context * wctx = ggml_init(ip);
            struct ggml_tensor * wt = ggml_new_tensor_2d(wctx, t, n_in, n_out);
            ggml_set_name(wt, "blk.0.ffn_up.weight");
            ggml_backend_buffer_type_t buft = repack ? repack_buft(dev, wt) : NULL;
            const char * layout = !repack ? "plain" : buft ? "repacked" : "repacked-unavailable";
            if (repack && !buft) {
                printf("RESULT %s %s - - -\n", ggml_type_name(t), layout);
                ggml_free(wctx);
                continue;
            }
            ggml_backend_buffer_t wbuf =
                ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft ? buft : ggml_backend_dev_buffer_type(dev));
            ggml_backend_tensor_set(wt, q, 0, row * n_out); /* whole: repacking buffers take no parts */
            for (int64_t c = 0; c < max_cols; c++) {
                if (!product(be, wt, x + c * n_in, 1, alone + c * n_out)) {
                    fprintf(stderr, "product failed\n");
                    return 2;
                }
            }
            for (int k = 0; k < n_counts; k++) {
                const int64_t n_cols = COLS[k];
                if (!product(be, wt, x, n_cols, all)) {
                    fprintf(stderr, "product failed\n");
                    return 2;
                }
                int differ = 0;
                float max_diff = 0;
                for (int64_t c = 0; c < n_cols; c++) {
                    if (memcmp(all + c * n_out, alone + c * n_out, sizeof(float) * n_out) != 0) {
                        differ++;
                        for (int64_t r = 0; r < n_out; r++) {
                            max_diff = fmaxf(max_diff, fabsf(all[c * n_out + r] - alone[c * n_out + r]));
                        }
                    }
                }
                failures += differ != 0;
                printf("RESULT %s %s %lld %d %.3g\n", ggml_type_name(t), layout, (long long) n_cols, differ, max_diff);
                fflush(stdout);
            }
            ggml_backend_buffer_free(wbuf);
            ggml_free(wctx);
        }
        free(q);
    }
    printf("FAILURES %d\n", failures);
    ggml_backend_free(be);
    return 0;
}
