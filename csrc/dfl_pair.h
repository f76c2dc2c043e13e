/* A drafter file against its target: drafter metadata read and bounded before anything
 * is loaded, the tokenizer fingerprint, and the pairing check. Also the tokenizer
 * validation that keeps corrupt vocabularies away from llama.cpp. */
#ifndef DFL_PAIR_H
#define DFL_PAIR_H

#include "dfl_gguf.h"

/* Keys our converters write into a drafter (llama.cpp ignores them), after the drafter's
 * architecture ("dflash.", "eagle3."): the target it was converted for. */
#define DFL_KEY_TARGET_NAME ".target.name"
#define DFL_KEY_TARGET_TOKENIZER ".target.tokenizer_sha256"
#define DFL_KEY_TARGET_N_EMBD ".target.embedding_length"
#define DFL_KEY_TARGET_N_VOCAB ".target.vocab_size"
#define DFL_KEY_TARGET_N_LAYER ".target.block_count" /* its own layers, without MTP (nextn) ones */

/* Largest drafted block (a chain verify of the whole block must fit). */
#define DFL_MAX_BLOCK 256

/* sha256 (hex) of the tokenizer metadata: tokens, merges and, with `special`, the bos,
 * eos, unk, sep and pad ids. False when the file has no token list. */
bool dfl_tokenizer_sha256(const dfl_gguf * g, bool special, char hex[65]);

/* The tokenizer metadata of a target, when it has any, is what llama.cpp can load
 * without aborting: byte-level BPE ('gpt2'), one token per embedding row, no duplicate
 * tokens, well-typed arrays. */
dfl_status dfl_vocab_check(const dfl_gguf * g, int64_t n_vocab);

/* The drafter `draft` fits the target whose file is `target` (n_vocab x n_embd
 * embedding): a drafter converted by us must have been converted for a target with
 * this tokenizer, embedding shape and (when it records one) layer count; one without a fingerprint (llama.cpp's converter)
 * is checked by its embedded vocabulary. Also bounds the block size. */
dfl_status dfl_pair_check(const dfl_gguf * draft, const dfl_gguf * target, int64_t n_vocab, int64_t n_embd);

#endif
