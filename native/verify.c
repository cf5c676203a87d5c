/*
 * verify.c - entry point: workspace layout, input checks, the children (CSR) view of the tree,
 * and dispatch to the algorithm families (chain.c, multipath.c, tree.c).
 */
#include "internal.h"

#include <math.h>
#include <string.h>

#define MAX_NODES (1 << 16)
#define MAX_VOCAB (1 << 28)
#define ALIGN 64

typedef struct layout {
    size_t rows, u, child_start, children, parent_row, n_removed, stamp, tmp, pr, aux, upd, keys, kept,
        sort_keys, sort_ids, qrow, total;
} layout;

static size_t carve(size_t *off, size_t bytes)
{
    const size_t at = (*off + ALIGN - 1) / ALIGN * ALIGN;
    *off = at + bytes;
    return at;
}

static int needs_keys(const ls_sampling *s, int32_t V)
{
    return s->temperature > 0.0f && ((s->top_k > 0 && s->top_k < V) || s->top_p < 1.0f);
}

/* a kept set can be small enough to list: greedy target or any filter */
static int may_be_sparse(const ls_sampling *s, int32_t V)
{
    return s->temperature <= 0.0f || needs_keys(s, V) || s->min_p > 0.0f;
}

static int make_layout(layout *L, int32_t method, int32_t n, int32_t V, const ls_sampling *s)
{
    if (n < 0 || n > MAX_NODES || V <= 0 || V > MAX_VOCAB || !s)
        return -1;
    const size_t N = (size_t)n, R = N + 1, VV = (size_t)V;
    size_t off = 0;
    L->rows = carve(&off, R * sizeof(ls_row));
    L->u = carve(&off, R * sizeof(double));
    L->child_start = carve(&off, (R + 1) * sizeof(int32_t));
    L->children = carve(&off, (N + 1) * sizeof(int32_t));
    L->parent_row = carve(&off, R * sizeof(int32_t));
    L->n_removed = carve(&off, R * sizeof(int32_t));
    L->stamp = carve(&off, R * sizeof(int32_t));
    L->tmp = carve(&off, (N + 1) * sizeof(int32_t));
    L->pr = carve(&off, R * sizeof(double));
    L->aux = carve(&off, 2 * R * sizeof(double));
    L->upd = carve(&off, (N + 1) * sizeof(ls_update));
    L->keys = needs_keys(s, V) || may_be_sparse(s, V) ? carve(&off, VV * sizeof(uint64_t)) : 0;
    L->kept = may_be_sparse(s, V) ? carve(&off, R * LS_SPARSE_MAX * sizeof(int32_t)) : 0;
    const int gbv = method == LS_GBV;
    L->sort_keys = gbv ? carve(&off, 2 * VV * sizeof(uint32_t)) : 0;
    L->sort_ids = gbv ? carve(&off, 2 * VV * sizeof(int32_t)) : 0;
    L->qrow = gbv ? carve(&off, VV * sizeof(double)) : 0;
    L->total = off + ALIGN; /* room to align the caller's base pointer */
    return 0;
}

size_t ls_workspace_bytes(int32_t method, int32_t n_nodes, int32_t n_vocab, const ls_sampling *sampling)
{
    layout L;
    if (method < 0 || method >= LS_N_METHODS || make_layout(&L, method, n_nodes, n_vocab, sampling) != 0)
        return 0;
    return L.total;
}

const char *ls_status_string(int status)
{
    switch (status) {
    case LS_OK: return "ok";
    case LS_ERR_ARGUMENT: return "invalid argument (null pointer, bad size or stride)";
    case LS_ERR_TOKEN: return "token id out of range [0, n_vocab)";
    case LS_ERR_PARENT: return "parent index must be -1 or an earlier node";
    case LS_ERR_LOGITS: return "target logits contain NaN or infinity";
    case LS_ERR_DRAFT: return "draft row is not a probability distribution";
    case LS_ERR_SHAPE: return "tree shape not supported by this method";
    case LS_ERR_SIBLINGS: return "sibling tokens must be distinct (drawn without replacement)";
    case LS_ERR_SAMPLING: return "sampling settings out of range";
    case LS_ERR_UNIFORM: return "uniforms must lie in [0, 1)";
    case LS_ERR_WORKSPACE: return "workspace too small";
    case LS_ERR_METHOD: return "unknown verification method";
    case LS_ERR_LENIENCE: return "lenience must be finite, >= 0, and is only defined for method token";
    case LS_ERR_MASK: return "a token mask row allows no token";
    default: return "unknown status";
    }
}

