/* A drafter's proposes (see dfl_draft.c for its loading and slots): each sequence's block
 * planned, its inputs staged, one graph for every sequence's block, and the drafter's
 * context appended. */
#include "dfl_draft_state.h"
#include "dfl_pair.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static dfl_status reserve(dfl_draft * d, int n, size_t mask) {
    if ((size_t) n > d->host_rows) {
        free(d->host_i32);
        free(d->host_i64);
        d->host_i32 = malloc((size_t) n * sizeof(int32_t));
        d->host_i64 = malloc((size_t) n * sizeof(int64_t));
        d->host_rows = (size_t) n;
    }
    if (mask > d->host_mask_size) {
        free(d->host_mask);
        d->host_mask_size = mask;
        d->host_mask = malloc(d->host_mask_size * sizeof(ggml_fp16_t));
    }
    if (!d->host_i32 || !d->host_i64 || !d->host_mask) {
        d->host_rows = d->host_mask_size = 0;
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

/* Host staging for a step's inputs: three numbers per entry or part, a token and
 * position per row of every pass, an index per drafted row, and the largest part's mask
 * (a row per block row, or per pass, over its cache rows). */
dfl_status dfl_draft_reserve_staging(dfl_draft * d, const dfl_draft_step * step) {
    const dfl_drafter * m = &d->m;
    const int E = dfl_draft_step_entries(step), R = dfl_draft_step_rows(m, step);
    const int n_pass = dfl_draft_step_passes(m, step), D = dfl_draft_step_drafted(step);
    int host = 3 * E;
    host = host > 3 * step->n_parts ? host : 3 * step->n_parts;
    host = host > R * (1 + n_pass) ? host : R * (1 + n_pass);
    host = host > D ? host : D;
    size_t mask = 1;
    for (int i = 0; i < step->n_parts; i++) {
        const dfl_draft_part * part = &step->part[i];
        const size_t cells = (size_t) (m->autoregressive ? m->block_size : dfl_draft_block_rows(m, part->n_block)) *
                             (size_t) part->n_kv;
        mask = cells > mask ? cells : mask;
    }
    return reserve(d, host, mask);
}

/* What a propose's part does, worked out from its block and the two memories. */
typedef struct part_plan {
    int seq;
    int p0;          /* the drafter's context positions before the step */
    int n_entries;   /* positions the target committed since: p0 .. p0 + n_entries - 1 */
    int pos;         /* the bonus's position: p0 + n_entries */
    const int32_t * tokens;
    int bonus, n_block;
} part_plan;

/* A block checked against its sequence's state, and its entries. */
static dfl_status plan_part(const dfl_draft * d, const dfl_block * b, const bool * seen, part_plan * pp) {
    const dfl_drafter * m = &d->m;
    TRY(dfl_draft_check_seq(d, b->seq));
    if (seen[b->seq]) {
        return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d appears twice in one propose", b->seq);
    }
    if (b->n_block != 0 && (b->n_block < 2 || b->n_block > m->block_size)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "block size %d is outside 2..%d (the drafter's block size)", b->n_block,
                        m->block_size);
    }
    if (b->n_block > 0 && (b->bonus < 0 || b->bonus >= m->n_vocab)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "token id %d is outside the vocabulary", b->bonus);
    }
    const int p0 = d->mem.seq[b->seq].n_past, end = dfl_target_n_past(d->target, b->seq);
    if (p0 > end) {
        return dfl_fail(DFL_ERR_STATE, "the drafter holds %d positions of sequence %d, its target %d: reset both",
                        p0, b->seq, end);
    }
    for (int pos = p0; pos < end; pos++) {
        if (dfl_target_feature_of(d->target, b->seq, pos) < 0) {
            return dfl_fail(DFL_ERR_STATE, "the target's features of position %d of sequence %d are gone (the target ran "
                            "another call of the sequence, or another sequence's prefill chunk, before the drafter read them)", pos, b->seq);
        }
    }
    const int n = end - p0;
    if (b->n_tokens < 0 || (b->n_tokens > 0 && !b->tokens)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null context tokens");
    }
    if (b->tokens && b->n_tokens != n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "%d context tokens given for the %d positions sequence %d's drafter lacks",
                        b->n_tokens, n, b->seq);
    }
    if (m->reads_tokens && n > 0 && !b->tokens) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the %s drafter needs the tokens of the %d positions it takes from the "
                        "target", m->registry->name, n);
    }
    for (int i = 0; b->tokens && i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "context token id %d is outside the vocabulary", b->tokens[i]);
        }
    }
    if (end + b->n_block > d->n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: drafting %d positions after %d exceeds %d", b->n_block,
                        end, d->n_ctx);
    }
    *pp = (part_plan) { b->seq, p0, n, end, b->tokens, b->bonus, b->n_block };
    return DFL_OK;
}

