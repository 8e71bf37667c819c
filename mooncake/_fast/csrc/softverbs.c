/*
 * mcsoftverbs: a software verbs provider, ABI-compatible with the slice of libibverbs that
 * mooncake uses, for RC queue pairs between processes of one host.
 *
 * It exports the libibverbs entry points by their real names (ibv_get_device_list,
 * ibv_open_device, ibv_reg_mr, ibv_create_qp, ...) and fills ``ibv_context.ops`` with
 * post_send / post_recv / poll_cq / req_notify_cq, the slots verbs.h's inline functions jump
 * through. Loading this library instead of libibverbs.so.1 (MOONCAKE_IBVERBS=<path>) makes the
 * unchanged verbs layer run without any RDMA hardware or kernel support.
 *
 * The "fabric" is one shared file (MC_SOFTVERBS_FABRIC, default /dev/shm/mcsoftverbs-<uid>)
 * mapped by every process: the devices (fake NICs, port state, injected faults), every QP
 * (owner pid, state, peer) and every MR (owner, PD, range, access, key). A WR is executed at
 * post time by the *initiator*, as an RNIC would without the target's CPU: the provider checks
 * the local lkeys, finds the connected peer QP, checks its state, access flags and the rkey
 * against the peer's MR table, then moves the bytes with process_vm_writev/readv (plain memmove
 * when both ends are this process) and queues the completion on the send CQ, writing the CQ's
 * handle to its completion channel if it was armed.
 *
 * Error semantics follow an RC QP on a real RNIC:
 *  - bad lkey / range / access on the local SGE     -> IBV_WC_LOC_PROT_ERR
 *  - bad rkey / range / access, or QP access flags  -> IBV_WC_REM_ACCESS_ERR
 *  - peer QP gone, not connected to us, owner dead, port down -> IBV_WC_RETRY_EXC_ERR
 *  - after any error the QP is in ERR and every later WR completes with IBV_WC_WR_FLUSH_ERR;
 *    error completions are generated even for unsignaled WRs.
 *  - posting in RESET/INIT/RTR, an unsupported opcode, too many SGEs or a full send queue
 *    fails the post itself (EINVAL / ENOMEM with *bad_wr set).
 * A CQ overrun makes every later ibv_poll_cq fail (as the CQ_ERR async event would).
 *
 * Test hooks (not part of libibverbs): mcsv_inject_fault, mcsv_set_port_state,
 * mcsv_live_objects (per-process counters of live contexts/PDs/MRs/CQs/QPs/channels).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "mc_verbs_abi.h"

#define EXPORT __attribute__((visibility("default")))

#define SV_MAGIC 0x5653434dU /* "MCSV" */
#define SV_VERSION 3U
#define SV_MAX_DEV 16
#define SV_MAX_QP 4096
#define SV_MAX_MR 16384
#define SV_QPN_BASE 0x100
#define SV_MAX_WR 16384
#define SV_MAX_SGE 16
#define SV_MAX_INLINE 256
#define SV_MAX_CQE (1 << 20)
#define SV_MAX_MSG (1U << 31)

/* ---- the shared fabric ------------------------------------------------------------------ */

struct sv_dev_shared {
    char name[MCV_SYSFS_NAME_MAX];
    int32_t used;
    int32_t port_state;   /* MCV_PORT_ACTIVE or MCV_PORT_DOWN */
    int32_t fault_status; /* completion status for injected faults */
    int32_t fault_count;  /* how many more WRs through this device fail */
    int32_t stalled;      /* WRs through this device are accepted but never complete */
    int32_t pad;
    uint64_t wr_count;    /* WRs executed through this device (either end) */
};

struct sv_qp_shared {
    int32_t owner; /* pid, 0 = free */
    uint32_t qpn;
    int32_t dev;
    int32_t state;
    uint32_t dest_qpn;
    int32_t dest_dev;
    uint64_t pd_id;
    uint32_t access;
    uint32_t pad;
};

struct sv_mr_shared {
    int32_t owner; /* pid, 0 = free */
    uint32_t key;
    uint64_t pd_id;
    uint64_t addr;
    uint64_t length;
    uint32_t access;
    uint32_t pad;
};

struct sv_fabric {
    uint32_t magic;
    uint32_t version;
    uint32_t key_salt;
    uint32_t pad;
    struct sv_dev_shared devs[SV_MAX_DEV];
    struct sv_qp_shared qps[SV_MAX_QP];
    struct sv_mr_shared mrs[SV_MAX_MR];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sv_fabric *g_fab;
static int g_fab_fd = -1;
static int g_fab_refs;
static pid_t g_pid;

/* live object counters: contexts, pds, mrs, cqs, qps, channels */
enum { LIVE_CTX, LIVE_PD, LIVE_MR, LIVE_CQ, LIVE_QP, LIVE_CH, LIVE_N };
static atomic_int g_live[LIVE_N];

/* Lock order: qp->lock -> fabric lock -> cq->lock. The fabric lock is a process-local mutex
 * (threads share one flock) plus flock on the fabric file (released by the kernel if a process
 * dies holding it). */
static void fab_lock(void) {
    pthread_mutex_lock(&g_lock);
    while (flock(g_fab_fd, LOCK_EX) != 0 && errno == EINTR) {
    }
}

static void fab_unlock(void) {
    flock(g_fab_fd, LOCK_UN);
    pthread_mutex_unlock(&g_lock);
}

static int pid_alive(pid_t pid) {
    if (pid == g_pid)
        return 1;
    return !(kill(pid, 0) != 0 && errno == ESRCH);
}

static const char *fabric_path(char *buf, size_t n) {
    const char *p = getenv("MC_SOFTVERBS_FABRIC");
    if (p && *p)
        return p;
    snprintf(buf, n, "/dev/shm/mcsoftverbs-%u", (unsigned)getuid());
    return buf;
}

/* Map the fabric (refcounted per process); g_lock held by the caller. */
static int fabric_get(void) {
    char buf[256];
    if (g_fab) {
        g_fab_refs++;
        return 0;
    }
    const char *path = fabric_path(buf, sizeof buf);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return errno;
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
            int e = errno;
            close(fd);
            return e;
        }
    }
    struct stat st;
    int err = 0;
    if (fstat(fd, &st) != 0)
        err = errno;
    else if ((size_t)st.st_size < sizeof(struct sv_fabric) &&
             ftruncate(fd, sizeof(struct sv_fabric)) != 0)
        err = errno;
    void *m = MAP_FAILED;
    if (!err) {
        m = mmap(NULL, sizeof(struct sv_fabric), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            err = errno;
    }
    if (!err) {
        struct sv_fabric *f = m;
        if (f->magic == 0) {
            f->version = SV_VERSION;
            f->key_salt = (uint32_t)getpid();
            f->magic = SV_MAGIC;
        } else if (f->magic != SV_MAGIC || f->version != SV_VERSION) {
            err = EPROTO;
            munmap(m, sizeof(struct sv_fabric));
        }
    }
    flock(fd, LOCK_UN);
    if (err) {
        close(fd);
        return err;
    }
    g_fab = m;
    g_fab_fd = fd;
    g_fab_refs = 1;
    g_pid = getpid();
    /* process_vm_writev needs ptrace rights on the peer; under Yama ptrace_scope=1 a peer
     * that is not our descendant must allow it. */
#ifdef PR_SET_PTRACER
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
    return 0;
}

