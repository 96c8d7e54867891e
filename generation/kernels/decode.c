/* Host (CPU) kernels of the built-in engine's decode, float32.
 *
 * A decode step of a small model is ~110 tensor ops of a few microseconds of arithmetic each; on
 * the CPU their dispatch and threading overhead, not their FLOPs, is the step's cost (issue 30).
 * lm_decode_step runs a whole step in one call: embedding, then per layer RMSNorm, q/k/v, rotary,
 * attention over the KV cache (a prompt's keys/values shared by its rows), output projection and
 * the SiLU-gated MLP, then the final norm and the LM head; the matmuls go to the BLAS sgemm_ the
 * caller hands over (torch's MKL, threaded as torch set it for the calling thread). lm_sample_step
 * is the sampling step after it (log-softmax, Gumbel-max over counter-based noise, entropy,
 * bookkeeping). Callers
 * run shards of rows in parallel host threads (ctypes releases the GIL); nothing else here is
 * threaded. Loops are written for the compiler's vectoriser (-O3, -fopenmp-simd, gcc/clang vector
 * extensions); the exponential is Cephes' expf polynomial, which it can vectorise.
 * Built and loaded by generation/kernels/__init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;

/* 16 floats (one AVX-512 register, two AVX2 ones): gcc/clang vector extensions, lowered to what
 * -march=native has */
typedef float v16f __attribute__((vector_size(64)));
static inline v16f ld16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

#define EXP_LO -87.3365447505531f

/* exp(x) for x <= 0 (softmax arguments), 0 below EXP_LO: Cephes' expf polynomial, written so that
 * gcc vectorises it without -ffast-math (a select, not fmaxf; floorf) */
static inline float exp_neg(float x) {
    const float lo = EXP_LO;
    const float xc = x < lo ? lo : x;
    const float fn = floorf(xc * 1.44269504088896341f + 0.5f);
    const int32_t n = (int32_t)fn;
    float r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lo ? 0.0f : p * scale;
}

/* y[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * w  for rows r < n of width h */
static void rms_norm(const float *x, i64 xs, const float *w, float *y, i64 ys, i64 n, i64 h, float eps) {
    for (i64 r = 0; r < n; r++) {
        const float *xr = x + r * xs;
        float *yr = y + r * ys;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (i64 i = 0; i < h; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
        for (i64 i = 0; i < h; i++) yr[i] = (xr[i] * inv) * w[i];
    }
}

/* y[r, i] = silu(g[r, i]) * u[r, i] with g = gu[r, :m], u = gu[r, m:2m] */
static void silu_mul(const float *gu, i64 gs, float *y, i64 ys, i64 n, i64 m) {
    for (i64 r = 0; r < n; r++) {
        const float *g = gu + r * gs, *u = g + m;
        float *yr = y + r * ys;
#pragma omp simd
        for (i64 i = 0; i < m; i++) {
            const float a = g[i];
            /* sigmoid(a) = 1 / (1 + exp(-a)) = exp(a) / (1 + exp(a)): exp of -|a| either way */
            const float e = exp_neg(-fabsf(a));
            const float num = a >= 0.0f ? 1.0f : e;
            yr[i] = (a * (num / (1.0f + e))) * u[i];
        }
    }
}

/* o[j * D + d] = sum_t p[j * ps + t] * v[t * vst + d] for j < J (1 or 2), D a multiple of 16; the
 * sum over t split in two interleaved halves (four FMA chains), added at the end */
static void values16(const float *p, i64 ps, i64 J, i64 D, const float *v, i64 vst, i64 T, float *o) {
    const float *p1 = p + (J > 1 ? ps : 0);
    for (i64 db = 0; db < D; db += 16) {
        v16f a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};
        i64 t = 0;
        for (; t + 2 <= T; t += 2) {
            const v16f va = ld16(v + t * vst + db), vb = ld16(v + (t + 1) * vst + db);
            a0 += p[t] * va;
            a1 += p1[t] * va;
            b0 += p[t + 1] * vb;
            b1 += p1[t + 1] * vb;
        }
        if (t < T) {
            const v16f va = ld16(v + t * vst + db);
            a0 += p[t] * va;
            a1 += p1[t] * va;
        }
        st16(o + db, a0 + b0);
        if (J > 1) st16(o + D + db, a1 + b1);
    }
}

