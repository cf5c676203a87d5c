/*
 * verifier.h - localspec's lossless speculative-decoding verifier (public C API).
 *
 * One tree representation serves chains, K paths and trees:
 *   tokens[n], parents[n]   node j's token and parent (-1 = the committed prefix, the "root");
 *                           parents come before children, siblings in the order they were sampled.
 *   target_logits[n+1][V]   row 0: target logits after the committed prefix, row j+1: after node j.
 *   draft_probs[n+1][V]     row 0: the distribution the root's children were sampled from,
 *                           row j+1: the one node j's children were sampled from (unused for leaves).
 * Rows are addressed internally by "row id": 0 = root, j+1 = node j.
 *
 * Randomness: n+1 uniforms in [0,1) supplied by the caller, or drawn from `seed` (xoshiro256**).
 * Every method documents which uniform it reads, so that a reference implementation can be
 * compared with this one draw for draw:
 *   u[j]  the accept/reject draw of node j (match: the target sample drawn at row j+1, u[0] at
 *         the root),
 *   u[n]  the draw of the final correction / bonus token.
 *
 * The target distribution of a row is the plain sampler's, in this order:
 *   1. the row's token mask, when masks != NULL (constrained decoding): disallowed tokens are
 *      removed, as if their logits were -inf; their logit values are never read as numbers
 *      (they may be anything, NaN and -inf included);
 *   2. top-k, then top-p, then min-p, all on the temperature-1 distribution of the allowed
 *      tokens (like llama.cpp's default chain);
 *   3. temperature, then renormalisation over the kept tokens; temperature 0 is greedy
 *      (one-hot on the lowest-id argmax among the allowed tokens).
 * Every method is lossless with respect to this (masked) target: a draft token its row's mask
 * forbids has target probability 0 and is never accepted; corrections and bonus tokens are drawn
 * from the masked target's residuals.
 *
 * No allocation: the caller passes a workspace of ls_workspace_bytes() bytes. No global state.
 */
#ifndef LOCALSPEC_VERIFIER_H
#define LOCALSPEC_VERIFIER_H

#include <stddef.h>
#include <stdint.h>

/* verification methods (names fixed by the API) */
#define LS_GREEDY 0    /* exact match against the target argmax, any tree */
#define LS_MATCH 1     /* sample-and-match (llama.cpp's behaviour), any tree */
#define LS_TOKEN 2     /* token verification (Leviathan/Chen; block paper Alg. 1), chain */
#define LS_BLOCK 3     /* block verification (Sun et al. Alg. 2, Eq. 4-5), chain */
#define LS_GBV 4       /* greedy multi-path block verification (Alg. 1, Eq. 19-23), K equal chains */
#define LS_RRS 5       /* recursive rejection sampling, i.i.d. siblings (traversal paper Alg. 2) */
#define LS_RRSW 6      /* RRS without replacement, siblings distinct */
#define LS_TRAVERSAL 7 /* traversal verification (Weng et al. Alg. 3), siblings distinct */
#define LS_BATCH 8     /* batch speculative decoding (Yin et al. Alg. 4), K chains */
#define LS_N_METHODS 9

/* status codes */
#define LS_OK 0
#define LS_ERR_ARGUMENT (-1)  /* null pointer, negative size, stride < n_vocab, mask_stride too small */
#define LS_ERR_TOKEN (-2)     /* token id outside [0, n_vocab); error_index = node */
#define LS_ERR_PARENT (-3)    /* parents[j] not in [-1, j); error_index = node */
#define LS_ERR_LOGITS (-4)    /* NaN or infinite target logit; error_index = row */
#define LS_ERR_DRAFT (-5)     /* draft row not a probability distribution; error_index = row */
#define LS_ERR_SHAPE (-6)     /* tree shape the method cannot verify; error_index = node or -1 */
#define LS_ERR_SIBLINGS (-7)  /* repeated sibling token where siblings must be distinct */
#define LS_ERR_SAMPLING (-8)  /* temperature/top-k/top-p/min-p out of range */
#define LS_ERR_UNIFORM (-9)   /* uniform outside [0,1) or NaN; error_index = slot */
#define LS_ERR_WORKSPACE (-10) /* workspace smaller than ls_workspace_bytes() */
#define LS_ERR_METHOD (-11)   /* unknown method id */
#define LS_ERR_LENIENCE (-12) /* lenience negative/non-finite, or used with a method other than token */
#define LS_ERR_MASK (-13)     /* a mask row allows no token; error_index = row */

