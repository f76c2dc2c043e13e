/* Tree verify planning (see dfl_tree.h): where each node's recurrence runs, padded so
 * that the graph depends on the node count and a shape that changes rarely. */
#include "dfl_tree.h"

#include <stdlib.h>
#include <string.h>

#define TREE_SHAPE_RESET 64

static int max_int(int a, int b) {
    return a > b ? a : b;
}

/* Each size at its largest over the trees of n nodes: the spine has at least two nodes
 * when n > 1, so at most n - 2 leaves are off it; a branch of L steps leaves a spine
 * of more than L nodes (the spine is a longest path), so 2 L + 1 <= n. plan_recurrence
 * keeps every shape within n - 2 branches in all, so this one-group shape, keeping a
 * state of every spine step and n - 2 nodes off it, bounds the memory of every tree
 * graph of n nodes. */
tree_shape dfl_tree_worst_shape(int n) {
    tree_shape sh = { n, 0, DFL_MAX_TREE, 0, { 0 }, { 0 } };
    if (n >= 3) {
        sh.split = n;
        sh.first = 0;
        sh.off = n - 2;
        sh.branches[DFL_TREE_GROUPS - 1] = n - 2;
        sh.steps[DFL_TREE_GROUPS - 1] = (n - 1) / 2;
    }
    return sh;
}

/* What a shape costs, in delta-rule steps: its padded steps, the states it copies (a
 * kept spine state; the second part's start; per branch, the gather of its start and
 * the op's own copy of it) and one step's worth per branch op. A state copy costs
 * about a step (both touch the whole state once or twice). */
static int shape_cost(const tree_shape * sh) {
    int cost = sh->spine;
    if (tree_branches(sh) > 0) {
        cost += sh->split - sh->first + (sh->split < sh->spine ? 1 : 0);
    }
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        if (sh->branches[g] > 0) {
            cost += sh->branches[g] * (sh->steps[g] + 2) + 1;
        }
    }
    return cost;
}

/* Each size at the larger of two shapes'; the spine's kept states reach from the
 * earlier first branch to the later last one. */
static tree_shape max_shape(tree_shape a, const tree_shape * b) {
    a.spine = max_int(a.spine, b->spine);
    a.split = max_int(a.split, b->split);
    a.first = a.first < b->first ? a.first : b->first;
    a.off = max_int(a.off, b->off);
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        a.branches[g] = max_int(a.branches[g], b->branches[g]);
        a.steps[g] = max_int(a.steps[g], b->steps[g]);
    }
    return a;
}

/* The branches sorted by length, split at k: the k shortest in group `lo`, the rest in
 * the other (DFL_TREE_GROUPS is 2). */
static tree_shape split_shape(int spine, int split, int first, int off, const int * len, int n_branches, int k,
                              int lo) {
    tree_shape sh = { spine, split, first, off, { 0 }, { 0 } };
    sh.branches[lo] = k;
    sh.steps[lo] = k > 0 ? len[k - 1] : 0;
    sh.branches[1 - lo] = n_branches - k;
    sh.steps[1 - lo] = n_branches > k ? len[n_branches - 1] : 0;
    return sh;
}

/* A tree's spine and its branches (see plan_recurrence). */
typedef struct {
    int spine;                    /* the spine's nodes */
    int down[DFL_MAX_TREE];       /* the child on the longest path below a node, -1 at a leaf */
    int spine_step[DFL_MAX_TREE]; /* a spine node's step, -1 off the spine */
    int nb;                       /* branches, sorted by length: */
    int leaf[DFL_MAX_TREE];       /*   the leaf each ends at */
    int from[DFL_MAX_TREE];       /*   the spine step it leaves from */
    int len[DFL_MAX_TREE];        /*   its nodes off the spine */
    int first_from, last_from;    /* the earliest and latest spine steps a branch leaves from */
} tree_walk;

/* The spine follows, from the root, a child with the longest path below it (the first
 * such child), so branches are short; a branch is the path from the spine to a leaf off
 * it. */
