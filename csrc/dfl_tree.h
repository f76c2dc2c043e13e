/* Tree verify planning: a pure function of a tree's parents (and the padded shapes
 * trees of its size took lately) giving what its graph needs on the host: depths,
 * ancestor masks, the short convolution's windows and the layout of the recurrence
 * (dfl_tree.c). */
#ifndef DFL_TREE_H
#define DFL_TREE_H

#include "dfl_error.h"

#include <stdbool.h>
#include <stdint.h>

#define DFL_MAX_TREE 64

/* Branches of a tree verify run in this many delta-rule ops, each padded on its own. */
#define DFL_TREE_GROUPS 2

/* The padded shape of a tree verify's recurrence (see dfl_tree_plan):
 * the spine's steps, the steps of its first part (up to the last step a branch leaves
 * from) and the first step a branch leaves from, the nodes off the spine (the short
 * convolution's windows of their own), then per group of branches, branches x steps.
 * A shape without branches has split 0 and first DFL_MAX_TREE. */
typedef struct tree_shape {
    int spine, split, first, off;
    int branches[DFL_TREE_GROUPS], steps[DFL_TREE_GROUPS];
} tree_shape;

static inline int tree_branches(const tree_shape * sh) {
    int n = 0;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        n += sh->branches[g];
    }
    return n;
}

/* A tree verify's recurrence runs in up to 2 + DFL_TREE_GROUPS delta-rule ops per layer:
 * the spine (the longest root path) as one sequence in two parts, the first keeping
 * its states from the first branch's start on, the rest (after the last branch's
 * start) keeping none; then each group of the other leaves' paths from where they
 * leave the spine, one sequence each, starting from the spine's state there. Branches are
 * grouped by length, so short ones are not padded to the longest. Each node's output
 * is read from the first sequence through it. The short convolution runs the spine as
 * one sequence (as the chain does) and each node off it on its own window, or every
 * node on its own window (tree_conv_spine). */
typedef struct tree_plan {
    int n;
    int32_t parent[DFL_MAX_TREE];
    int32_t depth[DFL_MAX_TREE];
    uint64_t ancestors[DFL_MAX_TREE];               /* bit j: node j is on the path to the root */
    /* conv window per node, d_conv columns of [committed conv inputs | nodes], oldest first */
    int32_t windows[DFL_MAX_TREE * 16];
    tree_shape shape;                               /* padded sizes (the graph's) */
    /* node of each step: the spine's, then each group's [branches][steps] */
    int32_t steps[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    int32_t branch_from[DFL_MAX_TREE];              /* per branch, groups in order: the spine snapshot it starts from */
    /* outputs: node i's row of the first op (the spine's first part), 0 for spare rows
     * and nodes first computed by a later op; then each later op's rows, in step order:
     * the node it computes first, or a spare row of its own (n + its index in the op) */
    int32_t out_rows[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    int32_t scatter[DFL_MAX_TREE * (DFL_MAX_TREE + 1)];
    /* the conv's columns of [committed conv inputs | nodes] (see tree_conv_spine): the
     * committed ones and the spine's nodes (padded with its last), then the window of
     * each node off the spine (padded with the root's); or every node's window */
    int32_t conv_rows[DFL_MAX_TREE * 18];
    /* with the spine as a sequence, conv outputs: node i's step on the spine (0 for spare
     * rows and nodes off it); then each off-spine window's node, or a spare row of its
     * own (n + its index) */
    int32_t conv_out[2 * DFL_MAX_TREE];
    int32_t conv_scatter[DFL_MAX_TREE];
} tree_plan;

/* Steps of a tree's recurrence: the spine's and every group's. */
static inline int64_t tree_steps(const tree_shape * sh) {
    int64_t n = sh->spine;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        n += (int64_t) sh->branches[g] * sh->steps[g];
    }
    return n;
}

/* Rows of a tree's first delta-rule op: the spine's first part (all of it without
 * branches); the later ops' rows are scattered over those gathered from it. */
static inline int tree_head_rows(const tree_shape * sh) {
    return tree_branches(sh) > 0 ? sh->split : sh->spine;
}

/* Spare output rows: the most rows of a later op (each of its rows that is not a
 * node's first is written to a spare row of its own). */
static inline int64_t tree_spare_rows(const tree_shape * sh) {
    if (tree_branches(sh) == 0) {
        return 0;
    }
    int64_t d = sh->spine - sh->split;
    for (int g = 0; g < DFL_TREE_GROUPS; g++) {
        const int64_t rows = (int64_t) sh->branches[g] * sh->steps[g];
        d = rows > d ? rows : d;
    }
    return d;
}

/* Whether a tree's conv runs its spine as a sequence and each node off it on its own
 * window, or every node on its own window: whichever costs less for the padded shape,
 * counting the columns gathered and transposed and the outputs computed (an output
 * costs about 3.5 columns in instructions on the CPU backend). */
static inline bool tree_conv_spine(const tree_shape * sh, int n, int d_conv) {
    const int64_t W = d_conv - 1;
    const int64_t spine = 2 * (W + sh->spine + (W + 1) * sh->off) + 7 * (sh->spine + sh->off);
    return spine <= 2 * (W + 1) * n + 7 * n;
}

/* Entries of a tree_plan's conv_rows. */
static inline int64_t tree_conv_rows(const tree_shape * sh, int n, int d_conv) {
    return tree_conv_spine(sh, n, d_conv) ? d_conv - 1 + sh->spine + (int64_t) sh->off * d_conv : (int64_t) n * d_conv;
}

/* The padded shape trees of each node count took lately, so that trees of a budget share
 * one graph (see dfl_tree_plan). */
typedef struct dfl_tree_shapes {
    tree_shape seen[DFL_MAX_TREE + 1];
    int age[DFL_MAX_TREE + 1]; /* trees planned with it since it was last reset */
} dfl_tree_shapes;

/* Check a tree (node 0 the root, parent -1; every other node's parent before it) and plan
 * its verify into tp: depths, ancestors, conv windows of d_conv inputs and, for a model
 * with recurrent layers (d_conv > 0), the recurrence's layout, padded to a shape that
 * grows within `shapes`. d_conv 0: no recurrent layers. */
dfl_status dfl_tree_plan(tree_plan * tp, dfl_tree_shapes * shapes, const int32_t * parents, int n, int d_conv);

/* The largest padded recurrence shape a tree of n nodes can take. */
tree_shape dfl_tree_worst_shape(int n);

#endif
