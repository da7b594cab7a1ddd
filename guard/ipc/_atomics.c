/* Acquire loads and release stores of 64-bit counters in a shared buffer, for the sample ring.
 *
 * Why: the ring (guard/ipc/ring.py) hands records from one process to another with two counters
 * and no lock. The producer writes a record's bytes, then advances ``head``; the consumer reads
 * ``head``, then the bytes. That is correct only if no CPU lets the counter's store become
 * visible before the bytes' stores (and the consumer's reads of the bytes happen after its read
 * of the counter). x86-64 keeps stores in order (TSO); arm64 (Graviton, Ampere) and POWER do
 * not. A release store orders every earlier load and store of this thread before it; an acquire
 * load orders every later one after it; so on any CPU a consumer that sees the new ``head``
 * sees the bytes it covers, and a producer that sees the new ``tail`` knows the consumer has
 * finished reading the bytes it frees. On x86-64 both compile to plain moves.
 *
 * The counters live in memory that two processes map: the atomics must be lock-free (a lock
 * inside one process's libatomic protects nothing in the other), hence the static assertion.
 *
 * Optional, like the tier-1 kernel: where it does not build, ring.py keeps plain stores on
 * x86-64 (correct there) and refuses to make a ring on other CPUs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if !defined(__GNUC__)
#error "guard.ipc._atomics needs GCC or Clang (__atomic builtins)"
#endif
_Static_assert(__atomic_always_lock_free(sizeof(uint64_t), 0),
               "64-bit atomics are not lock-free here: no use across processes");

/* The address of the aligned u64 at byte ``offset`` of ``view``, or NULL with an exception. */
static uint64_t *
counter_at(Py_buffer *view, PyObject *offset_obj)
{
    Py_ssize_t offset = PyLong_AsSsize_t(offset_obj);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (offset < 0 || offset > view->len - (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_IndexError, "counter offset %zd outside a buffer of %zd bytes",
                     offset, view->len);
        return NULL;
    }
    char *at = (char *)view->buf + offset;
    if ((uintptr_t)at % sizeof(uint64_t)) {  /* a misaligned access is not atomic on arm64 */
        PyErr_Format(PyExc_ValueError, "counter at offset %zd is not 8-byte aligned", offset);
        return NULL;
    }
    return (uint64_t *)at;
}

PyDoc_STRVAR(load_acquire_doc,
"load_acquire(buffer, offset) -> int\n\n"
"The native-endian u64 at byte ``offset`` of ``buffer`` (8-byte aligned), read with acquire\n"
"semantics: no later load or store of this thread is seen before it.");

static PyObject *
load_acquire(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "load_acquire(buffer, offset): two arguments");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    uint64_t *counter = counter_at(&view, args[1]);
    if (counter != NULL)
        result = PyLong_FromUnsignedLongLong(__atomic_load_n(counter, __ATOMIC_ACQUIRE));
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(store_release_doc,
"store_release(buffer, offset, value) -> None\n\n"
"Write ``value`` (0 <= value < 2**64) as the native-endian u64 at byte ``offset`` of the\n"
"writable ``buffer`` (8-byte aligned) with release semantics: every earlier load and store of\n"
"this thread is seen before it.");

static PyObject *
store_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "store_release(buffer, offset, value): three arguments");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(args[2]);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    uint64_t *counter = counter_at(&view, args[1]);
    if (counter != NULL)
        __atomic_store_n(counter, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    if (counter == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load_acquire", (PyCFunction)(void (*)(void))load_acquire, METH_FASTCALL,
     load_acquire_doc},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL,
     store_release_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_atomics",
    "Acquire loads and release stores of u64 counters in shared memory (see _atomics.c).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    return PyModule_Create(&module);
}
