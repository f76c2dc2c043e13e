#define _GNU_SOURCE /* sched_getaffinity */
#include "dfl_runtime.h"

#include "dfl_dump.h"
#include "dfl_reuse_check.h"
#include "dfl_threads.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* DFLASH_PROFILE=1: every graph runs node by node through the scheduler's evaluation
 * callback and the wall time of each node is added to its op's total, printed to stderr
 * when the runtime is freed. Node-by-node execution adds a little overhead per op, so
 * the totals are for finding hot spots, not for timing. */
#define PROFILE_OPS 96

typedef struct dfl_profile {
    char name[32];
    int n_graphs;
    double t_last;
    struct { char op[24]; double seconds; long count; } ops[PROFILE_OPS];
    int n_ops;
} dfl_profile;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

static bool profile_node(struct ggml_tensor * t, bool ask, void * user_data) {
    dfl_profile * p = user_data;
    if (ask) {
        return true; /* stop after every node */
    }
    const double t_now = now_seconds();
    const char * op = ggml_op_desc(t);
    int i = 0;
    while (i < p->n_ops && strcmp(p->ops[i].op, op) != 0) i++;
    if (i == p->n_ops && p->n_ops < PROFILE_OPS) {
        snprintf(p->ops[p->n_ops++].op, sizeof p->ops[0].op, "%s", op);
    }
    if (i < p->n_ops) {
        p->ops[i].seconds += t_now - p->t_last;
        p->ops[i].count++;
    }
    p->t_last = t_now;
    return true;
}

/* Mesa's lavapipe (Vulkan on the CPU, Mesa 22.3) corrupts the host heap now and then
 * when ggml's Vulkan backend records several of our nodes into one submission: the
 * process dies in the driver's queue thread (SIGSEGV) or in malloc ("unsorted double
 * linked list corrupted") one graph later. Seen with a chain verify after plain decoding,
 * f32 and f16 caches alike; serialized submissions (GGML_VK_SERIALIZE_SUBMISSIONS) do
 * not prevent it, submissions of up to 8 nodes and one node at a time do. On that
 * driver, whose device is the host's own CPU, graphs run one node per submission (the
 * scheduler stops after every node), which costs little there. */
static bool one_node_at_a_time(struct ggml_tensor * t, bool ask, void * user_data) {
    return true;
}

static bool is_lavapipe(ggml_backend_dev_t dev) {
    return strstr(ggml_backend_dev_description(dev), "llvmpipe") != NULL;
}

static int by_time(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void profile_report(const dfl_profile * p) {
    double total = 0;
    for (int i = 0; i < p->n_ops; i++) total += p->ops[i].seconds;
    fprintf(stderr, "[dflash profile] %s: %d graphs, %.3f s in nodes\n", p->name, p->n_graphs, total);
    struct { double seconds; int i; } order[PROFILE_OPS];
    for (int i = 0; i < p->n_ops; i++) {
        order[i].seconds = p->ops[i].seconds;
        order[i].i = i;
    }
    qsort(order, (size_t) p->n_ops, sizeof order[0], by_time);
    for (int k = 0; k < p->n_ops; k++) {
        const int i = order[k].i;
        fprintf(stderr, "  %-22s %8.3f ms %5.1f%% %8ld nodes %8.1f us/node\n", p->ops[i].op, 1e3 * p->ops[i].seconds,
                total > 0 ? 100 * p->ops[i].seconds / total : 0.0, p->ops[i].count,
                p->ops[i].count ? 1e6 * p->ops[i].seconds / (double) p->ops[i].count : 0.0);
    }
}

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

/* The CPUs this process may run on. ggml's own default is a fixed 4 threads, which on a
 * 2-core machine leaves spinning workers fighting for the cores: a tree verify of many
 * small ops ran 4x slower. */
static int available_cpus(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
#endif
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int) n : 1;
}

