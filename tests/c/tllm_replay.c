/*
 * TensorRT-LLM's use of Mooncake's C ABI (transfer_engine_c.h), replayed between two processes.
 *
 *   tllm_replay target               serve an 8 MiB buffer; print "READY <segment> <addr>"
 *   tllm_replay initiator SEG ADDR   the agent's sequence against a target at SEG (buffer ADDR)
 *   tllm_replay bad                  bad input: every call answers Mooncake's error code
 *   tllm_replay layout               struct sizes and offsets of the header
 *
 * The calls are TensorRT-LLM's MooncakeTransferAgent's: createTransferEngine("P2PHANDSHAKE",
 * ip, "", 0, 1), registerLocalMemory(.., "*", 1), getLocalIpAndPort, openSegment,
 * allocateBatchID(1024), submitTransfer / submitTransferWithNotify, getTransferStatus polled
 * per task, freeBatchID, genNotifyInEngine, getNotifsFromEngine + freeNotifsMsgBuf,
 * unregisterLocalMemory, destroyTransferEngine. Exit status 0 only if every byte and every
 * return code is as expected; failures are printed as "FAIL ...".
 */

#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

#define K4 4096u /* 4 KiB: the small transfer */
#define MiB (1024u * 1024u)
#define TSZ (8u * MiB)         /* the target's buffer */
#define WSZ (4u * MiB)         /* [0, WSZ) of it is written by the initiator */
#define LSZ (8u * MiB + K4)   /* the initiator's buffer */
#define DEADLINE_S 120.0

static int failures;
#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            failures++;                                   \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                 \
            fputc('\n', stderr);                          \
        }                                                 \
    } while (0)

static uint8_t pattern(unsigned seed, uint64_t off) {
    return (uint8_t)((off * 131u + seed * 29u + (off >> 12)) & 0xffu);
}

static void fill(uint8_t *p, uint64_t off, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = pattern(seed, off + i);
}

static long mismatch(const uint8_t *p, uint64_t off, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(seed, off + i)) return (long)i;
    return -1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void pause_briefly(void) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
}

/* TensorRT-LLM's MooncakeTransferStatus::isCompleted, polled until done: 0 if every task
 * completed with all its bytes, and the batch freed. */
static int wait_batch(transfer_engine_t e, batch_id_t bid, struct transfer_request *reqs, size_t n) {
    double end = now_s() + DEADLINE_S;
    for (;;) {
        int pending = 0, failed = 0;
        for (size_t i = 0; i < n; i++) {
            transfer_status_t st;
            int rc = getTransferStatus(e, bid, i, &st);
            if (rc || st.status == STATUS_FAILED) {
                failed = 1;
            } else if (st.status == STATUS_PENDING || st.status == STATUS_WAITING) {
                pending = 1;
                break;
            } else if (st.status != STATUS_COMPLETED || st.transferred_bytes != reqs[i].length) {
                failed = 1;
            }
        }
        if (!pending) {
            if (failed) return -1;
            return freeBatchID(e, bid) == 0 ? 0 : -1;
        }
        if (now_s() > end) return -2;
        pause_briefly();
    }
}

/* Wait for one notification whose message starts with `prefix`; its name and message. */
static int wait_notify(transfer_engine_t e, const char *prefix, char *name, size_t nlen, char *msg,
                       size_t mlen) {
    double end = now_s() + DEADLINE_S;
    while (now_s() < end) {
        int size = -1;
        notify_msg_t *m = getNotifsFromEngine(e, &size);
        int found = 0;
        CHECK(size >= 0, "getNotifsFromEngine size %d", size);
        for (int i = 0; i < size; i++) {
            if (!found && m[i].msg && strncmp(m[i].msg, prefix, strlen(prefix)) == 0) {
                snprintf(name, nlen, "%s", m[i].name);
                snprintf(msg, mlen, "%s", m[i].msg);
                found = 1;
            }
        }
        freeNotifsMsgBuf(m, size);
        if (found) return 0;
        pause_briefly();
    }
    return -1;
}

