/* Named-tensor dumps (see dfl_dump.h). Values cross to the host only through
 * ggml_backend_tensor_get, so a dump reads the same on any backend. */
#include "dfl_dump.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { DUMP_IDLE, DUMP_ACTIVE, DUMP_DONE };

struct dfl_dump {
    regex_t re;
    char * path;
    FILE * f;
    int state;
    int skip;     /* graphs with a match still to pass over (DFLASH_DUMP_SKIP) */
    bool every_node;
    int n_dumped; /* tensors written by the graph now running */
    void * buf;   /* the tensor's bytes as ggml_backend_tensor_get returns them */
    size_t buf_size;
    float * vals; /* and as float32 in element order */
    size_t vals_size;
};

static bool set(const char * var) {
    const char * v = getenv(var);
    return v && v[0];
}

dfl_status dfl_dump_from_env(const char * file_var, dfl_dump ** out) {
    *out = NULL;
    const char * pattern = getenv("DFLASH_DUMP_TENSORS");
    if (!pattern || !pattern[0]) {
        return DFL_OK;
    }
    const char * path = getenv(file_var);
    if (!path || !path[0]) {
        if (set(DFL_DUMP_FILE) || set(DFL_DUMP_DRAFT_FILE)) {
            return DFL_OK; /* the other runtime's dump */
        }
        return dfl_fail(DFL_ERR_ARGUMENT, "DFLASH_DUMP_TENSORS is set but DFLASH_DUMP_FILE (where to write) is not");
    }
    dfl_dump * d = calloc(1, sizeof *d);
    if (!d) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    if (regcomp(&d->re, pattern, REG_EXTENDED | REG_NOSUB) != 0) {
        free(d);
        return dfl_fail(DFL_ERR_ARGUMENT, "DFLASH_DUMP_TENSORS: invalid regular expression '%s'", pattern);
    }
    const char * skip = getenv("DFLASH_DUMP_SKIP");
    d->skip = skip && skip[0] ? atoi(skip) : 0;
    if (d->skip < 0) {
        regfree(&d->re);
        free(d);
        return dfl_fail(DFL_ERR_ARGUMENT, "DFLASH_DUMP_SKIP must be 0 or more, not '%s'", skip);
    }
    d->path = strdup(path);
    d->f = fopen(path, "wb");
    if (!d->path || !d->f) {
        if (d->f) fclose(d->f);
        regfree(&d->re);
        free(d->path);
        free(d);
        return dfl_fail(DFL_ERR_IO, "%s: cannot write '%s'", file_var, path);
    }
    *out = d;
    return DFL_OK;
}

static bool grow(void ** p, size_t * size, size_t need) {
    if (*size >= need) {
        return true;
    }
    void * q = realloc(*p, need);
    if (!q) {
        return false;
    }
    *p = q;
    *size = need;
    return true;
}

/* The tensor's elements as float32 in ggml order, from its bytes (which start at the
 * tensor's own offset; strides as nb says, so views read correctly). */
static bool to_floats(const struct ggml_tensor * t, const char * bytes, float * out) {
    const struct ggml_type_traits * tr = ggml_get_type_traits(t->type);
    if (t->type != GGML_TYPE_F32 && (!tr->to_float || ggml_is_quantized(t->type))) {
        return false; /* integer and quantized tensors are not compared */
    }
    size_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                const char * row = bytes + i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1];
                if (t->nb[0] == ggml_type_size(t->type)) {
                    if (t->type == GGML_TYPE_F32) {
                        memcpy(out + k, row, (size_t) t->ne[0] * sizeof(float));
                    } else {
                        tr->to_float(row, out + k, t->ne[0]);
                    }
                } else {
                    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                        const char * e = row + i0 * t->nb[0];
                        if (t->type == GGML_TYPE_F32) {
                            memcpy(out + k + i0, e, sizeof(float));
                        } else {
                            tr->to_float(e, out + k + i0, 1);
                        }
                    }
                }
                k += (size_t) t->ne[0];
            }
        }
    }
    return true;
}

static void write_tensor(dfl_dump * d, struct ggml_tensor * t) {
    const size_t nbytes = ggml_nbytes(t);
    const size_t n = (size_t) ggml_nelements(t);
    if (!grow(&d->buf, &d->buf_size, nbytes) || !grow((void **) &d->vals, &d->vals_size, n * sizeof(float))) {
        fprintf(stderr, "[dflash dump] out of host memory at %s; skipped\n", t->name);
        return;
    }
    ggml_backend_tensor_get(t, d->buf, 0, nbytes);
    if (!to_floats(t, d->buf, d->vals)) {
        return;
    }
    fprintf(d->f, "{\"name\": \"%s\", \"op\": \"%s\", \"type\": \"%s\", \"ne\": [%lld, %lld, %lld, %lld], \"n\": %zu}\n",
            t->name, ggml_op_desc(t), ggml_type_name(t->type), (long long) t->ne[0], (long long) t->ne[1],
            (long long) t->ne[2], (long long) t->ne[3], n);
    fwrite(d->vals, sizeof(float), n, d->f);
    d->n_dumped++;
}

static bool dump_node(struct ggml_tensor * t, bool ask, void * user_data) {
    dfl_dump * d = user_data;
    const bool wanted = d->state == DUMP_ACTIVE && t->name[0] && regexec(&d->re, t->name, 0, NULL, 0) == 0;
    if (ask) {
        return wanted || d->every_node; /* the scheduler stops after this node and calls again */
    }
    if (wanted && d->skip > 0) {
        d->n_dumped++; /* a graph passed over: counted, not written */
    } else if (wanted) {
        write_tensor(d, t);
    }
    return true;
}

void dfl_dump_attach(dfl_dump * d, ggml_backend_sched_t sched, bool every_node) {
    if (d) {
        d->every_node = d->every_node || every_node;
        ggml_backend_sched_set_eval_callback(sched, dump_node, d);
    }
}

void dfl_dump_begin(dfl_dump * d) {
    if (d && d->state == DUMP_IDLE) {
        d->state = DUMP_ACTIVE;
        d->n_dumped = 0;
    }
}

void dfl_dump_end(dfl_dump * d) {
    if (!d || d->state != DUMP_ACTIVE) {
        return;
    }
    if (d->n_dumped == 0) {
        d->state = DUMP_IDLE; /* nothing matched: wait for the prompt pass */
        return;
    }
    if (d->skip > 0) {
        d->skip--;
        d->state = DUMP_IDLE;
        return;
    }
    d->state = DUMP_DONE;
    if (fclose(d->f) != 0) {
        fprintf(stderr, "[dflash dump] error writing '%s'\n", d->path);
    }
    d->f = NULL;
    fprintf(stderr, "[dflash dump] %d tensors written to %s\n", d->n_dumped, d->path);
}

void dfl_dump_free(dfl_dump * d) {
    if (!d) {
        return;
    }
    if (d->f) fclose(d->f);
    regfree(&d->re);
    free(d->path);
    free(d->buf);
    free(d->vals);
    free(d);
}
