/* Drafter metadata, tokenizer fingerprints and the target/drafter pairing check. */
#include "dfl_pair.h"
#include "dfl_drafter.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- sha256 (FIPS 180-4) ------------------------------------------------------------- */

typedef struct sha256 {
    uint32_t h[8];
    uint8_t buf[64];
    size_t n_buf;
    uint64_t n_bytes;
} sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256 * s, const uint8_t * p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) {
        w[i] = (uint32_t) p[4 * i] << 24 | (uint32_t) p[4 * i + 1] << 16 | (uint32_t) p[4 * i + 2] << 8 | p[4 * i + 3];
    }
    for (int i = 16; i < 64; i++) {
        const uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        const uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        const uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    s->h[0] += a; s->h[1] += b; s->h[2] += c; s->h[3] += d;
    s->h[4] += e; s->h[5] += f; s->h[6] += g; s->h[7] += h;
}

static void sha256_init(sha256 * s) {
    static const uint32_t h0[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    memcpy(s->h, h0, sizeof h0);
    s->n_buf = 0;
    s->n_bytes = 0;
}

static void sha256_update(sha256 * s, const void * data, size_t n) {
    const uint8_t * p = data;
    s->n_bytes += n;
    while (n > 0) {
        const size_t take = n < 64 - s->n_buf ? n : 64 - s->n_buf;
        memcpy(s->buf + s->n_buf, p, take);
        s->n_buf += take;
        p += take;
        n -= take;
        if (s->n_buf == 64) {
            sha256_block(s, s->buf);
            s->n_buf = 0;
        }
    }
}

static void sha256_hex(sha256 * s, char hex[65]) {
    const uint64_t bits = s->n_bytes * 8;
    const uint8_t one = 0x80, zero = 0;
    sha256_update(s, &one, 1);
    while (s->n_buf != 56) {
        sha256_update(s, &zero, 1);
    }
    uint8_t len[8];
    for (int i = 0; i < 8; i++) {
        len[i] = (uint8_t) (bits >> (56 - 8 * i));
    }
    sha256_update(s, len, 8);
    for (int i = 0; i < 8; i++) {
        snprintf(hex + 8 * i, 9, "%08x", s->h[i]);
    }
}

/* ---- tokenizer fingerprint --------------------------------------------------------------- */

/* The byte stream hashed (convert/vocab/load.py tokenizer_sha256 writes the same):
 * "dflash-tokenizer-v1\n", then for the token list and the merges each: the entry count
 * (u64 LE) and every entry as its length (u32 LE) and bytes; then, with `special`, the
 * bos, eos, unk, sep and pad ids as i32 LE (-1 when absent). */
static const char * SPECIAL_KEYS[5] = {
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.seperator_token_id", "tokenizer.ggml.padding_token_id",
};

static void put_u32(sha256 * s, uint32_t v) {
    uint8_t b[4] = { (uint8_t) v, (uint8_t) (v >> 8), (uint8_t) (v >> 16), (uint8_t) (v >> 24) };
    sha256_update(s, b, 4);
}

static void put_u64(sha256 * s, uint64_t v) {
    put_u32(s, (uint32_t) v);
    put_u32(s, (uint32_t) (v >> 32));
}

static int64_t string_array(const dfl_gguf * g, const char * key) {
    const int64_t id = gguf_find_key(g->meta, key);
    if (id < 0 || gguf_get_kv_type(g->meta, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g->meta, id) != GGUF_TYPE_STRING) {
        return -1;
    }
    return id;
}

static void put_strings(sha256 * s, const dfl_gguf * g, int64_t id) {
    const size_t n = id < 0 ? 0 : gguf_get_arr_n(g->meta, id);
    put_u64(s, n);
    for (size_t i = 0; i < n; i++) {
        const char * str = gguf_get_arr_str(g->meta, id, i);
        const size_t len = strlen(str);
        put_u32(s, (uint32_t) len);
        sha256_update(s, str, len);
    }
}

/* A special token id key as an int: -1 when absent or not an integer. */
static int64_t special_id(const dfl_gguf * g, const char * key) {
    const int64_t id = gguf_find_key(g->meta, key);
    if (id < 0) {
        return -1;
    }
    switch (gguf_get_kv_type(g->meta, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g->meta, id);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g->meta, id);
        default: return -1;
    }
}

