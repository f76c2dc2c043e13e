/* Threads by load (dfl_threads.h). */
#include "dfl_threads.h"

#include "dfl_error.h"
#include "dflash.h"

#include <stdlib.h>
#include <string.h>

#define LEVELS 6   /* the count asked for, halved down to 1: 32 threads give 6 levels */
#define GRAPHS 16  /* graphs timed at once, the least recently computed forgotten first */
#define SLOWER 1.5 /* a graph this much slower than its best at a count: contention */
#define FASTER 0.9 /* a probe this fast against the current count's average: move there */
#define PROBE_SHARE 0.02 /* the time probes may take, against the time computed */

typedef struct {
    uint64_t build;        /* the graph's build (0: a free record) */
    int64_t used;          /* when it was last computed (the governor's clock) */
    double avg[LEVELS];    /* moving average of its seconds at each level (0: not timed) */
    double best[LEVELS];
    int64_t n[LEVELS];     /* its computes at each level */
} timing;

struct dfl_threads {
    int n_levels;
    int threads[LEVELS];
    int level;       /* the level in use */
    int probe;       /* the level the next compute tries (-1: none) */
    int next_dir;    /* the way the next periodic probe goes: +1 fewer threads, -1 more */
    bool judged;     /* a probe has been judged: the start is over */
    int64_t clock;
    double budget;   /* seconds of probing earned (PROBE_SHARE of the time computed) */
    timing graphs[GRAPHS];
};

static void init(dfl_threads * g, int n_threads) {
    for (int n = n_threads; g->n_levels < LEVELS; n /= 2) {
        g->threads[g->n_levels++] = n;
        if (n <= 1) {
            break;
        }
    }
    g->probe = -1;
    g->next_dir = 1;
}

dfl_threads * dfl_threads_new(int n_threads) {
    const char * fixed = getenv("DFLASH_FIXED_THREADS");
    if (n_threads <= 1 || (fixed && strcmp(fixed, "0") != 0)) {
        return NULL;
    }
    dfl_threads * g = calloc(1, sizeof *g);
    if (g) { /* else (out of memory) the count stays as asked */
        init(g, n_threads);
    }
    return g;
}

void dfl_threads_free(dfl_threads * g) {
    free(g);
}

static timing * timing_of(dfl_threads * g, uint64_t build) {
    timing * oldest = &g->graphs[0];
    for (int i = 0; i < GRAPHS; i++) {
        if (g->graphs[i].build == build) {
            return &g->graphs[i];
        }
        if (g->graphs[i].used < oldest->used) {
            oldest = &g->graphs[i];
        }
    }
    memset(oldest, 0, sizeof *oldest);
    oldest->build = build;
    return oldest;
}

int dfl_threads_pick(const dfl_threads * g) {
    return g->threads[g->probe >= 0 ? g->probe : g->level];
}

static int level_of(const dfl_threads * g, int n_threads) {
    for (int i = 0; i < g->n_levels; i++) {
        if (g->threads[i] == n_threads) {
            return i;
        }
    }
    return g->level;
}

/* What a compute at `level` is expected to cost: its average there, or (not timed yet)
 * the current level's scaled by the thread ratio, the pessimistic guess for fewer. */
static double expected(const dfl_threads * g, const timing * t, int level) {
    if (t->avg[level] > 0) {
        return t->avg[level];
    }
    const double here = t->avg[g->level];
    return here * ((double) g->threads[g->level] / g->threads[level]);
}

void dfl_threads_record(dfl_threads * g, uint64_t build, int n_threads, double seconds) {
    timing * t = timing_of(g, build);
    const int level = level_of(g, n_threads);
    t->used = ++g->clock;
    if (t->n[level]++ == 0 && level == g->level && g->probe < 0) {
        return; /* a graph's first compute warms it up (its buffers, the caches): not timed */
    }
    t->avg[level] = t->avg[level] > 0 ? 0.75 * t->avg[level] + 0.25 * seconds : seconds;
    if (t->best[level] == 0 || seconds < t->best[level]) {
        t->best[level] = seconds;
    }
    if (g->probe == level) { /* the probe's verdict: one compute against the average where we are */
        g->probe = -1;
        g->judged = true;
        if (t->avg[g->level] > 0 && seconds < FASTER * t->avg[g->level]) {
            g->level = level;
        }
        return;
    }
    g->budget += PROBE_SHARE * seconds;
    if (level != g->level) {
        return;
    }
    /* at the start, a graph not timed yet at fewer threads is, once, after its first
     * computes here: a machine busy from the start runs it uniformly slow, which no best
     * of its own shows. Later graphs are not: a verify's shape, and so its graph, changes
     * from step to step, and a probe of each would cost a slow compute each */
    if (!g->judged && level + 1 < g->n_levels && t->n[level + 1] == 0 && t->n[level] >= 2) {
        g->probe = level + 1;
        return;
    }
    /* contention: this graph runs well below its best here; try fewer threads now, in
     * debt to the probing budget if need be (so that it cannot happen again before the
     * budget is paid back) */
    if (t->avg[level] > SLOWER * t->best[level] && level + 1 < g->n_levels && g->budget >= 0) {
        g->budget -= expected(g, t, level + 1);
        g->probe = level + 1;
        return;
    }
    /* otherwise a neighbour now and then, alternately fewer and more threads, as the
     * probing budget affords it */
    int next = level + g->next_dir;
    if (next < 0 || next >= g->n_levels) {
        g->next_dir = -g->next_dir;
        next = level + g->next_dir;
    }
    if (next < 0 || next >= g->n_levels || t->avg[level] == 0) {
        return;
    }
    const double cost = expected(g, t, next);
    if (g->budget >= cost) {
        g->budget -= cost;
        g->probe = next;
        g->next_dir = -g->next_dir;
    }
}

DFL_API dfl_status dfl_threads_replay(int32_t n_threads, int32_t n_levels, const double * seconds,
                                      const uint64_t * builds, int64_t n, int32_t * threads_out) {
    if (n_threads < 2 || n_levels < 1 || n < 0 || (n > 0 && (!seconds || !threads_out))) {
        return dfl_fail(DFL_ERR_ARGUMENT, "threads replay: need 2 or more threads, levels, and a time and an output "
                                          "for each compute");
    }
    dfl_threads * g = calloc(1, sizeof *g);
    if (!g) {
        return dfl_fail(DFL_ERR_BACKEND, "out of host memory");
    }
    init(g, n_threads);
    if (g->n_levels != n_levels) {
        const int levels = g->n_levels;
        free(g);
        return dfl_fail(DFL_ERR_ARGUMENT, "threads replay: %d threads make %d levels, not %d", n_threads, levels,
                        n_levels);
    }
    for (int64_t i = 0; i < n; i++) {
        const int threads = dfl_threads_pick(g);
        const uint64_t build = builds ? builds[i] : 1; /* no builds: one graph */
        if (build == 0) {
            free(g);
            return dfl_fail(DFL_ERR_ARGUMENT, "threads replay: builds are numbered from 1");
        }
        threads_out[i] = threads;
        dfl_threads_record(g, build, threads, seconds[i * n_levels + level_of(g, threads)]);
    }
    free(g);
    return DFL_OK;
}
