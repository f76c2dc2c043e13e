/* Target graphs: the layer loop over the architecture's builders, the pending commits
 * carried at the start of a graph, the features captured and the logits' rows. The
 * services the builders call are dfl_graph_services.c's, the inputs dfl_target_inputs.c's.
 *
 * A graph is a function of the model, the memory and the step's descriptor (dfl_step):
 * nothing here writes to the target. The rows of every segment (sequence) of a step go
 * through the weights together; attention, the short convolution and the delta rule
 * run per segment, each on its own sequence's cache and states, so that a sequence's
 * rows see exactly what they would see alone. */
#include "dfl_graph_build.h"

#include <math.h>
#include <string.h>

/* ---- the pending commits ---------------------------------------------------------------- */

/* A sequence's commit is carried out at the start of the next graph it is in, so a
 * decoding step costs one target graph. Attention: after a tree, the accepted path's
 * rows move to consecutive cells (a chain's are already in place). Recurrent layers: the
 * conv state becomes the inputs before the next token, and the recurrent state that of
 * the last kept row, by rerunning the recurrence from the committed state over the
 * verify's rows gathered in path order (a chain's in order), the rows after the kept
 * ones made identity steps (decay exp(0) = 1, update weight 0: the state passes through
 * unchanged, bit for bit). Which rows, columns and tokens is an input, so the graph's
 * shape does not depend on the accepted length and consecutive steps reuse it. Cache
 * rows move through a gather and a scatter: every read happens before any write, and
 * the round trip through f32 is exact for every cache type (quantized rows requantize
 * to the same bytes). */
static void add_pending_commit(const dfl_target * t, const dfl_segment * seg, struct ggml_context * ctx,
                               struct ggml_cgraph * gf, seg_inputs * in) {
    in->commit_rows = in->commit_keep = in->commit_conv_cols = in->commit_kv_src = in->commit_kv_dst = NULL;
    in->commit_kv_src_swa = in->commit_kv_dst_swa = NULL;
    if (!seg->commit_kind) {
        return;
    }
    const dfl_model * m = &t->m;
    const dfl_memory * mem = &t->mem;
    const bool tree = seg->commit_kind == 2;
    if (tree && m->n_attention > 0) {
        in->commit_kv_src = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
        in->commit_kv_dst = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
        ggml_set_input(in->commit_kv_src);
        ggml_set_input(in->commit_kv_dst);
        if (mem->swa_window > 0) {
            in->commit_kv_src_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, t->p.n_verify);
            in->commit_kv_dst_swa = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, t->p.n_verify);
            ggml_set_input(in->commit_kv_src_swa);
            ggml_set_input(in->commit_kv_dst_swa);
        }
    }
    const int R = seg->commit_replay;
    if (m->n_recurrent > 0) {
        if (tree) {
            in->commit_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, R, 2); /* twice: see below */
            ggml_set_input(in->commit_rows);
        } else {
            in->commit_keep = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, R, 1);
            ggml_set_input(in->commit_keep);
        }
        in->commit_conv_cols = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, m->rec.d_conv - 1);
        ggml_set_input(in->commit_conv_cols);
    }
    const int64_t hk = m->rec.head_k_dim, hv = m->rec.head_v_dim, Hk = m->rec.n_k_heads, Hv = m->rec.n_v_heads;
    const int64_t C = m->rec.conv_channels, QK = 2 * hk * Hk;
    const size_t f32 = sizeof(float);
    const replay_planes P = dfl_replay_planes(&m->rec, t->p.n_verify);
    for (int il = 0; il < m->n_layer; il++) {
        if (m->kind[il] == DFL_LAYER_ATTENTION) {
            if (tree && !m->attn[il].shares_kv) {
                const bool ring = m->attn[il].window > 0;
                struct ggml_tensor * src = ring ? in->commit_kv_src_swa : in->commit_kv_src;
                struct ggml_tensor * dst = ring ? in->commit_kv_dst_swa : in->commit_kv_dst;
                struct ggml_tensor * caches[2] = { mem->k[il], mem->v[il] };
                for (int c = 0; c < 2; c++) {
                    struct ggml_tensor * rows = ggml_get_rows(ctx, caches[c], src);
                    ggml_build_forward_expand(gf, ggml_set_rows(ctx, caches[c], rows, dst));
                }
            }
            continue;
        }
        const size_t at = dfl_memory_slice_offset(mem, mem->replay[il], seg->seq);
        struct ggml_tensor * rp = mem->replay[il];
        struct ggml_tensor * q, * k, * v, * g, * b;
        if (tree) {
            /* the path's columns of every plane, in path order; identity steps take the
             * zero column (decay 0, update weight 0). The decay and update weight planes,
             * of one width, in one gather: its index holds the columns once per plane. */
            struct ggml_tensor * cols = ggml_view_1d(ctx, in->commit_rows, R, 0);
            struct ggml_tensor * planes[2];
            const int64_t first[2] = { P.conv, P.qk }, rows[2] = { C, QK };
            for (int i = 0; i < 2; i++) {
                struct ggml_tensor * plane = ggml_view_2d(ctx, rp, rows[i], P.cols, rows[i] * f32,
                                                          at + (size_t) first[i] * f32);
                planes[i] = ggml_get_rows(ctx, plane, cols);
            }
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, P.cols, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   at + (size_t) P.g * f32);
            gb = ggml_get_rows(ctx, gb, in->commit_rows); /* [Hv, R, 2] */
            v = ggml_view_4d(ctx, planes[0], hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, (size_t) QK * f32);
            q = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, 0);
            k = ggml_view_4d(ctx, planes[1], hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, hk * Hk * f32);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        } else {
            /* a chain's rows are in order already; the decay and update weight of every row
             * times keep, in one product: [Hv, R] decays, then [Hv, R] weights */
            v = ggml_view_4d(ctx, rp, hv, Hv, R, 1, hv * f32, C * f32, C * R * f32, at + (size_t) (P.conv + QK) * f32);
            q = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32, at + (size_t) P.qk * f32);
            k = ggml_view_4d(ctx, rp, hk, Hk, R, 1, hk * f32, QK * f32, QK * R * f32,
                             at + (size_t) (P.qk + hk * Hk) * f32);
            struct ggml_tensor * gb = ggml_view_3d(ctx, rp, Hv, R, 2, Hv * f32, (size_t) (P.beta - P.g) * f32,
                                                   at + (size_t) P.g * f32);
            gb = ggml_mul(ctx, gb, in->commit_keep);
            g = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, 0);
            b = ggml_view_4d(ctx, gb, 1, Hv, R, 1, f32, Hv * f32, Hv * R * f32, Hv * R * f32);
        }
        struct ggml_tensor * ssm = dfl_memory_slice(ctx, &t->mem, mem->ssm[il], seg->seq);
        struct ggml_tensor * s0 = ggml_reshape_4d(ctx, ssm, hv, hv, Hv, 1);
        struct ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, v, g, b, s0, 1);
        struct ggml_tensor * state = ggml_view_2d(ctx, r, hv * hv * Hv, 1, hv * hv * Hv * f32, hv * Hv * R * f32);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, state, ggml_reshape_2d(ctx, ssm, hv * hv * Hv, 1)));
        struct ggml_tensor * scratch = dfl_memory_slice(ctx, &t->mem, mem->conv_scratch[il], seg->seq);
        struct ggml_tensor * cols = ggml_get_rows(ctx, scratch, in->commit_conv_cols); /* [C, W] */
        struct ggml_tensor * conv = dfl_memory_slice(ctx, mem, mem->conv[il], seg->seq);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, cols), conv));
    }
}