bool dfl_tokenizer_sha256(const dfl_gguf * g, bool special, char hex[65]) {
    const int64_t tokens = string_array(g, "tokenizer.ggml.tokens");
    if (tokens < 0) {
        return false;
    }
    sha256 s;
    sha256_init(&s);
    const char * tag = "dflash-tokenizer-v1\n";
    sha256_update(&s, tag, strlen(tag));
    put_strings(&s, g, tokens);
    put_strings(&s, g, string_array(g, "tokenizer.ggml.merges"));
    if (special) {
        for (int i = 0; i < 5; i++) {
            put_u32(&s, (uint32_t) (int32_t) special_id(g, SPECIAL_KEYS[i]));
        }
    }
    sha256_hex(&s, hex);
    return true;
}

/* ---- tokenizer validation ---------------------------------------------------------------- */

static uint64_t fnv1a(const char * s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t) *s) * 1099511628211ull;
    }
    return h;
}

/* llama.cpp's name for an empty token */
static const char * token_text(const dfl_gguf * g, int64_t id, size_t i, char * buf, size_t n) {
    const char * s = gguf_get_arr_str(g->meta, id, i);
    if (s[0] == '\0') {
        snprintf(buf, n, "[EMPTY_%zu]", i);
        return buf;
    }
    return s;
}

/* The index of a token equal to an earlier one, or -1. */
static int64_t find_duplicate(const dfl_gguf * g, int64_t id, size_t n, int64_t * first) {
    size_t cap = 16;
    while (cap < 2 * n) {
        cap *= 2;
    }
    int64_t * slots = malloc(cap * sizeof *slots);
    if (!slots) {
        return -2;
    }
    for (size_t k = 0; k < cap; k++) {
        slots[k] = -1;
    }
    int64_t dup = -1;
    char a[48], b[48];
    for (size_t i = 0; i < n && dup < 0; i++) {
        const char * s = token_text(g, id, i, a, sizeof a);
        for (size_t k = fnv1a(s) & (cap - 1);; k = (k + 1) & (cap - 1)) {
            if (slots[k] < 0) {
                slots[k] = (int64_t) i;
                break;
            }
            if (strcmp(token_text(g, id, (size_t) slots[k], b, sizeof b), s) == 0) {
                dup = (int64_t) i;
                *first = slots[k];
                break;
            }
        }
    }
    free(slots);
    return dup;
}

dfl_status dfl_vocab_check(const dfl_gguf * g, int64_t n_vocab) {
    const int64_t model = gguf_find_key(g->meta, "tokenizer.ggml.model");
    const int64_t tokens = gguf_find_key(g->meta, "tokenizer.ggml.tokens");
    if (model < 0 && tokens < 0) {
        return DFL_OK; /* no tokenizer: token ids only */
    }
    if (model < 0 || gguf_get_kv_type(g->meta, model) != GGUF_TYPE_STRING) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tokenizer.ggml.model is missing or not a string", g->path);
    }
    const char * kind = gguf_get_val_str(g->meta, model);
    if (strcmp(kind, "gpt2") != 0 && strcmp(kind, "gemma4") != 0 && strcmp(kind, "llama") != 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tokenizer model '%.40s' is not supported (byte-level BPE 'gpt2' as "
                        "Qwen's, Gemma 4's BPE 'gemma4', or SentencePiece 'llama' as Gemma 3's)", g->path, kind);
    }
    if (string_array(g, "tokenizer.ggml.tokens") < 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tokenizer.ggml.tokens is missing or not an array of strings", g->path);
    }
    const size_t n = gguf_get_arr_n(g->meta, tokens);
    if ((int64_t) n != n_vocab) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has %zu tokens but %lld token embedding rows", g->path, n,
                        (long long) n_vocab);
    }
    const int64_t merges = gguf_find_key(g->meta, "tokenizer.ggml.merges");
    if (merges >= 0 && string_array(g, "tokenizer.ggml.merges") < 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tokenizer.ggml.merges is not an array of strings", g->path);
    }
    const char * int_arrays[2] = { "tokenizer.ggml.token_type", "tokenizer.ggml.scores" };
    for (int k = 0; k < 2; k++) {
        const int64_t id = gguf_find_key(g->meta, int_arrays[k]);
        if (id < 0) {
            continue;
        }
        const enum gguf_type want = k == 0 ? GGUF_TYPE_INT32 : GGUF_TYPE_FLOAT32;
        if (gguf_get_kv_type(g->meta, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g->meta, id) != want ||
            gguf_get_arr_n(g->meta, id) != n) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': %s must be an array of %zu %s", g->path, int_arrays[k], n,
                            k == 0 ? "int32" : "float32");
        }
    }
    int64_t first = -1;
    const int64_t dup = find_duplicate(g, tokens, n, &first);
    if (dup == -2) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    if (dup >= 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': tokens %lld and %lld are the same text: the vocabulary is corrupt",
                        g->path, (long long) first, (long long) dup);
    }
    return DFL_OK;
}

