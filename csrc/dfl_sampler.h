/* The sampling stage of a graph: one token per row of logits [V, n], chosen on the
 * device with stock ggml ops (any backend runs it), so that only token ids (and, for an
 * accept rule, a few candidates' probabilities) come back to the host.
 *
 * Order, as llama.cpp's default sampler chain: the sequence's logit bias (finite biases
 * added first; a -inf one is applied after the penalties, whose arithmetic would turn
 * -inf x 0 into NaN, and keeps the token at -inf either way), penalties on the logits
 * (the row's own token counts, given by the host), top-k, top-p and min-p on the probabilities at
 * temperature 1, the temperature, then the draw: the first candidate whose cumulative
 * weight exceeds the row's uniform times the total. Greedy rows take the argmax (after
 * the penalties). A row constrained by a grammar has an allowed-token bitmask: its
 * disallowed logits become -inf after the penalties' arithmetic (which would turn
 * -inf x 0 into NaN; the penalties change a token's logit on its own, so masking before
 * or after them chooses alike) and before top-k and the pick. */
#ifndef DFL_SAMPLER_H
#define DFL_SAMPLER_H

#include "dfl_runtime.h"

#include <stdbool.h>

/* Columns of a stage's per-row settings (an input [n, columns]: the row's uniform and
 * what its rules need, one column of n each; dfl_sampler.c lists them). */
int dfl_sampler_n_params(void);

/* How a graph applies the rows' masks (see dfl_sampler_key_settle). SPARSE: each row's
 * shorter exception list, a row with few allowed tokens keeping only those (its row
 * starts at -inf and they are restored), a row with few disallowed ones setting those to
 * -inf; DENSE: every row's bitmask expanded to a bias over the vocabulary and added.
 * Both leave the logits masked in place. CANDIDATES: the logits stay as they are. In an
 * argmax graph, a row with few allowed tokens takes the argmax of those (gathered), any
 * other row the most likely of its n_cand largest logits that its mask allows, looked up
 * in the mask's 16-bit halves, and -1 when none is (dfl_target_choices then decides the
 * row again over its whole masked row). In a ranked graph (rows of their own top_k, none
 * capped), the n_wide largest logits of each row are looked up alike, the disallowed ones
 * put last, and the ranked draw runs over the top_k first: the top_k largest allowed, as
 * the masked row's own top-k, when at least top_k of the n_wide are allowed; a row where
 * fewer are chooses -1 (dfl_target_choices then runs the step's stage again with the
 * masks in place, and its choices and candidates are those). */
enum { DFL_MASK_NONE = 0, DFL_MASK_SPARSE = 1, DFL_MASK_DENSE = 2, DFL_MASK_CANDIDATES = 3 };

/* How a graph picks: fixed when it is built, part of its key. MIXED: rows of several
 * sequences that pick differently, each by its own pick (a per-row setting): the argmax
 * of every row is computed (a greedy row takes it, exactly), the full draw when some row
 * draws over the vocabulary, the ranked draw when some row ranks candidates (the most
 * any row ranks, each row keeping its own top_k of them). */
enum { DFL_PICK_ARGMAX = 0, DFL_PICK_FULL = 1, DFL_PICK_RANKED = 2, DFL_PICK_MIXED = 3 };

typedef struct dfl_sampler_key {
    int pick;      /* DFL_PICK_*; FULL: no truncation, the draw runs over the vocabulary */
    int n_cand;    /* RANKED: candidates ranked per row (top_k, or n_candidates when top_k is 0) */
    int capped;    /* RANKED with top_k 0: probabilities are against the whole vocabulary, and a
                      row whose kept set may reach past the candidates chooses -1 */
    int n_penalty; /* penalty entries per row (0: no penalties in this graph) */
    int full;      /* MIXED: some row draws over the vocabulary */
    int ranked;    /* MIXED: some row ranks candidates (n_cand of them at most; capped: some row is) */
    int masked;    /* some row has an allowed-token mask (the others get all tokens): DFL_MASK_* */
    int n_keep;    /* SPARSE: entries of the allowed list (padded to a bucket; before
                      dfl_sampler_key_settle, the exact count) ... */
    int n_ban;     /* ... and of the disallowed list */
    int keep_rows; /* SPARSE: some row keeps only its allowed list (its logits start at -inf) */
    int keep_width; /* before dfl_sampler_key_settle: the most tokens a row with few allowed allows
                       (CANDIDATES: each row's allowed list is n_keep wide) */
    int by_sort;   /* candidates by a full sort (the runtime's top_k_by_sort) */
    int n_wide;    /* CANDIDATES in a ranked graph: the largest logits of a row looked up in its mask */
    int n_bias;    /* logit-bias entries per row (a power of two from 8; 0: no bias in this graph) */
    int raw;       /* some row's sequence keeps its rows' own logits (dfl_sampling.raw_logits) */
} dfl_sampler_key;

