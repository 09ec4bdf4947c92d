/* Top-p draws of whole rows on the CPU, the same tokens as minikv/engine/sampler.py's sorted path.

   minikv compiles this file on first use with the machine's C compiler (minikv/engine/cpu_topp.py) and
   calls it through ctypes; without a compiler the sampler keeps its torch path. Python's sampler.py is
   the specification: the token of a row is

       argmax over the nucleus of  s_j + g_j,   s_j = x_j / T (float32),  g_j = -log(-log(u(key, j)))

   where the nucleus is the shortest prefix of the vocabulary ordered by (s descending, id ascending)
   whose mass reaches top_p. A row here costs one read of its logits from memory and work on a few tokens:

     1. one read from memory, a segment of nb = V / 16 ids at a time: the maximum of every block of 16
        strided ids (ids c, c + nb, ..., c + 15 nb, as sampler.py's _strided_max), the row's maximum m
        and, from the cache, Z = sum of exp(s_j - s_max) as powers of 2;
     2. the edge: the first of LEVELS (in log2 units below the top) whose blocks' maxima alone weigh
        top_p + 2 slack;
     3. the candidates, every token above the edge, from the blocks whose maximum lies above it (or from
        the row read in order where those blocks are many); in a flat row, those above a finer cut;
     4. the draw: the best score among the candidates, with the mass ahead of it summed in float64. Below
        top_p - slack it is in the nucleus and it is the token; at top_p + slack or more it and every
        token after it are out (look again); between, or a near tie of scores, the row is not sure and
        Python draws it on the sorted path. `slack` bounds how far the sorted path's float32 sums may lie
        from exact ones (sampler.py: _mass_slack).

   Nothing here is sure of a row whose logits hold a NaN or +inf, or only -inf (Z or its maximum is then
   not finite). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16
#define CHUNK 1024 /* float32 partial sums of at most this many terms, then float64 */
#define NLEVELS 10
#define FINE_FROM 256 /* candidates past which a finer cut is looked for */
static const float LEVELS[NLEVELS] = {1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f, 16.f, 24.f, 32.f}; /* log2 units */
static const float LOG2E = 1.4426950408889634f;

/* 2^t for t <= 0, relative error under 3e-7; t below -126 gives 2^-126. The integer part goes into the
   exponent bits, the fraction into a degree-6 polynomial: no branch and no call, so loops vectorise. */
static inline float exp2_neg(float t) {
    t = t < -126.f ? -126.f : t;
    float whole = floorf(t);
    float f = t - whole; /* in [0, 1) */
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6180325e-3f;
    p = p * f + 5.5503367e-2f;
    p = p * f + 2.4022652e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)whole + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sampler.py's uniform_noise: a hash of (key, vocab id) into (0, 1), the top 23 bits as float32 */
static inline float uniform(uint64_t key, uint64_t id) {
    uint64_t x = key ^ (id * 0x9E3779B97F4A7C15ULL);
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return ((float)(x >> 41) + 0.5f) * (1.0f / (float)(1 << 23));
}

typedef struct {
    int32_t id;
    float s;      /* x / T */
    float score;  /* s + noise */
    double p;     /* exp(s - lse) */
} Candidate;

/* a ahead of b in the sorted path's order: s descending, then id ascending */
static inline int ahead(const Candidate* a, const Candidate* b) {
    return a->s > b->s || (a->s == b->s && a->id < b->id);
}

