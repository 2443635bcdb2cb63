/* Fused CPU kernels for the FP4 (E2M1) block formats of kvstore.format.quant.
 *
 * One pass over the input per block: amax, scale, true division, E2M1 round-to-nearest-even,
 * nibble packing. Bit-exact with the torch reference path in quant.py (both are tested against
 * ml_dtypes). The GIL is released and rows are split over a few pthreads.
 *
 *   quantize(src, src_kind, n_blocks, block, scale_kind, codes, scales, nthreads) -> bool ok
 *   dequantize(codes, scales, n_blocks, block, scale_kind, dst, dst_kind, nthreads) -> None
 *
 * Pointers are passed as integers (tensor.data_ptr()); the caller owns validation of sizes.
 * src_kind/dst_kind: 0 = float32, 1 = bfloat16. scale_kind: 0 = E4M3 (main KV), 1 = UE8M0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* Compiled for AVX2 and for the baseline; the loader picks the best the CPU has. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

static float e4m3_value[256];
static float e2m1_value[16];

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Round to nearest even integer for 0 <= x < 2^22 without a libm call: adding 2^23 leaves no
 * fraction bits, so the FPU's default rounding (nearest even) does the work. */
static inline float rne_int(float x) { return (x + 8388608.0f) - 8388608.0f; }

/* float32 (positive, <= 448, >= 2^-9) -> float8_e4m3fn bits, round to nearest even. */
static inline uint8_t e4m3_rne(float t) {
    if (t < 0.015625f) { /* subnormal: multiples of 2^-9; 2^-6 itself encodes as 0x08 */
        return (uint8_t)rne_int(t * 512.0f);
    }
    uint32_t b = f2u(t);
    b += 0x7FFFFu + ((b >> 20) & 1u); /* keep 3 mantissa bits, ties to even */
    uint32_t e = (b >> 23) - 127u + 7u;
    uint32_t m = (b >> 20) & 7u;
    return (uint8_t)((e << 3) | m);
}

/* y -> E2M1 code (sign in bit 3), |y| saturated at 6, round to nearest even. Branch-free so the
 * block loop vectorizes. */