/* A built sampling stage: its inputs and outputs. */
typedef struct dfl_sampler_graph {
    struct ggml_tensor * params;  /* [n, dfl_sampler_n_params()] per-row settings and uniform */
    struct ggml_tensor * pen_idx; /* [n_penalty * n] i32: row * V + token */
    struct ggml_tensor * pen_cnt; /* [n_penalty, n] f32: the token's count (0: a pad entry) */
    struct ggml_tensor * choice;  /* [n] i32 */
    struct ggml_tensor * cand;    /* RANKED: [n_cand, n] i32 candidates, most likely first ... */
    struct ggml_tensor * cand_p;  /* ... and their probabilities as drawn (0 for those cut) */
    struct ggml_tensor * mask;      /* masked: [4 * n_words * n] i32, each row's bitmask as its bytes
                                       (byte k of word w: tokens 32 w + 8 k ..), low byte first */
    struct ggml_tensor * byte_bias; /* masked: [8, 256] f32, byte v's bias per bit: 0 set, -inf clear */
    struct ggml_tensor * keep_idx;  /* SPARSE: [n_keep] i32, row * V + token of the keeping rows' allowed tokens */
    struct ggml_tensor * row_bias;  /* SPARSE with keep_rows: [1, 1, n] f32, -inf for a keeping row, 0 others */
    struct ggml_tensor * ban_idx;   /* SPARSE: [n_ban] i32, row * V + token of the other rows' disallowed tokens */
    struct ggml_tensor * halves;    /* CANDIDATES: [2 * n_words * n] f32, each row's bitmask as 16-bit halves
                                       (tokens 16 h ..), low half first; all set for a row without a mask */
    struct ggml_tensor * bit_scale; /* CANDIDATES: [16] f32, 2^-b: a half times it has bit b lowest */
    struct ggml_tensor * keep_tok;  /* CANDIDATES with n_keep: [n_keep, n] f32, a keeping row's allowed tokens
                                       (padded with its first), which keep_idx [n_keep * n] holds as row * V + token */
    struct ggml_tensor * keeps;     /* CANDIDATES with n_keep: [1, n] f32, 1 for a keeping row */
    struct ggml_tensor * bias_idx;  /* n_bias: [n_bias * n] i32, row * V + token of each row's biased tokens
                                       (padded with repeats of the row's first entry, or token 0 biased by 0) */
    struct ggml_tensor * bias_add;  /* n_bias: [1, n_bias * n] f32, the finite biases, added before the penalties */
    struct ggml_tensor * bias_ban;  /* n_bias: [1, n_bias * n] f32, -inf for a -inf bias (0 others), added after them */
    struct ggml_tensor * raw;       /* raw, where the stage changes the logits in place: [V, n] f32, a copy of
                                       them made before it does */
    int changes_logits;             /* the bias, penalties or a mask are written into the logits */
} dfl_sampler_graph;

