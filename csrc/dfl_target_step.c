/* The target's step: decodes, chain and tree verifies of one or several sequences in
 * one graph. Each entry is checked against its sequence's state, the step's rows,
 * attention spans and logits rows are worked out, and a graph of the step's shape is
 * reused when one is kept (a slot per runtime graph, least recently used); the
 * largest graphs each slot can be asked for are what a load reserves. */
#include "dfl_target_state.h"
#include "dfl_token_source.h"

#include <stdlib.h>
#include <string.h>

/* The attention window grows in steps so that graphs of consecutive steps share shapes. */
#define KV_PAD 256

/* Trees have at most 64 nodes (their ancestor sets are 64-bit masks) and n_verify. */
int dfl_target_max_tree_nodes(const dfl_target * t) {
    return t->p.n_verify < DFL_MAX_TREE ? t->p.n_verify : DFL_MAX_TREE;
}

dfl_status dfl_target_host_reserve(dfl_target * t, int n, size_t mask) {
    if ((size_t) n > t->host_rows) {
        free(t->host_i32);
        free(t->host_i64);
        t->host_i32 = malloc((size_t) n * sizeof(int32_t));
        t->host_i64 = malloc((size_t) n * sizeof(int64_t));
        t->host_rows = (size_t) n;
    }
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

/* A step of every sequence's rows of one kind at the end of a full context, each
 * carrying a commit (commit NULL: none), its rows sampled over the whole vocabulary
 * (the sampling stage that holds the most: a few vocabulary-wide intermediates per
 * row). */
static dfl_step full_step(const dfl_target * t, int kind, int n, const tree_plan * tree, const pending_commit * commit) {
    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = t->mem.n_seq;
    step.n_rows = step.n_out = n * t->mem.n_seq;
    step.samp.pick = DFL_PICK_FULL;
    for (int s = 0; s < step.n_seg; s++) {
        step.seg[s] = (dfl_segment) { s, kind, n, s * n, t->p.n_ctx - n, t->p.n_ctx, LOGITS_ALL, tree, commit, NULL,
                                      tree ? tree->shape : (tree_shape) { 0 }, commit ? (commit->tree ? 2 : 1) : 0,
                                      commit ? commit->n_replay : 0 };
    }
    return step;
}

/* A full step whose last sequence brings a prompt chunk of n tokens instead of its
 * verify (the chunk's last row sampled, its features kept), as a batch of running
 * sequences has a joining prompt's chunk follow their rows. */
static void shared_chunk_step(const dfl_target * t, dfl_step * step, int n) {
    const int last = step->n_seg - 1;
    const int row0 = step->seg[last].row0;
    step->seg[last] = (dfl_segment) { last, DFL_STEP_DECODE, n, row0, t->p.n_ctx - n, t->p.n_ctx, LOGITS_LAST,
                                      NULL, NULL, NULL, { 0 }, 0, 0 };
    step->n_rows = row0 + n;
    step->n_out = row0 + 1;
}

dfl_status dfl_target_worst_graphs(dfl_target * t, dfl_graph_visit visit, void * user) {
    dfl_runtime * rt = &t->rt;
    graph_inputs in;
    const int n_ctx = t->p.n_ctx;

    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = 1;
    step.n_rows = t->p.n_ubatch;
    step.n_out = 1;
    step.samp.pick = DFL_PICK_FULL;
    step.seg[0] = (dfl_segment) { 0, DFL_STEP_DECODE, t->p.n_ubatch, 0, n_ctx - t->p.n_ubatch, n_ctx, LOGITS_LAST,
                                  NULL, NULL, NULL, { 0 }, 0, 0 };
    visit(rt, 0, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, 0), &in), user);

    tree_plan * worst = calloc(1, sizeof *worst);
    if (!worst) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    const int n_tree = dfl_target_max_tree_nodes(t);
    worst->n = n_tree;
    worst->shape = dfl_tree_worst_shape(n_tree);
    const pending_commit tree_commit = { .active = true, .tree = true, .n_keep = 1, .n_replay = t->p.n_verify };
    /* a chain commit has nothing to do without recurrent layers */
    const pending_commit chain_commit = { .active = true, .tree = false, .n_keep = 1, .n_replay = t->p.n_verify };
    /* a prompt's chunk sharing the prefill slot's step with every other slot's rows, as
     * many tokens as they leave of n_ubatch (check_shared_chunk): beside their largest
     * verifies (trees, chains: the most rows sampled) and beside one-token decodes (the
     * largest chunk); the steps between hold no more */
    for (int k = 0; t->mem.n_seq > 1 && k < 3; k++) {
        const int others = t->mem.n_seq - 1;
        const int each = k == 0 ? n_tree : (k == 1 ? t->p.n_verify : 1);
        const int chunk = t->p.n_ubatch - others * each;
        if (chunk <= t->p.n_verify) {
            continue; /* a decode of a verify's size: a step slot takes it */
        }
        step = k == 0 ? full_step(t, DFL_STEP_TREE, n_tree, worst, &tree_commit)
             : k == 1 ? full_step(t, DFL_STEP_CHAIN, t->p.n_verify, NULL, t->m.n_recurrent > 0 ? &chain_commit : NULL)
                      : full_step(t, DFL_STEP_DECODE, 1, NULL, NULL);
        shared_chunk_step(t, &step, chunk);
        visit(rt, 0, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, 0), &in), user);
    }
    for (int slot = 1; slot < rt->n_slots; slot++) {
        step = full_step(t, DFL_STEP_TREE, n_tree, worst, &tree_commit);
        visit(rt, slot, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, slot), &in), user);
        step = full_step(t, DFL_STEP_CHAIN, t->p.n_verify, NULL, t->m.n_recurrent > 0 ? &chain_commit : NULL);
        visit(rt, slot, dfl_target_build_graph(t, &step, dfl_runtime_begin_graph(rt, slot), &in), user);
    }
    free(worst);
    return DFL_OK;
}

