/* The kept-graph check (see dfl_reuse_check.h). */
#include "dfl_reuse_check.h"

#include <ggml-backend.h>
#include <stdlib.h>
#include <string.h>

/* A node as ggml-cuda's graph update compares it (ggml_cuda_graph_update_required). */
typedef struct node_props {
    struct ggml_tensor node;
    void * src_data[GGML_MAX_SRC];
    int64_t src_ne[GGML_MAX_SRC][GGML_MAX_DIMS];
    size_t src_nb[GGML_MAX_SRC][GGML_MAX_DIMS];
} node_props;

typedef struct snapshot {
    const struct ggml_cgraph * gf; /* the graph it is of (NULL: none taken) */
    int n_nodes;
    node_props * props;
} snapshot;

struct dfl_reuse_check {
    int n_slots;
    snapshot slots[];
};

dfl_status dfl_reuse_check_from_env(int n_slots, dfl_reuse_check ** out) {
    *out = NULL;
    const char * v = getenv(DFL_CHECK_REUSE_ENV);
    if (!v || !v[0] || strcmp(v, "0") == 0) {
        return DFL_OK;
    }
    dfl_reuse_check * c = calloc(1, sizeof *c + (size_t) n_slots * sizeof(snapshot));
    if (!c) {
        return dfl_fail(DFL_ERR_BACKEND, "%s: out of host memory", DFL_CHECK_REUSE_ENV);
    }
    c->n_slots = n_slots;
    *out = c;
    return DFL_OK;
}

void dfl_reuse_check_forget(dfl_reuse_check * c, int slot) {
    if (!c) {
        return;
    }
    free(c->slots[slot].props);
    memset(&c->slots[slot], 0, sizeof c->slots[slot]);
}

void dfl_reuse_check_free(dfl_reuse_check * c) {
    for (int i = 0; c && i < c->n_slots; i++) {
        dfl_reuse_check_forget(c, i);
    }
    free(c);
}

static void props_of(const struct ggml_tensor * t, node_props * p) {
    memset(p, 0, sizeof *p);
    memcpy(&p->node, t, sizeof *t);
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        if (t->src[j]) {
            p->src_data[j] = t->src[j]->data;
            memcpy(p->src_ne[j], t->src[j]->ne, sizeof p->src_ne[j]);
            memcpy(p->src_nb[j], t->src[j]->nb, sizeof p->src_nb[j]);
        }
    }
}

/* The first field in which a and b differ, by name. */
static const char * changed_field(const node_props * a, const node_props * b) {
    const struct ggml_tensor * x = &a->node, * y = &b->node;
#define DIFFERS(f) (memcmp(&x->f, &y->f, sizeof x->f) != 0)
    if (DIFFERS(op)) return "op";
    if (DIFFERS(op_params)) return "op_params";
    if (DIFFERS(type)) return "type";
    if (DIFFERS(ne)) return "ne (shape)";
    if (DIFFERS(nb)) return "nb (strides)";
    if (DIFFERS(data)) return "data";
    if (DIFFERS(view_src)) return "view_src";
    if (DIFFERS(view_offs)) return "view_offs";
    if (DIFFERS(flags)) return "flags";
    if (DIFFERS(src)) return "src (a source tensor)";
    if (DIFFERS(buffer)) return "buffer";
    if (DIFFERS(name)) return "name";
#undef DIFFERS
    if (memcmp(a->src_data, b->src_data, sizeof a->src_data) != 0) return "a source's data";
    if (memcmp(a->src_ne, b->src_ne, sizeof a->src_ne) != 0) return "a source's ne (shape)";
    if (memcmp(a->src_nb, b->src_nb, sizeof a->src_nb) != 0) return "a source's nb (strides)";
    return "another field of the node";
}