static transfer_engine_t create(void) {
    const char *ip = getenv("TLLM_MOONCAKE_IP_ADDR");
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", ip ? ip : "127.0.0.1", "", 0, 1);
    if (!e) {
        fprintf(stderr, "FAIL createTransferEngine returned NULL\n");
        exit(2);
    }
    return e;
}

static int run_target(void) {
    transfer_engine_t e = create();
    uint8_t *buf = aligned_alloc(4096, TSZ);
    fill(buf, 0, TSZ, 1);
    CHECK(registerLocalMemory(e, buf, TSZ, "*", 1) == 0, "registerLocalMemory");
    char seg[64];
    CHECK(getLocalIpAndPort(e, seg, sizeof(seg)) == 0, "getLocalIpAndPort");
    printf("READY %s %" PRIu64 "\n", seg, (uint64_t)(uintptr_t)buf);
    fflush(stdout);

    char name[256], msg[256];
    CHECK(wait_notify(e, "written ", name, sizeof(name), msg, sizeof(msg)) == 0, "no 'written'");
    /* the notification follows the data: every written byte is in place */
    long bad = mismatch(buf, 0, WSZ, 2);
    CHECK(bad < 0, "written region differs at %ld", bad);
    uint64_t peer_addr = strtoull(msg + strlen("written "), NULL, 16);
    segment_id_t sid = openSegment(e, name);
    CHECK(sid > 0, "openSegment(%s) = %d", name, sid);
    /* answer: our [WSZ, WSZ + 4 KiB) into the initiator's last 4 KiB, then the verdict */
    batch_id_t bid = allocateBatchID(e, 1024);
    CHECK(bid != INVALID_BATCH, "allocateBatchID");
    struct transfer_request r = {OPCODE_WRITE, buf + WSZ, sid, peer_addr + LSZ - K4, K4};
    notify_msg_t n = {seg, bad < 0 ? "verified:1" : "verified:0"};
    CHECK(submitTransferWithNotify(e, bid, &r, 1, n) == 0, "submitTransferWithNotify");
    CHECK(wait_batch(e, bid, &r, 1) == 0, "answer batch");
    CHECK(wait_notify(e, "bye", name, sizeof(name), msg, sizeof(msg)) == 0, "no 'bye'");
    CHECK(unregisterLocalMemory(e, buf) == 0, "unregisterLocalMemory");
    destroyTransferEngine(e);
    free(buf);
    printf("DONE %d\n", failures);
    return failures ? 1 : 0;
}

static int submit_and_wait(transfer_engine_t e, struct transfer_request *reqs, size_t n,
                           const notify_msg_t *notify) {
    batch_id_t bid = allocateBatchID(e, 1024);
    if (bid == INVALID_BATCH) return -3;
    int rc = notify ? submitTransferWithNotify(e, bid, reqs, n, *notify)
                    : submitTransfer(e, bid, reqs, n);
    if (rc) return rc;
    return wait_batch(e, bid, reqs, n);
}