/* Up to 8 query vectors at once against one key matrix k [D, kst] (columns [0, T)):
 * s_i[t] = sum_d q_i[d] * k[d, t] for the queries q[i] (i < 8; missing ones point at zeros and write
 * to a spare row). Each key row is read once for all of them: the prompt part of a group's
 * attention, which its rows share. */
static void scores_x8(const float *const q[8], i64 D, const float *k, i64 kst, i64 T, float *const s[8]) {
    i64 t = 0;
    for (;;) {
        if (t + 16 > T) {
            if (t >= T || T < 16) break;
            t = T - 16;  /* the last partial block as the full block ending at T */
        }
        v16f a[8] = {{0}};
        for (i64 d = 0; d < D; d++) {
            const v16f kv = ld16(k + d * kst + t);
            for (int i = 0; i < 8; i++) a[i] += q[i][d] * kv;
        }
        for (int i = 0; i < 8; i++) st16(s[i] + t, a[i]);
        t += 16;
    }
    for (; t < T; t++)
        for (int i = 0; i < 8; i++) {
            float acc = 0.0f;
            for (i64 d = 0; d < D; d++) acc += q[i][d] * k[d * kst + t];
            s[i][t] = acc;
        }
}

/* o_i[d] += sum_t p_i[t] * v[t, d] for up to 8 probability rows p[i] (missing: zeros, spare output),
 * D a multiple of 16: each value row read once for all of them */
static void values_x8(const float *const p[8], i64 D, const float *v, i64 vst, i64 T, float *const o[8]) {
    for (i64 db = 0; db < D; db += 16) {
        v16f a[8] = {{0}};
        for (i64 t = 0; t < T; t++) {
            const v16f vv = ld16(v + t * vst + db);
            for (int i = 0; i < 8; i++) a[i] += p[i][t] * vv;
        }
        for (int i = 0; i < 8; i++) st16(o[i] + db, ld16(o[i] + db) + a[i]);
    }
}

/* The row pointers of queries [q0, q0 + 8) of nq for scores_x8/values_x8: row i of `in` (stride
 * is) and of `out` (stride ost); past nq, `in_pad` (zeros) and `out_pad` (a spare row) */
static void rows8(i64 q0, i64 nq, const float *in, i64 is, const float *in_pad, float *out, i64 ost,
                  float *out_pad, const float *ip[8], float *op[8]) {
    for (int i = 0; i < 8; i++) {
        ip[i] = q0 + i < nq ? in + (q0 + i) * is : in_pad;
        op[i] = q0 + i < nq ? out + (q0 + i) * ost : out_pad;
    }
}

/* s[t] (and s[ss + t] when J == 2) = sum_d q[d] * k(t, d) over the NB blocks of 16 columns of a
 * blocked key buffer k [NB, D, 16] (a block's keys transposed): one key row read for both heads */
static void scores_blocked(const float *q, i64 J, i64 D, const float *k, i64 NB, float *s, i64 ss) {
    const float *q1 = q + (J > 1 ? D : 0);
    for (i64 b = 0; b < NB; b++) {
        const float *kb = k + b * D * 16;
        v16f a0 = {0}, a1 = {0};
        for (i64 d = 0; d < D; d++) {
            const v16f kv = ld16(kb + d * 16);
            a0 += q[d] * kv;
            a1 += q1[d] * kv;
        }
        st16(s + b * 16, a0);
        if (J > 1) st16(s + ss + b * 16, a1);
    }
}