static void set_threads(ggml_backend_t backend, int n_threads) {
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

/* A slot's scheduler over the device and, when that is another, the CPU (the fallback,
 * last: ggml's scheduler takes the last backend for the host's). */
static bool new_sched(dfl_runtime * rt, dfl_graph_slot * s, bool op_offload) {
    ggml_backend_t backends[2] = { rt->backend, rt->backend_cpu };
    const int n_backends = rt->backend_cpu == rt->backend ? 1 : 2;
    s->sched = ggml_backend_sched_new(backends, NULL, n_backends, rt->graph_size, false, op_offload);
    if (!s->sched) {
        return false;
    }
    if (rt->dump) {
        /* a dump needs the callback for itself, and stops at every node where lavapipe needs that */
        dfl_dump_attach(rt->dump, s->sched, is_lavapipe(rt->dev));
    } else if (rt->profile) {
        ggml_backend_sched_set_eval_callback(s->sched, profile_node, rt->profile);
    } else if (is_lavapipe(rt->dev)) {
        ggml_backend_sched_set_eval_callback(s->sched, one_node_at_a_time, NULL);
    }
    return true;
}

dfl_status dfl_runtime_init(dfl_runtime * rt, const char * device, int n_threads, const char * name,
                           size_t graph_size, int n_slots) {
    memset(rt, 0, sizeof *rt);
    rt->graph_size = graph_size > DFL_GRAPH_SIZE ? graph_size : DFL_GRAPH_SIZE;
    rt->n_slots = n_slots < 1 ? 1 : n_slots > DFL_MAX_GRAPH_SLOTS ? DFL_MAX_GRAPH_SLOTS : n_slots;
    rt->dev = pick_device(device);
    if (!rt->dev) {
        char names[256] = "";
        for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
            const size_t used = strlen(names);
            snprintf(names + used, sizeof names - used, "%s%s", i ? ", " : "", ggml_backend_dev_name(ggml_backend_dev_get(i)));
        }
        return dfl_fail(DFL_ERR_BACKEND, "no ggml device named '%s'; this build has: %s", device ? device : "", names);
    }
    /* ggml's CUDA graphs replay a captured graph whenever the scheduler hands over the
     * same split again, without looking at its nodes. Our runtime computes a kept graph
     * once per step with new inputs, and on an H100 the replayed single-row decode gave
     * wrong tokens from the first replay on (the demo target's plain decoding parted from
     * the CPU's at its third step, where the CPU's top-2 gap is 0.53; with
     * GGML_CUDA_DISABLE_GRAPHS=1 all 96 tokens equal the CPU's: scripts/cuda/plain_check.py,
     * 2026-11-25). Until that is understood, CUDA graphs are off unless DFLASH_CUDA_GRAPHS=1.
     * ggml reads the variable at its first graph compute, which is after this. */
    if (!getenv("DFLASH_CUDA_GRAPHS") || strcmp(getenv("DFLASH_CUDA_GRAPHS"), "1") != 0) {
        setenv("GGML_CUDA_DISABLE_GRAPHS", "1", 0);
    }
    rt->backend = ggml_backend_dev_init(rt->dev, NULL);
    if (!rt->backend) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot initialise device %s", ggml_backend_dev_name(rt->dev));
    }
    if (ggml_backend_dev_type(rt->dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        rt->backend_cpu = rt->backend;
    } else {
        rt->backend_cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
        if (!rt->backend_cpu) {
            dfl_runtime_free(rt);
            return dfl_fail(DFL_ERR_BACKEND, "cannot initialise the CPU backend");
        }
    }
    rt->dev_cpu = ggml_backend_get_device(rt->backend_cpu);
    /* ggml's Vulkan top_k (its tournament shaders, several rows of a few thousand columns,
     * k 256) writes out of bounds: on lavapipe, whose device memory is the host's heap,
     * sampled verifies died in malloc or with SIGSEGV a graph later, and with the rows
     * ranked by a full argsort instead they do not. On a card the same writes would land
     * in device memory unseen, so every Vulkan device ranks by sorting. */
    rt->top_k_by_sort = strncmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(rt->dev)), "Vulkan", 6) == 0;
    rt->n_threads = n_threads > 0 ? n_threads : available_cpus();
    set_threads(rt->backend_cpu, rt->n_threads);
    rt->threads_in_use = rt->n_threads;
    if (rt->backend == rt->backend_cpu) { /* a device's graphs run on the device, not on these threads */
        rt->threads = dfl_threads_new(rt->n_threads);
    }

    rt->last_slot = -1;
    rt->graph_mem_size = ggml_tensor_overhead() * rt->graph_size + ggml_graph_overhead_custom(rt->graph_size, false);
    rt->traffic = calloc(1, sizeof *rt->traffic);
    const char * prof = getenv("DFLASH_PROFILE");
    if (rt->traffic && prof && prof[0] && strcmp(prof, "0") != 0) {
        rt->profile = calloc(1, sizeof *rt->profile);
        if (rt->profile) {
            snprintf(rt->profile->name, sizeof rt->profile->name, "%s", name);
        }
    }
    /* the target's dump and a drafter's go to files of their own */
    {
        const dfl_status st = dfl_dump_from_env(strcmp(name, "target") == 0 ? DFL_DUMP_FILE : DFL_DUMP_DRAFT_FILE,
                                                &rt->dump);
        if (st != DFL_OK) {
            dfl_runtime_free(rt);
            return st;
        }
    }
    {
        const dfl_status st = dfl_reuse_check_from_env(rt->n_slots, &rt->reuse);
        if (st != DFL_OK) {
            dfl_runtime_free(rt);
            return st;
        }
    }
    bool ok = rt->traffic != NULL;
    for (int i = 0; i < rt->n_slots && ok; i++) {
        rt->slots[i].mem = malloc(rt->graph_mem_size);
        ok = rt->slots[i].mem && new_sched(rt, &rt->slots[i], true);
    }
    if (!ok) {
        dfl_runtime_free(rt);
        return dfl_fail(DFL_ERR_BACKEND, "cannot create the graph scheduler");
    }
    return DFL_OK;
}

