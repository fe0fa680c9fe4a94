/* How the threads of a parallel loop share its independent items (weight panels, (request, head)
 * pairs): dynamically, in chunks of about 1 / (RD_CHUNKS_PER_THREAD * threads) of the loop. A thread
 * that another process preempts, or that shares its core with one, then delays only the chunk it
 * holds while the others take the rest; with a static split every thread waited at the loop's end
 * for the slowest one's whole share, at every linear of every layer. Each item is still computed by
 * one thread with the same code, so results do not depend on the split (bit for bit).
 *
 * Call rd_chunk() outside the parallel region (it reads the team size of the next region). */
#ifndef RD_WORK_SPLIT_H
#define RD_WORK_SPLIT_H

#include <omp.h>

#ifndef RD_CHUNKS_PER_THREAD
#define RD_CHUNKS_PER_THREAD 8
#endif

static inline long rd_chunk(long items) {
    long c = items / (RD_CHUNKS_PER_THREAD * (long)omp_get_max_threads());
    return c > 0 ? c : 1;
}

#endif
