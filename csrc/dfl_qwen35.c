#include "dfl_qwen35.h"
#include "dfl_pair.h"

#include <stdio.h>
#include <string.h>

#define TRY(x) do { dfl_status s_ = (x); if (s_ != DFL_OK) return s_; } while (0)

static dfl_status req_u32(const dfl_gguf * g, const char * key, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(g, key, true, 0, &v));
    if (v == 0 || v > (1u << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", g->path, g->arch, key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

/* An optional key with a default, bounded (values past `max` are corrupt, not large). */
static dfl_status opt_u32(const dfl_gguf * g, const char * key, uint32_t def, uint32_t max, int * out) {
    uint32_t v;
    TRY(dfl_gguf_u32(g, key, false, def, &v));
    if (v > max) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key '%s%s' has an invalid value %u", g->path, g->arch, key, v);
    }
    *out = (int) v;
    return DFL_OK;
}

static dfl_status tensor(const dfl_gguf * g, const char * name, int il, int64_t ne0, int64_t ne1, bool required,
                         struct ggml_tensor ** out) {
    char full[128];
    if (il >= 0) {
        snprintf(full, sizeof full, "blk.%d.%s", il, name);
    } else {
        snprintf(full, sizeof full, "%s", name);
    }
    const int64_t ne[2] = { ne0, ne1 };
    return dfl_gguf_tensor(g, full, ne1 > 0 ? 2 : 1, ne, required, out);
}

static dfl_status read_hparams(dfl_qwen35 * m) {
    const dfl_gguf * g = &m->file;
    int block_count = 0, n_nextn = 0, v_dim = 0;

    TRY(req_u32(g, ".embedding_length", &m->n_embd));
    TRY(req_u32(g, ".block_count", &block_count));
    TRY(opt_u32(g, ".nextn_predict_layers", 0, DFL_MAX_LAYERS, &n_nextn));
    m->n_layer = block_count - n_nextn;
    if (m->n_layer <= 0 || m->n_layer > DFL_MAX_LAYERS) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported layer count %d", g->path, m->n_layer);
    }
    TRY(req_u32(g, ".feed_forward_length", &m->n_ff));
    TRY(req_u32(g, ".attention.head_count", &m->n_head));
    TRY(req_u32(g, ".attention.head_count_kv", &m->n_head_kv));
    TRY(opt_u32(g, ".context_length", 0, 1u << 30, &m->n_ctx_train));
    TRY(opt_u32(g, ".attention.key_length", (uint32_t) (m->n_embd / m->n_head), 1u << 16, &m->head_dim));
    TRY(opt_u32(g, ".attention.value_length", (uint32_t) m->head_dim, 1u << 16, &v_dim));
    if (v_dim != m->head_dim) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': key and value head sizes differ (%d vs %d)", g->path, m->head_dim, v_dim);
    }
    TRY(opt_u32(g, ".rope.dimension_count", (uint32_t) m->head_dim, 1u << 16, &m->n_rot));
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", true, 0.0f, &m->eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &m->rope_base));
    if (m->eps < 0.0f || m->rope_base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", g->path, (double) m->eps,
                        (double) m->rope_base);
    }

    TRY(req_u32(g, ".ssm.conv_kernel", &m->d_conv));
    TRY(req_u32(g, ".ssm.inner_size", &m->d_inner));
    TRY(req_u32(g, ".ssm.state_size", &m->head_k_dim));
    TRY(req_u32(g, ".ssm.time_step_rank", &m->n_v_heads));
    TRY(req_u32(g, ".ssm.group_count", &m->n_k_heads));

    if (m->n_head % m->n_head_kv != 0 || m->head_dim == 0 || m->n_rot > m->head_dim || m->n_rot % 2 != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent attention shape (heads %d, kv heads %d, rope dims %d, head size %d)",
                        g->path, m->n_head, m->n_head_kv, m->n_rot, m->head_dim);
    }
    if (m->d_inner % m->n_v_heads != 0 || m->n_v_heads % m->n_k_heads != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': inconsistent linear-attention shape (inner %d, value heads %d, key heads %d)",
                        g->path, m->d_inner, m->n_v_heads, m->n_k_heads);
    }
    m->head_v_dim = m->d_inner / m->n_v_heads;
    if (m->head_v_dim != m->head_k_dim) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': linear-attention key and value head sizes differ (%d vs %d)",
                        g->path, m->head_k_dim, m->head_v_dim);
    }
    if (m->d_conv < 2 || m->d_conv > 16) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': unsupported convolution kernel size %d (2..16)", g->path, m->d_conv);
    }
    m->conv_channels = m->d_inner + 2 * m->n_k_heads * m->head_k_dim;

    bool recurrent[DFL_MAX_LAYERS];
    if (dfl_gguf_has(g, ".attention.recurrent_layers")) {
        TRY(dfl_gguf_arr_bool(g, ".attention.recurrent_layers", recurrent, m->n_layer));
    } else {
        uint32_t interval;
        TRY(dfl_gguf_u32(g, ".full_attention_interval", false, 4, &interval));
        if (interval == 0) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': full_attention_interval is 0", g->path);
        }
        for (int il = 0; il < m->n_layer; il++) {
            recurrent[il] = (il + 1) % interval != 0;
        }
    }
    for (int il = 0; il < m->n_layer; il++) {
        m->layers[il].recurrent = recurrent[il];
        if (recurrent[il]) {
            m->n_recurrent_layers++;
        } else {
            m->n_attn_layers++;
        }
    }
    if (m->n_attn_layers == 0) {
        /* a hybrid has full-attention layers; the runtime's graphs assume at least one */
        return dfl_fail(DFL_ERR_FORMAT, "'%s': none of its %d layers is a full-attention layer (block_count, "
                        "recurrent_layers or full_attention_interval is wrong)", g->path, m->n_layer);
    }
    return DFL_OK;
}