dfl_status dfl_runtime_set_op_offload(dfl_runtime * rt, int first, bool on) {
    for (int i = first; i < rt->n_slots; i++) {
        dfl_graph_slot * s = &rt->slots[i];
        dfl_reuse_check_forget(rt->reuse, i);
        if (s->ctx) {
            ggml_free(s->ctx);
            s->ctx = NULL;
        }
        ggml_backend_sched_free(s->sched);
        s->sched = NULL;
        if (rt->last_slot == i) {
            rt->last_slot = -1;
        }
        if (!new_sched(rt, s, on)) {
            return dfl_fail(DFL_ERR_BACKEND, "cannot create the graph scheduler");
        }
    }
    return DFL_OK;
}

void dfl_runtime_free(dfl_runtime * rt) {
    if (rt->profile) {
        profile_report(rt->profile);
        free(rt->profile);
    }
    dfl_dump_free(rt->dump);
    dfl_reuse_check_free(rt->reuse);
    dfl_threads_free(rt->threads);
    for (int i = 0; i < rt->n_slots; i++) {
        dfl_graph_slot * s = &rt->slots[i];
        if (s->ctx) ggml_free(s->ctx);
        if (s->sched) ggml_backend_sched_free(s->sched);
        free(s->mem);
    }
    free(rt->traffic);
    if (rt->backend_cpu && rt->backend_cpu != rt->backend) ggml_backend_free(rt->backend_cpu);
    if (rt->backend) ggml_backend_free(rt->backend);
    memset(rt, 0, sizeof *rt);
}

struct ggml_tensor * dfl_top_k(bool by_sort, struct ggml_context * ctx, struct ggml_tensor * a, int k) {
    return by_sort ? ggml_cont(ctx, ggml_argsort_top_k(ctx, a, k)) : ggml_top_k(ctx, a, k);
}

struct ggml_context * dfl_runtime_begin_graph(dfl_runtime * rt, int slot) {
    dfl_graph_slot * s = &rt->slots[slot];
    dfl_reuse_check_forget(rt->reuse, slot);
    if (s->ctx) {
        ggml_free(s->ctx);
    }
    struct ggml_init_params ip = { rt->graph_mem_size, s->mem, true };
    s->ctx = ggml_init(ip);
    s->build = ++rt->n_builds;
    ggml_backend_sched_reset(s->sched);
    return s->ctx;
}

static int by_address(const void * a, const void * b) {
    const uintptr_t x = (uintptr_t) *(void * const *) a, y = (uintptr_t) *(void * const *) b;
    return x < y ? -1 : x > y;
}

/* Every tensor a graph's nodes read before the scheduler splits it: its nodes' sources,
 * sorted by address, so that what a node reads afterwards can be looked up. */
static struct ggml_tensor ** sources_before(struct ggml_cgraph * gf, size_t * n_out) {
    const int n = ggml_graph_n_nodes(gf);
    struct ggml_tensor ** src = malloc(((size_t) n * GGML_MAX_SRC + 1) * sizeof *src);
    size_t k = 0;
    for (int i = 0; src && i < n; i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (node->src[j]) {
                src[k++] = node->src[j];
            }
        }
    }
    if (src) {
        qsort(src, k, sizeof *src, by_address);
    }
    *n_out = k;
    return src;
}

