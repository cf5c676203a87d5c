/*
 * chain.c - greedy and sample-and-match (any tree), token verification (+ the lossy lenience of
 * Yin et al. Thm 4) and block verification (chains).
 */
#include "internal.h"

static int32_t child_with_token(const ls_ctx *c, int32_t r, int32_t x)
{
    for (int32_t k = 0; k < ls_child_count(c, r); k++)
        if (ls_token_of(c, ls_child(c, r, k)) == x)
            return ls_child(c, r, k);
    return -1;
}

/* the verdict: the path from the root to row r, then token y */
static int ends(const ls_ctx *c, int32_t r, int32_t y, ls_verdict *out)
{
    ls_emit_path(c, r, out);
    out->token = y;
    return LS_OK;
}

/* greedy: follow the child equal to the target argmax; the argmax is the extra token */
int ls_greedy(ls_ctx *c, ls_verdict *out)
{
    int32_t r = 0;
    for (;;) {
        int st;
        const int32_t y = ls_row_argmax(c, r, &st);
        if (st != LS_OK)
            return st;
        const int32_t next = child_with_token(c, r, y);
        if (next < 0)
            return ends(c, r, y, out);
        r = next;
    }
}

/* sample-and-match (llama.cpp): sample the target at each row with u[row], keep a matching child */
int ls_match(ls_ctx *c, ls_verdict *out)
{
    int32_t r = 0;
    for (;;) {
        TRY_ROW(ls_row_prepare(c, r), r);
        ls_view v = ls_view_plain(c, r);
        int32_t y;
        TRY_ROW(ls_view_sample(c, &v, 1.0, 0, 1.0, c->u[r], &y), r);
        const int32_t next = child_with_token(c, r, y);
        if (next < 0)
            return ends(c, r, y, out);
        r = next;
    }
}

/* the correction token at row r from max(a * t - d, 0) under the view v of the row (mass w,
 * computed when w < 0), the final draw u[n]; the path ends at r */
static int correct(ls_ctx *c, int32_t r, ls_view *v, double a, double w, ls_verdict *out)
{
    int32_t y;
    if (w < 0.0)
        TRY_ROW(ls_view_sum(c, v, a, &w), r);
    TRY_ROW(ls_sample_final(c, v, a, w, c->u[c->n], &y), r);
    return ends(c, r, y, out);
}

/* the correction token at row r from max(t - d, 0) (residual) or the bonus token from t at a
 * leaf, drawn with u[n]; the path ends at r */
static int finish(ls_ctx *c, int32_t r, int residual, ls_verdict *out)
{
    TRY_ROW(ls_row_prepare(c, r), r);
    ls_view v = ls_view_plain(c, r);
    if (residual)
        return correct(c, r, &v, 1.0, -1.0, out);
    int32_t y;
    TRY_ROW(ls_view_sample(c, &v, 1.0, 0, 1.0, c->u[c->n], &y), r);
    return ends(c, r, y, out);
}

/* target and draft probability of row r's child token x */
static int child_probs(ls_ctx *c, int32_t r, int32_t x, double *t, double *d)
{
    TRY_ROW(ls_row_prepare(c, r), r);
    const ls_view v = ls_view_plain(c, r);
    TRY_ROW(ls_view_value(&v, x, t, d), r);
    return LS_OK;
}

/* token and block verification take one chain: no node branches, the root included */
static int require_one_chain(ls_ctx *c)
{
    const int st = ls_require_chain_below_root(c);
    if (st != LS_OK)
        return st;
    if (ls_child_count(c, 0) > 1) {
        c->error_index = ls_child(c, 0, 1) - 1;
        return LS_ERR_SHAPE;
    }
    return LS_OK;
}

/* Token verification, block paper Alg. 1 (residual Eq. 3). With lenience eps > 0 the acceptance
 * is Yin et al.'s b(x) = min{1, (target + eps) / draft}; their Thm 4 optimal residual
 * P* = [A]_+, A ∝ max(target - draft, -eps), is again norm(max(target - draft, 0)). With masks,
 * a token its row's mask forbids gets b(x) = 0: the lossy mode never breaks the constraint. */
