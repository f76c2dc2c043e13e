/* How a step's rows choose, and what is read of them: each sequence's sampling
 * settings and staged inputs (uniforms, penalties, masks), the step's merged sampling
 * key and its filled inputs, and the results: logits, choices, candidates, a redraw of
 * some rows. Under masks by candidates the choices are decided here once read: a row
 * whose candidates its mask allows none of is decided again in a graph of its own,
 * beside the step's. */
#include "dfl_target_state.h"

#include <stdlib.h>
#include <string.h>

/* How the step's logits rows choose: each segment's sequence's sampling, merged (rows of
 * sequences that pick differently each pick their own way: see dfl_sampler_key). */
dfl_status dfl_target_step_sampling(dfl_target * t, dfl_step * step) {
    memset(&step->samp, 0, sizeof step->samp);
    bool first = true;
    int n_rows = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int n_out = s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if (n_out == 0) {
            continue;
        }
        dfl_sampler_key key;
        TRY(dfl_sampler_key_for(&t->sampler[s->seq], n_out, t->n_head, &key));
        if (first) {
            step->samp = key;
        } else {
            dfl_sampler_key_merge(&step->samp, &key);
        }
        first = false;
        n_rows += n_out;
    }
    /* by candidates where top-k is a partial sort: where it sorts whole rows (Vulkan), the
     * sort would cost more than masking in place */
    dfl_sampler_key_settle(&step->samp, n_rows, t->n_head, !t->rt.top_k_by_sort);
    step->samp.by_sort = t->rt.top_k_by_sort;
    return DFL_OK;
}

dfl_status dfl_target_fill_sampling(dfl_target * t, const dfl_step * step, const graph_inputs * in) {
    dfl_sampler_part parts[DFL_MAX_SEQ];
    int n = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const dfl_segment * s = &step->seg[i];
        const int n_out = s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if (n_out > 0) {
            const dfl_sampler * smp = &t->sampler[s->seq];
            t->out_part[n].seq = s->seq;
            t->out_part[n].n_rows = n_out;
            t->out_part[n].mask_gen = smp->mask_rows > 0 ? smp->mask_gen : 0;
            parts[n++] = (dfl_sampler_part) { &t->sampler[s->seq], n_out };
        }
    }
    t->n_out_parts = n;
    t->choices_decided = false;
    t->out_redone = false;
    if (n == 0) {
        return DFL_OK;
    }
    TRY(dfl_sampler_fill_parts(parts, n, &t->rt, &in->samp, &step->samp, t->n_head));
    if (step->samp.masked == DFL_MASK_CANDIDATES && step->samp.pick != DFL_PICK_ARGMAX) {
        /* the host staging of the first part's sampler holds the settings just filled */
        const int m = step->n_out * dfl_sampler_n_params();
        if (!dfl_reserve((void **) &t->out_params, &t->cap_out_params, m, sizeof(float))) {
            return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        memcpy(t->out_params, parts[0].smp->host_params, (size_t) m * sizeof(float));
    }
    return DFL_OK;
}

