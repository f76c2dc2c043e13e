/* Tokens a proposer leaves on the device for the target's next verify, per slot: an
 * int32 tensor on the target's device and how many of its leading tokens are valid. A
 * drafter writes it after each propose; the target only reads it (a chain entry without
 * host tokens views it), so neither runtime calls into the other. */
#ifndef DFL_TOKEN_SOURCE_H
#define DFL_TOKEN_SOURCE_H

#include "dfl_runtime.h"
#include "dflash.h"

#include "ggml.h"

struct dfl_token_source {
    const dfl_target * target;               /* the target the tokens were drafted for */
    struct ggml_tensor * tokens[DFL_MAX_SEQ]; /* each slot's last block, bonus first */
    int32_t n[DFL_MAX_SEQ];                   /* its valid tokens (0: none since the slot's context changed) */
};

#endif