/* Whether two steps build the same graph (only their inputs differ). */
static bool same_shape(const dfl_step * a, const dfl_step * b) {
    if (a->n_seg != b->n_seg || memcmp(&a->samp, &b->samp, sizeof a->samp) != 0) {
        return false;
    }
    for (int i = 0; i < a->n_seg; i++) {
        const dfl_segment * x = &a->seg[i], * y = &b->seg[i];
        const bool same = x->seq == y->seq && x->kind == y->kind && x->n == y->n && x->n_kv == y->n_kv &&
                          x->logits == y->logits && x->tokens_src == y->tokens_src &&
                          x->commit_kind == y->commit_kind && x->commit_replay == y->commit_replay &&
                          memcmp(&x->shape, &y->shape, sizeof x->shape) == 0;
        if (!same) {
            return false;
        }
    }
    return true;
}

/* A step with a prefill chunk (a decode longer than a verify). */
static bool large_step(const dfl_target * t, const dfl_step * step) {
    for (int i = 0; i < step->n_seg; i++) {
        if (step->seg[i].n > t->p.n_verify) {
            return true;
        }
    }
    return false;
}

/* The slot holding a graph of this step's shape, or the one to build it in (marked
 * invalid): graphs with a prefill chunk always take slot 0, so that the other slots'
 * compute memory stays verify-sized; the rest take the least recently used. */
