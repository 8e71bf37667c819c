/*
 * libtransfer_engine.so: Mooncake's C ABI (include/transfer_engine_c.h) over this package's engine.
 *
 * Every call that needs the engine takes the GIL (PyGILState_Ensure) and calls a method of
 * mooncake._engine.cabi.CEngine; the engine itself runs on the facade's loop thread. Loaded into
 * a process without Python, the first createTransferEngine starts an embedded interpreter
 * (Py_InitializeFromConfig, no signal handlers; the interpreter is the one named by
 * MOONCAKE_PYTHON, else the one the library was built with, so its venv's packages are found)
 * and then releases the GIL, so the loop thread runs whenever C is not inside a call.
 *
 * Batches live here, in C: allocateBatchID, getTransferStatus and freeBatchID never touch
 * Python, so a caller spinning on getTransferStatus (as TensorRT-LLM's agent does) costs the
 * engine nothing. Python reports each task's end through mc_cabi_finish. Every batch field is
 * read and written under g_lock, which is never held while waiting for the GIL.
 * Batch ids carry a generation: a freed or made-up id is refused with kInvalidArgument (1),
 * never dereferenced.
 *
 * Return codes are Mooncake's: the int-returning calls use error.h's negative codes
 * (ERR_INVALID_ARGUMENT -1, ERR_ADDRESS_OVERLAPPED -7, ERR_METADATA -200 ...); submitTransfer,
 * submitTransferWithNotify, getTransferStatus and freeBatchID return Status::Code (0 ok,
 * 1 invalid argument, 2 too many requests, 3 address not registered, 4 batch busy).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

#ifndef MC_PYTHON_EXE
#define MC_PYTHON_EXE ""
#endif

#define MC_EXPORT __attribute__((visibility("default")))

/* error.h */
#define ERR_INVALID_ARGUMENT (-1)
#define ERR_METADATA (-200)
/* Status::Code */
#define S_OK 0
#define S_INVALID_ARGUMENT 1
#define S_TOO_MANY_REQUESTS 2
#define S_BATCH_BUSY 4
/* cabi.py's submit: every task already completed on the calling thread */
#define MC_DONE_INLINE 1000

#define MC_ENGINE_MAGIC 0x6d63656e67696e65ull /* "mcengine" */

typedef struct mc_engine {
    uint64_t magic;
    PyObject *py; /* mooncake._engine.cabi.CEngine */
    struct mc_engine *next;
} mc_engine;

typedef struct mc_batch {
    mc_engine *engine;
    size_t capacity;
    size_t count; /* tasks submitted */
    size_t alloc; /* slots allocated in status/lengths (grown by submits up to capacity) */
    _Atomic int *status;
    uint64_t *lengths;
} mc_batch;

typedef struct {
    mc_batch *batch;
    uint32_t gen;
} mc_slot;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done; /* broadcast when tasks end (CLOCK_MONOTONIC; set up at init) */
#define MC_POLL_WAIT_NS 1000000 /* getTransferStatus waits at most this long for a running task */
static mc_engine *g_engines; /* live engines (a handle not in here is refused) */
static mc_slot *g_slots;
static uint32_t g_nslots, g_cap_slots;
static uint32_t *g_free; /* free slot indices */
static uint32_t g_nfree;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static PyObject *g_mod; /* mooncake._engine.cabi, NULL if it could not be imported */

/* ---- Python ---------------------------------------------------------------------------- */

static void mc_set_locked(mc_batch *b, size_t first, size_t n, int status) {
    if (first <= b->alloc && n <= b->alloc - first)
        for (size_t i = first; i < first + n; i++)
            atomic_store_explicit(&b->status[i], status, memory_order_release);
    pthread_cond_broadcast(&g_done);
}

/* Called by Python (ctypes, GIL held) when tasks [first, first + n) of a batch ended. */
MC_EXPORT void mc_cabi_finish(void *batch, size_t first, size_t n, int status) {
    if (!batch) return;
    pthread_mutex_lock(&g_lock);
    mc_set_locked((mc_batch *)batch, first, n, status);
    pthread_mutex_unlock(&g_lock);
}

