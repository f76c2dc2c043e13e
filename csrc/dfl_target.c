/* Target runtime: caches, one graph builder for decode and verify, and commit. */
#include "dfl_target.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

enum { LOGITS_NONE = 0, LOGITS_LAST = 1, LOGITS_ALL = 2 };

static void add_pending_commit(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf, graph_inputs * in);
static void fill_commit_inputs(dfl_target * t, const graph_inputs * in);

/* The attention window grows in steps so that graphs of consecutive steps share shapes. */
#define KV_PAD 256

DFL_API void dfl_target_default_params(dfl_target_params * p) {
    memset(p, 0, sizeof *p);
    p->n_ctx = 4096;
    p->n_ubatch = 512;
    p->n_verify = 16;
    p->kv_type = GGML_TYPE_F16;
    p->kv_type_v = -1;
    p->n_gpu_layers = -1;
}

static dfl_status check_params(const dfl_qwen35 * m, dfl_target_params * p) {
    if (p->n_ctx <= 0) p->n_ctx = 4096;
    if (p->n_ubatch <= 0) p->n_ubatch = 512;
    if (p->n_verify <= 0) p->n_verify = 16;
    if (p->n_ubatch > p->n_ctx) p->n_ubatch = p->n_ctx;
    if (p->n_verify > DFL_MAX_VERIFY) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_verify (%d) exceeds the supported %d", p->n_verify, DFL_MAX_VERIFY);
    }
    if (p->n_verify > p->n_ctx) {
        return dfl_fail(DFL_ERR_ARGUMENT, "n_verify (%d) exceeds the context size (%d)", p->n_verify, p->n_ctx);
    }
    if (p->kv_type_v < 0) {
        p->kv_type_v = p->kv_type;
    }
    const int32_t types[2] = { p->kv_type, p->kv_type_v };
    for (int i = 0; i < 2; i++) {
        const int32_t kt = types[i];
        if (kt != GGML_TYPE_F32 && kt != GGML_TYPE_F16 && kt != GGML_TYPE_Q8_0 && kt != GGML_TYPE_Q4_0 &&
            kt != GGML_TYPE_BF16) {
            return dfl_fail(DFL_ERR_ARGUMENT, "unsupported %s cache type %d (use f32, f16, bf16, q8_0 or q4_0)",
                            i == 0 ? "K" : "V", kt);
        }
        if ((kt == GGML_TYPE_Q8_0 || kt == GGML_TYPE_Q4_0) && m->head_dim % ggml_blck_size((enum ggml_type) kt) != 0) {
            return dfl_fail(DFL_ERR_ARGUMENT, "cache type %s needs a head size multiple of %lld (model has %d)",
                            ggml_type_name((enum ggml_type) kt), (long long) ggml_blck_size((enum ggml_type) kt),
                            m->head_dim);
        }
    }
    if (p->n_feature_layers < 0 || p->n_feature_layers > 16) {
        return dfl_fail(DFL_ERR_ARGUMENT, "between 0 and 16 feature layers are supported, got %d", p->n_feature_layers);
    }
    for (int i = 0; i < p->n_feature_layers; i++) {
        const int L = p->feature_layers[i];
        if (L < 1 || L > m->n_layer) {
            return dfl_fail(DFL_ERR_ARGUMENT, "feature layer %d is outside 1..%d", L, m->n_layer);
        }
    }
    return DFL_OK;
}

/* Per verified token, what a Gated DeltaNet layer needs to rerun its recurrence:
 * q and k (l2-normalised), v, g and beta. */
static int64_t replay_rows(const dfl_qwen35 * m) {
    return 2 * (int64_t) m->head_k_dim * m->n_k_heads + (int64_t) m->head_v_dim * m->n_v_heads + 2 * m->n_v_heads;
}

/* Trees have at most 64 nodes (their ancestor sets are 64-bit masks) and n_verify. */
static int max_tree_nodes(const dfl_target * t) {
    return t->p.n_verify < DFL_MAX_TREE ? t->p.n_verify : DFL_MAX_TREE;
}

/* Layers il >= first_device_layer run on the device, the ones before on the CPU. */
static int first_device_layer(const dfl_target * t) {
    const int n_layer = t->m.n_layer;
    if (t->rt.dev == t->rt.dev_cpu || t->p.n_gpu_layers < 0 || t->p.n_gpu_layers >= n_layer) {
        return 0;
    }
    return n_layer - t->p.n_gpu_layers;
}

static ggml_backend_dev_t layer_device(const dfl_target * t, int il) {
    return il >= first_device_layer(t) ? t->rt.dev : t->rt.dev_cpu;
}

static ggml_backend_dev_t output_device(const dfl_target * t) {
    return t->p.n_gpu_layers < 0 || t->p.n_gpu_layers > t->m.n_layer ? t->rt.dev : t->rt.dev_cpu;
}

/* Device of each weight, in file order. As in llama.cpp, the token embedding stays on
 * the CPU (it is only gathered from) unless it doubles as the LM head. */
static dfl_status place_weights(dfl_target * t) {
    dfl_gguf * g = &t->m.file;
    const int64_t n = gguf_get_n_tensors(g->meta);
    ggml_backend_dev_t * dev_of = malloc((size_t) (n + 1) * sizeof *dev_of);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int64_t i = 0; i < n; i++) {
        const char * name = gguf_get_tensor_name(g->meta, i);
        int il = -1;
        if (sscanf(name, "blk.%d.", &il) == 1) {
            dev_of[i] = il < t->m.n_layer ? layer_device(t, il) : t->rt.dev_cpu;
        } else if (strcmp(name, "token_embd.weight") == 0 && t->m.output != t->m.tok_embd) {
            dev_of[i] = t->rt.dev_cpu;
        } else {
            dev_of[i] = output_device(t);
        }
    }
    dfl_status st = dfl_gguf_load_weights(g, dev_of, !t->p.no_repack);
    free(dev_of);
    return st;
}

/* Caches and recurrent states live with their layer's weights: ctx_state[0] on the
 * device, ctx_state[1] on the CPU. */
