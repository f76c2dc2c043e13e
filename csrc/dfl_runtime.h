/* Devices, scheduler and per-call graph memory shared by the target and the drafter. */
#ifndef DFL_RUNTIME_H
#define DFL_RUNTIME_H

#include "dfl_error.h"

#include "ggml.h"
#include "ggml-backend.h"

/* Graph nodes a runtime holds unless it asks for more (dfl_runtime_init). */
#define DFL_GRAPH_SIZE 16384

typedef struct dfl_runtime {
    ggml_backend_dev_t dev;     /* where weights and state live */
    ggml_backend_t backend;     /* on dev */
    ggml_backend_t backend_cpu; /* fallback for ops dev cannot run; == backend on CPU */
    ggml_backend_dev_t dev_cpu; /* host device: layers not offloaded to dev live here */
    ggml_backend_sched_t sched;
    int n_threads;              /* CPU threads (the CPU backend's, also when dev is another) */
    void * graph_mem;
    size_t graph_size;          /* nodes per graph */
    size_t graph_mem_size;
    struct ggml_context * ctx_graph;
    struct dfl_profile * profile; /* per-op times when DFLASH_PROFILE is set, printed at free */
} dfl_runtime;

/* `name` labels the DFLASH_PROFILE report ("target", "drafter"); graphs hold up to
 * graph_size nodes (at least DFL_GRAPH_SIZE). */
dfl_status dfl_runtime_init(dfl_runtime * rt, const char * device, int n_threads, const char * name,
                           size_t graph_size);
void dfl_runtime_free(dfl_runtime * rt);

/* Start a new graph in rt->ctx_graph (the previous one and its results are dropped). */
void dfl_runtime_begin_graph(dfl_runtime * rt);
dfl_status dfl_runtime_alloc(dfl_runtime * rt, struct ggml_cgraph * gf);
dfl_status dfl_runtime_compute(dfl_runtime * rt, struct ggml_cgraph * gf);

#endif
