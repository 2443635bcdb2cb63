/* Batch checks of chunk blobs (docs/FORMAT.md) for kvstore.format.chunk_batch: one call for N
 * chunks, no Python per chunk.
 *
 * Per blob, in the order kvstore/format/chunk_batch.py's Python reference applies them (so both
 * give the same status for every blob): the fixed header's sanity checks (chunk.read_header), the
 * xxh3-64 checksum (chunk.verify_checksum), the header's claims (key, layout, start, token count)
 * against what the caller expects, and optionally the key recomputed from the blob's own token ids
 * (keys.chunk_key_raw: a chained xxh3-128). A valid blob is then optionally copied into the
 * caller's buffer. The checksum is computed over the source first, which brings the blob into
 * cache, and the copy then streams it from cache to the destination with non-temporal stores: one
 * pass over memory, about the cost of one memcpy (a copy first and a hash of the copy after costs
 * the hash on top). So the source must not change during the call (tier values are immutable
 * objects or a read transaction's snapshot); a blob that fails leaves its slot untouched.
 *
 *   check(blobs, keys, layout_ids, starts, token_count, namespace, parents,
 *         dest, dest_offsets, slot_sizes, status, nthreads) -> None
 *   check_packed(buf, offsets, lengths, <the same from keys on>) -> None
 *
 * blobs: a list of buffers or None (a miss); or one buffer with int64 offsets and lengths. keys,
 * layout_ids: N x 16 bytes; starts: int64 [N]; parents: N x 16 bytes, or None to skip the key
 * recomputation (namespace is then ignored); dest: a writable buffer or None, dest_offsets and
 * slot_sizes int64 [N] (slot_sizes may be None: to the end of dest); status: uint8 [N], written.
 * The GIL is released for the pass; blobs are split over nthreads pthreads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#include "vendor/xxh_x86dispatch.c" /* XXH3 kernels chosen at run time: SSE2, AVX2 or AVX512 */
#define HASH64 XXH3_64bits_dispatch
#define UPDATE128 XXH3_128bits_update_dispatch
#define HAVE_STREAM_STORES 1
#else
#define XXH_INLINE_ALL
#include "vendor/xxhash.h" /* NEON and the like are chosen at compile time */
#define HASH64 XXH3_64bits
#define UPDATE128 XXH3_128bits_update
#define HAVE_STREAM_STORES 0
#endif

/* Must match kvstore/format/chunk_batch.py's Status. */
enum { VALID = 0, MISSING, TRUNCATED, OVERSIZED, BAD_MAGIC, BAD_VERSION, MALFORMED, CHECKSUM, CLAIM, KEY,
       NO_ROOM };

#define HEADER_BYTES 72
#define SECTION_BYTES 16
#define CHECKSUM_BYTES 8
#define KEY_BYTES 16
#define VERSION 1
#define MAX_CHUNK_BYTES (1ULL << 31)
static const char DOMAIN_TAG[] = "kvstore.chunk.v1"; /* + its NUL: keys.py's _DOMAIN, 17 bytes */

