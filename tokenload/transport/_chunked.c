/* The compiled core of `tokenload.transport.reader`: one chunked body read, de-chunked and counted in C.
 *
 * `ChunkedBody` is the read watcher's callback for one plain-HTTP, chunked,
 * undisplayed stream: each call is one `recvmsg` with the kernel's arrival stamp
 * (`SO_TIMESTAMPNS`, converted to the `perf_counter` clock), the chunk framing
 * decoded by a strict state machine (what llhttp accepts: CRLF line ends, hex
 * sizes, extensions, trailers), and the read's body bytes handed on. When the
 * session is between events (`StreamSession._aligned`) and every event of the
 * read has one of the stream's learned delta shapes (`tokenload.deltas`), the
 * tokens are written to the timeline here; anything else goes to
 * `StreamSession.on_data` unchanged, so the result is the pure-Python path's,
 * field for field (tests/test_load_chunked.py feeds both the same bytes).
 *
 * The end of the body, a reset, a framing error or an exception from the
 * session are reported once, through the `done` callable (None or the error).
 */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define READ_SIZE (64 * 1024)
#define PLAUSIBLE_S 60.0
#define MAX_BLOCKS 256
#ifndef SO_TIMESTAMPNS
#define SO_TIMESTAMPNS 35
#endif

/* One read buffer for the process: every call runs to its end holding the GIL. */
static char read_buf[READ_SIZE];
static PyObject *parse_error;                                   /* set by configure() */
static PyObject *s_aligned, *s_on_data, *s_timeline, *s_t_first_token, *s_t_first_text, *s_t_last_token,
    *s_chunk_times, *s_text_chunks, *s_thinking_chunks, *s_other_chunks;

enum state { SIZE_START, SIZE, EXT_NAME_START, EXT_NAME, EXT_VALUE_START, EXT_VALUE, EXT_QUOTED, EXT_ESCAPE, EXT_QUOTE_END,
             SIZE_LF, DATA, DATA_CR, DATA_LF, TRAILER_START, TRAILER_NAME, TRAILER_VALUE, TRAILER_LF, END_LF,
             DONE };

#define MAX_SHAPES 8 /* tokenload.deltas._MAX_SHAPES */

/* A learned delta shape, copied out of its Python tuple: matching touches only this object's memory. */
typedef struct {
    char *prefix, *suffix;
    Py_ssize_t head, tail;
    int kind; /* 0 text, 1 thinking, 2 other */
} Shape;

typedef struct {
    PyObject_HEAD
    int fd;
    PyObject *session;
    PyObject *shapes; /* the DeltaShapes' list, appended to by its learn() (inside on_data) */
    PyObject *blank;  /* tuple of bytes: numbers after these keys are ignored */
    PyObject *done;
    double last;
    int state;
    int finished;
    int aligned; /* session._aligned as of the last on_data */
    uint64_t remaining;
    char *body;
    Py_ssize_t body_len, body_cap;
    char *scratch;
    Py_ssize_t scratch_cap;
    Shape shape[MAX_SHAPES];
    int nshapes;
    /* Tokens counted here and not yet on the timeline (flush()): their stamps, counts by kind, first text. */
    double *pending;
    Py_ssize_t npending, pending_cap;
    Py_ssize_t counts[3];
    double first_text;
} ChunkedBody;

