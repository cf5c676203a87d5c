/*
 * multipath.c - K root-to-leaf chains: greedy multi-path block verification (GBV, multi-path paper
 * Sec. 5, Alg. 1, Eq. 19-23) and batch speculative decoding (theory paper Alg. 4).
 */
#include "internal.h"

/* Batch speculative decoding (Yin et al. Alg. 4): the K i.i.d. drafts' first tokens are tried in
 * turn against the running residual [target - draft]_+ (line 19), the first accepted draft is
 * continued with token verification (lines 13-21), and when every first token is rejected the
 * token comes from the last residual (line 28). That is recursive rejection sampling with
 * replacement on the K-chain tree. */
int ls_batch(ls_ctx *c, ls_verdict *out)
{
    const int st = ls_require_chain_below_root(c);
    if (st != LS_OK)
        return st;
    return ls_rrs(c, out, 0);
}

/* ------------------------------------------------------------------ GBV */

/* local ranking pi(y) = t(y)/d(y) of Eq. 21 as a float, ties broken by token id */
static inline int rank_less(float ka, int32_t a, float kb, int32_t b)
{
    return ka < kb || (ka == kb && a < b);
}

/* C(x) = sum of d(y) over y ranked below x at this row (the inner sums of Eq. 22-23) */
static LS_HOT double mass_below_dense(const ls_row *row, const float *d, int32_t V, float kx, int32_t x)
{
    double s = 0.0;
    for (int32_t lo = 0; lo < V; lo += LS_CHUNK) {
        const int32_t len = V - lo < LS_CHUNK ? V - lo : LS_CHUNK;
        double t[LS_CHUNK], m[LS_CHUNK];
        const float *dc = d + lo;
        target_block(row, lo, len, t);
        for (int32_t i = 0; i < len; i++) {
            const double dy = (double)dc[i];
            const float ky = ls_ratio_key(t[i], dy);
            const int below = rank_less(ky, lo + i, kx, x);
            m[i] = below ? dy : 0.0;
        }
        s += ls_sum_f64(m, len);
    }
    return s;
}

static LS_HOT double draft_total(const float *d, int32_t V)
{
    return ls_sum_f32(d, V);
}

/* draft mass outside a listed kept set: those tokens have t = 0, i.e. key 0 (or +inf with
 * d = 0, which carries no mass), below every token with a positive key */
static double mass_outside(const ls_row *row, const float *d, int32_t V)
{
    double in = 0.0;
    for (int32_t i = 0; i < row->n_kept; i++)
        in += (double)d[row->kept[i]];
    return draft_total(d, V) - in;
}

static double mass_below(const ls_row *row, const float *d, int32_t V, float kx, int32_t x)
{
    if (row->n_kept < 0 || !(kx > 0.0f))
        return mass_below_dense(row, d, V, kx, x);
    double s = mass_outside(row, d, V);
    for (int32_t i = 0; i < row->n_kept; i++) {
        const int32_t y = row->kept[i];
        const double dy = (double)d[y];
        if (rank_less(ls_ratio_key(ls_row_value(row, y), dy), y, kx, x))
            s += dy;
    }
    return s;
}

/* sum_{m<K} v^m u^{K-1-m} */
static inline double poly(double u, double v, int32_t K)
{
    double s = 1.0, vk = v;
    for (int32_t k = 1; k < K; k++) {
        s = u * s + vk;
        vk *= v;
    }
    return s;
}

/* q^Gamma(x | prefix) from Eq. 22-23 divided by q^Gamma(prefix), in the scaled variables
 * r = S/(S+Q), rho = Q/(S+Q) (S: mass of paths ranked before the prefix, Q: q(prefix)):
 * q^Gamma(x|.) = d(x) * sum_m v^m u^{K-1-m} / sum_m r^m, u = r + rho C(x), v = u + rho d(x).
 * inv_den = 1 / sum_m r^m. */
static inline double skewed(double d, double C, double r, double rho, int32_t K, double inv_den)
{
    const double u = r + rho * C;
    const double v = u + rho * d;
    return d * poly(u, v, K) * inv_den;
}

