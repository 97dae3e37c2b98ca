/*
 * raycoll._core's Pipe type: a pair pipe (pipe.h) for Python, which matches messages to
 * receives (raycoll/transport/pipes.py). It parses arguments, takes buffers and releases the
 * GIL around pipe.c's calls; nothing is decided here.
 */
#include "pipebind.h"
#include "segment.h"

typedef struct {
    rc_pipe_object head; /* first: the shared binding's busy flags (pipebind.h) */
    rc_pipe pipe;
} PipeObject;

static int pipe_init(PipeObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "side", "ring_bytes", "wait_s", NULL};
    const char *name;
    int side;
    unsigned long long ring;
    double wait_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "siKd", kwlist, &name, &side, &ring, &wait_s))
        return -1;
    if (self->pipe.base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pipe is already open");
        return -1;
    }
    char err[256] = "";
    int rc;
    uint64_t wait_ns = wait_s > 0 ? (uint64_t)(wait_s * 1e9) : 0;
    Py_BEGIN_ALLOW_THREADS rc = rc_pipe_open(&self->pipe, name, side, ring, wait_ns, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyObject *exc = Py_BuildValue("(is)", rc, err);
        if (exc != NULL) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    return 0;
}

static void pipe_dealloc(PipeObject *self) {
    rc_pipe_unmap(&self->pipe);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void *pipe_of(rc_pipe_object *self) {
    rc_pipe *pipe = &((PipeObject *)self)->pipe;
    return pipe->base != NULL ? pipe : NULL;
}

static int pipe_send_op(void *p, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                        const uint8_t *data, uint64_t n, int may_wait, int ack, int cma,
                        rc_call *call) {
    return rc_pipe_send((rc_pipe *)p, tag, meta, meta_len, data, n, may_wait, ack, cma, call);
}

static int pipe_peek_op(void *p, int may_wait, rc_call *call, rc_pipe_msg *msg) {
    return rc_pipe_peek((rc_pipe *)p, may_wait, call, msg);
}

static int pipe_take_op(void *p, uint8_t *dst, uint64_t n, int reject, rc_call *call) {
    return rc_pipe_take((rc_pipe *)p, dst, n, reject, call);
}

static const rc_pipe_msg *pipe_current(void *p) {
    const rc_pipe *pipe = (const rc_pipe *)p;
    return pipe->have_cur ? &pipe->cur : NULL;
}

static const rc_pipe_ops PIPE_OPS = {pipe_of, pipe_send_op, pipe_peek_op, pipe_take_op,
                                     pipe_current};

static PyObject *pipe_send(PipeObject *self, PyObject *args) {
    return pipebind_send(&self->head, &PIPE_OPS, args);
}

static PyObject *pipe_peek(PipeObject *self, PyObject *args) {
    return pipebind_peek(&self->head, &PIPE_OPS, args);
}

static PyObject *pipe_take(PipeObject *self, PyObject *args) {
    return pipebind_take(&self->head, &PIPE_OPS, args);
}

static PyObject *pipe_recv(PipeObject *self, PyObject *args) {
    return pipebind_recv(&self->head, &PIPE_OPS, args);
}

/* Whether the pipe is open (an exception set if not). */
static int pipe_usable(PipeObject *self) {
    if (self->pipe.base == NULL) {
        PyErr_SetString(PyExc_ValueError, "the pipe is closed");
        return 0;
    }
    return 1;
}

static PyObject *pipe_abort(PipeObject *self, PyObject *args) {
    unsigned int reason = RC_ABORT_FAILED;
    if (!PyArg_ParseTuple(args, "|I", &reason)) return NULL;
    if (!pipe_usable(self)) return NULL;
    rc_pipe_abort(&self->pipe, reason ? reason : RC_ABORT_FAILED);
    Py_RETURN_NONE;
}

static PyObject *pipe_close(PipeObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->pipe.base == NULL) Py_RETURN_NONE;
    rc_pipe_abort(&self->pipe, RC_ABORT_CLOSED); /* the peer's waits end */
    if (self->head.sending || self->head.receiving) { /* a call waits in another thread: end it */
        self->pipe.closing = 1;
        Py_RETURN_NONE;
    }
    rc_pipe_unmap(&self->pipe);
    Py_RETURN_NONE;
}