static double clock_s(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int grow(char **buf, Py_ssize_t *cap, Py_ssize_t need) {
    if (need <= *cap) return 0;
    Py_ssize_t size = *cap ? *cap : 4096;
    while (size < need) size *= 2;
    char *p = PyMem_Realloc(*buf, (size_t)size);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = p;
    *cap = size;
    return 0;
}

static int fail_framing(const char *what) {
    PyErr_Format(parse_error ? parse_error : PyExc_ValueError, "invalid chunked body: %s", what);
    return -1;
}

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* RFC 9110's token characters: extension and trailer names, unquoted extension values. */
static int is_tchar(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* The byte the state needs, and the state after it. */
#define EXPECT(byte, next, what)                       \
    if (c != (byte)) return fail_framing(what);        \
    self->state = (next);                              \
    break

/* Decode `data` into self->body (appended); -1 with an exception set on invalid framing.
 * As strict as llhttp (the pure path's parser): CRLF only, no spaces in sizes or extensions,
 * trailers as header lines, nothing but line ends after the last chunk. */
static int dechunk(ChunkedBody *self, const char *data, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)data[i];
        switch (self->state) {
        case SIZE_START:
        case SIZE: {
            int v = hex_value(c);
            if (v >= 0) {
                if (self->remaining > (UINT64_MAX >> 4)) return fail_framing("chunk size overflow");
                self->remaining = (self->remaining << 4) | (uint64_t)v;
                self->state = SIZE;
            } else if (self->state == SIZE && c == ';') {
                self->state = EXT_NAME_START;
            } else if (self->state == SIZE && c == '\r') {
                self->state = SIZE_LF;
            } else {
                return fail_framing("invalid character in chunk size");
            }
            break;
        }
        case EXT_NAME_START:
            if (!is_tchar(c)) return fail_framing("invalid chunk extension");
            self->state = EXT_NAME;
            break;
        case EXT_NAME:
        case EXT_VALUE_START:
        case EXT_VALUE:
        case EXT_QUOTE_END:
            if (c == ';') self->state = EXT_NAME_START;
            else if (c == '\r') self->state = SIZE_LF;
            else if (self->state == EXT_NAME && c == '=') self->state = EXT_VALUE_START;
            else if (self->state == EXT_VALUE_START && c == '"') self->state = EXT_QUOTED;
            else if (self->state == EXT_QUOTE_END || !is_tchar(c)) return fail_framing("invalid chunk extension");
            else if (self->state == EXT_VALUE_START) self->state = EXT_VALUE;
            break;
        case EXT_QUOTED:
            if (c == '"') self->state = EXT_QUOTE_END;
            else if (c == '\\') self->state = EXT_ESCAPE;
            else if (c < 0x20 && c != '\t') return fail_framing("invalid chunk extension");
            break;
        case EXT_ESCAPE:
            if (c < 0x20 && c != '\t') return fail_framing("invalid chunk extension");
            self->state = EXT_QUOTED;
            break;
        case SIZE_LF:
            EXPECT('\n', self->remaining ? DATA : TRAILER_START, "missing LF after chunk size");
        case DATA: {
            Py_ssize_t take = n - i;
            if ((uint64_t)take > self->remaining) take = (Py_ssize_t)self->remaining;
            if (grow(&self->body, &self->body_cap, self->body_len + take) < 0) return -1;
            memcpy(self->body + self->body_len, data + i, (size_t)take);
            self->body_len += take;
            self->remaining -= (uint64_t)take;
            i += take;
            if (self->remaining == 0) self->state = DATA_CR;
            continue;
        }
        case DATA_CR:
            EXPECT('\r', DATA_LF, "missing CR after chunk data");
        case DATA_LF:
            EXPECT('\n', SIZE_START, "missing LF after chunk data");
        case TRAILER_START:
            if (c == '\r') self->state = END_LF;
            else if (is_tchar(c)) self->state = TRAILER_NAME;
            else return fail_framing("invalid trailer");
            break;
        case TRAILER_NAME:
            if (c == ':') self->state = TRAILER_VALUE;
            else if (!is_tchar(c)) return fail_framing("invalid trailer");
            break;
        case TRAILER_VALUE:
            if (c == '\r') self->state = TRAILER_LF;
            else if (c < 0x20 && c != '\t') return fail_framing("invalid trailer");
            else if (c == 0x7f) return fail_framing("invalid trailer");
            break;
        case TRAILER_LF:
            EXPECT('\n', TRAILER_START, "missing LF after trailer");
        case END_LF:
            EXPECT('\n', DONE, "missing LF after last chunk");
        case DONE: /* another response would start here; none was asked for */
            if (c != '\r' && c != '\n') return fail_framing("bytes after the end of the body");
            break;
        }
        i++;
    }
    return 0;
}

/* A JSON string's body between its quotes, at least one character (tokenload.deltas._BODY). */
static int json_string_body(const unsigned char *p, Py_ssize_t n) {
    if (n <= 0) return 0;
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        if (c == '"' || c < 0x20) return 0;
        if (c != '\\') {
            i++;
            continue;
        }
        if (i + 1 >= n) return 0;
        unsigned char e = p[i + 1];
        if (e == 'u') {
            if (i + 6 > n) return 0;
            for (int k = 2; k < 6; k++)
                if (hex_value(p[i + k]) < 0) return 0;
            i += 6;
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
            i += 2;
        } else {
            return 0;
        }
    }
    return 1;
}

