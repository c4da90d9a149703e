/* Running team kernels (see cpu_common.h): one at a time, or a recorded list in one team. */
#include <omp.h>

#include "cpu_common.h"

void kvrail_run(kvrail_team_fn fn, const void *args, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    fn(args, omp_get_thread_num(), omp_get_num_threads());
}

struct kvrail_node {
    kvrail_team_fn fn;
    const void *args;
    int64_t serial; /* too little work to share: thread 0 alone runs it */
};

/* Each node's kernel finishes on every thread before the next starts, as with kvrail_run. */
void kvrail_replay(const struct kvrail_node *nodes, int64_t num_nodes, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t i = 0; i < num_nodes; i++) {
            if (!nodes[i].serial)
                nodes[i].fn(nodes[i].args, tid, team);
            else if (tid == 0)
                nodes[i].fn(nodes[i].args, 0, 1);
#pragma omp barrier
        }
    }
}
