/* Memory plan of a target and its drafter, before anything is allocated: the same
 * placement, state tensors and graphs as a real load, with every weight and state
 * tensor on a zero-size placeholder buffer so that ggml's allocator measures the graphs'
 * compute memory without allocating it, as llama.cpp's no_alloc mode does. The planner
 * reads both runtimes' insides (their loading steps, memory and graph builders over
 * descriptors); neither runtime calls it. */
#include "dfl_draft_state.h"
#include "dfl_target_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { PART_KV, PART_RECURRENT, PART_SCRATCH } state_part;

static state_part part_of(const dfl_target * t, const struct ggml_tensor * c) {
    const dfl_memory * mem = &t->mem;
    for (int il = 0; il < t->m.n_layer; il++) {
        if (c == mem->k[il] || c == mem->v[il]) {
            return PART_KV;
        }
        if (c == mem->conv[il] || c == mem->ssm[il]) {
            return PART_RECURRENT;
        }
    }
    return PART_SCRATCH;
}

static void max_into(size_t dst[2], const size_t a[2]) {
    for (int k = 0; k < 2; k++) {
        dst[k] = a[k] > dst[k] ? a[k] : dst[k];
    }
}

static void measure_graph(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, void * user) {
    size_t (*sizes)[2] = user; /* [0]: the prefill slot, [1]: the largest step slot */
    size_t got[2];
    dfl_runtime_measure(rt, slot, gf, got);
    max_into(sizes[slot == 0 ? 0 : 1], got);
}

/* The target's compute memory: its prefill slot and every step slot at their worst
 * graphs (dfl_target_worst_graphs, which a load reserves). */
static dfl_status target_compute(dfl_target * t, size_t out[2]) {
    size_t sizes[2][2] = { { 0, 0 }, { 0, 0 } };
    TRY(dfl_target_worst_graphs(t, measure_graph, sizes));
    for (int k = 0; k < 2; k++) {
        out[k] = sizes[0][k] + (size_t) (t->rt.n_slots - 1) * sizes[1][k];
    }
    return DFL_OK;
}

/* As at load: a tied embedding its device takes only in row slices is gathered from a
 * copy in host memory. */
static dfl_status plan_host_lookup(dfl_target * t, ggml_backend_buffer_t host) {
    struct ggml_init_params ip = { ggml_tensor_overhead(), NULL, true };
    t->ctx_lookup = ggml_init(ip);
    if (!t->ctx_lookup) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    t->tok_lookup = ggml_dup_tensor(t->ctx_lookup, t->m.tok_embd);
    ggml_set_name(t->tok_lookup, ggml_get_name(t->m.tok_embd));
    dfl_runtime_place_dummy(t->tok_lookup, host);
    return DFL_OK;
}

/* Bytes of one part of a plan; weights[0] and compute[0] on the part's device, [1] on
 * the CPU when that is another device. */
typedef struct part_sizes {
    size_t weights[2], cache, compute[2];
} part_sizes;

/* The drafter's weights, memory (its caches per slot, its blocks) and compute: slot 0
 * holds the larger of a propose of every sequence over the whole attention span and a
 * prefill chunk's entries alone; slot 1 the rank graph over that propose's logits and
 * softmax (top_k > 1). Its weights go where its placements by name put them (dummies:
 * weights on its device, weights on the CPU, state). */
static dfl_status plan_draft_with(dfl_draft * d, ggml_backend_buffer_t dummies[3], part_sizes * out) {
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d->rt.dev);
    ggml_backend_buffer_t dummy = dummies[2];
    const dfl_gguf * g = &d->m.file;
    ggml_backend_dev_t * dev_of = NULL;
    TRY(dfl_gguf_devices(g, d->p.weight_placements, d->p.n_weight_placements, d->rt.dev, d->rt.dev_cpu, &dev_of));
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta); i++) {
        if (g->used[i]) {
            struct ggml_tensor * w = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
            const int k = dev_of[i] == d->rt.dev ? 0 : 1;
            out->weights[k] += ggml_backend_buft_get_alloc_size(ggml_backend_dev_buffer_type(dev_of[i]), w);
            dfl_runtime_place_dummy(w, dummies[k]);
        }
    }
    free(dev_of);
    int n_kept;
    TRY(dfl_draft_kept_count(d, &n_kept));
    if (n_kept > 0) {
        /* a cut head's rows are a copy beside the whole head, in its memory (host memory:
         * the CPU's part when the drafter runs on another device), and their ids (the
         * propose's compute grows by the kept logits only: [n_kept, drafted rows]) */
        const struct ggml_tensor * head = d->m.head;
        const int k = d->rt.dev != d->rt.dev_cpu && ggml_backend_buffer_is_host(head->buffer) ? 1 : 0;
        out->weights[k] += ggml_row_size(head->type, head->ne[0]) * (size_t) n_kept + (size_t) n_kept * sizeof(int32_t);
    }
    TRY(dfl_draft_define_state(d));
    struct ggml_context * state[2] = { d->mem.ctx[0], d->ctx_blocks };
    for (int k = 0; k < 2; k++) {
        for (struct ggml_tensor * c = ggml_get_first_tensor(state[k]); c; c = ggml_get_next_tensor(state[k], c)) {
            out->cache += ggml_backend_buft_get_alloc_size(buft, c);
            dfl_runtime_place_dummy(c, dummy);
        }
    }
    size_t sizes[2][2] = { { 0, 0 }, { 0, 0 } };
    TRY(dfl_draft_worst_graphs(d, measure_graph, sizes, dummy));
    for (int k = 0; k < 2; k++) {
        out->compute[k] = sizes[0][k] + sizes[1][k];
    }
    return DFL_OK;
}

