/* Architecture registry, loader helpers and building blocks shared by model files. */
#include "dfl_model.h"
#include "dfl_pair.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DFL_ARCH(name) extern const dfl_arch dfl_arch_##name;
#include "models/registry.def"
#undef DFL_ARCH

static const dfl_arch * const ARCHS[] = {
#define DFL_ARCH(name) &dfl_arch_##name,
#include "models/registry.def"
#undef DFL_ARCH
};
#define N_ARCHS (sizeof ARCHS / sizeof ARCHS[0])

const char * dfl_model_arch_names(void) {
    static char names[256];
    if (!names[0]) {
        size_t at = 0;
        for (size_t i = 0; i < N_ARCHS && at < sizeof names; i++) {
            at += (size_t) snprintf(names + at, sizeof names - at, "%s%s", i ? ", " : "", ARCHS[i]->name);
        }
    }
    return names;
}

static dfl_status rope_key(const dfl_gguf * g, const char * name, float def, float * out) {
    char key[128];
    snprintf(key, sizeof key, ".rope.scaling.%s", name);
    return dfl_gguf_f32(g, key, false, def, out);
}

/* The yarn_truncate key: 1 true, 0 false, -1 absent (or not a bool: a file error). */
static dfl_status yarn_truncate_key(const dfl_gguf * g, int * out) {
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.yarn_truncate", g->arch);
    const int64_t k = gguf_find_key(g->meta, key);
    *out = -1;
    if (k < 0) {
        return DFL_OK;
    }
    if (gguf_get_kv_type(g->meta, k) != GGUF_TYPE_BOOL) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s' must be a bool", g->path, key);
    }
    *out = gguf_get_val_bool(g->meta, k) ? 1 : 0;
    return DFL_OK;
}

static float yarn_mscale(float factor, float mul) {
    return factor <= 1.0f ? 1.0f : 0.1f * mul * logf(factor) + 1.0f;
}

/* The rope.scaling.* keys and the overrides resolved the way llama.cpp's context resolves
 * them, so that a file rotates here as it does there. ggml's YaRN multiplies by
 * 1 + 0.1 ln(factor) itself, which is the attention factor transformers derives by default;
 * llama.cpp cancels its own estimate of that factor against ggml's, leaving
 * rope.scaling.attn_factor (default 1) as the multiplier. */
dfl_status dfl_rope_scaling_read(const dfl_gguf * g, int n_ctx_train, int type_override, float freq_scale,
                                 int n_ctx_orig, dfl_rope_scaling * r, const char ** type_out) {
    static const char * const names[] = { "none", "linear", "yarn" };
    *r = (dfl_rope_scaling) { 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, n_ctx_train };
    if (type_override < -1 || type_override > 2 || !(freq_scale >= 0.0f) || !isfinite(freq_scale) || n_ctx_orig < 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "invalid RoPE scaling override (type %d, frequency scale %g, original "
                        "context %d)", type_override, (double) freq_scale, n_ctx_orig);
    }
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", g->arch);
    const int64_t k = gguf_find_key(g->meta, key);
    const char * type = type_override >= 0 ? names[type_override]
                      : k < 0 ? "linear" /* llama.cpp's default: a factor alone scales linearly */
                      : gguf_get_kv_type(g->meta, k) == GGUF_TYPE_STRING ? gguf_get_val_str(g->meta, k) : "?";
    *type_out = type;
    const bool yarn = strcmp(type, "yarn") == 0;
    if (!yarn && strcmp(type, "linear") != 0 && strcmp(type, "none") != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' uses RoPE scaling '%s'; none, linear and yarn are implemented",
                        g->path, type);
    }
    float factor, attn = 1.0f, ext = -1.0f, log_mul = 0.0f;
    uint32_t orig = 0;
    TRY(rope_key(g, "factor", 0.0f, &factor));
    TRY(rope_key(g, "attn_factor", 1.0f, &attn));
    TRY(rope_key(g, "yarn_ext_factor", -1.0f, &ext));
    TRY(rope_key(g, "yarn_beta_fast", 32.0f, &r->beta_fast));
    TRY(rope_key(g, "yarn_beta_slow", 1.0f, &r->beta_slow));
    TRY(rope_key(g, "yarn_log_multiplier", 0.0f, &log_mul));
    TRY(dfl_gguf_u32(g, ".rope.scaling.original_context_length", false, 0, &orig));
    if (!(factor >= 0.0f) || !isfinite(factor) || !(attn > 0.0f) || !isfinite(attn) || !isfinite(ext) ||
        !isfinite(r->beta_fast) || !isfinite(r->beta_slow) || !isfinite(log_mul)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid RoPE scaling parameters", g->path);
    }
    if (strcmp(type, "none") != 0) {
        r->freq_scale = freq_scale > 0.0f ? freq_scale : factor == 0.0f ? 1.0f : 1.0f / factor;
    }
    r->n_ctx_orig = n_ctx_orig > 0 ? n_ctx_orig : orig > 0 ? (int) orig : n_ctx_train;
    r->ext_factor = ext < 0.0f ? (yarn ? 1.0f : 0.0f) : ext;
    if (r->ext_factor != 0.0f) {
        const float f = 1.0f / r->freq_scale;
        const float mscale = log_mul != 0.0f ? yarn_mscale(f, 1.0f) / yarn_mscale(f, log_mul) : yarn_mscale(f, 1.0f);
        r->attn_factor = mscale / (1.0f + 0.1f * logf(f));
    }
    r->attn_factor *= attn;
    int truncate;
    TRY(yarn_truncate_key(g, &truncate));
    r->exact_ramp = yarn && r->ext_factor != 0.0f && truncate == 0;
    return DFL_OK;
}

