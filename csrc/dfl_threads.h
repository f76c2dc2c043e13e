/* Threads by load: a CPU runtime's thread count, chosen again as it computes.
 *
 * ggml's CPU workers meet at a barrier after every op. When another process holds a
 * core, a worker waiting there spins while the worker it waits for has no core to run
 * on, and each op can cost a scheduler time slice: on a 2-core machine with one core
 * kept busy, the published 1.5B decoded at 9-10 tokens/s with 2 threads (ours and
 * llama.cpp's alike) and 18-19 with one. So the runtime times each graph it computes,
 * per graph (a kept graph is computed again and again, so its times compare), at each of
 * the thread counts it may use (the count asked for, halved down to 1), and moves to a
 * neighbouring count when one measures faster: at once when a graph turns 1.5x slower
 * than its best at the current count (something else took the cores), otherwise on a
 * probe, one compute at a neighbouring count, spaced so that probes cost a few percent
 * of the time computed at most. A graph is one build: a slot's memory holds a new graph
 * at the same address whenever the step's shape changes (its rows, its cache length), so
 * the runtime numbers its builds, and only a build's own computes compare (timed as one,
 * a one-row decode and a 64-row verify, or a verify before and after 2K more cells of
 * context, looked like contention and moved an idle machine to one thread). Results do
 * not depend on the thread count (each row's arithmetic is one thread's, whichever
 * thread takes it), so exactness is untouched.
 *
 * DFLASH_FIXED_THREADS=1 keeps the count asked for. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

typedef struct dfl_threads dfl_threads;

/* A governor for `n_threads` (NULL when there is nothing to choose: one thread, or
 * DFLASH_FIXED_THREADS set). */
dfl_threads * dfl_threads_new(int n_threads);
void dfl_threads_free(dfl_threads * g);

/* The thread count to compute the next graph with. */
int dfl_threads_pick(const dfl_threads * g);

/* The graph built `build`-th (1, 2, ...: dfl_runtime numbers them) computed with
 * `n_threads` in `seconds`. */
void dfl_threads_record(dfl_threads * g, uint64_t build, int n_threads, double seconds);