static PyObject *pipe_state(PipeObject *self, void *closure) {
    (void)closure;
    if (!pipe_usable(self)) return NULL;
    const rc_pipe *p = &self->pipe;
    const rc_pipe_side *peer = &p->sides[1 - p->me];
    return Py_BuildValue("{s:I,s:i,s:I,s:I,s:i,s:K}", "attached",
                         __atomic_load_n(&p->hdr->attached, __ATOMIC_ACQUIRE), "peer_pid",
                         (int)__atomic_load_n(&peer->pid, __ATOMIC_ACQUIRE), "peer_abort",
                         __atomic_load_n(&peer->abort, __ATOMIC_ACQUIRE), "abort",
                         __atomic_load_n(&p->sides[p->me].abort, __ATOMIC_ACQUIRE), "created",
                         p->created, "ring_bytes", (unsigned long long)p->ring);
}

static PyObject *pipe_spin_fails(PipeObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->pipe.spin_fails);
}

static PyObject *pipe_closed(PipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->pipe.base == NULL);
}

static PyMethodDef pipe_methods[] = {
    {"send", (PyCFunction)pipe_send, METH_VARARGS,
     "send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc): one "
     "message (may_wait false: AGAIN unless it goes whole now; ack: wait until the receiver "
     "took it, MISMATCH if it rejected it; cma, with ack: offer it across memory); GIL "
     "released"},
    {"peek", (PyCFunction)pipe_peek, METH_VARARGS,
     "peek(may_wait, wait, check) -> (status, tag, nbytes, meta, broke, exc): the next "
     "message's header, kept as the current one (AGAIN: none, without waiting)"},
    {"take", (PyCFunction)pipe_take, METH_VARARGS,
     "take(buf or None, reject, wait, check) -> (status, broke, exc): the current message "
     "into buf (exactly its bytes), or skipped (reject: its sender is told)"},
    {"recv", (PyCFunction)pipe_recv, METH_VARARGS,
     "recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc): the next "
     "message into buf if its tag is tag (MISMATCH: skipped, its meta or size differ), else "
     "OTHER (left in the pipe)"},
    {"abort", (PyCFunction)pipe_abort, METH_VARARGS,
     "abort(reason=1): this side gives up on the pipe (the peer's waits end)"},
    {"close", (PyCFunction)pipe_close, METH_NOARGS,
     "close(): give up on the pipe and unmap it (or, while a call waits, end it)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pipe_getset[] = {
    {"state", (getter)pipe_state, NULL, "the sides' words, as a dict", NULL},
    {"closed", (getter)pipe_closed, NULL, "whether it is unmapped", NULL},
    {"spin_fails", (getter)pipe_spin_fails, NULL,
     "waits whose spin ran its whole length without the peer", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject PipeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "raycoll.native._core.Pipe",
    .tp_basicsize = sizeof(PipeObject),
    .tp_dealloc = (destructor)pipe_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pipe(name, side, ring_bytes, wait_s): a pair pipe, made or mapped (pipe.h)",
    .tp_methods = pipe_methods,
    .tp_getset = pipe_getset,
    .tp_init = (initproc)pipe_init,
    .tp_new = PyType_GenericNew,
};

int add_pipe_type(PyObject *m) {
    if (PyType_Ready(&PipeType) < 0) return -1;
    Py_INCREF(&PipeType);
    if (PyModule_AddObject(m, "Pipe", (PyObject *)&PipeType) < 0) {
        Py_DECREF(&PipeType);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "PIPE_AGAIN", RC_PIPE_AGAIN) < 0 ||
        PyModule_AddIntConstant(m, "PIPE_OTHER", RC_PIPE_OTHER) < 0 ||
        PyModule_AddIntConstant(m, "PIPE_META_BYTES", RC_PIPE_META_BYTES) < 0)
        return -1;
    return 0;
}