/* ---- drafter metadata -------------------------------------------------------------------- */

static void model_name(const dfl_gguf * g, char * buf, size_t n) {
    const int64_t id = gguf_find_key(g->meta, "general.name");
    if (id >= 0 && gguf_get_kv_type(g->meta, id) == GGUF_TYPE_STRING && gguf_get_val_str(g->meta, id)[0]) {
        snprintf(buf, n, "%.127s", gguf_get_val_str(g->meta, id));
    } else {
        const char * slash = strrchr(g->path, '/');
        snprintf(buf, n, "%.127s", slash ? slash + 1 : g->path);
    }
}

/* The key `suffix` (".target.name") under the file's architecture. */
static int64_t arch_key(const dfl_gguf * g, const char * suffix) {
    char full[160];
    snprintf(full, sizeof full, "%s%s", g->arch, suffix);
    return gguf_find_key(g->meta, full);
}

/* A drafter file's own description: a DFlash drafter's (dflash), or an EAGLE3 drafter's
 * (eagle3: no block of its own, the caller's drafts per step). */
static dfl_status read_meta(const dfl_gguf * g, dfl_draft_meta * m) {
    memset(m, 0, sizeof *m);
    const dfl_drafter_kind * kind = dfl_drafter_kind_at(dfl_drafter_find(g));
    if (!kind) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%.40s'; a drafter file must be %s", g->path, g->arch,
                        dfl_drafter_file_archs());
    }
    snprintf(m->kind, sizeof m->kind, "%s", kind->name);
    uint32_t v;
    TRY(dfl_gguf_u32(g, ".block_size", false, 16, &v));
    if (v < 2 || v > DFL_MAX_BLOCK) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': block size %u is outside 2..%d", g->path, v, DFL_MAX_BLOCK);
    }
    m->block_size = kind->autoregressive ? 0 : (int32_t) v;
    float eps, base;
    TRY(dfl_gguf_f32(g, ".attention.layer_norm_rms_epsilon", false, 0.0f, &eps));
    TRY(dfl_gguf_f32(g, ".rope.freq_base", false, 10000.0f, &base));
    if (eps < 0.0f || base <= 0.0f) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': invalid norm epsilon %g or rope base %g", g->path, (double) eps,
                        (double) base);
    }
    TRY(dfl_gguf_u32(g, ".embedding_length", true, 0, &v));
    m->n_embd = (int32_t) (v > INT32_MAX ? INT32_MAX : v);
    m->mask_token_id = -1;
    if (dfl_gguf_has(g, "tokenizer.ggml.mask_token_id")) {
        TRY(dfl_gguf_u32(g, "tokenizer.ggml.mask_token_id", true, 0, &v));
        m->mask_token_id = v > INT32_MAX ? INT32_MAX : (int32_t) v;
    }
    int n = 0;
    TRY(dfl_gguf_arr_i32(g, ".target_layers", m->target_layers, 16, &n));
    if (n == 0) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s': %s.target_layers is empty", g->path, g->arch);
    }
    for (int i = 0; i < n; i++) {
        if (m->target_layers[i] < 1) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': %s.target_layers lists layer %d (llama.cpp's convention "
                            "counts from 1)", g->path, g->arch, m->target_layers[i]);
        }
    }
    m->n_target_layers = n;
    model_name(g, m->name, sizeof m->name);

    const int64_t sha = arch_key(g, DFL_KEY_TARGET_TOKENIZER);
    if (sha >= 0) {
        if (gguf_get_kv_type(g->meta, sha) != GGUF_TYPE_STRING || strlen(gguf_get_val_str(g->meta, sha)) != 64) {
            return dfl_fail(DFL_ERR_FORMAT, "'%s': %s%s is not a sha256 hex digest", g->path, g->arch,
                            DFL_KEY_TARGET_TOKENIZER);
        }
        snprintf(m->target_tokenizer_sha256, sizeof m->target_tokenizer_sha256, "%s", gguf_get_val_str(g->meta, sha));
        TRY(dfl_gguf_u32(g, DFL_KEY_TARGET_N_EMBD, true, 0, &v));
        m->target_n_embd = v > INT32_MAX ? INT32_MAX : (int32_t) v;
        TRY(dfl_gguf_u32(g, DFL_KEY_TARGET_N_VOCAB, true, 0, &v));
        m->target_n_vocab = v > INT32_MAX ? INT32_MAX : (int32_t) v;
        const int64_t name = arch_key(g, DFL_KEY_TARGET_NAME);
        if (name >= 0 && gguf_get_kv_type(g->meta, name) == GGUF_TYPE_STRING) {
            snprintf(m->target_name, sizeof m->target_name, "%s", gguf_get_val_str(g->meta, name));
        } else {
            snprintf(m->target_name, sizeof m->target_name, "(unnamed)");
        }
        m->has_fingerprint = 1;
    }
    return DFL_OK;
}