/* exp(x) for 16 floats x <= 0: Cephes' polynomial (as exp_neg), round-to-nearest by the 1.5 * 2^23
 * trick; 0 below EXP_LO */
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16f exp_neg16(v16f x) {
    const v16f lo = (v16f){0} + EXP_LO;
    const v16i small = x < lo;
    const v16f xc = (v16f)(((v16i)lo & small) | ((v16i)x & ~small));
    const v16f fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v16i n = __builtin_convertvector(fn, v16i);
    v16f r = xc - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v16f)((v16i)(p * (v16f)((n + 127) << 23)) & ~small);
}

/* s[t] <- exp(s[t] - max) over TP columns (a multiple of 16); returns 1 / sum */
static float softmax_unnormalised(float *s, i64 TP) {
    v16f m = ld16(s);
    for (i64 t = 16; t < TP; t += 16) {
        const v16f x = ld16(s + t);
        const v16i gt = x > m;
        m = (v16f)(((v16i)x & gt) | ((v16i)m & ~gt));
    }
    float mx = m[0];
    for (int i = 1; i < 16; i++) mx = m[i] > mx ? m[i] : mx;
    v16f acc = {0};
    for (i64 t = 0; t < TP; t += 16) {
        const v16f e = exp_neg16(ld16(s + t) - mx);
        st16(s + t, e);
        acc += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) sum += acc[i];
    return 1.0f / sum;
}

/* One layer's decode attention for rows [0, n) (the fused step's, float32, one thread).
 *
 * Rows with the same prompt (consecutive rows with equal prompt_of[r]: a group's samples) share
 * that prompt's keys and values, read once for all of them. A row attends over its prompt's P
 * columns (prompt keys [U, KV, D, P] with strides pks, values [U, KV, P, D] with strides pvs,
 * additive mask pmask [U, P] with row stride pms: the left padding) and its own completion columns
 * [0, ccol] (completion keys [rows, KV, NB, D, 16] with row/head strides cks: blocks of 16 columns,
 * each transposed; values [rows, KV, M, D] with row/head/column strides cvs). The step's key (with
 * rotary) and value are written at completion column ccol first.
 *
 * qkv [n, (H + 2KV) D] (row stride qs): q, k, v (the attention scale folded into q, or applied as
 * `scale`); rotary as the model's: x cos + rotate_half(x) sin with the cos/sin tables [Ptab, D] at
 * positions pos[r]; out [n, H D] (row stride os), head h = g (H / KV) + j for KV head g. scratch:
 * see attention_scratch_floats. D a multiple of 16. Returns 0, or -1 (nothing written) for a
 * position or prompt index out of range. */
#define RUN_ROWS 8
static i64 score_stride(i64 P, i64 C) {
    const i64 w = P + 16 * ((C + 15) / 16);
    return (w + 15) / 16 * 16;
}

static i64 attention_scratch_floats(i64 H, i64 KV, i64 D, i64 P, i64 ccol) {
    const i64 NQ = RUN_ROWS * (H / KV), SS = score_stride(P, ccol + 1);
    return NQ * SS + SS + 2 * NQ * D + (SS > D ? SS : D) + D + NQ;
}

