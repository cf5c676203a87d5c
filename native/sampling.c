/*
 * sampling.c - the plain sampler's transform of a logit row (top-k, top-p, min-p, temperature,
 * softmax), the full-vocabulary kernels every verifier shares (residual sums and inverse-CDF
 * sampling through residual updates), and the random numbers.
 *
 * All kernels work on chunks of LS_CHUNK entries in stack buffers; element-wise loops vectorize,
 * reductions use explicit lanes. Built with -ffp-contract=off so a scalar evaluation of one
 * entry equals the vectorized one bit for bit.
 */
#include "internal.h"

#include <math.h>
#include <string.h>

/* larger key = higher logit, then lower token id */
static inline uint64_t logit_key(float l, int32_t x)
{
    return ((uint64_t)sortable_f32(l) << 32) | (uint64_t)(0xffffffffu - (uint32_t)x);
}

/* ------------------------------------------------------------------ row scans */

/* Max and lowest argmax of a row in one pass; -1 when a logit is NaN or infinite. The max runs
 * on the order-preserving uint32 image of the floats (integer max reductions vectorize, float
 * ones would not without fast-math); each 64-logit chunk keeps its own max so the argmax is
 * found by rescanning a single chunk. */
static LS_HOT int scan_row(const float *l, int32_t V, float *mx, int32_t *argmax)
{
    uint32_t best = 0u, bad = 0u;
    int32_t best_lo = 0;
    for (int32_t lo = 0; lo < V; lo += 64) {
        const int32_t len = V - lo < 64 ? V - lo : 64;
        uint32_t cm = 0u;
        for (int32_t i = 0; i < len; i++) {
            uint32_t u;
            memcpy(&u, l + lo + i, sizeof u);
            u = u == 0x80000000u ? 0u : u; /* -0 ranks as +0 */
            const uint32_t key = u ^ (((uint32_t)0 - (u >> 31)) | 0x80000000u);
            cm = key > cm ? key : cm;
            bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        if (cm > best) {
            best = cm;
            best_lo = lo;
        }
    }
    if (bad)
        return -1;
    *mx = unsortable_f32(best);
    int32_t at = best_lo;
    while (!(l[at] == *mx))
        at++;
    *argmax = at;
    return 0;
}

/* max order-preserving key of the allowed logits among n <= 32 (0 when none), mask word w;
 * *bad |= an allowed logit is NaN or infinite */
static const uint32_t ls_bit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

LS_INLINE uint32_t masked_key_max(const float *l, uint32_t w, int32_t n, uint32_t *bad)
{
    uint32_t cm = 0u, b = 0u;
    for (int32_t i = 0; i < n; i++) {
        const uint32_t al = (uint32_t)((w & ls_bit[i]) != 0u); /* a table, not a variable shift: vectorizes */
        uint32_t u;
        memcpy(&u, l + i, sizeof u);
        u = u == 0x80000000u ? 0u : u; /* -0 ranks as +0 */
        uint32_t key = u ^ (((uint32_t)0 - (u >> 31)) | 0x80000000u);
        key &= (uint32_t)0 - al; /* an AND, not a select: the max reduction vectorizes */
        cm = key > cm ? key : cm;
        b |= al & (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    *bad |= b;
    return cm;
}

/* Masked scan_row: max and lowest argmax over the allowed tokens only (a disallowed logit is
 * never used: its key is forced to 0, below every finite float's). -1 when an allowed logit is
 * NaN or infinite, -2 when no token is allowed. */
static LS_HOT int scan_row_masked(const float *l, const uint32_t *m, int32_t V, float *mx, int32_t *argmax)
{
    uint32_t best = 0u, bad = 0u;
    int32_t best_lo = -1;
    for (int32_t lo = 0; lo < V; lo += 64) { /* 64 logits = mask words lo/32 and lo/32 + 1 */
        const int32_t len = V - lo < 64 ? V - lo : 64;
        uint32_t cm;
        if (len == 64) {
            const uint32_t a = masked_key_max(l + lo, m[lo >> 5], 32, &bad);
            const uint32_t b = masked_key_max(l + lo + 32, m[(lo >> 5) + 1], 32, &bad);
            cm = a > b ? a : b;
        } else {
            cm = masked_key_max(l + lo, m[lo >> 5], len < 32 ? len : 32, &bad);
            if (len > 32) {
                const uint32_t b = masked_key_max(l + lo + 32, m[(lo >> 5) + 1], len - 32, &bad);
                cm = b > cm ? b : cm;
            }
        }
        if (cm > best) {
            best = cm;
            best_lo = lo;
        }
    }
    if (bad)
        return -1;
    if (best_lo < 0)
        return -2;
    *mx = unsortable_f32(best);
    int32_t at = best_lo;
    while (!(ls_allowed(m, at) && l[at] == *mx))
        at++;
    *argmax = at;
    return 0;
}

int ls_mask_any(const uint32_t *mask, int32_t V)
{
    const int32_t full = V / 32, rem = V % 32;
    uint32_t any = 0u;
    for (int32_t w = 0; w < full; w++)
        any |= mask[w];
    if (rem)
        any |= mask[full] & ((1u << rem) - 1u);
    return any != 0u;
}

/* sum over the kept set of exp((l - max) * inv_temp) */
static LS_HOT double row_partition(const ls_row *row, int32_t V)
{
    float e[LS_CHUNK];
    double z = 0.0;
    for (int32_t lo = 0; lo < V; lo += LS_CHUNK) {
        const int32_t len = V - lo < LS_CHUNK ? V - lo : LS_CHUNK;
        exp_block(row, lo, len, e);
        z += ls_sum_f32(e, len);
    }
    return z;
}

double ls_row_value(const ls_row *row, int32_t x)
{
    float e;
    exp_block(row, x, 1, &e);
    return (double)e * row->inv_z;
}

/* ------------------------------------------------------------------ top-k / top-p */

static void heap_sift_down(uint64_t *h, int32_t n, int32_t i)
{
    for (;;) {
        int32_t s = i;
        const int32_t a = 2 * i + 1, b = 2 * i + 2;
        if (a < n && h[a] < h[s])
            s = a;
        if (b < n && h[b] < h[s])
            s = b;
        if (s == i)
            return;
        const uint64_t t = h[i];
        h[i] = h[s];
        h[s] = t;
        i = s;
    }
}

/* heapsort descending (a min-heap popped to the back), in place, no allocation */
static void sort_desc(uint64_t *h, int32_t n)
{
    for (int32_t i = n / 2 - 1; i >= 0; i--)
        heap_sift_down(h, n, i);
    for (int32_t end = n - 1; end > 0; end--) {
        const uint64_t t = h[0];
        h[0] = h[end];
        h[end] = t;
        heap_sift_down(h, end, 0);
    }
}

static inline uint32_t nonfinite(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
}

/* Offer logit `value` of token `id` to the min-heap of the k largest keys (keys[0] the smallest);
 * returns the heap's new floor (the logit below which nothing can enter). */
static inline float heap_offer(uint64_t *keys, int32_t k, float value, int32_t id, float floor_logit)
{
    const uint64_t key = logit_key(value, id);
    if (key <= keys[0])
        return floor_logit;
    keys[0] = key;
    heap_sift_down(keys, k, 0);
    return unsortable_f32((uint32_t)(keys[0] >> 32));
}

/* The k largest keys of the row into keys[0..k), the k-th largest into *kth, fused with the
 * max/argmax scan and the NaN/Inf check (-1). A 64-logit chunk is only visited when one of its
 * logits beats the current k-th (equal logits come later, i.e. with higher ids, and lose). */
static LS_HOT int top_k_scan(ls_row *row, int32_t V, int32_t k, uint64_t *keys, uint64_t *kth)
{
    const float *l = row->logits;
    uint32_t bad = 0u;
    for (int32_t i = 0; i < k; i++) {
        keys[i] = logit_key(l[i], i);
        bad |= nonfinite(l[i]);
    }
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(keys, k, i);
    float floor_logit = unsortable_f32((uint32_t)(keys[0] >> 32));
    for (int32_t lo = k; lo < V; lo += 64) {
        const int32_t hi = V - lo < 64 ? V : lo + 64;
        if (hi - lo == 64) {
            uint32_t b = 0u;
            const float *chunk = l + lo;
            for (int32_t i = 0; i < 64; i++)
                b |= nonfinite(chunk[i]);
            bad |= b;
            if (!ls_chunk_any(l + lo, floor_logit, 0))
                continue;
        } else {
            for (int32_t i = lo; i < hi; i++)
                bad |= nonfinite(l[i]);
        }
        for (int32_t i = lo; i < hi; i++) {
            if (!(l[i] > floor_logit))
                continue;
            floor_logit = heap_offer(keys, k, l[i], i, floor_logit);
        }
    }
    if (bad)
        return -1;
    uint64_t top = keys[0];
    for (int32_t i = 1; i < k; i++)
        top = keys[i] > top ? keys[i] : top;
    row->max = unsortable_f32((uint32_t)(top >> 32));
    row->argmax = (int32_t)(0xffffffffu - (uint32_t)top);
    if (row->ready < 1)
        row->ready = 1;
    *kth = keys[0];
    return 0;
}

/* Masked top-k: the (at most) k largest keys of the allowed tokens into keys[0..return), as a
 * min-heap when k of them were found (keys[0] is then the k-th largest); fewer than k allowed
 * tokens: all of them, and top-k keeps them all. The row must be scanned (ready >= 1). */
static LS_HOT int32_t top_k_masked(const ls_row *row, int32_t V, int32_t k, uint64_t *keys)
{
    const float *l = row->logits;
    const uint32_t *m = row->mask;
    int32_t n = 0, x = 0;
    for (; x < V && n < k; x++)
        if (ls_allowed(m, x))
            keys[n++] = logit_key(l[x], x);
    if (n < k)
        return n;
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(keys, k, i);
    float floor_logit = unsortable_f32((uint32_t)(keys[0] >> 32));
    for (int32_t lo = x; lo < V; lo += 64) {
        const int32_t hi = V - lo < 64 ? V : lo + 64;
        if (hi - lo == 64 && !ls_chunk_any(l + lo, floor_logit, 0)) /* raw logits: conservative */
            continue;
        for (int32_t i = lo; i < hi; i++) {
            if (!(l[i] > floor_logit) || !ls_allowed(m, i))
                continue;
            floor_logit = heap_offer(keys, k, l[i], i, floor_logit);
        }
    }
    return k;
}

/* ids of the allowed logits >= floor, ascending, into out[0..return), at most cap of them
 * (cap + 1 is returned when there are more) */
static LS_HOT int32_t collect_at_least(const float *l, const uint32_t *m, int32_t V, float floor, int32_t *out,
                                       int32_t cap)
{
    int32_t n = 0;
    for (int32_t lo = 0; lo < V; lo += 64) {
        const int32_t hi = V - lo < 64 ? V : lo + 64;
        if (hi - lo == 64 && !ls_chunk_any(l + lo, floor, 1))
            continue;
        for (int32_t i = lo; i < hi; i++)
            if (l[i] >= floor && ls_allowed(m, i)) {
                if (n == cap)
                    return cap + 1;
                out[n++] = i;
            }
    }
    return n;
}

static inline void set_boundary(ls_row *row, uint64_t key)
{
    row->thr = unsortable_f32((uint32_t)(key >> 32));
    row->thr_id = (int32_t)(0xffffffffu - (uint32_t)key);
}

/* keys[0..m) sorted descending: the length of the shortest prefix with temperature-1 mass >= top_p */
static int32_t top_p_cut(const float *l, float mx, const uint64_t *keys, int32_t m, double z1,
                         float top_p)
{
    double cum = 0.0;
    for (int32_t i = 0; i < m; i++) {
        const int32_t x = (int32_t)(0xffffffffu - (uint32_t)keys[i]);
        cum += (double)ls_expf(l[x] - mx) / z1;
        if (cum >= (double)top_p)
            return i + 1;
    }
    return m;
}

/* top-p over the k_kept top-k survivors in keys (or the whole row when k_kept == 0); leaves the
 * kept keys sorted descending in keys[0..return) */
static LS_HOT int32_t apply_top_p(ls_row *row, int32_t V, int32_t k_kept, float top_p, uint64_t *keys)
{
    const float *l = row->logits;
    const float mx = row->max;
    if (k_kept > 0) {
        sort_desc(keys, k_kept);
        double z1 = 0.0;
        for (int32_t i = 0; i < k_kept; i++)
            z1 += (double)ls_expf(l[(int32_t)(0xffffffffu - (uint32_t)keys[i])] - mx);
        const int32_t m = top_p_cut(l, mx, keys, k_kept, z1, top_p);
        set_boundary(row, keys[m - 1]);
        return m;
    }
    ls_row t1 = *row; /* the whole row at temperature 1 */
    t1.thr = -INFINITY;
    t1.thr_id = V;
    t1.lo = -INFINITY;
    t1.inv_temp = 1.0f;
    t1.inv_z = 1.0;
    const double z1 = row_partition(&t1, V);
    /* candidates: logits within `gap` of the max, widened until they hold top_p of the mass */
    for (float gap = 8.0f;; gap *= 2.0f) {
        const int all = gap > 128.0f;
        const float floor = all ? -INFINITY : mx - gap;
        int32_t m = 0;
        double mass = 0.0;
        for (int32_t lo = 0; lo < V; lo += 64) {
            const int32_t hi = V - lo < 64 ? V : lo + 64;
            if (hi - lo == 64 && !ls_chunk_any(l + lo, floor, 1))
                continue;
            for (int32_t x = lo; x < hi; x++)
                if (l[x] >= floor && ls_allowed(row->mask, x)) {
                    keys[m++] = logit_key(l[x], x);
                    mass += (double)ls_expf(l[x] - mx);
                }
        }
        if (all || mass / z1 >= (double)top_p) {
            sort_desc(keys, m);
            const int32_t cut = top_p_cut(l, mx, keys, m, z1, top_p);
            set_boundary(row, keys[cut - 1]);
            return cut;
        }
    }
}

/* the kept set as ascending ids in kept[0..return), or -1 when it is larger than LS_SPARSE_MAX.
 * m >= 0: the candidates are keys[0..m); otherwise every token passing the min-p floor. */
static int32_t list_kept(const ls_row *row, int32_t V, int32_t m, uint64_t *keys, int32_t *kept)
{
    const float *l = row->logits;
    int32_t n = 0;
    if (m >= 0) {
        for (int32_t i = 0; i < m; i++) {
            const int32_t x = (int32_t)(0xffffffffu - (uint32_t)keys[i]);
            if (l[x] >= row->lo) {
                if (n == LS_SPARSE_MAX)
                    return -1;
                kept[n++] = x;
            }
        }
    } else {
        n = collect_at_least(l, row->mask, V, row->lo, kept, LS_SPARSE_MAX);
        return n > LS_SPARSE_MAX ? -1 : n; /* already ascending */
    }
    for (int32_t i = 0; i < n; i++)
        keys[i] = (uint64_t)kept[i];
    sort_desc(keys, n);
    for (int32_t i = 0; i < n; i++)
        kept[i] = (int32_t)keys[n - 1 - i];
    return n;
}

/* stage 1: max and argmax (all greedy needs), over the allowed tokens; ready = 1 */
static int row_scan(ls_row *row, const float *logits, const uint32_t *mask, int32_t V)
{
    row->logits = logits;
    row->mask = mask;
    row->ready = 0;
    row->kept = NULL;
    row->n_kept = -1;
    const int st = mask ? scan_row_masked(logits, mask, V, &row->max, &row->argmax)
                        : scan_row(logits, V, &row->max, &row->argmax);
    if (st != 0)
        return st == -2 ? LS_ERR_MASK : LS_ERR_LOGITS;
    row->ready = 1;
    return LS_OK;
}

/* stage 2: the kept set and the partition function; ready = 2. A small kept set is also listed
 * (in kept, LS_SPARSE_MAX entries) so later passes can skip the rest of the vocabulary. */
static int topk_active(const ls_sampling *s, int32_t V)
{
    return s->temperature > 0.0f && s->top_k > 0 && s->top_k < V;
}

static int row_transform(ls_row *row, int32_t V, const ls_sampling *s, uint64_t *keys, int32_t *kept)
{
    row->lo = -INFINITY;
    row->kept = NULL;
    row->n_kept = -1;
    if (s->temperature <= 0.0f) {
        row->thr = row->max;
        row->thr_id = row->argmax;
        row->inv_temp = 0.0f;
        row->inv_z = 1.0;
        if (kept) {
            kept[0] = row->argmax;
            row->kept = kept;
            row->n_kept = 1;
        }
        row->ready = 2;
        return LS_OK;
    }
    row->thr = -INFINITY;
    row->thr_id = V;
    int32_t m = -1; /* keys[0..m) hold the kept candidates; -1: not listed */
    if (topk_active(s, V) && row->mask) { /* mask first, then top-k among the allowed tokens */
        m = top_k_masked(row, V, s->top_k, keys);
        if (m == s->top_k)
            set_boundary(row, keys[0]);
    } else if (topk_active(s, V)) {
        uint64_t kth;
        if (top_k_scan(row, V, s->top_k, keys, &kth) != 0)
            return LS_ERR_LOGITS;
        set_boundary(row, kth);
        m = s->top_k;
    }
    if (s->top_p < 1.0f)
        m = apply_top_p(row, V, m > 0 ? m : 0, s->top_p, keys);
    if (s->min_p > 0.0f)
        row->lo = row->max + logf(s->min_p);
    row->inv_temp = 1.0f / s->temperature;
    row->inv_z = 1.0;
    if (kept && (m >= 0 || s->min_p > 0.0f)) {
        row->n_kept = list_kept(row, V, m, keys, kept);
        row->kept = row->n_kept >= 0 ? kept : NULL;
    }
    double z = 0.0;
    if (row->n_kept >= 0) {
        for (int32_t i = 0; i < row->n_kept; i++) {
            float e;
            exp_block(row, row->kept[i], 1, &e);
            z += (double)e;
        }
    } else {
        z = row_partition(row, V);
    }
    row->inv_z = 1.0 / z; /* z >= 1: the argmax is always kept */
    row->ready = 2;
    return LS_OK;
}

int ls_row_init(ls_row *row, const float *logits, const uint32_t *mask, int32_t V, const ls_sampling *s,
                uint64_t *keys, int32_t *kept)
{
    row->logits = logits;
    row->mask = mask;
    row->ready = 0;
    if (mask || !topk_active(s, V)) { /* unmasked top-k scans by itself */
        const int st = row_scan(row, logits, mask, V);
        if (st != LS_OK)
            return st;
    }
    return row_transform(row, V, s, keys, kept);
}

static int row_stage(ls_ctx *c, int32_t r, int32_t stage)
{
    ls_row *row = &c->rows[r];
    if (row->ready >= stage)
        return LS_OK;
    const ls_problem *p = c->p;
    const float *logits = p->target_logits + (int64_t)r * p->target_stride;
    const uint32_t *mask = p->masks ? p->masks + (int64_t)r * p->mask_stride : NULL;
    int st = LS_OK;
    if (row->ready < 1) {
        row->logits = logits;
        row->mask = mask;
        if (mask || !(stage >= 2 && topk_active(&p->sampling, c->V))) /* unmasked top-k scans by itself */
            st = row_scan(row, logits, mask, c->V);
    }
    if (st == LS_OK && stage >= 2)
        st = row_transform(row, c->V, &p->sampling, c->keys, c->kept ? c->kept + (int64_t)r * LS_SPARSE_MAX : NULL);
    if (st != LS_OK)
        c->error_index = r;
    return st;
}

int ls_row_prepare(ls_ctx *c, int32_t r)
{
    return row_stage(c, r, 2);
}

int32_t ls_row_argmax(ls_ctx *c, int32_t r, int *status)
{
    *status = row_stage(c, r, 1);
    return c->rows[r].argmax;
}

const float *ls_draft_row(const ls_ctx *c, int32_t r)
{
    return c->p->draft_probs ? c->p->draft_probs + (int64_t)r * c->p->draft_stride : NULL;
}

/* ------------------------------------------------------------------ views through residual updates */

ls_view ls_view_plain(const ls_ctx *c, int32_t r)
{
    ls_view v;
    v.row = &c->rows[r];
    v.draft32 = ls_draft_row(c, r);
    v.draft64 = NULL;
    v.upd = NULL;
    v.n_upd = 0;
    v.remove = 0;
    return v;
}

static inline int draft_ok(double d)
{
    return d >= 0.0 && d <= 1.0001; /* false for NaN */
}

int ls_view_value(const ls_view *v, int32_t x, double *t, double *s)
{
    double T = ls_row_value(v->row, x);
    const double d = v->draft64 ? v->draft64[x] : v->draft32 ? (double)v->draft32[x] : 0.0;
    if (!draft_ok(d))
        return LS_ERR_DRAFT;
    double S = d;
    int removed = 0;
    for (int32_t k = 0; k < v->n_upd; k++) {
        const ls_update *u = &v->upd[k];
        if (!u->passthrough) {
            const double w = u->a * T - S;
            T = (w > 0.0 ? w : 0.0) * u->inv_w;
        }
        removed |= v->remove && u->token == x;
        S = removed ? 0.0 : d * u->inv_d;
    }
    *t = T;
    *s = S;
    return LS_OK;
}

/* target T_k (mode 0) or residual max(a T_k - S_k, 0) (mode 1) of entries [lo, lo+len), none removed */
LS_INLINE int weights_block(const ls_view *v, double a, int residual, int32_t lo, int32_t len,
                                double *w, double *dsum)
{
    double T[LS_CHUNK], D[LS_CHUNK];
    target_block(v->row, lo, len, T);
    if (!residual && v->n_upd == 0) { /* the target alone: the draft is not read */
        for (int32_t q = 0; q < len; q++)
            w[q] = T[q];
        return 1;
    }
    if (v->draft64) {
        const double *d = v->draft64 + lo;
        for (int32_t i = 0; i < len; i++)
            D[i] = d[i];
    } else {
        const float *d = v->draft32 + lo;
        for (int32_t i = 0; i < len; i++)
            D[i] = (double)d[i];
    }
    int32_t good = 0;
    for (int32_t i = 0; i < len; i++)
        good += (D[i] >= 0.0) & (D[i] <= 1.0001); /* false for NaN */
    *dsum += ls_sum_f64(D, len);
    const int ok = good == len;
    for (int32_t k = 0; k < v->n_upd; k++) {
        const ls_update *u = &v->upd[k];
        if (!u->passthrough) {
            const double ua = u->a, iw = u->inv_w, id_prev = k ? v->upd[k - 1].inv_d : 1.0;
            for (int32_t q = 0; q < len; q++) {
                const double r = ua * T[q] - D[q] * id_prev;
                T[q] = (r > 0.0 ? r : 0.0) * iw;
            }
        }
    }
    if (residual) {
        const double id = v->n_upd ? v->upd[v->n_upd - 1].inv_d : 1.0;
        for (int32_t q = 0; q < len; q++) {
            const double r = a * T[q] - D[q] * id;
            w[q] = r > 0.0 ? r : 0.0;
        }
    } else {
        for (int32_t q = 0; q < len; q++)
            w[q] = T[q];
    }
    return ok;
}

/* one entry's weight, honouring removals */
static int weight_one(const ls_view *v, double a, int residual, int32_t x, double *w)
{
    double t, s;
    const int st = ls_view_value(v, x, &t, &s);
    if (st != LS_OK)
        return st;
    if (residual) {
        const double r = a * t - s;
        *w = r > 0.0 ? r : 0.0;
    } else {
        *w = t;
    }
    return LS_OK;
}

/* removed tokens of the view, ascending, into c->tmp; returns their count */
static int32_t removed_sorted(ls_ctx *c, const ls_view *v)
{
    if (!v->remove)
        return 0;
    int32_t m = 0;
    for (int32_t k = 0; k < v->n_upd; k++) {
        const int32_t x = v->upd[k].token;
        int32_t i = m++;
        while (i > 0 && c->tmp[i - 1] > x) {
            c->tmp[i] = c->tmp[i - 1];
            i--;
        }
        c->tmp[i] = x;
    }
    return m;
}

static LS_HOT int sum_range(const ls_view *v, double a, int residual, int32_t lo, int32_t hi,
                            double *sum, double *dsum)
{
    double w[LS_CHUNK];
    int ok = 1;
    for (int32_t b = lo; b < hi; b += LS_CHUNK) {
        const int32_t len = hi - b < LS_CHUNK ? hi - b : LS_CHUNK;
        ok &= weights_block(v, a, residual, b, len, w, dsum);
        *sum += ls_sum_f64(w, len);
    }
    return ok;
}

/* the sum over a listed kept set (the target, hence every weight, is 0 elsewhere) */
static int sparse_sum(const ls_view *v, double a, double *out)
{
    double sum = 0.0;
    for (int32_t i = 0; i < v->row->n_kept; i++) {
        double w;
        const int st = weight_one(v, a, 1, v->row->kept[i], &w);
        if (st != LS_OK)
            return st;
        sum += w;
    }
    *out = sum;
    return LS_OK;
}

/* sum_x max(a * T_k(x) - S_k(x), 0): the residual mass of Eq. 3/4 and Alg. 3 Eq. 1 */
int ls_view_sum(ls_ctx *c, const ls_view *v, double a, double *out)
{
    if (v->row->n_kept >= 0)
        return sparse_sum(v, a, out);
    const int32_t m = removed_sorted(c, v);
    double sum = 0.0, dsum = 0.0;
    int32_t lo = 0;
    int ok = 1;
    for (int32_t i = 0; i <= m; i++) {
        const int32_t hi = i < m ? c->tmp[i] : c->V;
        ok &= sum_range(v, a, 1, lo, hi, &sum, &dsum);
        if (i < m) {
            double w;
            const int st = weight_one(v, a, 1, hi, &w);
            if (st != LS_OK)
                return st;
            sum += w;
            lo = hi + 1;
        }
    }
    /* a full pass over a caller draft row doubles as its validation */
    if (!ok || (m == 0 && !v->draft64 && v->n_upd == 0 && fabs(dsum - 1.0) > 1e-3))
        return LS_ERR_DRAFT;
    *out = sum;
    return LS_OK;
}

static LS_HOT int sample_range(const ls_view *v, double a, int residual, int32_t lo, int32_t hi,
                               double target, double *run, int32_t *last_pos, int32_t *found)
{
    double w[LS_CHUNK];
    double dsum = 0.0;
    for (int32_t b = lo; b < hi; b += LS_CHUNK) {
        const int32_t len = hi - b < LS_CHUNK ? hi - b : LS_CHUNK;
        if (!weights_block(v, a, residual, b, len, w, &dsum))
            return LS_ERR_DRAFT;
        const double bs = ls_sum_f64(w, len);
        if (bs <= 0.0)
            continue;
        for (int32_t q = len - 1; q >= 0; q--)
            if (w[q] > 0.0) {
                *last_pos = b + q;
                break;
            }
        if (*run + bs > target) {
            for (int32_t q = 0; q < len; q++) {
                *run += w[q];
                if (*run > target && w[q] > 0.0) {
                    *found = b + q;
                    return LS_OK;
                }
            }
        } else {
            *run += bs;
        }
    }
    return LS_OK;
}

/* Inverse-CDF draw in token order: the first x whose running weight exceeds u * total (the last
 * positive entry if rounding leaves none). residual = 1: weights max(a T_k - S_k, 0); 0: T_k. */
static int sparse_sample(const ls_view *v, double a, int residual, double target, int32_t *token)
{
    double run = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < v->row->n_kept; i++) {
        const int32_t x = v->row->kept[i];
        double w;
        const int st = weight_one(v, a, residual, x, &w);
        if (st != LS_OK)
            return st;
        if (w > 0.0) {
            last = x;
            run += w;
            if (run > target) {
                *token = x;
                return LS_OK;
            }
        }
    }
    *token = last >= 0 ? last : v->row->argmax;
    return LS_OK;
}

int ls_view_sample(ls_ctx *c, const ls_view *v, double a, int residual, double total, double u,
                   int32_t *token)
{
    if (v->row->n_kept >= 0)
        return sparse_sample(v, a, residual, u * total, token);
    const int32_t m = removed_sorted(c, v);
    const double target = u * total;
    double run = 0.0;
    int32_t last = -1, found = -1, lo = 0;
    for (int32_t i = 0; i <= m && found < 0; i++) {
        const int32_t hi = i < m ? c->tmp[i] : c->V;
        const int st = sample_range(v, a, residual, lo, hi, target, &run, &last, &found);
        if (st != LS_OK)
            return st;
        if (i < m && found < 0) {
            double w;
            const int st2 = weight_one(v, a, residual, hi, &w);
            if (st2 != LS_OK)
                return st2;
            if (w > 0.0) {
                last = hi;
                run += w;
                if (run > target)
                    found = hi;
            }
            lo = hi + 1;
        }
    }
    if (found < 0)
        found = last >= 0 ? last : v->row->argmax;
    *token = found;
    return LS_OK;
}

/* The correction token: residual weights with mass w, or the view's target when the residual is
 * empty (w <= 0 only through rounding or a draft equal to the target). */
int ls_sample_final(ls_ctx *c, const ls_view *v, double a, double w, double u, int32_t *token)
{
    if (w > 0.0)
        return ls_view_sample(c, v, a, 1, w, u, token);
    return ls_view_sample(c, v, a, 0, 1.0, u, token);
}

/* ------------------------------------------------------------------ random numbers */

static inline uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* xoshiro256** seeded through splitmix64; doubles in [0, 1) with 53 random bits */
void ls_fill_uniforms(uint64_t seed, double *u, int32_t count)
{
    uint64_t sm = seed, s[4];
    for (int i = 0; i < 4; i++)
        s[i] = splitmix64(&sm);
    for (int32_t i = 0; i < count; i++) {
        const uint64_t result = rotl(s[1] * 5, 7) * 9;
        const uint64_t t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = rotl(s[3], 45);
        u[i] = (double)(result >> 11) * 0x1.0p-53;
    }
}

/* ------------------------------------------------------------------ public helpers */

static int sampling_ok(const ls_sampling *s)
{
    return s && isfinite(s->temperature) && s->temperature >= 0.0f && s->top_k >= 0 &&
           s->top_p > 0.0f && s->top_p <= 1.0f && s->min_p >= 0.0f && s->min_p <= 1.0f;
}

size_t ls_probs_workspace_bytes(int32_t n_vocab, const ls_sampling *sampling)
{
    (void)sampling;
    if (n_vocab <= 0)
        return 0;
    return (size_t)n_vocab * sizeof(uint64_t) + LS_SPARSE_MAX * sizeof(int32_t);
}

static LS_HOT void write_probs(const ls_row *row, int32_t V, double *o64, float *o32)
{
    double t[LS_CHUNK];
    for (int32_t lo = 0; lo < V; lo += LS_CHUNK) {
        const int32_t len = V - lo < LS_CHUNK ? V - lo : LS_CHUNK;
        target_block(row, lo, len, t);
        if (o64)
            for (int32_t i = 0; i < len; i++)
                (o64 + lo)[i] = t[i];
        if (o32)
            for (int32_t i = 0; i < len; i++)
                (o32 + lo)[i] = (float)t[i];
    }
}

int ls_probs_masked(const float *logits, int64_t stride, int32_t n_rows, int32_t n_vocab,
                    const uint32_t *masks, int64_t mask_stride, const ls_sampling *sampling,
                    void *workspace, size_t workspace_bytes, double *out64, float *out32,
                    int64_t out_stride, int32_t *error_row)
{
    if (error_row)
        *error_row = -1;
    if (!logits || n_rows < 0 || n_vocab <= 0 || stride < n_vocab || out_stride < n_vocab)
        return LS_ERR_ARGUMENT;
    if (masks && mask_stride < ((int64_t)n_vocab + 31) / 32)
        return LS_ERR_ARGUMENT;
    if (!sampling_ok(sampling))
        return LS_ERR_SAMPLING;
    if (!workspace || workspace_bytes < ls_probs_workspace_bytes(n_vocab, sampling))
        return LS_ERR_WORKSPACE;
    for (int32_t r = 0; r < n_rows; r++) {
        ls_row row;
        uint64_t *keys = workspace;
        int32_t *kept = (int32_t *)(void *)(keys + n_vocab);
        const uint32_t *mask = masks ? masks + (int64_t)r * mask_stride : NULL;
        const int st = ls_row_init(&row, logits + (int64_t)r * stride, mask, n_vocab, sampling, keys, kept);
        if (st != LS_OK) {
            if (error_row)
                *error_row = r;
            return st;
        }
        write_probs(&row, n_vocab, out64 ? out64 + (int64_t)r * out_stride : NULL,
                    out32 ? out32 + (int64_t)r * out_stride : NULL);
    }
    return LS_OK;
}

int ls_probs(const float *logits, int64_t stride, int32_t n_rows, int32_t n_vocab,
             const ls_sampling *sampling, void *workspace, size_t workspace_bytes, double *out64,
             float *out32, int64_t out_stride, int32_t *error_row)
{
    return ls_probs_masked(logits, stride, n_rows, n_vocab, NULL, 0, sampling, workspace, workspace_bytes,
                           out64, out32, out_stride, error_row);
}

int ls_sample_probs(const float *probs, int32_t n_vocab, const int32_t *exclude, int32_t n_exclude,
                    double uniform, int32_t *token)
{
    if (!probs || !token || n_vocab <= 0 || n_exclude < 0 || (n_exclude > 0 && !exclude))
        return LS_ERR_ARGUMENT;
    if (!(uniform >= 0.0 && uniform < 1.0))
        return LS_ERR_UNIFORM;
    double total = 0.0;
    for (int32_t x = 0; x < n_vocab; x++) {
        if (!draft_ok((double)probs[x]))
            return LS_ERR_DRAFT;
        total += (double)probs[x];
    }
    for (int32_t i = 0; i < n_exclude; i++) {
        if (exclude[i] < 0 || exclude[i] >= n_vocab)
            return LS_ERR_TOKEN;
        int dup = 0;
        for (int32_t j = 0; j < i; j++)
            dup |= exclude[j] == exclude[i];
        if (!dup)
            total -= (double)probs[exclude[i]];
    }
    if (!(total > 0.0))
        return LS_ERR_DRAFT;
    const double target = uniform * total;
    double run = 0.0;
    int32_t last = -1;
    for (int32_t x = 0; x < n_vocab; x++) {
        if (probs[x] <= 0.0f)
            continue;
        int skip = 0;
        for (int32_t i = 0; i < n_exclude; i++)
            skip |= exclude[i] == x;
        if (skip)
            continue;
        last = x;
        run += (double)probs[x];
        if (run > target) {
            *token = x;
            return LS_OK;
        }
    }
    if (last < 0)
        return LS_ERR_DRAFT;
    *token = last;
    return LS_OK;
}
