/*
 * raycoll._core's SockPipe type: a socket pipe (sockpipe.h) for Python, with the Pipe type's
 * methods (pipemodule.c), so that raycoll/transport/pipes.py matches messages the same way on
 * both. It parses arguments, takes buffers and releases the GIL around sockpipe.c's calls;
 * nothing is decided here.
 */
#include "pipebind.h"
#include "sockpipe.h"

typedef struct {
    rc_pipe_object head; /* first: the shared binding's busy flags (pipebind.h) */
    rc_sock sock;
    int open;
} SockPipeObject;

static int sp_init(SockPipeObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"out_fd", "in_fd", NULL};
    int out_fd, in_fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii", kwlist, &out_fd, &in_fd)) return -1;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "SockPipe is already open");
        return -1;
    }
    int err = rc_sock_open(&self->sock, out_fd, in_fd);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->open = 1;
    return 0;
}

static void sp_dealloc(SockPipeObject *self) {
    if (self->open) rc_sock_close(&self->sock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void *sp_of(rc_pipe_object *self) {
    SockPipeObject *sp = (SockPipeObject *)self;
    return sp->open ? &sp->sock : NULL;
}

/* cma is ignored: the peer is on another node. */
static int sp_send_op(void *s, int64_t tag, const uint8_t *meta, uint32_t meta_len,
                      const uint8_t *data, uint64_t n, int may_wait, int ack, int cma,
                      rc_call *call) {
    (void)cma;
    return rc_sock_send((rc_sock *)s, tag, meta, meta_len, data, n, may_wait, ack, call);
}

static int sp_peek_op(void *s, int may_wait, rc_call *call, rc_pipe_msg *msg) {
    return rc_sock_peek((rc_sock *)s, may_wait, call, msg);
}

static int sp_take_op(void *s, uint8_t *dst, uint64_t n, int reject, rc_call *call) {
    return rc_sock_take((rc_sock *)s, dst, n, reject, call);
}

static const rc_pipe_msg *sp_current(void *s) {
    const rc_sock *sock = (const rc_sock *)s;
    return sock->have_cur ? &sock->cur : NULL;
}

static const rc_pipe_ops SOCK_OPS = {sp_of, sp_send_op, sp_peek_op, sp_take_op, sp_current};

static PyObject *sp_send(SockPipeObject *self, PyObject *args) {
    return pipebind_send(&self->head, &SOCK_OPS, args);
}

static PyObject *sp_peek(SockPipeObject *self, PyObject *args) {
    return pipebind_peek(&self->head, &SOCK_OPS, args);
}

static PyObject *sp_take(SockPipeObject *self, PyObject *args) {
    return pipebind_take(&self->head, &SOCK_OPS, args);
}

static PyObject *sp_recv(SockPipeObject *self, PyObject *args) {
    return pipebind_recv(&self->head, &SOCK_OPS, args);
}

static PyObject *sp_attach_in(SockPipeObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "the pipe is closed");
        return NULL;
    }
    if (self->head.receiving) { /* a receive reads the connection being replaced */
        PyErr_SetString(PyExc_RuntimeError, "the pipe is busy with another call that way");
        return NULL;
    }
    int err = rc_sock_attach_in(&self->sock, fd);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *sp_close(SockPipeObject *self, PyObject *noargs) {
    (void)noargs;
    if (!self->open) Py_RETURN_NONE;
    self->sock.closing = 1;
    if (self->head.sending || self->head.receiving) Py_RETURN_NONE; /* the waiting call ends; dealloc */
    rc_sock_close(&self->sock);
    self->open = 0;
    Py_RETURN_NONE;
}

static PyObject *sp_state(SockPipeObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("{s:i,s:i,s:i}", "attached", self->sock.in_fd >= 0 ? 2 : 1,
                         "out_broken", self->sock.out_broken, "in_broken", self->sock.in_broken);
}

static PyObject *sp_spin_fails(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->sock.spin_fails);
}

static PyObject *sp_closed(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(!self->open || self->sock.closing);
}

static PyObject *sp_attached(SockPipeObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->open && self->sock.in_fd >= 0);
}

static PyMethodDef sp_methods[] = {
    {"send", (PyCFunction)sp_send, METH_VARARGS,
     "send(buf, tag, meta, may_wait, ack, cma, wait, check) -> (status, broke, exc): as "
     "Pipe.send (cma ignored); GIL released where it may wait"},
    {"peek", (PyCFunction)sp_peek, METH_VARARGS,
     "peek(may_wait, wait, check) -> (status, tag, nbytes, meta, broke, exc): as Pipe.peek"},
    {"take", (PyCFunction)sp_take, METH_VARARGS,
     "take(buf or None, reject, wait, check) -> (status, broke, exc): as Pipe.take"},
    {"recv", (PyCFunction)sp_recv, METH_VARARGS,
     "recv(buf, tag, meta, wait, check) -> (status, tag, nbytes, meta, broke, exc): as "
     "Pipe.recv"},
    {"attach_in", (PyCFunction)sp_attach_in, METH_VARARGS,
     "attach_in(fd): the peer's connection (a dup is kept), once it came"},
    {"close", (PyCFunction)sp_close, METH_NOARGS,
     "close(): end the pipe's waits and close its descriptors (the connections stay open)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef sp_getset[] = {
    {"state", (getter)sp_state, NULL, "the pipe's flags, as a dict", NULL},
    {"closed", (getter)sp_closed, NULL, "whether it is closed", NULL},
    {"attached", (getter)sp_attached, NULL, "whether the peer's connection is attached", NULL},
    {"spin_fails", (getter)sp_spin_fails, NULL,
     "waits whose spin ran its whole length without the peer", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject SockPipeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "raycoll.native._core.SockPipe",
    .tp_basicsize = sizeof(SockPipeObject),
    .tp_dealloc = (destructor)sp_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SockPipe(out_fd, in_fd): a socket pipe over dups of two connections "
              "(sockpipe.h); in_fd -1 until the peer's comes",
    .tp_methods = sp_methods,
    .tp_getset = sp_getset,
    .tp_init = (initproc)sp_init,
    .tp_new = PyType_GenericNew,
};

int add_sockpipe_type(PyObject *m) {
    if (PyType_Ready(&SockPipeType) < 0) return -1;
    Py_INCREF(&SockPipeType);
    if (PyModule_AddObject(m, "SockPipe", (PyObject *)&SockPipeType) < 0) {
        Py_DECREF(&SockPipeType);
        return -1;
    }
    return 0;
}