/* A model's sampling settings and what the host staged for its next graph that samples. */
typedef struct dfl_sampler {
    dfl_sampling s;
    float * u;                  /* uniforms for the next call's rows ... */
    int n_u;                    /* ... how many (0: none staged) */
    int32_t * pen_tok;          /* penalty entries for the next call's rows */
    float * pen_cnt;
    int pen_rows, pen_per_row;  /* (0: none staged) */
    uint32_t * mask;            /* allowed-token bitmasks for the next call's rows, [rows][words] */
    int32_t * mask_allowed;     /* tokens each of them allows */
    int mask_rows;              /* (0: none staged) */
    int cap_mask, cap_mask_allowed;
    uint64_t mask_gen;          /* masks staged so far (a step's undecided rows are decided again
                                   from the masks it was filled with) */
    int cap_u, cap_pen_tok, cap_pen_cnt; /* staging capacities */
    float * host_params;        /* input staging */
    int32_t * host_idx;
    float * host_cnt;
    int32_t * host_mask;        /* DENSE: the bytes; SPARSE: the allowed list */
    int32_t * host_ban;
    float * host_row_bias;      /* SPARSE: each row's bias; CANDIDATES: whether it keeps */
    float * host_halves;        /* CANDIDATES: the masks' 16-bit halves ... */
    float * host_keep_tok;      /* ... and the keeping rows' tokens */
    int32_t * bias_tok;         /* the sequence's logit bias: distinct tokens and their biases (-inf: never), */
    float * bias_val;           /* kept until the sampling is set again */
    int n_bias, cap_bias_tok, cap_bias_val;
    int32_t * host_bias_idx;    /* its inputs' staging */
    float * host_bias_add, * host_bias_ban;
    int cap_host_bias_idx, cap_host_bias_add, cap_host_bias_ban;
    int cap_params, cap_idx, cap_cnt, cap_host_mask, cap_host_ban, cap_host_row_bias, cap_host_halves,
        cap_host_keep_tok;
} dfl_sampler;

/* 32-bit words of a bitmask over n_vocab tokens (bit t % 32 of word t / 32: token t). */
static inline int dfl_mask_words(int n_vocab) {
    return (n_vocab + 31) / 32;
}

void dfl_sampler_init(dfl_sampler * smp);
void dfl_sampler_free(dfl_sampler * smp);
dfl_status dfl_sampler_set(dfl_sampler * smp, const dfl_sampling * s);
dfl_status dfl_sampler_stage_uniforms(dfl_sampler * smp, const float * u, int n);
dfl_status dfl_sampler_stage_penalties(dfl_sampler * smp, const int32_t * tokens, const float * counts, int n_rows,
                                       int per_row, int n_vocab);
/* The sequence's logit bias from its next call on (until the sampling is set again): n
 * distinct tokens of the vocabulary, each with a bias added to its logit before the
 * penalties (llama.cpp's order); a bias of -inf keeps the token from being chosen. n 0: none. */
dfl_status dfl_sampler_set_bias(dfl_sampler * smp, const int32_t * tokens, const float * biases, int n, int n_vocab);
/* Allowed-token bitmasks for the next call's n_rows rows, n_words each (dfl_mask_words);
 * a row must allow some token. */
dfl_status dfl_sampler_stage_masks(dfl_sampler * smp, const uint32_t * words, int n_rows, int n_words, int n_vocab);

/* The key of a graph that samples n rows of a vocabulary of n_vocab now; fails when what
 * it needs was not staged. */
dfl_status dfl_sampler_key_for(const dfl_sampler * smp, int n_rows, int n_vocab, dfl_sampler_key * key);

/* The key of a graph whose rows are those of `acc` and then those of `k`: the same pick
 * when both pick alike, else MIXED; the most penalty entries and candidates; the rows'
 * exception lists together. */
void dfl_sampler_key_merge(dfl_sampler_key * acc, const dfl_sampler_key * k);

/* Decides how a key's (merged) masks of n rows are applied: CANDIDATES in an argmax graph
 * when `candidates` allows it, else SPARSE when the rows' exception lists cost less than
 * the dense expansion, their lengths padded to a power of four (so that a graph serves
 * many steps), else DENSE. Call once, after the merges. */
void dfl_sampler_key_settle(dfl_sampler_key * key, int n_rows, int n_vocab, bool candidates);

/* Builds the stage over logits [V, n] (contiguous) into gf; returns out->choice. */
struct ggml_tensor * dfl_sampler_build(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * logits,
                                       const dfl_sampler_key * key, dfl_sampler_graph * out);

/* Writes the stage's inputs for n rows and consumes what was staged. */
dfl_status dfl_sampler_fill(dfl_sampler * smp, const dfl_runtime * rt, const dfl_sampler_graph * g,
                            const dfl_sampler_key * key, int n_rows, int n_vocab);

/* A graph's rows from several samplers (sequences), in order: each part's n_rows. */
typedef struct dfl_sampler_part {
    dfl_sampler * smp;
    int n_rows;
} dfl_sampler_part;

