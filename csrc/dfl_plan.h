/* Memory planning: what a configuration needs on each device, computed before anything
 * is allocated (dfl_plan.c). Graphs are measured with ggml's own allocator over
 * tensors that sit on zero-size placeholder buffers, as llama.cpp's no_alloc mode does. */
#ifndef DFL_PLAN_H
#define DFL_PLAN_H

#include "dfl_runtime.h"

/* Bytes of one part of a plan; weights[0] and compute[0] on the part's device, [1] on
 * the CPU when that is another device. */
typedef struct dfl_part_sizes {
    size_t weights[2], cache, compute[2];
} dfl_part_sizes;

/* The drafter's weights, context cache and compute memory (dfl_draft.c). */
dfl_status dfl_draft_plan(const char * path, dfl_target * target, const dfl_draft_params * params,
                          dfl_part_sizes * out);

#endif
