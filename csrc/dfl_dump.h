/* Named-tensor dumps of one graph, for comparing a run with llama.cpp's
 * llama-eval-callback tensor by tensor (python -m dflash_gguf.tools.parity).
 *
 *   DFLASH_DUMP_TENSORS=REGEX     names to dump (POSIX extended regex, searched, not anchored)
 *   DFLASH_DUMP_FILE=PATH         where the target's go (this or the next is required with the above)
 *   DFLASH_DUMP_DRAFT_FILE=PATH   where a drafter's go (DFlash and DSpark name theirs as llama.cpp's dflash)
 *   DFLASH_DUMP_SKIP=N            pass over the first N graphs with a matching node (default 0)
 *
 * A runtime's first graph with a matching node (the target's first prompt pass, the
 * drafter's first propose), after the DFLASH_DUMP_SKIP passed over, is dumped through the scheduler's evaluation callback;
 * later graphs are not. Each
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

#define DFL_DUMP_FILE "DFLASH_DUMP_FILE"
#define DFL_DUMP_DRAFT_FILE "DFLASH_DUMP_DRAFT_FILE"

/* From the environment, the dump written to the file that variable file_var names: *out
 * NULL when DFLASH_DUMP_TENSORS is unset or empty, or when file_var is unset and the other
 * runtime's file is set. */
dfl_status dfl_dump_from_env(const char * file_var, dfl_dump ** out);
/* Install the callback on a scheduler (no-op when d is NULL); every_node: stop the
 * scheduler after every node, as the runtime's own callback does on drivers that need it. */
void dfl_dump_attach(dfl_dump * d, ggml_backend_sched_t sched, bool every_node);
/* Around one graph compute: arms the dump before, closes the file after the first
 * graph that dumped anything. */
void dfl_dump_begin(dfl_dump * d);
void dfl_dump_end(dfl_dump * d);
void dfl_dump_free(dfl_dump * d);

#endif