/* How the propose's drafted rows choose: each part's sequence's sampling, merged. */
static dfl_status propose_sampling(dfl_draft * d, dfl_draft_step * step) {
    memset(&step->samp, 0, sizeof step->samp);
    bool first = true;
    for (int i = 0; i < step->n_parts; i++) {
        if (step->part[i].n_block == 0) {
            continue;
        }
        dfl_sampler_key k;
        TRY(dfl_sampler_key_for(&d->sampler[step->part[i].seq], step->part[i].n_block - 1, d->m.n_vocab, &k));
        if (first) {
            step->samp = k;
        } else {
            dfl_sampler_key_merge(&step->samp, &k);
        }
        first = false;
    }
    step->samp.by_sort = d->rt.top_k_by_sort;
    return DFL_OK;
}

static bool same_step(const dfl_draft_step * a, const dfl_draft_step * b) {
    return a->n_parts == b->n_parts && memcmp(a->part, b->part, (size_t) a->n_parts * sizeof a->part[0]) == 0 &&
           memcmp(&a->samp, &b->samp, sizeof a->samp) == 0;
}

/* The part's block rows' mask over n_kv cache rows of its sequence, one row per block row
 * (per pass, autoregressive): cache row j holds the latest position below the block's end
 * that maps to it, visible when in the drafter's context window (an older or stale one is
 * out of it by construction) and by the layer's rule: causal, not after the row's
 * position; window, fewer than `window` positions from it. */
static void fill_mask(dfl_draft * d, struct ggml_tensor * dst, const part_plan * pp, int rows,
                      const dfl_draft_mask_rule * rule) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), minf = ggml_fp32_to_fp16(-INFINITY);
    const int p = pp->pos, n_kv = (int) dst->ne[0], ring = dfl_memory_kv_rows(&d->mem, 0);
    const int written = d->m.autoregressive ? pp->n_block - 1 : dfl_draft_block_rows(&d->m, pp->n_block);
    int first = d->p.window > 0 && p > d->p.window ? p - d->p.window : 0;
    first = first > d->m.first_pos ? first : d->m.first_pos;
    const int end = p + written;
    for (int i = 0; i < rows; i++) {
        const int q = p + i;
        for (int j = 0; j < n_kv; j++) {
            const int pos = j < end ? j + ring * ((end - 1 - j) / ring) : -1;
            bool visible = pos >= first;
            visible = visible && (!rule->causal || pos <= q);
            visible = visible && (rule->window <= 0 || (q - pos < rule->window && (rule->causal || pos - q < rule->window)));
            d->host_mask[(size_t) i * n_kv + j] = visible ? zero : minf;
        }
    }
    dfl_runtime_set(&d->rt, dst, d->host_mask, 0, (size_t) rows * n_kv * sizeof(ggml_fp16_t));
}

/* The entries' inputs: feature rows, positions, cells (padding, and entries a later one
 * of the same call replaces in the ring, write to the slot's spare cell: one scatter
 * never writes a cell twice), tokens; and what feat_previous drafters carry. */