static int graph_slot(dfl_target * t, const dfl_step * step) {
    const int n_slots = t->rt.n_slots;
    for (int i = 0; i < n_slots; i++) {
        if (t->graphs[i].valid && same_shape(&t->graphs[i].key, step)) {
            return i;
        }
    }
    int slot = 0;
    if (!large_step(t, step)) {
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

/* Run a step whose segments are set (sequence, kind, rows, length, logits, tree plan,
 * commit, token source): their rows, attention spans, the logits rows and the sampling
 * are worked out here; the graph of a step of this shape is reused when one is kept. */
static dfl_status run_step(dfl_target * t, dfl_step * step, const int32_t * const * tokens) {
    int rows = 0, n_out = 0;
    size_t mask = 0;
    for (int i = 0; i < step->n_seg; i++) {
        dfl_segment * s = &step->seg[i];
        s->row0 = rows;
        rows += s->n;
        s->shape = s->kind == DFL_STEP_TREE ? s->tree->shape : (tree_shape) { 0 };
        s->commit_kind = s->commit ? (s->commit->tree ? 2 : 1) : 0;
        s->commit_replay = s->commit ? s->commit->n_replay : 0;
        s->n_kv = ((s->n_past + s->n + KV_PAD - 1) / KV_PAD) * KV_PAD;
        if (s->n_kv > t->p.n_ctx) {
            s->n_kv = t->p.n_ctx;
        }
        n_out += s->logits == LOGITS_NONE ? 0 : (s->logits == LOGITS_LAST ? 1 : s->n);
        if ((size_t) s->n * (size_t) s->n_kv > mask) {
            mask = (size_t) s->n * (size_t) s->n_kv;
        }
    }
    step->n_rows = rows;
    step->n_out = n_out;
    /* commit inputs have n_verify rows */
    TRY(dfl_target_host_reserve(t, rows > t->p.n_verify ? rows : t->p.n_verify, mask));
    TRY(dfl_target_step_sampling(t, step));

    /* steps of a shape seen lately reuse its graph and allocation, only the inputs
     * change: plain decoding, chain steps (the commit they carry is an input), tree
     * steps with as many nodes whatever the tree, and `auto` going back and forth
     * between the chain and a few tree sizes */
    const int slot = graph_slot(t, step);
    graph_cache * gc = &t->graphs[slot];
    t->n_graphs++;
    if (!gc->valid) {
        t->n_graph_builds++;
        gc->gf = dfl_target_build_graph(t, step, dfl_runtime_begin_graph(&t->rt, slot), &gc->in);
        TRY(dfl_runtime_alloc(&t->rt, slot, gc->gf));
        gc->key = *step;
        gc->valid = true;
    }
    gc->last_use = ++t->graph_clock;
    t->out = gc;
    dfl_target_fill_inputs(t, &gc->in, step, tokens);
    TRY(dfl_target_fill_sampling(t, step, &gc->in));
    TRY(dfl_runtime_compute(&t->rt, slot, gc->gf));
    t->n_last_replay = 0;
    for (int i = 0; i < step->n_seg; i++) {
        const pending_commit * pc = step->seg[i].commit;
        if (pc && t->m.n_recurrent > 0 && pc->n_replay > t->n_last_replay) {
            t->n_last_replay = pc->n_replay;
        }
    }
    t->n_out = n_out;
    return DFL_OK;
}

/* An entry of a step, checked against its sequence's state; its device token source. */
static dfl_status check_entry(const dfl_target * t, const dfl_token_source * src, const dfl_rows * r,
                              struct ggml_tensor ** tokens_src) {
    TRY(dfl_target_check_seq(t, r->seq));
    const dfl_seq * q = &t->mem.seq[r->seq];
    const verify_seq * vq = &t->verify[r->seq];
    *tokens_src = NULL;
    switch (r->kind) {
        case DFL_STEP_DECODE:
            if (r->n <= 0 || !r->tokens) {
                return dfl_fail(DFL_ERR_ARGUMENT, "decode needs at least one token");
            }
            if (r->n > t->p.n_ubatch) {
                return dfl_fail(DFL_ERR_CAPACITY, "decode of %d tokens exceeds the ubatch size %d", r->n, t->p.n_ubatch);
            }
            if (r->logits < LOGITS_NONE || r->logits > LOGITS_ALL) {
                return dfl_fail(DFL_ERR_ARGUMENT, "logits mode must be 0, 1 or 2");
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "a verify is waiting for dfl_target_commit");
            }
            break;
        case DFL_STEP_CHAIN:
            if (r->n <= 0) {
                return dfl_fail(DFL_ERR_ARGUMENT, "verify needs a target and at least one token");
            }
            if (r->n > t->p.n_verify) {
                return dfl_fail(DFL_ERR_CAPACITY, "verify of %d tokens exceeds n_verify %d", r->n, t->p.n_verify);
            }
            if (!r->tokens) {
                if (!src) {
                    return dfl_fail(DFL_ERR_ARGUMENT, "verify needs tokens or a drafter whose block to read");
                }
                if (src->target != t) {
                    return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
                }
                if (r->n > src->n[r->seq]) {
                    return dfl_fail(DFL_ERR_STATE, "the drafter's last block has fewer than %d tokens", r->n);
                }
                *tokens_src = src->tokens[r->seq];
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
            }
            break;
        case DFL_STEP_TREE:
            if (r->n <= 0 || !r->tokens || !r->parents) {
                return dfl_fail(DFL_ERR_ARGUMENT, "tree verify needs at least one node");
            }
            if (r->n > t->p.n_verify) {
                return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds n_verify %d", r->n, t->p.n_verify);
            }
            if (vq->pending) {
                return dfl_fail(DFL_ERR_STATE, "the previous verify was not committed");
            }
            break;
        default:
            return dfl_fail(DFL_ERR_ARGUMENT, "unknown step kind %d", r->kind);
    }
    for (int i = 0; r->tokens && i < r->n; i++) {
        if (r->tokens[i] < 0 || r->tokens[i] >= t->m.n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "token id %d at index %d is outside the vocabulary (0..%d)", r->tokens[i],
                            i, t->m.n_vocab - 1);
        }
    }
    if (q->n_past + r->n > t->p.n_ctx) {
        return dfl_fail(DFL_ERR_CAPACITY, "context overflow: %d tokens in context + %d new > context size %d",
                        q->n_past, r->n, t->p.n_ctx);
    }
    return DFL_OK;
}

