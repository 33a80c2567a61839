// Where a multi-threaded run's time goes between and inside OpenMP parallel regions, for libgomp
// (g++'s OpenMP). Preloaded into a benchmark, it wraps GOMP_parallel, times every region and each
// thread's share of its work, and at exit reports a window of the steady state: the time outside
// any region (serial code), the time inside regions split into the slowest thread's work and the
// starting and ending of the region, how long one thread waited for the other, and the regions
// that took the most time by their outlined function (an offset into the executable), each with
// the share of the window one of its threads spent waiting for the other (its imbalance) and each
// thread's work in it (a thread slower on the same share shows in every region), and the
// serial time before each region by the place GOMP_parallel was called from (the code that ran on
// one thread lies between the region before and that call).
//
//   gcc -O2 -shared -fPIC tools/gomp_regions.c -o /tmp/gomp_regions.so -ldl
//   LD_PRELOAD=/tmp/gomp_regions.so build/benchmarks/bench_models --benchmark_filter=BM_train_A/ --benchmark_min_time=6 2>regions.txt
//   grep '^gomp_regions' regions.txt; grep '^region' regions.txt | sort -k2 -rn | head -20 |
//       while read -r _ pct n off wait file w0 w1; do echo "$pct $n $wait $w0 $w1 $(addr2line -f -C -e "$file" "$off" | head -1)"; done
//   grep '^serial' regions.txt | sort -k2 -rn | head -20 |
//       while read -r _ pct n off file; do echo "$pct $n $(addr2line -f -i -C -e "$file" "$off" | sed -n 1p)"; done
//
// The window is the 4 s that end 0.6 s before the last region (Google Benchmark's final run of a
// row with --benchmark_min_time of 5 s or more, past the peak measurement that follows the row);
// MNEMO_REGIONS_WINDOW=s sets its length. Counts the first two threads of each region only; nested
// regions and regions run by other OpenMP constructs (parallel for without GOMP_parallel) are not
// seen. At most 1M regions are recorded.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*parallel_fn)(void (*)(void*), void*, unsigned, unsigned);
typedef int (*thread_num_fn)(void);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

struct region {
    double begin, end, work[2];
    void* fn;
    void* site;  // where GOMP_parallel was called from
};
enum { max_regions = 1 << 20 };
static struct region* regions;
static long n_regions;
static thread_num_fn thread_num;

struct call {
    void (*fn)(void*);
    void* data;
    double work[2];
};

static void timed_body(void* p) {
    struct call* c = p;
    const double t0 = now();
    c->fn(c->data);
    const int t = thread_num();
    if (t < 2) c->work[t] = now() - t0;
}

void GOMP_parallel(void (*fn)(void*), void* data, unsigned threads, unsigned flags) {
    static parallel_fn real;
    if (!real) {
        real = (parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
        thread_num = (thread_num_fn)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
        regions = malloc(sizeof(struct region) * max_regions);
    }
    struct call c = {fn, data, {0, 0}};
    const double t0 = now();
    real(timed_body, &c, threads, flags);
    const double t1 = now();
    if (regions && n_regions < max_regions)
        regions[n_regions++] = (struct region){t0, t1, {c.work[0], c.work[1]}, (void*)fn, __builtin_return_address(0)};
}

__attribute__((destructor)) static void report(void) {
    if (n_regions == 0) return;
    const char* w = getenv("MNEMO_REGIONS_WINDOW");
    const double length = w ? atof(w) : 4.0;
    const double end = regions[n_regions - 1].end - 0.6, start = end - length;
    double first = 0, last = 0, inside = 0, waited = 0, slowest = 0, work0 = 0, work1 = 0;
    long counted = 0;
    enum { max_fns = 512 };
    void* fns[max_fns];
    double fn_time[max_fns], fn_wait[max_fns], fn_work0[max_fns], fn_work1[max_fns];
    long fn_count[max_fns];
    int n_fns = 0;
    void* sites[max_fns];  // serial time before each region, by the region's call site
    double site_gap[max_fns];
    long site_count[max_fns];
    int n_sites = 0;
    for (long i = 0; i < n_regions; ++i) {
        const struct region* r = &regions[i];
        if (r->begin < start || r->end > end) continue;
        if (counted++ == 0) first = r->begin;
        else {
            int g = 0;
            while (g < n_sites && sites[g] != r->site) ++g;
            if (g == n_sites && n_sites < max_fns) sites[n_sites] = r->site, site_gap[n_sites] = 0, site_count[n_sites] = 0, ++n_sites;
            if (g < n_sites) site_gap[g] += r->begin - last, ++site_count[g];
        }
        last = r->end;
        const double hi = r->work[0] > r->work[1] ? r->work[0] : r->work[1];
        const double lo = r->work[0] > r->work[1] ? r->work[1] : r->work[0];
        inside += r->end - r->begin;
        slowest += hi;
        waited += hi - lo;
        work0 += r->work[0];
        work1 += r->work[1];
        int f = 0;
        while (f < n_fns && fns[f] != r->fn) ++f;
        if (f == n_fns) {
            if (n_fns == max_fns) continue;
            fns[n_fns] = r->fn, fn_time[n_fns] = 0, fn_wait[n_fns] = 0, fn_work0[n_fns] = 0, fn_work1[n_fns] = 0;
            fn_count[n_fns++] = 0;
        }
        fn_time[f] += r->end - r->begin;
        fn_wait[f] += hi - lo;
        fn_work0[f] += r->work[0];
        fn_work1[f] += r->work[1];
        ++fn_count[f];
    }
    const double span = last - first;
    if (counted == 0 || span <= 0) {
        fprintf(stderr, "gomp_regions: no region in the window\n");
        return;
    }
    fprintf(stderr,
            "gomp_regions: %.2f s, %ld regions (one every %.1f us): serial %.1f%%, in regions %.1f%% "
            "(slowest thread's work %.1f%%, start and end %.1f%%); one thread waiting for the other %.1f%%; "
            "work of thread 0 %.1f%%, thread 1 %.1f%%\n",
            span, counted, 1e6 * span / (double)counted, 100 * (span - inside) / span, 100 * inside / span,
            100 * slowest / span, 100 * (inside - slowest) / span, 100 * waited / span, 100 * work0 / span,
            100 * work1 / span);
    for (int f = 0; f < n_fns; ++f) {
        Dl_info info;
        if (!dladdr(fns[f], &info)) continue;
        fprintf(stderr, "region %.2f%% %ld 0x%lx %.2f%% %s %.2f%% %.2f%%\n", 100 * fn_time[f] / span, fn_count[f],
                (unsigned long)((char*)fns[f] - (char*)info.dli_fbase), 100 * fn_wait[f] / span, info.dli_fname,
                100 * fn_work0[f] / span, 100 * fn_work1[f] / span);
    }
    for (int g = 0; g < n_sites; ++g) {
        Dl_info info;
        if (!dladdr(sites[g], &info)) continue;
        fprintf(stderr, "serial %.2f%% %ld 0x%lx %s\n", 100 * site_gap[g] / span, site_count[g],
                (unsigned long)((char*)sites[g] - (char*)info.dli_fbase), info.dli_fname);
    }
}
