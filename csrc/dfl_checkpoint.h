/* What dfl_checkpoint.c needs of the drafter (dfl_draft.c), whose state is private. */
#ifndef DFL_CHECKPOINT_H
#define DFL_CHECKPOINT_H

#include "dflash.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

int dfl_draft_n_tokens(const dfl_draft * d);
int dfl_draft_first_visible(const dfl_draft * d);
size_t dfl_draft_context_bytes(const dfl_draft * d, int first, int end);
/* to_cache: host -> the drafter's cache (and the drafter then holds `end` positions);
 * otherwise the cache -> host. */
void dfl_draft_context_copy(dfl_draft * d, uint8_t * host, int first, int end, bool to_cache);

#endif
