/* internal.h - shared state and row operations of the verifier (not part of the public API). */
#ifndef LOCALSPEC_INTERNAL_H
#define LOCALSPEC_INTERNAL_H

#include "verifier.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Hot full-vocabulary loops get x86-64-v3 (AVX2+FMA) and -v4 (AVX-512) clones next to the
 * portable one; the best one the CPU supports is picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LS_NO_CLONES)
#define LS_HOT __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define LS_HOT
#endif

/* helpers of the hot loops: always inlined, so each clone gets its own vector code */
#if defined(__GNUC__)
#define LS_INLINE static inline __attribute__((always_inline))
#else
#define LS_INLINE static inline
#endif

#define LS_CHUNK 512 /* elements per chunk of the row kernels (stack buffers) */
#define LS_SPARSE_MAX 1024 /* largest kept set handled token by token instead of densely */

/* The plain sampler's distribution of one target row, kept implicit:
 *   keep(x) = allowed(x) && (l > thr || (l == thr && x <= thr_id)) && l >= lo
 *   t(x)    = keep(x) ? exp((l - max) * inv_temp) * inv_z : 0
 * allowed(x) is the row's mask bit (always 1 without a mask); max, argmax and the filter
 * boundaries are taken over the allowed tokens only, whose logits alone are ever used.
 * Temperature 0 keeps only the argmax with inv_temp = 0, inv_z = 1. */
typedef struct ls_row {
    const float *logits;
    const uint32_t *mask; /* NULL: every token allowed */
    float max;
    float inv_temp;
    float thr;
    float lo;
    int32_t thr_id;
    int32_t argmax;
    double inv_z;
    const int32_t *kept; /* the kept set as ascending ids when small (n_kept >= 0) */
    int32_t n_kept;      /* -1: not listed (dense passes) */
    int32_t ready;       /* 0: nothing, 1: max/argmax, 2: kept set and partition function */
} ls_row;

/* One residual update applied to a row (RRS/RRSw/traversal):
 *   T_k(x) = max(a * T_{k-1}(x) - S_{k-1}(x), 0) * inv_w     (unchanged if passthrough)
 *   S_k(x) = removed-so-far(x) ? 0 : d(x) * inv_d             (inv_d = 1 with replacement) */
typedef struct ls_update {
    double a;
    double inv_w;
    double inv_d;
    int32_t token;       /* the rejected token (removed from the draft when without replacement) */
    int32_t passthrough; /* empty residual (W == 0): keep the previous target */
} ls_update;

/* A row seen through its residual updates; draft from float32 (caller rows) or float64 (GBV). */
typedef struct ls_view {
    const ls_row *row;
    const float *draft32;
    const double *draft64;
    const ls_update *upd;
    int32_t n_upd;
    int32_t remove; /* removed tokens get draft 0 (sampling without replacement) */
} ls_view;

typedef struct ls_ctx {
    const ls_problem *p;
    int32_t n;
    int32_t V;
    ls_row *rows;          /* n+1 */
    double *u;             /* n+1 uniforms */
    int32_t *child_start;  /* n+2, CSR offsets into children */
    int32_t *children;     /* n, row ids in sibling order */
    int32_t *parent_row;   /* n+1 (root: -1) */
    int32_t *n_removed;    /* n+1: children rejected so far, always a prefix of the sibling list */
    int32_t *stamp;        /* n+1: scratch marks */
    int32_t *tmp;          /* n: scratch tokens */
    double *pr;            /* n+1: per-row acceptance weights p */
    double *aux;           /* 2*(n+1): per-row extra scalars (GBV r and rho) */
    ls_update *upd;        /* n: records, CSR-aligned with children */
    uint64_t *keys;        /* V (top-k / top-p scratch) or NULL */
    int32_t *kept;         /* (n+1) * LS_SPARSE_MAX kept-set lists, or NULL */
    uint32_t *sort_keys;   /* 2V (GBV) */
    int32_t *sort_ids;     /* 2V (GBV) */
    double *qrow;          /* V (GBV skewed draft row) */
    int32_t error_index;
} ls_ctx;


/* ---- inline row arithmetic shared by every kernel (bit-identical scalar and vector) ---- */

/* exp(x) for x <= 0 in float32 (Cephes expf polynomial, ~1 ulp); exactly 0 below -87.
 * fmaf is exactly rounded, so the scalar and every vector clone give identical bits. */