dfl_status dfl_pair_check(const dfl_gguf * draft, const dfl_gguf * target, int64_t n_vocab, int64_t n_embd) {
    dfl_draft_meta m;
    TRY(read_meta(draft, &m));
    char tname[128];
    model_name(target, tname, sizeof tname);
    if (m.has_fingerprint) {
        if (m.target_n_embd != n_embd || m.target_n_vocab != n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter '%s' was converted for target '%s' (embedding %d x %d), but the "
                            "loaded target '%s' has a %lld x %lld embedding: wrong target/drafter pair", m.name,
                            m.target_name, m.target_n_vocab, m.target_n_embd, tname, (long long) n_vocab,
                            (long long) n_embd);
        }
        if (dfl_gguf_has(draft, DFL_KEY_TARGET_N_LAYER)) {
            uint32_t want, blocks, nextn;
            TRY(dfl_gguf_u32(draft, DFL_KEY_TARGET_N_LAYER, true, 0, &want));
            TRY(dfl_gguf_u32(target, ".block_count", true, 0, &blocks));
            TRY(dfl_gguf_u32(target, ".nextn_predict_layers", false, 0, &nextn));
            if (nextn > blocks || blocks - nextn != want) {
                return dfl_fail(DFL_ERR_ARGUMENT, "drafter '%s' was converted for target '%s' (%u layers), but the "
                                "loaded target '%s' has %u: wrong target/drafter pair", m.name, m.target_name, want,
                                tname, nextn > blocks ? 0 : blocks - nextn);
            }
        }
        char hex[65];
        if (dfl_tokenizer_sha256(target, true, hex) && strcmp(hex, m.target_tokenizer_sha256) != 0) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter '%s' was converted for target '%s' (tokenizer sha256 %.12s...), "
                            "but the loaded target '%s' has another tokenizer (sha256 %.12s...): wrong target/drafter "
                            "pair", m.name, m.target_name, m.target_tokenizer_sha256, tname, hex);
        }
        return DFL_OK;
    }
    /* no fingerprint (llama.cpp's converter): the vocabulary it carries is the target's */
    const int64_t tokens = string_array(draft, "tokenizer.ggml.tokens");
    if (tokens >= 0) {
        const size_t n = gguf_get_arr_n(draft->meta, tokens);
        if ((int64_t) n != n_vocab) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter '%s' carries a vocabulary of %zu tokens, but the loaded target "
                            "'%s' has %lld: wrong target/drafter pair", m.name, n, tname, (long long) n_vocab);
        }
        char a[65], b[65];
        if (dfl_tokenizer_sha256(draft, false, a) && dfl_tokenizer_sha256(target, false, b) && strcmp(a, b) != 0) {
            return dfl_fail(DFL_ERR_ARGUMENT, "drafter '%s' carries another vocabulary than the loaded target '%s' "
                            "(same size, different tokens or merges): wrong target/drafter pair", m.name, tname);
        }
    }
    return DFL_OK;
}

