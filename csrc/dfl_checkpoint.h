/* What dfl_checkpoint.c needs of the drafter (dfl_draft.c), whose state is private. */
#ifndef DFL_CHECKPOINT_H
#define DFL_CHECKPOINT_H

#include "dflash.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct ggml_tensor;

int dfl_draft_n_tokens(const dfl_draft * d, int seq);
/* The first context position a later draft of sequence seq may attend to: the window's start, or 0. */
int dfl_draft_first_visible(const dfl_draft * d, int seq);
int dfl_draft_n_layers(const dfl_draft * d);
/* Layer il's context keys (v = 0) or values (v = 1): position p of sequence s in row
 * dfl_draft_cache_base(d, s) + p % ring. */
struct ggml_tensor * dfl_draft_cache(const dfl_draft * d, int il, int v);
int dfl_draft_ring(const dfl_draft * d);
int64_t dfl_draft_cache_base(const dfl_draft * d, int seq);
/* After a restore: sequence seq holds positions up to n (its cache rows were written). */
void dfl_draft_set_n_tokens(dfl_draft * d, int seq, int n);

#endif