static void fabric_put(void) {
    if (--g_fab_refs == 0) {
        munmap(g_fab, sizeof(struct sv_fabric));
        close(g_fab_fd);
        g_fab = NULL;
        g_fab_fd = -1;
    }
}

/* Device slot for ``name`` (allocated on first use); fabric lock held. */
static int dev_slot(const char *name) {
    int free_slot = -1;
    for (int i = 0; i < SV_MAX_DEV; i++) {
        if (g_fab->devs[i].used) {
            if (strncmp(g_fab->devs[i].name, name, MCV_SYSFS_NAME_MAX) == 0)
                return i;
        } else if (free_slot < 0) {
            free_slot = i;
        }
    }
    if (free_slot < 0)
        return -1;
    struct sv_dev_shared *d = &g_fab->devs[free_slot];
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name);
    d->port_state = MCV_PORT_ACTIVE;
    d->used = 1;
    return free_slot;
}

static int dev_by_name(const char *name) {
    for (int i = 0; i < SV_MAX_DEV; i++)
        if (g_fab->devs[i].used && strncmp(g_fab->devs[i].name, name, MCV_SYSFS_NAME_MAX) == 0)
            return i;
    return -1;
}

static int link_is_ethernet(void) {
    const char *v = getenv("MC_SOFTVERBS_LINK_LAYER");
    return v && (strcmp(v, "ethernet") == 0 || strcmp(v, "roce") == 0);
}

static void dev_gid(int slot, union mcv_gid *gid) {
    memset(gid, 0, sizeof *gid);
    gid->raw[0] = 0xfe;
    gid->raw[1] = 0x80;
    gid->raw[8] = 'M';
    gid->raw[9] = 'C';
    gid->raw[10] = 'S';
    gid->raw[11] = 'V';
    gid->raw[15] = (uint8_t)(slot + 1);
}

static uint16_t dev_lid(int slot) { return link_is_ethernet() ? 0 : (uint16_t)(slot + 1); }

/* ---- local objects ---------------------------------------------------------------------- */

struct sv_context {
    struct mcv_context ibv;
    struct mcv_device *dev_copy;
    int slot;
    int async_wfd;
};

struct sv_pd {
    struct mcv_pd ibv;
    uint64_t id;
    atomic_int children;
};

struct sv_mr {
    struct mcv_mr ibv;
    int slot;
};

struct sv_channel {
    struct mcv_comp_channel ibv;
    int wfd;
};

struct sv_cqe_meta {
    struct sv_qp *qp;
    uint32_t retire;
};

struct sv_cq {
    struct mcv_cq ibv;
    pthread_mutex_t lock;
    struct mcv_wc *ring;
    struct sv_cqe_meta *meta;
    int cap, head, count;
    int armed;
    int overrun;
    atomic_int qps;
    uint32_t events_reported;
};

struct sv_qp {
    struct mcv_qp ibv;
    pthread_mutex_t lock;
    int slot;
    int dev;
    struct mcv_qp_cap cap;
    int sq_sig_all;
    uint32_t outstanding;     /* WRs posted and not yet retired by a polled CQE */
    uint32_t pending_retire;  /* unsignaled WRs waiting for the next CQE */
    uint32_t dest_qpn;
    int dest_dev;
    uint32_t access;
    uint64_t pd_id;
    uint64_t *stall_ids; /* WRs swallowed by a stalled device: flushed on ERR, dropped on RESET */
    int *stall_ops;
    uint32_t nstall;
};

/* ---- device list / context -------------------------------------------------------------- */

EXPORT struct mcv_device **ibv_get_device_list(int *num_devices) {
    const char *env = getenv("MC_SOFTVERBS_DEVICES");
    if (!env)
        env = "soft0";
    char *copy = strdup(env);
    if (!copy) {
        errno = ENOMEM;
        return NULL;
    }
    int n = 0;
    struct mcv_device **list = calloc(SV_MAX_DEV + 1, sizeof *list);
    if (!list) {
        free(copy);
        errno = ENOMEM;
        return NULL;
    }
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && n < SV_MAX_DEV;
         tok = strtok_r(NULL, ",", &save)) {
        if (!*tok)
            continue;
        struct mcv_device *d = calloc(1, sizeof *d);
        if (!d)
            break;
        d->node_type = MCV_NODE_CA;
        d->transport_type = MCV_TRANSPORT_IB;
        snprintf(d->name, sizeof d->name, "%s", tok);
        snprintf(d->dev_name, sizeof d->dev_name, "uverbs%d", n);
        snprintf(d->dev_path, sizeof d->dev_path, "/sys/class/infiniband_verbs/uverbs%d", n);
        snprintf(d->ibdev_path, sizeof d->ibdev_path, "/sys/class/infiniband/%s", tok);
        list[n++] = d;
    }
    free(copy);
    if (num_devices)
        *num_devices = n;
    return list;
}

EXPORT void ibv_free_device_list(struct mcv_device **list) {
    if (!list)
        return;
    for (int i = 0; list[i]; i++)
        free(list[i]);
    free(list);
}

EXPORT const char *ibv_get_device_name(struct mcv_device *device) { return device->name; }