dfl_status dfl_model_rope_scaling(dfl_model * m, int type_override, float freq_scale, int n_ctx_orig) {
    const dfl_rope_scaling * r = &m->rope;
    const char * type = NULL;
    TRY(dfl_rope_scaling_read(&m->file, m->n_ctx_train, type_override, freq_scale, n_ctx_orig, &m->rope, &type));
    int truncate;
    TRY(yarn_truncate_key(&m->file, &truncate));
    if (truncate < 0 && m->yarn_exact_ramp && strcmp(type, "yarn") == 0 && m->rope.ext_factor != 0.0f) {
        m->rope.exact_ramp = true;
    }
    if (m->no_rope_scaling && (r->freq_scale != 1.0f || r->ext_factor != 0.0f)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': RoPE scaling '%s' is not implemented for %s", m->file.path, type,
                        m->arch->family);
    }
    return DFL_OK;
}

/* One sliding window per model (the runtime keeps one mask for it), and every shared
 * cache is an earlier layer's own, of the same geometry. */
static dfl_status check_attention(const dfl_model * m) {
    int window = 0;
    for (int il = 0; il < m->n_layer; il++) {
        const dfl_attention_geometry * a = &m->attn[il];
        if (m->kind[il] != DFL_LAYER_ATTENTION) {
            continue;
        }
        if (a->window < 0 || (a->window > 0 && window > 0 && a->window != window)) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d has sliding window %d; one window size per model is "
                            "supported (another layer has %d)", m->file.path, il, a->window, window);
        }
        if (a->window > 0) {
            window = a->window;
        }
        if (a->shares_kv) {
            const int src = a->kv_layer;
            const dfl_attention_geometry * s = src >= 0 && src < il ? &m->attn[src] : NULL;
            if (!s || m->kind[src] != DFL_LAYER_ATTENTION || s->shares_kv || s->head_dim_k != a->head_dim_k ||
                s->head_dim_v != a->head_dim_v || s->n_head_kv != a->n_head_kv || s->window != a->window) {
                return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d shares the KV cache of layer %d, which is not an "
                                "earlier attention layer of the same kind with its own cache", m->file.path, il, src);
            }
        }
    }
    return DFL_OK;
}