static void mc_root_dir(char *out, size_t len) {
    /* this library lies in <root>/mooncake/_fast/lib/ */
    Dl_info info;
    char path[PATH_MAX];
    out[0] = 0;
    if (!dladdr((void *)mc_root_dir, &info) || !info.dli_fname) return;
    if (!realpath(info.dli_fname, path)) return;
    for (int up = 0; up < 4; up++) {
        char *slash = strrchr(path, '/');
        if (!slash) return;
        *slash = 0;
    }
    snprintf(out, len, "%s", path[0] ? path : "/");
}

static PyObject *mc_import(int put_root_first) {
    char root[PATH_MAX];
    mc_root_dir(root, sizeof(root));
    if (put_root_first && root[0]) {
        PyObject *sys_path = PySys_GetObject("path"); /* borrowed */
        PyObject *r = PyUnicode_DecodeFSDefault(root);
        if (sys_path && r) PyList_Insert(sys_path, 0, r);
        Py_XDECREF(r);
    }
    PyObject *mod = PyImport_ImportModule("mooncake._engine.cabi");
    if (!mod && !put_root_first && root[0]) {
        PyErr_Clear();
        return mc_import(1);
    }
    return mod;
}

static void mc_init_python(void) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g_done, &ca);
    pthread_condattr_destroy(&ca);
    int embedded = !Py_IsInitialized();
    if (embedded) {
        PyConfig config;
        PyConfig_InitPythonConfig(&config);
        config.install_signal_handlers = 0;
        config.parse_argv = 0;
        const char *exe = getenv("MOONCAKE_PYTHON");
        if (!exe || !*exe) exe = MC_PYTHON_EXE;
        PyStatus st = PyStatus_Ok();
        if (exe && *exe) st = PyConfig_SetBytesString(&config, &config.program_name, exe);
        if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
        PyConfig_Clear(&config);
        if (PyStatus_Exception(st)) {
            fprintf(stderr, "libtransfer_engine: starting Python failed: %s\n",
                    st.err_msg ? st.err_msg : "unknown error");
            return;
        }
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject *mod = mc_import(embedded);
    if (mod) {
        PyObject *r = PyObject_CallMethod(mod, "_attach", "K",
                                          (unsigned long long)(uintptr_t)&mc_cabi_finish);
        if (r) {
            Py_DECREF(r);
            g_mod = mod;
        } else {
            Py_DECREF(mod);
        }
    }
    if (!g_mod) {
        fprintf(stderr, "libtransfer_engine: importing mooncake._engine.cabi failed:\n");
        PyErr_Print();
    }
    PyGILState_Release(gs);
    if (embedded) PyEval_SaveThread(); /* the loop thread runs while C is outside our calls */
}

/* The GIL for this thread. A thread's first call keeps a thread state for it for good, so
 * later calls from it (TensorRT-LLM calls from its own threads) neither create nor destroy one;
 * a thread that already holds the GIL (a PyDLL caller) is left as it is. */
static __thread int t_kept;

static PyGILState_STATE mc_gil(void) {
    if (!t_kept) {
        t_kept = 1;
        PyGILState_STATE s = PyGILState_Ensure();
        if (s == PyGILState_UNLOCKED)
            PyEval_SaveThread();
        else
            PyGILState_Release(s);
    }
    return PyGILState_Ensure();
}