static dfl_status alloc_state(dfl_target * t) {
    const dfl_qwen35 * m = &t->m;
    const int n_tensors = 5 * m->n_layer + 1;
    for (int k = 0; k < 2; k++) {
        struct ggml_init_params ip = { (size_t) n_tensors * ggml_tensor_overhead(), NULL, true };
        t->ctx_state[k] = ggml_init(ip);
        if (!t->ctx_state[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot create the state context");
        }
    }
    const int64_t kv_dim = (int64_t) m->head_dim * m->n_head_kv;
    const int64_t state_size = (int64_t) m->head_v_dim * m->head_v_dim * m->n_v_heads;
    for (int il = 0; il < m->n_layer; il++) {
        struct ggml_context * ctx = t->ctx_state[layer_device(t, il) == t->rt.dev ? 0 : 1];
        if (m->layers[il].recurrent) {
            t->conv_state[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m->d_conv - 1, m->conv_channels);
            t->ssm_state[il] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, state_size);
            const int64_t out_size = (int64_t) m->head_v_dim * m->n_v_heads;
            t->snapshots[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, out_size + state_size, max_tree_nodes(t));
            t->replay[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, replay_rows(m), t->p.n_verify);
            t->conv_scratch[il] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m->conv_channels, m->d_conv - 1 + t->p.n_verify);
        } else {
            t->k_cache[il] = ggml_new_tensor_2d(ctx, (enum ggml_type) t->p.kv_type, kv_dim, t->p.n_ctx);
            t->v_cache[il] = ggml_new_tensor_2d(ctx, (enum ggml_type) t->p.kv_type_v, kv_dim, t->p.n_ctx);
        }
    }
    const int rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
    t->features = ggml_new_tensor_2d(t->ctx_state[output_device(t) == t->rt.dev ? 0 : 1], GGML_TYPE_F32,
                                     (int64_t) m->n_embd * (t->p.n_feature_layers > 0 ? t->p.n_feature_layers : 1), rows);
    const ggml_backend_dev_t devs[2] = { t->rt.dev, t->rt.dev_cpu };
    for (int k = 0; k < 2; k++) {
        if (!ggml_get_first_tensor(t->ctx_state[k])) {
            continue;
        }
        t->buf_state[k] = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx_state[k], ggml_backend_dev_buffer_type(devs[k]));
        if (!t->buf_state[k]) {
            return dfl_fail(DFL_ERR_BACKEND, "out of %s memory for a context of %d tokens",
                            ggml_backend_dev_name(devs[k]), t->p.n_ctx);
        }
        ggml_backend_buffer_clear(t->buf_state[k], 0);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_load(const char * path, const dfl_target_params * params, dfl_target ** out) {
    *out = NULL;
    if (!path) {
        return dfl_fail(DFL_ERR_ARGUMENT, "no model path given");
    }
    dfl_target * t = calloc(1, sizeof *t);
    if (!t) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    if (params) {
        t->p = *params;
    } else {
        dfl_target_default_params(&t->p);
    }
    t->p.device = NULL; /* the caller's string is not ours to keep */

    dfl_status st = dfl_qwen35_open(path, &t->m);
    if (st != DFL_OK) {
        free(t);
        return st;
    }
    st = check_params(&t->m, &t->p);
    if (st == DFL_OK) {
        /* a tree verify takes about a dozen graph nodes per node and recurrent layer */
        const size_t graph_size = DFL_GRAPH_SIZE + (size_t) t->m.n_layer * (64 + 16 * (size_t) max_tree_nodes(t));
        st = dfl_runtime_init(&t->rt, params ? params->device : NULL, t->p.n_threads, "target", graph_size,
                              DFL_MAX_GRAPH_SLOTS);
    }
    if (st == DFL_OK) {
        t->backend = t->rt.backend;
        st = place_weights(t);
    }
    if (st == DFL_OK) {
        st = alloc_state(t);
    }
    if (st != DFL_OK) {
        dfl_target_free(t);
        return st;
    }
    *out = t;
    return DFL_OK;
}

DFL_API void dfl_target_free(dfl_target * t) {
    if (!t) {
        return;
    }
    for (int k = 0; k < 2; k++) {
        if (t->buf_state[k]) ggml_backend_buffer_free(t->buf_state[k]);
        if (t->ctx_state[k]) ggml_free(t->ctx_state[k]);
    }
    dfl_runtime_free(&t->rt);
    dfl_gguf_close(&t->m.file);
    free(t->host_i32);
    free(t->host_i64);
    free(t->host_mask);
    free(t);
}

DFL_API dfl_status dfl_target_get_info(const dfl_target * t, dfl_target_info * info) {
    if (!t || !info) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    memset(info, 0, sizeof *info);
    info->n_vocab = t->m.n_vocab;
    info->n_embd = t->m.n_embd;
    info->n_layer = t->m.n_layer;
    info->n_ctx_train = t->m.n_ctx_train;
    info->n_ctx = t->p.n_ctx;
    info->n_ubatch = t->p.n_ubatch;
    info->n_verify = t->p.n_verify;
    info->n_past = t->n_past;
    info->n_gpu_layers = t->rt.dev == t->rt.dev_cpu ? 0 : t->m.n_layer - first_device_layer(t);
    info->n_graphs = t->n_graphs;
    info->n_graph_builds = t->n_graph_builds;
    snprintf(info->device, sizeof info->device, "%s", ggml_backend_dev_name(t->rt.dev));
    info->n_threads = t->rt.n_threads;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_reset(dfl_target * t) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    for (int k = 0; k < 2; k++) {
        if (t->buf_state[k]) ggml_backend_buffer_clear(t->buf_state[k], 0);
    }
    t->n_past = 0;
    t->pending_verify = 0;
    t->commit.active = false;
    for (int i = 0; i < DFL_MAX_GRAPH_SLOTS; i++) {
        t->graphs[i].valid = false;
    }
    t->n_out = 0;
    t->n_rows = 0;
    return DFL_OK;
}

dfl_status dfl_host_reserve(dfl_target * t, int n, int n_kv) {
    if ((size_t) n > t->host_rows) {
        free(t->host_i32);
        free(t->host_i64);
        t->host_i32 = malloc((size_t) n * sizeof(int32_t));
        t->host_i64 = malloc((size_t) n * sizeof(int64_t));
        t->host_rows = (size_t) n;
    }
    const size_t mask = (size_t) n * (size_t) n_kv;
    if (mask > t->host_mask_size) {
        free(t->host_mask);
        t->host_mask = malloc(mask * sizeof(ggml_fp16_t));
        t->host_mask_size = mask;
    }
    if (!t->host_i32 || !t->host_i64 || !t->host_mask) {
        t->host_rows = t->host_mask_size = 0;
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

/* ---- graph ---------------------------------------------------------------------- */

static struct ggml_tensor * rms_norm(dfl_target * t, struct ggml_context * ctx, struct ggml_tensor * x,
                                     struct ggml_tensor * w) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, t->m.eps), w);
}