static i64 decode_attention(const float *qkv, i64 qs, i64 H, i64 KV, i64 D,
                        const float *cos_t, const float *sin_t, i64 Ptab, const i64 *pos,
                        const float *pk, const i64 *pks, const float *pv, const i64 *pvs,
                        const float *pmask, i64 pms, i64 P, i64 U, const i64 *prompt_of,
                        float *ck, const i64 *cks, float *cv, const i64 *cvs, i64 ccol,
                        float scale, float *out, i64 os, i64 n, float *scratch) {
    const i64 G = H / KV, C = ccol + 1, T = P + C, NB = (C + 15) / 16, SS = score_stride(P, C);
    const i64 k_off = H * D, v_off = (H + KV) * D, half = D / 2;
    const i64 NQ = RUN_ROWS * G;              /* queries of a run of rows, for one KV head */
    float *s = scratch;                       /* [NQ, SS] scores, then exp(score - max) */
    float *spare = s + NQ * SS;               /* [SS] */
    float *qb = spare + SS;                   /* [NQ, D] rotated queries */
    float *zero = qb + NQ * D;                /* [max(SS, D)] zeros */
    float *ob = zero + (SS > D ? SS : D);     /* [NQ, D] outputs of the prompt columns */
    float *ospare = ob + NQ * D;              /* [D] */
    float *inv = ospare + D;                  /* [NQ] 1 / softmax sums */
    for (i64 i = 0; i < (SS > D ? SS : D); i++) zero[i] = 0.0f;
    for (i64 r = 0; r < n; r++)
        if (pos[r] < 0 || pos[r] >= Ptab || prompt_of[r] < 0 || prompt_of[r] >= U) return -1;
    const i64 wb = (ccol / 16) * D * 16 + ccol % 16;   /* the step's key column in a blocked buffer */
    for (i64 r0 = 0; r0 < n;) {
        const i64 u = prompt_of[r0];
        i64 L = 1;
        while (r0 + L < n && L < RUN_ROWS && prompt_of[r0 + L] == u) L++;
        const i64 nq = L * G;
        for (i64 g = 0; g < KV; g++) {
            /* rotary; the step's key and value into the completion cache; the run's queries */
            for (i64 i = 0; i < L; i++) {
                const i64 r = r0 + i;
                const float *row = qkv + r * qs;
                const float *c = cos_t + pos[r] * D, *sn = sin_t + pos[r] * D;
                float *kb = ck + r * cks[0] + g * cks[1] + wb;
                float *vb = cv + r * cvs[0] + g * cvs[1] + ccol * cvs[2];
                const float *k = row + k_off + g * D, *v = row + v_off + g * D;
                for (i64 d = 0; d < half; d++) {
                    kb[d * 16] = k[d] * c[d] + -k[d + half] * sn[d];
                    kb[(d + half) * 16] = k[d + half] * c[d + half] + k[d] * sn[d + half];
                }
                for (i64 d = 0; d < D; d++) vb[d] = v[d];
                for (i64 j = 0; j < G; j++) {
                    const float *q = row + (g * G + j) * D;
                    float *qj = qb + (i * G + j) * D;
                    for (i64 d = 0; d < half; d++) {
                        qj[d] = q[d] * c[d] + -q[d + half] * sn[d];
                        qj[d + half] = q[d + half] * c[d + half] + q[d] * sn[d + half];
                    }
                }
            }
            /* prompt columns: all the run's queries against the prompt's keys, 8 at a time */
            const float *pkg = pk + u * pks[0] + g * pks[1];
            for (i64 q0 = 0; q0 < nq; q0 += 8) {
                const float *qp[8];
                float *sp[8];
                rows8(q0, nq, qb, D, zero, s, SS, spare, qp, sp);
                scores_x8(qp, D, pkg, pks[2], P, sp);
            }
            /* completion columns: each row's own keys, whole blocks (columns past ccol are masked next) */
            for (i64 i = 0; i < L; i++) {
                const float *kb = ck + (r0 + i) * cks[0] + g * cks[1];
                for (i64 j = 0; j < G; j += 2)
                    scores_blocked(qb + (i * G + j) * D, G - j > 1 ? 2 : 1, D, kb, NB, s + (i * G + j) * SS + P, SS);
            }
            /* scale, the prompt's padding mask, nothing past the last column; exp(score - max) */
            const float *pm = pmask + u * pms;
            for (i64 qi = 0; qi < nq; qi++) {
                float *sq = s + qi * SS;
#pragma omp simd
                for (i64 t = 0; t < P; t++) sq[t] = sq[t] * scale + pm[t];
#pragma omp simd
                for (i64 t = P; t < T; t++) sq[t] = sq[t] * scale;
                for (i64 t = T; t < SS; t++) sq[t] = -INFINITY;
                inv[qi] = softmax_unnormalised(sq, SS);
            }
            /* values: the prompt's shared, then each row's own; normalised at the end */
            for (i64 i = 0; i < nq * D; i++) ob[i] = 0.0f;
            const float *pvg = pv + u * pvs[0] + g * pvs[1];
            for (i64 q0 = 0; q0 < nq; q0 += 8) {
                const float *pp[8];
                float *op[8];
                rows8(q0, nq, s, SS, zero, ob, D, ospare, pp, op);
                values_x8(pp, D, pvg, pvs[2], P, op);
            }
            for (i64 i = 0; i < L; i++) {
                const float *vb = cv + (r0 + i) * cvs[0] + g * cvs[1];
                float *o = out + (r0 + i) * os + g * G * D;
                for (i64 j = 0; j < G; j += 2) {
                    const i64 J = G - j > 1 ? 2 : 1;
                    values16(s + (i * G + j) * SS + P, SS, J, D, vb, cvs[2], C, o + j * D);
                    for (i64 jj = 0; jj < J; jj++) {
                        const float w = inv[i * G + j + jj];
                        float *oj = o + (j + jj) * D;
                        const float *pj = ob + (i * G + j + jj) * D;
#pragma omp simd
                        for (i64 d = 0; d < D; d++) oj[d] = (oj[d] + pj[d]) * w;
                    }
                }
            }
        }
        r0 += L;
    }
    return 0;
}