/* The engine of a handle, or NULL if it is not a live engine of this library. */
static mc_engine *mc_engine_of(transfer_engine_t handle) {
    mc_engine *found = NULL;
    if (!handle) return NULL;
    pthread_mutex_lock(&g_lock);
    for (mc_engine *e = g_engines; e; e = e->next)
        if (e == handle) {
            found = e;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return found && found->magic == MC_ENGINE_MAGIC ? found : NULL;
}

/* Call a method of the engine's CEngine; its int result, or `fail` on an exception. */
static long mc_call_int(mc_engine *e, long fail, const char *method, const char *fmt, ...) {
    PyGILState_STATE gs = mc_gil();
    long rc = fail;
    PyObject *m = PyObject_GetAttrString(e->py, method);
    PyObject *args = NULL, *r = NULL;
    if (m) {
        va_list va;
        va_start(va, fmt);
        args = Py_VaBuildValue(fmt, va);
        va_end(va);
    }
    if (m && args) {
        if (!PyTuple_Check(args)) {
            PyObject *t = PyTuple_Pack(1, args);
            Py_DECREF(args);
            args = t;
        }
        if (args) r = PyObject_Call(m, args, NULL);
    }
    if (r) {
        rc = PyLong_AsLong(r);
        if (rc == -1 && PyErr_Occurred()) rc = fail;
    }
    if (PyErr_Occurred()) PyErr_Print();
    Py_XDECREF(r);
    Py_XDECREF(args);
    Py_XDECREF(m);
    PyGILState_Release(gs);
    return rc;
}

/* ---- engines --------------------------------------------------------------------------- */

MC_EXPORT transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                                 const char *local_server_name,
                                                 const char *ip_or_host_name, uint64_t rpc_port,
                                                 int auto_discover) {
    pthread_once(&g_once, mc_init_python);
    if (!g_mod) return NULL;
    PyGILState_STATE gs = mc_gil();
    PyObject *py = PyObject_CallMethod(
        g_mod, "create", "yyyKi", metadata_conn_string ? metadata_conn_string : "",
        local_server_name ? local_server_name : "", ip_or_host_name ? ip_or_host_name : "",
        (unsigned long long)rpc_port, auto_discover);
    if (!py) PyErr_Print();
    if (py == Py_None) Py_CLEAR(py);
    PyGILState_Release(gs);
    if (!py) return NULL;
    mc_engine *e = calloc(1, sizeof(*e));
    if (!e) {
        gs = mc_gil();
        PyObject *r = PyObject_CallMethod(py, "close", NULL);
        Py_XDECREF(r);
        Py_DECREF(py);
        PyGILState_Release(gs);
        return NULL;
    }
    e->magic = MC_ENGINE_MAGIC;
    e->py = py;
    pthread_mutex_lock(&g_lock);
    e->next = g_engines;
    g_engines = e;
    pthread_mutex_unlock(&g_lock);
    return (transfer_engine_t)e;
}

static void mc_free_batch_locked(uint32_t slot) {
    mc_batch *b = g_slots[slot].batch;
    g_slots[slot].batch = NULL;
    g_slots[slot].gen++;
    g_free[g_nfree++] = slot;
    free((void *)b->status);
    free(b->lengths);
    free(b);
}

MC_EXPORT void destroyTransferEngine(transfer_engine_t engine) {
    mc_engine *e = mc_engine_of(engine);
    if (!e) return;
    pthread_mutex_lock(&g_lock);
    for (mc_engine **p = &g_engines; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    PyGILState_STATE gs = mc_gil();
    PyObject *r = PyObject_CallMethod(e->py, "close", NULL);
    if (!r) PyErr_Print();
    Py_XDECREF(r);
    Py_CLEAR(e->py);
    PyGILState_Release(gs);
    /* the engine is closed: nothing reports into its batches any more */
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < g_nslots; i++)
        if (g_slots[i].batch && g_slots[i].batch->engine == e) mc_free_batch_locked(i);
    pthread_mutex_unlock(&g_lock);
    e->magic = 0;
    free(e);
}

MC_EXPORT int discoverTopology(transfer_engine_t engine) {
    return mc_engine_of(engine) ? 0 : ERR_INVALID_ARGUMENT;
}