/* x / sqrt(sum(x^2) + eps), the form transformers uses for the delta-net q/k. */
static struct ggml_tensor * l2_norm(dfl_target * t, struct ggml_context * ctx, struct ggml_tensor * x) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, t->m.eps / n), 1.0f / sqrtf(n));
}



static struct ggml_tensor * build_attention(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf,
                                            const graph_inputs * in, struct ggml_tensor * cur, int il, int n,
                                            int n_kv) {
    const dfl_qwen35 * m = &t->m;
    const dfl_qwen35_layer * L = &m->layers[il];
    const int hd = m->head_dim;
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qg = ggml_mul_mat(ctx, L->wq, cur);
    struct ggml_tensor * q = ggml_view_3d(ctx, qg, hd, m->n_head, n, 2 * hd * f32, qg->nb[1], 0);
    struct ggml_tensor * gate = ggml_view_3d(ctx, qg, hd, m->n_head, n, 2 * hd * f32, qg->nb[1], hd * f32);
    q = rms_norm(t, ctx, q, L->q_norm);

    struct ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wk, cur), hd, m->n_head_kv, n);
    k = rms_norm(t, ctx, k, L->k_norm);
    struct ggml_tensor * v = ggml_mul_mat(ctx, L->wv, cur);

    /* Qwen3.5 uses interleaved multi-section RoPE; for text every section carries the same
     * position, which makes it the NeoX rotation over the first n_rot dimensions. */
    q = ggml_rope_ext(ctx, q, in->pos, NULL, m->n_rot, GGML_ROPE_TYPE_NEOX, m->n_ctx_train, m->rope_base, 1.0f,
                      0.0f, 1.0f, 0.0f, 0.0f);
    k = ggml_rope_ext(ctx, k, in->pos, NULL, m->n_rot, GGML_ROPE_TYPE_NEOX, m->n_ctx_train, m->rope_base, 1.0f,
                      0.0f, 1.0f, 0.0f, 0.0f);

    const int64_t kv_dim = (int64_t) hd * m->n_head_kv;
    struct ggml_tensor * kc = ggml_set_rows(ctx, t->k_cache[il], ggml_reshape_2d(ctx, k, kv_dim, n), in->slots);
    struct ggml_tensor * vc = ggml_set_rows(ctx, t->v_cache[il], v, in->slots);
    ggml_build_forward_expand(gf, kc);
    ggml_build_forward_expand(gf, vc);

    struct ggml_tensor * K = ggml_view_3d(ctx, kc, hd, m->n_head_kv, n_kv, ggml_row_size(kc->type, hd), kc->nb[1], 0);
    struct ggml_tensor * V = ggml_view_3d(ctx, vc, hd, m->n_head_kv, n_kv, ggml_row_size(vc->type, hd), vc->nb[1], 0);
    K = ggml_permute(ctx, K, 0, 2, 1, 3);
    V = ggml_permute(ctx, V, 0, 2, 1, 3);
    struct ggml_tensor * Q = ggml_permute(ctx, q, 0, 2, 1, 3);

    struct ggml_tensor * o = ggml_flash_attn_ext(ctx, Q, K, V, in->mask, 1.0f / sqrtf((float) hd), 0.0f, 0.0f);
    ggml_prec_set_acc(o, GGML_PREC_F32);
    o = ggml_reshape_2d(ctx, o, (int64_t) hd * m->n_head, n);
    o = ggml_mul(ctx, o, ggml_sigmoid(ctx, ggml_cont_2d(ctx, gate, (int64_t) hd * m->n_head, n)));
    return ggml_mul_mat(ctx, L->wo, o);
}

static struct ggml_tensor * build_delta_net(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf,
                                            struct ggml_tensor * cur, int il, int n, bool verify) {
    const dfl_qwen35 * m = &t->m;
    const dfl_qwen35_layer * L = &m->layers[il];
    const int64_t hk = m->head_k_dim, hv = m->head_v_dim, Hk = m->n_k_heads, Hv = m->n_v_heads;
    const int64_t C = m->conv_channels, W = m->d_conv - 1;
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qkv = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L->wqkv, cur), C, n, 1);
    struct ggml_tensor * z = ggml_mul_mat(ctx, L->wz, cur);
    struct ggml_tensor * beta = ggml_sigmoid(ctx, ggml_mul_mat(ctx, L->w_beta, cur));
    struct ggml_tensor * alpha = ggml_mul_mat(ctx, L->w_alpha, cur);
    struct ggml_tensor * g = ggml_mul(ctx, ggml_softplus(ctx, ggml_add(ctx, alpha, L->dt_bias)), L->ssm_a);
    beta = ggml_reshape_4d(ctx, beta, 1, Hv, n, 1);
    g = ggml_reshape_4d(ctx, g, 1, Hv, n, 1);

    /* conv input: the last W inputs of the committed context, then this call's inputs */
    struct ggml_tensor * conv_state = ggml_reshape_3d(ctx, t->conv_state[il], W, C, 1);
    struct ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, qkv), 0);
    if (verify) {
        struct ggml_tensor * dst = ggml_view_2d(ctx, t->conv_scratch[il], C, W + n, C * f32, 0);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, conv_in, W + n, C)), dst));
    } else {
        struct ggml_tensor * last = ggml_view_3d(ctx, conv_in, W, C, 1, conv_in->nb[1], conv_in->nb[2], n * f32);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, last, conv_state));
    }
    struct ggml_tensor * conv = ggml_silu(ctx, ggml_ssm_conv(ctx, conv_in, L->conv1d));

    struct ggml_tensor * q = ggml_view_4d(ctx, conv, hk, Hk, n, 1, hk * f32, conv->nb[1], conv->nb[2], 0);
    struct ggml_tensor * k = ggml_view_4d(ctx, conv, hk, Hk, n, 1, hk * f32, conv->nb[1], conv->nb[2], hk * Hk * f32);
    struct ggml_tensor * v = ggml_view_4d(ctx, conv, hv, Hv, n, 1, hv * f32, conv->nb[1], conv->nb[2],
                                          2 * hk * Hk * f32);
    q = l2_norm(t, ctx, q);
    k = l2_norm(t, ctx, k);

    const int64_t S = hv * hv * Hv;
    struct ggml_tensor * s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
    struct ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, v, g, beta, s0, 1);
    const int64_t n_out = hv * Hv * n;
    struct ggml_tensor * o = ggml_view_4d(ctx, r, hv, Hv, n, 1, hv * f32, hv * Hv * f32, n_out * f32, 0);
    if (verify) {
        /* the state moves only at commit, by rerunning the kept tokens (add_pending_commit):
         * cheaper than keeping a state per verified token */
        struct ggml_tensor * rp = t->replay[il];
        const int64_t parts[5][2] = { { 0, hk * Hk }, { hk * Hk, hk * Hk }, { 2 * hk * Hk, hv * Hv },
                                      { 2 * hk * Hk + hv * Hv, Hv }, { 2 * hk * Hk + hv * Hv + Hv, Hv } };
        struct ggml_tensor * srcs[5] = { q, k, v, g, beta };
        for (int i = 0; i < 5; i++) {
            struct ggml_tensor * dst = ggml_view_2d(ctx, rp, parts[i][1], n, rp->nb[1], (size_t) parts[i][0] * f32);
            ggml_build_forward_expand(gf, ggml_cpy(ctx, srcs[i], dst));
        }
    } else {
        struct ggml_tensor * s1 = ggml_view_1d(ctx, r, S, n_out * f32);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, s1, t->ssm_state[il]));
    }

    o = rms_norm(t, ctx, o, L->ssm_norm);
    o = ggml_mul(ctx, o, ggml_silu(ctx, ggml_reshape_4d(ctx, z, hv, Hv, n, 1)));
    return ggml_mul_mat(ctx, L->ssm_out, ggml_reshape_2d(ctx, o, hv * Hv, n));
}