/* A model GGUF whose nextn layers draft for it (csrc/models/mtp.c): the layers before
 * them, whose final-normed state the MTP layer reads. */
static dfl_status read_mtp_meta(const dfl_gguf * g, dfl_draft_meta * m) {
    memset(m, 0, sizeof *m);
    uint32_t blocks, nextn, n_embd;
    TRY(dfl_gguf_u32(g, ".block_count", true, 0, &blocks));
    TRY(dfl_gguf_u32(g, ".nextn_predict_layers", false, 0, &nextn));
    TRY(dfl_gguf_u32(g, ".embedding_length", true, 0, &n_embd));
    if (nextn == 0 || nextn >= blocks || blocks > 4096) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has architecture '%s' and no nextn (MTP) layers: not a drafter "
                        "(convert the checkpoint without --no-mtp)", g->path, g->arch);
    }
    m->mask_token_id = -1;
    m->n_embd = n_embd > INT32_MAX ? INT32_MAX : (int32_t) n_embd;
    m->n_target_layers = 1;
    m->target_layers[0] = (int32_t) (blocks - nextn);
    model_name(g, m->name, sizeof m->name);
    return DFL_OK;
}

DFL_API dfl_status dfl_draft_read_meta(const char * path, dfl_draft_meta * meta) {
    if (!path || !meta) {
        return dfl_fail(DFL_ERR_ARGUMENT, "dfl_draft_read_meta needs a path and a result");
    }
    dfl_gguf g;
    TRY(dfl_gguf_open(path, &g));
    /* the kind that reads the file, as the loader picks it (a DSpark drafter: a 'dflash'
     * GGUF with a Markov head) */
    const int found = dfl_drafter_find(&g);
    const dfl_drafter_kind * kind = dfl_drafter_kind_at(found);
    dfl_status st;
    if (kind && kind->in_target) {
        st = read_mtp_meta(&g, meta);
        snprintf(meta->kind, sizeof meta->kind, "%s", kind->name);
    } else {
        st = read_meta(&g, meta);
    }
    const dfl_drafter_arch * arch = dfl_drafter_arch_at(found);
    if (st == DFL_OK && arch && arch->read_meta) {
        arch->read_meta(&g, meta);
    }
    dfl_gguf_close(&g);
    return st;
}

DFL_API dfl_status dfl_tokenizer_fingerprint(const char * path, char * hex, size_t size) {
    if (!path || !hex || size < 65) {
        return dfl_fail(DFL_ERR_ARGUMENT, "dfl_tokenizer_fingerprint needs a path and 65 bytes");
    }
    dfl_gguf g;
    TRY(dfl_gguf_open(path, &g));
    const bool found = dfl_tokenizer_sha256(&g, true, hex);
    dfl_gguf_close(&g);
    if (!found) {
        return dfl_fail(DFL_ERR_FORMAT, "'%s' has no tokenizer (tokenizer.ggml.tokens)", path);
    }
    return DFL_OK;
}
