/* Devices, scheduler and per-call graph memory shared by the target and the drafter. */
#ifndef DFL_RUNTIME_H
#define DFL_RUNTIME_H

#include "dfl_error.h"

#include "ggml.h"
#include "ggml-backend.h"

/* Graph nodes a runtime holds unless it asks for more (dfl_runtime_init), and what a
 * model asks for per layer (the most any architecture's layer builds, with room to
 * spare). Not more: every graph build clears hash tables of this size, which on a
 * small model is a visible part of a step. */
#define DFL_GRAPH_SIZE 2048
#define DFL_GRAPH_NODES_PER_LAYER 384
/* ... and per layer for every further sequence in a step (its attention, convolution and
 * delta rule of its own) */
#define DFL_GRAPH_NODES_PER_SEQ 160
#define DFL_MAX_GRAPH_SLOTS 4

/* Sequences a target holds at most, each in a slot of its memory. */
#define DFL_MAX_SEQ 16

/* A graph kept for reuse: its scheduler (and so its compute memory) and the context
 * holding its tensors. Graphs in different slots are allocated apart and can be run
 * in any order. */
typedef struct dfl_graph_slot {
    ggml_backend_sched_t sched;
    void * mem;
    struct ggml_context * ctx;
    int64_t copy_bytes; /* what its graph copies between backends per compute (its splits' inputs) */
    uint64_t build;     /* its graph's number among the runtime's builds (dfl_threads times each apart) */
} dfl_graph_slot;

typedef struct dfl_runtime {
    ggml_backend_dev_t dev;     /* where weights and state live */
    ggml_backend_t backend;     /* on dev */
    ggml_backend_t backend_cpu; /* fallback for ops dev cannot run; == backend on CPU */
    ggml_backend_dev_t dev_cpu; /* host device: layers not offloaded to dev live here */
    int n_threads;              /* CPU threads asked for (the CPU backend's, also when dev is another) */
    int threads_in_use;         /* the CPU backend's now: n_threads, or fewer while `threads` finds that faster */
    struct dfl_threads * threads; /* threads by load (dfl_threads.h); NULL: n_threads always */
    size_t graph_size;          /* nodes per graph */
    size_t graph_mem_size;
    int n_slots;
    uint64_t n_builds;          /* graphs begun so far, in every slot */
    dfl_graph_slot slots[DFL_MAX_GRAPH_SLOTS];
    struct dfl_profile * profile; /* per-op times when DFLASH_PROFILE is set, printed at free */
    struct dfl_dump * dump;       /* the target's named-tensor dump when DFLASH_DUMP_TENSORS is set (dfl_dump.h) */
    struct dfl_reuse_check * reuse; /* kept graphs held unchanged when DFLASH_CHECK_REUSE is set (dfl_reuse_check.h) */
    struct dfl_traffic * traffic; /* host <-> device transfers so far (see dfl_runtime_set/get) */
    bool top_k_by_sort;           /* dfl_top_k sorts the whole row (see dfl_runtime_init) */
    int n_last_nodes;             /* nodes of the last graph computed */
    int last_slot;              /* slot and graph of the last compute (-1: none yet) */
    struct ggml_cgraph * last_graph;
} dfl_runtime;

/* What the host did with the device so far: graphs computed, and blocking transfers
 * (on a device each one waits for it: ggml copies synchronously) of inputs written and
 * results read. */
typedef struct dfl_traffic {
    int64_t computes, writes, reads;
    int64_t write_bytes, read_bytes;
    int64_t copy_bytes; /* copied between backends by the scheduler inside graphs */
} dfl_traffic;

/* `name` labels the DFLASH_PROFILE report ("target", "drafter"); graphs hold up to
 * graph_size nodes (at least DFL_GRAPH_SIZE); n_slots graphs (1..DFL_MAX_GRAPH_SLOTS)
 * can be kept at once. */
dfl_status dfl_runtime_init(dfl_runtime * rt, const char * device, int n_threads, const char * name,
                           size_t graph_size, int n_slots);
void dfl_runtime_free(dfl_runtime * rt);
/* Whether the slots from `first` on let the device take an op whose weight is in host
 * memory (ggml's op offload: the weight is copied to the device for the op; CUDA and
 * Vulkan ask for it on batches of 32 rows or more). Without it such an op runs on the
 * CPU and only activations cross. A slot's graph is dropped. */
dfl_status dfl_runtime_set_op_offload(dfl_runtime * rt, int first, bool on);

/* Start a new graph in a slot: returns the context for its tensors (the slot's previous
 * graph and its results are dropped). */
struct ggml_context * dfl_runtime_begin_graph(dfl_runtime * rt, int slot);
dfl_status dfl_runtime_alloc(dfl_runtime * rt, int slot, struct ggml_cgraph * gf);
dfl_status dfl_runtime_compute(dfl_runtime * rt, int slot, struct ggml_cgraph * gf);
/* Graph inputs in, results out: ggml_backend_tensor_set/get, counted. The runtime may be
 * reached through a const handle (reading results does not change a model). An input
 * the graph does not read (no memory) is skipped. */
void dfl_runtime_set(const dfl_runtime * rt, struct ggml_tensor * t, const void * src, size_t offset, size_t size);
void dfl_runtime_get(const dfl_runtime * rt, const struct ggml_tensor * t, void * dst, size_t offset, size_t size);
/* The indices of the k largest of each row of a, [k, rows], in no particular order:
 * ggml_top_k, or where the device's top_k cannot be trusted (rt->top_k_by_sort) the
 * first k of a full argsort. */
struct ggml_tensor * dfl_top_k(bool by_sort, struct ggml_context * ctx, struct ggml_tensor * a, int k);
/* Where the scheduler placed the nodes of the graph computed last (see dfl_placement). */
dfl_status dfl_runtime_placement(const dfl_runtime * rt, dfl_placement * out);
/* Compute memory the slots' schedulers hold now, over every backend. */
size_t dfl_runtime_compute_bytes(const dfl_runtime * rt);

/* Measuring instead of allocating (the memory planner's tools, dfl_plan.c, used by each
 * runtime to measure its own graphs): a zero-size buffer of dev's buffer type; a tensor
 * placed on it counts as allocated (its data is never touched, the graphs are only
 * measured); the compute memory a graph needs in a slot, per backend [device, CPU]. */
ggml_backend_buffer_t dfl_runtime_dummy_buffer(ggml_backend_dev_t dev);
/* The same marked as holding weights, as weight buffers are: ggml's scheduler runs an op
 * where its weight lives only when the weight's buffer is so marked. */
ggml_backend_buffer_t dfl_runtime_dummy_weights(ggml_backend_dev_t dev);
void dfl_runtime_place_dummy(struct ggml_tensor * t, ggml_backend_buffer_t dummy);
void dfl_runtime_measure(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, size_t sizes[2]);
/* Give a slot the compute memory gf needs now, and write it once (a slot keeps the most
 * any reserve or graph asked of it): a runtime that reserves its worst graphs at load
 * does not grow later. */
dfl_status dfl_runtime_reserve(dfl_runtime * rt, int slot, struct ggml_cgraph * gf);
/* A runtime's worst graphs are handed one by one to a visitor with their slot: the planner
 * measures them, a load reserves them (dfl_runtime_reserve_visit: user is a dfl_status,
 * whose first failure stands). */
typedef void (*dfl_graph_visit)(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, void * user);
void dfl_runtime_reserve_visit(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, void * user);

#endif