dfl_status dfl_target_check_rows(const dfl_target * t, int32_t row0, int32_t n_rows, int32_t have,
                                 const char * what) {
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
    TRY(dfl_target_check_rows(t, row0, n_rows, t ? t->n_out : 0, "logit"));
    const size_t row = (size_t) t->n_head * sizeof(float);
    dfl_runtime_get(&t->rt, t->out->in.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

DFL_API dfl_status dfl_target_raw_logits(const dfl_target * t, float * dst, int32_t row0, int32_t n_rows) {
    TRY(dfl_target_check_rows(t, row0, n_rows, t ? t->n_out : 0, "logit"));
    if (n_rows == 0) {
        return DFL_OK;
    }
    const dfl_sampler_graph * samp = &t->out->in.samp;
    if (samp->changes_logits && !samp->raw) {
        return dfl_fail(DFL_ERR_STATE, "the last step changed its logits (a bias, penalties or a mask) and kept no "
                                       "copy of them: set dfl_sampling.raw_logits before it");
    }
    const size_t row = (size_t) t->n_head * sizeof(float);
    dfl_runtime_get(&t->rt, samp->raw ? samp->raw : t->out->in.logits, dst, (size_t) row0 * row, (size_t) n_rows * row);
    return DFL_OK;
}

static int spare_slot(dfl_target * t);

/* The step's logits as a leaf of a new graph in `slot`, in the memory they are in
 * (through the step's own tensor the new graph would run the whole step again), the rows
 * `which` (an input, [n]) gathered from them. */
static dfl_status step_logits_rows(dfl_target * t, struct ggml_context * ctx, int n, struct ggml_tensor ** which,
                                   struct ggml_tensor ** rows) {
    const struct ggml_tensor * step_logits = t->out->in.logits;
    struct ggml_tensor * logits = ggml_new_tensor_2d(ctx, step_logits->type, step_logits->ne[0], step_logits->ne[1]);
    if (ggml_backend_tensor_alloc(step_logits->buffer, logits, step_logits->data) != GGML_STATUS_SUCCESS) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot reach the step's logits");
    }
    *which = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(*which);
    *rows = ggml_get_rows(ctx, logits, *which);
    return DFL_OK;
}

/* A sampling stage over n rows of the step's logits (`which`, an input, chooses them) in a
 * graph of its own in `slot`, beside the step's, allocated. */
static dfl_status rows_sampler_graph(dfl_target * t, int slot, int n, const dfl_sampler_key * key,
                                     dfl_sampler_graph * g, struct ggml_cgraph ** gf, struct ggml_tensor ** which) {
    t->graphs[slot].valid = false;
    struct ggml_context * ctx = dfl_runtime_begin_graph(&t->rt, slot);
    *gf = ggml_new_graph_custom(ctx, DFL_GRAPH_SIZE, false);
    struct ggml_tensor * logits;
    TRY(step_logits_rows(t, ctx, n, which, &logits));
    dfl_sampler_build(ctx, *gf, logits, key, g);
    return dfl_runtime_alloc(&t->rt, slot, *gf);
}

/* The step's choices read into out_choices; *undecided: how many are -1. */
static dfl_status read_choices(dfl_target * t, int * undecided) {
    const int n = t->n_out;
    if (!dfl_reserve((void **) &t->out_choices, &t->cap_out_choices, n, sizeof(int32_t))) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    dfl_runtime_get(&t->rt, t->out->in.samp.choice, t->out_choices, 0, (size_t) n * sizeof(int32_t));
    *undecided = 0;
    for (int r = 0; r < n; r++) {
        *undecided += t->out_choices[r] < 0;
    }
    return DFL_OK;
}

/* A greedy step under masks by candidates (DFL_MASK_CANDIDATES): its choices read, and
 * the rows none of whose candidates their mask allows decided again over their whole
 * rows, masked as a sampling step masks them (exact whatever the mask), in a graph of
 * their rows beside the step's. */
static dfl_status decide_choices(dfl_target * t) {
    const int n = t->n_out, V = t->n_head, W = dfl_mask_words(V);
    int m;
    TRY(read_choices(t, &m));
    if (m == 0) {
        t->choices_decided = true;
        return DFL_OK;
    }
    int32_t * rows = malloc((size_t) 2 * m * sizeof(int32_t)), * decided = rows + m; /* which rows, their choices */
    uint32_t * words = malloc((size_t) m * W * sizeof(uint32_t));
    if (!rows || !words) {
        free(rows);
        free(words);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int r = 0, i = 0; r < n; r++) {
        if (t->out_choices[r] < 0) {
            rows[i++] = r;
        }
    }
    for (int i = 0; i < m; i++) { /* each row's mask, in its sequence's staging still */
        int p = 0, r0 = 0;
        while (rows[i] >= r0 + t->out_part[p].n_rows) {
            r0 += t->out_part[p++].n_rows;
        }
        const dfl_sampler * smp = &t->sampler[t->out_part[p].seq];
        if (t->out_part[p].mask_gen == 0 || smp->mask_gen != t->out_part[p].mask_gen) {
            free(rows);
            free(words);
            return dfl_fail(DFL_ERR_STATE, "masks were staged again before the last step's choices were read");
        }
        memcpy(words + (size_t) i * W, smp->mask + (size_t) (rows[i] - r0) * W, (size_t) W * sizeof(uint32_t));
    }
    dfl_sampler again;
    dfl_sampler_init(&again); /* greedy */
    dfl_status st = dfl_sampler_stage_masks(&again, words, m, W, V);
    free(words);
    dfl_sampler_key key;
    if (st == DFL_OK) {
        st = dfl_sampler_key_for(&again, m, V, &key);
    }
    const int slot = spare_slot(t);
    if (st == DFL_OK && slot < 0) {
        st = dfl_fail(DFL_ERR_STATE, "deciding a masked row again: the runtime keeps no second graph");
    }
    if (st == DFL_OK) {
        dfl_sampler_key_settle(&key, m, V, false);
        key.by_sort = t->rt.top_k_by_sort;
        struct ggml_cgraph * gf;
        struct ggml_tensor * which;
        dfl_sampler_graph g;
        st = rows_sampler_graph(t, slot, m, &key, &g, &gf, &which);
        if (st == DFL_OK) {
            dfl_runtime_set(&t->rt, which, rows, 0, (size_t) m * sizeof(int32_t));
            st = dfl_sampler_fill(&again, &t->rt, &g, &key, m, V);
        }
        if (st == DFL_OK) {
            st = dfl_runtime_compute(&t->rt, slot, gf);
        }
        if (st == DFL_OK) {
            dfl_runtime_get(&t->rt, g.choice, decided, 0, (size_t) m * sizeof(int32_t));
            for (int i = 0; i < m; i++) {
                t->out_choices[rows[i]] = decided[i];
            }
            t->choices_decided = true;
        }
    }
    dfl_sampler_free(&again);
    free(rows);
    return st;
}

/* The masks the step's part p was filled with, staged again in `again` (a part without
 * masks stages none). */
static dfl_status restage_masks(const dfl_target * t, int p, dfl_sampler * again) {
    const int V = t->n_head, W = dfl_mask_words(V);
    const dfl_sampler * smp = &t->sampler[t->out_part[p].seq];
    if (t->out_part[p].mask_gen == 0) {
        return DFL_OK;
    }
    if (smp->mask_gen != t->out_part[p].mask_gen) {
        return dfl_fail(DFL_ERR_STATE, "masks were staged again before the last step's choices were read");
    }
    return dfl_sampler_stage_masks(again, smp->mask, t->out_part[p].n_rows, W, V);
}

/* The sampling stage of a ranked step under masks by candidates, run again over all its
 * rows with the masks applied in place (SPARSE or DENSE: exact whatever the mask), in a
 * graph beside the step's: over the step's logits (which its graph penalized in place
 * already: no penalties again), with the settings and uniforms it was filled with. Its
 * choices, candidates and probabilities, read back, are the step's. */
static dfl_status sample_again(dfl_target * t) {
    const int n = t->n_out, V = t->n_head, P = t->n_out_parts;
    dfl_sampler again[DFL_MAX_SEQ];
    dfl_sampler_part parts[DFL_MAX_SEQ];
    dfl_sampler_key masks;
    dfl_status st = DFL_OK;
    for (int p = 0; p < P; p++) {
        dfl_sampler_init(&again[p]); /* greedy: the key of its masks alone */
        parts[p] = (dfl_sampler_part) { &again[p], t->out_part[p].n_rows };
        dfl_sampler_key k;
        if (st == DFL_OK) {
            st = restage_masks(t, p, &again[p]);
        }
        if (st == DFL_OK) {
            st = dfl_sampler_key_for(&again[p], t->out_part[p].n_rows, V, &k);
        }
        if (st == DFL_OK && p == 0) {
            masks = k;
        } else if (st == DFL_OK) {
            dfl_sampler_key_merge(&masks, &k);
        }
    }
    const int slot = spare_slot(t);
    if (st == DFL_OK && slot < 0) {
        st = dfl_fail(DFL_ERR_STATE, "sampling a masked step again: the runtime keeps no second graph");
    }
    if (st == DFL_OK) {
        dfl_sampler_key_settle(&masks, n, V, false);
        dfl_sampler_key key = t->out->key.samp;
        key.masked = masks.masked;
        key.n_keep = masks.n_keep;
        key.n_ban = masks.n_ban;
        key.keep_rows = masks.keep_rows;
        key.n_wide = 0;
        key.n_penalty = 0;
        key.n_bias = 0; /* biased in place already, as penalized */
        const int K = key.n_cand;
        struct ggml_cgraph * gf;
        struct ggml_tensor * which;
        dfl_sampler_graph g;
        /* the rows gathered: the mask is applied to the copy, the step's logits stay as they are */
        st = rows_sampler_graph(t, slot, n, &key, &g, &gf, &which);
        if (st == DFL_OK && (!dfl_reserve((void **) &t->out_cand, &t->cap_out_cand, n * K, sizeof(int32_t)) ||
                             !dfl_reserve((void **) &t->out_cand_p, &t->cap_out_cand_p, n * K, sizeof(float)))) {
            st = dfl_fail(DFL_ERR_BACKEND, "out of host memory");
        }
        if (st == DFL_OK) {
            for (int r = 0; r < n; r++) {
                t->out_choices[r] = r; /* the rows in order (the choices are read over them below) */
            }
            dfl_runtime_set(&t->rt, which, t->out_choices, 0, (size_t) n * sizeof(int32_t));
            dfl_runtime_set(&t->rt, g.params, t->out_params, 0, (size_t) n * dfl_sampler_n_params() * sizeof(float));
            st = dfl_sampler_fill_masks(parts, P, &t->rt, &g, &key, V);
        }
        if (st == DFL_OK) {
            st = dfl_runtime_compute(&t->rt, slot, gf);
        }
        if (st == DFL_OK) {
            dfl_runtime_get(&t->rt, g.choice, t->out_choices, 0, (size_t) n * sizeof(int32_t));
            dfl_runtime_get(&t->rt, g.cand, t->out_cand, 0, (size_t) n * K * sizeof(int32_t));
            dfl_runtime_get(&t->rt, g.cand_p, t->out_cand_p, 0, (size_t) n * K * sizeof(float));
            t->out_redone = true;
        }
    }
    for (int p = 0; p < P; p++) {
        dfl_sampler_free(&again[p]);
    }
    return st;
}

/* The step's choices decided (once): under masks by candidates, a greedy step's undecided
 * rows decided again, a ranked step's stage run again when some row is undecided. */
static dfl_status decide(dfl_target * t) {
    if (t->choices_decided) {
        return DFL_OK;
    }
    if (t->out->key.samp.pick == DFL_PICK_ARGMAX) {
        return decide_choices(t);
    }
    int m;
    TRY(read_choices(t, &m));
    if (m > 0) {
        TRY(sample_again(t));
    }
    t->choices_decided = true;
    return DFL_OK;
}

DFL_API dfl_status dfl_target_choices(dfl_target * t, int32_t * dst, int32_t row0, int32_t n_rows) {
    TRY(dfl_target_check_rows(t, row0, n_rows, t ? t->n_out : 0, "choices"));
    if (n_rows == 0) {
        return DFL_OK; /* a step whose rows gave no logits (a prompt chunk's middle) has no choice tensor */
    }
    if (t->out->key.samp.masked == DFL_MASK_CANDIDATES) {
        TRY(decide(t));
        memcpy(dst, t->out_choices + row0, (size_t) n_rows * sizeof(int32_t));
        return DFL_OK;
    }
    dfl_runtime_get(&t->rt, t->out->in.samp.choice, dst, (size_t) row0 * sizeof(int32_t),
                    (size_t) n_rows * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_candidates(dfl_target * t, int32_t row0, int32_t n_rows, int32_t k, int32_t * tokens,
                                        float * probs) {
    if (!t || t->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "candidates: the last call computed no logits");
    }
    if (t->out->key.samp.masked == DFL_MASK_CANDIDATES && t->out->key.samp.pick != DFL_PICK_ARGMAX) {
        TRY(decide(t));
    }
    if (!t->out_redone) {
        return dfl_sampler_candidates(&t->rt, &t->out->in.samp, t->n_out, row0, n_rows, k, tokens, probs);
    }
    /* the step's stage ran again: its candidates were read back */
    const int K = t->out->key.samp.n_cand;
    TRY(dfl_sampler_check_candidates(K, t->n_out, row0, n_rows, k, tokens, probs));
    for (int r = 0; r < n_rows; r++) {
        memcpy(tokens + (size_t) r * k, t->out_cand + (size_t) (row0 + r) * K, (size_t) k * sizeof(int32_t));
        memcpy(probs + (size_t) r * k, t->out_cand_p + (size_t) (row0 + r) * K, (size_t) k * sizeof(float));
    }
    return DFL_OK;
}

/* A slot for a graph beside the one whose results are being read: the least recently
 * used other than it (its graph is rebuilt when its shape comes again). */
static int spare_slot(dfl_target * t) {
    int slot = -1;
    for (int i = 0; i < t->rt.n_slots; i++) {
        if (&t->graphs[i] == t->out) {
            continue;
        }
        if (slot < 0 || !t->graphs[i].valid ||
            (t->graphs[slot].valid && t->graphs[i].last_use < t->graphs[slot].last_use)) {
            slot = i;
        }
    }
    return slot;
}

DFL_API dfl_status dfl_target_redraw(dfl_target * t, int32_t seq, const int32_t * rows, const float * u, int32_t n,
                                     int32_t * dst) {
    TRY(dfl_target_check_seq(t, seq));
    if (!rows || !u || !dst || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "redraw: needs rows, a uniform for each and room for the tokens");
    }
    if (t->n_out == 0) {
        return dfl_fail(DFL_ERR_STATE, "redraw: the last call computed no logits");
    }
    for (int i = 0; i < n; i++) {
        TRY(dfl_target_check_rows(t, rows[i], 1, t->n_out, "redraw"));
    }
    dfl_sampler * smp = &t->sampler[seq];
    if (smp->s.temperature <= 0.0f) {
        return dfl_fail(DFL_ERR_STATE, "redraw: sequence %d does not sample (temperature 0)", seq);
    }
    const int slot = spare_slot(t);
    if (slot < 0) {
        return dfl_fail(DFL_ERR_STATE, "redraw: the runtime keeps no second graph");
    }
    t->graphs[slot].valid = false;
    /* the rows' logits (their penalties applied in place by the step's graph) ranked in
     * full: the draw then sees every token the kept set may hold, at any vocabulary size */
    const int V = t->n_head;
    const dfl_sampler_key key = { DFL_PICK_RANKED, V, 0, 0, 0, 0 };
    struct ggml_context * ctx = dfl_runtime_begin_graph(&t->rt, slot);
    struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, DFL_GRAPH_SIZE, false);
    struct ggml_tensor * which, * logits;
    TRY(step_logits_rows(t, ctx, n, &which, &logits));
    dfl_sampler_graph g;
    struct ggml_tensor * choice = dfl_sampler_build(ctx, gf, logits, &key, &g);
    ggml_set_output(choice);
    ggml_build_forward_expand(gf, choice);
    TRY(dfl_runtime_alloc(&t->rt, slot, gf));
    dfl_runtime_set(&t->rt, which, rows, 0, (size_t) n * sizeof(int32_t));
    TRY(dfl_sampler_stage_uniforms(smp, u, n));
    TRY(dfl_sampler_fill(smp, &t->rt, &g, &key, n, V));
    TRY(dfl_runtime_compute(&t->rt, slot, gf));
    dfl_runtime_get(&t->rt, choice, dst, 0, (size_t) n * sizeof(int32_t));
    return DFL_OK;
}

