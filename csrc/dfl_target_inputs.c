/* A target graph's inputs for a step: the tokens and positions, each segment's mask
 * (ancestor-only for a tree, cut to a window's ring), the tree rows and the logits'
 * rows, written with the backend's tensor copies. */
#include "dfl_graph_build.h"

#include <math.h>
#include <string.h>

/* Tokens (unless they come from a device tensor), positions (n_past + depth; a chain's
 * depth is its index) and cache rows (of position n_past + index) of every row. */
static void set_token_inputs(dfl_target * t, const graph_inputs * in, const dfl_step * step,
                             const int32_t * const * tokens) {
    const dfl_memory * mem = &t->mem;
    int32_t * pos = t->host_i32;
    int64_t * slots = t->host_i64;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
        for (int j = 0; j < s->n; j++) {
            pos[s->row0 + j] = s->n_past + (depth ? depth[j] : j);
        }
        if (in->tokens) {
            dfl_runtime_set(&t->rt, in->tokens, tokens[i], (size_t) s->row0 * sizeof(int32_t),
                            (size_t) s->n * sizeof(int32_t));
        } else if (in->seg[i].tokens) {
            dfl_runtime_set(&t->rt, in->seg[i].tokens, tokens[i], 0, (size_t) s->n * sizeof(int32_t));
        }
    }
    dfl_runtime_set(&t->rt, in->pos, pos, 0, (size_t) step->n_rows * sizeof(int32_t));
    for (int ring = 0; ring < 2; ring++) {
        struct ggml_tensor * dst = ring ? in->slots_swa : in->slots;
        if (!dst) {
            continue;
        }
        const int R = ring ? mem->swa_ring : mem->n_ctx;
        for (int i = 0; i < step->n_seg; i++) {
            const dfl_segment * s = &step->seg[i];
            const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
            for (int j = 0; j < s->n; j++) {
                slots[s->row0 + j] = (int64_t) s->seq * (R + mem->spare) +
                                     ring_slot(s->n_past, j, depth ? depth[j] : j, R);
            }
        }
        dfl_runtime_set(&t->rt, dst, slots, 0, (size_t) step->n_rows * sizeof(int64_t));
    }
    if (in->feat_rows) {
        for (int i = 0; i < step->n_seg; i++) {
            const dfl_segment * s = &step->seg[i];
            for (int j = 0; j < s->n; j++) {
                slots[s->row0 + j] = dfl_memory_features_region(mem, s->seq, s->n) + s->feat_at + j;
            }
        }
        dfl_runtime_set(&t->rt, in->feat_rows, slots, 0, (size_t) step->n_rows * sizeof(int64_t));
    }
}

/* Causal for a chain; a tree node sees the context and its ancestors. In a sliding
 * layer's ring of R rows (and its spare rows after it), the call's rows are where
 * ring_slot puts them; any other ring row j holds position j - p mod R + p - R (none when
 * negative), a spare row nothing; the mask hides, in addition, keys `window` or more
 * positions behind the row's own (a node's position is p + depth). */
static void fill_mask(dfl_target * t, const dfl_segment * s, struct ggml_tensor * dst, int window, int ring) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t minf = ggml_fp32_to_fp16(-INFINITY);
    const int32_t * depth = s->kind == DFL_STEP_TREE ? s->tree->depth : NULL;
    const uint64_t * ancestors = depth ? s->tree->ancestors : NULL;
    const int p = s->n_past, n = s->n, n_kv = (int) dst->ne[0], base = p % ring;
    for (int i = 0; i < n; i++) {
        ggml_fp16_t * row = t->host_mask + (size_t) i * n_kv;
        const int pos_i = p + (depth ? depth[i] : i);
        for (int j = 0; j < n_kv; j++) {
            const int node = ring_row(base, j, depth, n, ring);
            bool visible;
            int pos_j;
            if (node >= 0) {
                visible = depth ? (ancestors[i] >> node & 1) != 0 : node <= i;
                pos_j = p + (depth ? depth[node] : node);
            } else {
                pos_j = p + ((j - p) % ring + ring) % ring - ring;
                visible = j < ring && pos_j >= 0;
            }
            if (visible && window > 0) {
                visible = pos_i - pos_j < window;
            }
            row[j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&t->rt, dst, t->host_mask, 0, (size_t) n * n_kv * sizeof(ggml_fp16_t));
}

static void set_tree_rows(dfl_target * t, const dfl_segment * s, const seg_inputs * in) {
    const tree_plan * tp = s->tree;
    const tree_shape sh = tp->shape;
    const int n = s->n;
    dfl_runtime_set(&t->rt, in->tree_steps, tp->steps, 0, (size_t) tree_steps(&sh) * sizeof(int32_t));
    if (in->branch_from) {
        dfl_runtime_set(&t->rt, in->branch_from, tp->branch_from, 0,
                        (size_t) (tree_branches(&sh)) * sizeof(int32_t));
    }
    dfl_runtime_set(&t->rt, in->out_rows, tp->out_rows, 0, (size_t) (n + tree_spare_rows(&sh)) * sizeof(int32_t));
    if (in->scatter) {
        dfl_runtime_set(&t->rt, in->scatter, tp->scatter, 0,
                        (size_t) (tree_steps(&sh) - tree_head_rows(&sh)) * sizeof(int32_t));
    }
    dfl_runtime_set(&t->rt, in->conv_rows, tp->conv_rows, 0,
                    (size_t) tree_conv_rows(&sh, n, t->m.rec.d_conv) * sizeof(int32_t));
    if (in->conv_out) {
        dfl_runtime_set(&t->rt, in->conv_out, tp->conv_out, 0, (size_t) (n + sh.off) * sizeof(int32_t));
    }
    if (in->conv_scatter) {
        dfl_runtime_set(&t->rt, in->conv_scatter, tp->conv_scatter, 0, (size_t) sh.off * sizeof(int32_t));
    }
}

/* Which rows have logits: each segment's last, or all of its rows. */
static void set_logits_rows(dfl_target * t, const graph_inputs * in, const dfl_step * step) {
    int32_t * idx = t->host_i32;
    int k = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        if (s->logits == LOGITS_LAST) {
            idx[k++] = s->row0 + s->n - 1;
        } else if (s->logits == LOGITS_ALL) {
            for (int j = 0; j < s->n; j++) {
                idx[k++] = s->row0 + j;
            }
        }
    }
    dfl_runtime_set(&t->rt, in->out_idx, idx, 0, (size_t) k * sizeof(int32_t));
}

void dfl_target_fill_inputs(dfl_target * t, const graph_inputs * in, const dfl_step * step,
                            const int32_t * const * tokens) {
    for (int i = 0; i < step->n_seg; i++) {
        if (step->seg[i].commit) {
            dfl_target_fill_commit_inputs(t, &step->seg[i], &in->seg[i]);
        }
    }
    set_token_inputs(t, in, step, tokens);
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        fill_mask(t, s, in->seg[i].mask, 0, t->mem.n_ctx);
        if (in->seg[i].mask_swa) {
            fill_mask(t, s, in->seg[i].mask_swa, t->mem.swa_window, t->mem.swa_ring);
        }
        if (in->seg[i].conv_rows) {
            set_tree_rows(t, s, &in->seg[i]);
        }
    }
    if (in->out_idx) {
        set_logits_rows(t, in, step);
    }
}