dfl_status dfl_model_open(const char * path, dfl_model * m) {
    memset(m, 0, sizeof *m);
    TRY(dfl_gguf_open(path, &m->file));
    for (size_t i = 0; i < N_ARCHS; i++) {
        if (strcmp(m->file.arch, ARCHS[i]->name) == 0) {
            m->arch = ARCHS[i];
        }
    }
    dfl_status st = DFL_OK;
    if (!m->arch) {
        st = dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%s'; a target model must be one of: %s", path,
                      m->file.arch, dfl_model_arch_names());
    }
    if (st == DFL_OK) {
        m->embd_scale = 1.0f;
        st = m->arch->load(m);
    }
    if (st == DFL_OK) {
        st = dfl_model_rope_scaling(m, -1, 0.0f, 0);
    }
    if (st == DFL_OK) {
        st = dfl_vocab_check(&m->file, m->n_vocab); /* before llama.cpp reads the vocabulary */
    }
    if (st == DFL_OK) {
        for (int il = 0; il < m->n_layer; il++) {
            if (m->kind[il] == DFL_LAYER_RECURRENT) {
                m->n_recurrent++;
            } else {
                m->n_attention++;
            }
        }
    }
    if (st == DFL_OK) {
        st = check_attention(m);
    }
    if (st == DFL_OK && m->n_attention == 0) {
        /* every architecture here has attention layers; none means a corrupt layer pattern */
        st = dfl_fail(DFL_ERR_FORMAT, "'%s': none of its %d layers is an attention layer (block_count, "
                      "recurrent_layers or full_attention_interval is wrong)", path, m->n_layer);
    }
    if (st != DFL_OK) {
        dfl_model_close(m);
    }
    return st;
}

void dfl_model_close(dfl_model * m) {
    dfl_gguf_close(&m->file);
    free(m->weights);
    m->weights = NULL;
}

/* ---- loader helpers ----------------------------------------------------------------- */