/* Tree verify: every node continues its parent's recurrence, one node after another in
 * the given order (parents first). Node j's step gathers its parent's state from the
 * per-node rows (the root starts from the committed state), runs one token and
 * scatters [output | state] to row j. Which row is whose parent is an input, so the
 * graph depends only on the node count: every tree of a budget reuses one graph. Conv
 * windows are gathered along each node's ancestor chain. A chain-shaped tree does
 * exactly the arithmetic of the chain path. */
static struct ggml_tensor * build_delta_net_tree(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf,
                                                 const graph_inputs * in, struct ggml_tensor * cur, int il, int n) {
    const dfl_qwen35 * m = &t->m;
    const dfl_qwen35_layer * L = &m->layers[il];
    const int64_t hk = m->head_k_dim, hv = m->head_v_dim, Hk = m->n_k_heads, Hv = m->n_v_heads;
    const int64_t C = m->conv_channels, W = m->d_conv - 1;
    const size_t f32 = sizeof(float);

    struct ggml_tensor * qkv = ggml_mul_mat(ctx, L->wqkv, cur);
    struct ggml_tensor * z = ggml_mul_mat(ctx, L->wz, cur);
    struct ggml_tensor * beta = ggml_sigmoid(ctx, ggml_mul_mat(ctx, L->w_beta, cur));
    struct ggml_tensor * alpha = ggml_mul_mat(ctx, L->w_alpha, cur);
    struct ggml_tensor * g = ggml_mul(ctx, ggml_softplus(ctx, ggml_add(ctx, alpha, L->dt_bias)), L->ssm_a);

    /* [committed conv inputs | node inputs], one column per time step, kept for commit */
    struct ggml_tensor * cat = ggml_concat(ctx, ggml_cont(ctx, ggml_transpose(ctx, t->conv_state[il])), qkv, 1);
    struct ggml_tensor * saved = ggml_view_2d(ctx, t->conv_scratch[il], C, W + n, C * f32, 0);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, cat, saved));
    struct ggml_tensor * win = ggml_get_rows(ctx, cat, in->conv_windows);            /* [C, (W+1) * n] */
    win = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, win, C, W + 1, n), 1, 0, 2, 3)); /* [W+1, C, n] */
    struct ggml_tensor * conv = ggml_silu(ctx, ggml_ssm_conv(ctx, win, L->conv1d));    /* [C, 1, n] */

    struct ggml_tensor * q = ggml_view_4d(ctx, conv, hk, Hk, n, 1, hk * f32, conv->nb[2], conv->nb[2] * n, 0);
    struct ggml_tensor * k = ggml_view_4d(ctx, conv, hk, Hk, n, 1, hk * f32, conv->nb[2], conv->nb[2] * n, hk * Hk * f32);
    struct ggml_tensor * v = ggml_view_4d(ctx, conv, hv, Hv, n, 1, hv * f32, conv->nb[2], conv->nb[2] * n,
                                          2 * hk * Hk * f32);
    q = l2_norm(t, ctx, q);
    k = l2_norm(t, ctx, k);

    const int64_t O = hv * Hv; /* output floats of a token; its state follows in the row */
    struct ggml_tensor * rows = t->snapshots[il];
    for (int j = 0; j < n; j++) {
        struct ggml_tensor * s0;
        if (j == 0) {
            s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
        } else {
            struct ggml_tensor * parent = ggml_get_rows(ctx, rows, in->parent_row[j]);
            s0 = ggml_view_4d(ctx, parent, hv, hv, Hv, 1, hv * f32, hv * hv * f32, hv * hv * Hv * f32, O * f32);
        }
        struct ggml_tensor * qj = ggml_view_4d(ctx, q, hk, Hk, 1, 1, q->nb[1], q->nb[2], q->nb[2], j * q->nb[2]);
        struct ggml_tensor * kj = ggml_view_4d(ctx, k, hk, Hk, 1, 1, k->nb[1], k->nb[2], k->nb[2], j * k->nb[2]);
        struct ggml_tensor * vj = ggml_view_4d(ctx, v, hv, Hv, 1, 1, v->nb[1], v->nb[2], v->nb[2], j * v->nb[2]);
        struct ggml_tensor * gj = ggml_view_4d(ctx, g, 1, Hv, 1, 1, f32, Hv * f32, Hv * f32, j * Hv * f32);
        struct ggml_tensor * bj = ggml_view_4d(ctx, beta, 1, Hv, 1, 1, f32, Hv * f32, Hv * f32, j * Hv * f32);
        struct ggml_tensor * r = ggml_gated_delta_net(ctx, qj, kj, vj, gj, bj, s0, 1); /* [output | state] */
        rows = ggml_set_rows(ctx, rows, ggml_reshape_2d(ctx, r, ggml_nelements(r), 1), in->node_row[j]);
    }
    ggml_build_forward_expand(gf, rows);

    struct ggml_tensor * o = ggml_cont(ctx, ggml_view_2d(ctx, rows, O, n, rows->nb[1], 0));
    o = rms_norm(t, ctx, ggml_reshape_4d(ctx, o, hv, Hv, n, 1), L->ssm_norm);
    o = ggml_mul(ctx, o, ggml_silu(ctx, ggml_reshape_4d(ctx, z, hv, Hv, n, 1)));
    return ggml_mul_mat(ctx, L->ssm_out, ggml_reshape_2d(ctx, o, hv * Hv, n));
}

