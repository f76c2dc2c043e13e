#include "dfl_runtime.h"

#include <stdlib.h>
#include <string.h>

static ggml_backend_dev_t pick_device(const char * name) {
    if (name && name[0]) {
        return ggml_backend_dev_by_name(name);
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type t = ggml_backend_dev_type(d);
        if (t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return d;
        }
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

static void set_threads(ggml_backend_t backend, int n_threads) {
    if (n_threads <= 0) {
        return;
    }
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    if (!reg) {
        return;
    }
    ggml_backend_set_n_threads_t fn =
        (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
    if (fn) {
        fn(backend, n_threads);
    }
}

dfl_status dfl_runtime_init(dfl_runtime * rt, const char * device, int n_threads) {
    memset(rt, 0, sizeof *rt);
    rt->dev = pick_device(device);
    if (!rt->dev) {
        return dfl_fail(DFL_ERR_BACKEND, "no ggml device named '%s' (see dfl_device_describe)", device ? device : "");
    }
    rt->backend = ggml_backend_dev_init(rt->dev, NULL);
    if (!rt->backend) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot initialise device %s", ggml_backend_dev_name(rt->dev));
    }
    ggml_backend_t backends[2] = { rt->backend, NULL };
    int n_backends = 1;
    if (ggml_backend_dev_type(rt->dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        rt->backend_cpu = rt->backend;
    } else {
        rt->backend_cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
        if (!rt->backend_cpu) {
            dfl_runtime_free(rt);
            return dfl_fail(DFL_ERR_BACKEND, "cannot initialise the CPU backend");
        }
        backends[n_backends++] = rt->backend_cpu;
    }
    rt->dev_cpu = ggml_backend_get_device(rt->backend_cpu);
    set_threads(rt->backend_cpu, n_threads);

    rt->sched = ggml_backend_sched_new(backends, NULL, n_backends, DFL_GRAPH_SIZE, false, true);
    rt->graph_mem_size = ggml_tensor_overhead() * DFL_GRAPH_SIZE + ggml_graph_overhead_custom(DFL_GRAPH_SIZE, false);
    rt->graph_mem = malloc(rt->graph_mem_size);
    if (!rt->sched || !rt->graph_mem) {
        dfl_runtime_free(rt);
        return dfl_fail(DFL_ERR_BACKEND, "cannot create the graph scheduler");
    }
    return DFL_OK;
}

void dfl_runtime_free(dfl_runtime * rt) {
    if (rt->ctx_graph) ggml_free(rt->ctx_graph);
    if (rt->sched) ggml_backend_sched_free(rt->sched);
    if (rt->backend_cpu && rt->backend_cpu != rt->backend) ggml_backend_free(rt->backend_cpu);
    if (rt->backend) ggml_backend_free(rt->backend);
    free(rt->graph_mem);
    memset(rt, 0, sizeof *rt);
}

void dfl_runtime_begin_graph(dfl_runtime * rt) {
    if (rt->ctx_graph) {
        ggml_free(rt->ctx_graph);
    }
    struct ggml_init_params ip = { rt->graph_mem_size, rt->graph_mem, true };
    rt->ctx_graph = ggml_init(ip);
    ggml_backend_sched_reset(rt->sched);
}

dfl_status dfl_runtime_alloc(dfl_runtime * rt, struct ggml_cgraph * gf) {
    if (!ggml_backend_sched_alloc_graph(rt->sched, gf)) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot allocate compute memory for a graph of %d nodes", ggml_graph_n_nodes(gf));
    }
    return DFL_OK;
}

dfl_status dfl_runtime_compute(dfl_runtime * rt, struct ggml_cgraph * gf) {
    if (ggml_backend_sched_graph_compute(rt->sched, gf) != GGML_STATUS_SUCCESS) {
        return dfl_fail(DFL_ERR_BACKEND, "graph computation failed");
    }
    return DFL_OK;
}
