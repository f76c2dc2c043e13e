/* Where the target's parts live: each layer on the device or the CPU (n_gpu_layers),
 * each weight with its layer or as the caller placed it by name, the caches and states
 * with their layer's weights; the weights loaded there, and the head cut to the kept
 * tokens. Kept apart from loading so that the memory planner (dfl_plan.c) can ask the
 * same questions without loading anything. */
#include "dfl_target_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Layers il >= dfl_target_first_device_layer run on the device, the ones before on the CPU. */
int dfl_target_first_device_layer(const dfl_target * t) {
    const int n_layer = t->m.n_layer;
    if (t->rt.dev == t->rt.dev_cpu || t->p.n_gpu_layers < 0 || t->p.n_gpu_layers >= n_layer) {
        return 0;
    }
    return n_layer - t->p.n_gpu_layers;
}

static ggml_backend_dev_t layer_device(const dfl_target * t, int il) {
    return il >= dfl_target_first_device_layer(t) ? t->rt.dev : t->rt.dev_cpu;
}

static ggml_backend_dev_t output_device(const dfl_target * t) {
    return t->p.n_gpu_layers < 0 || t->p.n_gpu_layers > t->m.n_layer ? t->rt.dev : t->rt.dev_cpu;
}

/* Device of each weight, in file order (NULL when out of host memory). As in
 * llama.cpp, the token embedding stays on the CPU (it is only gathered from) unless it
 * doubles as the LM head. */
ggml_backend_dev_t * dfl_target_weight_devices(const dfl_target * t) {
    const dfl_gguf * g = &t->m.file;
    const int64_t n = gguf_get_n_tensors(g->meta);
    ggml_backend_dev_t * dev_of = malloc((size_t) (n + 1) * sizeof *dev_of);
    if (!dev_of) {
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        const char * name = gguf_get_tensor_name(g->meta, i);
        int il = -1;
        if (t->placed && t->placed[i]) {
            dev_of[i] = t->placed[i];
        } else if (sscanf(name, "blk.%d.", &il) == 1) {
            dev_of[i] = il < t->m.n_layer ? layer_device(t, il) : t->rt.dev_cpu;
        } else if (strcmp(name, "token_embd.weight") == 0 && t->m.output != t->m.tok_embd) {
            dev_of[i] = t->rt.dev_cpu;
        } else {
            dev_of[i] = output_device(t);
        }
    }
    return dev_of;
}

/* Bytes of the layers' weights that stay in host memory while the model runs on another
 * device: what its verifies compute on the CPU. */
static uint64_t host_layer_weights(const dfl_target * t, ggml_backend_dev_t const * dev_of) {
    const dfl_gguf * g = &t->m.file;
    uint64_t bytes = 0;
    int il;
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta) && t->rt.dev != t->rt.dev_cpu; i++) {
        const char * name = gguf_get_tensor_name(g->meta, i);
        if (g->used[i] && dev_of[i] == t->rt.dev_cpu && sscanf(name, "blk.%d.", &il) == 1) {
            bytes += ggml_nbytes(ggml_get_tensor(g->ctx, name));
        }
    }
    return bytes;
}

/* A token embedding tied to the LM head lives with the LM head. When the device takes it
 * only in row slices (dfl_gguf_mul_mat), the lookup cannot gather from it whole: it gets
 * a copy in host memory, where an untied embedding would have stayed anyway. */
static dfl_status copy_lookup_to_host(dfl_target * t) {
    const struct ggml_tensor * w = t->m.tok_embd;
    struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
    t->ctx_lookup = ggml_init(ip);
    if (!t->ctx_lookup) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    struct ggml_tensor * copy = ggml_new_tensor_2d(t->ctx_lookup, w->type, w->ne[0], w->ne[1]);
    ggml_set_name(copy, ggml_get_name(w));
    t->buf_lookup = ggml_backend_alloc_ctx_tensors_from_buft(t->ctx_lookup, ggml_backend_dev_buffer_type(t->rt.dev_cpu));
    if (!t->buf_lookup) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot allocate a host copy of the token embedding of '%s' (%zu bytes)",
                        t->m.file.path, ggml_nbytes(w));
    }
    ggml_backend_buffer_set_usage(t->buf_lookup, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_copy(t->m.tok_embd, copy);
    t->tok_lookup = copy;
    return DFL_OK;
}

