/*
 * fuzz_verifier.c - random valid and invalid inputs through every entry point of the verifier.
 * Built by tests/test_sanitizers.py with -fsanitize=address,undefined; exits non-zero when a
 * result breaks the API contract. Workspaces are malloc'ed at exactly the reported size so an
 * out-of-bounds access is caught.
 *
 * Token masks: 40% of the iterations pass masks of every density (all-zero rows included, junk
 * bits past n_vocab and in the padding words, junk logits under disallowed bits); a success must
 * only ever output allowed tokens, and an empty row must be reported as LS_ERR_MASK.
 *
 * usage: fuzz_verifier ITERATIONS SEED
 */
#include "verifier.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t state;

static uint64_t next(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static int below(int n) { return (int)(next() % (uint64_t)n); }
static double unit(void) { return (double)(next() >> 11) * 0x1.0p-53; }
static int chance(int percent) { return below(100) < percent; }

static float normal(void)
{
    const double u = unit() + 1e-12, v = unit();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static int allowed(const uint32_t *row, int32_t x) { return (int)((row[x >> 5] >> (x & 31)) & 1u); }

static int row_empty(const uint32_t *row, int V)
{
    for (int x = 0; x < V; x++)
        if (allowed(row, x))
            return 0;
    return 1;
}

static void fail(const char *what, int iter)
{
    fprintf(stderr, "contract violated at iteration %d: %s\n", iter, what);
    exit(1);
}

/* parents for a shape the method accepts (most of the time) or anything */
static void make_parents(int method, int n, int32_t *parents)
{
    const int kind = chance(85) ? method : -1;
    if (kind == LS_TOKEN || kind == LS_BLOCK) {
        for (int j = 0; j < n; j++)
            parents[j] = j - 1;
    } else if (kind == LS_GBV || kind == LS_BATCH) {
        const int K = 1 + below(4), L = n / K > 0 ? n / K : 1;
        for (int j = 0; j < n; j++)
            parents[j] = (j % L == 0) ? -1 : j - 1;
    } else {
        for (int j = 0; j < n; j++)
            parents[j] = j ? below(j + 1) - 1 : -1;
    }
    if (chance(3) && n > 0)
        parents[below(n)] = below(2 * n + 3) - n - 2; /* possibly invalid */
}

int main(int argc, char **argv)
{
    const int iterations = argc > 1 ? atoi(argv[1]) : 10000;
    state = argc > 2 ? strtoull(argv[2], NULL, 10) * 2654435761u + 1 : 88172645463325252ull;
    int ok_count = 0, err_count = 0;
    for (int it = 0; it < iterations; it++) {
        const int method = chance(2) ? below(20) - 5 : below(LS_N_METHODS);
        const int n = below(14);
        const int V = 1 + (chance(10) ? below(3000) : below(40));
        ls_sampling s;
        s.temperature = chance(20) ? 0.0f : (float)(unit() * 2.0);
        s.top_k = chance(60) ? 0 : below(V + 3);
        s.top_p = chance(60) ? 1.0f : (float)unit();
        s.min_p = chance(70) ? 0.0f : (float)unit();
        if (chance(3))
            s.temperature = chance(50) ? -1.0f : NAN;
        if (chance(2))
            s.top_p = chance(50) ? 0.0f : 1.5f;

        const size_t rows = (size_t)n + 1;
        float *logits = malloc(rows * (size_t)V * sizeof(float));
        float *draft = malloc(rows * (size_t)V * sizeof(float));
        int32_t *tokens = malloc((size_t)(n + 1) * sizeof(int32_t));
        int32_t *parents = malloc((size_t)(n + 1) * sizeof(int32_t));
        int32_t *path = malloc((size_t)(n + 1) * sizeof(int32_t));
        double *u = malloc(rows * sizeof(double));
        const int use_masks = chance(40);
        const int words = (V + 31) / 32;
        const int mstride = words + (chance(30) ? below(3) : 0);
        uint32_t *masks = malloc(rows * (size_t)mstride * sizeof(uint32_t));
        if (!logits || !draft || !tokens || !parents || !path || !u || !masks)
            return 2;
        int any_empty = 0;
        for (size_t r = 0; r < rows; r++) {
            uint32_t *m = masks + r * (size_t)mstride;
            const int density = below(5); /* 0: empty (rarely), 1: one token, 2: sparse, 3: half, 4: all */
            for (int w = 0; w < mstride; w++)
                m[w] = (uint32_t)next(); /* junk, including past n_vocab and in the padding */
            for (int x = 0; x < V; x++) {
                const int on = density == 4 || (density == 3 && chance(50)) || (density == 2 && chance(10));
                m[x >> 5] = on ? (m[x >> 5] | (1u << (x & 31))) : (m[x >> 5] & ~(1u << (x & 31)));
            }
            if (density == 0 && chance(95)) { /* usually turn an empty row into a one-token row */
                const int x = below(V);
                m[x >> 5] |= 1u << (x & 31);
            }
            if (density == 1) {
                const int x = below(V);
                m[x >> 5] |= 1u << (x & 31);
            }
            any_empty |= row_empty(m, V);
        }
        const float scale = (float)(0.1 + 5.0 * unit());
        for (size_t i = 0; i < rows * (size_t)V; i++)
            logits[i] = chance(10) ? (float)below(3) : scale * normal();
        for (size_t r = 0; r < rows; r++) {
            double sum = 0.0;
            float *d = draft + r * (size_t)V;
            const int sparse = chance(30), onehot = chance(10);
            for (int x = 0; x < V; x++) {
                d[x] = (sparse && chance(50)) ? 0.0f : (float)unit();
                sum += d[x];
            }
            if (onehot || sum <= 0.0) {
                memset(d, 0, (size_t)V * sizeof(float));
                d[below(V)] = 1.0f;
            } else {
                for (int x = 0; x < V; x++)
                    d[x] = (float)(d[x] / sum);
            }
        }
        if (use_masks) /* junk under disallowed bits is never read */
            for (size_t r = 0; r < rows; r++)
                for (int x = 0; x < V; x++)
                    if (!allowed(masks + r * (size_t)mstride, x) && chance(20))
                        logits[r * (size_t)V + (size_t)x] = chance(50) ? NAN : -INFINITY;
        if (chance(3))
            logits[below((int)(rows * (size_t)V))] = chance(50) ? NAN : INFINITY;
        if (chance(3))
            draft[below((int)(rows * (size_t)V))] = chance(50) ? NAN : -0.5f;
        make_parents(method, n, parents);
        for (int j = 0; j < n; j++)
            tokens[j] = chance(2) ? below(V + 10) - 5 : below(V);
        for (int j = 0; j < n + 1; j++)
            u[j] = chance(1) ? 1.0 : unit();

        ls_problem p;
        memset(&p, 0, sizeof p);
        p.n_nodes = n;
        p.n_vocab = V;
        p.tokens = tokens;
        p.parents = parents;
        p.target_logits = logits;
        p.target_stride = V;
        p.draft_probs = (n == 0 && chance(50)) ? NULL : draft;
        p.draft_stride = V;
        p.sampling = s;
        p.lenience = chance(10) ? unit() : 0.0;
        p.uniforms = chance(50) ? u : NULL;
        p.seed = next();
        p.masks = use_masks ? masks : NULL;
        p.mask_stride = chance(1) ? words - 1 : mstride; /* occasionally too small */

        const size_t bytes = ls_workspace_bytes(method, n, V, &s);
        void *ws = bytes ? malloc(bytes) : NULL;
        ls_verdict out;
        out.path = path;
        const int st = ls_verify(method, &p, ws, bytes, &out);
        if (st == LS_OK) {
            ok_count++;
            if (out.token < 0 || out.token >= V)
                fail("token out of range", it);
            if (out.n_accepted < 0 || out.n_accepted > n)
                fail("n_accepted out of range", it);
            for (int i = 0; i < out.n_accepted; i++) {
                const int32_t node = path[i];
                if (node < 0 || node >= n)
                    fail("path node out of range", it);
                if (parents[node] != (i ? path[i - 1] : -1))
                    fail("path is not a root-to-node chain", it);
                if (use_masks && !allowed(masks + (size_t)(parents[node] + 1) * (size_t)mstride, tokens[node]))
                    fail("accepted a token its row's mask forbids", it);
            }
            if (use_masks) {
                const size_t last = out.n_accepted ? (size_t)path[out.n_accepted - 1] + 1 : 0;
                if (!allowed(masks + last * (size_t)mstride, out.token))
                    fail("output a token its row's mask forbids", it);
                if (any_empty)
                    fail("an empty mask row was not reported", it);
            }
        } else {
            err_count++;
            if (st < LS_ERR_MASK || st > LS_ERR_ARGUMENT)
                fail("unknown status", it);
            if (st == LS_ERR_MASK &&
                (!use_masks || out.error_index < 0 || out.error_index > n ||
                 !row_empty(masks + (size_t)out.error_index * (size_t)mstride, V)))
                fail("LS_ERR_MASK without an empty mask row", it);
            if (strlen(ls_status_string(st)) == 0)
                fail("empty status string", it);
        }
        if (bytes && chance(20)) { /* a workspace one byte short must be refused */
            if (ls_verify(method, &p, ws, bytes - 1, &out) != LS_ERR_WORKSPACE && st == LS_OK)
                fail("short workspace accepted", it);
        }
        free(ws);

        /* ls_probs and ls_sample_probs on the same rows */
        const size_t pbytes = ls_probs_workspace_bytes(V, &s);
        void *pws = malloc(pbytes ? pbytes : 1);
        double *o64 = malloc(rows * (size_t)V * sizeof(double));
        int32_t err_row;
        const int pst = use_masks ? ls_probs_masked(logits, V, (int32_t)rows, V, masks, p.mask_stride, &s, pws,
                                                    pbytes, o64, NULL, V, &err_row)
                                  : ls_probs(logits, V, (int32_t)rows, V, &s, pws, pbytes, o64, NULL, V, &err_row);
        if (pst == LS_OK) {
            if (use_masks && any_empty)
                fail("probs: an empty mask row was not reported", it);
            for (size_t r = 0; r < rows; r++) {
                double sum = 0.0;
                for (int x = 0; x < V; x++) {
                    const double q = o64[r * (size_t)V + (size_t)x];
                    sum += q;
                    if (use_masks && q != 0.0 && !allowed(masks + r * (size_t)mstride, x))
                        fail("probs: mass on a disallowed token", it);
                }
                if (fabs(sum - 1.0) > 1e-6)
                    fail("probs row does not sum to 1", it);
            }
        } else if (pst == LS_ERR_MASK &&
                   (!use_masks || err_row < 0 || !row_empty(masks + (size_t)err_row * (size_t)mstride, V))) {
            fail("probs: LS_ERR_MASK without an empty mask row", it);
        }
        free(pws);
        free(o64);
        int32_t exclude[3] = {below(V), below(V), below(V + 4) - 2};
        int32_t tok;
        const int sst = ls_sample_probs(draft, V, exclude, below(4), unit(), &tok);
        if (sst == LS_OK && (tok < 0 || tok >= V))
            fail("sampled token out of range", it);

        free(logits);
        free(draft);
        free(tokens);
        free(parents);
        free(path);
        free(u);
        free(masks);
    }
    printf("ok %d iterations: %d verified, %d rejected with a status\n", iterations, ok_count, err_count);
    return 0;
}