/* One row; returns 1 with *out set when sure. Scratch: bm and bt, nb + 1 floats; ids and cand, room for V. */
static int draw_row(const float* x, int64_t V, float T, uint64_t key, float top_p, double slack, float* bm,
                    float* bt, int32_t* ids, Candidate* cand, int64_t* out) {
    const int64_t nb = V / BLOCK, tail = V % BLOCK;
    /* 1 and 2 in one read of the row from memory, a segment at a time: segment i holds ids i nb .. i nb + nb - 1,
       lane i of every block (the tail, ids past 16 nb, is a segment of its own). Its maximum m_i first; then,
       from the cache, the blocks' maxima and its sum of 2^((x - m_i) log2 e / T) (float32 over CHUNK terms,
       then float64); the segments' sums are brought to the row's maximum m as they come. */
    const float k2 = LOG2E / T;
    const int64_t nblocks = nb + (tail > 0);
    float m = -INFINITY;
    double z = 0.0;
    for (int64_t i = 0; i <= BLOCK; i++) {
        const float* xi = x + i * nb;
        const int64_t len = i < BLOCK ? nb : tail;
        if (len == 0) continue;
        float mi = -INFINITY;
#pragma omp simd reduction(max : mi)
        for (int64_t c = 0; c < len; c++) mi = xi[c] > mi ? xi[c] : mi;
        const float mref = mi == -INFINITY ? 0.f : mi; /* a segment all -inf: its terms are 0, not NaN */
        double zi = 0.0;
        for (int64_t a = 0; a < len; a += CHUNK) {
            const int64_t b = a + CHUNK < len ? a + CHUNK : len;
            float zc = 0.f;
            if (i == 0) {
#pragma omp simd reduction(+ : zc)
                for (int64_t c = a; c < b; c++) bm[c] = xi[c], zc += exp2_neg((xi[c] - mref) * k2);
            } else if (i < BLOCK) {
#pragma omp simd reduction(+ : zc)
                for (int64_t c = a; c < b; c++) bm[c] = xi[c] > bm[c] ? xi[c] : bm[c], zc += exp2_neg((xi[c] - mref) * k2);
            } else {
#pragma omp simd reduction(+ : zc)
                for (int64_t c = a; c < b; c++) zc += exp2_neg((xi[c] - mref) * k2);
            }
            zi += zc;
        }
        if (i == BLOCK) bm[nb] = mi;
        /* a segment of -inf adds nothing, a NaN anywhere makes z NaN (z * 0.0 keeps it): the row is not sure */
        if (mi == -INFINITY) {
            z += zi * 0.0;
        } else if (mi > m) {  /* the sum so far, brought down to the new maximum */
            z = (m == -INFINITY ? z * 0.0 : z * exp2((double)(m - mi) * k2)) + zi;
            m = mi;
        } else {
            z += zi * exp2((double)(mi - m) * k2);
        }
    }
    const float s_max = m / T; /* division by T > 0 keeps the order: the largest x / T */
    if (!isfinite(z) || !isfinite(s_max)) return 0;
    const double lse = (double)s_max + log(z);
    /* the sorted path rounds its log-sum-exp to float32: every mass it computes may be off by an ulp of it */
    slack += fabs(lse) * 0x1p-23;
    const double need = (double)top_p + 2.0 * slack;
    if (need >= 1.0) return 0;
    /* the edge: the first level whose blocks' maxima alone weigh `need` (each block above it holds at least
       its maximum's mass), else the last. bt: each block maximum's exponent t, in log2 units below the top */
    for (int64_t c = 0; c < nblocks; c++) bt[c] = (bm[c] - m) * k2;
    int level = 0;
    for (; level < NLEVELS - 1; level++) {
        const float lo = -LEVELS[level];
        float w = 0.f;
#pragma omp simd reduction(+ : w)
        for (int64_t c = 0; c < nblocks; c++) w += bt[c] >= lo ? exp2_neg(bt[c]) : 0.f;
        if (w >= (need + 1e-5) * z) break;
    }
    /* 3. the candidates, every token with s >= s_edge (on s itself, so that every token ahead of a
       candidate in the sorted path's order is one too). x_edge is the least float whose x / T reaches
       s_edge: a block whose maximum lies below it holds none. When they do not hold top_p + slack, the
       next level. */
    int64_t k;
    double held;
    for (;; level++) {
        const float s_edge = s_max - LEVELS[level] / LOG2E;
        float x_edge = s_edge * T;
        while (x_edge / T >= s_edge) x_edge = nextafterf(x_edge, -INFINITY);
        while (x_edge / T < s_edge) x_edge = nextafterf(x_edge, INFINITY);
        /* their ids: from the blocks above the edge, or, where those are an eighth of the blocks or more
           (a flat row), from the row read in order, which costs less than as many scattered reads */
        int64_t above = 0, n = 0;
        for (int64_t c = 0; c < nblocks; c++) above += bm[c] >= x_edge;
        if (above * 8 >= nblocks) {
            for (int64_t j = 0; j < V; j++) ids[n] = (int32_t)j, n += x[j] >= x_edge;
        } else {
            for (int64_t c = 0; c < nblocks; c++) {
                if (bm[c] < x_edge) continue;
                const int64_t first = c < nb ? c : BLOCK * nb, step = c < nb ? nb : 1;
                const int64_t count = c < nb ? BLOCK : tail;
                for (int64_t i = 0; i < count; i++) {
                    const int64_t j = first + i * step;
                    ids[n] = (int32_t)j, n += x[j] >= x_edge;
                }
            }
        }
        held = 0.0;
        for (k = 0; k < n; k++) {
            const float s = x[ids[k]] / T;
            cand[k].id = ids[k];
            cand[k].s = s;
            cand[k].p = exp2_neg((s - s_max) * LOG2E) / z; /* its mass, within ~2e-6 of itself */
            held += cand[k].p;
        }
        if (held >= (double)top_p + slack) break;
        if (level == NLEVELS - 1) return 0; /* the candidates may not hold the nucleus */
    }
    /* a row with many candidates (a flat one) keeps those above a finer cut: a histogram of their mass in
       quarters of a log2 unit below s_max; the cut is the least s among the first bins that weigh `need` */
    if (k > FINE_FROM) {
        double bins[4 * 32 + 1] = {0};
        const int nbin = 4 * (int)LEVELS[level] + 1;
        for (int64_t i = 0; i < k; i++) {
            int b = (int)((s_max - cand[i].s) * (4.0f * LOG2E));
            bins[b < 0 ? 0 : (b >= nbin ? nbin - 1 : b)] += cand[i].p;
        }
        double sum = 0.0;
        int last = 0;
        while (last < nbin - 1 && (sum += bins[last]) < need + 1e-5) last++;
        float cut = INFINITY;
        for (int64_t i = 0; i < k; i++) {
            int b = (int)((s_max - cand[i].s) * (4.0f * LOG2E));
            if (b <= last && cand[i].s < cut) cut = cand[i].s;
        }
        int64_t kept = 0;
        double kept_mass = 0.0;
        for (int64_t i = 0; i < k; i++)
            if (cand[i].s >= cut) kept_mass += cand[i].p, cand[kept++] = cand[i];
        if (kept_mass < (double)top_p + slack) return 0; /* cannot happen with exact bins; be safe */
        k = kept;
    }
    for (int64_t i = 0; i < k; i++)
        cand[i].score = cand[i].s - logf(-logf(uniform(key, (uint64_t)cand[i].id)));
    /* 4. the draw */
    int64_t win;
    double before;
    for (;;) {
        win = -1;
        for (int64_t i = 0; i < k; i++)
            if (cand[i].score > -INFINITY && (win < 0 || cand[i].score > cand[win].score)) win = i;
        if (win < 0) return 0;
        before = 0.0;
        for (int64_t i = 0; i < k; i++)
            if (ahead(&cand[i], &cand[win])) before += cand[i].p;
        if (before < (double)top_p + slack) break;
        const Candidate w = cand[win]; /* out, and every token after it */
        for (int64_t i = 0; i < k; i++)
            if (!ahead(&cand[i], &w)) cand[i].score = -INFINITY;
    }
    if (before >= (double)top_p - slack) return 0; /* near the nucleus' edge */
    const float best = cand[win].score;
    float second = -INFINITY;
    for (int64_t i = 0; i < k; i++)
        if (i != win && cand[i].score > second) second = cand[i].score;
    if (!(best - second > 1e-5f * (1.0f + fabsf(best)))) return 0; /* a near tie: the logs may differ by an ulp */
    *out = cand[win].id;
    return 1;
}

