/* A greedy chain step in one call (dfl_chain_step): drafter and target through their
 * public entry points, so that neither runtime calls into the other. */
#include "dfl_error.h"
#include "dfl_pair.h"
#include "dfl_runtime.h"

#include "ggml.h"

#include <math.h>

DFL_API int32_t dfl_confident_drafts(const float * top1_lp, int32_t n, float p_min) {
    if (!(p_min > 0.0f)) {
        return n;
    }
    const float floor = logf(p_min);
    for (int32_t i = 0; i < n; i++) {
        if (top1_lp[i] < floor) {
            return i;
        }
    }
    return n;
}

DFL_API int32_t dfl_agreed_drafts(const int32_t * block, const int32_t * choice, int32_t b) {
    int32_t n = 0;
    while (n < b - 1 && block[n + 1] == choice[n]) {
        n++;
    }
    return n;
}

DFL_API dfl_status dfl_chain_step(dfl_target * target, dfl_draft * draft, dfl_chain_seq * seqs, int32_t n,
                                  float p_min, int64_t * copies, int64_t * us) {
    if (!target || !draft || !seqs || n <= 0 || n > DFL_MAX_SEQ) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a chain step needs a target, a drafter and 1..%d sequences", DFL_MAX_SEQ);
    }
    if (!(p_min >= 0.0f && p_min <= 1.0f)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "p_min %g is outside 0..1", (double) p_min);
    }
    const int64_t t0 = ggml_time_us();
    dfl_block blocks[DFL_MAX_SEQ];
    for (int i = 0; i < n; i++) {
        const dfl_chain_seq * s = &seqs[i];
        if (s->n_block < 2 || s->n_block > DFL_MAX_BLOCK || !s->out) {
            return dfl_fail(DFL_ERR_ARGUMENT, "sequence %d: a chain step drafts a block of 2..%d into out",
                            (int) s->seq, DFL_MAX_BLOCK);
        }
        blocks[i] = (dfl_block) { s->seq, s->tokens, s->n_tokens, s->bonus, s->n_block };
    }
    TRY(dfl_draft_propose(draft, blocks, n));
    /* the chains' lengths, cut by the drafter's confidence: the only read before the verify */
    dfl_rows rows[DFL_MAX_SEQ];
    int total = 0, drafted = 0;
    for (int i = 0; i < n; i++) {
        dfl_chain_seq * s = &seqs[i];
        int b = s->n_block;
        if (p_min > 0.0f) {
            float lp[DFL_MAX_BLOCK];
            TRY(dfl_draft_top1(draft, drafted, b - 1, NULL, lp));
            b = 1 + dfl_confident_drafts(lp, b - 1, p_min);
        }
        drafted += s->n_block - 1;
        s->n_verified = b;
        /* a chain cut to its bonus verifies the host's token: nothing to read on the device */
        rows[i] = (dfl_rows) { s->seq, DFL_STEP_CHAIN, b, b == 1 ? &s->bonus : NULL, NULL, 0 };
        total += b;
    }
    const int64_t t1 = ggml_time_us();
    TRY(dfl_target_step(target, dfl_draft_tokens(draft), rows, n));
    int32_t choice[DFL_MAX_SEQ * DFL_MAX_BLOCK];
    TRY(dfl_target_choices(target, choice, 0, total));
    int row0 = 0;
    for (int i = 0; i < n; i++) {
        dfl_chain_seq * s = &seqs[i];
        const int b = s->n_verified;
        int32_t block[DFL_MAX_BLOCK];
        block[0] = s->bonus;
        if (b > 1) {
            TRY(dfl_draft_block(draft, s->seq, block, b));
        }
        const int n_acc = dfl_agreed_drafts(block, &choice[row0], b);
        for (int j = 0; j < n_acc; j++) {
            s->out[j] = block[j + 1];
        }
        s->out[n_acc] = choice[row0 + n_acc];
        s->n_out = n_acc + 1;
        TRY(dfl_target_commit(target, s->seq, n_acc + 1));
        row0 += b;
    }
    if (copies) {
        dfl_target_info info;
        TRY(dfl_target_get_info(target, &info));
        copies[0] = info.n_last_splits;
        copies[1] = info.last_copy_bytes;
    }
    if (us) {
        us[0] = t1 - t0;
        us[1] = ggml_time_us() - t1;
    }
    return DFL_OK;
}