MC_EXPORT int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !buf_out || !buf_len) return ERR_INVALID_ARGUMENT;
    PyGILState_STATE gs = mc_gil();
    int rc = ERR_INVALID_ARGUMENT;
    PyObject *r = PyObject_CallMethod(e->py, "local_ip_and_port", NULL);
    const char *s = r ? PyUnicode_AsUTF8(r) : NULL;
    if (s) {
        snprintf(buf_out, buf_len, "%s", s);
        rc = 0;
    }
    if (PyErr_Occurred()) PyErr_Print();
    Py_XDECREF(r);
    PyGILState_Release(gs);
    return rc;
}

/* Transports are chosen by the engine; these keep the published signatures. */
static char mc_transport_token[1];

MC_EXPORT transport_t installTransport(transfer_engine_t engine, const char *proto, void **args) {
    (void)args;
    mc_engine *e = mc_engine_of(engine);
    if (!e || !proto) return NULL;
    long ok = mc_call_int(e, 0, "has_transport", "y", proto);
    return ok ? (transport_t)mc_transport_token : NULL;
}

MC_EXPORT int uninstallTransport(transfer_engine_t engine, const char *proto) {
    return mc_engine_of(engine) && proto ? 0 : ERR_INVALID_ARGUMENT;
}

MC_EXPORT segment_id_t openSegment(transfer_engine_t engine, const char *segment_name) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !segment_name) return ERR_INVALID_ARGUMENT;
    return (segment_id_t)mc_call_int(e, -1, "open_segment", "yi", segment_name, 0);
}

MC_EXPORT segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !segment_name) return ERR_INVALID_ARGUMENT;
    return (segment_id_t)mc_call_int(e, -1, "open_segment", "yi", segment_name, 1);
}

MC_EXPORT int closeSegment(transfer_engine_t engine, segment_id_t segment_id) {
    mc_engine *e = mc_engine_of(engine);
    if (!e) return ERR_INVALID_ARGUMENT;
    return (int)mc_call_int(e, ERR_INVALID_ARGUMENT, "close_segment", "i", segment_id);
}

MC_EXPORT int warmupEfaSegment(transfer_engine_t engine, const char *segment_name) {
    (void)engine;
    (void)segment_name;
    return 0; /* no EFA here: nothing to warm up, as in the published non-EFA builds */
}

MC_EXPORT int removeLocalSegment(transfer_engine_t engine, const char *segment_name) {
    return mc_engine_of(engine) && segment_name ? 0 : ERR_INVALID_ARGUMENT;
}

MC_EXPORT int syncSegmentCache(transfer_engine_t engine) {
    mc_engine *e = mc_engine_of(engine);
    if (!e) return ERR_INVALID_ARGUMENT;
    return (int)mc_call_int(e, ERR_INVALID_ARGUMENT, "sync_segment_cache", "()");
}

MC_EXPORT void enableGracefulShutdown(transfer_engine_t engine) { (void)engine; }

MC_EXPORT int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats, size_t *count) {
    if (!mc_engine_of(engine) || !stats || !count) return -1;
    *count = 0; /* no RDMA NIC statistics are kept */
    return 0;
}

MC_EXPORT int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json) {
    if (!mc_engine_of(engine) || !buf_out || buf_len == 0) return -1;
    snprintf(buf_out, buf_len, "%s", json ? "[]" : "");
    return 0;
}

/* ---- memory ---------------------------------------------------------------------------- */

MC_EXPORT int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length,
                                  const char *location, int remote_accessible) {
    (void)remote_accessible; /* every registered range is reachable by peers */
    mc_engine *e = mc_engine_of(engine);
    if (!e || !addr || !length) return ERR_INVALID_ARGUMENT;
    return (int)mc_call_int(e, ERR_INVALID_ARGUMENT, "register", "Kny",
                            (unsigned long long)(uintptr_t)addr, (Py_ssize_t)length,
                            location ? location : "*");
}