/* ------------------------------------------------------------------ tree helpers */

int32_t ls_child_count(const ls_ctx *c, int32_t r)
{
    return c->child_start[r + 1] - c->child_start[r];
}

int32_t ls_child(const ls_ctx *c, int32_t r, int32_t k)
{
    return c->children[c->child_start[r] + k];
}

int32_t ls_token_of(const ls_ctx *c, int32_t r)
{
    return c->p->tokens[r - 1];
}

/* every node but the root has at most one child: chains hanging off the root */
int ls_require_chain_below_root(ls_ctx *c)
{
    for (int32_t r = 1; r <= c->n; r++)
        if (ls_child_count(c, r) > 1) {
            c->error_index = r - 1;
            return LS_ERR_SHAPE;
        }
    return LS_OK;
}

void ls_emit_path(const ls_ctx *c, int32_t r, ls_verdict *out)
{
    int32_t len = 0;
    for (int32_t q = r; q > 0; q = c->parent_row[q])
        len++;
    out->n_accepted = len;
    for (int32_t q = r; q > 0; q = c->parent_row[q])
        out->path[--len] = q - 1;
}

static int build_tree(ls_ctx *c)
{
    const ls_problem *p = c->p;
    const int32_t n = c->n;
    memset(c->child_start, 0, (size_t)(n + 2) * sizeof(int32_t));
    c->parent_row[0] = -1;
    for (int32_t j = 0; j < n; j++) {
        if (p->tokens[j] < 0 || p->tokens[j] >= c->V) {
            c->error_index = j;
            return LS_ERR_TOKEN;
        }
        if (p->parents[j] < -1 || p->parents[j] >= j) {
            c->error_index = j;
            return LS_ERR_PARENT;
        }
        c->parent_row[j + 1] = p->parents[j] + 1;
        c->child_start[p->parents[j] + 2]++;
    }
    for (int32_t r = 0; r <= n; r++)
        c->child_start[r + 1] += c->child_start[r];
    for (int32_t r = 0; r <= n; r++)
        c->stamp[r] = c->child_start[r];
    for (int32_t j = 0; j < n; j++)
        c->children[c->stamp[c->parent_row[j + 1]]++] = j + 1;
    return LS_OK;
}

/* siblings drawn without replacement must carry distinct tokens */
static int require_distinct_siblings(ls_ctx *c)
{
    for (int32_t r = 0; r <= c->n; r++) {
        const int32_t k = ls_child_count(c, r);
        for (int32_t a = 1; a < k; a++)
            for (int32_t b = 0; b < a; b++)
                if (ls_token_of(c, ls_child(c, r, a)) == ls_token_of(c, ls_child(c, r, b))) {
                    c->error_index = ls_child(c, r, a) - 1;
                    return LS_ERR_SIBLINGS;
                }
    }
    return LS_OK;
}

static int check_problem(int32_t method, const ls_problem *p)
{
    if (method < 0 || method >= LS_N_METHODS)
        return LS_ERR_METHOD;
    if (p->n_nodes < 0 || p->n_nodes > MAX_NODES || p->n_vocab <= 0 || p->n_vocab > MAX_VOCAB ||
        !p->target_logits || p->target_stride < p->n_vocab)
        return LS_ERR_ARGUMENT;
    if (p->n_nodes > 0 && (!p->tokens || !p->parents || !p->draft_probs || p->draft_stride < p->n_vocab))
        return LS_ERR_ARGUMENT;
    if (p->masks && p->mask_stride < ((int64_t)p->n_vocab + 31) / 32)
        return LS_ERR_ARGUMENT;
    const ls_sampling *s = &p->sampling;
    if (!isfinite(s->temperature) || s->temperature < 0.0f || s->top_k < 0 || !(s->top_p > 0.0f) ||
        s->top_p > 1.0f || !(s->min_p >= 0.0f) || s->min_p > 1.0f)
        return LS_ERR_SAMPLING;
    if (!isfinite(p->lenience) || p->lenience < 0.0 || (p->lenience > 0.0 && method != LS_TOKEN))
        return LS_ERR_LENIENCE;
    return LS_OK;
}