static inline uint64_t rd(const uint8_t *p, int n) { /* little-endian, whatever the host */
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

typedef struct {
    const uint8_t *p; /* NULL: a miss */
    uint64_t n;
} src_t;

typedef struct {
    const src_t *src;
    const uint8_t *keys, *layouts, *parents, *ns;
    const int64_t *starts, *offsets, *slots;
    uint64_t token_count, ns_len;
    uint8_t *dest, *status;
    uint64_t dest_len;
    Py_ssize_t b0, b1;
} job_t;

/* chunk.read_header's checks, in its order. */
static int header_status(const uint8_t *p, uint64_t n) {
    if (n < HEADER_BYTES + CHECKSUM_BYTES) return TRUNCATED;
    if (memcmp(p, "KVCK", 4) != 0) return BAD_MAGIC;
    if (rd(p + 4, 2) != VERSION) return BAD_VERSION;
    uint64_t header_bytes = rd(p + 6, 2), total = rd(p + 8, 4), n_tok = rd(p + 12, 4);
    uint64_t tokens_offset = rd(p + 56, 4), n_sections = rd(p + 60, 2), compressible = rd(p + 64, 4);
    if (total > MAX_CHUNK_BYTES) return OVERSIZED;
    if (n < total) return TRUNCATED;
    if (n > total) return OVERSIZED;
    if (header_bytes < HEADER_BYTES + SECTION_BYTES * n_sections) return MALFORMED;
    if (tokens_offset + 4 * n_tok > total - CHECKSUM_BYTES) return MALFORMED;
    if (tokens_offset < header_bytes) return MALFORMED;
    if (!(header_bytes <= compressible && compressible <= tokens_offset)) return MALFORMED;
    return VALID;
}

/* keys.chunk_key_raw: xxh3-128(domain, layout id, u16 len(ns), ns, parent, token ids), canonical bytes. */
static void chunk_key(const job_t *j, const uint8_t *layout, const uint8_t *parent, const uint8_t *ids,
                      uint64_t ids_len, uint8_t out[KEY_BYTES]) {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    uint8_t ns_len[2] = {(uint8_t)(j->ns_len & 0xFF), (uint8_t)(j->ns_len >> 8)};
    XXH3_128bits_reset(&st);
    UPDATE128(&st, DOMAIN_TAG, sizeof DOMAIN_TAG);
    UPDATE128(&st, layout, KEY_BYTES);
    UPDATE128(&st, ns_len, 2);
    UPDATE128(&st, j->ns, (size_t)j->ns_len);
    UPDATE128(&st, parent, KEY_BYTES);
    UPDATE128(&st, ids, (size_t)ids_len);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    memcpy(out, c.digest, KEY_BYTES);
}

/* Copy a blob just hashed (so in cache) to memory that is read next by another process or a
 * device: non-temporal stores skip reading the destination's lines in first. */
static void stream_copy(uint8_t *d, const uint8_t *s, uint64_t n) {
#if HAVE_STREAM_STORES
    if (n >= 4096) {
        while (((uintptr_t)d & 15) && n) { *d++ = *s++; n--; }
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
    }
#endif
    memcpy(d, s, (size_t)n);
}

static int blob_status(const job_t *j, Py_ssize_t i) {
    const uint8_t *p = j->src[i].p;
    uint64_t n = j->src[i].n;
    if (p == NULL) return MISSING;
    int st = header_status(p, n);
    if (st != VALID) return st;
    if (HASH64(p, (size_t)(n - CHECKSUM_BYTES)) != rd(p + n - CHECKSUM_BYTES, 8)) return CHECKSUM;
    const uint8_t *key = j->keys + KEY_BYTES * i, *layout = j->layouts + KEY_BYTES * i;
    uint64_t n_tok = rd(p + 12, 4), tokens_offset = rd(p + 56, 4);
    if (memcmp(p + 40, key, KEY_BYTES) != 0 || memcmp(p + 24, layout, KEY_BYTES) != 0 ||
        rd(p + 16, 8) != (uint64_t)j->starts[i] || n_tok != j->token_count)
        return CLAIM;
    if (j->parents != NULL) {
        uint8_t want[KEY_BYTES];
        chunk_key(j, layout, j->parents + KEY_BYTES * i, p + tokens_offset, 4 * n_tok, want);
        if (memcmp(want, key, KEY_BYTES) != 0) return KEY;
    }
    if (j->dest != NULL) {
        uint64_t off = (uint64_t)j->offsets[i];
        uint64_t room = off > j->dest_len ? 0 : j->dest_len - off;
        if (j->slots != NULL && (uint64_t)j->slots[i] < room) room = (uint64_t)j->slots[i];
        if (n > room) return NO_ROOM;
        stream_copy(j->dest + off, p, n);
    }
    return VALID;
}

static void *worker(void *arg) {
    job_t *j = arg;
    for (Py_ssize_t i = j->b0; i < j->b1; i++) j->status[i] = (uint8_t)blob_status(j, i);
#if HAVE_STREAM_STORES
    _mm_sfence(); /* the streamed stores are visible before the caller hands the buffer on */
#endif
    return NULL;
}

static void run(job_t *base, Py_ssize_t n, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 16) nthreads = 16;
    if (nthreads > n) nthreads = n > 0 ? (int)n : 1;
    job_t jobs[16];
    pthread_t th[16];
    int started[16] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = *base;
        jobs[t].b0 = n * t / nthreads;
        jobs[t].b1 = n * (t + 1) / nthreads;
        if (t > 0) started[t] = pthread_create(&th[t], NULL, worker, &jobs[t]) == 0;
        if (t > 0 && !started[t]) worker(&jobs[t]); /* no thread to be had: do its share here */
    }
    worker(&jobs[0]);
    for (int t = 1; t < nthreads; t++)
        if (started[t]) pthread_join(th[t], NULL);
    Py_END_ALLOW_THREADS
}