static void capture_features(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf,
                             struct ggml_tensor * x, int layer, int n) {
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] == layer) {
            struct ggml_tensor * dst = ggml_view_2d(ctx, t->features, t->m.n_embd, n, t->features->nb[1],
                                                    (size_t) f * t->m.n_embd * sizeof(float));
            ggml_build_forward_expand(gf, ggml_cpy(ctx, x, dst));
        }
    }
}

static struct ggml_cgraph * build_graph(dfl_target * t, struct ggml_context * ctx, graph_inputs * in, int n,
                                        int n_kv, bool verify, bool tree, int logits, struct ggml_tensor * tokens_src) {
    const dfl_qwen35 * m = &t->m;
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, t->rt.graph_size, false);
    add_pending_commit(t, ctx, gf, in);

    in->tokens = NULL;
    struct ggml_tensor * tokens;
    if (tokens_src) {
        tokens = ggml_view_1d(ctx, tokens_src, n, 0);
    } else {
        tokens = in->tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(in->tokens);
    }
    in->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    in->slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    in->mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n);
    ggml_set_input(in->pos);
    ggml_set_input(in->slots);
    ggml_set_input(in->mask);
    if (tree) {
        in->conv_windows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) m->d_conv * n);
        in->node_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
        ggml_set_input(in->conv_windows);
        ggml_set_input(in->node_rows);
        /* the root starts from the committed state: only nodes 1.. have a parent row */
        in->parent_rows = n > 1 ? ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n - 1) : NULL;
        if (in->parent_rows) {
            ggml_set_input(in->parent_rows);
        }
        for (int j = 0; j < n; j++) {
            in->parent_row[j] = j ? ggml_view_1d(ctx, in->parent_rows, 1, (size_t) (j - 1) * sizeof(int32_t)) : NULL;
            in->node_row[j] = ggml_view_1d(ctx, in->node_rows, 1, (size_t) j * sizeof(int64_t));
        }
    }

    struct ggml_tensor * x = ggml_get_rows(ctx, m->tok_embd, tokens);
    for (int il = 0; il < m->n_layer; il++) {
        capture_features(t, ctx, gf, x, il, n);
        const dfl_qwen35_layer * L = &m->layers[il];
        struct ggml_tensor * cur = rms_norm(t, ctx, x, L->attn_norm);
        if (!L->recurrent) {
            cur = build_attention(t, ctx, gf, in, cur, il, n, n_kv);
        } else if (tree) {
            cur = build_delta_net_tree(t, ctx, gf, in, cur, il, n);
        } else {
            cur = build_delta_net(t, ctx, gf, cur, il, n, verify);
        }
        x = ggml_add(ctx, cur, x);
        cur = rms_norm(t, ctx, x, L->post_norm);
        cur = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L->ffn_gate, cur), ggml_mul_mat(ctx, L->ffn_up, cur));
        x = ggml_add(ctx, ggml_mul_mat(ctx, L->ffn_down, cur), x);
    }
    /* layer n_layer is the final-normed state, as transformers' last hidden_states entry
     * (what z-lab's drafters read for the last target layer) */
    bool normed = false;
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] == m->n_layer && !normed) {
            x = rms_norm(t, ctx, x, m->output_norm);
            normed = true;
            capture_features(t, ctx, gf, x, m->n_layer, n);
        }
    }

    t->out_logits = NULL;
    t->out_argmax = NULL;
    if (logits != LOGITS_NONE) {
        if (logits == LOGITS_LAST && n > 1) {
            x = ggml_view_2d(ctx, x, m->n_embd, 1, x->nb[1], (size_t) (n - 1) * x->nb[1]);
        }
        if (!normed) {
            x = rms_norm(t, ctx, x, m->output_norm);
        }
        t->out_logits = ggml_mul_mat(ctx, m->output, x);
        t->out_argmax = ggml_argmax(ctx, t->out_logits);
        ggml_set_output(t->out_logits);
        ggml_set_output(t->out_argmax);
        ggml_build_forward_expand(gf, t->out_argmax);
    }
    ggml_build_forward_expand(gf, x);
    return gf;
}

/* Tokens (unless they come from a device tensor), positions (n_past + depth; a chain's
 * depth is its index) and cache slots (n_past + index). */
static void set_token_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n,
                             const int32_t * depth) {
    int32_t * pos = t->host_i32;
    int64_t * slots = t->host_i64;
    for (int i = 0; i < n; i++) {
        pos[i] = t->n_past + (depth ? depth[i] : i);
        slots[i] = t->n_past + i;
    }
    if (in->tokens) {
        ggml_backend_tensor_set(in->tokens, tokens, 0, (size_t) n * sizeof(int32_t));
    }
    ggml_backend_tensor_set(in->pos, pos, 0, (size_t) n * sizeof(int32_t));
    ggml_backend_tensor_set(in->slots, slots, 0, (size_t) n * sizeof(int64_t));
}

static void fill_chain_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n, int n_kv) {
    set_token_inputs(t, in, tokens, n, NULL);

    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t minf = ggml_fp32_to_fp16(-INFINITY);
    ggml_fp16_t * mask = t->host_mask;
    for (int i = 0; i < n; i++) {
        const int visible = t->n_past + i + 1;
        for (int j = 0; j < n_kv; j++) {
            mask[(size_t) i * n_kv + j] = j < visible ? zero : minf;
        }
    }
    ggml_backend_tensor_set(in->mask, mask, 0, (size_t) n * n_kv * sizeof(ggml_fp16_t));
}