static void stage_entries(dfl_draft * d, const dfl_draft_step * step, const part_plan * plans, const draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    const int E = dfl_draft_step_entries(step), ring = dfl_memory_kv_rows(&d->mem, 0);
    int32_t * rows = d->host_i32, * pos = d->host_i32 + E, * tok = d->host_i32 + 2 * E;
    int64_t * cells = d->host_i64;
    for (int i = 0, at = 0; i < step->n_parts; at += step->part[i].entry_rows, i++) {
        const part_plan * pp = &plans[i];
        for (int k = 0; k < step->part[i].entry_rows; k++) {
            const bool real = k < pp->n_entries;
            const int p = pp->p0 + (real ? k : 0);
            const int own = m->feat_previous ? p - 1 : p;
            rows[at + k] = real && (!m->feat_previous || k > 0) ? (int32_t) dfl_target_feature_of(d->target, pp->seq, own)
                                                                : 0;
            pos[at + k] = p + m->pos_offset;
            cells[at + k] = real && k >= pp->n_entries - ring ? dfl_memory_cell(&d->mem, 0, pp->seq, p)
                                                              : dfl_memory_spare_cell(&d->mem, 0, pp->seq);
            tok[at + k] = real && pp->tokens ? pp->tokens[k] : 0;
        }
    }
    dfl_runtime_set(&d->rt, in->entry_rows, rows, 0, (size_t) E * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->entry_pos, pos, 0, (size_t) E * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->entry_cells, cells, 0, (size_t) E * sizeof(int64_t));
    if (in->entry_tokens) {
        dfl_runtime_set(&d->rt, in->entry_tokens, tok, 0, (size_t) E * sizeof(int32_t));
    }
    if (!m->feat_previous) {
        return;
    }
    const int P = step->n_parts;
    int64_t * slots = d->host_i64, * first = d->host_i64 + P;
    int32_t * last = d->host_i32, * drafting = d->host_i32 + P, * rows_of_slots = d->host_i32 + 2 * P;
    float has[DFL_MAX_SEQ], none[DFL_MAX_SEQ];
    int n_drafting = 0;
    for (int i = 0, at = 0; i < P; at += step->part[i].entry_rows, i++) {
        const part_plan * pp = &plans[i];
        slots[i] = rows_of_slots[i] = pp->seq;
        first[i] = at;
        last[i] = pp->n_entries > 0 ? (int32_t) dfl_target_feature_of(d->target, pp->seq, pp->pos - 1) : 0;
        has[i] = pp->n_entries > 0 ? 1.0f : 0.0f;
        none[i] = 1.0f - has[i];
        if (pp->n_block > 0) {
            drafting[n_drafting++] = i;
        }
    }
    dfl_runtime_set(&d->rt, in->carry_rows, rows_of_slots, 0, (size_t) P * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->carry_slots, slots, 0, (size_t) P * sizeof(int64_t));
    dfl_runtime_set(&d->rt, in->first_entry, first, 0, (size_t) P * sizeof(int64_t));
    dfl_runtime_set(&d->rt, in->last_row, last, 0, (size_t) P * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->has_entries, has, 0, (size_t) P * sizeof(float));
    dfl_runtime_set(&d->rt, in->no_entries, none, 0, (size_t) P * sizeof(float));
    if (in->block_parts) {
        dfl_runtime_set(&d->rt, in->block_parts, drafting, 0, (size_t) n_drafting * sizeof(int32_t));
    }
}

/* The block's inputs: the first pass's tokens ([bonus, filler...] per block, or each
 * bonus), every pass's positions and cells (passes past a sequence's block write to its
 * spare cell), the masks and the drafted rows. */
static void stage_block(dfl_draft * d, const dfl_draft_step * step, const part_plan * plans, const draft_inputs * in) {
    const dfl_drafter * m = &d->m;
    const int R = dfl_draft_step_rows(m, step), n_pass = dfl_draft_step_passes(m, step);
    int32_t * tok = d->host_i32, * pos = d->host_i32 + R;
    int64_t * cells = d->host_i64;
    for (int i = 0, row = 0; i < step->n_parts; i++) {
        const part_plan * pp = &plans[i];
        if (pp->n_block == 0) {
            continue;
        }
        dfl_runtime_set(&d->rt, d->blocks.tokens[pp->seq], &pp->bonus, 0, sizeof(int32_t));
        if (m->autoregressive) {
            tok[row] = pp->bonus;
            for (int j = 0; j < n_pass; j++) {
                pos[j * R + row] = pp->pos + j + m->pos_offset;
                cells[j * R + row] = j < pp->n_block - 1 ? dfl_memory_cell(&d->mem, 0, pp->seq, pp->pos + j)
                                                         : dfl_memory_spare_cell(&d->mem, 0, pp->seq);
            }
            row++;
        } else {
            for (int j = 0; j < dfl_draft_block_rows(m, pp->n_block); j++, row++) {
                tok[row] = j == 0 ? pp->bonus : m->filler;
                pos[row] = pp->pos + j + m->pos_offset;
                cells[row] = dfl_memory_cell(&d->mem, 0, pp->seq, pp->pos + j);
            }
        }
    }
    dfl_runtime_set(&d->rt, in->tokens, tok, 0, (size_t) R * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->pos, pos, 0, (size_t) n_pass * R * sizeof(int32_t));
    dfl_runtime_set(&d->rt, in->cells, cells, 0, (size_t) n_pass * R * sizeof(int64_t));
    for (int i = 0; i < step->n_parts; i++) {
        for (int k = 0; k < m->n_masks && plans[i].n_block > 0; k++) {
            fill_mask(d, in->mask[i][k], &plans[i], m->autoregressive ? n_pass : dfl_draft_block_rows(m, plans[i].n_block),
                      &m->masks[k]);
        }
    }
    if (in->drafted) {
        int32_t * idx = d->host_i32;
        int k = 0;
        for (int i = 0, row = 0; i < step->n_parts; i++) {
            const int n = plans[i].n_block - 1;
            if (n < 1) {
                continue;
            }
            for (int j = 0; j < n; j++) {
                idx[k++] = m->autoregressive ? j * R + row : row + dfl_draft_first_drafted(m) + j;
            }
            row += dfl_draft_block_rows(m, plans[i].n_block);
        }
        dfl_runtime_set(&d->rt, in->drafted, idx, 0, (size_t) k * sizeof(int32_t));
    }
}