/* A read-only (or, with writable, a writable) contiguous buffer of at least min_len bytes, or NULL
 * for None when none_ok; -1 with an exception set on failure. */
static int get_buf(PyObject *o, Py_buffer *b, int writable, Py_ssize_t min_len, int none_ok, const char *what) {
    b->obj = NULL;
    b->buf = NULL;
    b->len = 0;
    if (o == Py_None) {
        if (none_ok) return 0;
        PyErr_Format(PyExc_TypeError, "%s must not be None", what);
        return -1;
    }
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (b->len < min_len) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, b->len, min_len);
        PyBuffer_Release(b);
        b->obj = NULL;
        return -1;
    }
    return 0;
}

static void release(Py_buffer *b) {
    if (b->obj != NULL) PyBuffer_Release(b);
}

/* The arguments after the blobs, shared by check and check_packed: parsed into *j, their buffers
 * in bufs[0..7] (released by the caller whatever happens). */
static int parse_rest(PyObject *const *a, Py_ssize_t n, job_t *j, Py_buffer bufs[8], int *nthreads) {
    /* a: keys, layout_ids, starts, token_count, namespace, parents, dest, dest_offsets, slot_sizes,
     * status, nthreads */
    memset(bufs, 0, 8 * sizeof(Py_buffer));
    if (get_buf(a[0], &bufs[0], 0, KEY_BYTES * n, 0, "keys") < 0) return -1;
    if (get_buf(a[1], &bufs[1], 0, KEY_BYTES * n, 0, "layout_ids") < 0) return -1;
    if (get_buf(a[2], &bufs[2], 0, 8 * n, 0, "starts") < 0) return -1;
    unsigned long long token_count = PyLong_AsUnsignedLongLong(a[3]);
    if (PyErr_Occurred()) return -1;
    if (get_buf(a[5], &bufs[4], 0, KEY_BYTES * n, 1, "parents") < 0) return -1;
    if (bufs[4].obj != NULL && get_buf(a[4], &bufs[3], 0, 0, 0, "namespace") < 0) return -1;
    if (bufs[3].len > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "namespace is over 65535 bytes");
        return -1;
    }
    if (get_buf(a[6], &bufs[5], 1, 0, 1, "dest") < 0) return -1;
    if (bufs[5].obj != NULL) {
        if (get_buf(a[7], &bufs[6], 0, 8 * n, 0, "dest_offsets") < 0) return -1;
        if (get_buf(a[8], &bufs[7], 0, 8 * n, 1, "slot_sizes") < 0) return -1;
        const int64_t *off = bufs[6].buf, *slot = bufs[7].buf;
        for (Py_ssize_t i = 0; i < n; i++)
            if (off[i] < 0 || (slot != NULL && slot[i] < 0)) {
                PyErr_SetString(PyExc_ValueError, "dest offsets and slot sizes must be >= 0");
                return -1;
            }
    }
    *nthreads = (int)PyLong_AsLong(a[10]);
    if (PyErr_Occurred()) return -1;
    *j = (job_t){.keys = bufs[0].buf, .layouts = bufs[1].buf, .starts = bufs[2].buf, .ns = bufs[3].buf,
                 .ns_len = (uint64_t)bufs[3].len, .parents = bufs[4].buf, .dest = bufs[5].buf,
                 .dest_len = (uint64_t)bufs[5].len, .offsets = bufs[6].buf, .slots = bufs[7].buf,
                 .token_count = token_count};
    return 0;
}