dfl_status dfl_model_key_or(const dfl_model * m, const char * key, int def, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(&m->file, key, false, (uint32_t) def, &v));
    if (v > (1u << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", m->file.path, m->file.arch, key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

dfl_status dfl_model_key(const dfl_model * m, const char * key, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(&m->file, key, true, 0, &v));
    if (v == 0 || v > (1u << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", m->file.path, m->file.arch, key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

dfl_status dfl_model_block_keys(dfl_model * m) {
    int n_layer = 0;
    TRY(dfl_model_key(m, ".embedding_length", &m->n_embd));
    TRY(dfl_model_key(m, ".block_count", &n_layer));
    if (n_layer > DFL_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported layer count %d", m->file.path, n_layer);
    }
    m->n_layer = n_layer;
    return DFL_OK;
}

dfl_status dfl_model_attention_keys(dfl_model * m, int * n_ff, dfl_attention_keys * out) {
    dfl_attention_keys a = { 0 };
    int head_dim_v = 0;
    TRY(dfl_model_block_keys(m));
    if (n_ff) {
        TRY(dfl_model_key(m, ".feed_forward_length", n_ff));
    }
    TRY(dfl_model_key(m, ".attention.head_count", &a.n_head));
    TRY(dfl_model_key(m, ".attention.head_count_kv", &a.n_head_kv));
    TRY(dfl_model_key_or(m, ".context_length", 0, &m->n_ctx_train));
    TRY(dfl_model_key_or(m, ".attention.key_length", m->n_embd / a.n_head, &a.head_dim));
    TRY(dfl_model_key_or(m, ".attention.value_length", a.head_dim, &head_dim_v));
    TRY(dfl_model_key_or(m, ".rope.dimension_count", a.head_dim, &a.n_rot));
    if (a.head_dim <= 0 || a.head_dim > 65536 || head_dim_v != a.head_dim || a.n_head % a.n_head_kv != 0 ||
        a.n_rot > a.head_dim || a.n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent attention shape (heads %d, kv heads %d, head sizes %d/%d, "
                        "rope dims %d)", m->file.path, a.n_head, a.n_head_kv, a.head_dim, head_dim_v, a.n_rot);
    }
    *out = a;
    return DFL_OK;
}

dfl_status dfl_model_tensor(const dfl_model * m, const char * name, int il, int64_t ne0, int64_t ne1, int64_t ne2,
                            bool required, struct ggml_tensor ** out) {
    char full[128];
    if (il >= 0) {
        snprintf(full, sizeof full, "blk.%d.%s", il, name);
    } else {
        snprintf(full, sizeof full, "%s", name);
    }
    const int64_t ne[3] = { ne0, ne1, ne2 };
    const int n_dims = ne2 > 0 ? 3 : ne1 > 0 ? 2 : 1;
    return dfl_gguf_tensor(&m->file, full, n_dims, ne, required, out);
}

dfl_status dfl_model_load_io(dfl_model * m) {
    const int64_t E = m->n_embd;
    TRY(dfl_gguf_tensor(&m->file, "token_embd.weight", 2, (int64_t[]) { E, 0 }, true, &m->tok_embd));
    if (m->tok_embd->ne[1] < 1 || m->tok_embd->ne[1] > (1 << 24)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': token_embd.weight has an invalid shape", m->file.path);
    }
    m->n_vocab = (int) m->tok_embd->ne[1];
    TRY(dfl_model_tensor(m, "output_norm.weight", -1, E, 0, 0, true, &m->output_norm));
    TRY(dfl_model_tensor(m, "output.weight", -1, E, m->n_vocab, 0, false, &m->output));
    if (!m->output) {
        m->output = m->tok_embd;
    }
    return DFL_OK;
}

dfl_status dfl_model_hybrid_layout(dfl_model * m) {
    bool recurrent[DFL_MAX_LAYERS];
    if (dfl_gguf_has(&m->file, ".attention.recurrent_layers")) {
        TRY(dfl_gguf_arr_bool(&m->file, ".attention.recurrent_layers", recurrent, m->n_layer));
    } else {
        int interval = 0;
        TRY(dfl_model_key_or(m, ".full_attention_interval", 4, &interval));
        if (interval == 0) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': full_attention_interval is 0", m->file.path);
        }
        for (int il = 0; il < m->n_layer; il++) {
            recurrent[il] = (il + 1) % interval != 0;
        }
    }
    for (int il = 0; il < m->n_layer; il++) {
        m->kind[il] = recurrent[il] ? DFL_LAYER_RECURRENT : DFL_LAYER_ATTENTION;
    }
    return DFL_OK;
}

/* ---- building blocks ---------------------------------------------------------------- */

struct ggml_tensor * dfl_rope(const dfl_model * m, struct ggml_context * ctx, struct ggml_tensor * x,
                              struct ggml_tensor * pos, struct ggml_tensor * freqs, int n_rot, float base) {
    const dfl_rope_scaling * r = &m->rope;
    GGML_ASSERT(!r->exact_ramp || !freqs); /* no model with factors of its own runs scaled RoPE (Gemma 4) */
    if (r->exact_ramp) {
        freqs = dfl_yarn_factors(ctx, r, n_rot, base);
    }
    return dfl_rope_scaled(r, ctx, x, pos, freqs, n_rot, base);
}

struct ggml_tensor * dfl_graph_rope(const dfl_model * m, dfl_graph * g, struct ggml_tensor * x, int n_rot, float base) {
    if (m->rope.exact_ramp && !g->rope_factors) {
        g->rope_factors = dfl_yarn_factors(g->ctx, &m->rope, n_rot, base);
    }
    return dfl_rope_scaled(&m->rope, g->ctx, x, g->pos, m->rope.exact_ramp ? g->rope_factors : NULL, n_rot, base);
}

struct ggml_tensor * dfl_rope_scaled(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                     struct ggml_tensor * pos, struct ggml_tensor * factors, int n_rot, float base) {
    return dfl_rope_scaled_mode(r, ctx, x, pos, factors, n_rot, base, GGML_ROPE_TYPE_NEOX);
}

struct ggml_tensor * dfl_rope_ramped(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                     struct ggml_tensor * pos, int n_rot, float base, int mode) {
    struct ggml_tensor * factors = r->exact_ramp ? dfl_yarn_factors(ctx, r, n_rot, base) : NULL;
    return dfl_rope_scaled_mode(r, ctx, x, pos, factors, n_rot, base, mode);
}

struct ggml_tensor * dfl_rope_scaled_mode(const dfl_rope_scaling * r, struct ggml_context * ctx, struct ggml_tensor * x,
                                          struct ggml_tensor * pos, struct ggml_tensor * factors, int n_rot, float base,
                                          int mode) {
    if (r->exact_ramp) {
        /* the blend is in the factors: rotate by them alone, and apply the attention factor
         * ggml multiplies by itself only when it blends (ext_factor != 0) */
        const float mscale = r->attn_factor * (1.0f + 0.1f * logf(1.0f / r->freq_scale));
        return ggml_rope_ext(ctx, x, pos, factors, n_rot, mode, r->n_ctx_orig, base, 1.0f, 0.0f, mscale,
                             r->beta_fast, r->beta_slow);
    }
    return ggml_rope_ext(ctx, x, pos, factors, n_rot, mode, r->n_ctx_orig, base, r->freq_scale, r->ext_factor,
                         r->attn_factor, r->beta_fast, r->beta_slow);
}

/* transformers' find_correction_dim: the rotary pair that turns `rotations` times over the
 * original context */
static double yarn_corr_dim(int n_rot, int n_ctx_orig, float rotations, float base) {
    return n_rot * log((double) n_ctx_orig / (rotations * 2.0 * 3.14159265358979323846)) / (2.0 * log((double) base));
}

struct ggml_tensor * dfl_yarn_factors(struct ggml_context * ctx, const dfl_rope_scaling * r, int n_rot, float base) {
    double low = yarn_corr_dim(n_rot, r->n_ctx_orig, r->beta_fast, base);
    double high = yarn_corr_dim(n_rot, r->n_ctx_orig, r->beta_slow, base);
    low = low > 0.0 ? low : 0.0;
    high = high < n_rot - 1 ? high : n_rot - 1;
    if (high == low) {
        high += 0.001; /* as transformers' linear_ramp_factor */
    }
    const float inv_factor = r->freq_scale; /* 1 / YaRN's factor */
    struct ggml_tensor * pair = ggml_arange(ctx, 0.0f, (float) (n_rot / 2), 1.0f);
    struct ggml_tensor * ramp = ggml_clamp(ctx, ggml_scale_bias(ctx, pair, (float) (1.0 / (high - low)),
                                                                (float) (-low / (high - low))), 0.0f, 1.0f);
    /* the pair's frequency is the extrapolated one times 1 - ramp + ramp / factor */
    struct ggml_tensor * blend = ggml_scale_bias(ctx, ramp, inv_factor - 1.0f, 1.0f);
    return ggml_div(ctx, ggml_scale_bias(ctx, ramp, 0.0f, 1.0f), blend);
}

struct ggml_tensor * dfl_cb(struct ggml_tensor * t, const char * name, int il) {
    if (il >= 0) {
        ggml_format_name(t, "%s-%d", name, il);
    } else {
        ggml_set_name(t, name);
    }
    return t;
}

struct ggml_tensor * dfl_rms_norm(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

/* the form transformers uses for the delta-net q/k: rms_norm with eps / n, then scaled */
struct ggml_tensor * dfl_l2_norm(struct ggml_context * ctx, struct ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / sqrtf(n));
}

struct ggml_tensor * dfl_gelu_tanh(struct ggml_context * ctx, struct ggml_tensor * x) {
    if (!ggml_is_contiguous(x)) {
        x = ggml_cont(ctx, x); /* ggml_scale needs it (the gate half of a fused gate_up) */
    }
    struct ggml_tensor * inner = ggml_add(ctx, x, ggml_scale(ctx, ggml_mul(ctx, ggml_sqr(ctx, x), x), 0.044715f));
    struct ggml_tensor * t = ggml_tanh(ctx, ggml_scale(ctx, inner, 0.7978845608028654f)); /* sqrt(2 / pi) */
    return ggml_mul(ctx, ggml_scale(ctx, x, 0.5f), ggml_scale_bias(ctx, t, 1.0f, 1.0f));
}

struct ggml_tensor * dfl_ffn_swiglu(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * gate,
                                    struct ggml_tensor * up, struct ggml_tensor * down) {
    return ggml_mul_mat(ctx, down, ggml_swiglu_split(ctx, ggml_mul_mat(ctx, gate, x), ggml_mul_mat(ctx, up, x)));
}

struct ggml_tensor * dfl_moe_ffn(struct ggml_context * ctx, struct ggml_tensor * x, const dfl_moe_weights * w) {
    struct ggml_tensor * logits = ggml_mul_mat(ctx, w->router, x);
    return dfl_moe_ffn_routed(ctx, x, w->router_b ? ggml_add(ctx, logits, w->router_b) : logits, w);
}

/* the chosen experts' projection of x [E, 1 or k, n], plus each expert's bias when given */
static struct ggml_tensor * expert_mul_mat(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * bias,
                                           struct ggml_tensor * x, struct ggml_tensor * chosen) {
    struct ggml_tensor * y = ggml_mul_mat_id(ctx, w, x, chosen);
    return bias ? ggml_add_id(ctx, y, bias, chosen) : y;
}

struct ggml_tensor * dfl_moe_ffn_routed(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * logits,
                                        const dfl_moe_weights * w) {
    const int64_t E = x->ne[0], n = x->ne[1], k = w->n_used;
    struct ggml_tensor * probs = ggml_soft_max(ctx, logits); /* [n_expert, n] */
    struct ggml_tensor * chosen = ggml_top_k(ctx, probs, (int) k);                   /* [k, n] */
    struct ggml_tensor * weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, w->n_expert, n), chosen);
    weights = ggml_reshape_2d(ctx, weights, k, n);
    weights = ggml_div(ctx, weights, ggml_sum_rows(ctx, weights)); /* renormalised over the chosen */
    if (w->expert_scale) {
        struct ggml_tensor * scale = ggml_get_rows(ctx, ggml_reshape_2d(ctx, w->expert_scale, 1, w->n_expert),
                                                   ggml_reshape_1d(ctx, chosen, k * n)); /* [1, k n] */
        weights = ggml_mul(ctx, weights, ggml_reshape_2d(ctx, scale, k, n));
    }
    weights = ggml_reshape_3d(ctx, weights, 1, k, n);

    struct ggml_tensor * xr = ggml_reshape_3d(ctx, x, E, 1, n);
    struct ggml_tensor * gate, * up;
    if (w->gate_up) {
        struct ggml_tensor * gu = ggml_mul_mat_id(ctx, w->gate_up, xr, chosen); /* [2 n_ff, k, n] */
        const int64_t F = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, F, k, n, gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, F, k, n, gu->nb[1], gu->nb[2], (size_t) F * ggml_element_size(gu));
    } else {
        gate = expert_mul_mat(ctx, w->gate, w->gate_b, xr, chosen);
        up = expert_mul_mat(ctx, w->up, w->up_b, xr, chosen);
    }
    struct ggml_tensor * h = w->swiglu_limit > 0.0f ? ggml_swiglu_oai(ctx, gate, up, w->swiglu_alpha, w->swiglu_limit)
                           : w->gelu ? ggml_mul(ctx, dfl_gelu_tanh(ctx, gate), up)
                           : ggml_swiglu_split(ctx, gate, up);
    struct ggml_tensor * out = expert_mul_mat(ctx, w->down, w->down_b, h, chosen); /* [E, k, n] */
    out = ggml_mul(ctx, out, weights);
    struct ggml_tensor * sum = ggml_view_2d(ctx, out, E, n, out->nb[2], 0);
    for (int64_t i = 1; i < k; i++) {
        sum = ggml_add(ctx, sum, ggml_view_2d(ctx, out, E, n, out->nb[2], (size_t) i * out->nb[1]));
    }
    return sum;
}
