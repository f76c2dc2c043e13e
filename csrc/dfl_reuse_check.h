/* DFLASH_CHECK_REUSE=1: a kept graph must not change between its computes.
 *
 * ggml's scheduler gives a graph's splits new ids only when it allocates the graph. A
 * backend that records a split as a device graph (ggml-cuda's CUDA graphs) replays its
 * record for a split whose id it has seen without comparing the nodes again, so a graph
 * the runtime keeps and computes again must be exactly the graph it was at its first
 * compute: every field ggml-cuda compares when it does compare (the node's whole struct,
 * that is its op, op_params, shapes, strides, data, view source and offset, flags and
 * sources, and each source's data, shape and strides). With the variable set, the
 * runtime snapshots those after a kept graph's first compute and checks them before each
 * later one, failing with the first node and field that changed. A graph allocated anew
 * (new ids: the backend compares again) starts a new snapshot. */
#ifndef DFL_REUSE_CHECK_H
#define DFL_REUSE_CHECK_H

#include "dfl_error.h"

#include <ggml.h>
#include <stdbool.h>

#define DFL_CHECK_REUSE_ENV "DFLASH_CHECK_REUSE"

typedef struct dfl_reuse_check dfl_reuse_check;

/* *out: the check when DFLASH_CHECK_REUSE is set (and not "0"), for n_slots graph slots;
 * NULL when unset (every other call takes NULL as "no check"). */
dfl_status dfl_reuse_check_from_env(int n_slots, dfl_reuse_check ** out);
/* The slot holds a new graph (built or allocated anew): its snapshot is dropped. */
void dfl_reuse_check_forget(dfl_reuse_check * c, int slot);
/* Before a compute of the slot's graph: a graph computed before since its snapshot must
 * match it (DFL_ERR_STATE naming the node and field otherwise). */
dfl_status dfl_reuse_check_before(dfl_reuse_check * c, int slot, const struct ggml_cgraph * gf);
/* After a compute: the first compute of a graph takes its snapshot. */
dfl_status dfl_reuse_check_after(dfl_reuse_check * c, int slot, const struct ggml_cgraph * gf);
void dfl_reuse_check_free(dfl_reuse_check * c);

#endif