MC_EXPORT int unregisterLocalMemory(transfer_engine_t engine, void *addr) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !addr) return ERR_INVALID_ARGUMENT;
    return (int)mc_call_int(e, ERR_INVALID_ARGUMENT, "unregister", "K",
                            (unsigned long long)(uintptr_t)addr);
}

MC_EXPORT int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list,
                                       size_t buffer_len, const char *location) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || (!buffer_list && buffer_len)) return ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < buffer_len; i++) {
        int rc = registerLocalMemory(engine, buffer_list[i].addr, buffer_list[i].length, location,
                                     1);
        if (rc) {
            while (i--) unregisterLocalMemory(engine, buffer_list[i].addr); /* all or nothing */
            return rc;
        }
    }
    return 0;
}

MC_EXPORT int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list,
                                         size_t addr_len) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || (!addr_list && addr_len)) return ERR_INVALID_ARGUMENT;
    int first_error = 0;
    for (size_t i = 0; i < addr_len; i++) {
        int rc = unregisterLocalMemory(engine, addr_list[i]);
        if (rc && !first_error) first_error = rc;
    }
    return first_error;
}

/* ---- batches --------------------------------------------------------------------------- */

/* The batch of an id (g_lock held), or NULL. */
static mc_batch *mc_batch_locked(mc_engine *e, batch_id_t id, uint32_t *slot_out) {
    uint64_t slot = (id & 0xffffffffu);
    uint32_t gen = (uint32_t)(id >> 32);
    if (slot == 0 || slot > g_nslots) return NULL;
    mc_slot *s = &g_slots[slot - 1];
    if (!s->batch || s->gen != gen || s->batch->engine != e) return NULL;
    if (slot_out) *slot_out = (uint32_t)(slot - 1);
    return s->batch;
}

MC_EXPORT batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || batch_size > ((size_t)1 << 30)) return INVALID_BATCH;
    mc_batch *b = calloc(1, sizeof(*b));
    size_t cap = batch_size < 16 ? (batch_size ? batch_size : 1) : 16;
    if (b) {
        b->alloc = cap;
        b->status = calloc(cap, sizeof(*b->status));
        b->lengths = calloc(cap, sizeof(*b->lengths));
    }
    if (!b || !b->status || !b->lengths) goto fail;
    b->engine = e;
    b->capacity = batch_size;
    pthread_mutex_lock(&g_lock);
    uint32_t slot;
    if (g_nfree) {
        slot = g_free[--g_nfree];
    } else {
        if (g_nslots == g_cap_slots) {
            uint32_t ncap = g_cap_slots ? g_cap_slots * 2 : 64;
            mc_slot *ns = realloc(g_slots, ncap * sizeof(*ns));
            if (ns) g_slots = ns;
            uint32_t *nf = ns ? realloc(g_free, ncap * sizeof(*nf)) : NULL;
            if (nf) g_free = nf;
            if (!ns || !nf || ncap >= 0xffffffffu) {
                pthread_mutex_unlock(&g_lock);
                goto fail;
            }
            g_cap_slots = ncap;
        }
        slot = g_nslots++;
        g_slots[slot].gen = 1;
    }
    g_slots[slot].batch = b;
    if (g_slots[slot].gen == 0xffffffffu) g_slots[slot].gen = 1;
    batch_id_t id = ((uint64_t)g_slots[slot].gen << 32) | (uint64_t)(slot + 1);
    pthread_mutex_unlock(&g_lock);
    return id;
fail:
    if (b) {
        free((void *)b->status);
        free(b->lengths);
        free(b);
    }
    return INVALID_BATCH;
}