static dfl_status read_tensors(dfl_qwen35 * m) {
    const dfl_gguf * g = &m->file;
    const int64_t E = m->n_embd;

    TRY(dfl_gguf_tensor(g, "token_embd.weight", 2, (int64_t[]) { E, 0 }, true, &m->tok_embd));
    if (m->tok_embd->ne[1] < 1 || m->tok_embd->ne[1] > (1 << 30)) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': token embedding has %lld rows", g->path, (long long) m->tok_embd->ne[1]);
    }
    m->n_vocab = (int) m->tok_embd->ne[1];
    TRY(tensor(g, "output_norm.weight", -1, E, 0, true, &m->output_norm));
    TRY(tensor(g, "output.weight", -1, E, m->n_vocab, false, &m->output));
    if (!m->output) {
        m->output = m->tok_embd;
    }

    const int64_t q_dim = (int64_t) m->head_dim * m->n_head;
    const int64_t kv_dim = (int64_t) m->head_dim * m->n_head_kv;
    for (int il = 0; il < m->n_layer; il++) {
        dfl_qwen35_layer * L = &m->layers[il];
        TRY(tensor(g, "attn_norm.weight", il, E, 0, true, &L->attn_norm));
        TRY(tensor(g, "post_attention_norm.weight", il, E, 0, true, &L->post_norm));
        if (L->recurrent) {
            TRY(tensor(g, "attn_qkv.weight", il, E, m->conv_channels, true, &L->wqkv));
            TRY(tensor(g, "attn_gate.weight", il, E, m->d_inner, true, &L->wz));
            TRY(tensor(g, "ssm_conv1d.weight", il, m->d_conv, m->conv_channels, true, &L->conv1d));
            TRY(tensor(g, "ssm_dt.bias", il, m->n_v_heads, 0, true, &L->dt_bias));
            TRY(tensor(g, "ssm_a", il, m->n_v_heads, 0, true, &L->ssm_a));
            TRY(tensor(g, "ssm_beta.weight", il, E, m->n_v_heads, true, &L->w_beta));
            TRY(tensor(g, "ssm_alpha.weight", il, E, m->n_v_heads, true, &L->w_alpha));
            TRY(tensor(g, "ssm_norm.weight", il, m->head_v_dim, 0, true, &L->ssm_norm));
            TRY(tensor(g, "ssm_out.weight", il, m->d_inner, E, true, &L->ssm_out));
            if (L->conv1d->type != GGML_TYPE_F32 || L->ssm_a->type != GGML_TYPE_F32 || L->dt_bias->type != GGML_TYPE_F32) {
                return dfl_fail(DFL_ERR_FORMAT, "'%s': layer %d convolution/decay tensors must be f32", g->path, il);
            }
        } else {
            TRY(tensor(g, "attn_q.weight", il, E, 2 * q_dim, true, &L->wq));
            TRY(tensor(g, "attn_k.weight", il, E, kv_dim, true, &L->wk));
            TRY(tensor(g, "attn_v.weight", il, E, kv_dim, true, &L->wv));
            TRY(tensor(g, "attn_output.weight", il, q_dim, E, true, &L->wo));
            TRY(tensor(g, "attn_q_norm.weight", il, m->head_dim, 0, true, &L->q_norm));
            TRY(tensor(g, "attn_k_norm.weight", il, m->head_dim, 0, true, &L->k_norm));
        }
        TRY(tensor(g, "ffn_gate.weight", il, E, m->n_ff, true, &L->ffn_gate));
        TRY(tensor(g, "ffn_up.weight", il, E, m->n_ff, true, &L->ffn_up));
        TRY(tensor(g, "ffn_down.weight", il, m->n_ff, E, true, &L->ffn_down));
    }
    return DFL_OK;
}

dfl_status dfl_qwen35_open(const char * path, dfl_qwen35 * m) {
    memset(m, 0, sizeof *m);
    TRY(dfl_gguf_open(path, &m->file));
    dfl_status st = DFL_OK;
    if (strcmp(m->file.arch, "qwen35") != 0) {
        st = dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%s'; a target model must be 'qwen35' (Qwen3.5)",
                      path, m->file.arch);
    }
    if (st == DFL_OK) {
        st = read_hparams(m);
    }
    if (st == DFL_OK) {
        st = read_tensors(m);
    }
    if (st == DFL_OK) {
        st = dfl_vocab_check(&m->file, m->n_vocab); /* before llama.cpp reads the vocabulary */
    }
    if (st != DFL_OK) {
        dfl_gguf_close(&m->file);
    }
    return st;
}