int ls_token(ls_ctx *c, ls_verdict *out)
{
    const int st = require_one_chain(c);
    if (st != LS_OK)
        return st;
    const double eps = c->p->lenience;
    int32_t r = 0;
    while (ls_child_count(c, r) == 1) {
        const int32_t node = ls_child(c, r, 0);
        double t, d;
        const int s2 = child_probs(c, r, ls_token_of(c, node), &t, &d);
        if (s2 != LS_OK)
            return s2;
        double h = 0.0;
        if (d > 0.0 && ls_allowed(c->rows[r].mask, ls_token_of(c, node))) { /* lenience never admits a masked token */
            const double ratio = (t + eps) / d;
            h = ratio < 1.0 ? ratio : 1.0;
        }
        if (!(c->u[node - 1] < h))
            return finish(c, r, 1, out);
        r = node;
    }
    return finish(c, r, 0, out);
}

/* Block verification's last part, on a path of L drafted rows whose p_i are known (block paper
 * Alg. 2; GBV's along its chosen chain): the whole path and a bonus token when eta_L < p_L,
 * else tau = max{i < L : eta_i < h_i}, h_i = W_i / (W_i + 1 - p_i) (Eq. 5; 1 when p_i = 1), found
 * top-down so that W_i is computed only where it can matter, and the correction token from
 * row R_tau's residual (Eq. 4). Row R_i = rows[i - 1] (rows NULL: R_i = i), R_0 = 0; eta_i is
 * u[R_i - 1]; view(c, i, R_i, arg, &v) gives the row's target and draft for W_i. */
int ls_block_path(ls_ctx *c, const int32_t *rows, const double *p, int32_t L, ls_path_view view, void *arg,
                  ls_verdict *out)
{
#define PATH_ROW(i) ((i) == 0 ? 0 : rows ? rows[(i) - 1] : (i))
    if (L == 0 || c->u[PATH_ROW(L) - 1] < p[L]) /* h_L = p_L; an empty draft is tau = L = 0 */
        return finish(c, PATH_ROW(L), 0, out);
    int32_t tau = 0;
    double w_tau = -1.0;
    ls_view v;
    for (int32_t i = L - 1; i >= 1; i--) {
        const int32_t R = PATH_ROW(i);
        double h = 1.0, w = -1.0;
        if (p[i] < 1.0) {
            TRY_ROW(view(c, i, R, arg, &v), R);
            TRY_ROW(ls_view_sum(c, &v, p[i], &w), R);
            const double den = w + (1.0 - p[i]);
            h = den > 0.0 ? w / den : 1.0;
        }
        if (c->u[R - 1] < h) {
            tau = i;
            w_tau = w;
            break;
        }
    }
    const int32_t R = PATH_ROW(tau);
    if (w_tau < 0.0) /* W_tau not computed (tau = 0, or p_tau = 1): v is not this row's view */
        TRY_ROW(view(c, tau, R, arg, &v), R);
    return correct(c, R, &v, p[tau], w_tau, out);
#undef PATH_ROW
}

/* block verification's view of row R: its own target and draft */
static int plain_view(ls_ctx *c, int32_t i, int32_t R, void *arg, ls_view *v)
{
    (void)i;
    (void)arg;
    TRY_ROW(ls_row_prepare(c, R), R);
    *v = ls_view_plain(c, R);
    return LS_OK;
}

/* Block verification, block paper Alg. 2: p_i (line 4), then ls_block_path (h_i, tau, the
 * residual). */
int ls_block(ls_ctx *c, ls_verdict *out)
{
    const int st = require_one_chain(c);
    if (st != LS_OK)
        return st;
    /* chain rows r_0 = 0, r_i = i (parents precede children, one child each) */
    const int32_t g = c->n;
    double *p = c->pr;
    p[0] = 1.0;
    for (int32_t i = 1; i <= g; i++) {
        double t, d;
        const int s2 = child_probs(c, i - 1, ls_token_of(c, i), &t, &d);
        if (s2 != LS_OK)
            return s2;
        const double ratio = d > 0.0 ? t / d : 0.0;
        const double pi = p[i - 1] * ratio;
        p[i] = pi < 1.0 ? pi : 1.0;
    }
    return ls_block_path(c, NULL, p, g, plain_view, NULL, out);
}