typedef struct {
    const float* logits;
    int64_t stride, n, V;
    const int64_t *rows, *keys;
    const float *temperature, *top_p;
    double slack;
    int64_t* choice;
    uint8_t* sure;
    int64_t next; /* the next row to take, shared by the workers */
    int failed;
} Job;

static void* work(void* arg) {
    Job* job = arg;
    const int64_t V = job->V;
    float* bm = malloc((size_t)(V / BLOCK + 1) * sizeof(float));
    float* bt = malloc((size_t)(V / BLOCK + 1) * sizeof(float));
    int32_t* ids = malloc((size_t)V * sizeof(int32_t));
    Candidate* cand = malloc((size_t)V * sizeof(Candidate));
    if (!bm || !bt || !ids || !cand) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (int64_t r; (r = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->n;)
            if (job->temperature[r] > 0.f && V >= BLOCK)
                job->sure[r] = (uint8_t)draw_row(job->logits + job->rows[r] * job->stride, V, job->temperature[r],
                                                 (uint64_t)job->keys[r], job->top_p[r], job->slack, bm, bt, ids, cand,
                                                 &job->choice[r]);
    }
    free(bm);
    free(bt);
    free(ids);
    free(cand);
    return NULL;
}

/* rows[r] of logits (row stride `stride` floats), each with its temperature, key and top_p. choice[r] is set
   where sure[r] is 1. `threads` workers take rows in turn: OpenMP's, from the runtime torch has loaded
   (libgomp), whose threads are the ones torch's own ops just ran on; built without OpenMP, the caller's
   thread alone.
   Returns 0, or -1 when scratch memory could not be had (then nothing is sure). */
int minikv_top_p_rows(const float* logits, int64_t stride, const int64_t* rows, int64_t n, int64_t V,
                      const float* temperature, const int64_t* keys, const float* top_p, double slack,
                      int64_t* choice, uint8_t* sure, int64_t threads) {
    memset(sure, 0, (size_t)n);
    Job job = {logits, stride, n, V, rows, keys, temperature, top_p, slack, choice, sure, 0, 0};
    if (threads > n) threads = n;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    work(&job);
    if (job.failed) {
        memset(sure, 0, (size_t)n);
        return -1;
    }
    return 0;
}