static int run_initiator(const char *seg, uint64_t raddr) {
    transfer_engine_t e = create();
    uint8_t *buf = aligned_alloc(4096, LSZ);
    memset(buf, 0, LSZ);
    fill(buf, 0, WSZ, 2);
    CHECK(registerLocalMemory(e, buf, LSZ, "*", 1) == 0, "registerLocalMemory");
    char me[64];
    CHECK(getLocalIpAndPort(e, me, sizeof(me)) == 0 && strchr(me, ':'), "getLocalIpAndPort");
    segment_id_t sid = openSegment(e, seg);
    CHECK(sid > 0, "openSegment(%s) = %d", seg, sid);
    CHECK(openSegment(e, seg) == sid, "openSegment again: the same id");

    static struct transfer_request reqs[1024];
    /* writes: 256 x 4 KiB, then 3 x 1 MiB with the notification */
    for (size_t i = 0; i < 256; i++)
        reqs[i] = (struct transfer_request){OPCODE_WRITE, buf + i * K4, sid, raddr + i * K4, K4};
    CHECK(submit_and_wait(e, reqs, 256, NULL) == 0, "256 x 4 KiB writes");
    char note[96];
    snprintf(note, sizeof(note), "written %" PRIx64, (uint64_t)(uintptr_t)buf);
    notify_msg_t n = {me, note};
    for (size_t i = 0; i < 3; i++)
        reqs[i] = (struct transfer_request){OPCODE_WRITE, buf + MiB + i * MiB, sid,
                                            raddr + MiB + i * MiB, MiB};
    CHECK(submit_and_wait(e, reqs, 3, &n) == 0, "3 x 1 MiB writes with notify");

    /* reads of what the target holds: [4, 5) MiB as 256 x 4 KiB, [5, 8) MiB as 3 x 1 MiB */
    for (size_t i = 0; i < 256; i++)
        reqs[i] = (struct transfer_request){OPCODE_READ, buf + WSZ + i * K4, sid,
                                            raddr + WSZ + i * K4, K4};
    for (size_t i = 0; i < 3; i++)
        reqs[256 + i] = (struct transfer_request){OPCODE_READ, buf + WSZ + MiB + i * MiB, sid,
                                                  raddr + WSZ + MiB + i * MiB, MiB};
    CHECK(submit_and_wait(e, reqs, 259, NULL) == 0, "reads");
    long bad = mismatch(buf + WSZ, WSZ, TSZ - WSZ, 1);
    CHECK(bad < 0, "read bytes differ at %ld", bad);
    /* read back what we wrote */
    for (size_t i = 0; i < 4; i++)
        reqs[i] = (struct transfer_request){OPCODE_READ, buf + WSZ + i * MiB, sid,
                                            raddr + i * MiB, MiB};
    CHECK(submit_and_wait(e, reqs, 4, NULL) == 0, "read back");
    bad = mismatch(buf + WSZ, 0, WSZ, 2);
    CHECK(bad < 0, "read-back bytes differ at %ld", bad);

    /* a range the target never registered fails that task, and only the call's status says so */
    batch_id_t bid = allocateBatchID(e, 1024);
    reqs[0] = (struct transfer_request){OPCODE_WRITE, buf, sid, raddr + TSZ, K4};
    CHECK(submitTransfer(e, bid, reqs, 1) == 0, "submit to an unregistered remote range");
    double end = now_s() + DEADLINE_S;
    transfer_status_t st = {STATUS_WAITING, 0};
    while ((st.status == STATUS_WAITING || st.status == STATUS_PENDING) && now_s() < end) {
        CHECK(getTransferStatus(e, bid, 0, &st) == 0, "getTransferStatus");
        pause_briefly();
    }
    CHECK(st.status == STATUS_FAILED, "remote range outside: status %d", st.status);
    CHECK(freeBatchID(e, bid) == 0, "freeBatchID after failure");

    /* the target answers with a write into our last 4 KiB and a notification */
    char name[256], msg[256];
    CHECK(wait_notify(e, "verified:", name, sizeof(name), msg, sizeof(msg)) == 0,
          "no 'verified'");
    CHECK(strcmp(msg, "verified:1") == 0, "target saw %s", msg);
    CHECK(strcmp(name, seg) == 0, "notification from %s, not %s", name, seg);
    bad = mismatch(buf + LSZ - K4, WSZ, K4, 1);
    CHECK(bad < 0, "the target's write differs at %ld", bad);
    notify_msg_t bye = {me, "bye"};
    CHECK(genNotifyInEngine(e, (uint64_t)sid, bye) == 0, "genNotifyInEngine");
    CHECK(unregisterLocalMemory(e, buf) == 0, "unregisterLocalMemory");
    destroyTransferEngine(e);
    free(buf);
    printf("DONE %d\n", failures);
    return failures ? 1 : 0;
}