/* Fortran BLAS sgemm (torch's MKL exports it as sgemm_; its address is handed over by the caller) */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *,
                         const int *);

/* y[n, out] = x[n, in] (row stride xs) @ W[out, in]^T (+ beta * y) (+ bias), row-major */
static void linear(sgemm_fn gemm, i64 n, i64 out, i64 in, const float *x, i64 xs, const float *w,
                   const float *bias, float beta, float *y) {
    if (n == 0) return;
    const int m = (int)out, nn = (int)n, k = (int)in, lda = (int)in, ldb = (int)xs, ldc = (int)out;
    const float one = 1.0f;
    gemm("T", "N", &m, &nn, &k, &one, w, &lda, x, &ldb, &beta, y, &ldc);
    if (bias)
        for (i64 r = 0; r < n; r++)
#pragma omp simd
            for (i64 j = 0; j < out; j++) y[r * out + j] += bias[j];
}

enum { DIM_HIDDEN, DIM_HEADS, DIM_KV, DIM_HEAD, DIM_INTER, DIM_VOCAB, DIM_LAYERS, N_DIMS };
enum { W_EMBED, W_NORM, W_HEAD, W_HEAD_BIAS, N_GLOBAL };
enum { W_LN1, W_QKV, W_QKV_BIAS, W_O, W_LN2, W_GATE_UP, W_DOWN, N_PER_LAYER };

/* Floats of workspace lm_decode_step needs for n rows, P prompt columns, completion column ccol */
i64 lm_step_workspace(const i64 *dims, i64 n, i64 P, i64 ccol) {
    const i64 hd = dims[DIM_HIDDEN], H = dims[DIM_HEADS], KV = dims[DIM_KV], D = dims[DIM_HEAD];
    return 2 * n * hd + n * (H + 2 * KV) * D + n * H * D + 3 * n * dims[DIM_INTER]
           + attention_scratch_floats(H, KV, D, P, ccol);
}

/* One decode step of a Llama-family model (the fused decoder's weights) for rows [0, n): logits
 * [n, vocab] of the token after ids[r] at position pos[r]. dims: N_DIMS sizes; eps_scale: RMSNorm
 * eps and the attention scale (1 when folded into q); weights: N_GLOBAL pointers then N_PER_LAYER per
 * layer (q/k/v rows first in W_QKV; bias pointers may be NULL). The caches: per layer pointers pk, pv
 * (prompt keys/values, strides pks/pvs) and ck, cv (completion keys/values, strides cks/cvs), as
 * decode_attention. work: lm_step_workspace floats. Returns 0, or -1 (logits not written; the
 * caches may hold this step's column) for a token, position or prompt index out of range. */