static int mc_submit(transfer_engine_t engine, batch_id_t batch_id,
                     struct transfer_request *entries, size_t count, const notify_msg_t *notify) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || (!entries && count)) return S_INVALID_ARGUMENT;
    if (notify && (!notify->name || !notify->msg)) return S_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    mc_batch *b = mc_batch_locked(e, batch_id, NULL);
    if (!b) {
        pthread_mutex_unlock(&g_lock);
        return S_INVALID_ARGUMENT;
    }
    if (count > b->capacity - b->count) {
        pthread_mutex_unlock(&g_lock);
        return S_TOO_MANY_REQUESTS;
    }
    if (b->count + count > b->alloc) { /* grow the task slots (Python holds no pointer to them) */
        size_t want = b->alloc * 2 > b->count + count ? b->alloc * 2 : b->count + count;
        if (want > b->capacity) want = b->capacity;
        _Atomic int *st = realloc((void *)b->status, want * sizeof(*st));
        if (st) b->status = st;
        uint64_t *ln = st ? realloc(b->lengths, want * sizeof(*ln)) : NULL;
        if (ln) b->lengths = ln;
        if (!st || !ln) {
            pthread_mutex_unlock(&g_lock);
            return S_TOO_MANY_REQUESTS;
        }
        b->alloc = want;
    }
    size_t first = b->count;
    for (size_t i = 0; i < count; i++) {
        b->lengths[first + i] = entries[i].length;
        atomic_store_explicit(&b->status[first + i], STATUS_WAITING, memory_order_relaxed);
    }
    b->count += count;
    pthread_mutex_unlock(&g_lock);
    if (!count) return S_OK;

    PyGILState_STATE gs = mc_gil();
    long rc = S_INVALID_ARGUMENT;
    static PyObject *submit_name;
    if (!submit_name) submit_name = PyUnicode_InternFromString("submit");
    /* a copy: Python never keeps a view of the caller's array */
    PyObject *raw = PyBytes_FromStringAndSize((const char *)entries,
                                             (Py_ssize_t)(count * sizeof(*entries)));
    PyObject *pb = PyLong_FromVoidPtr(b), *pf = PyLong_FromSize_t(first);
    PyObject *nn = notify ? PyBytes_FromString(notify->name) : Py_NewRef(Py_None);
    PyObject *nm = notify ? PyBytes_FromString(notify->msg) : Py_NewRef(Py_None);
    PyObject *r = NULL;
    if (submit_name && raw && pb && pf && nn && nm)
        r = PyObject_CallMethodObjArgs(e->py, submit_name, pb, pf, raw, nn, nm, NULL);
    if (r) {
        rc = PyLong_AsLong(r);
        if (rc == -1 && PyErr_Occurred()) rc = S_INVALID_ARGUMENT;
    }
    if (PyErr_Occurred()) PyErr_Print();
    Py_XDECREF(r);
    Py_XDECREF(raw);
    Py_XDECREF(pb);
    Py_XDECREF(pf);
    Py_XDECREF(nn);
    Py_XDECREF(nm);
    PyGILState_Release(gs);

    if (rc == MC_DONE_INLINE) {
        mc_cabi_finish(b, first, count, STATUS_COMPLETED);
        return S_OK;
    }
    if (rc != S_OK) {
        /* refused before anything moved: take the tasks back (or fail them if others followed) */
        pthread_mutex_lock(&g_lock);
        if (b->count == first + count)
            b->count = first;
        else
            mc_set_locked(b, first, count, STATUS_FAILED);
        pthread_mutex_unlock(&g_lock);
    }
    return (int)rc;
}

MC_EXPORT int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count) {
    return mc_submit(engine, batch_id, entries, count, NULL);
}

MC_EXPORT int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                                       struct transfer_request *entries, size_t count,
                                       notify_msg_t notify_msg) {
    return mc_submit(engine, batch_id, entries, count, &notify_msg);
}