/* A prompt chunk (a decode of more than n_verify tokens) shares a step with other
 * sequences' rows when the step holds no more rows than a chunk alone (n_ubatch), one
 * chunk a step: the graphs the load reserves the prefill slot for. */
static dfl_status check_shared_chunk(const dfl_target * t, const dfl_rows * rows, int n) {
    int chunks = 0, total = 0;
    for (int i = 0; i < n; i++) {
        chunks += rows[i].kind == DFL_STEP_DECODE && rows[i].n > t->p.n_verify;
        total += rows[i].n;
    }
    if (n > 1 && chunks > 1) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step takes one prompt chunk (a decode of more than n_verify %d), got %d",
                        t->p.n_verify, chunks);
    }
    if (n > 1 && chunks && total > t->p.n_ubatch) {
        return dfl_fail(DFL_ERR_CAPACITY, "a step with a prompt chunk holds at most the ubatch size %d rows, got %d",
                        t->p.n_ubatch, total);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_target_step(dfl_target * t, const dfl_token_source * source, const dfl_rows * rows,
                                   int32_t n) {
    if (!t || !rows || n <= 0) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step needs a target and at least one sequence's rows");
    }
    if (n > t->mem.n_seq) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a step of %d sequences exceeds the target's %d slots", n, t->mem.n_seq);
    }
    TRY(check_shared_chunk(t, rows, n));
    dfl_step step;
    memset(&step, 0, sizeof step);
    step.n_seg = n;
    const int32_t * tokens[DFL_MAX_SEQ];
    bool seen[DFL_MAX_SEQ] = { false };
    for (int i = 0; i < n; i++) {
        const dfl_rows * r = &rows[i];
        struct ggml_tensor * src;
        TRY(check_entry(t, source, r, &src));
        if (seen[r->seq]) {
            return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d appears twice in one step", r->seq);
        }
        seen[r->seq] = true;
        const dfl_seq * q = &t->mem.seq[r->seq];
        verify_seq * vq = &t->verify[r->seq];
        if (r->kind == DFL_STEP_TREE) {
            TRY(dfl_tree_plan(&vq->tree, &t->tree_shapes, r->parents, r->n, t->m.n_recurrent > 0 ? t->m.rec.d_conv : 0));
        }
        step.seg[i] = (dfl_segment) { r->seq, r->kind, r->n, 0, q->n_past, 0,
                                      r->kind == DFL_STEP_DECODE ? r->logits : LOGITS_ALL,
                                      r->kind == DFL_STEP_TREE ? &vq->tree : NULL,
                                      vq->commit.active ? &vq->commit : NULL, src, { 0 }, 0, 0 };
        step.seg[i].feat_at = dfl_memory_features_at(&t->mem, r->seq, q->n_past, r->n,
                                                     dfl_token_source_taken(source, t, r->seq));
        tokens[i] = r->tokens;
    }
    TRY(run_step(t, &step, tokens));
    for (int i = 0; i < n; i++) {
        const dfl_segment * s = &step.seg[i];
        dfl_seq * q = &t->mem.seq[s->seq];
        verify_seq * vq = &t->verify[s->seq];
        vq->commit.active = false;
        /* the slot's feature rows hold this call's rows now: a decode's are committed, a
         * verify's wait for its commit */
        dfl_memory_features_written(&t->mem, s->seq, q->n_past, s->n, s->kind == DFL_STEP_DECODE ? s->n : 0,
                                    s->feat_at);
        if (s->kind == DFL_STEP_DECODE) {
            q->n_past += s->n;
        } else {
            vq->pending = s->n;
            vq->pending_tree = s->kind == DFL_STEP_TREE;
        }
    }
    return DFL_OK;
}

