/* Prefix checkpoints: the whole decoding state at a context position, copied to host
 * memory and back through the backend (never through tensor data pointers), so that a
 * later request sharing the prefix resumes there instead of prefilling it again.
 *
 * A position's state is more than the attention cache: recurrent layers carry their
 * Gated DeltaNet and conv states (which cannot be rolled back, only replaced), and the
 * drafter carries its projected context. Everything is saved, or nothing is usable. */
#include "dfl_checkpoint.h"
#include "dfl_target_impl.h"

#include <stdlib.h>
#include <string.h>


struct dfl_checkpoint {
    const dfl_target * target; /* the pair it was taken from, and the only one it restores into */
    const dfl_draft * draft;   /* NULL: the target alone */
    int32_t n_past;
    int32_t draft_first;       /* drafter positions [draft_first, n_past) are kept */
    size_t target_bytes, bytes;
    uint8_t * data;            /* target layers in order, then the drafter's context */
};

/* Per layer, the state a position needs: K and V rows 0..n_past-1 of an attention
 * layer; the conv and recurrent states of a recurrent one. */
static size_t target_bytes(const dfl_target * t, int n_past) {
    size_t bytes = 0;
    for (int il = 0; il < t->m.n_layer; il++) {
        if (t->m.kind[il] == DFL_LAYER_RECURRENT) {
            bytes += ggml_nbytes(t->conv_state[il]) + ggml_nbytes(t->ssm_state[il]);
        } else {
            bytes += (t->k_cache[il]->nb[1] + t->v_cache[il]->nb[1]) * (size_t) n_past;
        }
    }
    return bytes;
}

static void target_copy(dfl_target * t, uint8_t * host, int n_past, bool to_target) {
    for (int il = 0; il < t->m.n_layer; il++) {
        struct ggml_tensor * parts[2];
        size_t sizes[2];
        if (t->m.kind[il] == DFL_LAYER_RECURRENT) {
            parts[0] = t->conv_state[il];
            parts[1] = t->ssm_state[il];
            sizes[0] = ggml_nbytes(parts[0]);
            sizes[1] = ggml_nbytes(parts[1]);
        } else {
            parts[0] = t->k_cache[il];
            parts[1] = t->v_cache[il];
            sizes[0] = parts[0]->nb[1] * (size_t) n_past;
            sizes[1] = parts[1]->nb[1] * (size_t) n_past;
        }
        for (int k = 0; k < 2; k++) {
            if (sizes[k] == 0) {
                continue;
            }
            if (to_target) {
                ggml_backend_tensor_set(parts[k], host, 0, sizes[k]);
            } else {
                ggml_backend_tensor_get(parts[k], host, 0, sizes[k]);
            }
            host += sizes[k];
        }
    }
}

DFL_API dfl_status dfl_checkpoint_measure(const dfl_target * t, const dfl_draft * d, uint64_t * bytes) {
    if (!t || !bytes) {
        return dfl_fail(DFL_ERR_ARGUMENT, "measuring a checkpoint needs a target");
    }
    *bytes = target_bytes(t, t->n_past);
    if (d) {
        *bytes += dfl_draft_context_bytes(d, dfl_draft_first_visible(d), dfl_draft_n_tokens(d));
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_checkpoint_save(dfl_target * t, dfl_draft * d, dfl_checkpoint ** out) {
    if (!t || !out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a checkpoint needs a target");
    }
    *out = NULL;
    if (d && dfl_draft_target(d) != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the drafter was loaded for another target");
    }
    /* between a verify and the graph that carries its commit, the recurrent state is
     * not yet the committed position's */
    if (t->pending_verify || t->commit.active) {
        return dfl_fail(DFL_ERR_STATE, "the target is between a verify and its commit: checkpoints are taken "
                        "after a decode (a prefill)");
    }
    if (t->n_past == 0) {
        return dfl_fail(DFL_ERR_STATE, "the context is empty: nothing to checkpoint");
    }
    if (d && dfl_draft_n_tokens(d) != t->n_past) {
        return dfl_fail(DFL_ERR_STATE, "the drafter holds %d context positions, the target %d: append the target's "
                        "features before taking a checkpoint", dfl_draft_n_tokens(d), t->n_past);
    }
    dfl_checkpoint * c = calloc(1, sizeof *c);
    if (!c) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    c->target = t;
    c->draft = d;
    c->n_past = t->n_past;
    c->draft_first = d ? dfl_draft_first_visible(d) : 0;
    c->target_bytes = target_bytes(t, c->n_past);
    c->bytes = c->target_bytes + (d ? dfl_draft_context_bytes(d, c->draft_first, c->n_past) : 0);
    c->data = malloc(c->bytes);
    if (!c->data) {
        free(c);
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory for a checkpoint of %zu bytes", c->bytes);
    }
    target_copy(t, c->data, c->n_past, false);
    if (d) {
        dfl_draft_context_copy(d, c->data + c->target_bytes, c->draft_first, c->n_past, false);
    }
    *out = c;
    return DFL_OK;
}

DFL_API dfl_status dfl_checkpoint_restore(const dfl_checkpoint * c, dfl_target * t, dfl_draft * d) {
    if (!c || !t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "restoring needs a checkpoint and a target");
    }
    if (c->target != t) {
        return dfl_fail(DFL_ERR_ARGUMENT, "the checkpoint was taken from another target");
    }
    if (d && c->draft != d) {
        return dfl_fail(DFL_ERR_ARGUMENT, c->draft ? "the checkpoint was taken with another drafter"
                                                   : "the checkpoint holds no drafter context");
    }
    target_copy(t, c->data, c->n_past, true);
    t->n_past = c->n_past;
    t->pending_verify = 0;
    t->pending_tree = false;
    t->commit.active = false;
    t->n_out = 0;
    t->n_rows = 0; /* the features of the last call belong to another context */
    if (d) {
        dfl_draft_context_copy(d, c->data + c->target_bytes, c->draft_first, c->n_past, true);
    }
    return DFL_OK;
}

DFL_API int32_t dfl_checkpoint_n_past(const dfl_checkpoint * c) { return c ? c->n_past : 0; }

DFL_API uint64_t dfl_checkpoint_bytes(const dfl_checkpoint * c) { return c ? (uint64_t) c->bytes : 0; }

DFL_API void dfl_checkpoint_free(dfl_checkpoint * c) {
    if (c) {
        free(c->data);
        free(c);
    }
}