/* The kind (0 text, 1 thinking, 2 other) of one event's bytes when it has a learned shape, else -1; -2 on error. */
static int match(ChunkedBody *self, const char *block, Py_ssize_t size) {
    Py_ssize_t nblank = PyTuple_GET_SIZE(self->blank);
    if (nblank) { /* DeltaShapes._normalise: the digits after each ignored key removed */
        if (grow(&self->scratch, &self->scratch_cap, size) < 0) return -2;
        memcpy(self->scratch, block, (size_t)size);
        block = self->scratch;
        for (Py_ssize_t k = 0; k < nblank; k++) {
            PyObject *key = PyTuple_GET_ITEM(self->blank, k);
            Py_ssize_t klen = PyBytes_GET_SIZE(key);
            const char *at = memmem(self->scratch, (size_t)size, PyBytes_AS_STRING(key), (size_t)klen);
            if (at == NULL) continue;
            char *start = self->scratch + (at - self->scratch) + klen, *end = start;
            while (end < self->scratch + size && *end >= '0' && *end <= '9') end++;
            memmove(start, end, (size_t)(self->scratch + size - end));
            size -= end - start;
        }
    }
    for (int s = 0; s < self->nshapes; s++) {
        const Shape *sh = &self->shape[s];
        if (size > sh->head + sh->tail && memcmp(block, sh->prefix, (size_t)sh->head) == 0 &&
            memcmp(block + size - sh->tail, sh->suffix, (size_t)sh->tail) == 0 &&
            json_string_body((const unsigned char *)block + sh->head, size - sh->head - sh->tail))
            return sh->kind;
    }
    return -1;
}