static void bind(ls_ctx *c, const layout *L, unsigned char *base)
{
    c->rows = (ls_row *)(void *)(base + L->rows);
    c->u = (double *)(void *)(base + L->u);
    c->child_start = (int32_t *)(void *)(base + L->child_start);
    c->children = (int32_t *)(void *)(base + L->children);
    c->parent_row = (int32_t *)(void *)(base + L->parent_row);
    c->n_removed = (int32_t *)(void *)(base + L->n_removed);
    c->stamp = (int32_t *)(void *)(base + L->stamp);
    c->tmp = (int32_t *)(void *)(base + L->tmp);
    c->pr = (double *)(void *)(base + L->pr);
    c->aux = (double *)(void *)(base + L->aux);
    c->upd = (ls_update *)(void *)(base + L->upd);
    c->keys = L->keys ? (uint64_t *)(void *)(base + L->keys) : NULL;
    c->kept = L->kept ? (int32_t *)(void *)(base + L->kept) : NULL;
    c->sort_keys = L->sort_keys ? (uint32_t *)(void *)(base + L->sort_keys) : NULL;
    c->sort_ids = L->sort_ids ? (int32_t *)(void *)(base + L->sort_ids) : NULL;
    c->qrow = L->qrow ? (double *)(void *)(base + L->qrow) : NULL;
}

static int dispatch(int32_t method, ls_ctx *c, ls_verdict *out)
{
    switch (method) {
    case LS_GREEDY: return ls_greedy(c, out);
    case LS_MATCH: return ls_match(c, out);
    case LS_TOKEN: return ls_token(c, out);
    case LS_BLOCK: return ls_block(c, out);
    case LS_GBV: return ls_gbv(c, out);
    case LS_RRS: return ls_rrs(c, out, 0);
    case LS_RRSW: return ls_rrs(c, out, 1);
    case LS_TRAVERSAL: return ls_traversal(c, out);
    case LS_BATCH: return ls_batch(c, out);
    default: return LS_ERR_METHOD;
    }
}

int ls_verify(int32_t method, const ls_problem *p, void *workspace, size_t workspace_bytes, ls_verdict *out)
{
    if (!out)
        return LS_ERR_ARGUMENT;
    out->n_accepted = 0;
    out->token = -1;
    out->error_index = -1;
    if (!p)
        return LS_ERR_ARGUMENT;
    int st = check_problem(method, p);
    if (st != LS_OK)
        return st;
    if (p->n_nodes > 0 && !out->path)
        return LS_ERR_ARGUMENT;
    layout L;
    if (make_layout(&L, method, p->n_nodes, p->n_vocab, &p->sampling) != 0)
        return LS_ERR_ARGUMENT;
    if (!workspace || workspace_bytes < L.total)
        return LS_ERR_WORKSPACE;
    const uintptr_t addr = (uintptr_t)workspace;
    unsigned char *base = (unsigned char *)workspace + ((ALIGN - addr % ALIGN) % ALIGN);

    ls_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.n = p->n_nodes;
    c.V = p->n_vocab;
    c.error_index = -1;
    bind(&c, &L, base);
    for (int32_t r = 0; r <= c.n; r++)
        c.rows[r].ready = 0;
    memset(c.n_removed, 0, (size_t)(c.n + 1) * sizeof(int32_t));

    if (p->uniforms) {
        for (int32_t i = 0; i <= c.n; i++) {
            const double u = p->uniforms[i];
            if (!(u >= 0.0 && u < 1.0)) {
                out->error_index = i;
                return LS_ERR_UNIFORM;
            }
            c.u[i] = u;
        }
    } else {
        ls_fill_uniforms(p->seed, c.u, c.n + 1);
    }
    if (p->masks) /* every target row must allow a token: checked up front, whichever rows are read */
        for (int32_t r = 0; r <= c.n; r++)
            if (!ls_mask_any(p->masks + (int64_t)r * p->mask_stride, c.V)) {
                out->error_index = r;
                return LS_ERR_MASK;
            }
    st = build_tree(&c);
    if (st == LS_OK && (method == LS_RRSW || method == LS_TRAVERSAL))
        st = require_distinct_siblings(&c);
    if (st == LS_OK)
        st = dispatch(method, &c, out);
    if (st != LS_OK) {
        out->n_accepted = 0;
        out->token = -1;
        out->error_index = c.error_index;
    }
    return st;
}

_Bool ls_abort_requested(void *flag)
{
    /* an atomic read: Python sets the flag from another thread while llama.cpp's threads decode */
    return flag != NULL && __atomic_load_n((const int32_t *)flag, __ATOMIC_RELAXED) != 0;
}