struct thread_job {
    transfer_engine_t e;
    uint8_t *buf;
    int rc;
};

/* Calls from threads other than the one that created the engine (TensorRT-LLM makes them). */
static void *thread_copy(void *arg) {
    struct thread_job *j = arg;
    for (int round = 0; round < 50 && j->rc == 0; round++) {
        char name[64];
        if (getLocalIpAndPort(j->e, name, sizeof(name))) j->rc = 1;
        batch_id_t bid = allocateBatchID(j->e, 4);
        struct transfer_request r = {OPCODE_WRITE, j->buf, LOCAL_SEGMENT,
                                     (uint64_t)(uintptr_t)(j->buf + 8 * K4), K4};
        if (submitTransfer(j->e, bid, &r, 1) || wait_batch(j->e, bid, &r, 1)) j->rc = 2;
    }
    return NULL;
}

static int run_bad(void) {
    char out[64];
    int size = 7;
    transfer_status_t st;
    struct transfer_request r;
    notify_msg_t n = {"x", "y"};
    /* no engine */
    destroyTransferEngine(NULL);
    CHECK(registerLocalMemory(NULL, out, 64, "*", 1) == -1, "register on NULL");
    CHECK(unregisterLocalMemory(NULL, out) == -1, "unregister on NULL");
    CHECK(openSegment(NULL, "127.0.0.1:1") == -1, "openSegment on NULL");
    CHECK(getLocalIpAndPort(NULL, out, sizeof(out)) == -1, "getLocalIpAndPort on NULL");
    CHECK(allocateBatchID(NULL, 1) == INVALID_BATCH, "allocateBatchID on NULL");
    CHECK(submitTransfer(NULL, 1, &r, 1) == 1, "submitTransfer on NULL");
    CHECK(getTransferStatus(NULL, 1, 0, &st) == 1, "getTransferStatus on NULL");
    CHECK(freeBatchID(NULL, 1) == 1, "freeBatchID on NULL");
    CHECK(genNotifyInEngine(NULL, 0, n) == -1, "genNotifyInEngine on NULL");
    CHECK(getNotifsFromEngine(NULL, &size) == NULL && size == 0, "getNotifsFromEngine on NULL");
    CHECK(freeNotifsMsgBuf(NULL, 0) == 0, "freeNotifsMsgBuf(NULL)");
    CHECK(getNicLoadStats(NULL, NULL, NULL) == -1, "getNicLoadStats on NULL");
    CHECK(showLinks(NULL, out, sizeof(out), 1) == -1, "showLinks on NULL");
    int not_an_engine = 0;
    CHECK(submitTransfer(&not_an_engine, 1, &r, 1) == 1, "submitTransfer on a stray pointer");

    transfer_engine_t e = create();
    uint8_t *buf = aligned_alloc(4096, 1 * MiB);
    uint8_t *other = aligned_alloc(4096, 16 * K4);
    memset(buf, 0, MiB);
    CHECK(registerLocalMemory(e, NULL, 64, "*", 1) == -1, "register NULL address");
    CHECK(registerLocalMemory(e, buf, 0, "*", 1) == -1, "register zero length");
    CHECK(registerLocalMemory(e, buf, MiB, "*", 1) == 0, "register");
    CHECK(registerLocalMemory(e, buf + K4, K4, "*", 1) == -7, "register overlapping");
    CHECK(unregisterLocalMemory(e, other) == -3, "unregister unknown");
    CHECK(getLocalIpAndPort(e, out, 0) == -1, "getLocalIpAndPort with no room");
    char me[64];
    CHECK(getLocalIpAndPort(e, me, sizeof(me)) == 0, "getLocalIpAndPort");
    CHECK(openSegment(e, NULL) == -1, "openSegment(NULL)");
    CHECK(openSegment(e, "") == -1, "openSegment(\"\")");
    CHECK(openSegment(e, "127.0.0.1:1") == -1, "openSegment of nothing listening");
    CHECK(openSegment(e, me) == LOCAL_SEGMENT, "openSegment of ourselves");

    /* our own segment: a loopback copy */
    fill(buf, 0, 16 * K4, 3);
    batch_id_t bid = allocateBatchID(e, 2);
    CHECK(bid != INVALID_BATCH, "allocateBatchID");
    r = (struct transfer_request){OPCODE_WRITE, buf, LOCAL_SEGMENT,
                                  (uint64_t)(uintptr_t)(buf + 128 * K4), 16 * K4};
    CHECK(submitTransfer(e, bid, &r, 1) == 0, "local write");
    CHECK(wait_batch(e, bid, &r, 1) == 0, "local write completes");
    CHECK(mismatch(buf + 128 * K4, 0, 16 * K4, 3) < 0, "local copy differs");

    /* the same from two other threads at once */
    struct thread_job jobs[2] = {{e, buf + 160 * K4, 0}, {e, buf + 192 * K4, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) fill(jobs[i].buf, 0, K4, 4 + i);
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thread_copy, &jobs[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        CHECK(jobs[i].rc == 0, "calls from thread %d: %d", i, jobs[i].rc);
        CHECK(mismatch(jobs[i].buf + 8 * K4, 0, K4, 4 + i) < 0, "thread %d's copy differs", i);
    }

    /* a freed batch id is refused everywhere */
    CHECK(getTransferStatus(e, bid, 0, &st) == 1, "status of a freed batch");
    CHECK(submitTransfer(e, bid, &r, 1) == 1, "submit to a freed batch");
    CHECK(freeBatchID(e, bid) == 1, "free twice");
    CHECK(getTransferStatus(e, 12345, 0, &st) == 1, "made-up batch id");
    CHECK(getTransferStatus(e, INVALID_BATCH, 0, &st) == 1, "INVALID_BATCH");

    bid = allocateBatchID(e, 2);
    CHECK(getTransferStatus(e, bid, 0, &st) == 1, "task id out of range");
    CHECK(getTransferStatus(e, bid, 0, NULL) == 1, "NULL status");
    CHECK(submitTransfer(e, bid, NULL, 1) == 1, "NULL entries");
    struct transfer_request three[3] = {r, r, r};
    CHECK(submitTransfer(e, bid, three, 3) == 2, "more tasks than the batch holds");
    r.target_id = 99;
    CHECK(submitTransfer(e, bid, &r, 1) == 1, "unknown segment id");
    r.target_id = LOCAL_SEGMENT;
    r.opcode = 7;
    CHECK(submitTransfer(e, bid, &r, 1) == 1, "bad opcode");
    r.opcode = OPCODE_WRITE;
    r.source = other;
    CHECK(submitTransfer(e, bid, &r, 1) == 3, "unregistered source");
    r.source = buf + MiB - K4; /* runs past the end of the registered range */
    r.length = 2 * K4;
    CHECK(submitTransfer(e, bid, &r, 1) == 3, "source past the registered range");
    CHECK(getTransferStatus(e, bid, 0, &st) == 1, "refused submits add no task");
    CHECK(submitTransfer(e, bid, &r, 0) == 0, "zero requests");
    CHECK(freeBatchID(e, bid) == 0, "free an unused batch");

    notify_msg_t nn = {NULL, "m"};
    CHECK(genNotifyInEngine(e, 99, n) == -200, "notify an unknown segment id");
    CHECK(genNotifyInEngine(e, 0, nn) == -1, "notify with a NULL name");
    CHECK(submitTransferWithNotify(e, allocateBatchID(e, 1), &r, 1, nn) == 1,
          "submit with a NULL notify name");
    size = 7;
    notify_msg_t *m = getNotifsFromEngine(e, &size);
    CHECK(m == NULL && size == 0, "no notifications: NULL, 0");
    CHECK(freeNotifsMsgBuf(m, size) == 0, "freeNotifsMsgBuf(NULL, 0)");
    size_t count = 4;
    nic_load_stat_t stats[4];
    CHECK(getNicLoadStats(e, stats, &count) == 0 && count == 0, "getNicLoadStats");
    CHECK(showLinks(e, out, sizeof(out), 1) == 0, "showLinks");
    CHECK(discoverTopology(e) == 0, "discoverTopology");
    CHECK(installTransport(e, "tcp", NULL) != NULL, "installTransport(tcp): it is there");
    CHECK(installTransport(e, "nvmeof", NULL) == NULL, "installTransport(nvmeof)");
    CHECK(unregisterLocalMemory(e, buf) == 0, "unregister");
    CHECK(unregisterLocalMemory(e, buf) == -3, "unregister twice");
    destroyTransferEngine(e);
    free(buf);
    free(other);
    printf("DONE %d\n", failures);
    return failures ? 1 : 0;
}

/* Mooncake's layouts on LP64 (x86-64, aarch64) */
_Static_assert(sizeof(transfer_request_t) == 40, "transfer_request size");
_Static_assert(offsetof(transfer_request_t, opcode) == 0, "opcode");
_Static_assert(offsetof(transfer_request_t, source) == 8, "source");
_Static_assert(offsetof(transfer_request_t, target_id) == 16, "target_id");
_Static_assert(offsetof(transfer_request_t, target_offset) == 24, "target_offset");
_Static_assert(offsetof(transfer_request_t, length) == 32, "length");
_Static_assert(sizeof(notify_msg_t) == 16 && offsetof(notify_msg_t, msg) == 8, "notify_msg");
_Static_assert(sizeof(transfer_status_t) == 16, "transfer_status size");
_Static_assert(offsetof(transfer_status_t, transferred_bytes) == 8, "transferred_bytes");
_Static_assert(sizeof(buffer_entry_t) == 16 && offsetof(buffer_entry_t, length) == 8, "buffer");
_Static_assert(sizeof(segment_desc_t) == 48 && offsetof(segment_desc_t, desc_) == 8, "segment");
_Static_assert(sizeof(nic_load_stat_t) == 80, "nic_load_stat size");
_Static_assert(offsetof(nic_load_stat_t, inflight_bytes) == 64, "inflight_bytes");
_Static_assert(offsetof(nic_load_stat_t, ewma_bandwidth_bps) == 72, "ewma_bandwidth_bps");
_Static_assert(sizeof(segment_id_t) == 4 && sizeof(batch_id_t) == 8, "id types");
_Static_assert(INVALID_BATCH == UINT64_MAX && LOCAL_SEGMENT == 0, "constants");
_Static_assert(STATUS_WAITING == 0 && STATUS_PENDING == 1 && STATUS_COMPLETED == 4 &&
                   STATUS_TIMEOUT == 5 && STATUS_FAILED == 6 && OPCODE_WRITE == 1,
               "status codes");

static int run_layout(void) {
    printf("transfer_request %zu notify_msg %zu transfer_status %zu segment_desc %zu "
           "buffer_entry %zu nic_load_stat %zu\n",
           sizeof(transfer_request_t), sizeof(notify_msg_t), sizeof(transfer_status_t),
           sizeof(segment_desc_t), sizeof(buffer_entry_t), sizeof(nic_load_stat_t));
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stderr, NULL, _IONBF, 0);
    if (argc >= 2 && strcmp(argv[1], "target") == 0) return run_target();
    if (argc >= 4 && strcmp(argv[1], "initiator") == 0)
        return run_initiator(argv[2], strtoull(argv[3], NULL, 10));
    if (argc >= 2 && strcmp(argv[1], "bad") == 0) return run_bad();
    if (argc >= 2 && strcmp(argv[1], "layout") == 0) return run_layout();
    fprintf(stderr, "usage: %s target | initiator SEGMENT ADDR | bad | layout\n", argv[0]);
    return 2;
}
