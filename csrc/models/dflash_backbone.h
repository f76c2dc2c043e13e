/* The DFlash backbone (csrc/models/dflash.c) as other drafter architectures build on it:
 * DSpark (dspark.c) is the same layers under heads of its own. */
#ifndef DFL_DFLASH_BACKBONE_H
#define DFL_DFLASH_BACKBONE_H

#include "../dfl_drafter.h"

typedef struct dflash_weights dflash_weights;

/* A 'dflash' GGUF's hyperparameters and layers, checked against the target: fills m as
 * the DFlash drafter's loader does. *out is set before anything can fail (free() it). */
dfl_status dflash_backbone_load(dfl_drafter * m, const dfl_target * t, dflash_weights ** out);
/* The entries' keys and values stored, the block run through the layers: the drafted
 * rows' output-normed states [n_embd, D] (NULL when the graph drafts nothing). */
struct ggml_tensor * dflash_backbone_hidden(const dfl_drafter * m, const dflash_weights * w, dfl_draft_graph * g);
/* The LM head's logits [n_vocab, n] of states x [n_embd, n] (no logit scale or softcap). */
struct ggml_tensor * dflash_backbone_head(const dflash_weights * w, struct ggml_context * ctx, struct ggml_tensor * x);
/* Whether the backbone has DFlash2's convolutions and candidate selector. */
bool dflash_backbone_is_dflash2(const dflash_weights * w);

#endif