LS_INLINE float ls_expf(float x)
{
    const float xc = x < -87.0f ? -87.0f : x;
    float fx = xc * 1.44269504088896341f;
    fx = (fx + 12582912.0f) - 12582912.0f; /* round to nearest integer, |fx| < 2^22 */
    const float r = fmaf(fx, 2.12194440e-4f, fmaf(fx, -0.693359375f, xc));
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y * r, r, r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)fx + 127) << 23; /* 2^n, n in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

/* order-preserving map of a float to uint32 (-0 normalised to +0) */
static inline uint32_t sortable_f32(float f)
{
    f += 0.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static inline float unsortable_f32(uint32_t k)
{
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float ls_ratio_key(double t, double d)
{
    return d > 0.0 ? (float)(t / d) : INFINITY;
}

/* Reductions in a fixed order with vector-extension lanes: they vectorize in every clone
 * without letting the compiler reassociate anything else. */
typedef double ls_v8d __attribute__((vector_size(64)));
typedef float ls_v8f __attribute__((vector_size(32)));

LS_INLINE double ls_hsum(const ls_v8d *a)
{
    return (((*a)[0] + (*a)[4]) + ((*a)[1] + (*a)[5])) + (((*a)[2] + (*a)[6]) + ((*a)[3] + (*a)[7]));
}

LS_INLINE double ls_sum_f64(const double *x, int32_t n)
{
    ls_v8d a = {0}, b = {0};
    int32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        ls_v8d u, v;
        memcpy(&u, x + i, sizeof u);
        memcpy(&v, x + i + 8, sizeof v);
        a += u;
        b += v;
    }
    for (; i + 8 <= n; i += 8) {
        ls_v8d u;
        memcpy(&u, x + i, sizeof u);
        a += u;
    }
    const ls_v8d ab = a + b;
    double s = ls_hsum(&ab);
    for (; i < n; i++)
        s += x[i];
    return s;
}

LS_INLINE double ls_sum_f32(const float *x, int32_t n)
{
    ls_v8d a = {0}, b = {0};
    int32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        ls_v8f u, v;
        memcpy(&u, x + i, sizeof u);
        memcpy(&v, x + i + 8, sizeof v);
        a += __builtin_convertvector(u, ls_v8d);
        b += __builtin_convertvector(v, ls_v8d);
    }
    for (; i + 8 <= n; i += 8) {
        ls_v8f u;
        memcpy(&u, x + i, sizeof u);
        a += __builtin_convertvector(u, ls_v8d);
    }
    const ls_v8d ab = a + b;
    double s = ls_hsum(&ab);
    for (; i < n; i++)
        s += (double)x[i];
    return s;
}

/* does any of the 64 logits at l exceed floor (or reach it, when inclusive)? */
LS_INLINE int ls_chunk_any(const float *l, float floor, int inclusive)
{
    int any = 0;
    if (inclusive)
        for (int i = 0; i < 64; i++)
            any |= l[i] >= floor;
    else
        for (int i = 0; i < 64; i++)
            any |= l[i] > floor;
    return any;
}

/* is token x allowed by mask m (NULL: always)? bit x % 32 of word x / 32 */
static inline int ls_allowed(const uint32_t *m, int32_t x)
{
    return !m || ((m[x >> 5] >> (x & 31)) & 1u);
}