void dfl_target_fill_commit_inputs(dfl_target * t, const dfl_segment * seg, const seg_inputs * in) {
    const pending_commit * pc = seg->commit;
    const dfl_memory * mem = &t->mem;
    if (in->commit_kv_src) {
        const int M = t->p.n_verify;
        int32_t * src = t->host_i32;
        int64_t * dst = t->host_i64;
        /* unused entries copy position p0 onto itself (path[0] is always the root, already in place) */
        for (int ring = 0; ring < 2; ring++) {
            struct ggml_tensor * src_in = ring ? in->commit_kv_src_swa : in->commit_kv_src;
            struct ggml_tensor * dst_in = ring ? in->commit_kv_dst_swa : in->commit_kv_dst;
            if (!src_in) {
                continue;
            }
            const int R = ring ? mem->swa_ring : mem->n_ctx;
            const int64_t base = (int64_t) seg->seq * (R + mem->spare);
            for (int k = 0; k < M; k++) { /* the path's node k is at depth k */
                src[k] = (int32_t) (base + (k < pc->n_keep ? ring_slot(pc->p0, pc->path[k], k, R) : pc->p0 % R));
                dst[k] = base + (pc->p0 + (k < pc->n_keep ? k : 0)) % R;
            }
            dfl_runtime_set(&t->rt, src_in, src, 0, (size_t) M * sizeof(int32_t));
            dfl_runtime_set(&t->rt, dst_in, dst, 0, (size_t) M * sizeof(int64_t));
        }
    }
    if (in->commit_keep) {
        float keep[DFL_MAX_VERIFY];
        for (int k = 0; k < pc->n_replay; k++) {
            keep[k] = k < pc->n_keep ? 1.0f : 0.0f;
        }
        dfl_runtime_set(&t->rt, in->commit_keep, keep, 0, (size_t) pc->n_replay * sizeof(float));
    }
    if (in->commit_rows) {
        int32_t rows[2 * DFL_MAX_VERIFY];
        const int R = pc->n_replay;
        for (int k = 0; k < R; k++) {
            rows[k] = rows[R + k] = k < pc->n_keep ? pc->path[k] : t->p.n_verify; /* identity steps: the zero column */
        }
        dfl_runtime_set(&t->rt, in->commit_rows, rows, 0, (size_t) 2 * R * sizeof(int32_t));
    }
    if (in->commit_conv_cols) {
        dfl_runtime_set(&t->rt, in->commit_conv_cols, pc->conv_cols, 0, (size_t) (t->m.rec.d_conv - 1) * sizeof(int32_t));
    }
}