static inline uint32_t e2m1_code(float y) {
    float v = fabsf(y);
    v = v > 6.0f ? 6.0f : v;
    uint32_t b = f2u(v);
    uint32_t normal = ((b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22) - 252u; /* v >= 1: 1 mantissa bit */
    uint32_t sub = (uint32_t)(int32_t)rne_int(v * 2.0f);                         /* v < 1: 0, 0.5, 1 */
    uint32_t mag = v < 1.0f ? sub : normal;
    return mag | ((f2u(y) >> 31) << 3);
}

typedef struct {
    const void *src; int src_kind; size_t b0, b1; int block; int scale_kind;
    uint8_t *codes; uint8_t *scales; int bad;
    void *dst; int dst_kind;
} job_t;

KERNEL static void *quant_worker(void *arg) {
    job_t *j = (job_t *)arg;
    const int B = j->block;
    float buf[32];
    uint32_t code[32];
    int bad = 0;
    for (size_t blk = j->b0; blk < j->b1; blk++) {
        size_t base = blk * (size_t)B;
        if (j->src_kind == 1) {
            const uint16_t *p = (const uint16_t *)j->src + base;
            for (int k = 0; k < B; k++) buf[k] = u2f((uint32_t)p[k] << 16);
        } else {
            memcpy(buf, (const float *)j->src + base, sizeof(float) * (size_t)B);
        }
        /* |x| as bits: for finite floats, integer order is value order. Exponent all ones = NaN/Inf. */
        int32_t abits = 0;
        for (int k = 0; k < B; k++) {
            int32_t a = (int32_t)(f2u(buf[k]) & 0x7FFFFFFFu);
            bad |= a >= 0x7F800000;
            abits = a > abits ? a : abits;
        }
        float amax = u2f((uint32_t)abits);
        float s;
        if (j->scale_kind == 0) {
            float a = amax > 0.01171875f ? amax : 0.01171875f; /* 6 * 2^-9 */
            float t = a / 6.0f;
            if (t > 448.0f) t = 448.0f;
            uint8_t sc = e4m3_rne(t);
            j->scales[blk] = sc;
            s = e4m3_value[sc];
        } else {
            float a = amax > 7.052966104933725e-38f ? amax : 7.052966104933725e-38f; /* 6 * 2^-126 */
            float t = a / 6.0f;
            uint32_t b = f2u(t);
            int e = (int)(b >> 23) - 127 + ((b & 0x7FFFFFu) != 0); /* ceil(log2 t), t normal */
            j->scales[blk] = (uint8_t)(e + 127);
            s = u2f((uint32_t)(e + 127) << 23);
        }
        for (int k = 0; k < B; k++) code[k] = e2m1_code(buf[k] / s); /* true division, as specified */
        uint8_t *out = j->codes + base / 2;
        for (int k = 0; k < B / 2; k++) out[k] = (uint8_t)(code[2 * k] | (code[2 * k + 1] << 4));
    }
    j->bad = bad;
    return NULL;
}

KERNEL static void *dequant_worker(void *arg) {
    job_t *j = (job_t *)arg;
    const int B = j->block;
    for (size_t blk = j->b0; blk < j->b1; blk++) {
        uint8_t sc = j->scales[blk];
        float s = j->scale_kind == 0 ? e4m3_value[sc] : u2f((uint32_t)sc << 23);
        const uint8_t *in = j->codes + blk * (size_t)B / 2;
        size_t base = blk * (size_t)B;
        if (j->dst_kind == 1) {
            uint16_t *o = (uint16_t *)j->dst + base;
            /* value * scale has <= 6 significant bits: exact in bf16, so truncation is exact. */
            for (int k = 0; k < B / 2; k++) {
                o[2 * k] = (uint16_t)(f2u(e2m1_value[in[k] & 15] * s) >> 16);
                o[2 * k + 1] = (uint16_t)(f2u(e2m1_value[in[k] >> 4] * s) >> 16);
            }
        } else {
            float *o = (float *)j->dst + base;
            for (int k = 0; k < B / 2; k++) {
                o[2 * k] = e2m1_value[in[k] & 15] * s;
                o[2 * k + 1] = e2m1_value[in[k] >> 4] * s;
            }
        }
    }
    return NULL;
}

static int run_jobs(job_t *proto, size_t n_blocks, int nthreads, void *(*fn)(void *)) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 16) nthreads = 16;
    if (n_blocks < 4096) nthreads = 1; /* thread start-up costs more than small inputs */
    job_t jobs[16];
    pthread_t th[16];
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = *proto;
        jobs[t].b0 = n_blocks * t / nthreads;
        jobs[t].b1 = n_blocks * (t + 1) / nthreads;
        jobs[t].bad = 0;
        if (t > 0) pthread_create(&th[t], NULL, fn, &jobs[t]);
    }
    fn(&jobs[0]);
    for (int t = 1; t < nthreads; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < nthreads; t++) bad |= jobs[t].bad;
    Py_END_ALLOW_THREADS
    return bad;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    unsigned long long src, codes, scales;
    Py_ssize_t n_blocks;
    int src_kind, block, scale_kind, nthreads;
    if (!PyArg_ParseTuple(args, "KiniiKKi", &src, &src_kind, &n_blocks, &block, &scale_kind, &codes,
                          &scales, &nthreads))
        return NULL;
    if (block != 16 && block != 32) {
        PyErr_SetString(PyExc_ValueError, "block must be 16 or 32");
        return NULL;
    }
    job_t j = {(const void *)src, src_kind, 0, 0, block, scale_kind, (uint8_t *)codes,
               (uint8_t *)scales, 0, NULL, 0};
    int bad = run_jobs(&j, (size_t)n_blocks, nthreads, quant_worker);
    return PyBool_FromLong(!bad);
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    unsigned long long codes, scales, dst;
    Py_ssize_t n_blocks;
    int block, scale_kind, dst_kind, nthreads;
    if (!PyArg_ParseTuple(args, "KKniiKii", &codes, &scales, &n_blocks, &block, &scale_kind, &dst,
                          &dst_kind, &nthreads))
        return NULL;
    if (block != 16 && block != 32) {
        PyErr_SetString(PyExc_ValueError, "block must be 16 or 32");
        return NULL;
    }
    job_t j = {NULL, 0, 0, 0, block, scale_kind, (uint8_t *)codes, (uint8_t *)scales, 0,
               (void *)dst, dst_kind};
    run_jobs(&j, (size_t)n_blocks, nthreads, dequant_worker);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"quantize", py_quantize, METH_VARARGS, "Fused FP4 block quantization (see module doc)."},
    {"dequantize", py_dequantize, METH_VARARGS, "Fused FP4 block dequantization."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp4", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fp4(void) {
    static const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int i = 0; i < 16; i++) e2m1_value[i] = (i & 8) ? -mags[i & 7] : mags[i & 7];
    for (int i = 0; i < 256; i++) {
        int e = (i >> 3) & 15, m = i & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if ((i & 0x7F) == 0x7F) v = NAN;
        e4m3_value[i] = (i & 0x80) ? -v : v;
    }
    return PyModule_Create(&module);
}