typedef struct ls_sampling {
    float temperature; /* >= 0; 0 = greedy */
    int32_t top_k;     /* 0 = off */
    float top_p;       /* (0, 1]; 1 = off */
    float min_p;       /* [0, 1]; 0 = off */
} ls_sampling;

typedef struct ls_problem {
    int32_t n_nodes;
    int32_t n_vocab;
    const int32_t *tokens;
    const int32_t *parents;
    const float *target_logits; /* n_nodes+1 rows */
    int64_t target_stride;      /* floats between rows, >= n_vocab */
    const float *draft_probs;   /* n_nodes+1 rows; may be NULL when n_nodes == 0 */
    int64_t draft_stride;
    ls_sampling sampling;
    double lenience;            /* Yin et al. Thm 4 over-acceptance epsilon (token only); 0 = lossless;
                                 * never applied to a token the row's mask forbids */
    const double *uniforms;     /* n_nodes+1 values in [0,1), or NULL to draw them from seed */
    uint64_t seed;
    /* Optional token masks (NULL = unconstrained), n_nodes+1 rows with the row ids of
     * target_logits: row r allows token t iff bit (t % 32) of word (t / 32) is set; bits at
     * t >= n_vocab are ignored. Every row must allow at least one token (else LS_ERR_MASK). */
    const uint32_t *masks;
    int64_t mask_stride;        /* uint32 words between mask rows, >= (n_vocab + 31) / 32 */
} ls_problem;

typedef struct ls_verdict {
    int32_t n_accepted;  /* number of accepted draft nodes */
    int32_t token;       /* correction or bonus token */
    int32_t error_index; /* see status codes; -1 when not applicable */
    int32_t *path;       /* caller buffer of n_nodes entries: accepted node indices, root to leaf */
} ls_verdict;

/* Bytes of workspace ls_verify needs (with or without masks); 0 if the sizes are invalid. */
size_t ls_workspace_bytes(int32_t method, int32_t n_nodes, int32_t n_vocab, const ls_sampling *sampling);

/* Verify one speculative step. Returns LS_OK or a negative status; never aborts. */
int ls_verify(int32_t method, const ls_problem *problem, void *workspace, size_t workspace_bytes,
              ls_verdict *verdict);

/* Bytes of workspace ls_probs / ls_probs_masked need for rows of n_vocab entries. */
size_t ls_probs_workspace_bytes(int32_t n_vocab, const ls_sampling *sampling);

/* The plain sampler's distribution of each row (the transform ls_verify applies to the target),
 * written as float64 (out64) and/or float32 (out32), either may be NULL. On a bad row, returns
 * LS_ERR_LOGITS and sets *error_row. */
int ls_probs(const float *logits, int64_t stride, int32_t n_rows, int32_t n_vocab,
             const ls_sampling *sampling, void *workspace, size_t workspace_bytes,
             double *out64, float *out32, int64_t out_stride, int32_t *error_row);

/* ls_probs with optional token masks (NULL = none; layout as in ls_problem.masks, mask row r for
 * logits row r): the masked plain sampler's distribution, the one ls_verify uses as the target
 * (a drafter can draw from its own masked distribution with it). LS_ERR_MASK and *error_row
 * when a row allows no token; LS_ERR_ARGUMENT when mask_stride < (n_vocab + 31) / 32. */
int ls_probs_masked(const float *logits, int64_t stride, int32_t n_rows, int32_t n_vocab,
                    const uint32_t *masks, int64_t mask_stride, const ls_sampling *sampling,
                    void *workspace, size_t workspace_bytes, double *out64, float *out32,
                    int64_t out_stride, int32_t *error_row);

/* Inverse-CDF sample from a probability row, the tokens in `exclude` removed and the rest
 * renormalised (sampling without replacement). Returns LS_OK or LS_ERR_DRAFT (no mass left,
 * or a negative / non-finite entry) / LS_ERR_ARGUMENT / LS_ERR_UNIFORM. */
int ls_sample_probs(const float *probs, int32_t n_vocab, const int32_t *exclude, int32_t n_exclude,
                    double uniform, int32_t *token);

/* Static English description of a status code. */
const char *ls_status_string(int status);

/* llama.cpp's abort callback (ggml_abort_callback, set with llama_set_abort_callback): true once
 * the int32 that `flag` points to is nonzero (NULL: never). It takes no lock, so a decode running
 * on llama.cpp's threads checks it between graph nodes without Python's interpreter lock. */
_Bool ls_abort_requested(void *flag);

#endif