/* ggml's scheduler gives a node whose source lives on another backend a copy of that
 * source on its own (one per source and backend, filled before each split runs) and
 * points the node at the copy: a source no node read before the split is such a copy,
 * and those copies are what crosses between backends. Looked up by address, not by a
 * node's position: a backend may reorder the nodes of its splits (Vulkan does, to fuse
 * them). Bytes of the copies, each counted once. */
static int64_t copied_bytes(struct ggml_cgraph * gf, struct ggml_tensor ** before, size_t n_before) {
    const int n = ggml_graph_n_nodes(gf);
    struct ggml_tensor ** copies = malloc(((size_t) n * GGML_MAX_SRC + 1) * sizeof *copies);
    if (!copies) {
        return -1;
    }
    size_t n_copies = 0;
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (node->src[j] && !bsearch(&node->src[j], before, n_before, sizeof *before, by_address)) {
                copies[n_copies++] = node->src[j];
            }
        }
    }
    qsort(copies, n_copies, sizeof *copies, by_address);
    int64_t bytes = 0;
    for (size_t k = 0; k < n_copies; k++) {
        if (k == 0 || copies[k] != copies[k - 1]) {
            bytes += (int64_t) ggml_nbytes(copies[k]);
        }
    }
    free(copies);
    return bytes;
}

dfl_status dfl_runtime_alloc(dfl_runtime * rt, int slot, struct ggml_cgraph * gf) {
    dfl_graph_slot * s = &rt->slots[slot];
    dfl_reuse_check_forget(rt->reuse, slot); /* new split ids: a backend compares the nodes again */
    const int n = ggml_graph_n_nodes(gf);
    size_t n_before = 0;
    const bool split = rt->backend_cpu != rt->backend;
    struct ggml_tensor ** before = split ? sources_before(gf, &n_before) : NULL;
    if (split && !before) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    if (!ggml_backend_sched_alloc_graph(s->sched, gf)) {
        free(before);
        return dfl_fail(DFL_ERR_BACKEND, "cannot allocate compute memory for a graph of %d nodes", n);
    }
    s->copy_bytes = before ? copied_bytes(gf, before, n_before) : 0;
    free(before);
    if (s->copy_bytes < 0) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    return DFL_OK;
}

dfl_status dfl_runtime_compute(dfl_runtime * rt, int slot, struct ggml_cgraph * gf) {
    if (rt->profile) {
        rt->profile->n_graphs++;
        rt->profile->t_last = now_seconds();
    }
    rt->traffic->computes++;
    rt->traffic->copy_bytes += rt->slots[slot].copy_bytes;
    rt->n_last_nodes = ggml_graph_n_nodes(gf);
    TRY(dfl_reuse_check_before(rt->reuse, slot, gf));
    if (rt->threads) {
        const int n = dfl_threads_pick(rt->threads);
        if (n != rt->threads_in_use) {
            set_threads(rt->backend_cpu, n);
            rt->threads_in_use = n;
        }
    }
    const double t0 = rt->threads ? now_seconds() : 0.0;
    dfl_dump_begin(rt->dump);
    const enum ggml_status status = ggml_backend_sched_graph_compute(rt->slots[slot].sched, gf);
    dfl_dump_end(rt->dump);
    if (rt->threads) {
        dfl_threads_record(rt->threads, rt->slots[slot].build, rt->threads_in_use, now_seconds() - t0);
    }
    if (status != GGML_STATUS_SUCCESS) {
        return dfl_fail(DFL_ERR_BACKEND, "graph computation failed");
    }
    TRY(dfl_reuse_check_after(rt->reuse, slot, gf));
    rt->last_slot = slot;
    rt->last_graph = gf;
    return DFL_OK;
}