static PyObject *finish(PyObject *status_obj, job_t *j, Py_ssize_t n, int nthreads, Py_buffer bufs[8]) {
    Py_buffer st;
    PyObject *ret = NULL;
    if (get_buf(status_obj, &st, 1, n, 0, "status") == 0) {
        j->status = st.buf;
        run(j, n, nthreads);
        release(&st);
        ret = Py_None;
        Py_INCREF(ret);
    }
    for (int k = 0; k < 8; k++) release(&bufs[k]);
    return ret;
}

static PyObject *py_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "check takes 12 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "blobs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    src_t *src = PyMem_Calloc(n ? n : 1, sizeof(src_t));
    Py_buffer bufs[8];
    PyObject *ret = NULL;
    job_t j;
    int nthreads;
    if (views == NULL || src == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; got < n; got++) {
        if (items[got] == Py_None) continue;
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_SIMPLE) < 0) goto out; /* contiguous, or raises */
        src[got] = (src_t){views[got].buf, (uint64_t)views[got].len};
    }
    if (parse_rest(args + 1, n, &j, bufs, &nthreads) < 0) {
        for (int k = 0; k < 8; k++) release(&bufs[k]);
        goto out;
    }
    j.src = src;
    ret = finish(args[10], &j, n, nthreads, bufs);
out:
    for (Py_ssize_t i = 0; i < got; i++)
        if (items[i] != Py_None) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(src);
    Py_DECREF(seq);
    return ret;
}

static PyObject *py_check_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "check_packed takes 14 arguments");
        return NULL;
    }
    Py_buffer buf, offs, lens, bufs[8];
    PyObject *ret = NULL;
    if (get_buf(args[0], &buf, 0, 0, 0, "buffer") < 0) return NULL;
    if (get_buf(args[1], &offs, 0, 0, 0, "offsets") < 0) {
        release(&buf);
        return NULL;
    }
    Py_ssize_t n = offs.len / 8;
    src_t *src = NULL;
    if (get_buf(args[2], &lens, 0, 8 * n, 0, "lengths") < 0) goto out2;
    src = PyMem_Calloc(n ? n : 1, sizeof(src_t));
    if (src == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    const int64_t *o = offs.buf, *l = lens.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || l[i] < 0 || o[i] > buf.len || l[i] > buf.len - o[i]) {
            PyErr_Format(PyExc_ValueError, "blob %zd: [%lld, +%lld) is outside the %zd-byte buffer", i,
                         (long long)o[i], (long long)l[i], buf.len);
            goto out;
        }
        src[i] = (src_t){(const uint8_t *)buf.buf + o[i], (uint64_t)l[i]};
    }
    job_t j;
    int nthreads;
    if (parse_rest(args + 3, n, &j, bufs, &nthreads) < 0) {
        for (int k = 0; k < 8; k++) release(&bufs[k]);
        goto out;
    }
    j.src = src;
    ret = finish(args[12], &j, n, nthreads, bufs);
out:
    release(&lens);
out2:
    PyMem_Free(src);
    release(&offs);
    release(&buf);
    return ret;
}

/* addresses(blobs, out): the address of each blob's first byte into out (uint64 [N]; 0 for None), as the
 * buffer protocol gives it: what a cross-process write (kvstore/transport/cma.py) names as its sources. */
