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
        if (next < 0) {
            ls_emit_path(c, r, out);
            out->token = y;
            return LS_OK;
        }
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
        if (next < 0) {
            ls_emit_path(c, r, out);
            out->token = y;
            return LS_OK;
        }
        r = next;
    }
}

/* the correction token at row r from max(a * t - d, 0) (mass w, computed when w < 0), or the
 * bonus token from t at a leaf */
static int finish(ls_ctx *c, int32_t r, double a, int residual, double w, ls_verdict *out)
{
    TRY_ROW(ls_row_prepare(c, r), r);
    ls_view v = ls_view_plain(c, r);
    int32_t y;
    if (residual) {
        if (w < 0.0)
            TRY_ROW(ls_view_sum(c, &v, a, &w), r);
        TRY_ROW(ls_sample_final(c, &v, a, w, c->u[c->n], &y), r);
    } else {
        TRY_ROW(ls_view_sample(c, &v, 1.0, 0, 1.0, c->u[c->n], &y), r);
    }
    ls_emit_path(c, r, out);
    out->token = y;
    return LS_OK;
}

/* target and draft probability of row r's child token x */
static int child_probs(ls_ctx *c, int32_t r, int32_t x, double *t, double *d)
{
    TRY_ROW(ls_row_prepare(c, r), r);
    const ls_view v = ls_view_plain(c, r);
    TRY_ROW(ls_view_value(&v, x, t, d), r);
    return LS_OK;
}

/* Token verification, block paper Alg. 1 (residual Eq. 3). With lenience eps > 0 the acceptance
 * is Yin et al.'s b(x) = min{1, (target + eps) / draft}; their Thm 4 optimal residual
 * P* = [A]_+, A ∝ max(target - draft, -eps), is again norm(max(target - draft, 0)). With masks,
 * a token its row's mask forbids gets b(x) = 0: the lossy mode never breaks the constraint. */
int ls_token(ls_ctx *c, ls_verdict *out)
{
    const int st = ls_require_chain_below_root(c);
    if (st != LS_OK)
        return st;
    if (ls_child_count(c, 0) > 1) {
        c->error_index = ls_child(c, 0, 1) - 1;
        return LS_ERR_SHAPE;
    }
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
            return finish(c, r, 1.0, 1, -1.0, out);
        r = node;
    }
    return finish(c, r, 1.0, 0, -1.0, out);
}

/* Block verification, block paper Alg. 2: p_i (line 4), h_i (Eq. 5), residual (Eq. 4).
 * tau = max{i : eta_i < h_i}, found top-down so W_i is only computed where it can matter;
 * h_i = 1 whenever p_i = 1 (Eq. 5 with 1 - p_i = 0). */
int ls_block(ls_ctx *c, ls_verdict *out)
{
    const int st = ls_require_chain_below_root(c);
    if (st != LS_OK)
        return st;
    if (ls_child_count(c, 0) > 1) {
        c->error_index = ls_child(c, 0, 1) - 1;
        return LS_ERR_SHAPE;
    }
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
    if (g == 0 || c->u[g - 1] < p[g]) /* h_gamma = p_gamma; an empty draft is tau = gamma = 0 */
        return finish(c, g, 1.0, 0, -1.0, out);
    int32_t tau = 0;
    double w_tau = -1.0;
    for (int32_t i = g - 1; i >= 1; i--) {
        double h = 1.0, w = -1.0;
        if (p[i] < 1.0) {
            TRY_ROW(ls_row_prepare(c, i), i);
            ls_view v = ls_view_plain(c, i);
            TRY_ROW(ls_view_sum(c, &v, p[i], &w), i);
            const double den = w + (1.0 - p[i]);
            h = den > 0.0 ? w / den : 1.0;
        }
        if (c->u[i - 1] < h) {
            tau = i;
            w_tau = w;
            break;
        }
    }
    return finish(c, tau, p[tau], 1, w_tau, out);
}