MC_EXPORT int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id,
                                struct transfer_status *status) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !status) return S_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    mc_batch *b = mc_batch_locked(e, batch_id, NULL);
    if (!b || task_id >= b->count) {
        pthread_mutex_unlock(&g_lock);
        return S_INVALID_ARGUMENT;
    }
    int s = atomic_load_explicit(&b->status[task_id], memory_order_acquire);
    if (s == STATUS_WAITING) {
        /* callers spin on this (TensorRT-LLM does): rather than burn the core the engine needs,
         * wait a little for a task to end (woken at once when one does) */
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += MC_POLL_WAIT_NS;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g_done, &g_lock, &until);
        b = mc_batch_locked(e, batch_id, NULL); /* freed meanwhile by another thread? */
        if (!b || task_id >= b->count) {
            pthread_mutex_unlock(&g_lock);
            return S_INVALID_ARGUMENT;
        }
        s = atomic_load_explicit(&b->status[task_id], memory_order_acquire);
    }
    status->status = s;
    status->transferred_bytes = s == STATUS_COMPLETED ? b->lengths[task_id] : 0;
    pthread_mutex_unlock(&g_lock);
    return S_OK;
}

MC_EXPORT int freeBatchID(transfer_engine_t engine, batch_id_t batch_id) {
    mc_engine *e = mc_engine_of(engine);
    if (!e) return S_INVALID_ARGUMENT;
    uint32_t slot;
    pthread_mutex_lock(&g_lock);
    mc_batch *b = mc_batch_locked(e, batch_id, &slot);
    if (!b) {
        pthread_mutex_unlock(&g_lock);
        return S_INVALID_ARGUMENT;
    }
    for (size_t i = 0; i < b->count; i++)
        if (atomic_load_explicit(&b->status[i], memory_order_acquire) == STATUS_WAITING) {
            pthread_mutex_unlock(&g_lock);
            return S_BATCH_BUSY;
        }
    mc_free_batch_locked(slot);
    pthread_mutex_unlock(&g_lock);
    return S_OK;
}

/* ---- notifications --------------------------------------------------------------------- */

MC_EXPORT int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,
                                notify_msg_t notify_msg) {
    mc_engine *e = mc_engine_of(engine);
    if (!e || !notify_msg.name || !notify_msg.msg) return ERR_INVALID_ARGUMENT;
    if (target_id > INT32_MAX) return ERR_METADATA;
    return (int)mc_call_int(e, ERR_METADATA, "notify", "iyy", (int)target_id, notify_msg.name,
                            notify_msg.msg);
}

static char *mc_strdup_bytes(PyObject *o) {
    char *s;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(o, &s, &n) < 0) return NULL;
    char *out = malloc((size_t)n + 1);
    if (!out) return NULL;
    memcpy(out, s, (size_t)n);
    out[n] = 0;
    return out;
}

MC_EXPORT notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size) {
    mc_engine *e = mc_engine_of(engine);
    if (size) *size = 0;
    if (!e || !size) return NULL;
    PyGILState_STATE gs = mc_gil();
    notify_msg_t *out = NULL;
    PyObject *lst = PyObject_CallMethod(e->py, "get_notifies", NULL);
    Py_ssize_t n = lst && PyList_Check(lst) ? PyList_GET_SIZE(lst) : 0;
    if (n > 0 && n <= INT_MAX) out = calloc((size_t)n, sizeof(*out));
    if (out) {
        Py_ssize_t i;
        for (i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(lst, i); /* (name: bytes, msg: bytes) */
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) break;
            out[i].name = mc_strdup_bytes(PyTuple_GET_ITEM(item, 0));
            out[i].msg = mc_strdup_bytes(PyTuple_GET_ITEM(item, 1));
            if (!out[i].name || !out[i].msg) break;
        }
        if (i == n) {
            *size = (int)n;
        } else {
            freeNotifsMsgBuf(out, (int)n);
            out = NULL;
        }
    }
    if (PyErr_Occurred()) PyErr_Print();
    Py_XDECREF(lst);
    PyGILState_Release(gs);
    return out;
}

MC_EXPORT int freeNotifsMsgBuf(notify_msg_t *msg, int size) {
    if (!msg) return 0;
    for (int i = 0; i < size; i++) {
        free(msg[i].name);
        free(msg[i].msg);
    }
    free(msg);
    return 0;
}
