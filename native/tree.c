/*
 * tree.c - token trees: recursive rejection sampling with / without replacement (traversal paper
 * Alg. 2, applied layer by layer) and traversal verification (traversal paper Alg. 3).
 *
 * A row's rejected children are always a prefix of its sibling list, so the residual updates of
 * row r live CSR-aligned with its children: c->upd[child_start[r] + k] is the k-th update.
 */
#include "internal.h"

static ls_view row_view(const ls_ctx *c, int32_t r, int remove)
{
    ls_view v = ls_view_plain(c, r);
    v.upd = c->upd + c->child_start[r];
    v.n_upd = c->n_removed[r];
    v.remove = remove;
    return v;
}

/* Append the residual update for rejecting child token x of row r with weight a:
 * T' = norm([a T - S]_+) (Alg. 2 line 7 with a = 1; Alg. 3 Eq. 1), S' = S without x,
 * renormalised, when sampling without replacement (Alg. 2 line 9; Alg. 3 Eq. 2).
 * *rest is the draft mass not yet removed. Returns the residual mass through *w. */
static int reject_child(ls_ctx *c, int32_t r, int32_t x, double a, int remove, double *rest, double *w)
{
    ls_view v = row_view(c, r, remove);
    TRY_ROW(ls_view_sum(c, &v, a, w), r);
    ls_update *u = &c->upd[c->child_start[r] + c->n_removed[r]];
    u->a = a;
    u->passthrough = !(*w > 0.0);
    u->inv_w = *w > 0.0 ? 1.0 / *w : 0.0;
    u->token = x;
    if (remove) {
        *rest -= (double)ls_draft_row(c, r)[x];
        u->inv_d = *rest > 0.0 ? 1.0 / *rest : 0.0;
    } else {
        u->inv_d = 1.0;
    }
    c->n_removed[r]++;
    return LS_OK;
}

/* the extra token from row r's current target (after its updates) with u[n] */
static int finish(ls_ctx *c, int32_t r, int remove, ls_verdict *out)
{
    TRY_ROW(ls_row_prepare(c, r), r);
    ls_view v = row_view(c, r, remove);
    int32_t y;
    TRY_ROW(ls_view_sample(c, &v, 1.0, 0, 1.0, c->u[c->n], &y), r);
    ls_emit_path(c, r, out);
    out->token = y;
    return LS_OK;
}

static inline double accept_prob(double t, double s)
{
    if (!(s > 0.0))
        return 0.0;
    const double h = t / s;
    return h < 1.0 ? h : 1.0;
}

/* RRS / RRSw (Alg. 2) layer by layer: try the children of the current node in sibling order,
 * each against the running residual; descend into the first accepted one. */
int ls_rrs(ls_ctx *c, ls_verdict *out, int without_replacement)
{
    int32_t r = 0;
    for (;;) {
        const int32_t kc = ls_child_count(c, r);
        if (kc > 0)
            TRY_ROW(ls_row_prepare(c, r), r);
        double rest = 1.0;
        int32_t next = -1;
        for (int32_t k = 0; k < kc && next < 0; k++) {
            const int32_t node = ls_child(c, r, k), x = ls_token_of(c, node);
            const ls_view v = row_view(c, r, without_replacement);
            double t, s;
            TRY_ROW(ls_view_value(&v, x, &t, &s), r);
            if (c->u[node - 1] < accept_prob(t, s)) {
                next = node;
            } else {
                double w;
                const int st = reject_child(c, r, x, 1.0, without_replacement, &rest, &w);
                if (st != LS_OK)
                    return st;
            }
        }
        if (next < 0)
            return finish(c, r, without_replacement, out);
        r = next;
    }
}

/* p of every remaining node below row P, recomputed after P's update (Alg. 3 line 13) */
static int refresh_below(ls_ctx *c, int32_t P, int32_t after, int32_t mark)
{
    c->stamp[P] = mark;
    for (int32_t q = after + 1; q <= c->n; q++) {
        const int32_t par = c->parent_row[q];
        if (c->stamp[par] != mark)
            continue;
        const ls_view v = row_view(c, par, 1);
        double t, s;
        TRY_ROW(ls_view_value(&v, ls_token_of(c, q), &t, &s), par);
        const double ratio = s > 0.0 ? t / s : 0.0;
        const double val = c->pr[par] * ratio;
        c->pr[q] = val < 1.0 ? val : 1.0;
        c->stamp[q] = mark;
    }
    return LS_OK;
}

/* Traversal verification (Alg. 3): repeatedly test the first leaf (depth-first along first
 * children); accept its whole root path with probability p, else delete it and update its
 * parent's residual (Eq. 1), draft (Eq. 2) and p (Eq. 3). The root's p stays 1 (Eq. 3 with
 * p = 1), so reaching the root accepts it without a draw. */
int ls_traversal(ls_ctx *c, ls_verdict *out)
{
    double *rest = c->aux; /* per row: draft mass not removed yet */
    c->pr[0] = 1.0;
    for (int32_t r = 0; r <= c->n; r++) {
        rest[r] = 1.0;
        c->stamp[r] = -1;
    }
    for (int32_t q = 1; q <= c->n; q++) { /* Alg. 3 line 1 */
        const int32_t par = c->parent_row[q];
        TRY_ROW(ls_row_prepare(c, par), par);
        const ls_view v = ls_view_plain(c, par);
        double t, d;
        TRY_ROW(ls_view_value(&v, ls_token_of(c, q), &t, &d), par);
        const double val = c->pr[par] * (d > 0.0 ? t / d : 0.0);
        c->pr[q] = val < 1.0 ? val : 1.0;
    }
    for (int32_t mark = 0;; mark++) {
        int32_t r = 0;
        while (c->n_removed[r] < ls_child_count(c, r))
            r = ls_child(c, r, c->n_removed[r]);
        if (r == 0 || c->u[r - 1] < c->pr[r])
            return finish(c, r, 1, out);
        const int32_t P = c->parent_row[r];
        const double a = c->pr[P];
        double w;
        const int st = reject_child(c, P, ls_token_of(c, r), a, 1, &rest[P], &w);
        if (st != LS_OK)
            return st;
        const double den = w + (1.0 - a);
        c->pr[P] = den > 0.0 ? w / den : 1.0;
        const int st2 = refresh_below(c, P, r, mark);
        if (st2 != LS_OK)
            return st2;
    }
}