/* dfl_sampler_fill of rows from several samplers, one part after another. */
dfl_status dfl_sampler_fill_parts(const dfl_sampler_part * parts, int n_parts, const dfl_runtime * rt,
                                  const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab);

/* The masks' inputs alone (of dfl_sampler_fill_parts: the parts' staged masks, a part
 * without them allowing every token); what was staged stays. */
dfl_status dfl_sampler_fill_masks(const dfl_sampler_part * parts, int n_parts, const dfl_runtime * rt,
                                  const dfl_sampler_graph * g, const dfl_sampler_key * key, int n_vocab);

/* Grows *buf to hold n elements of `size` bytes (cap in elements); false when out of
 * memory (*buf then as it was). */
bool dfl_reserve(void ** buf, int * cap, int n, size_t size);

/* Whether reading k of each row's K candidates, rows [row0, row0 + n_rows) of a call of
 * n_out rows, into tokens and probs is a valid request. */
dfl_status dfl_sampler_check_candidates(int K, int n_out, int32_t row0, int32_t n_rows, int32_t k,
                                        const int32_t * tokens, const float * probs);

/* Reads rows [row0, row0 + n_rows) of a RANKED (or MIXED) stage's candidates and their
 * probabilities, the first k of each row (k at most the stage's candidates). */
dfl_status dfl_sampler_candidates(const dfl_runtime * rt, const dfl_sampler_graph * g, int n_out, int32_t row0,
                                  int32_t n_rows, int32_t k, int32_t * tokens, float * probs);

/* A stage's per-row settings, an input [n, DFL_SAMPLER_PARAMS] (one column of n per
 * setting): the row's uniform, 1 / temperature, top_p, log(min_p), and the penalties as
 * the logit arithmetic uses them (repeat - 1, 1 / repeat - repeat, frequency, presence);
 * in a stage whose rows pick differently (DFL_PICK_MIXED), the row's pick, its candidate
 * count and whether it is capped (see dfl_sampler_key). */
enum { DFL_SP_U, DFL_SP_INV_TEMP, DFL_SP_TOP_P, DFL_SP_LOG_MIN_P, DFL_SP_REP_M1, DFL_SP_REP_FLIP, DFL_SP_FREQ,
       DFL_SP_PRESENT, DFL_SP_PICK, DFL_SP_TOP_K, DFL_SP_CAPPED, DFL_SAMPLER_PARAMS };

/* The relative costs (bytes moved, roughly) that choose how masks are applied: a
 * disallowed entry set to -inf (a scattered write), an allowed entry kept (a gather and a
 * scattered write), a pad entry (uploaded, then the same value written again where the
 * last was: in cache), per token of every row the -inf start of keeping rows (a read and
 * a write of the logits) and the dense expansion (its byte index, the bias written, then
 * read with the logits and the sum written). A list entry costs more than its bytes: the
 * gather and the scattered write handle each as a row of its own (CPU, a 16-row chain
 * pass at a 248K vocabulary: about 8 ns an entry, pads included, 1M of them, against
 * about 1 ns a token for the dense path: results/sampling-cost-2026-11-25-0219.json
 * against -2026-11-24-2250.json), so the lists' weights are about 9 times the dense
 * token's (they were 4 and 8 times, and the dense worst case took the lists). */
#define COST_BAN_ENTRY 150
#define COST_KEEP_ENTRY 300
#define COST_PAD_ENTRY 8
#define COST_KEEP_ROWS_TOKEN 8
#define COST_DENSE_TOKEN 17

/* The bits of word w of an n_words-word bitmask that stand for tokens of the vocabulary
 * (the last word's tail past n_vocab is not). */
static inline uint32_t vocab_bits(int w, int n_words, int n_vocab) {
    return w == n_words - 1 && n_vocab % 32 ? ~(~0u << (n_vocab % 32)) : ~0u;
}

/* Whether a row allowing `allowed` of n_vocab tokens keeps its allowed list (cheaper than
 * banning the rest) rather than bans its disallowed one. */
static inline bool row_keeps(int allowed, int n_vocab) {
    return (int64_t) allowed * COST_KEEP_ENTRY < (int64_t) (n_vocab - allowed) * COST_BAN_ENTRY;
}

#endif