static void walk_tree(const tree_plan * tp, tree_walk * w) {
    const int n = tp->n;
    int height[DFL_MAX_TREE];
    bool inner[DFL_MAX_TREE];
    for (int i = 0; i < n; i++) {
        height[i] = 1;
        w->down[i] = -1;
        w->spine_step[i] = -1;
        inner[i] = false;
    }
    for (int i = n - 1; i > 0; i--) {
        const int p = tp->parent[i];
        inner[p] = true;
        if (height[i] + 1 >= height[p]) { /* ties: the child that comes first */
            height[p] = height[i] + 1;
            w->down[p] = i;
        }
    }
    w->spine = height[0];
    for (int x = 0, s = 0; x >= 0; x = w->down[x], s++) {
        w->spine_step[x] = s;
    }
    /* branches, by length (insertion sort: stable, at most 62 of them) */
    w->nb = 0;
    w->first_from = DFL_MAX_TREE;
    w->last_from = -1;
    for (int i = 0; i < n; i++) {
        if (inner[i] || w->spine_step[i] >= 0) {
            continue;
        }
        int x = i;
        while (w->spine_step[x] < 0) {
            x = tp->parent[x];
        }
        const int l = tp->depth[i] - tp->depth[x];
        int j = w->nb++;
        for (; j > 0 && w->len[j - 1] > l; j--) {
            w->leaf[j] = w->leaf[j - 1];
            w->from[j] = w->from[j - 1];
            w->len[j] = w->len[j - 1];
        }
        w->leaf[j] = i;
        w->from[j] = w->spine_step[x];
        w->len[j] = l;
        w->first_from = w->from[j] < w->first_from ? w->from[j] : w->first_from;
        w->last_from = max_int(w->last_from, w->from[j]);
    }
}

/* The padded shape for this tree: branches sorted by length split in two groups (the
 * short ones in either) where that costs least (shape_cost), each size at the largest
 * seen for this node count within n - 2 branches in all, or from this tree alone after
 * TREE_SHAPE_RESET trees (or when no split fits). *k and *lo: the split chosen, the k
 * shortest branches in group *lo. */
static tree_shape choose_shape(dfl_tree_shapes * shapes, int n, const tree_walk * w, int * k_best, int * lo_best) {
    tree_shape * seen = &shapes->seen[n];
    const bool reset = ++shapes->age[n] >= TREE_SHAPE_RESET || seen->spine == 0;
    if (reset) {
        shapes->age[n] = 0;
    }
    tree_shape best = { 0 };
    int best_cost = -1;
    for (int pass = reset ? 1 : 0; pass < 2 && best_cost < 0; pass++) {
        /* pass 0 within the shape seen, pass 1 (a reset, or no split fits n - 2
         * branches in all) from this tree alone; the short ones in either group */
        for (int k = 0; k <= w->nb; k++) {
            for (int lo = 0; lo < 2; lo++) {
                tree_shape sh = split_shape(w->spine, w->last_from + 1, w->first_from, n - w->spine, w->len, w->nb,
                                            k, lo);
                if (pass == 0) {
                    sh = max_shape(sh, seen);
                    if (tree_branches(&sh) > max_int(n - 2, 0)) {
                        continue;
                    }
                }
                const int cost = shape_cost(&sh);
                if (best_cost < 0 || cost < best_cost) {
                    best = sh;
                    best_cost = cost;
                    *k_best = k;
                    *lo_best = lo;
                }
            }
        }
    }
    return *seen = best;
}

/* Each recurrence row's node: the spine's steps, then each group's branches (the k
 * shortest in group lo), each from the kept spine state it leaves from. Padding steps
 * repeat a real node after the last one read (their results are never read), padding
 * branches run the root from the last state. */
static void place_steps(tree_plan * tp, const tree_walk * w, int k_best, int lo_best) {
    const tree_shape sh = tp->shape;
    int32_t * steps = tp->steps;
    int last = 0;
    for (int x = 0; x >= 0; x = w->down[x]) {
        steps[w->spine_step[x]] = last = x;
        tp->out_rows[x] = w->spine_step[x];
    }
    for (int s = w->spine; s < sh.spine; s++) {
        steps[s] = last;
    }
    int row0 = sh.spine, seq = 0;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        int b = g == lo_best ? 0 : k_best;
        const int end = g == lo_best ? k_best : w->nb;
        for (int j = 0; j < sh.branches[g]; j++, seq++, row0 += sh.steps[g]) {
            if (b == end) { /* padding */
                tp->branch_from[seq] = 0;
                for (int s = 0; s < sh.steps[g]; s++) {
                    steps[row0 + s] = 0;
                }
                continue;
            }
            const int i = w->leaf[b], d0 = tp->depth[i] - w->len[b];
            /* kept state s: s steps before the end of the spine's first part */
            tp->branch_from[seq] = sh.split - 1 - w->from[b];
            for (int y = i; tp->depth[y] > d0; y = tp->parent[y]) {
                const int row = row0 + tp->depth[y] - d0 - 1;
                steps[row] = y;
                if (tp->out_rows[y] < 0) {
                    tp->out_rows[y] = row;
                }
            }
            for (int s = w->len[b]; s < sh.steps[g]; s++) {
                steps[row0 + s] = i;
            }
            b++;
        }
    }
}