DFL_API dfl_status dfl_target_set_sampling(dfl_target * t, int32_t seq, const dfl_sampling * s) {
    TRY(dfl_target_check_seq(t, seq));
    return dfl_sampler_set(&t->sampler[seq], s);
}

DFL_API dfl_status dfl_target_set_logit_bias(dfl_target * t, int32_t seq, const int32_t * tokens,
                                             const float * biases, int32_t n) {
    TRY(dfl_target_check_seq(t, seq));
    return dfl_sampler_set_bias(&t->sampler[seq], tokens, biases, n, t->n_head);
}

DFL_API dfl_status dfl_target_set_uniforms(dfl_target * t, int32_t seq, const float * u, int32_t n) {
    TRY(dfl_target_check_seq(t, seq));
    return dfl_sampler_stage_uniforms(&t->sampler[seq], u, n);
}

DFL_API dfl_status dfl_target_set_penalties(dfl_target * t, int32_t seq, const int32_t * tokens, const float * counts,
                                           int32_t n_rows, int32_t per_row) {
    TRY(dfl_target_check_seq(t, seq));
    return dfl_sampler_stage_penalties(&t->sampler[seq], tokens, counts, n_rows, per_row, t->n_head);
}

DFL_API dfl_status dfl_target_set_masks(dfl_target * t, int32_t seq, const uint32_t * words, int32_t n_rows,
                                       int32_t n_words) {
    TRY(dfl_target_check_seq(t, seq));
    return dfl_sampler_stage_masks(&t->sampler[seq], words, n_rows, n_words, t->n_head);
}
