/* What a drafter shows its target, per slot: the tokens it left on the device for the
 * target's next verify (an int32 tensor on the target's device and how many of its
 * leading tokens are valid), and how far it has taken the target's features (its own
 * memory's record, the only one: the target keeps the feature rows the drafter lacks).
 * The drafter writes it; the target only reads it (a chain entry without host tokens
 * views the tokens), so neither runtime calls into the other. */
#ifndef DFL_TOKEN_SOURCE_H
#define DFL_TOKEN_SOURCE_H

#include "dfl_memory.h"
#include "dfl_runtime.h"
#include "dflash.h"

#include "ggml.h"

struct dfl_token_source {
    const dfl_target * target;               /* the target the tokens were drafted for */
    struct ggml_tensor * tokens[DFL_MAX_SEQ]; /* each slot's last block, bonus first */
    int32_t n[DFL_MAX_SEQ];                   /* its valid tokens (0: none since the slot's context changed) */
    const dfl_memory * drafter;               /* the drafter's memory: a slot's n_past is what it has taken */
};

/* The positions of slot seq before which the drafter has taken every feature row of
 * target t; 0 when no drafter of t says (the target then keeps whatever fits). */
static inline int dfl_token_source_taken(const dfl_token_source * s, const dfl_target * t, int seq) {
    return s && s->target == t && seq < s->drafter->n_seq ? s->drafter->seq[seq].n_past : 0;
}

#endif
