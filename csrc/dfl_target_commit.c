/* A verify's commit: the rows kept of a chain or a root-to-node path of a tree,
 * recorded as the commit the sequence's next graph carries (its KV rows moved, its
 * recurrent and conv states rerun from the kept rows). Also the verify protocol's
 * bookkeeping of each slot between calls (verify_seq): whether a verify or a commit
 * waits, and its reset when the slot is written from outside. */
#include "dfl_target_state.h"

#include <string.h>

void dfl_verify_seq_reset(verify_seq * v) {
    v->pending = 0;
    v->pending_tree = false;
    v->commit.active = false;
    v->last_chain = 0;
    v->chain_steady = DFL_CHAIN_STEADY;
}

void dfl_target_seq_restored(dfl_target * t, int seq, int n_past) {
    dfl_memory_seq_restored(&t->mem, seq, n_past);
    dfl_verify_seq_reset(&t->verify[seq]);
}

bool dfl_target_seq_settled(const dfl_target * t, int seq) {
    return !t->verify[seq].pending && !t->verify[seq].commit.active;
}

DFL_API dfl_status dfl_target_commit(dfl_target * t, int32_t seq, int32_t n_keep) {
    TRY(dfl_target_check_seq(t, seq));
    dfl_seq * q = &t->mem.seq[seq];
    verify_seq * vq = &t->verify[seq];
    const int n = vq->pending;
    if (n == 0) {
        return dfl_fail(DFL_ERR_STATE, "commit without a preceding verify");
    }
    if (vq->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "a tree verify is committed with dfl_target_commit_path");
    }
    if (n_keep < 0 || n_keep > n) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d verified tokens", n_keep, n);
    }
    vq->pending = 0;
    vq->chain_steady = n == vq->last_chain || vq->last_chain == 0 ? vq->chain_steady + 1 : 0;
    vq->last_chain = n;
    /* a chain's attention rows are already in place: only recurrent layers have work */
    if (n_keep > 0 && t->m.n_recurrent > 0) {
        pending_commit * pc = &vq->commit;
        pc->active = true;
        pc->tree = false;
        pc->p0 = q->n_past;
        pc->n_keep = n_keep;
        /* chain verifies of one length reuse one graph when their commits rerun every
         * verified row; while the lengths vary (a confidence cut), the graphs differ
         * anyway and only the kept rows are rerun, sparing the identity steps */
        pc->n_replay = vq->chain_steady >= DFL_CHAIN_STEADY ? n : n_keep;
        for (int k = 0; k < n_keep; k++) {
            pc->path[k] = k;
        }
        for (int j = 0; j < t->m.rec.d_conv - 1; j++) {
            pc->conv_cols[j] = n_keep + j;
        }
    }
    dfl_memory_features_kept(&t->mem, seq, NULL, n_keep);
    q->n_past += n_keep;
    return DFL_OK;
}

/* Keep a root-to-node path of the last tree verify: its KV rows move to consecutive
 * cells, the recurrent state becomes the last node's, the conv state the inputs along
 * the path. */
DFL_API dfl_status dfl_target_commit_path(dfl_target * t, int32_t seq, const int32_t * path, int32_t n_keep) {
    TRY(dfl_target_check_seq(t, seq));
    dfl_seq * q = &t->mem.seq[seq];
    verify_seq * vq = &t->verify[seq];
    if (vq->pending == 0 || !vq->pending_tree) {
        return dfl_fail(DFL_ERR_STATE, "commit_path needs a preceding tree verify");
    }
    const tree_plan * tp = &vq->tree;
    if (n_keep < 0 || n_keep > tp->n || (n_keep > 0 && !path)) {
        return dfl_fail(DFL_ERR_ARGUMENT, "cannot keep %d of %d tree nodes", n_keep, tp->n);
    }
    for (int k = 0; k < n_keep; k++) {
        const bool ok = path[k] >= 0 && path[k] < tp->n && (k == 0 ? path[k] == 0 : tp->parent[path[k]] == path[k - 1]);
        if (!ok) {
            return dfl_fail(DFL_ERR_ARGUMENT, "path entry %d (node %d) does not continue a root-to-node path", k, path[k]);
        }
    }
    vq->pending = 0;
    vq->pending_tree = false;
    dfl_memory_features_kept(&t->mem, seq, path, n_keep);
    if (n_keep > 0) {
        const int W = t->m.rec.d_conv - 1, last = path[n_keep - 1];
        pending_commit * pc = &vq->commit;
        pc->active = true;
        pc->tree = true;
        pc->p0 = q->n_past;
        pc->n_keep = n_keep;
        /* the kept path is no longer than the spine: a larger tree's other rows would be
         * identity steps, each as dear as a real one */
        pc->n_replay = t->m.n_recurrent > 0 ? tp->shape.spine : tp->n;
        memcpy(pc->path, path, (size_t) n_keep * sizeof(int32_t));
        for (int j = 0; j < W; j++) {
            pc->conv_cols[j] = tp->windows[(size_t) last * (W + 1) + j + 1];
        }
        q->n_past += n_keep;
    }
    return DFL_OK;
}