/* ---- the graph --------------------------------------------------------------------- */

/* The hidden states x [n_embd, step rows] entering `layer`, where feature layers are
 * captured: each row into its slot's feature rows (in->feat_rows: where each segment's
 * rows go, dfl_memory_features_at), which stay until that slot's next call (other
 * sequences' graphs do not touch them). */
static void capture_features(const dfl_target * t, const graph_inputs * in, struct ggml_context * ctx,
                             struct ggml_cgraph * gf, struct ggml_tensor * x, int layer) {
    struct ggml_tensor * features = t->mem.features;
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] != layer) {
            continue;
        }
        struct ggml_tensor * dst = ggml_view_2d(ctx, features, t->m.n_embd, features->ne[1], features->nb[1],
                                                (size_t) f * t->m.n_embd * sizeof(float));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, dst, x, in->feat_rows));
    }
}

static struct ggml_tensor * new_input(struct ggml_context * ctx, enum ggml_type type, int64_t n) {
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, type, n);
    ggml_set_input(x);
    return x;
}

/* A segment's masks and tree tables. */
static void add_segment_inputs(const dfl_target * t, const dfl_segment * seg, struct ggml_context * ctx,
                               seg_inputs * in) {
    const dfl_model * m = &t->m;
    const int n = seg->n;
    in->mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, seg->n_kv, n);
    ggml_set_input(in->mask);
    in->mask_swa = NULL;
    if (t->mem.swa_window > 0) {
        in->mask_swa = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, attended_rows(&t->mem, seg, t->mem.swa_ring), n);
        ggml_set_input(in->mask_swa);
    }
    in->conv_rows = in->tree_steps = in->branch_from = in->out_rows = in->scatter = in->conv_out = NULL;
    in->conv_scatter = NULL;
    if (seg->kind == DFL_STEP_TREE && m->n_recurrent > 0) {
        const tree_shape sh = seg->shape;
        const int n_branches = tree_branches(&sh);
        in->conv_rows = new_input(ctx, GGML_TYPE_I32, tree_conv_rows(&sh, n, m->rec.d_conv));
        in->tree_steps = new_input(ctx, GGML_TYPE_I32, tree_steps(&sh));
        in->branch_from = n_branches > 0 ? new_input(ctx, GGML_TYPE_I32, n_branches) : NULL;
        in->out_rows = new_input(ctx, GGML_TYPE_I32, n + tree_spare_rows(&sh));
        in->scatter = n_branches > 0 ? new_input(ctx, GGML_TYPE_I32, tree_steps(&sh) - tree_head_rows(&sh)) : NULL;
        if (tree_conv_spine(&sh, n, m->rec.d_conv)) {
            in->conv_out = new_input(ctx, GGML_TYPE_I32, n + sh.off);
            in->conv_scatter = sh.off > 0 ? new_input(ctx, GGML_TYPE_I32, sh.off) : NULL;
        }
    }
}

/* The step's token embeddings: one lookup over a host input when every segment's tokens
 * come from the host, else a lookup per segment joined. */
static struct ggml_tensor * embed(const dfl_target * t, const dfl_step * step, struct ggml_context * ctx,
                                  graph_inputs * in) {
    bool host = true;
    for (int i = 0; i < step->n_seg; i++) {
        host = host && !step->seg[i].tokens_src;
        in->seg[i].tokens = NULL;
    }
    in->tokens = NULL;
    if (host) {
        in->tokens = new_input(ctx, GGML_TYPE_I32, step->n_rows);
        return ggml_get_rows(ctx, t->tok_lookup, in->tokens);
    }
    struct ggml_tensor * x = NULL;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        struct ggml_tensor * tokens;
        if (s->tokens_src) {
            tokens = ggml_view_1d(ctx, s->tokens_src, s->n, 0);
        } else {
            tokens = in->seg[i].tokens = new_input(ctx, GGML_TYPE_I32, s->n);
        }
        x = join(ctx, x, ggml_get_rows(ctx, t->tok_lookup, tokens), 1);
    }
    return x;
}