/* stable LSD radix sort of (key, id) pairs by key, 3 passes of 11 bits; result in (kb, ib) */
static void radix_sort(uint32_t *ka, int32_t *ia, uint32_t *kb, int32_t *ib, int32_t m)
{
    for (int pass = 0; pass < 3; pass++) {
        uint32_t hist[2048] = {0};
        const int shift = 11 * pass;
        for (int32_t i = 0; i < m; i++)
            hist[(ka[i] >> shift) & 2047u]++;
        uint32_t sum = 0;
        for (int b = 0; b < 2048; b++) {
            const uint32_t h = hist[b];
            hist[b] = sum;
            sum += h;
        }
        for (int32_t i = 0; i < m; i++) {
            const uint32_t pos = hist[(ka[i] >> shift) & 2047u]++;
            kb[pos] = ka[i];
            ib[pos] = ia[i];
        }
        if (pass < 2) {
            uint32_t *tk = ka;
            ka = kb;
            kb = tk;
            int32_t *ti = ia;
            ia = ib;
            ib = ti;
        }
    }
}

/* (key, id) of every token with positive draft probability, in id order; -1 on a bad draft */
static LS_HOT int32_t rank_keys(const ls_row *row, const float *d, int32_t V, uint32_t *ka, int32_t *ia,
                               double *qrow)
{
    int32_t m = 0, bad = 0;
    double t[LS_CHUNK];
    for (int32_t lo = 0; lo < V; lo += LS_CHUNK) {
        const int32_t len = V - lo < LS_CHUNK ? V - lo : LS_CHUNK;
        target_block(row, lo, len, t);
        for (int32_t i = 0; i < len; i++) {
            const int32_t y = lo + i;
            const double dy = (double)d[y];
            bad |= !(dy >= 0.0 && dy <= 1.0001);
            qrow[y] = 0.0;
            if (dy > 0.0) {
                ka[m] = sortable_f32(ls_ratio_key(t[i], dy));
                ia[m] = y;
                m++;
            }
        }
    }
    return bad ? -1 : m;
}

/* The skewed draft row q^Gamma(.|prefix) at row R into c->qrow. With a listed kept set only
 * its entries are computed: the target is 0 elsewhere, so no other entry is ever weighed. */
static int materialize(ls_ctx *c, int32_t R, double r, double rho, int32_t K)
{
    const int32_t V = c->V;
    const float *d = ls_draft_row(c, R);
    const ls_row *row = &c->rows[R];
    uint32_t *ka = c->sort_keys, *kb = c->sort_keys + V;
    int32_t *ia = c->sort_ids, *ib = c->sort_ids + V;
    int32_t m;
    double C = 0.0;
    if (row->n_kept >= 0) {
        m = 0;
        for (int32_t i = 0; i < row->n_kept; i++) {
            const int32_t y = row->kept[i];
            const double dy = (double)d[y];
            if (!(dy >= 0.0 && dy <= 1.0001))
                return LS_ERR_DRAFT;
            c->qrow[y] = 0.0;
            if (dy > 0.0) {
                ka[m] = sortable_f32(ls_ratio_key(ls_row_value(row, y), dy));
                ia[m] = y;
                m++;
            }
        }
        C = mass_outside(row, d, V);
        if (C < -1e-3 || C > 1.001)
            return LS_ERR_DRAFT;
    } else {
        m = rank_keys(row, d, V, ka, ia, c->qrow);
        if (m < 0)
            return LS_ERR_DRAFT;
    }
    radix_sort(ka, ia, kb, ib, m);
    const double inv_den = 1.0 / poly(r, 1.0, K);
    for (int32_t i = 0; i < m; i++) {
        const int32_t y = ib[i];
        const double dy = (double)d[y];
        c->qrow[y] = skewed(dy, C, r, rho, K, inv_den);
        C += dy;
    }
    if (C < 0.999 || C > 1.001)
        return LS_ERR_DRAFT;
    return LS_OK;
}

/* row of chain k at depth i (1-based), stored by collect_chains */
#define CHAIN(k, i) c->tmp[(k) * L + (i) - 1]

static int collect_chains(ls_ctx *c, int32_t K, int32_t *L_out)
{
    const int32_t L = c->n / K;
    for (int32_t k = 0; k < K; k++) {
        int32_t r = ls_child(c, 0, k), len = 0;
        while (r >= 0) {
            len++;
            if (len > L) {
                c->error_index = r - 1;
                return LS_ERR_SHAPE;
            }
            CHAIN(k, len) = r;
            r = ls_child_count(c, r) ? ls_child(c, r, 0) : -1;
        }
        if (len != L) {
            c->error_index = ls_child(c, 0, k) - 1;
            return LS_ERR_SHAPE;
        }
    }
    *L_out = L;
    return LS_OK;
}

