/* The drafter registry: csrc/models/drafters.def's kinds (dflash.h's dfl_drafter_kind),
 * each with the architecture its model file defines (dfl_drafter.h), and the one rule
 * that tells which kind reads a file, which the loader (dfl_draft.c), the metadata read
 * (dfl_pair.c) and, through dfl_drafter_kind_at, the Python kind checks follow. */
#include "dfl_drafter.h"

#include <stdio.h>
#include <string.h>

#define DFL_DRAFTER(name, ...) extern const dfl_drafter_arch dfl_drafter_##name;
#include "models/drafters.def"
#undef DFL_DRAFTER

#define DFL_DRAFTER(name, title, what, help, marker, flags, ...) \
    static const char * const archs_##name[] = { __VA_ARGS__, NULL };
#include "models/drafters.def"
#undef DFL_DRAFTER

static const dfl_drafter_kind KINDS[] = {
#define DFL_DRAFTER(name, title, what, help, marker, flags, ...) \
    { #name, "draft-" #name, title, what, help, marker, archs_##name, ((flags) & DFL_DRAFTER_AUTOREGRESSIVE) != 0, \
      ((flags) & DFL_DRAFTER_IN_TARGET) != 0 },
#include "models/drafters.def"
#undef DFL_DRAFTER
};

static const dfl_drafter_arch * const ARCHS[] = {
#define DFL_DRAFTER(name, ...) &dfl_drafter_##name,
#include "models/drafters.def"
#undef DFL_DRAFTER
};

#define N_KINDS ((int) (sizeof KINDS / sizeof KINDS[0]))

DFL_API int32_t dfl_drafter_kind_count(void) {
    return N_KINDS;
}

DFL_API const dfl_drafter_kind * dfl_drafter_kind_at(int32_t i) {
    return i >= 0 && i < N_KINDS ? &KINDS[i] : NULL;
}

const dfl_drafter_arch * dfl_drafter_arch_at(int kind) {
    return kind >= 0 && kind < N_KINDS ? ARCHS[kind] : NULL;
}

static bool reads(const dfl_drafter_kind * k, const char * arch) {
    for (const char * const * a = k->archs; *a; a++) {
        if (strcmp(*a, arch) == 0) {
            return true;
        }
    }
    return false;
}

int dfl_drafter_find(const dfl_gguf * file) {
    int plain = -1;
    for (int i = 0; i < N_KINDS; i++) {
        if (!reads(&KINDS[i], file->arch)) {
            continue;
        }
        if (!KINDS[i].marker) {
            plain = plain < 0 ? i : plain;
        } else if (ggml_get_tensor(file->ctx, KINDS[i].marker)) {
            return i;
        }
    }
    return plain;
}

const char * dfl_drafter_archs(void) {
    static char names[256];
    if (!names[0]) {
        size_t at = 0;
        for (int i = 0; i < N_KINDS; i++) {
            for (const char * const * a = KINDS[i].archs; *a && at < sizeof names; a++) {
                at += (size_t) snprintf(names + at, sizeof names - at, "%s%s (%s)", at ? ", " : "", *a,
                                        KINDS[i].name);
            }
        }
    }
    return names;
}

const char * dfl_drafter_file_archs(void) {
    static char names[256];
    if (!names[0]) {
        const char * archs[2 * N_KINDS];
        int n = 0;
        for (int i = 0; i < N_KINDS; i++) {
            for (const char * const * a = KINDS[i].archs; !KINDS[i].in_target && *a; a++) {
                bool seen = false;
                for (int j = 0; j < n && !seen; j++) {
                    seen = strcmp(archs[j], *a) == 0;
                }
                if (!seen && n < (int) (sizeof archs / sizeof archs[0])) {
                    archs[n++] = *a;
                }
            }
        }
        size_t at = 0;
        for (int j = 0; j < n && at < sizeof names; j++) {
            at += (size_t) snprintf(names + at, sizeof names - at, "%s'%s'", j == 0 ? "" : j == n - 1 ? " or " : ", ",
                                    archs[j]);
        }
    }
    return names;
}