static void fill_tree_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n, int n_kv);

static bool same_key(const graph_key * a, const graph_key * b) {
    return a->n == b->n && a->n_kv == b->n_kv && a->logits == b->logits && a->verify == b->verify &&
           a->commit == b->commit && a->commit_replay == b->commit_replay && a->tokens_src == b->tokens_src &&
           a->tree == b->tree;
}

/* The slot holding a graph of this key, or the one to build it in (marked invalid):
 * graphs larger than a verify (prefill chunks) always take slot 0, so that the other
 * slots' compute memory stays verify-sized; the rest take the least recently used. */
static int graph_slot(dfl_target * t, const graph_key * key) {
    const int n_slots = t->rt.n_slots;
    for (int i = 0; i < n_slots; i++) {
        if (t->graphs[i].valid && same_key(&t->graphs[i].key, key)) {
            return i;
        }
    }
    int slot = 0;
    if (key->n <= t->p.n_verify) {
        uint64_t oldest = UINT64_MAX;
        for (int i = 1; i < n_slots; i++) {
            const uint64_t used = t->graphs[i].valid ? t->graphs[i].last_use : 0;
            if (used < oldest) {
                oldest = used;
                slot = i;
            }
        }
    }
    t->graphs[slot].valid = false;
    return slot;
}

/* tokens come from the host, or (tokens == NULL) from the device tensor tokens_src */
static dfl_status run(dfl_target * t, const int32_t * tokens, int n, bool verify, bool tree, int logits,
                      struct ggml_tensor * tokens_src) {
    for (int i = 0; tokens && i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= t->m.n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "token id %d at index %d is outside the vocabulary (0..%d)", tokens[i],
                            i, t->m.n_vocab - 1);
        }
    }
    if (t->n_past + n > t->p.n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: %d tokens in context + %d new > context size %d",
                        t->n_past, n, t->p.n_ctx);
    }
    int n_kv = ((t->n_past + n + KV_PAD - 1) / KV_PAD) * KV_PAD;
    if (n_kv > t->p.n_ctx) {
        n_kv = t->p.n_ctx;
    }
    TRY(dfl_host_reserve(t, n > t->p.n_verify ? n : t->p.n_verify, n_kv)); /* commit inputs have n_verify rows */

    /* steps of a shape seen lately reuse its graph and allocation, only the inputs
     * change: plain decoding, chain steps (the commit they carry is an input), tree
     * steps with as many nodes whatever the tree, and `auto` going back and forth
     * between the chain and a few tree sizes */
    const int commit = t->commit.active ? (t->commit.tree ? 2 : 1) : 0;
    const graph_key key = { n, n_kv, logits, verify, commit, commit == 1 ? t->commit.n_verified : 0, tokens_src,
                            tree };
    const int slot = graph_slot(t, &key);
    graph_cache * gc = &t->graphs[slot];
    t->n_graphs++;
    if (!gc->valid) {
        t->n_graph_builds++;
        gc->gf = build_graph(t, dfl_runtime_begin_graph(&t->rt, slot), &gc->in, n, n_kv, verify, tree, logits,
                             tokens_src);
        TRY(dfl_runtime_alloc(&t->rt, slot, gc->gf));
        gc->key = key;
        gc->logits = t->out_logits;
        gc->argmax = t->out_argmax;
        gc->valid = true;
    }
    gc->last_use = ++t->graph_clock;
    t->out_logits = gc->logits;
    t->out_argmax = gc->argmax;
    struct ggml_cgraph * gf = gc->gf;
    const graph_inputs in = gc->in;
    if (t->commit.active) {
        fill_commit_inputs(t, &in);
    }
    if (tree) {
        fill_tree_inputs(t, &in, tokens, n, n_kv);
    } else {
        fill_chain_inputs(t, &in, tokens, n, n_kv);
    }
    TRY(dfl_runtime_compute(&t->rt, slot, gf));
    t->commit.active = false;

    t->n_rows = n;
    t->n_out = logits == LOGITS_NONE ? 0 : (logits == LOGITS_LAST ? 1 : n);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_decode(dfl_target * t, const int32_t * tokens, int32_t n, int32_t logits) {
    if (!t || !tokens || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "decode needs at least one token");
    }
    if (n > t->p.n_ubatch) {
        return dfl_fail(DFL_ERR_CAPACITY, "decode of %d tokens exceeds the ubatch size %d", n, t->p.n_ubatch);
    }
    if (logits < LOGITS_NONE || logits > LOGITS_ALL) {
        return dfl_fail(DFL_ERR_ARGUMENT, "logits mode must be 0, 1 or 2");
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "a verify is waiting for dfl_target_commit");
    }
    TRY(run(t, tokens, n, false, false, logits, NULL));
    t->n_past += n;
    return DFL_OK;
}

static dfl_status verify_chain(dfl_target * t, const int32_t * tokens, int32_t n, struct ggml_tensor * tokens_src) {
    if (n > t->p.n_verify) {
        return dfl_fail(DFL_ERR_CAPACITY, "verify of %d tokens exceeds n_verify %d", n, t->p.n_verify);
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
    }
    TRY(run(t, tokens, n, true, false, LOGITS_ALL, tokens_src));
    t->pending_verify = n;
    t->pending_tree = false;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_verify(dfl_target * t, const int32_t * tokens, int32_t n) {
    if (!t || !tokens || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target and at least one token");
    }
    return verify_chain(t, tokens, n, NULL);
}

DFL_API dfl_status dfl_target_verify_draft(dfl_target * t, const dfl_draft * d, int32_t n) {
    if (!t || !d || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target, a drafter and at least one token");
    }
    if (dfl_draft_target(d) != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
    }
    struct ggml_tensor * block = dfl_draft_block_tensor(d, n);
    if (!block) {
        return dfl_fail(DFL_ERR_STATE, "the drafter's last block has fewer than %d tokens", n);
    }
    return verify_chain(t, NULL, n, block);
}

DFL_API dfl_status dfl_target_commit(dfl_target * t, int32_t n_keep) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    const int n = t->pending_verify;
    if (n == 0) {
        return dfl_fail(DFL_ERR_STATE, "commit without a preceding verify");
    }
    if (t->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "a tree verify is committed with dfl_target_commit_path");
    }
    if (n_keep < 0 || n_keep > n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d verified tokens", n_keep, n);
    }
    t->pending_verify = 0;
    t->n_out = 0;
    if (n_keep > 0) {
        pending_commit * pc = &t->commit;
        pc->active = true;
        pc->tree = false;
        pc->p0 = t->n_past;
        pc->n_keep = n_keep;
        pc->n_verified = n;
        for (int j = 0; j < t->m.d_conv - 1; j++) {
            pc->conv_cols[j] = n_keep + j;
        }
        t->n_past += n_keep;
    }
    return DFL_OK;
}