/* Copy the shapes learned since the last call out of the DeltaShapes' list. */
static int sync_shapes(ChunkedBody *self) {
    Py_ssize_t count = PyList_GET_SIZE(self->shapes);
    while (self->nshapes < count && self->nshapes < MAX_SHAPES) {
        /* (prefix, suffix, len(prefix), len(suffix), len(prefix + suffix), kind) */
        PyObject *tuple = PyList_GET_ITEM(self->shapes, self->nshapes);
        if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 6 || !PyBytes_Check(PyTuple_GET_ITEM(tuple, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(tuple, 1)) || !PyUnicode_Check(PyTuple_GET_ITEM(tuple, 5))) {
            PyErr_SetString(PyExc_TypeError, "a delta shape is (prefix, suffix, head, tail, fixed, kind)");
            return -1;
        }
        PyObject *prefix = PyTuple_GET_ITEM(tuple, 0), *suffix = PyTuple_GET_ITEM(tuple, 1);
        Shape *sh = &self->shape[self->nshapes];
        sh->head = PyBytes_GET_SIZE(prefix);
        sh->tail = PyBytes_GET_SIZE(suffix);
        sh->prefix = PyMem_Malloc((size_t)(sh->head + sh->tail + 1));
        if (sh->prefix == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        sh->suffix = sh->prefix + sh->head;
        memcpy(sh->prefix, PyBytes_AS_STRING(prefix), (size_t)sh->head);
        memcpy(sh->suffix, PyBytes_AS_STRING(suffix), (size_t)sh->tail);
        PyObject *kind = PyTuple_GET_ITEM(tuple, 5);
        sh->kind = PyUnicode_CompareWithASCIIString(kind, "text") == 0       ? 0
                   : PyUnicode_CompareWithASCIIString(kind, "thinking") == 0 ? 1
                                                                              : 2;
        self->nshapes++;
    }
    return 0;
}

static int add_count(PyObject *tl, PyObject *name, Py_ssize_t n) {
    if (n == 0) return 0;
    PyObject *old = PyObject_GetAttr(tl, name);
    if (old == NULL) return -1;
    PyObject *add = PyLong_FromSsize_t(n);
    PyObject *sum = add ? PyNumber_Add(old, add) : NULL;
    Py_DECREF(old);
    Py_XDECREF(add);
    if (sum == NULL) return -1;
    int rc = PyObject_SetAttr(tl, name, sum);
    Py_DECREF(sum);
    return rc;
}

static int set_stamp_if_none(PyObject *tl, PyObject *name, double t) {
    PyObject *old = PyObject_GetAttr(tl, name);
    if (old == NULL) return -1;
    int rc = 0;
    if (old == Py_None) {
        PyObject *stamp = PyFloat_FromDouble(t);
        rc = stamp ? PyObject_SetAttr(tl, name, stamp) : -1;
        Py_XDECREF(stamp);
    }
    Py_DECREF(old);
    return rc;
}

/* Put the tokens counted here on the timeline, as Timeline.token would have, one by one. */
static int flush_tokens(ChunkedBody *self) {
    if (self->npending == 0) return 0;
    PyObject *tl = PyObject_GetAttr(self->session, s_timeline);
    if (tl == NULL) return -1;
    PyObject *times = NULL, *stamp = NULL;
    int rc = -1;
    if (set_stamp_if_none(tl, s_t_first_token, self->pending[0]) < 0) goto out;
    if (self->counts[0] && set_stamp_if_none(tl, s_t_first_text, self->first_text) < 0) goto out;
    if (add_count(tl, s_text_chunks, self->counts[0]) < 0 || add_count(tl, s_thinking_chunks, self->counts[1]) < 0 ||
        add_count(tl, s_other_chunks, self->counts[2]) < 0)
        goto out;
    times = PyObject_GetAttr(tl, s_chunk_times);
    if (times == NULL) goto out;
    if (!PyList_Check(times)) {
        PyErr_SetString(PyExc_TypeError, "timeline.chunk_times is not a list");
        goto out;
    }
    for (Py_ssize_t k = 0; k < self->npending; k++) {
        if (stamp == NULL || PyFloat_AS_DOUBLE(stamp) != self->pending[k]) { /* tokens of one read share a stamp */
            Py_XDECREF(stamp);
            stamp = PyFloat_FromDouble(self->pending[k]);
            if (stamp == NULL) goto out;
        }
        if (PyList_Append(times, stamp) < 0) goto out;
    }
    if (PyObject_SetAttr(tl, s_t_last_token, stamp) < 0) goto out;
    rc = 0;
out:
    self->npending = 0;
    self->counts[0] = self->counts[1] = self->counts[2] = 0;
    Py_XDECREF(stamp);
    Py_XDECREF(times);
    Py_DECREF(tl);
    return rc;
}

/* Count every event of this read by its shape, all stamped `t`: 1 done, 0 not every event has one, -1 error. */
static int count_tokens(ChunkedBody *self, double t) {
    const char *body = self->body;
    Py_ssize_t len = self->body_len, pos = 0, nblocks = 0;
    int kinds[MAX_BLOCKS];
    while (pos < len) {
        const char *end = memmem(body + pos, (size_t)(len - pos), "\n\n", 2);
        if (end == NULL) break; /* bytes.split drops what follows the last separator */
        if (nblocks == MAX_BLOCKS) return 0;
        int kind = match(self, body + pos, end - (body + pos));
        if (kind < 0) return kind == -1 ? 0 : -1;
        kinds[nblocks++] = kind;
        pos = end - body + 2;
    }
    if (nblocks == 0) return 0;
    if (grow((char **)&self->pending, &self->pending_cap, (self->npending + nblocks) * (Py_ssize_t)sizeof(double)) < 0)
        return -1;
    for (Py_ssize_t k = 0; k < nblocks; k++) {
        if (kinds[k] == 0 && self->counts[0] == 0) self->first_text = t;
        self->counts[kinds[k]]++;
        self->pending[self->npending++] = t;
    }
    return 1;
}

/* Hand this read's body bytes on: counted here when every event has a shape, else `on_data`. */
static int deliver(ChunkedBody *self, double t) {
    if (self->body_len == 0) return 0;
    const char *body = self->body;
    Py_ssize_t len = self->body_len;
    if (self->aligned && len >= 2 && body[len - 2] == '\n' && body[len - 1] == '\n' &&
        memchr(body, '\r', (size_t)len) == NULL) {
        int rc = count_tokens(self, t);
        if (rc != 0) {
            self->body_len = 0;
            return rc < 0 ? -1 : 0;
        }
    }
    self->body_len = 0;
    if (flush_tokens(self) < 0) return -1; /* the session sees the tokens before these bytes */
    PyObject *chunk = PyBytes_FromStringAndSize(body, len);
    if (chunk == NULL) return -1;
    PyObject *stamp = PyFloat_FromDouble(t);
    PyObject *res = stamp ? PyObject_CallMethodObjArgs(self->session, s_on_data, stamp, chunk, NULL) : NULL;
    Py_XDECREF(stamp);
    Py_DECREF(chunk);
    if (res == NULL) return -1;
    Py_DECREF(res);
    /* Only on_data moves the session between events or teaches it shapes. */
    PyObject *aligned = PyObject_GetAttr(self->session, s_aligned);
    if (aligned == NULL) return -1;
    self->aligned = PyObject_IsTrue(aligned);
    Py_DECREF(aligned);
    if (self->aligned < 0) return -1;
    return sync_shapes(self);
}

/* One read's bytes, stamped `t` (never before the previous read's stamp). */
static int process(ChunkedBody *self, const char *data, Py_ssize_t n, double t) {
    if (t < self->last) t = self->last;
    self->last = t;
    self->body_len = 0;
    if (dechunk(self, data, n) < 0) return -1;
    if (deliver(self, t) < 0) return -1;
    return self->state == DONE ? flush_tokens(self) : 0;
}

/* Report the end (None) or the error once, the tokens counted here on the timeline first. */
static void finish(ChunkedBody *self, PyObject *error) {
    self->finished = 1;
    if (flush_tokens(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
    PyObject *res = PyObject_CallOneArg(self->done, error);
    if (res == NULL) PyErr_WriteUnraisable(self->done);
    Py_XDECREF(res);
}

static void finish_with_current_error(ChunkedBody *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL) PyException_SetTraceback(value, tb);
    finish(self, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* The watcher's callback: one stamped read, decoded and handed on. */
static PyObject *ChunkedBody_call(ChunkedBody *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    if (self->finished) Py_RETURN_NONE;
    char control[CMSG_SPACE(sizeof(struct timespec))];
    struct iovec iov = {read_buf, READ_SIZE};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n = recvmsg(self->fd, &msg, MSG_DONTWAIT);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            /* A spurious wake-up, or a send stamp that came late (reader.sent_stamps): it wakes the watcher as an
             * error until it is read off the error queue. */
            char drain[256];
            struct msghdr err;
            memset(&err, 0, sizeof err);
            do {
                err.msg_control = drain;
                err.msg_controllen = sizeof drain;
            } while (recvmsg(self->fd, &err, MSG_ERRQUEUE | MSG_DONTWAIT) >= 0);
            Py_RETURN_NONE;
        }
        PyErr_SetFromErrno(PyExc_OSError);
        finish_with_current_error(self);
        Py_RETURN_NONE;
    }
    if (n == 0) {
        PyObject *exc = PyObject_CallFunction(PyExc_ConnectionResetError, "is", ECONNRESET,
                                              "connection closed before the end of the body");
        if (exc == NULL) return NULL;
        finish(self, exc);
        Py_DECREF(exc);
        Py_RETURN_NONE;
    }
    double now = clock_s(CLOCK_MONOTONIC), t = now;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            double kernel = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 + (now - clock_s(CLOCK_REALTIME));
            if (now - PLAUSIBLE_S < kernel && kernel < now) t = kernel;
            break;
        }
    }
    if (process(self, read_buf, n, t) < 0) finish_with_current_error(self);
    else if (self->state == DONE) finish(self, Py_None);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(feed_doc, "feed(data, t)\n--\n\nDecode and hand on body bytes read elsewhere (those that came with "
                       "the headers), stamped t; raises what the watcher's call reports through done.");

static PyObject *ChunkedBody_feed(ChunkedBody *self, PyObject *args) {
    Py_buffer data;
    double t;
    if (!PyArg_ParseTuple(args, "y*d", &data, &t)) return NULL;
    int rc = process(self, data.buf, data.len, t);
    PyBuffer_Release(&data);
    if (rc < 0) { /* the tokens counted before the error stay on the timeline */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (flush_tokens(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(flush_doc, "flush()\n--\n\nPut the tokens counted so far on the session's timeline (the "
                        "deadline and a stopped user read it; the end and on_data do it themselves).");

static PyObject *ChunkedBody_flush(ChunkedBody *self, PyObject *unused) {
    (void)unused;
    if (flush_tokens(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static int ChunkedBody_init(ChunkedBody *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fd", "session", "shapes", "blank", "done", "last", NULL};
    int fd;
    PyObject *session, *shapes, *blank, *done;
    double last;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOO!O!Od", names, &fd, &session, &PyList_Type, &shapes,
                                     &PyTuple_Type, &blank, &done, &last))
        return -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(blank); k++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(blank, k))) {
            PyErr_SetString(PyExc_TypeError, "blank must be a tuple of bytes");
            return -1;
        }
    self->fd = fd;
    Py_INCREF(session);
    Py_XSETREF(self->session, session);
    Py_INCREF(shapes);
    Py_XSETREF(self->shapes, shapes);
    Py_INCREF(blank);
    Py_XSETREF(self->blank, blank);
    Py_INCREF(done);
    Py_XSETREF(self->done, done);
    self->last = last;
    self->state = SIZE_START;
    self->remaining = 0;
    self->finished = 0;
    self->body_len = 0;
    self->npending = 0;
    self->counts[0] = self->counts[1] = self->counts[2] = 0;
    for (; self->nshapes > 0; self->nshapes--) PyMem_Free(self->shape[self->nshapes - 1].prefix);
    PyObject *aligned = PyObject_GetAttr(session, s_aligned);
    if (aligned == NULL) return -1;
    self->aligned = PyObject_IsTrue(aligned);
    Py_DECREF(aligned);
    if (self->aligned < 0) return -1;
    return sync_shapes(self);
}

static int ChunkedBody_traverse(ChunkedBody *self, visitproc visit, void *arg) {
    Py_VISIT(self->session);
    Py_VISIT(self->shapes);
    Py_VISIT(self->blank);
    Py_VISIT(self->done);
    return 0;
}

static int ChunkedBody_clear(ChunkedBody *self) {
    Py_CLEAR(self->session);
    Py_CLEAR(self->shapes);
    Py_CLEAR(self->blank);
    Py_CLEAR(self->done);
    return 0;
}

static void ChunkedBody_dealloc(ChunkedBody *self) {
    PyObject_GC_UnTrack(self);
    ChunkedBody_clear(self);
    PyMem_Free(self->body);
    PyMem_Free(self->scratch);
    PyMem_Free(self->pending);
    for (int k = 0; k < self->nshapes; k++) PyMem_Free(self->shape[k].prefix);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *ChunkedBody_complete(ChunkedBody *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->state == DONE);
}

static PyMemberDef ChunkedBody_members[] = {
    {"last", T_DOUBLE, offsetof(ChunkedBody, last), READONLY, "the stamp of the latest read"},
    {NULL},
};

static PyGetSetDef ChunkedBody_getset[] = {
    {"complete", (getter)ChunkedBody_complete, NULL, "the last chunk and trailers have been read", NULL},
    {NULL},
};

static PyMethodDef ChunkedBody_methods[] = {
    {"feed", (PyCFunction)ChunkedBody_feed, METH_VARARGS, feed_doc},
    {"flush", (PyCFunction)ChunkedBody_flush, METH_NOARGS, flush_doc},
    {NULL},
};

static PyTypeObject ChunkedBodyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenload.transport._chunked.ChunkedBody",
    .tp_basicsize = sizeof(ChunkedBody),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("ChunkedBody(fd, session, shapes, blank, done, last)\n--\n\n"
                        "One chunked response body read from socket fd into a StreamSession; call it when fd is "
                        "readable."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ChunkedBody_init,
    .tp_dealloc = (destructor)ChunkedBody_dealloc,
    .tp_traverse = (traverseproc)ChunkedBody_traverse,
    .tp_clear = (inquiry)ChunkedBody_clear,
    .tp_call = (ternaryfunc)ChunkedBody_call,
    .tp_members = ChunkedBody_members,
    .tp_getset = ChunkedBody_getset,
    .tp_methods = ChunkedBody_methods,
};

static PyObject *configure(PyObject *module, PyObject *error) {
    (void)module;
    Py_INCREF(error);
    Py_XSETREF(parse_error, error);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, "configure(parse_error)\n--\n\nThe exception type for invalid framing."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_chunked",
    .m_doc = "Chunked bodies read, de-chunked and counted in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__chunked(void) {
    if (PyType_Ready(&ChunkedBodyType) < 0) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(s_aligned, "_aligned")
    INTERN(s_on_data, "on_data")
    INTERN(s_timeline, "timeline")
    INTERN(s_t_first_token, "t_first_token")
    INTERN(s_t_first_text, "t_first_text")
    INTERN(s_t_last_token, "t_last_token")
    INTERN(s_chunk_times, "chunk_times")
    INTERN(s_text_chunks, "text_chunks")
    INTERN(s_thinking_chunks, "thinking_chunks")
    INTERN(s_other_chunks, "other_chunks")
#undef INTERN
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&ChunkedBodyType);
    if (PyModule_AddObject(m, "ChunkedBody", (PyObject *)&ChunkedBodyType) < 0) {
        Py_DECREF(&ChunkedBodyType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