DFL_API dfl_status dfl_draft_propose(dfl_draft * d, const dfl_block * blocks, int32_t n) {
    if (!d || !blocks || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose needs a drafter and at least one block");
    }
    if (n > d->n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a propose of %d blocks exceeds the %d sequence slots", n, d->n_seq);
    }
    const dfl_drafter * m = &d->m;
    bool seen[DFL_MAX_SEQ] = { false };
    part_plan plans[DFL_MAX_SEQ];
    dfl_draft_step step;
    memset(&step, 0, sizeof step);
    const int ring = dfl_memory_kv_rows(&d->mem, 0);
    for (int i = 0; i < n; i++) {
        part_plan pp;
        TRY(plan_part(d, &blocks[i], seen, &pp));
        seen[pp.seq] = true;
        if (pp.n_block == 0 && pp.n_entries == 0) {
            continue; /* nothing to do for it */
        }
        int n_kv = ((pp.pos + pp.n_block + DFL_DRAFT_KV_PAD - 1) / DFL_DRAFT_KV_PAD) * DFL_DRAFT_KV_PAD;
        n_kv = n_kv > ring ? ring : n_kv;
        /* entries ride along padded to the block size, so that every step has the same
         * shape; a prefill chunk's alone come as they are */
        const int rows = pp.n_block == 0 || pp.n_entries > m->block_size ? pp.n_entries : m->block_size;
        plans[step.n_parts] = pp;
        step.part[step.n_parts++] = (dfl_draft_part) { pp.seq, rows, pp.n_block, pp.n_block > 0 ? n_kv : 0 };
    }
    if (step.n_parts == 0) {
        return DFL_OK;
    }
    const int R = dfl_draft_step_rows(m, &step), D = dfl_draft_step_drafted(&step);
    TRY(dfl_draft_reserve_staging(d, &step));
    TRY(propose_sampling(d, &step));
    d->n_graphs++;
    if (!(d->graph_valid && same_step(&d->graph_key, &step))) {
        d->n_graph_builds++;
        d->rank.valid = false;
        d->graph_valid = false;
        dfl_draft_build_graph(d, &step, dfl_runtime_begin_graph(&d->rt, 0), &d->graph);
        TRY(dfl_runtime_alloc(&d->rt, 0, d->graph.gf));
        d->graph_key = step;
        d->graph_valid = true;
    }
    const draft_inputs * in = &d->graph;
    stage_entries(d, &step, plans, in);
    if (R > 0) {
        stage_block(d, &step, plans, in);
    }
    if (D > 0 && step.samp.pick != DFL_PICK_ARGMAX) {
        /* each part's rows of the stage's inputs, from its sequence's sampler */
        dfl_sampler_part parts[DFL_MAX_SEQ];
        int k = 0;
        for (int i = 0; i < step.n_parts; i++) {
            if (plans[i].n_block > 0) {
                parts[k++] = (dfl_sampler_part) { &d->sampler[plans[i].seq], plans[i].n_block - 1 };
            }
        }
        TRY(dfl_sampler_fill_parts(parts, k, &d->rt, &in->sampled, &step.samp, m->n_vocab));
    }
    TRY(dfl_runtime_compute(&d->rt, 0, in->gf));
    d->n_step_nodes = d->rt.n_last_nodes;
    d->rank.fresh = false;
    for (int i = 0; i < step.n_parts; i++) {
        d->mem.seq[plans[i].seq].n_past = plans[i].pos;
        d->blocks.n[plans[i].seq] = plans[i].n_block;
    }
    d->n_out = D;
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_append(dfl_draft * d, int32_t seq, const int32_t * tokens, int32_t n_tokens) {
    TRY(dfl_draft_check_seq(d, seq));
    const dfl_block b = { seq, tokens, n_tokens, 0, 0 };
    return dfl_draft_propose(d, &b, 1);
}