/* The rows with logits: every row, one segment's last (also where none has logits: the
 * row a cut keeps), or gathered by an input. */
static struct ggml_tensor * logits_rows(const dfl_step * step, struct ggml_context * ctx, graph_inputs * in,
                                        struct ggml_tensor * x) {
    in->out_idx = NULL;
    if (step->n_out == step->n_rows) {
        return x;
    }
    if (step->n_seg == 1) { /* its last row */
        return ggml_view_2d(ctx, x, x->ne[0], 1, x->nb[1], (size_t) (step->n_rows - 1) * x->nb[1]);
    }
    in->out_idx = new_input(ctx, GGML_TYPE_I32, step->n_out);
    return ggml_get_rows(ctx, x, in->out_idx);
}

/* Whether a feature layer is n_layer: the final-normed state of every row, for a drafter. */
static bool captures_final_state(const dfl_target * t) {
    for (int f = 0; f < t->p.n_feature_layers; f++) {
        if (t->p.feature_layers[f] == t->m.n_layer) {
            return true;
        }
    }
    return false;
}

struct ggml_tensor * dfl_graph_ffn_rows(dfl_graph * g, int il, struct ggml_tensor * x) {
    graph_build * b = g->runtime;
    const dfl_step * step = b->step;
    if (il != b->t->m.n_layer - 1 || step->n_out == step->n_rows || (step->n_out == 0 && step->n_seg > 1) ||
        captures_final_state(b->t)) {
        return x;
    }
    if (b->cut && b->in->out_idx) { /* a second tensor of the layer: the same rows */
        return ggml_get_rows(g->ctx, x, b->in->out_idx);
    }
    b->cut = true;
    return logits_rows(step, g->ctx, b->in, x);
}

struct ggml_cgraph * dfl_target_build_graph(const dfl_target * t, const dfl_step * step, struct ggml_context * ctx,
                                            graph_inputs * in) {
    const dfl_model * m = &t->m;
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, t->rt.graph_size, false);
    for (int i = 0; i < step->n_seg; i++) {
        add_pending_commit(t, &step->seg[i], ctx, gf, &in->seg[i]);
    }

    const int n = step->n_rows;
    struct ggml_tensor * x = dfl_cb(embed(t, step, ctx, in), "inp_embd", -1);
    in->pos = new_input(ctx, GGML_TYPE_I32, n);
    in->slots = new_input(ctx, GGML_TYPE_I64, n);
    in->slots_swa = t->mem.swa_window > 0 ? new_input(ctx, GGML_TYPE_I64, n) : NULL;
    in->feat_rows = t->mem.features ? new_input(ctx, GGML_TYPE_I64, n) : NULL;
    for (int i = 0; i < step->n_seg; i++) {
        add_segment_inputs(t, &step->seg[i], ctx, &in->seg[i]);
    }

    in->out_idx = NULL;
    graph_build b = { t, step, in, { NULL }, { NULL }, false };
    dfl_graph g = { ctx, gf, n, in->pos, &b };
    if (m->embd_scale != 1.0f) {
        x = dfl_cb(ggml_scale(ctx, x, m->embd_scale), "inp_scaled", -1);  /* Gemma's name for it */
    }
    for (int il = 0; il < m->n_layer; il++) {
        capture_features(t, in, ctx, gf, x, il);
        x = m->arch->build_layer(m, &g, il, x);
    }
    /* layer n_layer is the final-normed state, as transformers' last hidden_states entry
     * (what z-lab's drafters read for the last target layer) */
    const bool normed = captures_final_state(t);
    if (normed) {
        x = dfl_cb(dfl_rms_norm(ctx, x, m->output_norm, m->eps), "result_norm", -1);
        capture_features(t, in, ctx, gf, x, m->n_layer);
    }

    in->logits = NULL;
    memset(&in->samp, 0, sizeof in->samp);
    if (step->n_out > 0) {
        if (!b.cut) {
            x = logits_rows(step, ctx, in, x);
        }
        if (!normed) {
            x = dfl_cb(dfl_rms_norm(ctx, x, m->output_norm, m->eps), "result_norm", -1);
        }
        struct ggml_tensor * out = dfl_gguf_mul_mat(&m->file, ctx, t->head, x); /* n_head wide */
        if (m->logit_softcap > 0.0f) {
            out = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, out, 1.0f / m->logit_softcap)), m->logit_softcap);
        }
        in->logits = dfl_cb(out, "result_output", -1);
        ggml_set_output(out);
        dfl_sampler_build(ctx, gf, out, &step->samp, &in->samp);
    }
    ggml_build_forward_expand(gf, x);
    return gf;
}