EXPORT uint64_t ibv_get_device_guid(struct mcv_device *device) {
    uint64_t h = 1469598103934665603ULL;
    for (const char *p = device->name; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ULL;
    return h;
}

static int sv_poll_cq(struct mcv_cq *cq, int n, struct mcv_wc *wc);
static int sv_req_notify_cq(struct mcv_cq *cq, int solicited_only);
static int sv_post_send(struct mcv_qp *qp, struct mcv_send_wr *wr, struct mcv_send_wr **bad);
static int sv_post_recv(struct mcv_qp *qp, struct mcv_recv_wr *wr, struct mcv_recv_wr **bad);

EXPORT struct mcv_context *ibv_open_device(struct mcv_device *device) {
    struct sv_context *c = calloc(1, sizeof *c);
    if (!c) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    int err = fabric_get();
    pthread_mutex_unlock(&g_lock);
    if (err) {
        free(c);
        errno = err;
        return NULL;
    }
    fab_lock();
    c->slot = dev_slot(device->name);
    fab_unlock();
    if (c->slot < 0) {
        pthread_mutex_lock(&g_lock);
        fabric_put();
        pthread_mutex_unlock(&g_lock);
        free(c);
        errno = ENOSPC;
        return NULL;
    }
    /* like libibverbs, the context must outlive ibv_free_device_list */
    c->dev_copy = malloc(sizeof *c->dev_copy);
    if (!c->dev_copy) {
        pthread_mutex_lock(&g_lock);
        fabric_put();
        pthread_mutex_unlock(&g_lock);
        free(c);
        errno = ENOMEM;
        return NULL;
    }
    *c->dev_copy = *device;
    c->ibv.device = c->dev_copy;
    c->ibv.ops.poll_cq = sv_poll_cq;
    c->ibv.ops.req_notify_cq = sv_req_notify_cq;
    c->ibv.ops.post_send = sv_post_send;
    c->ibv.ops.post_recv = sv_post_recv;
    /* an fd that pollers may watch; the provider never raises async events on it */
    int afd[2];
    if (pipe2(afd, O_CLOEXEC | O_NONBLOCK) != 0) {
        int e = errno;
        pthread_mutex_lock(&g_lock);
        fabric_put();
        pthread_mutex_unlock(&g_lock);
        free(c->dev_copy);
        free(c);
        errno = e;
        return NULL;
    }
    c->async_wfd = afd[1];
    c->ibv.cmd_fd = -1;
    c->ibv.async_fd = afd[0];
    c->ibv.num_comp_vectors = 1;
    pthread_mutex_init(&c->ibv.mutex, NULL);
    atomic_fetch_add(&g_live[LIVE_CTX], 1);
    return &c->ibv;
}

EXPORT int ibv_close_device(struct mcv_context *context) {
    struct sv_context *c = (struct sv_context *)context;
    pthread_mutex_destroy(&c->ibv.mutex);
    close(c->ibv.async_fd);
    close(c->async_wfd);
    free(c->dev_copy);
    free(c);
    pthread_mutex_lock(&g_lock);
    fabric_put();
    pthread_mutex_unlock(&g_lock);
    atomic_fetch_sub(&g_live[LIVE_CTX], 1);
    return 0;
}

EXPORT int ibv_query_device(struct mcv_context *context, struct mcv_device_attr *attr) {
    struct sv_context *c = (struct sv_context *)context;
    memset(attr, 0, sizeof *attr);
    snprintf(attr->fw_ver, sizeof attr->fw_ver, "mcsoftverbs-%u", SV_VERSION);
    attr->node_guid = ibv_get_device_guid(c->ibv.device);
    attr->sys_image_guid = attr->node_guid;
    attr->max_mr_size = 1ULL << 40;
    attr->page_size_cap = 4096;
    attr->vendor_id = 0x4d43;
    attr->max_qp = SV_MAX_QP;
    attr->max_qp_wr = SV_MAX_WR;
    attr->max_sge = SV_MAX_SGE;
    attr->max_sge_rd = SV_MAX_SGE;
    attr->max_cq = 1 << 16;
    attr->max_cqe = SV_MAX_CQE;
    attr->max_mr = SV_MAX_MR;
    attr->max_pd = 1 << 16;
    attr->max_qp_rd_atom = 16;
    attr->max_res_rd_atom = 16 * SV_MAX_QP;
    attr->max_qp_init_rd_atom = 16;
    attr->max_pkeys = 1;
    attr->phys_port_cnt = 1;
    return 0;
}

EXPORT int ibv_query_port(struct mcv_context *context, uint8_t port, struct mcv_port_attr *attr) {
    struct sv_context *c = (struct sv_context *)context;
    if (port != 1)
        return EINVAL;
    /* only the compat prefix (up to ``flags``) is ours to write, as libibverbs' export does */
    memset(attr, 0, offsetof(struct mcv_port_attr, port_cap_flags2));
    fab_lock();
    attr->state = g_fab->devs[c->slot].port_state;
    fab_unlock();
    attr->max_mtu = MCV_MTU_4096;
    attr->active_mtu = MCV_MTU_4096;
    attr->gid_tbl_len = 1;
    attr->max_msg_sz = SV_MAX_MSG;
    attr->pkey_tbl_len = 1;
    attr->lid = dev_lid(c->slot);
    attr->sm_lid = 1;
    attr->max_vl_num = 1;
    attr->active_width = 2; /* 4x */
    attr->active_speed = 32;
    attr->phys_state = attr->state == MCV_PORT_ACTIVE ? 5 : 3;
    attr->link_layer = link_is_ethernet() ? MCV_LINK_LAYER_ETHERNET : MCV_LINK_LAYER_INFINIBAND;
    return 0;
}

EXPORT int ibv_query_gid(struct mcv_context *context, uint8_t port, int index, union mcv_gid *gid) {
    struct sv_context *c = (struct sv_context *)context;
    if (port != 1 || index != 0)
        return -1;
    dev_gid(c->slot, gid);
    return 0;
}

/* ---- PD / MR ---------------------------------------------------------------------------- */

static atomic_uint_fast64_t g_pd_counter;

EXPORT struct mcv_pd *ibv_alloc_pd(struct mcv_context *context) {
    struct sv_pd *pd = calloc(1, sizeof *pd);
    if (!pd) {
        errno = ENOMEM;
        return NULL;
    }
    pd->ibv.context = context;
    pd->id = ((uint64_t)getpid() << 32) | (atomic_fetch_add(&g_pd_counter, 1) + 1);
    pd->ibv.handle = (uint32_t)pd->id;
    atomic_fetch_add(&g_live[LIVE_PD], 1);
    return &pd->ibv;
}

EXPORT int ibv_dealloc_pd(struct mcv_pd *ibpd) {
    struct sv_pd *pd = (struct sv_pd *)ibpd;
    if (atomic_load(&pd->children) > 0)
        return EBUSY;
    free(pd);
    atomic_fetch_sub(&g_live[LIVE_PD], 1);
    return 0;
}

EXPORT struct mcv_mr *ibv_reg_mr(struct mcv_pd *ibpd, void *addr, size_t length, int access) {
    struct sv_pd *pd = (struct sv_pd *)ibpd;
    if (length == 0 || (uint64_t)(uintptr_t)addr + length < (uint64_t)(uintptr_t)addr) {
        errno = EINVAL;
        return NULL;
    }
    /* remote write/atomic without local write is refused by every provider */
    if ((access & (MCV_ACCESS_REMOTE_WRITE | MCV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & MCV_ACCESS_LOCAL_WRITE)) {
        errno = EINVAL;
        return NULL;
    }
    struct sv_mr *mr = calloc(1, sizeof *mr);
    if (!mr) {
        errno = ENOMEM;
        return NULL;
    }
    fab_lock();
    int slot = -1;
    for (int i = 0; i < SV_MAX_MR; i++) {
        struct sv_mr_shared *e = &g_fab->mrs[i];
        if (e->owner == 0 || !pid_alive(e->owner)) {
            slot = i;
            break;
        }
    }
    if (slot < 0) {
        fab_unlock();
        free(mr);
        errno = ENOMEM;
        return NULL;
    }
    struct sv_mr_shared *e = &g_fab->mrs[slot];
    uint32_t salt = (++g_fab->key_salt) & 0xffU;
    e->key = ((uint32_t)slot << 8) | salt;
    e->pd_id = pd->id;
    e->addr = (uint64_t)(uintptr_t)addr;
    e->length = length;
    e->access = (uint32_t)access;
    e->owner = g_pid;
    fab_unlock();
    mr->slot = slot;
    mr->ibv.context = ibpd->context;
    mr->ibv.pd = ibpd;
    mr->ibv.addr = addr;
    mr->ibv.length = length;
    mr->ibv.handle = e->key;
    mr->ibv.lkey = e->key;
    mr->ibv.rkey = e->key;
    atomic_fetch_add(&pd->children, 1);
    atomic_fetch_add(&g_live[LIVE_MR], 1);
    return &mr->ibv;
}

EXPORT struct mcv_mr *ibv_reg_mr_iova2(struct mcv_pd *pd, void *addr, size_t length, uint64_t iova,
                                       unsigned int access) {
    if (iova != (uint64_t)(uintptr_t)addr) {
        errno = EOPNOTSUPP;
        return NULL;
    }
    return ibv_reg_mr(pd, addr, length, (int)(access & ~(unsigned)MCV_ACCESS_RELAXED_ORDERING));
}

EXPORT int ibv_dereg_mr(struct mcv_mr *ibmr) {
    struct sv_mr *mr = (struct sv_mr *)ibmr;
    fab_lock();
    memset(&g_fab->mrs[mr->slot], 0, sizeof g_fab->mrs[mr->slot]);
    fab_unlock();
    atomic_fetch_sub(&((struct sv_pd *)mr->ibv.pd)->children, 1);
    free(mr);
    atomic_fetch_sub(&g_live[LIVE_MR], 1);
    return 0;
}

/* ---- completion channel / CQ ------------------------------------------------------------ */

EXPORT struct mcv_comp_channel *ibv_create_comp_channel(struct mcv_context *context) {
    struct sv_channel *ch = calloc(1, sizeof *ch);
    if (!ch) {
        errno = ENOMEM;
        return NULL;
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        int e = errno;
        free(ch);
        errno = e;
        return NULL;
    }
    /* the write end never blocks the poster: an event is a wake-up hint, and the reader
     * drains the CQ anyway, so a full pipe loses nothing that matters */
    fcntl(fds[1], F_SETFL, O_NONBLOCK);
    ch->ibv.context = context;
    ch->ibv.fd = fds[0];
    ch->ibv.refcnt = 0;
    ch->wfd = fds[1];
    atomic_fetch_add(&g_live[LIVE_CH], 1);
    return &ch->ibv;
}

EXPORT int ibv_destroy_comp_channel(struct mcv_comp_channel *channel) {
    struct sv_channel *ch = (struct sv_channel *)channel;
    if (__atomic_load_n(&ch->ibv.refcnt, __ATOMIC_SEQ_CST) > 0)
        return EBUSY;
    close(ch->ibv.fd);
    close(ch->wfd);
    free(ch);
    atomic_fetch_sub(&g_live[LIVE_CH], 1);
    return 0;
}

EXPORT struct mcv_cq *ibv_create_cq(struct mcv_context *context, int cqe, void *cq_context,
                                    struct mcv_comp_channel *channel, int comp_vector) {
    if (cqe < 1 || cqe > SV_MAX_CQE || comp_vector != 0) {
        errno = EINVAL;
        return NULL;
    }
    struct sv_cq *cq = calloc(1, sizeof *cq);
    if (!cq) {
        errno = ENOMEM;
        return NULL;
    }
    cq->ring = calloc((size_t)cqe, sizeof *cq->ring);
    cq->meta = calloc((size_t)cqe, sizeof *cq->meta);
    if (!cq->ring || !cq->meta) {
        free(cq->ring);
        free(cq->meta);
        free(cq);
        errno = ENOMEM;
        return NULL;
    }
    cq->cap = cqe;
    pthread_mutex_init(&cq->lock, NULL);
    pthread_mutex_init(&cq->ibv.mutex, NULL);
    pthread_cond_init(&cq->ibv.cond, NULL);
    cq->ibv.context = context;
    cq->ibv.channel = channel;
    cq->ibv.cq_context = cq_context;
    cq->ibv.cqe = cqe;
    if (channel)
        __atomic_add_fetch(&channel->refcnt, 1, __ATOMIC_SEQ_CST);
    atomic_fetch_add(&g_live[LIVE_CQ], 1);
    return &cq->ibv;
}

EXPORT int ibv_destroy_cq(struct mcv_cq *ibcq) {
    struct sv_cq *cq = (struct sv_cq *)ibcq;
    if (atomic_load(&cq->qps) > 0)
        return EBUSY;
    if (cq->ibv.channel)
        __atomic_sub_fetch(&cq->ibv.channel->refcnt, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_destroy(&cq->lock);
    pthread_mutex_destroy(&cq->ibv.mutex);
    pthread_cond_destroy(&cq->ibv.cond);
    free(cq->ring);
    free(cq->meta);
    free(cq);
    atomic_fetch_sub(&g_live[LIVE_CQ], 1);
    return 0;
}

EXPORT int ibv_get_cq_event(struct mcv_comp_channel *channel, struct mcv_cq **cq, void **cq_context) {
    uint64_t handle;
    ssize_t r = read(channel->fd, &handle, sizeof handle);
    if (r != (ssize_t)sizeof handle)
        return -1;
    struct sv_cq *c = (struct sv_cq *)(uintptr_t)handle;
    *cq = &c->ibv;
    *cq_context = c->ibv.cq_context;
    return 0;
}

EXPORT void ibv_ack_cq_events(struct mcv_cq *cq, unsigned int nevents) {
    pthread_mutex_lock(&cq->mutex);
    cq->comp_events_completed += nevents;
    pthread_mutex_unlock(&cq->mutex);
}

static int sv_req_notify_cq(struct mcv_cq *ibcq, int solicited_only) {
    struct sv_cq *cq = (struct sv_cq *)ibcq;
    (void)solicited_only;
    if (!cq->ibv.channel)
        return EINVAL;
    pthread_mutex_lock(&cq->lock);
    cq->armed = 1;
    pthread_mutex_unlock(&cq->lock);
    return 0;
}

/* Queue one CQE; cq->lock is taken here. */
static void cq_push(struct sv_cq *cq, struct sv_qp *qp, uint64_t wr_id, int status, int opcode,
                    uint32_t byte_len, uint32_t retire) {
    int notify = 0;
    pthread_mutex_lock(&cq->lock);
    if (cq->count == cq->cap) {
        cq->overrun = 1;
    } else {
        int i = (cq->head + cq->count) % cq->cap;
        struct mcv_wc *wc = &cq->ring[i];
        memset(wc, 0, sizeof *wc);
        wc->wr_id = wr_id;
        wc->status = status;
        wc->opcode = opcode;
        wc->byte_len = byte_len;
        wc->qp_num = qp->ibv.qp_num;
        wc->vendor_err = status ? 0x100 + (uint32_t)status : 0;
        cq->meta[i].qp = qp;
        cq->meta[i].retire = retire;
        cq->count++;
        if (cq->armed) {
            cq->armed = 0;
            notify = 1;
            cq->events_reported++;
        }
    }
    pthread_mutex_unlock(&cq->lock);
    if (notify) {
        struct sv_channel *ch = (struct sv_channel *)cq->ibv.channel;
        uint64_t handle = (uint64_t)(uintptr_t)cq;
        ssize_t r = write(ch->wfd, &handle, sizeof handle);
        (void)r;
    }
}

static int sv_poll_cq(struct mcv_cq *ibcq, int n, struct mcv_wc *wc) {
    struct sv_cq *cq = (struct sv_cq *)ibcq;
    int got = 0;
    pthread_mutex_lock(&cq->lock);
    if (cq->overrun) {
        pthread_mutex_unlock(&cq->lock);
        return -EOVERFLOW;
    }
    while (got < n && cq->count > 0) {
        wc[got] = cq->ring[cq->head];
        struct sv_qp *qp = cq->meta[cq->head].qp;
        /* retiring frees send-queue slots; the qp is alive: destroy_qp purges its CQEs */
        __atomic_sub_fetch(&qp->outstanding, cq->meta[cq->head].retire, __ATOMIC_SEQ_CST);
        cq->head = (cq->head + 1) % cq->cap;
        cq->count--;
        got++;
    }
    pthread_mutex_unlock(&cq->lock);
    return got;
}

/* Remove every CQE of ``qp`` (as providers do when a QP is destroyed). */
static void cq_purge(struct sv_cq *cq, struct sv_qp *qp) {
    pthread_mutex_lock(&cq->lock);
    int keep = 0;
    for (int k = 0; k < cq->count; k++) {
        int src = (cq->head + k) % cq->cap;
        if (cq->meta[src].qp == qp)
            continue;
        int dst = (cq->head + keep) % cq->cap;
        if (dst != src) {
            cq->ring[dst] = cq->ring[src];
            cq->meta[dst] = cq->meta[src];
        }
        keep++;
    }
    cq->count = keep;
    pthread_mutex_unlock(&cq->lock);
}

/* ---- QP --------------------------------------------------------------------------------- */

EXPORT struct mcv_qp *ibv_create_qp(struct mcv_pd *ibpd, struct mcv_qp_init_attr *attr) {
    struct sv_pd *pd = (struct sv_pd *)ibpd;
    if (attr->qp_type != MCV_QPT_RC || !attr->send_cq || !attr->recv_cq || attr->srq ||
        attr->cap.max_send_wr < 1 || attr->cap.max_send_wr > SV_MAX_WR ||
        attr->cap.max_recv_wr > SV_MAX_WR || attr->cap.max_send_sge > SV_MAX_SGE ||
        attr->cap.max_recv_sge > SV_MAX_SGE || attr->cap.max_inline_data > SV_MAX_INLINE) {
        errno = EINVAL;
        return NULL;
    }
    struct sv_qp *qp = calloc(1, sizeof *qp);
    if (qp) {
        qp->stall_ids = calloc(attr->cap.max_send_wr, sizeof *qp->stall_ids);
        qp->stall_ops = calloc(attr->cap.max_send_wr, sizeof *qp->stall_ops);
    }
    if (!qp || !qp->stall_ids || !qp->stall_ops) {
        if (qp) {
            free(qp->stall_ids);
            free(qp->stall_ops);
        }
        free(qp);
        errno = ENOMEM;
        return NULL;
    }
    struct sv_context *ctx = (struct sv_context *)ibpd->context;
    fab_lock();
    int slot = -1;
    for (int i = 0; i < SV_MAX_QP; i++) {
        struct sv_qp_shared *e = &g_fab->qps[i];
        if (e->owner == 0 || !pid_alive(e->owner)) {
            slot = i;
            break;
        }
    }
    if (slot < 0) {
        fab_unlock();
        free(qp->stall_ids);
        free(qp->stall_ops);
        free(qp);
        errno = ENOMEM;
        return NULL;
    }
    struct sv_qp_shared *e = &g_fab->qps[slot];
    memset(e, 0, sizeof *e);
    e->qpn = SV_QPN_BASE + (uint32_t)slot;
    e->dev = ctx->slot;
    e->state = MCV_QPS_RESET;
    e->pd_id = pd->id;
    e->dest_dev = -1;
    e->owner = g_pid;
    fab_unlock();
    pthread_mutex_init(&qp->lock, NULL);
    pthread_mutex_init(&qp->ibv.mutex, NULL);
    pthread_cond_init(&qp->ibv.cond, NULL);
    qp->slot = slot;
    qp->dev = ctx->slot;
    qp->pd_id = pd->id;
    qp->cap = attr->cap;
    if (qp->cap.max_send_sge == 0)
        qp->cap.max_send_sge = 1;
    qp->sq_sig_all = attr->sq_sig_all;
    qp->dest_dev = -1;
    qp->ibv.context = ibpd->context;
    qp->ibv.qp_context = attr->qp_context;
    qp->ibv.pd = ibpd;
    qp->ibv.send_cq = attr->send_cq;
    qp->ibv.recv_cq = attr->recv_cq;
    qp->ibv.handle = (uint32_t)slot;
    qp->ibv.qp_num = SV_QPN_BASE + (uint32_t)slot;
    qp->ibv.state = MCV_QPS_RESET;
    qp->ibv.qp_type = MCV_QPT_RC;
    atomic_fetch_add(&pd->children, 1);
    atomic_fetch_add(&((struct sv_cq *)attr->send_cq)->qps, 1);
    atomic_fetch_add(&((struct sv_cq *)attr->recv_cq)->qps, 1);
    atomic_fetch_add(&g_live[LIVE_QP], 1);
    return &qp->ibv;
}

static void cq_push(struct sv_cq *cq, struct sv_qp *qp, uint64_t wr_id, int status, int opcode,
                    uint32_t byte_len, uint32_t retire);

static void qp_set_state(struct sv_qp *qp, int state) {
    qp->ibv.state = state;
    g_fab->qps[qp->slot].state = state;
    if (state == MCV_QPS_ERR) {
        /* swallowed WRs come back flushed, as everything outstanding does on a real RNIC */
        for (uint32_t i = 0; i < qp->nstall; i++)
            cq_push((struct sv_cq *)qp->ibv.send_cq, qp, qp->stall_ids[i], MCV_WC_WR_FLUSH_ERR,
                    qp->stall_ops[i], 0, 1);
        qp->nstall = 0;
    } else if (state == MCV_QPS_RESET) {
        __atomic_sub_fetch(&qp->outstanding, qp->nstall + qp->pending_retire, __ATOMIC_SEQ_CST);
        qp->nstall = 0;
        qp->pending_retire = 0;
    }
}

/* Resolve the device an address vector points at; fabric lock held. */
static int av_device(const struct mcv_ah_attr *ah) {
    if (ah->is_global) {
        for (int i = 0; i < SV_MAX_DEV; i++) {
            if (!g_fab->devs[i].used)
                continue;
            union mcv_gid g;
            dev_gid(i, &g);
            if (memcmp(g.raw, ah->grh.dgid.raw, 16) == 0)
                return i;
        }
        return -1;
    }
    if (link_is_ethernet())
        return -1; /* RoCE needs a GRH */
    int slot = (int)ah->dlid - 1;
    if (slot < 0 || slot >= SV_MAX_DEV || !g_fab->devs[slot].used)
        return -1;
    return slot;
}

EXPORT int ibv_modify_qp(struct mcv_qp *ibqp, struct mcv_qp_attr *attr, int mask) {
    struct sv_qp *qp = (struct sv_qp *)ibqp;
    int rc = 0;
    pthread_mutex_lock(&qp->lock);
    int cur = qp->ibv.state;
    if (mask & MCV_QP_CUR_STATE && attr->cur_qp_state != cur) {
        pthread_mutex_unlock(&qp->lock);
        return EINVAL;
    }
    if (!(mask & MCV_QP_STATE)) {
        pthread_mutex_unlock(&qp->lock);
        return EINVAL;
    }
    int next = attr->qp_state;
    const int init_req = MCV_QP_STATE | MCV_QP_PKEY_INDEX | MCV_QP_PORT | MCV_QP_ACCESS_FLAGS;
    const int rtr_req = MCV_QP_STATE | MCV_QP_AV | MCV_QP_PATH_MTU | MCV_QP_DEST_QPN |
                        MCV_QP_RQ_PSN | MCV_QP_MAX_DEST_RD_ATOMIC | MCV_QP_MIN_RNR_TIMER;
    const int rts_req = MCV_QP_STATE | MCV_QP_TIMEOUT | MCV_QP_RETRY_CNT | MCV_QP_RNR_RETRY |
                        MCV_QP_SQ_PSN | MCV_QP_MAX_QP_RD_ATOMIC;
    fab_lock();
    if (next == MCV_QPS_RESET || next == MCV_QPS_ERR) {
        if (next == MCV_QPS_RESET) {
            qp->dest_dev = -1;
            qp->dest_qpn = 0;
            g_fab->qps[qp->slot].dest_dev = -1;
            g_fab->qps[qp->slot].dest_qpn = 0;
        }
        qp_set_state(qp, next);
    } else if (cur == MCV_QPS_RESET && next == MCV_QPS_INIT) {
        if ((mask & init_req) != init_req || attr->port_num != 1 || attr->pkey_index != 0)
            rc = EINVAL;
        else {
            qp->access = attr->qp_access_flags;
            g_fab->qps[qp->slot].access = attr->qp_access_flags;
            qp_set_state(qp, next);
        }
    } else if (cur == MCV_QPS_INIT && next == MCV_QPS_RTR) {
        int dev = (mask & MCV_QP_AV) ? av_device(&attr->ah_attr) : -1;
        if ((mask & rtr_req) != rtr_req || attr->path_mtu < MCV_MTU_256 || attr->path_mtu > MCV_MTU_4096)
            rc = EINVAL;
        else if (dev < 0)
            rc = EINVAL; /* no such destination on this fabric */
        else {
            qp->dest_dev = dev;
            qp->dest_qpn = attr->dest_qp_num;
            g_fab->qps[qp->slot].dest_dev = dev;
            g_fab->qps[qp->slot].dest_qpn = attr->dest_qp_num;
            if (mask & MCV_QP_ACCESS_FLAGS) {
                qp->access = attr->qp_access_flags;
                g_fab->qps[qp->slot].access = attr->qp_access_flags;
            }
            qp_set_state(qp, next);
        }
    } else if (cur == MCV_QPS_RTR && next == MCV_QPS_RTS) {
        if ((mask & rts_req) != rts_req)
            rc = EINVAL;
        else
            qp_set_state(qp, next);
    } else if (cur == next && (cur == MCV_QPS_INIT || cur == MCV_QPS_RTS)) {
        if (mask & MCV_QP_ACCESS_FLAGS) {
            qp->access = attr->qp_access_flags;
            g_fab->qps[qp->slot].access = attr->qp_access_flags;
        }
    } else {
        rc = EINVAL;
    }
    fab_unlock();
    pthread_mutex_unlock(&qp->lock);
    return rc;
}

EXPORT int ibv_query_qp(struct mcv_qp *ibqp, struct mcv_qp_attr *attr, int mask,
                        struct mcv_qp_init_attr *init_attr) {
    struct sv_qp *qp = (struct sv_qp *)ibqp;
    (void)mask;
    pthread_mutex_lock(&qp->lock);
    memset(attr, 0, sizeof *attr);
    attr->qp_state = qp->ibv.state;
    attr->cur_qp_state = qp->ibv.state;
    attr->dest_qp_num = qp->dest_qpn;
    attr->qp_access_flags = qp->access;
    attr->cap = qp->cap;
    attr->port_num = 1;
    if (init_attr) {
        memset(init_attr, 0, sizeof *init_attr);
        init_attr->qp_context = qp->ibv.qp_context;
        init_attr->send_cq = qp->ibv.send_cq;
        init_attr->recv_cq = qp->ibv.recv_cq;
        init_attr->cap = qp->cap;
        init_attr->qp_type = MCV_QPT_RC;
        init_attr->sq_sig_all = qp->sq_sig_all;
    }
    pthread_mutex_unlock(&qp->lock);
    return 0;
}

EXPORT int ibv_destroy_qp(struct mcv_qp *ibqp) {
    struct sv_qp *qp = (struct sv_qp *)ibqp;
    pthread_mutex_lock(&qp->lock);
    fab_lock();
    memset(&g_fab->qps[qp->slot], 0, sizeof g_fab->qps[qp->slot]);
    fab_unlock();
    pthread_mutex_unlock(&qp->lock);
    struct sv_cq *scq = (struct sv_cq *)qp->ibv.send_cq;
    struct sv_cq *rcq = (struct sv_cq *)qp->ibv.recv_cq;
    cq_purge(scq, qp);
    if (rcq != scq)
        cq_purge(rcq, qp);
    atomic_fetch_sub(&scq->qps, 1);
    atomic_fetch_sub(&rcq->qps, 1);
    atomic_fetch_sub(&((struct sv_pd *)qp->ibv.pd)->children, 1);
    pthread_mutex_destroy(&qp->lock);
    pthread_mutex_destroy(&qp->ibv.mutex);
    pthread_cond_destroy(&qp->ibv.cond);
    free(qp->stall_ids);
    free(qp->stall_ops);
    free(qp);
    atomic_fetch_sub(&g_live[LIVE_QP], 1);
    return 0;
}

/* ---- posting ---------------------------------------------------------------------------- */

/* Check a local SGE against this process's MRs; fabric lock held. */
static int local_sge_ok(struct sv_qp *qp, const struct mcv_sge *s, int need_write) {
    uint32_t slot = s->lkey >> 8;
    if (slot >= SV_MAX_MR)
        return 0;
    const struct sv_mr_shared *e = &g_fab->mrs[slot];
    if (e->owner != g_pid || e->key != s->lkey || e->pd_id != qp->pd_id)
        return 0;
    if (s->addr < e->addr || s->addr + s->length > e->addr + e->length)
        return 0;
    if (need_write && !(e->access & MCV_ACCESS_LOCAL_WRITE))
        return 0;
    return 1;
}

static int take_fault(int dev) {
    struct sv_dev_shared *d = &g_fab->devs[dev];
    if (d->port_state != MCV_PORT_ACTIVE)
        return MCV_WC_RETRY_EXC_ERR;
    if (d->fault_count > 0) {
        d->fault_count--;
        return d->fault_status;
    }
    return MCV_WC_SUCCESS;
}

/* MC_SOFTVERBS_NOCOPY=1: WRs are checked and completed as usual but move no bytes, so a
 * benchmark can take the provider's copy out of what it measures (read once per process). */
static int sv_nocopy(void) {
    static int cached = -1;
    if (cached < 0) {
        const char *v = getenv("MC_SOFTVERBS_NOCOPY");
        cached = v && *v && strcmp(v, "0") != 0;
    }
    return cached;
}

/* Execute one RDMA WRITE/READ; fabric lock held. Returns a completion status. */
static int execute(struct sv_qp *qp, const struct mcv_send_wr *wr, uint32_t *byte_len) {
    int is_read = wr->opcode == MCV_WR_RDMA_READ;
    int is_inline = !is_read && (wr->send_flags & MCV_SEND_INLINE);
    struct iovec liov[SV_MAX_SGE];
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; i++) {
        const struct mcv_sge *s = &wr->sg_list[i];
        if (!is_inline && !local_sge_ok(qp, s, is_read))
            return MCV_WC_LOC_PROT_ERR;
        liov[i].iov_base = (void *)(uintptr_t)s->addr;
        liov[i].iov_len = s->length;
        total += s->length;
    }
    if (total > SV_MAX_MSG)
        return MCV_WC_LOC_LEN_ERR;
    *byte_len = (uint32_t)total;
    int st = take_fault(qp->dev);
    if (st == MCV_WC_SUCCESS && qp->dest_dev != qp->dev)
        st = take_fault(qp->dest_dev);
    if (st != MCV_WC_SUCCESS)
        return st;
    g_fab->devs[qp->dev].wr_count++;
    if (qp->dest_dev != qp->dev)
        g_fab->devs[qp->dest_dev].wr_count++;

    /* the responder: the QP we are connected to, connected back to us, and alive */
    uint32_t rslot = qp->dest_qpn - SV_QPN_BASE;
    if (qp->dest_qpn < SV_QPN_BASE || rslot >= SV_MAX_QP)
        return MCV_WC_RETRY_EXC_ERR;
    const struct sv_qp_shared *r = &g_fab->qps[rslot];
    if (r->owner == 0 || r->qpn != qp->dest_qpn || r->dev != qp->dest_dev ||
        (r->state != MCV_QPS_RTR && r->state != MCV_QPS_RTS) || r->dest_qpn != qp->ibv.qp_num ||
        r->dest_dev != qp->dev || !pid_alive(r->owner))
        return MCV_WC_RETRY_EXC_ERR;
    uint32_t need = is_read ? MCV_ACCESS_REMOTE_READ : MCV_ACCESS_REMOTE_WRITE;
    if (!(r->access & need))
        return MCV_WC_REM_ACCESS_ERR;
    uint32_t mslot = wr->wr.rdma.rkey >> 8;
    if (mslot >= SV_MAX_MR)
        return MCV_WC_REM_ACCESS_ERR;
    const struct sv_mr_shared *m = &g_fab->mrs[mslot];
    uint64_t raddr = wr->wr.rdma.remote_addr;
    if (m->owner != r->owner || m->key != wr->wr.rdma.rkey || m->pd_id != r->pd_id ||
        !(m->access & need) || raddr < m->addr || raddr + total > m->addr + m->length ||
        raddr + total < raddr)
        return MCV_WC_REM_ACCESS_ERR;
    if (total == 0 || sv_nocopy())
        return MCV_WC_SUCCESS;

    if (r->owner == g_pid) {
        uint8_t *p = (uint8_t *)(uintptr_t)raddr;
        for (int i = 0; i < wr->num_sge; i++) {
            if (is_read)
                memmove(liov[i].iov_base, p, liov[i].iov_len);
            else
                memmove(p, liov[i].iov_base, liov[i].iov_len);
            p += liov[i].iov_len;
        }
        return MCV_WC_SUCCESS;
    }
    int first = 0;
    uint64_t done = 0;
    while (done < total) {
        struct iovec riov = {(void *)(uintptr_t)(raddr + done), (size_t)(total - done)};
        ssize_t n = is_read ? process_vm_readv(r->owner, &liov[first], (unsigned long)(wr->num_sge - first), &riov, 1, 0)
                            : process_vm_writev(r->owner, &liov[first], (unsigned long)(wr->num_sge - first), &riov, 1, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ESRCH)
                return MCV_WC_RETRY_EXC_ERR; /* the responder is gone */
            if (errno == EFAULT)
                return MCV_WC_REM_ACCESS_ERR; /* registered memory unmapped under its MR */
            return MCV_WC_GENERAL_ERR;
        }
        if (n == 0)
            return MCV_WC_GENERAL_ERR;
        done += (uint64_t)n;
        /* advance the local iovec past what moved (partial transfers stop at page faults) */
        size_t adv = (size_t)n;
        while (adv > 0 && first < wr->num_sge) {
            if (adv >= liov[first].iov_len) {
                adv -= liov[first].iov_len;
                first++;
            } else {
                liov[first].iov_base = (uint8_t *)liov[first].iov_base + adv;
                liov[first].iov_len -= adv;
                adv = 0;
            }
        }
    }
    return MCV_WC_SUCCESS;
}

static int sv_post_send(struct mcv_qp *ibqp, struct mcv_send_wr *wr, struct mcv_send_wr **bad) {
    struct sv_qp *qp = (struct sv_qp *)ibqp;
    struct sv_cq *cq = (struct sv_cq *)qp->ibv.send_cq;
    int rc = 0;
    pthread_mutex_lock(&qp->lock);
    fab_lock();
    /* the shared state can move to ERR only through this process, but re-read it anyway */
    for (; wr; wr = wr->next) {
        int state = qp->ibv.state;
        if (state != MCV_QPS_RTS && state != MCV_QPS_ERR) {
            rc = EINVAL;
            break;
        }
        if ((wr->opcode != MCV_WR_RDMA_WRITE && wr->opcode != MCV_WR_RDMA_READ) ||
            wr->num_sge < 0 || (uint32_t)wr->num_sge > qp->cap.max_send_sge) {
            rc = EINVAL;
            break;
        }
        if ((wr->send_flags & MCV_SEND_INLINE) && wr->opcode == MCV_WR_RDMA_WRITE) {
            uint64_t total = 0;
            for (int i = 0; i < wr->num_sge; i++)
                total += wr->sg_list[i].length;
            if (total > qp->cap.max_inline_data) {
                rc = EINVAL;
                break;
            }
        }
        if (__atomic_load_n(&qp->outstanding, __ATOMIC_SEQ_CST) >= qp->cap.max_send_wr) {
            rc = ENOMEM;
            break;
        }
        __atomic_add_fetch(&qp->outstanding, 1, __ATOMIC_SEQ_CST);
        qp->pending_retire++;
        int opc = wr->opcode == MCV_WR_RDMA_READ ? MCV_WC_RDMA_READ : MCV_WC_RDMA_WRITE;
        int signaled = qp->sq_sig_all || (wr->send_flags & MCV_SEND_SIGNALED);
        if (state == MCV_QPS_ERR) {
            cq_push(cq, qp, wr->wr_id, MCV_WC_WR_FLUSH_ERR, opc, 0, qp->pending_retire);
            qp->pending_retire = 0;
            continue;
        }
        if (g_fab->devs[qp->dev].stalled ||
            (qp->dest_dev >= 0 && g_fab->devs[qp->dest_dev].stalled)) {
            qp->pending_retire--; /* retired by its own flush completion */
            qp->stall_ids[qp->nstall] = wr->wr_id;
            qp->stall_ops[qp->nstall] = opc;
            qp->nstall++;
            continue;
        }
        uint32_t byte_len = 0;
        int st = execute(qp, wr, &byte_len);
        if (st != MCV_WC_SUCCESS) {
            qp_set_state(qp, MCV_QPS_ERR);
            cq_push(cq, qp, wr->wr_id, st, opc, 0, qp->pending_retire);
            qp->pending_retire = 0;
        } else if (signaled) {
            cq_push(cq, qp, wr->wr_id, MCV_WC_SUCCESS, opc, byte_len, qp->pending_retire);
            qp->pending_retire = 0;
        }
    }
    fab_unlock();
    pthread_mutex_unlock(&qp->lock);
    if (rc && bad)
        *bad = wr;
    return rc;
}

static int sv_post_recv(struct mcv_qp *qp, struct mcv_recv_wr *wr, struct mcv_recv_wr **bad) {
    (void)qp;
    if (bad)
        *bad = wr;
    return wr ? EOPNOTSUPP : 0; /* mooncake uses one-sided verbs only */
}

/* The rest of the libibverbs surface other engines link against (the published Mooncake
 * engine among them), so this library can stand in for libibverbs.so.1 for them too. */
EXPORT int ibv_fork_init(void) { return 0; }

struct mcv_async_event {
    void *element;
    int event_type;
};

EXPORT int ibv_get_async_event(struct mcv_context *context, struct mcv_async_event *event) {
    /* no async events are ever raised: behave like a blocking read that never returns data
     * (the fd is non-blocking, so a poller sees EAGAIN) */
    char b;
    (void)event;
    ssize_t r = read(context->async_fd, &b, 1);
    (void)r;
    errno = EAGAIN;
    return -1;
}

struct mcv_gid_entry {
    union mcv_gid gid;
    uint32_t gid_index;
    uint32_t port_num;
    uint32_t gid_type; /* IBV_GID_TYPE_IB 0, ROCE_V1 1, ROCE_V2 2 */
    uint32_t ndev_ifindex;
};

EXPORT int _ibv_query_gid_ex(struct mcv_context *context, uint32_t port, uint32_t index,
                             struct mcv_gid_entry *entry, uint32_t flags, size_t entry_size) {
    (void)flags;
    if (entry_size < sizeof *entry)
        return EINVAL;
    if (ibv_query_gid(context, (uint8_t)port, (int)index, &entry->gid) != 0)
        return ENODATA;
    entry->gid_index = index;
    entry->port_num = port;
    entry->gid_type = link_is_ethernet() ? 2 : 0;
    entry->ndev_ifindex = 0;
    return 0;
}

EXPORT void ibv_ack_async_event(struct mcv_async_event *event) { (void)event; }

EXPORT const char *ibv_event_type_str(int event) {
    (void)event;
    return "unknown async event";
}

EXPORT const char *ibv_wc_status_str(int status) {
    static const char *const names[] = {
        "success", "local length error", "local QP operation error", "local EE context operation error",
        "local protection error", "Work Request Flushed Error", "memory management operation error",
        "bad response error", "local access error", "remote invalid request error",
        "remote access error", "remote operation error", "transport retry counter exceeded",
        "RNR retry counter exceeded", "local RDD violation error", "remote invalid RD request",
        "aborted error", "invalid EE context number", "invalid EE context state", "fatal error",
        "response timeout error", "general error"};
    if (status < 0 || status >= (int)(sizeof names / sizeof names[0]))
        return "unknown";
    return names[status];
}

/* ---- test hooks ------------------------------------------------------------------------- */

/* The next ``count`` WRs whose initiator or responder is on ``dev`` complete with ``status``. */
EXPORT int mcsv_inject_fault(const char *dev, int status, int count) {
    pthread_mutex_lock(&g_lock);
    int err = fabric_get();
    pthread_mutex_unlock(&g_lock);
    if (err)
        return -err;
    fab_lock();
    int slot = dev_slot(dev);
    if (slot >= 0) {
        g_fab->devs[slot].fault_status = status;
        g_fab->devs[slot].fault_count = count;
    }
    fab_unlock();
    pthread_mutex_lock(&g_lock);
    fabric_put();
    pthread_mutex_unlock(&g_lock);
    return slot < 0 ? -ENOSPC : 0;
}

/* Port state of ``dev`` (MCV_PORT_ACTIVE=4 / MCV_PORT_DOWN=1); WRs through a down port fail
 * with IBV_WC_RETRY_EXC_ERR. */
EXPORT int mcsv_set_port_state(const char *dev, int state) {
    pthread_mutex_lock(&g_lock);
    int err = fabric_get();
    pthread_mutex_unlock(&g_lock);
    if (err)
        return -err;
    fab_lock();
    int slot = dev_slot(dev);
    if (slot >= 0)
        g_fab->devs[slot].port_state = state;
    fab_unlock();
    pthread_mutex_lock(&g_lock);
    fabric_put();
    pthread_mutex_unlock(&g_lock);
    return slot < 0 ? -ENOSPC : 0;
}

/* Stall ``dev``: WRs through it are accepted and never complete until their QP goes to ERR
 * (a hung link or device); 0 resumes. */
EXPORT int mcsv_set_stall(const char *dev, int on) {
    pthread_mutex_lock(&g_lock);
    int err = fabric_get();
    pthread_mutex_unlock(&g_lock);
    if (err)
        return -err;
    fab_lock();
    int slot = dev_slot(dev);
    if (slot >= 0)
        g_fab->devs[slot].stalled = on;
    fab_unlock();
    pthread_mutex_lock(&g_lock);
    fabric_put();
    pthread_mutex_unlock(&g_lock);
    return slot < 0 ? -ENOSPC : 0;
}

/* WRs executed through ``dev`` since the fabric was created (-1 if unknown). */
EXPORT long long mcsv_wr_count(const char *dev) {
    pthread_mutex_lock(&g_lock);
    int err = fabric_get();
    pthread_mutex_unlock(&g_lock);
    if (err)
        return -1;
    fab_lock();
    int slot = dev_by_name(dev);
    long long n = slot < 0 ? -1 : (long long)g_fab->devs[slot].wr_count;
    fab_unlock();
    pthread_mutex_lock(&g_lock);
    fabric_put();
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Live objects of this process: out[0..5] = contexts, PDs, MRs, CQs, QPs, channels. */
EXPORT int mcsv_live_objects(int *out, int n) {
    for (int i = 0; i < n && i < LIVE_N; i++)
        out[i] = atomic_load(&g_live[i]);
    return LIVE_N;
}
