/* What a drafter may know of its target: accessors, not fields (see dfl_target.c). The
 * target exposes these and knows nothing of who reads them. */
#ifndef DFL_TARGET_H
#define DFL_TARGET_H

#include "dfl_gguf.h"
#include "dfl_model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <stdbool.h>

/* The target's file, for checks of a drafter against it. */
const dfl_gguf * dfl_target_file(const dfl_target * t);
int dfl_target_n_vocab(const dfl_target * t);
int dfl_target_n_embd(const dfl_target * t);
int dfl_target_n_layer(const dfl_target * t);
int dfl_target_n_ctx(const dfl_target * t);
int dfl_target_n_seq(const dfl_target * t);
int dfl_target_n_ubatch(const dfl_target * t);
int dfl_target_n_threads(const dfl_target * t);
bool dfl_target_repack(const dfl_target * t);
/* The device the target runs on, and whether that is the CPU. */
ggml_backend_dev_t dfl_target_device(const dfl_target * t);
bool dfl_target_on_cpu(const dfl_target * t);
/* The token embedding lookups gather from (a host copy when a tied LM head is sliced on
 * its device) and the LM head, shared with a drafter; the final norm's weight. */
struct ggml_tensor * dfl_target_tok_embd(const dfl_target * t);
struct ggml_tensor * dfl_target_lm_head(const dfl_target * t);
/* The kept tokens of a cut head: 1..n_vocab distinct ids of the vocabulary (n 0: none,
 * the whole head). path names the model in the message. */
dfl_status dfl_check_head_tokens(const int32_t * ids, int n, int n_vocab, const char * path);
struct ggml_tensor * dfl_target_output_norm(const dfl_target * t);
/* Its RoPE scaling as resolved at load (the file's keys and the caller's overrides): a
 * drafter layer of the target's own file rotates as its layers do. */
const dfl_rope_scaling * dfl_target_rope_scaling(const dfl_target * t);
/* Feature layers captured (llama.cpp convention), their count returned. */
int dfl_target_feature_layers(const dfl_target * t, int32_t * layers, int max_n);
/* [n_feature_layers * n_embd, rows] every slot's feature rows (NULL without feature
 * layers): slot s's last call's rows, and those of earlier calls a drafter has yet to
 * take, in its own rows (see dfl_memory.h). */
struct ggml_tensor * dfl_target_feature_tensor(const dfl_target * t);
/* The row of that tensor holding the features of committed position pos of slot seq, or
 * -1 when it holds them no longer (the slot ran a graph since) or not yet. */
int64_t dfl_target_feature_of(const dfl_target * t, int seq, int pos);
/* Rows slot seq's next call may have while its feature rows keep what a drafter that
 * has taken the positions before `taken` lacks (0 without feature layers). */
int dfl_target_feature_room(const dfl_target * t, int seq, int taken);

#endif
