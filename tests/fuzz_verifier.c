/*
 * fuzz_verifier.c - random valid and invalid inputs through every entry point of the verifier.
 * Built by tests/test_sanitizers.py with -fsanitize=address,undefined; exits non-zero when a
 * result breaks the API contract. Workspaces are malloc'ed at exactly the reported size so an
 * out-of-bounds access is caught.
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
        if (!logits || !draft || !tokens || !parents || !path || !u)
            return 2;
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
            }
        } else {
            err_count++;
            if (st < LS_ERR_LENIENCE || st > LS_ERR_ARGUMENT)
                fail("unknown status", it);
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
        const int pst = ls_probs(logits, V, (int32_t)rows, V, &s, pws, pbytes, o64, NULL, V, &err_row);
        if (pst == LS_OK) {
            for (size_t r = 0; r < rows; r++) {
                double sum = 0.0;
                for (int x = 0; x < V; x++)
                    sum += o64[r * (size_t)V + (size_t)x];
                if (fabs(sum - 1.0) > 1e-6)
                    fail("probs row does not sum to 1", it);
            }
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
    }
    printf("ok %d iterations: %d verified, %d rejected with a status\n", iterations, ok_count, err_count);
    return 0;
}
