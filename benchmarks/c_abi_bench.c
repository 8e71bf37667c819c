/*
 * Writes through Mooncake's C ABI the way TensorRT-LLM's agent issues them: per op
 * allocateBatchID(1024), submitTransfer (one request), getTransferStatus polled until done,
 * freeBatchID. Built and run by benchmarks/c_abi.py.
 *
 *   c_abi_bench SEGMENT ADDR SECONDS SIZE...   one JSON line per size
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

#define MAX_SAMPLES 2000000

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s SEGMENT ADDR SECONDS SIZE...\n", argv[0]);
        return 2;
    }
    uint64_t raddr = strtoull(argv[2], NULL, 10);
    double seconds = atof(argv[3]);
    size_t max = 0;
    for (int i = 4; i < argc; i++)
        if ((size_t)atoll(argv[i]) > max) max = (size_t)atoll(argv[i]);
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    if (!e) return 1;
    uint8_t *buf = aligned_alloc(4096, (max + 4095) / 4096 * 4096);
    memset(buf, 0x5a, max);
    if (registerLocalMemory(e, buf, max, "*", 1)) return 1;
    segment_id_t sid = openSegment(e, argv[1]);
    if (sid < 0) return 1;
    double *lat = malloc(sizeof(double) * MAX_SAMPLES);
    for (int a = 4; a < argc; a++) {
        size_t size = (size_t)atoll(argv[a]);
        size_t n = 0;
        double start = now_s(), end = start + seconds;
        int errors = 0;
        while ((n < 20 || now_s() < end) && n < MAX_SAMPLES) {
            double t0 = now_s();
            batch_id_t bid = allocateBatchID(e, 1024);
            struct transfer_request r = {OPCODE_WRITE, buf, sid, raddr, size};
            if (submitTransfer(e, bid, &r, 1)) errors++;
            transfer_status_t st = {STATUS_WAITING, 0};
            while (getTransferStatus(e, bid, 0, &st) == 0 &&
                   (st.status == STATUS_WAITING || st.status == STATUS_PENDING)) {
            }
            if (st.status != STATUS_COMPLETED) errors++;
            freeBatchID(e, bid);
            lat[n++] = now_s() - t0;
        }
        double total = now_s() - start;
        qsort(lat, n, sizeof(double), cmp);
        printf("{\"size\": %zu, \"ops\": %zu, \"seconds\": %.6f, \"p50_us\": %.3f, "
               "\"p99_us\": %.3f, \"errors\": %d}\n",
               size, n, total, lat[n / 2] * 1e6, lat[(size_t)(n * 0.99)] * 1e6, errors);
        fflush(stdout);
    }
    unregisterLocalMemory(e, buf);
    destroyTransferEngine(e);
    return 0;
}