i64 lm_decode_step(const i64 *dims, const float *eps_scale, const float *const *weights, void *sgemm,
                   const i64 *ids, const i64 *pos, i64 n, const float *cos_t, const float *sin_t, i64 Ptab,
                   const float *const *pk, const i64 *pks, const float *const *pv, const i64 *pvs,
                   const float *pmask, i64 pms, i64 P, i64 U, const i64 *prompt_of,
                   float *const *ck, const i64 *cks, float *const *cv, const i64 *cvs, i64 ccol,
                   float *logits, float *work) {
    const sgemm_fn gemm = (sgemm_fn)sgemm;
    const i64 hd = dims[DIM_HIDDEN], H = dims[DIM_HEADS], KV = dims[DIM_KV], D = dims[DIM_HEAD];
    const i64 inter = dims[DIM_INTER], vocab = dims[DIM_VOCAB], layers = dims[DIM_LAYERS];
    const i64 qkv_w = (H + 2 * KV) * D, qd = H * D;
    const float eps = eps_scale[0], scale = eps_scale[1];
    float *x = work, *h = x + n * hd, *qkv = h + n * hd, *att = qkv + n * qkv_w, *gu = att + n * qd;
    float *act = gu + 2 * n * inter, *scratch = act + n * inter;
    for (i64 r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= vocab) return -1;
        memcpy(x + r * hd, weights[W_EMBED] + ids[r] * hd, hd * sizeof(float));
    }
    for (i64 l = 0; l < layers; l++) {
        const float *const *w = weights + N_GLOBAL + l * N_PER_LAYER;
        rms_norm(x, hd, w[W_LN1], h, hd, n, hd, eps);
        linear(gemm, n, qkv_w, hd, h, hd, w[W_QKV], w[W_QKV_BIAS], 0.0f, qkv);
        if (decode_attention(qkv, qkv_w, H, KV, D, cos_t, sin_t, Ptab, pos, pk[l], pks, pv[l], pvs, pmask, pms,
                             P, U, prompt_of, ck[l], cks, cv[l], cvs, ccol, scale, att, qd, n, scratch))
            return -1;
        linear(gemm, n, hd, qd, att, qd, w[W_O], NULL, 1.0f, x);
        rms_norm(x, hd, w[W_LN2], h, hd, n, hd, eps);
        linear(gemm, n, 2 * inter, hd, h, hd, w[W_GATE_UP], NULL, 0.0f, gu);
        silu_mul(gu, 2 * inter, act, inter, n, inter);
        linear(gemm, n, hd, inter, act, inter, w[W_DOWN], NULL, 1.0f, x);
    }
    rms_norm(x, hd, weights[W_NORM], h, hd, n, hd, eps);
    linear(gemm, n, vocab, hd, h, hd, weights[W_HEAD], weights[W_HEAD_BIAS], 0.0f, logits);
    return 0;
}

/* splitmix64's finaliser: generation/sampler.py's _mix */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Upper bounds of the Gumbel noise g(u) = -log(-log u) per bucket of u: the noise's top GUMBEL_BITS
 * bits k put u below (k + 1) / 2^GUMBEL_BITS, so g(u) <= gumbel_ub[k] (g rises with u; the last
 * bucket is bounded by the largest u the hash yields). Filled once by lm_sampler_init. */
#define GUMBEL_BITS 12
static double gumbel_ub[1 << GUMBEL_BITS];

void lm_sampler_init(void) {
    const double umax = ((double)((1ull << 53) - 1) + 0.5) * 0x1p-53;
    for (int k = 0; k < (1 << GUMBEL_BITS); k++) {
        double u = (double)(k + 1) / (double)(1 << GUMBEL_BITS);
        if (u > umax) u = umax;
        gumbel_ub[k] = -log(-log(u)) + 1e-9; /* a margin over the rounding of the exact score */
    }
}