/* Plain decoding's step, one call a token: the host loop crosses into the library once
 * per step instead of once per input staged and result read. */
DFL_API dfl_status dfl_target_decode_next(dfl_target * t, const dfl_token_source * source, const int32_t * seqs,
                                          const int32_t * tokens, const float * u, int32_t n, int32_t * choices,
                                          int64_t * copies) {
    if (!t || !seqs || !tokens || !choices || n <= 0 || n > DFL_MAX_SEQ) {
        return dfl_fail(DFL_ERR_ARGUMENT, "decode_next needs a target and 1..%d sequences' tokens and choices",
                        DFL_MAX_SEQ);
    }
    dfl_rows rows[DFL_MAX_SEQ];
    for (int i = 0; i < n; i++) {
        TRY(dfl_target_check_seq(t, seqs[i]));
        if (u && u[i] >= 0.0f) {
            TRY(dfl_sampler_stage_uniforms(&t->sampler[seqs[i]], &u[i], 1));
        }
        rows[i] = (dfl_rows) { seqs[i], DFL_STEP_DECODE, 1, &tokens[i], NULL, LOGITS_LAST };
    }
    TRY(dfl_target_step(t, source, rows, n));
    TRY(dfl_target_choices(t, choices, 0, n));
    if (copies) {
        dfl_target_last_copies(t, copies);
    }
    return DFL_OK;
}

/* The last graph computed: its splits (runs on one backend) and the bytes the scheduler
 * copies between devices per compute. */
void dfl_target_last_copies(const dfl_target * t, int64_t copies[2]) {
    const int last = t->rt.last_slot;
    copies[0] = last >= 0 ? ggml_backend_sched_get_n_splits(t->rt.slots[last].sched) : 0;
    copies[1] = last >= 0 ? t->rt.slots[last].copy_bytes : 0;
}