static PyObject *py_addresses(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "addresses takes 2 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "blobs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer out;
    if (get_buf(args[1], &out, 1, 8 * n, 0, "out") < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    uint64_t *addr = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        addr[i] = 0;
        if (items[i] == Py_None) continue;
        Py_buffer v;
        if (PyObject_GetBuffer(items[i], &v, PyBUF_SIMPLE) < 0) {
            release(&out);
            Py_DECREF(seq);
            return NULL;
        }
        addr[i] = (uint64_t)(uintptr_t)v.buf; /* valid while the blob lives: the caller holds it */
        PyBuffer_Release(&v);
    }
    release(&out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* ---- engine page blobs (kvstore/format/page.py, docs/FORMAT.md section 6) ----
 *
 *   check_pages(blobs, keys, layout_id, namespace, groups, block_bytes, codes_end, status, nthreads)
 *
 * What kvstore/store/engine_pages.py's page_matches applies to one blob, for N blobs of one layout and
 * namespace in one call with the GIL released: page.read_header's checks, the header against the
 * layout and its group (page._of_layout), the key recomputed from namespace, group and block hash
 * (page.page_key) equal to the blob's and to the key asked for (keys: N x 16 bytes), the xxh3-64
 * checksum. groups, block_bytes, codes_end: int64 [G], the layout's groups. status: uint8 [N],
 * written: 0 for a match, 1 for anything else (a miss, as page_matches answers False). */
#define PAGE_HEADER_BYTES 64
#define PAGE_VERSION 2
#define PAGE_MAX_HASH 64
static const char PAGE_DOMAIN[16] = "kvstore.page.v2"; /* + its NUL: page.py's _DOMAIN, 16 bytes */

typedef struct {
    const src_t *src;
    const uint8_t *keys, *layout, *ns;
    const int64_t *groups, *block_bytes, *codes_end;
    uint64_t ns_len;
    Py_ssize_t n_groups, b0, b1;
    uint8_t *status;
} page_job_t;

static int page_ok(const page_job_t *j, Py_ssize_t i) {
    const uint8_t *p = j->src[i].p;
    uint64_t n = j->src[i].n;
    if (p == NULL || n < PAGE_HEADER_BYTES + CHECKSUM_BYTES) return 0;
    if (memcmp(p, "KVPG", 4) != 0 || rd(p + 4, 2) != PAGE_VERSION) return 0;
    uint64_t hb = rd(p + 6, 2), total = rd(p + 8, 4), block = rd(p + 12, 4), group = rd(p + 48, 4);
    uint64_t hash_len = rd(p + 52, 2), comp = rd(p + 56, 4);
    if (hash_len == 0 || hash_len > PAGE_MAX_HASH || hb != ((PAGE_HEADER_BYTES + hash_len + 15) & ~(uint64_t)15))
        return 0;
    if (total != n || total != hb + block + CHECKSUM_BYTES || !(hb <= comp && comp <= hb + block)) return 0;
    if (memcmp(p + 16, j->layout, KEY_BYTES) != 0) return 0;
    Py_ssize_t g = 0;
    while (g < j->n_groups && (uint64_t)j->groups[g] != group) g++;
    if (g == j->n_groups || (uint64_t)j->block_bytes[g] != block || comp != hb + (uint64_t)j->codes_end[g]) return 0;
    if (memcmp(p + 32, j->keys + KEY_BYTES * i, KEY_BYTES) != 0) return 0; /* not the block asked for */
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    uint8_t ns_len[2] = {(uint8_t)(j->ns_len & 0xFF), (uint8_t)(j->ns_len >> 8)};
    uint8_t grp[4] = {(uint8_t)group, (uint8_t)(group >> 8), (uint8_t)(group >> 16), (uint8_t)(group >> 24)};
    uint8_t hl[2] = {(uint8_t)hash_len, (uint8_t)(hash_len >> 8)};
    XXH3_128bits_reset(&st);
    UPDATE128(&st, PAGE_DOMAIN, sizeof PAGE_DOMAIN);
    UPDATE128(&st, j->layout, KEY_BYTES);
    UPDATE128(&st, ns_len, 2);
    UPDATE128(&st, j->ns, (size_t)j->ns_len);
    UPDATE128(&st, grp, 4);
    UPDATE128(&st, hl, 2);
    UPDATE128(&st, p + PAGE_HEADER_BYTES, (size_t)hash_len);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    if (memcmp(c.digest, p + 32, KEY_BYTES) != 0) return 0; /* the key is not its namespace's, group's, hash's */
    return HASH64(p, (size_t)(n - CHECKSUM_BYTES)) == rd(p + n - CHECKSUM_BYTES, 8);
}

static void *page_worker(void *arg) {
    page_job_t *j = arg;
    for (Py_ssize_t i = j->b0; i < j->b1; i++) j->status[i] = page_ok(j, i) ? 0 : 1;
    return NULL;
}

static PyObject *py_check_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "check_pages takes 9 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "blobs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    src_t *src = PyMem_Calloc(n ? n : 1, sizeof(src_t));
    Py_buffer b[7];
    memset(b, 0, sizeof b);
    PyObject *ret = NULL;
    if (views == NULL || src == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; got < n; got++) {
        if (items[got] == Py_None) continue;
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_SIMPLE) < 0) goto out;
        src[got] = (src_t){views[got].buf, (uint64_t)views[got].len};
    }
    if (get_buf(args[1], &b[0], 0, KEY_BYTES * n, 0, "keys") < 0) goto out;
    if (get_buf(args[2], &b[1], 0, KEY_BYTES, 0, "layout_id") < 0) goto out;
    if (get_buf(args[3], &b[2], 0, 0, 0, "namespace") < 0) goto out;
    if (b[2].len > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "namespace is over 65535 bytes");
        goto out;
    }
    if (get_buf(args[4], &b[3], 0, 0, 0, "groups") < 0) goto out;
    Py_ssize_t ng = b[3].len / 8;
    if (get_buf(args[5], &b[4], 0, 8 * ng, 0, "block_bytes") < 0) goto out;
    if (get_buf(args[6], &b[5], 0, 8 * ng, 0, "codes_end") < 0) goto out;
    if (get_buf(args[7], &b[6], 1, n, 0, "status") < 0) goto out;
    int nthreads = (int)PyLong_AsLong(args[8]);
    if (PyErr_Occurred()) goto out;
    page_job_t base = {.src = src, .keys = b[0].buf, .layout = b[1].buf, .ns = b[2].buf, .ns_len = (uint64_t)b[2].len,
                       .groups = b[3].buf, .block_bytes = b[4].buf, .codes_end = b[5].buf, .n_groups = ng,
                       .status = b[6].buf};
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 16) nthreads = 16;
    if (nthreads > n) nthreads = n > 0 ? (int)n : 1;
    page_job_t jobs[16];
    pthread_t th[16];
    int started[16] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = base;
        jobs[t].b0 = n * t / nthreads;
        jobs[t].b1 = n * (t + 1) / nthreads;
        if (t > 0) started[t] = pthread_create(&th[t], NULL, page_worker, &jobs[t]) == 0;
        if (t > 0 && !started[t]) page_worker(&jobs[t]);
    }
    page_worker(&jobs[0]);
    for (int t = 1; t < nthreads; t++)
        if (started[t]) pthread_join(th[t], NULL);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
out:
    for (int k = 0; k < 7; k++) release(&b[k]);
    for (Py_ssize_t i = 0; i < got; i++)
        if (items[i] != Py_None) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(src);
    Py_DECREF(seq);
    return ret;
}

static PyMethodDef methods[] = {
    {"check_pages", (PyCFunction)(void (*)(void))py_check_pages, METH_FASTCALL,
     "Check a batch of engine page blobs of one layout and namespace."},
    {"addresses", (PyCFunction)(void (*)(void))py_addresses, METH_FASTCALL,
     "The address of each blob's first byte."},
    {"check", (PyCFunction)(void (*)(void))py_check, METH_FASTCALL, "Check (and copy) a batch of chunk blobs."},
    {"check_packed", (PyCFunction)(void (*)(void))py_check_packed, METH_FASTCALL,
     "Check (and copy) chunk blobs lying in one buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chunks", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chunks(void) { return PyModule_Create(&module); }