static inline uint64_t noise_hash(uint64_t h0, i64 v) {
    return mix64(h0 ^ ((uint64_t)(v + 1) * 0xD1B54A32D192ED03ull));
}

static inline double gumbel_score(float lp, uint64_t h) {
    const double u = ((double)(h >> 11) + 0.5) * 0x1p-53;
    return (double)lp - log(-log(u));
}

/* The sampling step of rows [0, n) (batch rows rows[i]) at response position t: log-softmax of
 * logits[i] / temp, the token argmax(logp + g) with the Gumbel noise g = -log(-log u) of
 * generation/sampler.py (u a pure function of the row's noise key keys[rows[i]], t and the
 * vocabulary index: the same hash, the same doubles), entropy -sum p log p. Rows not yet done get
 * their token, its log-prob and the entropy written to tokens[b, t], logps[b, t], ent_sum[b]; a row
 * that drew eos is done with lengths[b] = t + 1. next[i] = the drawn token (fed next step), keep[i]
 * = the row is not done. Returns the number of kept rows, or -1 (nothing written) when a row is
 * outside [0, B). scratch: 2 V floats.
 *
 * The draw is exact but skips the two logarithms wherever they cannot win: the most likely token's
 * score is a first lower bound of the maximum, and an index whose log-prob plus its bucket's noise
 * bound (gumbel_ub) stays below the best score so far cannot reach it; ties keep the lowest index,
 * as a full argmax does. With a large vocabulary this is most of the step's sampling cost. */
i64 lm_sample_step(const float *logits, i64 ls, i64 n, i64 V, float temp,
                   const i64 *keys, const i64 *rows, i64 B, i64 t, i64 eos, i64 M,
                   i64 *tokens, float *logps, float *ent_sum, i64 *lengths, uint8_t *done,
                   i64 *next, uint8_t *keep, float *scratch) {
    i64 kept = 0;
    for (i64 i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= B) return -1;
    for (i64 i = 0; i < n; i++) {
        const float *x = logits + i * ls;
        const uint64_t h0 = mix64((uint64_t)keys[rows[i]] + (uint64_t)(t + 1) * 0x9E3779B97F4A7C15ull);
        float *y = scratch;
        float mx = -INFINITY;
        for (i64 v = 0; v < V; v++) {
            y[v] = x[v] / temp;
            mx = y[v] > mx ? y[v] : mx;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (i64 v = 0; v < V; v++) sum += exp_neg(y[v] - mx);
        const float lse = logf(sum);
        float *pr = scratch + V;
#pragma omp simd
        for (i64 v = 0; v < V; v++) {
            y[v] = (y[v] - mx) - lse;
            pr[v] = exp_neg(y[v]);
        }
        float ent = 0.0f; /* summed in index order */
        i64 top = 0;
        for (i64 v = 0; v < V; v++) {
            if (pr[v] > 0.0f) ent -= pr[v] * y[v];
            if (y[v] > y[top]) top = v;
        }
        i64 best = top;
        double best_score = gumbel_score(y[top], noise_hash(h0, top));
        for (i64 v = 0; v < V; v++) {
            const uint64_t h = noise_hash(h0, v);
            if ((double)y[v] + gumbel_ub[h >> (64 - GUMBEL_BITS)] < best_score) continue;
            const double sc = gumbel_score(y[v], h);
            if (sc > best_score || (sc == best_score && v < best)) { best_score = sc; best = v; }
        }
        next[i] = best;
        const i64 b = rows[i];
        if (!done[b]) {
            tokens[b * M + t] = best;
            logps[b * M + t] = y[best];
            ent_sum[b] += ent;
            if (best == eos) { lengths[b] = t + 1; done[b] = 1; }
        }
        keep[i] = !done[b];
        kept += keep[i];
    }
    return kept;
}