dfl_status dfl_reuse_check_before(dfl_reuse_check * c, int slot, const struct ggml_cgraph * gf) {
    if (!c || c->slots[slot].gf != gf) {
        return DFL_OK;
    }
    const snapshot * s = &c->slots[slot];
    const int n = ggml_graph_n_nodes((struct ggml_cgraph *) gf);
    if (n != s->n_nodes) {
        return dfl_fail(DFL_ERR_STATE, "%s: a kept graph of slot %d has %d nodes, %d at its first compute",
                        DFL_CHECK_REUSE_ENV, slot, n, s->n_nodes);
    }
    node_props now;
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * t = ggml_graph_node((struct ggml_cgraph *) gf, i);
        props_of(t, &now);
        if (memcmp(&now, &s->props[i], sizeof now) != 0) {
            return dfl_fail(DFL_ERR_STATE, "%s: a kept graph of slot %d changed since its first compute: node %d "
                            "(%s, '%s') differs in %s", DFL_CHECK_REUSE_ENV, slot, i, ggml_op_desc(t), t->name,
                            changed_field(&s->props[i], &now));
        }
    }
    return DFL_OK;
}

dfl_status dfl_reuse_check_after(dfl_reuse_check * c, int slot, const struct ggml_cgraph * gf) {
    if (!c || c->slots[slot].gf == gf) {
        return DFL_OK;
    }
    dfl_reuse_check_forget(c, slot);
    const int n = ggml_graph_n_nodes((struct ggml_cgraph *) gf);
    snapshot * s = &c->slots[slot];
    s->props = malloc((size_t) (n > 0 ? n : 1) * sizeof *s->props);
    if (!s->props) {
        return dfl_fail(DFL_ERR_BACKEND, "%s: out of host memory for a graph of %d nodes", DFL_CHECK_REUSE_ENV, n);
    }
    for (int i = 0; i < n; i++) {
        props_of(ggml_graph_node((struct ggml_cgraph *) gf, i), &s->props[i]);
    }
    s->gf = gf;
    s->n_nodes = n;
    return DFL_OK;
}

/* The check itself, on a small graph of the CPU's (a view of an input, scaled, added to
 * another input) computed once, then changed as `change` says before it would compute
 * again: what a kept graph must never undergo. */
DFL_API dfl_status dfl_reuse_check_probe(int change) {
    struct ggml_init_params params = { 1 << 20, NULL, false };
    struct ggml_context * ctx = ggml_init(params);
    if (!ctx) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    struct ggml_tensor * a = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    struct ggml_tensor * other = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 64);
    struct ggml_tensor * b = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 16);
    struct ggml_tensor * v = ggml_view_1d(ctx, a, 16, 0);
    struct ggml_tensor * scaled = ggml_scale(ctx, v, 2.0f);
    struct ggml_tensor * sum = ggml_add(ctx, scaled, b);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, sum);
    for (int i = 0; i < 64; i++) {
        ((float *) a->data)[i] = (float) i;
        ((float *) other->data)[i] = (float) -i;
    }
    memset(b->data, 0, ggml_nbytes(b));
    dfl_reuse_check * c = calloc(1, sizeof *c + sizeof(snapshot));
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
    dfl_status st = !c ? dfl_fail(DFL_ERR_BACKEND, "out of host memory")
                  : !cpu ? dfl_fail(DFL_ERR_BACKEND, "cannot initialise the CPU backend") : DFL_OK;
    if (st == DFL_OK) {
        c->n_slots = 1;
        st = ggml_backend_graph_compute(cpu, gf) == GGML_STATUS_SUCCESS ? DFL_OK
           : dfl_fail(DFL_ERR_BACKEND, "graph computation failed");
    }
    if (st == DFL_OK) {
        st = dfl_reuse_check_after(c, 0, gf);
    }
    if (st == DFL_OK) {
        const float three = 3.0f;
        switch (change) {
        case 1: /* the view moved along its source (a cache view at a new position) */
            v->view_offs = 16 * sizeof(float);
            v->data = (char *) a->data + v->view_offs;
            break;
        case 2: /* the scale's parameter */
            memcpy(scaled->op_params, &three, sizeof three);
            break;
        case 3: /* a source swapped for another tensor */
            sum->src[1] = ggml_view_1d(ctx, other, 16, 0);
            break;
        default:
            break;
        }
        st = dfl_reuse_check_before(c, 0, gf);
    }
    if (cpu) {
        ggml_backend_free(cpu);
    }
    dfl_reuse_check_free(c);
    ggml_free(ctx);
    return st;
}
