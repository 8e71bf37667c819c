/*
 * Device memory through Mooncake's C ABI (needs a CUDA GPU; run by benchmarks/gpu_check_cabi.sh).
 *
 * Two engines in one process, as two TensorRT-LLM ranks would use them: A registers 8 MiB of
 * device memory (cudaMalloc, location "cuda:0", as the agent's registerMemory does for KV
 * blocks; also "*" to let the engine find the device), B registers host buffers. A reads B's
 * pattern into device memory and writes it back into another of B's buffers; B reads A's device
 * memory. Every byte is checked (device contents through cudaMemcpy). libcudart is dlopen()ed.
 * Exit status 0 only if all passed; 3 when no GPU is usable.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

#define SZ (8u << 20)
#define MIB (1u << 20)

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*memcpy_fn)(void *, const void *, size_t, int);
typedef int (*setdev_fn)(int);

static int failures;
#define CHECK(c, ...)                                                  \
    do {                                                               \
        if (!(c)) {                                                    \
            failures++;                                                \
            fprintf(stderr, "FAIL %d: ", __LINE__);                    \
            fprintf(stderr, __VA_ARGS__);                              \
            fputc('\n', stderr);                                       \
        }                                                              \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int run(transfer_engine_t e, segment_id_t sid, int op, void *local, uint64_t remote,
               size_t len, size_t piece) {
    struct transfer_request reqs[64];
    size_t n = len / piece;
    if (n > 64) return -9;
    for (size_t i = 0; i < n; i++)
        reqs[i] = (struct transfer_request){op, (char *)local + i * piece, sid, remote + i * piece,
                                            piece};
    batch_id_t bid = allocateBatchID(e, 1024);
    int rc = submitTransfer(e, bid, reqs, n);
    if (rc) return rc;
    double end = now_s() + 120;
    for (size_t i = 0; i < n; i++) {
        transfer_status_t st = {STATUS_WAITING, 0};
        while (getTransferStatus(e, bid, i, &st) == 0 &&
               (st.status == STATUS_WAITING || st.status == STATUS_PENDING) && now_s() < end) {
        }
        if (st.status != STATUS_COMPLETED) return -10 - st.status;
    }
    return freeBatchID(e, bid);
}

int main(int argc, char **argv) {
    const char *loc = argc > 1 ? argv[1] : "cuda:0";
    void *cudart = dlopen("libcudart.so", RTLD_NOW);
    if (!cudart) cudart = dlopen("libcudart.so.12", RTLD_NOW);
    if (!cudart) {
        fprintf(stderr, "no libcudart: %s\n", dlerror());
        return 3;
    }
    malloc_fn cmalloc = (malloc_fn)dlsym(cudart, "cudaMalloc");
    free_fn cfree = (free_fn)dlsym(cudart, "cudaFree");
    memcpy_fn cmemcpy = (memcpy_fn)dlsym(cudart, "cudaMemcpy");
    setdev_fn csetdev = (setdev_fn)dlsym(cudart, "cudaSetDevice");
    void *dev = NULL;
    if (!cmalloc || csetdev(0) || cmalloc(&dev, SZ)) {
        fprintf(stderr, "no usable GPU\n");
        return 3;
    }
    unsigned char *h = malloc(SZ), *h2 = calloc(1, SZ), *h3 = calloc(1, SZ), *chk = malloc(SZ);
    for (size_t i = 0; i < SZ; i++) h[i] = (unsigned char)(i * 131 + (i >> 12));
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    CHECK(a && b, "createTransferEngine");
    if (!a || !b) return 1;
    CHECK(registerLocalMemory(a, dev, SZ, loc, 1) == 0, "register device memory as %s", loc);
    CHECK(registerLocalMemory(b, h, SZ, "cpu:0", 1) == 0, "register h");
    CHECK(registerLocalMemory(b, h2, SZ, "cpu:0", 1) == 0, "register h2");
    CHECK(registerLocalMemory(b, h3, SZ, "cpu:0", 1) == 0, "register h3");
    char an[64], bn[64];
    getLocalIpAndPort(a, an, sizeof(an));
    getLocalIpAndPort(b, bn, sizeof(bn));
    segment_id_t to_b = openSegment(a, bn), to_a = openSegment(b, an);
    CHECK(to_b > 0 && to_a > 0, "openSegment %d %d", to_b, to_a);
    /* B's pattern into A's device memory: 4 KiB pieces for the first MiB, 1 MiB pieces after */
    CHECK(run(a, to_b, OPCODE_READ, dev, (uint64_t)(uintptr_t)h, MIB / 16, 4096) == 0, "read 4K");
    CHECK(run(a, to_b, OPCODE_READ, (char *)dev + MIB / 16, (uint64_t)(uintptr_t)h + MIB / 16,
              MIB - MIB / 16, MIB - MIB / 16) == 0, "read rest of first MiB");
    CHECK(run(a, to_b, OPCODE_READ, (char *)dev + MIB, (uint64_t)(uintptr_t)h + MIB, SZ - MIB,
              MIB) == 0, "read 1M pieces");
    CHECK(cmemcpy(chk, dev, SZ, 2 /* cudaMemcpyDeviceToHost */) == 0, "cudaMemcpy");
    CHECK(memcmp(chk, h, SZ) == 0, "device memory differs from the pattern after reads");
    /* device memory out again, as a write from A, and as a read by B (A serves device memory) */
    CHECK(run(a, to_b, OPCODE_WRITE, dev, (uint64_t)(uintptr_t)h2, SZ, MIB) == 0, "write");
    CHECK(memcmp(h2, h, SZ) == 0, "write from device memory differs");
    CHECK(run(b, to_a, OPCODE_READ, h3, (uint64_t)(uintptr_t)dev, SZ, MIB) == 0, "B reads A");
    CHECK(memcmp(h3, h, SZ) == 0, "B's read of device memory differs");
    CHECK(unregisterLocalMemory(a, dev) == 0, "unregister device memory");
    destroyTransferEngine(a);
    destroyTransferEngine(b);
    cfree(dev);
    printf("DONE %d (location %s)\n", failures, loc);
    return failures ? 1 : 0;
}