/* Rows of the ops after the recurrence: spare rows first, then the nodes they compute
 * first. */
static void place_scatter(tree_plan * tp) {
    const tree_shape sh = tp->shape;
    const int n = tp->n, head = tree_head_rows(&sh);
    int bound[2 + DFL_TREE_GROUPS] = { head, sh.spine };
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        bound[g + 2] = bound[g + 1] + sh.branches[g] * sh.steps[g];
    }
    for (int o = 0; o <= DFL_TREE_GROUPS; o++) {
        for (int r = bound[o]; r < bound[o + 1]; r++) {
            tp->scatter[r - head] = n + r - bound[o];
        }
    }
    for (int i = 0; i < n; i++) {
        if (tp->out_rows[i] >= head) {
            tp->scatter[tp->out_rows[i] - head] = i;
            tp->out_rows[i] = 0;
        }
    }
    for (int i = n; i < n + tree_spare_rows(&sh); i++) {
        tp->out_rows[i] = 0;
    }
}

/* The convolution's rows: the committed inputs and the spine, then a window per node
 * off it; or a window per node. */
static void place_conv(tree_plan * tp, const tree_walk * w, int W) {
    const tree_shape sh = tp->shape;
    const int n = tp->n;
    int32_t * rows = tp->conv_rows;
    if (!tree_conv_spine(&sh, n, W + 1)) {
        memcpy(rows, tp->windows, (size_t) n * (W + 1) * sizeof(int32_t));
        return;
    }
    for (int k = 0; k < W; k++) {
        rows[k] = k;
    }
    for (int s = 0; s < sh.spine; s++) {
        rows[W + s] = W + tp->steps[s];
    }
    int off = 0;
    for (int i = 0; i < n; i++) {
        tp->conv_out[i] = w->spine_step[i] >= 0 ? w->spine_step[i] : 0;
        if (w->spine_step[i] < 0) {
            memcpy(&rows[W + sh.spine + off * (W + 1)], &tp->windows[(size_t) i * (W + 1)],
                   (size_t) (W + 1) * sizeof(int32_t));
            tp->conv_scatter[off++] = i;
        }
    }
    for (; off < sh.off; off++) {
        memcpy(&rows[W + sh.spine + off * (W + 1)], tp->windows, (size_t) (W + 1) * sizeof(int32_t));
        tp->conv_scatter[off] = n + off;
    }
    for (int i = n; i < n + sh.off; i++) {
        tp->conv_out[i] = 0;
    }
}

/* The recurrence of a tree (see tree_plan): a spine and branches off it (walk_tree),
 * their padded shape (choose_shape), which grows to the largest of each size seen for
 * this node count so that trees of a budget share one graph once a few steps have set
 * it; every TREE_SHAPE_RESET trees it restarts from the current tree's, so that a rare
 * odd tree does not pad every later one (at most one graph rebuild per reset). Then
 * each row's node (place_steps), the later ops' rows (place_scatter) and the
 * convolution's (place_conv). */
static void plan_recurrence(tree_plan * tp, dfl_tree_shapes * shapes, int d_conv) {
    tree_walk w;
    int k_best = 0, lo_best = 0;
    walk_tree(tp, &w);
    tp->shape = choose_shape(shapes, tp->n, &w, &k_best, &lo_best);
    place_steps(tp, &w, k_best, lo_best);
    place_scatter(tp);
    place_conv(tp, &w, d_conv - 1);
}

