/* threadpool.c — the persistent native thread pool of the kernels.
 *
 * n threads in all = the calling thread + (n-1) workers, created lazily on the first parallel
 * job and kept until the size changes.  After a job a worker spins for SPIN_NS watching for the
 * next one before it parks on a condition variable: the forward pass calls the kernels back to
 * back, and waking a parked thread costs ~0.2 ms on a busy VM, as much as a whole small matvec
 * (measured: without the spin, 2 threads on a 0.3 ms matvec gave 1.2x one thread).  A job is a count of
 * tasks claimed with an atomic counter; the caller runs tasks too, then waits for the workers.
 * Jobs are serialised by call_lock, so concurrent callers (the Python wrapper releases the GIL)
 * simply queue.  A thread that set itself alone (ds4f_pool_set_alone) runs its jobs' tasks
 * itself, without the lock or the workers: a helper thread computing beside another keeps to one
 * core.  Nothing is allocated per job.  After fork() the child starts with no workers.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "kernels_internal.h"

#define MAX_THREADS 256
#define SPIN_NS 100000L /* 0.1 ms */

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one job (or resize) at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static pthread_t workers[MAX_THREADS];
static int n_running;          /* workers alive */
static atomic_int n_threads;   /* configured size incl. caller; 0 = not chosen yet */
static atomic_ulong generation; /* bumped (under mu) for every job; read without mu while spinning */
static int stopping, pending;
static ds4f_task_fn job_fn;
static void *job_ctx;
static size_t job_ntasks;
static atomic_size_t job_next;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static _Thread_local int alone; /* this thread's jobs run on it alone */

static atomic_ullong tasks_done, worker_tasks_done; /* counts only: nothing waits on them */

static void run_one(ds4f_task_fn fn, void *ctx, size_t i) {
    fn(ctx, i);
    atomic_fetch_add_explicit(&tasks_done, 1, memory_order_relaxed);
}

/* The job's tasks this thread claims; returns how many it ran. */
static size_t run_tasks(ds4f_task_fn fn, void *ctx, size_t ntasks) {
    size_t i, ran = 0;
    while ((i = atomic_fetch_add_explicit(&job_next, 1, memory_order_relaxed)) < ntasks) {
        run_one(fn, ctx, i);
        ran++;
    }
    return ran;
}

static long elapsed_ns(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - t0->tv_sec) * 1000000000L + (t.tv_nsec - t0->tv_nsec);
}

/* Watch for a new job for up to SPIN_NS without the lock (the job itself is read under mu). */
static void spin_for_job(unsigned long seen) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(&generation, memory_order_relaxed) != seen) return;
        if (i % 64 == 0 && elapsed_ns(&t0) > SPIN_NS) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
    }
}

static void *worker_main(void *arg) {
    /* the generation current when the worker was created (no job was running then): a job
     * posted before this thread gets to run is still seen as new */
    unsigned long seen = (unsigned long)(uintptr_t)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        if (generation == seen && !stopping) {
            pthread_mutex_unlock(&mu);
            spin_for_job(seen);
            pthread_mutex_lock(&mu);
        }
        while (generation == seen && !stopping) pthread_cond_wait(&cv_work, &mu);
        if (stopping) break;
        seen = generation;
        ds4f_task_fn fn = job_fn;
        void *ctx = job_ctx;
        size_t nt = job_ntasks;
        pthread_mutex_unlock(&mu);
        atomic_fetch_add_explicit(&worker_tasks_done, run_tasks(fn, ctx, nt), memory_order_relaxed);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&cv_done);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static void stop_workers(void) { /* call_lock held */
    pthread_mutex_lock(&mu);
    stopping = 1;
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n_running; i++) pthread_join(workers[i], NULL);
    n_running = 0;
    stopping = 0;
}

static void start_workers(int n) { /* call_lock held; n = workers wanted */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    while (n_running < n) {
        if (pthread_create(&workers[n_running], &attr, worker_main, (void *)(uintptr_t)atomic_load(&generation)) != 0)
            break; /* run with fewer */
        n_running++;
    }
    pthread_attr_destroy(&attr);
}

static void atfork_prepare(void) { pthread_mutex_lock(&call_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&call_lock); }
static void atfork_child(void) { /* the workers do not exist in the child */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    mu = m;
    cv_work = c;
    cv_done = c;
    n_running = 0;
    stopping = 0;
    pending = 0;
    pthread_mutex_unlock(&call_lock);
}
static void init_once(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static int default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 && CPU_COUNT(&set) < n)
        n = CPU_COUNT(&set);
#endif
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

unsigned long long ds4f_pool_tasks_done(void) { return atomic_load_explicit(&tasks_done, memory_order_relaxed); }
unsigned long long ds4f_pool_worker_tasks_done(void) {
    return atomic_load_explicit(&worker_tasks_done, memory_order_relaxed);
}

void ds4f_pool_set_alone(int on) { alone = on != 0; }
int ds4f_pool_get_alone(void) { return alone; }

int ds4f_pool_get_threads(void) {
    int n = atomic_load(&n_threads);
    if (n == 0) {
        int expected = 0;
        atomic_compare_exchange_strong(&n_threads, &expected, default_threads());
        n = atomic_load(&n_threads);
    }
    return n;
}

int ds4f_pool_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -1;
    pthread_once(&once, init_once);
    pthread_mutex_lock(&call_lock);
    if (n_running > n - 1) stop_workers(); /* shrink: restart lazily at the new size */
    atomic_store(&n_threads, n);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

void ds4f_pool_run(ds4f_task_fn fn, void *ctx, size_t ntasks) {
    if (ntasks == 0) return;
    const int nt = ds4f_pool_get_threads();
    if (nt == 1 || ntasks == 1 || alone) { /* no pool state touched: no lock */
        for (size_t i = 0; i < ntasks; i++) run_one(fn, ctx, i);
        return;
    }
    pthread_once(&once, init_once);
    pthread_mutex_lock(&call_lock);
    const int want = atomic_load(&n_threads) - 1; /* re-read: a resize may have run meanwhile */
    if (n_running > want) stop_workers();
    if (n_running < want) start_workers(want);
    pthread_mutex_lock(&mu);
    job_fn = fn;
    job_ctx = ctx;
    job_ntasks = ntasks;
    atomic_store(&job_next, 0);
    pending = n_running;
    generation++;
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
    run_tasks(fn, ctx, ntasks);
    pthread_mutex_lock(&mu);
    while (pending > 0) pthread_cond_wait(&cv_done, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&call_lock);
}