LS_INLINE void exp_block(const ls_row *row, int32_t lo, int32_t len, float *e)
{
    const float *l = row->logits + lo;
    const float mx = row->max, it = row->inv_temp, thr = row->thr, low = row->lo;
    const int32_t tid = row->thr_id;
    if (row->mask) { /* masked row: a disallowed logit is replaced by max before any arithmetic */
        const uint32_t *m = row->mask;
        int32_t i = 0;
        if ((lo & 31) == 0) /* whole mask words: one word per 32 lanes (vectorizes) */
            for (; i + 32 <= len; i += 32) {
                const uint32_t w = m[(lo + i) >> 5];
                for (int32_t b = 0; b < 32; b++) {
                    const int32_t x = lo + i + b;
                    const int al = (int)((w >> b) & 1u);
                    const float v = al ? l[i + b] : mx;
                    const int keep = ((v > thr) | ((v == thr) & (x <= tid))) & (v >= low) & al;
                    const float ex = ls_expf((v - mx) * it);
                    e[i + b] = keep ? ex : 0.0f;
                }
            }
        for (; i < len; i++) {
            const int32_t x = lo + i;
            const int al = (int)((m[x >> 5] >> (x & 31)) & 1u);
            const float v = al ? l[i] : mx;
            const int keep = ((v > thr) | ((v == thr) & (x <= tid))) & (v >= low) & al;
            const float ex = ls_expf((v - mx) * it);
            e[i] = keep ? ex : 0.0f;
        }
        return;
    }
    for (int32_t i = 0; i < len; i++) {
        const float v = l[i];
        const int32_t x = lo + i;
        const int keep = ((v > thr) | ((v == thr) & (x <= tid))) & (v >= low);
        const float ex = ls_expf((v - mx) * it);
        e[i] = keep ? ex : 0.0f;
    }
}

LS_INLINE void target_block(const ls_row *row, int32_t lo, int32_t len, double *t)
{
    float e[LS_CHUNK];
    exp_block(row, lo, len, e);
    const double iz = row->inv_z;
    for (int32_t i = 0; i < len; i++)
        t[i] = (double)e[i] * iz;
}


/* ---- sampling.c: rows, kernels, random numbers ---- */
int ls_row_init(ls_row *row, const float *logits, const uint32_t *mask, int32_t V, const ls_sampling *s,
                uint64_t *keys, int32_t *kept);
int ls_mask_any(const uint32_t *mask, int32_t V);
int ls_row_prepare(ls_ctx *c, int32_t r);
int32_t ls_row_argmax(ls_ctx *c, int32_t r, int *status);
double ls_row_value(const ls_row *row, int32_t x);
const float *ls_draft_row(const ls_ctx *c, int32_t r);

ls_view ls_view_plain(const ls_ctx *c, int32_t r);
int ls_view_value(const ls_view *v, int32_t x, double *t, double *s);
int ls_view_sum(ls_ctx *c, const ls_view *v, double a, double *out);
int ls_view_sample(ls_ctx *c, const ls_view *v, double a, int residual, double total, double u,
                   int32_t *token);
int ls_sample_final(ls_ctx *c, const ls_view *v, double a, double w, double u, int32_t *token);

void ls_fill_uniforms(uint64_t seed, double *u, int32_t count);


/* inside an algorithm with `ls_ctx *c`: return a failed status, recording the row it concerns */
#define TRY_ROW(expr, r)                                                                           \
    do {                                                                                           \
        const int st_ = (expr);                                                                    \
        if (st_ != LS_OK) {                                                                        \
            if (c->error_index < 0)                                                                \
                c->error_index = (r);                                                              \
            return st_;                                                                            \
        }                                                                                          \
    } while (0)

/* ---- chain.c / multipath.c / tree.c ---- */
int ls_greedy(ls_ctx *c, ls_verdict *out);
int ls_match(ls_ctx *c, ls_verdict *out);
int ls_token(ls_ctx *c, ls_verdict *out);
int ls_block(ls_ctx *c, ls_verdict *out);
int ls_gbv(ls_ctx *c, ls_verdict *out);
int ls_batch(ls_ctx *c, ls_verdict *out);
int ls_rrs(ls_ctx *c, ls_verdict *out, int without_replacement);
int ls_traversal(ls_ctx *c, ls_verdict *out);

/* block verification's tau and correction on a path whose p_i are known (chain.c; block and GBV):
 * R_i = rows[i - 1] (rows NULL: R_i = i); view gives row R_i's target and draft at depth i */
typedef int (*ls_path_view)(ls_ctx *c, int32_t i, int32_t R, void *arg, ls_view *v);
int ls_block_path(ls_ctx *c, const int32_t *rows, const double *p, int32_t L, ls_path_view view, void *arg,
                  ls_verdict *out);

/* ---- verify.c: tree helpers ---- */
int32_t ls_child_count(const ls_ctx *c, int32_t r);
int32_t ls_child(const ls_ctx *c, int32_t r, int32_t k);
int32_t ls_token_of(const ls_ctx *c, int32_t r);
int ls_require_chain_below_root(ls_ctx *c);
void ls_emit_path(const ls_ctx *c, int32_t r, ls_verdict *out);

#endif