dfl_status dfl_tree_plan(tree_plan * tp, dfl_tree_shapes * shapes, const int32_t * parents, int n, int d_conv) {
    const int W = d_conv - 1; /* -1 without recurrent layers: no windows */
    if (n <= 0 || !parents) {
        return dfl_fail(DFL_ERR_ARGUMENT, "a tree needs at least one node");
    }
    if (n > DFL_MAX_TREE) {
        return dfl_fail(DFL_ERR_CAPACITY, "a tree of %d nodes exceeds the supported %d", n, DFL_MAX_TREE);
    }
    tp->n = n;
    for (int i = 0; i < n; i++) {
        const int p = parents[i];
        if (i == 0 ? p != -1 : (p < 0 || p >= i)) {
            return dfl_fail(DFL_ERR_ARGUMENT, "tree node %d has parent %d: node 0 is the root (parent -1) and every "
                            "other node's parent must come before it", i, p);
        }
        tp->parent[i] = p;
        tp->depth[i] = i == 0 ? 0 : tp->depth[p] + 1;
        tp->ancestors[i] = (i == 0 ? 0 : tp->ancestors[p]) | (1ull << i);
        /* conv window: the last W+1 inputs along the path, oldest first; columns 0..W-1
         * of the concatenation are the committed inputs, W+j is node j */
        int32_t * w = &tp->windows[(size_t) i * (W + 1)];
        int node = i;
        for (int k = W; k >= 0; k--) {
            if (node >= 0) {
                w[k] = W + node;
                node = tp->parent[node];
            } else {
                w[k] = w[k + 1] - 1; /* walked past the root: into the committed inputs */
            }
        }
        tp->out_rows[i] = -1;
    }
    tp->shape = (tree_shape) { 0 };
    if (d_conv > 0) {
        plan_recurrence(tp, shapes, d_conv);
    }
    return DFL_OK;
}

DFL_API dfl_status dfl_tree_describe(const int32_t * parents, int32_t n, int32_t d_conv, dfl_tree_layout * out) {
    if (!out) {
        return dfl_fail(DFL_ERR_ARGUMENT, "null layout");
    }
    if (d_conv < 2 || d_conv > 16) {
        return dfl_fail(DFL_ERR_ARGUMENT, "convolution kernel %d is outside 2..16", d_conv);
    }
    tree_plan * tp = calloc(1, sizeof *tp);
    dfl_tree_shapes * shapes = calloc(1, sizeof *shapes);
    dfl_status st = tp && shapes ? dfl_tree_plan(tp, shapes, parents, n, d_conv)
                                 : dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    if (st == DFL_OK) {
        const tree_shape * sh = &tp->shape;
        memset(out, 0, sizeof *out);
        out->n = n;
        memcpy(out->depth, tp->depth, (size_t) n * sizeof(int32_t));
        memcpy(out->ancestors, tp->ancestors, (size_t) n * sizeof(uint64_t));
        memcpy(out->windows, tp->windows, (size_t) n * d_conv * sizeof(int32_t));
        out->spine = sh->spine;
        out->split = sh->split;
        out->first = sh->first;
        out->off = sh->off;
        for (int g = 0; g < DFL_TREE_GROUPS; g++) {
            out->branches[g] = sh->branches[g];
            out->steps[g] = sh->steps[g];
        }
        out->n_steps = (int32_t) tree_steps(sh);
        memcpy(out->step_node, tp->steps, (size_t) out->n_steps * sizeof(int32_t));
        out->n_branches = tree_branches(sh);
        memcpy(out->branch_from, tp->branch_from, (size_t) out->n_branches * sizeof(int32_t));
        out->n_out_rows = n + (int32_t) tree_spare_rows(sh);
        memcpy(out->out_rows, tp->out_rows, (size_t) out->n_out_rows * sizeof(int32_t));
        out->n_scatter = out->n_branches > 0 ? (int32_t) (tree_steps(sh) - tree_head_rows(sh)) : 0;
        memcpy(out->scatter, tp->scatter, (size_t) out->n_scatter * sizeof(int32_t));
        out->conv_spine = tree_conv_spine(sh, n, d_conv);
        out->n_conv_rows = (int32_t) tree_conv_rows(sh, n, d_conv);
        memcpy(out->conv_rows, tp->conv_rows, (size_t) out->n_conv_rows * sizeof(int32_t));
        out->n_conv_out = out->conv_spine ? n + sh->off : 0;
        memcpy(out->conv_out, tp->conv_out, (size_t) out->n_conv_out * sizeof(int32_t));
        out->n_conv_scatter = out->conv_spine ? sh->off : 0;
        memcpy(out->conv_scatter, tp->conv_scatter, (size_t) out->n_conv_scatter * sizeof(int32_t));
    }
    free(tp);
    free(shapes);
    return st;
}