dfl_status dfl_runtime_placement(const dfl_runtime * rt, dfl_placement * out) {
    memset(out, 0, sizeof *out);
    if (rt->last_slot < 0) {
        return dfl_fail(DFL_ERR_STATE, "no graph has been computed yet");
    }
    ggml_backend_sched_t sched = rt->slots[rt->last_slot].sched;
    struct ggml_cgraph * gf = rt->last_graph;
    out->n_nodes = ggml_graph_n_nodes(gf);
    out->n_splits = ggml_backend_sched_get_n_splits(sched);
    out->copy_bytes = rt->slots[rt->last_slot].copy_bytes;
    size_t used = 0;
    for (int i = 0; i < out->n_nodes && rt->backend_cpu != rt->backend; i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        /* views of inputs are input data, not work */
        const bool input = node->view_src && (node->view_src->flags & GGML_TENSOR_FLAG_INPUT);
        if (input || ggml_backend_sched_get_tensor_backend(sched, node) != rt->backend_cpu) {
            continue;
        }
        out->n_host_nodes++;
        const int w = snprintf(out->host_nodes + used, sizeof out->host_nodes - used, "%s%s(%s)", used ? "," : "",
                               ggml_op_desc(node), node->src[0] ? ggml_get_name(node->src[0]) : "");
        if (w > 0 && used + (size_t) w < sizeof out->host_nodes) {
            used += (size_t) w;
        }
    }
    return DFL_OK;
}

void dfl_runtime_set(const dfl_runtime * rt, struct ggml_tensor * t, const void * src, size_t offset, size_t size) {
    if (!t->buffer) {
        /* an input no node of the graph reads, which the scheduler gave no memory (a model
         * whose layers are all sliding-window reads no full-attention cache rows) */
        return;
    }
    rt->traffic->writes++;
    rt->traffic->write_bytes += (int64_t) size;
    ggml_backend_tensor_set(t, src, offset, size);
}

void dfl_runtime_get(const dfl_runtime * rt, const struct ggml_tensor * t, void * dst, size_t offset, size_t size) {
    rt->traffic->reads++;
    rt->traffic->read_bytes += (int64_t) size;
    ggml_backend_tensor_get(t, dst, offset, size);
}

size_t dfl_runtime_compute_bytes(const dfl_runtime * rt) {
    size_t total = 0;
    for (int i = 0; i < rt->n_slots; i++) {
        ggml_backend_sched_t sched = rt->slots[i].sched;
        for (int b = 0; b < ggml_backend_sched_get_n_backends(sched); b++) {
            total += ggml_backend_sched_get_buffer_size(sched, ggml_backend_sched_get_backend(sched, b));
        }
    }
    return total;
}

ggml_backend_buffer_t dfl_runtime_dummy_buffer(ggml_backend_dev_t dev) {
    return ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), 0);
}

ggml_backend_buffer_t dfl_runtime_dummy_weights(ggml_backend_dev_t dev) {
    ggml_backend_buffer_t buf = dfl_runtime_dummy_buffer(dev);
    if (buf) {
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    return buf;
}

void dfl_runtime_place_dummy(struct ggml_tensor * t, ggml_backend_buffer_t dummy) {
    t->buffer = dummy;
}

void dfl_runtime_measure(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, size_t sizes[2]) {
    sizes[0] = sizes[1] = 0;
    ggml_backend_sched_reserve_size(rt->slots[slot].sched, gf, sizes);
}

dfl_status dfl_runtime_reserve(dfl_runtime * rt, int slot, struct ggml_cgraph * gf) {
    ggml_backend_sched_t sched = rt->slots[slot].sched;
    /* allocating the graph reserves what it needs; splitting it once more first (a
     * ggml_backend_sched_reserve of the same graph) would not do: the scheduler points the
     * nodes' sources at its copies between backends, and a second split of those nodes
     * copies the copies, reserving beyond what the graph needs (3x on the CPU's side with
     * routed experts there) */
    if (!ggml_backend_sched_alloc_graph(sched, gf)) {
        return dfl_fail(DFL_ERR_BACKEND, "cannot allocate compute memory for a graph of %d nodes",
                        ggml_graph_n_nodes(gf));
    }
    /* written once too: a host buffer's pages would otherwise become resident only as
     * later graphs first reach them, and the process would grow for as long as its
     * contexts keep getting longer */
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        struct ggml_tensor * node = ggml_graph_node(gf, i);
        if (!node->view_src && node->buffer &&
            ggml_backend_buffer_get_usage(node->buffer) == GGML_BACKEND_BUFFER_USAGE_COMPUTE) {
            ggml_backend_tensor_memset(node, 0, 0, ggml_nbytes(node));
        }
    }
    ggml_backend_sched_reset(sched);
    return DFL_OK;
}

void dfl_runtime_reserve_visit(dfl_runtime * rt, int slot, struct ggml_cgraph * gf, void * user) {
    dfl_status * status = user;
    if (*status == DFL_OK) {
        *status = dfl_runtime_reserve(rt, slot, gf);
    }
}