/* Validate a tree and derive what its graph needs on the host: depths (positions), the
 * ancestor mask and conv windows. */
static dfl_status plan_tree(dfl_target * t, const int32_t * parents, int n) {
    tree_plan * tp = &t->tree;
    const int W = t->m.d_conv - 1;
    if (n > DFL_MAX_TREE) {
        return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds the supported %d", n, DFL_MAX_TREE);
    }
    tp->n = n;
    for (int i = 0; i < n; i++) {
        const int p = parents[i];
        if (i == 0 ? p != -1 : (p < 0 || p >= i)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "tree node %d has parent %d: node 0 is the root (parent -1) and every "
                            "other node's parent must come before it", i, p);
        }
        tp->parent[i] = p;
        tp->depth[i] = i == 0 ? 0 : tp->depth[p] + 1;
        tp->ancestors[i] = (i == 0 ? 0 : tp->ancestors[p]) | (1ull << i);
        /* conv window: the last W+1 inputs along the path, oldest first; columns 0..W-1
         * of the concatenation are the committed inputs, W+j is node j */
        int32_t * w = &tp->windows[(size_t) i * (W + 1)];
        int node = i;
        for (int k = W; k >= 0; k--) {
            if (node >= 0) {
                w[k] = W + node;
                node = tp->parent[node];
            } else {
                w[k] = w[k + 1] - 1; /* walked past the root: into the committed inputs */
            }
        }
    }
    return DFL_OK;
}

static void fill_tree_inputs(dfl_target * t, const graph_inputs * in, const int32_t * tokens, int n, int n_kv) {
    const tree_plan * tp = &t->tree;
    set_token_inputs(t, in, tokens, n, tp->depth);

    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t minf = ggml_fp32_to_fp16(-INFINITY);
    for (int i = 0; i < n; i++) {
        ggml_fp16_t * row = t->host_mask + (size_t) i * n_kv;
        for (int j = 0; j < n_kv; j++) {
            const int node = j - t->n_past;
            const bool visible = node < 0 || (node < n && (tp->ancestors[i] >> node & 1));
            row[j] = visible ? zero : minf;
        }
    }
    ggml_backend_tensor_set(in->mask, t->host_mask, 0, (size_t) n * n_kv * sizeof(ggml_fp16_t));

    int32_t parent_rows[DFL_MAX_TREE];
    int64_t node_rows[DFL_MAX_TREE];
    for (int i = 0; i < n; i++) {
        parent_rows[i] = i + 1 < n ? tp->parent[i + 1] : 0;
        node_rows[i] = i;
    }
    if (in->parent_rows) {
        ggml_backend_tensor_set(in->parent_rows, parent_rows, 0, (size_t) (n - 1) * sizeof(int32_t));
    }
    ggml_backend_tensor_set(in->node_rows, node_rows, 0, (size_t) n * sizeof(int64_t));
    ggml_backend_tensor_set(in->conv_windows, tp->windows, 0, (size_t) n * t->m.d_conv * sizeof(int32_t));
}

DFL_API dfl_status dfl_target_verify_tree(dfl_target * t, const int32_t * tokens, const int32_t * parents, int32_t n) {
    if (!t || !tokens || !parents || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "tree verify needs at least one node");
    }
    if (n > t->p.n_verify) {
        return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds n_verify %d", n, t->p.n_verify);
    }
    if (t->pending_verify) {
        return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
    }
    TRY(plan_tree(t, parents, n));
    TRY(run(t, tokens, n, true, true, LOGITS_ALL, NULL));
    t->pending_verify = n;
    t->pending_tree = true;
    return DFL_OK;
}

/* Keep a root-to-node path of the last tree verify: its KV rows move to consecutive
 * slots, the recurrent state becomes the last node's, the conv state the inputs along
 * the path. */
DFL_API dfl_status dfl_target_commit_path(dfl_target * t, const int32_t * path, int32_t n_keep) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (t->pending_verify == 0 || !t->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "commit_path needs a preceding tree verify");
    }
    const tree_plan * tp = &t->tree;
    if (n_keep < 0 || n_keep > tp->n || (n_keep > 0 && !path)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d tree nodes", n_keep, tp->n);
    }
    for (int k = 0; k < n_keep; k++) {
        const bool ok = path[k] >= 0 && path[k] < tp->n && (k == 0 ? path[k] == 0 : tp->parent[path[k]] == path[k - 1]);
        if (!ok) {
            return dfl_fail(DFL_ERR_ARGUMENT, "path entry %d (node %d) does not continue a root-to-node path", k, path[k]);
        }
    }
    t->pending_verify = 0;
    t->pending_tree = false;
    t->n_out = 0;
    if (n_keep > 0) {
        const int W = t->m.d_conv - 1, last = path[n_keep - 1];
        pending_commit * pc = &t->commit;
        pc->active = true;
        pc->tree = true;
        pc->p0 = t->n_past;
        pc->n_keep = n_keep;
        memcpy(pc->path, path, (size_t) n_keep * sizeof(int32_t));
        pc->state_row = last;
        for (int j = 0; j < W; j++) {
            pc->conv_cols[j] = tp->windows[(size_t) last * (W + 1) + j + 1];
        }
        t->n_past += n_keep;
    }
    return DFL_OK;
}

/* A commit is carried out at the start of the next graph, so a decoding step costs
 * one target graph: the accepted path's attention rows move to consecutive slots, the
 * conv state becomes the inputs before the next token, and the recurrent state that of
 * the last kept token: after a chain, by rerunning the recurrence over the verified
 * tokens from the committed state with the tokens after the kept ones made identity
 * steps (decay exp(0) = 1, update weight 0: the state passes through unchanged, bit for
 * bit); after a tree, the kept node's row of the per-node states. Which rows, columns
 * and tokens is an input, so the graph's shape does not depend on the accepted length
 * and consecutive steps reuse it. Cache rows move through a gather and a scatter: every
 * read happens before any write, and the round trip through f32 is exact for every
 * cache type (quantized rows requantize to the same bytes). */