static dfl_status plan_draft(const char * path, dfl_target * t, const dfl_draft_params * params, part_sizes * out) {
    memset(out, 0, sizeof *out);
    dfl_draft * d;
    TRY(dfl_draft_open(path, t, params, &d));
    ggml_backend_buffer_t dummies[3] = { dfl_runtime_dummy_weights(d->rt.dev),
                                         dfl_runtime_dummy_weights(d->rt.dev_cpu),
                                         dfl_runtime_dummy_buffer(d->rt.dev) };
    const dfl_status st = dummies[0] && dummies[1] && dummies[2]
                              ? plan_draft_with(d, dummies, out)
                              : dfl_fail(DFL_ERR_BACKEND, "cannot plan for device %s", ggml_backend_dev_name(d->rt.dev));
    for (int k = 0; k < 3; k++) {
        if (dummies[k]) {
            ggml_backend_buffer_free(dummies[k]);
        }
    }
    dfl_draft_free(d);
    return st;
}

/* dummies: per device [model's, CPU], placeholders for weights ([0], [1]) and for state
 * ([2], [3]), whose buffers ggml's scheduler tells apart */
static dfl_status plan_with(dfl_target * t, const char * draft_path, const dfl_draft_params * draft_params,
                            ggml_backend_buffer_t dummies[4], dfl_plan * plan) {
    const ggml_backend_dev_t devs[2] = { t->rt.dev, t->rt.dev_cpu };
    const int n_dev = t->rt.dev == t->rt.dev_cpu ? 1 : 2;
    plan->n_devices = n_dev;
    for (int k = 0; k < n_dev; k++) {
        dfl_plan_device * pd = &plan->devices[k];
        snprintf(pd->name, sizeof pd->name, "%s", ggml_backend_dev_name(devs[k]));
        size_t free_mem = 0, total = 0;
        ggml_backend_dev_memory(devs[k], &free_mem, &total);
        pd->free = free_mem;
        pd->total = total;
        dummies[k] = dfl_runtime_dummy_weights(devs[k]);
        dummies[2 + k] = dfl_runtime_dummy_buffer(devs[k]);
        if (!dummies[k] || !dummies[2 + k]) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot plan for device %s", pd->name);
        }
    }

    const dfl_gguf * g = &t->m.file;
    ggml_backend_dev_t * dev_of = dfl_target_weight_devices(t);
    if (!dev_of) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(g->meta); i++) {
        if (!g->used[i]) {
            continue; /* not loaded: the model does not ask for it */
        }
        struct ggml_tensor * w = ggml_get_tensor(g->ctx, gguf_get_tensor_name(g->meta, i));
        const int k = dev_of[i] == devs[0] ? 0 : 1;
        dfl_plan_device * pd = &plan->devices[k];
        const size_t size = ggml_backend_buft_get_alloc_size(ggml_backend_dev_buffer_type(devs[k]), w);
        pd->target_weights += size;
        if (w == t->m.tok_embd) {
            pd->target_embd += size;
        } else if (w == t->m.output || w == t->m.output_norm) {
            pd->target_output += size;
        } else if (dfl_gguf_is_expert(w->name)) {
            pd->target_experts += size;
        }
        dfl_runtime_place_dummy(w, dummies[k]);
    }
    free(dev_of);
    TRY(dfl_gguf_slice_weights(&t->m.file));
    for (int i = 0; i < g->n_sliced; i++) {
        if (g->sliced[i].whole == t->m.tok_embd) {
            TRY(plan_host_lookup(t, dummies[1]));
            const size_t size = ggml_backend_buft_get_alloc_size(ggml_backend_dev_buffer_type(devs[1]), t->tok_lookup);
            plan->devices[1].target_weights += size;
            plan->devices[1].target_embd += size;
        }
    }

    TRY(dfl_target_define_state(t));
    for (int k = 0; k < n_dev; k++) {
        dfl_plan_device * pd = &plan->devices[k];
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(devs[k]);
        for (struct ggml_tensor * c = ggml_get_first_tensor(t->mem.ctx[k]); c;
             c = ggml_get_next_tensor(t->mem.ctx[k], c)) {
            const size_t size = ggml_backend_buft_get_alloc_size(buft, c);
            switch (part_of(t, c)) {
                case PART_KV: pd->kv_cache += size; break;
                case PART_RECURRENT: pd->recurrent_state += size; break;
                case PART_SCRATCH: pd->verify_scratch += size; break;
            }
            dfl_runtime_place_dummy(c, dummies[2 + k]);
        }
    }

    size_t compute[2];
    TRY(target_compute(t, compute));
    for (int k = 0; k < n_dev; k++) {
        plan->devices[k].target_compute = compute[k];
    }
    if (draft_path) {
        part_sizes d;
        TRY(plan_draft(draft_path, t, draft_params, &d));
        plan->devices[0].draft_cache = d.cache;
        for (int k = 0; k < n_dev; k++) {
            plan->devices[k].draft_weights = d.weights[k];
            plan->devices[k].draft_compute = d.compute[k];
        }
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_plan_memory(const char * target_path, const dfl_target_params * target_params,
                                   const char * draft_path, const dfl_draft_params * draft_params, dfl_plan * plan) {
    if (!plan) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null plan");
    }
    memset(plan, 0, sizeof *plan);
    dfl_target * t;
    TRY(dfl_target_open(target_path, target_params, &t));
    ggml_backend_buffer_t dummies[4] = { NULL, NULL, NULL, NULL };
    const dfl_status st = plan_with(t, draft_path, draft_params, dummies, plan);
    dfl_target_free(t);
    for (int k = 0; k < 4; k++) {
        if (dummies[k]) {
            ggml_backend_buffer_free(dummies[k]);
        }
    }
    return st;
}
