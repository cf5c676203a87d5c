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

/* max of a row; returns -1 when a logit is NaN or infinite. Integer lanes (the order-preserving
 * map of sortable_f32) vectorize where a float max reduction would not. */
static LS_HOT int scan_max(const float *l, int32_t V, float *mx)
{
    uint32_t best = 0u, bad = 0u;
    for (int32_t i = 0; i < V; i++) {
        uint32_t u;
        memcpy(&u, l + i, sizeof u);
        const uint32_t key = u ^ (((uint32_t)0 - (u >> 31)) | 0x80000000u);
        best = key > best ? key : best;
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    *mx = unsortable_f32(best);
    return bad ? -1 : 0;
}

/* lowest index holding v: whole chunks are tested with a vectorizable OR first */
static LS_HOT int32_t first_index_of(const float *l, int32_t V, float v)
{
    int32_t lo = 0;
    for (; lo + 64 <= V; lo += 64) {
        int hit = 0;
        for (int32_t i = 0; i < 64; i++)
            hit |= l[lo + i] == v;
        if (hit)
            break;
    }
    for (int32_t i = lo; i < V; i++)
        if (l[i] == v)
            return i;
    return 0;
}

static int scan_row(const float *l, int32_t V, float *mx, int32_t *argmax)
{
    if (scan_max(l, V, mx) != 0)
        return -1;
    *argmax = first_index_of(l, V, *mx);
    return 0;
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

/* the k largest keys of the row into keys[0..k); returns the k-th largest */
static uint64_t top_k_keys(const float *l, int32_t V, int32_t k, uint64_t *keys)
{
    for (int32_t i = 0; i < k; i++)
        keys[i] = logit_key(l[i], i);
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(keys, k, i);
    float floor_logit = unsortable_f32((uint32_t)(keys[0] >> 32));
    for (int32_t i = k; i < V; i++) {
        if (l[i] < floor_logit)
            continue;
        const uint64_t key = logit_key(l[i], i);
        if (key > keys[0]) {
            keys[0] = key;
            heap_sift_down(keys, k, 0);
            floor_logit = unsortable_f32((uint32_t)(keys[0] >> 32));
        }
    }
    return keys[0];
}

static inline void set_boundary(ls_row *row, uint64_t key)
{
    row->thr = unsortable_f32((uint32_t)(key >> 32));
    row->thr_id = (int32_t)(0xffffffffu - (uint32_t)key);
}

/* keys[0..m) sorted descending: the shortest prefix with temperature-1 mass >= top_p */
static uint64_t top_p_cut(const float *l, float mx, const uint64_t *keys, int32_t m, double z1,
                          float top_p)
{
    double cum = 0.0;
    for (int32_t i = 0; i < m; i++) {
        const int32_t x = (int32_t)(0xffffffffu - (uint32_t)keys[i]);
        cum += (double)ls_expf(l[x] - mx) / z1;
        if (cum >= (double)top_p)
            return keys[i];
    }
    return keys[m - 1];
}

static void apply_top_p(ls_row *row, int32_t V, int32_t k_kept, float top_p, uint64_t *keys)
{
    const float *l = row->logits;
    const float mx = row->max;
    if (k_kept > 0) { /* after top-k: the k survivors are in keys */
        sort_desc(keys, k_kept);
        double z1 = 0.0;
        for (int32_t i = 0; i < k_kept; i++)
            z1 += (double)ls_expf(l[(int32_t)(0xffffffffu - (uint32_t)keys[i])] - mx);
        set_boundary(row, top_p_cut(l, mx, keys, k_kept, z1, top_p));
        return;
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
        int32_t m = 0;
        double mass = 0.0;
        const int all = gap > 128.0f;
        for (int32_t x = 0; x < V; x++)
            if (all || l[x] >= mx - gap) {
                keys[m++] = logit_key(l[x], x);
                mass += (double)ls_expf(l[x] - mx);
            }
        if (all || mass / z1 >= (double)top_p) {
            sort_desc(keys, m);
            set_boundary(row, top_p_cut(l, mx, keys, m, z1, top_p));
            return;
        }
    }
}

/* stage 1: max and argmax (all greedy needs); ready = 1 */
static int row_scan(ls_row *row, const float *logits, int32_t V)
{
    row->logits = logits;
    row->ready = 0;
    if (scan_row(logits, V, &row->max, &row->argmax) != 0)
        return LS_ERR_LOGITS;
    row->ready = 1;
    return LS_OK;
}

/* stage 2: the kept set and the partition function; ready = 2 */
static void row_transform(ls_row *row, int32_t V, const ls_sampling *s, uint64_t *keys)
{
    const float *logits = row->logits;
    row->lo = -INFINITY;
    if (s->temperature <= 0.0f) {
        row->thr = row->max;
        row->thr_id = row->argmax;
        row->inv_temp = 0.0f;
        row->inv_z = 1.0;
        row->ready = 2;
        return;
    }
    row->thr = -INFINITY;
    row->thr_id = V;
    int32_t k_kept = 0;
    if (s->top_k > 0 && s->top_k < V) {
        set_boundary(row, top_k_keys(logits, V, s->top_k, keys));
        k_kept = s->top_k;
    }
    if (s->top_p < 1.0f)
        apply_top_p(row, V, k_kept, s->top_p, keys);
    if (s->min_p > 0.0f)
        row->lo = row->max + logf(s->min_p);
    row->inv_temp = 1.0f / s->temperature;
    row->inv_z = 1.0;
    row->inv_z = 1.0 / row_partition(row, V); /* >= 1 term: the argmax is always kept */
    row->ready = 2;
}

int ls_row_init(ls_row *row, const float *logits, int32_t V, const ls_sampling *s, uint64_t *keys)
{
    const int st = row_scan(row, logits, V);
    if (st == LS_OK)
        row_transform(row, V, s, keys);
    return st;
}

static int row_stage(ls_ctx *c, int32_t r, int32_t stage)
{
    ls_row *row = &c->rows[r];
    if (row->ready >= stage)
        return LS_OK;
    const ls_problem *p = c->p;
    if (row->ready < 1 && row_scan(row, p->target_logits + (int64_t)r * p->target_stride, c->V) != LS_OK) {
        c->error_index = r;
        return LS_ERR_LOGITS;
    }
    if (stage >= 2)
        row_transform(row, c->V, &p->sampling, c->keys);
    return LS_OK;
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
        for (int32_t i = 0; i < len; i++)
            D[i] = v->draft64[lo + i];
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

/* sum_x max(a * T_k(x) - S_k(x), 0): the residual mass of Eq. 3/4 and Alg. 3 Eq. 1 */
int ls_view_sum(ls_ctx *c, const ls_view *v, double a, double *out)
{
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
int ls_view_sample(ls_ctx *c, const ls_view *v, double a, int residual, double total, double u,
                   int32_t *token)
{
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
    return (size_t)n_vocab * sizeof(uint64_t);
}

static LS_HOT void write_probs(const ls_row *row, int32_t V, double *o64, float *o32)
{
    double t[LS_CHUNK];
    for (int32_t lo = 0; lo < V; lo += LS_CHUNK) {
        const int32_t len = V - lo < LS_CHUNK ? V - lo : LS_CHUNK;
        target_block(row, lo, len, t);
        if (o64)
            for (int32_t i = 0; i < len; i++)
                o64[lo + i] = t[i];
        if (o32)
            for (int32_t i = 0; i < len; i++)
                o32[lo + i] = (float)t[i];
    }
}

int ls_probs(const float *logits, int64_t stride, int32_t n_rows, int32_t n_vocab,
             const ls_sampling *sampling, void *workspace, size_t workspace_bytes, double *out64,
             float *out32, int64_t out_stride, int32_t *error_row)
{
    if (error_row)
        *error_row = -1;
    if (!logits || n_rows < 0 || n_vocab <= 0 || stride < n_vocab || out_stride < n_vocab)
        return LS_ERR_ARGUMENT;
    if (!sampling_ok(sampling))
        return LS_ERR_SAMPLING;
    if (!workspace || workspace_bytes < ls_probs_workspace_bytes(n_vocab, sampling))
        return LS_ERR_WORKSPACE;
    for (int32_t r = 0; r < n_rows; r++) {
        ls_row row;
        if (ls_row_init(&row, logits + (int64_t)r * stride, n_vocab, sampling, workspace) != LS_OK) {
            if (error_row)
                *error_row = r;
            return LS_ERR_LOGITS;
        }
        write_probs(&row, n_vocab, out64 ? out64 + (int64_t)r * out_stride : NULL,
                    out32 ? out32 + (int64_t)r * out_stride : NULL);
    }
    return LS_OK;
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
