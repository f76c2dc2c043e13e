/* Named-tensor dumps of one graph, for comparing a run with llama.cpp's
 * llama-eval-callback tensor by tensor (python -m dflash_gguf.parity).
 *
 *   DFLASH_DUMP_TENSORS=REGEX  names to dump (POSIX extended regex, searched, not anchored)
 *   DFLASH_DUMP_FILE=PATH      where (required with the above)
 *
 * The target runtime's first graph with a matching node (the first prompt pass) is
 * dumped through the scheduler's evaluation callback; later graphs are not. Each
 * tensor is one JSON header line
 *   {"name": "attn_norm-0", "op": "MUL", "type": "f32", "ne": [ne0, ne1, ne2, ne3], "n": N}
 * followed by N little-endian float32 values in ggml's element order (ne0 fastest),
 * read from the device with ggml_backend_tensor_get. */
#ifndef DFL_DUMP_H
#define DFL_DUMP_H

#include "dfl_error.h"

#include <ggml-backend.h>
#include <stdbool.h>

typedef struct dfl_dump dfl_dump;

/* From the environment: *out NULL when DFLASH_DUMP_TENSORS is unset or empty. */
dfl_status dfl_dump_from_env(dfl_dump ** out);
/* Install the callback on a scheduler (no-op when d is NULL); every_node: stop the
 * scheduler after every node, as the runtime's own callback does on drivers that need it. */
void dfl_dump_attach(dfl_dump * d, ggml_backend_sched_t sched, bool every_node);
/* Around one graph compute: arms the dump before, closes the file after the first
 * graph that dumped anything. */
void dfl_dump_begin(dfl_dump * d);
void dfl_dump_end(dfl_dump * d);
void dfl_dump_free(dfl_dump * d);

#endif
