/* The CPU flash attention's exactness harness (patch 0007 and the kernels tried before it), beyond what tests/runtime/test_attention_invariance.py
 * asks through the runtime: row r of an n-row ggml_flash_attn_ext equals the row alone, bit
 * for bit, with masks the probe has not (a tree's holes in the rows' cells and the cache,
 * a sliding window, an additive bias), ALiBi, softcap, sinks, any GQA ratio, any cache type
 * (0 f32, 1 f16, 30 bf16, 8 q8_0, 2 q4_0), one thread count for the n rows and another for
 * the lone rows. FA_REF=1 also compares the n rows with stock ggml's one-row kernel
 * (use_ref); FA_BENCH=REPS times the n-row call against that kernel (thread CPU time;
 * FA_WALL=1 for wall time). Build against a ggml built from the patched tree:
 *   gcc -O2 -o fa_row_invariance experiments/fa_row_invariance.c -I$GGML/include \
 *       -L$BUILD/src -lggml -lggml-base -lggml-cpu -lm -Wl,-rpath,$BUILD/src
 *   ./fa_row_invariance type dk n_head n_head_kv n_kv n_rows mask(0 causal, 1 tree, 2 window,
 *       3 bias) window max_bias softcap sinks threads_all [threads_one] [seed]
 * Exits 1 when a row differs. */
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void){struct timespec t; clock_gettime(getenv("FA_WALL") ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+1e-9*t.tv_nsec;}

static uint64_t rs = 1;
static float frand(void) { rs = rs * 6364136223846793005ULL + 1442695040888963407ULL; return (float)((rs >> 40) & 0xffffff) / 16777216.0f * 2 - 1; }

typedef struct { int type, dk, n_head, n_head_kv, n_kv, n_rows, maskkind, window; float max_bias, softcap; int sinks; } cfg_t;

static void attend(ggml_backend_t be, struct ggml_tensor * k, struct ggml_tensor * v, const cfg_t * c,
                   const float * q, const ggml_fp16_t * mask, const float * sinks, int n, float * out) {
    struct ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * qt = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c->dk, n, c->n_head, 1);
    struct ggml_tensor * mt = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c->n_kv, n, 1, 1);
    struct ggml_tensor * st = c->sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, c->n_head) : NULL;
    struct ggml_tensor * o = ggml_flash_attn_ext(ctx, qt, k, v, mt, 1.0f / sqrtf((float) c->dk), c->max_bias, c->softcap);
    ggml_prec_set_acc(o, GGML_PREC_F32);
    if (st) ggml_flash_attn_ext_add_sinks(o, st);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, o);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_tensor_set(qt, q, 0, ggml_nbytes(qt));
    ggml_backend_tensor_set(mt, mask, 0, ggml_nbytes(mt));
    if (st) ggml_backend_tensor_set(st, sinks, 0, ggml_nbytes(st));
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); exit(2); }
    ggml_backend_tensor_get(o, out, 0, ggml_nbytes(o)); // [dv, n_head, n]
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    if (argc < 13) { fprintf(stderr, "usage: type dk n_head n_head_kv n_kv n_rows maskkind window max_bias softcap sinks threads_all [threads_one] [seed]\n"); return 1; }
    cfg_t c = { atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7]), atoi(argv[8]), (float) atof(argv[9]), (float) atof(argv[10]), atoi(argv[11]) };
    int nth_all = atoi(argv[12]);
    int nth_one = argc > 13 ? atoi(argv[13]) : nth_all;
    rs = argc > 14 ? (uint64_t) atoll(argv[14]) : 1;
    ggml_backend_t be = ggml_backend_cpu_init();
    const int dk = c.dk, dv = c.dk, n_kv = c.n_kv, n = c.n_rows, H = c.n_head, HKV = c.n_head_kv;

    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * kctx = ggml_init(ip);
    struct ggml_tensor * k = ggml_new_tensor_4d(kctx, c.type, dk, n_kv, HKV, 1);
    struct ggml_tensor * v = ggml_new_tensor_4d(kctx, c.type, dv, n_kv, HKV, 1);
    ggml_backend_buffer_t kbuf = ggml_backend_alloc_ctx_tensors(kctx, be);
    size_t nel = (size_t) dk * n_kv * HKV;
    float * f = malloc(nel * sizeof(float));
    void * qd = malloc(ggml_row_size(c.type, dk) * n_kv * HKV);
    for (size_t i = 0; i < nel; i++) f[i] = frand() * 2.0f;
    ggml_quantize_chunk(c.type, f, qd, 0, (int64_t) n_kv * HKV, dk, NULL);
    ggml_backend_tensor_set(k, qd, 0, ggml_nbytes(k));
    for (size_t i = 0; i < nel; i++) f[i] = frand();
    ggml_quantize_chunk(c.type, f, qd, 0, (int64_t) n_kv * HKV, dk, NULL);
    ggml_backend_tensor_set(v, qd, 0, ggml_nbytes(v));

    float * q = malloc(sizeof(float) * dk * n * H); // [dk, n, H]
    for (size_t i = 0; i < (size_t) dk * n * H; i++) q[i] = frand() * 1.5f;
    float sinks[512]; for (int h = 0; h < H; h++) sinks[h] = frand() * 3;
    ggml_fp16_t * mask = malloc(sizeof(ggml_fp16_t) * n_kv * n);
    const int base = n_kv - n;
    for (int i = 0; i < n; i++) for (int j = 0; j < n_kv; j++) {
        int vis = j <= base + i;
        if (c.maskkind == 1 && j >= base && j < base + i) vis = ((frand() > 0)); // tree: holes among the rows' own cells
        if (c.maskkind == 1 && j < base && (j % 97) == 5) vis = 0;                // holes in the cache too
        if (c.maskkind == 2 && j < base + i - c.window) vis = 0;                // sliding window
        float mv = vis ? (c.max_bias > 0 ? -(float)(base + i - j) : 0.0f) : -INFINITY;
        if (vis && c.maskkind == 3) mv = -0.01f * (float)((j * 7) % 13);  // additive non-zero bias
        mask[(size_t) i * n_kv + j] = ggml_fp32_to_fp16(mv);
    }
    float * all = malloc(sizeof(float) * dv * H * n);
    float * one = malloc(sizeof(float) * dv * H);
    float * q1 = malloc(sizeof(float) * dk * H);
    ggml_backend_cpu_set_n_threads(be, nth_all);
    attend(be, k, v, &c, q, mask, sinks, n, all);
    if (getenv("FA_BENCH")) {
        int reps = atoi(getenv("FA_BENCH"));
        double best[2] = {1e9, 1e9};
        for (int rep = 0; rep < reps; rep++) for (int m = 0; m < 2; m++) {
            ggml_backend_cpu_set_use_ref(be, m == 1);
            double t0 = now(); attend(be, k, v, &c, q, mask, sinks, n, all); double t = now() - t0;
            if (t < best[m]) best[m] = t;
        }
        ggml_backend_cpu_set_use_ref(be, false);
        printf("bench type=%d dk=%d H=%d/%d n_kv=%d n=%d thr=%d: new %.3f ms, one-row kernel (use_ref) %.3f ms, ratio %.2f\n",
               c.type, dk, H, HKV, n_kv, n, nth_all, best[0]*1e3, best[1]*1e3, best[1]/best[0]);
        return 0;
    }
    ggml_backend_cpu_set_n_threads(be, nth_one);
    int n_differ = 0; float maxd = 0; int nan = 0;
    for (int i = 0; i < n; i++) {
        for (int h = 0; h < H; h++) memcpy(q1 + (size_t) h * dk, q + ((size_t) h * n + i) * dk, sizeof(float) * dk);
        attend(be, k, v, &c, q1, mask + (size_t) i * n_kv, sinks, 1, one);
        const float * row = all + (size_t) i * dv * H;
        for (int e = 0; e < dv * H; e++) if (isnan(row[e])) nan++;
        if (memcmp(row, one, sizeof(float) * dv * H)) {
            n_differ++;
            for (int e = 0; e < dv * H; e++) maxd = fmaxf(maxd, fabsf(row[e] - one[e]));
        }
    }
    // the stock one-row kernel (use_ref) for the whole call: the new kernel's numbers against it
    int n_ref = 0; float maxr = 0;
    if (getenv("FA_REF")) {
        ggml_backend_cpu_set_use_ref(be, true);
        ggml_backend_cpu_set_n_threads(be, nth_all);
        float * ref = malloc(sizeof(float) * dv * H * n);
        attend(be, k, v, &c, q, mask, sinks, n, ref);
        for (int i = 0; i < n; i++) if (memcmp(all + (size_t) i*dv*H, ref + (size_t) i*dv*H, sizeof(float)*dv*H)) n_ref++;
        for (size_t e = 0; e < (size_t) dv*H*n; e++) maxr = fmaxf(maxr, fabsf(all[e] - ref[e]));
        printf("vs use_ref one-row kernel: rows differ=%d max=%g\n", n_ref, maxr);
    }
    printf("type=%d dk=%d H=%d/%d n_kv=%d n=%d mask=%d bias=%g softcap=%g sinks=%d thr=%d/%d: differ=%d max=%g nan=%d\n",
           c.type, dk, H, HKV, n_kv, n, c.maskkind, c.max_bias, c.softcap, c.sinks, nth_all, nth_one, n_differ, maxd, nan);
    ggml_backend_buffer_free(kbuf); ggml_free(kctx); ggml_backend_free(be);
    return n_differ != 0;
}