static void add_pending_commit(dfl_target * t, struct ggml_context * ctx, struct ggml_cgraph * gf, graph_inputs * in) {
    in->commit_state_row = in->commit_keep = in->commit_conv_cols = in->commit_kv_src = in->commit_kv_dst = NULL;
    if (!t->commit.active) {
        return;
    }
    const dfl_qwen35 * m = &t->m;
    const int W = m->d_conv - 1, M = t->p.n_verify;
    const bool tree = t->commit.tree;
    const int64_t hk = m->head_k_dim, hv = m->head_v_dim, Hk = m->n_k_heads, Hv = m->n_v_heads;
    const size_t f32 = sizeof(float);
    if (tree) {
        in->commit_state_row = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
        ggml_set_input(in->commit_state_row);
    } else {
        in->commit_keep = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, 1, t->commit.n_verified, 1);
        ggml_set_input(in->commit_keep);
    }
    in->commit_conv_cols = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, W);
    in->commit_kv_src = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, M);
    in->commit_kv_dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, M);
    ggml_set_input(in->commit_conv_cols);
    ggml_set_input(in->commit_kv_src);
    ggml_set_input(in->commit_kv_dst);
    for (int il = 0; il < m->n_layer; il++) {
        if (!m->layers[il].recurrent) {
            struct ggml_tensor * caches[2] = { t->k_cache[il], t->v_cache[il] };
            for (int c = 0; c < 2; c++) {
                struct ggml_tensor * rows = ggml_get_rows(ctx, caches[c], in->commit_kv_src);
                ggml_build_forward_expand(gf, ggml_set_rows(ctx, caches[c], rows, in->commit_kv_dst));
            }
            continue;
        }
        struct ggml_tensor * state;
        if (tree) {
            struct ggml_tensor * row = ggml_get_rows(ctx, t->snapshots[il], in->commit_state_row);
            state = ggml_view_2d(ctx, row, hv * hv * Hv, 1, row->nb[1], hv * Hv * f32); /* after the output */
        } else {
            struct ggml_tensor * rp = t->replay[il];
            const size_t row = rp->nb[1];
            const int R = t->commit.n_verified;
            const int64_t at_g = 2 * hk * Hk + hv * Hv;
            struct ggml_tensor * q = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, row, row * R, 0);
            struct ggml_tensor * k = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, row, row * R, hk * Hk * f32);
            struct ggml_tensor * v = ggml_view_4d(ctx, rp, hv, Hv, R, 1, hv * f32, row, row * R, 2 * hk * Hk * f32);
            struct ggml_tensor * g = ggml_view_4d(ctx, rp, 1, Hv, R, 1, f32, row, row * R, at_g * f32);
            struct ggml_tensor * b = ggml_view_4d(ctx, rp, 1, Hv, R, 1, f32, row, row * R, (at_g + Hv) * f32);
            g = ggml_mul(ctx, g, in->commit_keep);
            b = ggml_mul(ctx, b, in->commit_keep);
            struct ggml_tensor * s0 = ggml_reshape_4d(ctx, t->ssm_state[il], hv, hv, Hv, 1);
            struct ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, v, g, b, s0, 1);
            state = ggml_view_2d(ctx, r, hv * hv * Hv, 1, hv * hv * Hv * f32, hv * Hv * R * f32);
        }
        ggml_build_forward_expand(gf, ggml_cpy(ctx, state, ggml_reshape_2d(ctx, t->ssm_state[il], hv * hv * Hv, 1)));
        struct ggml_tensor * cols = ggml_get_rows(ctx, t->conv_scratch[il], in->commit_conv_cols); /* [C, W] */
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, cols), t->conv_state[il]));
    }
}

static void fill_commit_inputs(dfl_target * t, const graph_inputs * in) {
    const pending_commit * pc = &t->commit;
    const int M = t->p.n_verify;
    int32_t * src = t->host_i32;
    int64_t * dst = t->host_i64;
    /* unused entries copy row p0 onto itself (path[0] is always the root, already in place) */
    for (int k = 0; k < M; k++) {
        const bool moved = pc->tree && k < pc->n_keep;
        src[k] = pc->p0 + (moved ? pc->path[k] : 0);
        dst[k] = pc->p0 + (moved ? k : 0);
    }
    if (pc->tree) {
        const int32_t state_row = pc->state_row;
        ggml_backend_tensor_set(in->commit_state_row, &state_row, 0, sizeof state_row);
    } else {
        float keep[DFL_MAX_VERIFY];
        for (int k = 0; k < pc->n_verified; k++) {
            keep[k] = k < pc->n_keep ? 1.0f : 0.0f;
        }
        ggml_backend_tensor_set(in->commit_keep, keep, 0, (size_t) pc->n_verified * sizeof(float));
    }
    ggml_backend_tensor_set(in->commit_conv_cols, pc->conv_cols, 0, (size_t) (t->m.d_conv - 1) * sizeof(int32_t));
    ggml_backend_tensor_set(in->commit_kv_src, src, 0, (size_t) M * sizeof(int32_t));
    ggml_backend_tensor_set(in->commit_kv_dst, dst, 0, (size_t) M * sizeof(int64_t));
}

static dfl_status check_rows(const dfl_target * t, int32_t row0, int32_t n_rows, int32_t have, const char * what) {
    if (!t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null target");
    }
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > have) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%s rows %d..%d requested, the last call produced %d", what, row0,
                        row0 + n_rows, have);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_logits(const dfl_target * t, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_out : 0, "logit"));
    const size_t row = (size_t) t->m.n_vocab * sizeof(float);
    ggml_backend_tensor_get(t->out_logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_argmax(const dfl_target * t, int32_t * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_out : 0, "argmax"));
    ggml_backend_tensor_get(t->out_argmax, dst, (size_t) row0 * sizeof(int32_t), (size_t) n_rows * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_features(const dfl_target * t, float * dst, int32_t row0, int32_t n_rows) {
    TRY(check_rows(t, row0, n_rows, t ? t->n_rows : 0, "feature"));
    if (t->p.n_feature_layers == 0) {
        return dfl_fail(DFL_ERR_STATE, "the target was loaded without feature layers");
    }
    const size_t row = t->features->nb[1];
    ggml_backend_tensor_get(t->features, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}