/* does chain b outrank chain a in the lexicographic order of Def. 5.2 (Alg. 1 lines 2-3)? */
static int outranks(ls_ctx *c, int32_t L, int32_t a, int32_t b, int *better)
{
    *better = 0;
    for (int32_t i = 1; i <= L; i++) {
        const int32_t xa = ls_token_of(c, CHAIN(a, i)), xb = ls_token_of(c, CHAIN(b, i));
        if (xa == xb)
            continue;
        const int32_t R = i == 1 ? 0 : CHAIN(a, i - 1);
        TRY_ROW(ls_row_prepare(c, R), R);
        const ls_view v = ls_view_plain(c, R);
        double ta, da, tb, db;
        TRY_ROW(ls_view_value(&v, xa, &ta, &da), R);
        TRY_ROW(ls_view_value(&v, xb, &tb, &db), R);
        *better = rank_less(ls_ratio_key(ta, da), xa, ls_ratio_key(tb, db), xb);
        return LS_OK;
    }
    return LS_OK;
}

/* the scaled variables of GBV's skewed draft along the chosen chain (r_i, rho_i per depth) */
typedef struct skew {
    const double *r;
    const double *rho;
    int32_t K;
} skew;

/* GBV's view of row R at depth i: its target, and its skewed draft q^Gamma(.|prefix) (c->qrow) */
static int skewed_view(ls_ctx *c, int32_t i, int32_t R, void *arg, ls_view *v)
{
    const skew *sk = arg;
    TRY_ROW(ls_row_prepare(c, R), R);
    TRY_ROW(materialize(c, R, sk->r[i], sk->rho[i], sk->K), R);
    *v = ls_view_plain(c, R);
    v->draft64 = c->qrow;
    return LS_OK;
}

/* GBV (multi-path paper Alg. 1): select the top-ranked chain, then block verification
 * (block paper Alg. 2, ls_block_path) on it with draft values q^Gamma (Eq. 22-23). */
int ls_gbv(ls_ctx *c, ls_verdict *out)
{
    int st = ls_require_chain_below_root(c);
    if (st != LS_OK)
        return st;
    const int32_t K = ls_child_count(c, 0);
    if (K <= 1)
        return ls_block(c, out); /* one path: q^Gamma = q, plain block verification */
    int32_t L;
    st = collect_chains(c, K, &L);
    if (st != LS_OK)
        return st;
    int32_t best = 0;
    for (int32_t k = 1; k < K; k++) {
        int better;
        st = outranks(c, L, best, k, &better);
        if (st != LS_OK)
            return st;
        if (better)
            best = k;
    }
    /* p_i along the chosen chain: rows R_0 = 0, R_i = CHAIN(best, i) */
    double *p = c->pr, *rr = c->aux, *rh = c->aux + (c->n + 1);
    p[0] = 1.0;
    rr[0] = 0.0;
    rh[0] = 1.0;
    for (int32_t i = 1; i <= L; i++) {
        const int32_t R = i == 1 ? 0 : CHAIN(best, i - 1), x = ls_token_of(c, CHAIN(best, i));
        TRY_ROW(ls_row_prepare(c, R), R);
        const ls_view v = ls_view_plain(c, R);
        double t, d;
        TRY_ROW(ls_view_value(&v, x, &t, &d), R);
        const double C = mass_below(&c->rows[R], ls_draft_row(c, R), c->V, ls_ratio_key(t, d), x);
        const double q = skewed(d, C, rr[i - 1], rh[i - 1], K, 1.0 / poly(rr[i - 1], 1.0, K));
        const double pi = q > 0.0 ? p[i - 1] * (t / q) : 0.0;
        p[i] = pi < 1.0 ? pi : 1.0;
        const double u = rr[i - 1] + rh[i - 1] * C, vv = u + rh[i - 1] * d;
        rr[i] = vv > 0.0 ? u / vv : 0.0;
        rh[i] = vv > 0.0 ? rh[i - 1] * d / vv : 1.0;
    }
    skew sk = {rr, rh, K};
    return ls_block_path(c, &CHAIN(best, 1), p, L, skewed_view, &sk, out);
}