dfl_status dfl_target_place_weights(dfl_target * t) {
    ggml_backend_dev_t * dev_of = dfl_target_weight_devices(t);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    t->host_layer_weights = host_layer_weights(t, dev_of);
    dfl_status st = dfl_gguf_load_weights(&t->m.file, dev_of, !t->p.no_repack);
    free(dev_of);
    for (int i = 0; st == DFL_OK && i < t->m.file.n_sliced; i++) {
        if (t->m.file.sliced[i].whole == t->m.tok_embd) {
            st = copy_lookup_to_host(t);
        }
    }
    return st;
}

dfl_status dfl_check_head_tokens(const int32_t * ids, int n, int n_vocab, const char * path) {
    if (n == 0) {
        return DFL_OK;
    }
    if (n < 0 || n > n_vocab || !ids) {
        return dfl_fail(DFL_ERR_ARGUMENT, "an output head cut to %d tokens: keep 1..%d (the vocabulary of '%s'), "
                        "or 0 for the whole head", n, n_vocab, path);
    }
    uint8_t * seen = calloc((size_t) n_vocab, 1);
    if (!seen) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    dfl_status st = DFL_OK;
    for (int i = 0; i < n && st == DFL_OK; i++) {
        const int32_t tok = ids[i];
        if (tok < 0 || tok >= n_vocab) {
            st = dfl_fail(DFL_ERR_ARGUMENT, "kept head token %d (entry %d) is outside the vocabulary 0..%d", tok, i,
                          n_vocab - 1);
        } else if (seen[tok]++) {
            st = dfl_fail(DFL_ERR_ARGUMENT, "kept head token %d is listed twice", tok);
        }
    }
    free(seen);
    return st;
}

/* The head cut to the kept tokens' rows of the output weight (tied: of the embedding). */
dfl_status dfl_target_cut_head(dfl_target * t, const dfl_target_params * p) {
    if (!p || p->n_head_tokens == 0) {
        return DFL_OK;
    }
    TRY(dfl_gguf_weight_rows(&t->m.file, t->m.output, p->head_tokens, p->n_head_tokens, !t->p.no_repack,
                             &t->ctx_head, &t->buf_head, &t->head));
    t->n_head = p->n_head_tokens;
    return DFL_OK;
}

/* Caches and recurrent states live with their layer's weights (the memory's tensors on
 * the device or on the CPU), the features with the output. Tensors only: alloc_state
 * gives them memory. */
dfl_status dfl_target_define_state(dfl_target * t) {
    bool on_device[DFL_MAX_LAYERS];
    for (int il = 0; il < t->m.n_layer; il++) {
        on_device[il] = layer_device(t, il) == t->rt.dev;
    }
    const dfl_memory_layout layout = { t->m.n_layer, t->m.kind, t->m.attn, &t->m.rec };
    const int call_rows = t->p.n_ubatch > t->p.n_verify ? t->p.n_ubatch : t->p.n_verify;
    /* a sliding layer's ring keeps a verify's rows spare after it, for a tree's rows that
     * reach past the ring's end before their positions do (dfl_target_graph.c: ring_slot) */
    bool windowed = false;
    for (int il = 0; il < t->m.n_layer; il++) {
        windowed |= t->m.kind[il] == DFL_LAYER_ATTENTION && t->m.attn[il].window > 0;
    }
    const dfl_memory_params mp = { .n_seq = t->p.n_seq, .n_ctx = t->p.n_ctx, .n_ubatch = t->p.n_ubatch,
                                   .n_verify = t->p.n_verify, .type_k = (enum ggml_type) t->p.kv_type,
                                   .type_v = (enum ggml_type) t->p.kv_type_v, .on_device = on_device,
                                   .window_rows = call_rows, .spare = windowed ? t->p.n_verify : 0,
                                   .feature_floats = t->p.n_feature_layers * t->m.n_embd,
                                   .features_on_device = output_device(t) == t->rt.dev, .state_floats = 0 };
    for (int s = 0; s < DFL_MAX_SEQ; s++) {
        dfl_verify_seq_reset(&t->verify[s]);
    }
    return dfl_memory_define(&t->mem, &layout, &mp);
}
