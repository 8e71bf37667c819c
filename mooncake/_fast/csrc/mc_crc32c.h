/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), hardware accelerated.
 *
 * Kernels, the fastest the CPU has chosen at run time (mc_crc_kernel; each compiled with a
 * target attribute, never global -m flags, so the module runs on any x86-64):
 *   MC_CRC_K_AVX512  VPCLMULQDQ folding of four 512-bit registers (256 bytes a step),
 *   MC_CRC_K_PCLMUL  PCLMULQDQ folding of four 128-bit registers (64 bytes a step),
 *   MC_CRC_K_SSE42   the crc32 instruction on three streams (below),
 *   MC_CRC_K_TABLE   slice-by-8 tables.
 * Folding (Intel's "Fast CRC computation using PCLMULQDQ", as in ISA-L crc32_iscsi and Peter
 * Cawley's fast-crc32): a 128-bit lane D bytes before the lane it is folded into is multiplied
 * (carry-less) by x^(8(D+8)-33) mod P (its low 64 bits) and x^(8D-33) mod P (its high 64 bits)
 * and xored into it; the last 16 bytes left are reduced by two crc32 instructions. The folding
 * constants are computed at init from the polynomial (mc_crc_xnmodp), not pasted.
 * Measured on AMD EPYC (Zen 4, docs/benchmarks.md): avx512 ~55 GB/s, the fused copy at
 * memcpy's speed; pclmul ~14 GB/s (slower than sse42's ~25, so not the default);
 * mc_crc32c_set_kernel() chooses another (tests, MOONCAKE_CRC_KERNEL).
 *
 * MC_CRC_K_SSE42: the SSE4.2 `crc32` instruction (_mm_crc32_u64), three independent streams
 * over 8 KiB / 256 B blocks combined by "append zeros" operators (Mark Adler's method), so the
 * instruction's 3-cycle latency is hidden: ~3x one stream. aarch64: the ARMv8 CRC32C
 * instructions (__crc32cd) in the same shape. Anything else, or a CPU without them (checked
 * at run time): slice-by-8 tables.
 *
 * Conventions (the standard CRC32C, as iSCSI / ext4 / google-crc32c): initial value and final
 * xor 0xFFFFFFFF, so mc_crc32c(mc_crc32c(0, a), b) == mc_crc32c(0, a || b) and
 * mc_crc32c(0, "123456789") == 0xE3069283.
 *
 * mc_copy_crc32c copies and checksums in one pass over the data: the folding kernels load each
 * 64-byte line (16 bytes for pclmul) once, store it and fold it (mc_copy_crc32c_ex with stream:
 * non-temporal stores from 4 KiB); the CRC instruction each 8-byte word; the tables copy chunks
 * small enough to stay in the core's cache, then checksum the copy. mc_crc32c_combine gives
 * crc(A || B) from crc(A), crc(B) and len(B).
 */
#ifndef MC_CRC32C_H
#define MC_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define MC_CRC_TARGET __attribute__((target("sse4.2")))
#define MC_CLMUL_TARGET __attribute__((target("sse4.2,pclmul")))
#define MC_AVX512_TARGET \
    __attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512bw,avx512vl,vpclmulqdq")))
#define MC_CRC_HAVE_FOLD 1
#define MC_CRC64(c, v) _mm_crc32_u64((c), (v))
#define MC_CRC8(c, v) _mm_crc32_u8((uint32_t)(c), (v))
#define MC_CRC_HAVE_HW 1
#elif defined(__aarch64__)
#include <arm_acle.h>
#define MC_CRC_TARGET __attribute__((target("+crc")))
#define MC_CRC64(c, v) __crc32cd((uint32_t)(c), (v))
#define MC_CRC8(c, v) __crc32cb((uint32_t)(c), (v))
#define MC_CRC_HAVE_HW 1
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#else
#define MC_CRC_HAVE_HW 0
#endif
#ifndef MC_CRC_HAVE_FOLD
#define MC_CRC_HAVE_FOLD 0
#endif

#define MC_CRC_K_TABLE 0
#define MC_CRC_K_SSE42 1 /* the CRC instruction (ARMv8 CRC32C on aarch64) */
#define MC_CRC_K_PCLMUL 2
#define MC_CRC_K_AVX512 3

#define MC_CRC_POLY 0x82f63b78u
#define MC_CRC_LONG 8192
#define MC_CRC_SHORT 256

static uint32_t mc_crc_sw[8][256];
static uint32_t mc_crc_long[4][256];
static uint32_t mc_crc_short[4][256];
static int mc_crc_hw = 0;     /* mc_crc_kernel >= MC_CRC_K_SSE42 */
static int mc_crc_kernel = 0; /* in use */
static int mc_crc_best = 0;   /* the highest this CPU has */
static int mc_crc_default = 0; /* the fastest this CPU has (what init chooses) */
/* folding constants for distances of 16, 32, 48, 64, 128, 256 bytes: {low lane, high lane} */
static uint64_t mc_crc_fold_k[6][2];
static uint32_t mc_crc_pow2[48][32]; /* operators appending 2**k zero bytes (combine) */

static uint32_t mc_gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void mc_gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = mc_gf2_times(mat, mat[n]);
}

/* the operator that appends len zero bytes to a (pre-/post-conditioning free) crc; len a
 * power of two */
static void mc_crc_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = MC_CRC_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    mc_gf2_square(even, odd); /* two zero bits */
    mc_gf2_square(odd, even); /* four zero bits */
    do {                      /* the first square gives one zero byte (in even) */
        mc_gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        mc_gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void mc_crc_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    mc_crc_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = mc_gf2_times(op, n);
        zeros[1][n] = mc_gf2_times(op, n << 8);
        zeros[2][n] = mc_gf2_times(op, n << 16);
        zeros[3][n] = mc_gf2_times(op, n << 24);
    }
}

static inline uint32_t mc_crc_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

/* x^n mod P, bit-reflected (bit 31 is x^0): n steps of the CRC's own shift register */
static uint32_t mc_crc_xnmodp(unsigned n) {
    uint32_t r = 0x80000000u;
    while (n--) r = r & 1 ? (r >> 1) ^ MC_CRC_POLY : r >> 1;
    return r;
}

/* lowers the kernel to at most `want` (MC_CRC_K_*; the best available if higher); returns the
 * kernel in use. Not thread safe against concurrent checksums: call before using them. */
static int mc_crc32c_set_kernel(int want) {
    mc_crc_kernel = want < mc_crc_best ? (want < 0 ? 0 : want) : mc_crc_best;
    mc_crc_hw = mc_crc_kernel >= MC_CRC_K_SSE42;
    return mc_crc_kernel;
}

static void mc_crc32c_init(void) {
    static const unsigned dist[6] = {16, 32, 48, 64, 128, 256};
    for (int i = 0; i < 6; i++) {
        mc_crc_fold_k[i][0] = mc_crc_xnmodp(8 * (dist[i] + 8) - 33);
        mc_crc_fold_k[i][1] = mc_crc_xnmodp(8 * dist[i] - 33);
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ MC_CRC_POLY : crc >> 1;
        mc_crc_sw[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = mc_crc_sw[0][n];
        for (int k = 1; k < 8; k++) {
            crc = mc_crc_sw[0][crc & 0xff] ^ (crc >> 8);
            mc_crc_sw[k][n] = crc;
        }
    }
    mc_crc_zeros(mc_crc_long, MC_CRC_LONG);
    mc_crc_zeros(mc_crc_short, MC_CRC_SHORT);
    mc_crc_zeros_op(mc_crc_pow2[0], 1);
    for (int k = 1; k < 48; k++) mc_gf2_square(mc_crc_pow2[k], mc_crc_pow2[k - 1]);
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        mc_crc_best = MC_CRC_K_SSE42;
        if (__builtin_cpu_supports("pclmul")) {
            mc_crc_best = MC_CRC_K_PCLMUL;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq"))
                mc_crc_best = MC_CRC_K_AVX512;
        }
    }
#elif defined(__aarch64__)
    if (getauxval(AT_HWCAP) & HWCAP_CRC32) mc_crc_best = MC_CRC_K_SSE42;
#endif
    /* PCLMULQDQ on 128-bit registers alone is throughput bound by the multiplier (AMD Zen:
     * one per 2 cycles, ~14 GB/s, measured) and no faster than three crc32 streams on Intel,
     * so without the 512-bit kernel the default is the crc32 instruction; the 128-bit folding
     * kernel stays selectable (MOONCAKE_CRC_KERNEL=pclmul). */
    mc_crc_default = mc_crc_best == MC_CRC_K_PCLMUL ? MC_CRC_K_SSE42 : mc_crc_best;
    mc_crc32c_set_kernel(mc_crc_default);
}

static uint32_t mc_crc32c_sw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)p & 7)) {
        c = mc_crc_sw[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c ^= w; /* little-endian hosts only (x86-64, aarch64 LE) */
        c = mc_crc_sw[7][c & 0xff] ^ mc_crc_sw[6][(c >> 8) & 0xff] ^
            mc_crc_sw[5][(c >> 16) & 0xff] ^ mc_crc_sw[4][(c >> 24) & 0xff] ^
            mc_crc_sw[3][(c >> 32) & 0xff] ^ mc_crc_sw[2][(c >> 40) & 0xff] ^
            mc_crc_sw[1][(c >> 48) & 0xff] ^ mc_crc_sw[0][c >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) c = mc_crc_sw[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return (uint32_t)c ^ 0xffffffffu;
}

#if MC_CRC_HAVE_HW
static inline uint64_t mc_ld64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline void mc_st64(unsigned char *p, uint64_t w) { memcpy(p, &w, 8); }

MC_CRC_TARGET static uint32_t mc_crc32c_hw(uint32_t crc, const unsigned char *next, size_t len) {
    uint64_t crc0 = crc ^ 0xffffffffu, crc1, crc2;
    const unsigned char *end;
    while (len && ((uintptr_t)next & 7)) {
        crc0 = MC_CRC8(crc0, *next++);
        len--;
    }
    while (len >= MC_CRC_LONG * 3) {
        crc1 = crc2 = 0;
        end = next + MC_CRC_LONG;
        do {
            crc0 = MC_CRC64(crc0, mc_ld64(next));
            crc1 = MC_CRC64(crc1, mc_ld64(next + MC_CRC_LONG));
            crc2 = MC_CRC64(crc2, mc_ld64(next + 2 * MC_CRC_LONG));
            next += 8;
        } while (next < end);
        crc0 = mc_crc_shift(mc_crc_long, (uint32_t)crc0) ^ crc1;
        crc0 = mc_crc_shift(mc_crc_long, (uint32_t)crc0) ^ crc2;
        next += 2 * MC_CRC_LONG;
        len -= 3 * MC_CRC_LONG;
    }
    while (len >= MC_CRC_SHORT * 3) {
        crc1 = crc2 = 0;
        end = next + MC_CRC_SHORT;
        do {
            crc0 = MC_CRC64(crc0, mc_ld64(next));
            crc1 = MC_CRC64(crc1, mc_ld64(next + MC_CRC_SHORT));
            crc2 = MC_CRC64(crc2, mc_ld64(next + 2 * MC_CRC_SHORT));
            next += 8;
        } while (next < end);
        crc0 = mc_crc_shift(mc_crc_short, (uint32_t)crc0) ^ crc1;
        crc0 = mc_crc_shift(mc_crc_short, (uint32_t)crc0) ^ crc2;
        next += 2 * MC_CRC_SHORT;
        len -= 3 * MC_CRC_SHORT;
    }
    end = next + (len - (len & 7));
    while (next < end) {
        crc0 = MC_CRC64(crc0, mc_ld64(next));
        next += 8;
    }
    len &= 7;
    while (len--) crc0 = MC_CRC8(crc0, *next++);
    return (uint32_t)crc0 ^ 0xffffffffu;
}
#endif


#if MC_CRC_HAVE_FOLD
/* The folding kernels, on the raw (pre-inverted) state c; with copy, every byte read from src
 * is also stored to dst (the same load), so one body serves checksum and fused copy. */
MC_CLMUL_TARGET static inline __m128i mc_fold128(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

MC_CLMUL_TARGET static inline __m128i mc_fold_k(int i) {
    return _mm_set_epi64x((long long)mc_crc_fold_k[i][1], (long long)mc_crc_fold_k[i][0]);
}

/* the raw state of 16 folded bytes: their CRC from a zero state (x is already "data ^ crc") */
MC_CLMUL_TARGET static inline uint64_t mc_fold_finish(__m128i x) {
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    return _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
}

MC_CLMUL_TARGET static inline __attribute__((always_inline)) uint64_t
mc_crc_tail(unsigned char *dst, const unsigned char *src, size_t len, uint64_t c, const int copy) {
    while (len >= 8) {
        uint64_t w = mc_ld64(src);
        if (copy) mc_st64(dst, w), dst += 8;
        c = _mm_crc32_u64(c, w);
        src += 8;
        len -= 8;
    }
    while (len--) {
        unsigned char b = *src++;
        if (copy) *dst++ = b;
        c = _mm_crc32_u8((uint32_t)c, b);
    }
    return c;
}

#define MC_LD(p)                                                     \
    (nt ? _mm_loadu_si128((const __m128i *)(const void *)(p))        \
        : _mm_load_si128((const __m128i *)(const void *)(p)))
#define MC_ST(p, v)                                                  \
    (nt ? _mm_stream_si128((__m128i *)(void *)(p), (v))              \
        : _mm_storeu_si128((__m128i *)(void *)(p), (v)))

MC_CLMUL_TARGET static inline __attribute__((always_inline)) uint64_t
mc_crc_clmul_body(unsigned char *dst, const unsigned char *src, size_t len, uint64_t c,
                  const int copy, const int nt) {
    if (len >= 64 + 15) {
        /* aligned loads from here on (aligned non-temporal stores with nt) */
        size_t head = (size_t)(-(uintptr_t)(nt ? (const unsigned char *)dst : src) & 15);
        c = mc_crc_tail(dst, src, head, c, copy);
        src += head, len -= head;
        if (copy) dst += head;
        __m128i x0 = MC_LD(src), x1 = MC_LD(src + 16), x2 = MC_LD(src + 32), x3 = MC_LD(src + 48);
        if (copy) {
            MC_ST(dst, x0), MC_ST(dst + 16, x1), MC_ST(dst + 32, x2), MC_ST(dst + 48, x3);
            dst += 64;
        }
        x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)(uint32_t)c));
        src += 64, len -= 64;
        __m128i k = mc_fold_k(3);
        while (len >= 64) {
            __m128i y0 = MC_LD(src), y1 = MC_LD(src + 16), y2 = MC_LD(src + 32),
                    y3 = MC_LD(src + 48);
            if (copy) {
                MC_ST(dst, y0), MC_ST(dst + 16, y1), MC_ST(dst + 32, y2), MC_ST(dst + 48, y3);
                dst += 64;
            }
            x0 = _mm_xor_si128(mc_fold128(x0, k), y0);
            x1 = _mm_xor_si128(mc_fold128(x1, k), y1);
            x2 = _mm_xor_si128(mc_fold128(x2, k), y2);
            x3 = _mm_xor_si128(mc_fold128(x3, k), y3);
            src += 64, len -= 64;
        }
        k = mc_fold_k(0);
        x1 = _mm_xor_si128(mc_fold128(x0, k), x1);
        x3 = _mm_xor_si128(mc_fold128(x2, k), x3);
        x0 = _mm_xor_si128(mc_fold128(x1, mc_fold_k(1)), x3);
        while (len >= 16) {
            __m128i y = MC_LD(src);
            if (copy) MC_ST(dst, y), dst += 16;
            x0 = _mm_xor_si128(mc_fold128(x0, k), y);
            src += 16, len -= 16;
        }
        if (nt) _mm_sfence();
        c = mc_fold_finish(x0);
    }
    return mc_crc_tail(dst, src, len, c, copy);
}

MC_CLMUL_TARGET static uint32_t mc_crc32c_clmul(uint32_t crc, const unsigned char *p, size_t len) {
    return (uint32_t)mc_crc_clmul_body(NULL, p, len, crc ^ 0xffffffffu, 0, 0) ^ 0xffffffffu;
}

MC_CLMUL_TARGET static uint32_t mc_copy_crc32c_clmul(unsigned char *dst, const unsigned char *src,
                                                     size_t len, uint32_t crc, int nt) {
    uint64_t c = crc ^ 0xffffffffu;
    c = nt ? mc_crc_clmul_body(dst, src, len, c, 1, 1) : mc_crc_clmul_body(dst, src, len, c, 1, 0);
    return (uint32_t)c ^ 0xffffffffu;
}

MC_AVX512_TARGET static inline __m512i mc_fold512(__m512i z, __m512i k, __m512i y) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00),
                                     _mm512_clmulepi64_epi128(z, k, 0x11), y, 0x96);
}

#define MC_LDZ(p) _mm512_loadu_si512((const void *)(p))
#define MC_STZ(p, v) \
    (nt ? _mm512_stream_si512((void *)(p), (v)) : _mm512_storeu_si512((void *)(p), (v)))

MC_AVX512_TARGET static inline __attribute__((always_inline)) uint64_t
mc_crc_avx512_body(unsigned char *dst, const unsigned char *src, size_t len, uint64_t c,
                   const int copy, const int nt) {
    if (len >= 256 + 63) {
        /* whole-line loads from here on (whole-line non-temporal stores with nt) */
        size_t head = (size_t)(-(uintptr_t)(nt ? (const unsigned char *)dst : src) & 63);
        c = mc_crc_tail(dst, src, head, c, copy);
        src += head, len -= head;
        if (copy) dst += head;
        __m512i z0 = MC_LDZ(src), z1 = MC_LDZ(src + 64), z2 = MC_LDZ(src + 128),
                z3 = MC_LDZ(src + 192);
        if (copy) {
            MC_STZ(dst, z0), MC_STZ(dst + 64, z1), MC_STZ(dst + 128, z2), MC_STZ(dst + 192, z3);
            dst += 256;
        }
        z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)(uint32_t)c)));
        src += 256, len -= 256;
        __m512i k = _mm512_broadcast_i32x4(mc_fold_k(5));
        while (len >= 256) {
            __m512i y0 = MC_LDZ(src), y1 = MC_LDZ(src + 64), y2 = MC_LDZ(src + 128),
                    y3 = MC_LDZ(src + 192);
            if (copy) {
                MC_STZ(dst, y0), MC_STZ(dst + 64, y1), MC_STZ(dst + 128, y2),
                    MC_STZ(dst + 192, y3);
                dst += 256;
            }
            z0 = mc_fold512(z0, k, y0);
            z1 = mc_fold512(z1, k, y1);
            z2 = mc_fold512(z2, k, y2);
            z3 = mc_fold512(z3, k, y3);
            src += 256, len -= 256;
        }
        k = _mm512_broadcast_i32x4(mc_fold_k(3));
        z1 = mc_fold512(z0, k, z1);
        z3 = mc_fold512(z2, k, z3);
        z0 = mc_fold512(z1, _mm512_broadcast_i32x4(mc_fold_k(4)), z3);
        while (len >= 64) {
            __m512i y = MC_LDZ(src);
            if (copy) MC_STZ(dst, y), dst += 64;
            z0 = mc_fold512(z0, k, y);
            src += 64, len -= 64;
        }
        if (nt) _mm_sfence();
        /* the four 128-bit lanes of z0 into its last */
        __m128i x = _mm512_extracti32x4_epi32(z0, 3);
        x = _mm_xor_si128(x, mc_fold128(_mm512_extracti32x4_epi32(z0, 0), mc_fold_k(2)));
        x = _mm_xor_si128(x, mc_fold128(_mm512_extracti32x4_epi32(z0, 1), mc_fold_k(1)));
        x = _mm_xor_si128(x, mc_fold128(_mm512_extracti32x4_epi32(z0, 2), mc_fold_k(0)));
        __m128i k16 = mc_fold_k(0);
        while (len >= 16) {
            __m128i y = _mm_loadu_si128((const __m128i *)(const void *)src);
            if (copy) _mm_storeu_si128((__m128i *)(void *)dst, y), dst += 16;
            x = _mm_xor_si128(mc_fold128(x, k16), y);
            src += 16, len -= 16;
        }
        c = mc_fold_finish(x);
        return mc_crc_tail(dst, src, len, c, copy);
    }
    return mc_crc_clmul_body(dst, src, len, c, copy, 0);
}

MC_AVX512_TARGET static uint32_t mc_crc32c_avx512(uint32_t crc, const unsigned char *p,
                                                  size_t len) {
    return (uint32_t)mc_crc_avx512_body(NULL, p, len, crc ^ 0xffffffffu, 0, 0) ^ 0xffffffffu;
}

MC_AVX512_TARGET static uint32_t mc_copy_crc32c_avx512(unsigned char *dst,
                                                       const unsigned char *src, size_t len,
                                                       uint32_t crc, int nt) {
    uint64_t c = crc ^ 0xffffffffu;
    c = nt ? mc_crc_avx512_body(dst, src, len, c, 1, 1)
           : mc_crc_avx512_body(dst, src, len, c, 1, 0);
    return (uint32_t)c ^ 0xffffffffu;
}
#undef MC_LD
#undef MC_ST
#undef MC_LDZ
#undef MC_STZ
#endif

static inline uint32_t mc_crc32c(uint32_t crc, const void *p, size_t len) {
#if MC_CRC_HAVE_FOLD
    if (mc_crc_kernel == MC_CRC_K_AVX512)
        return mc_crc32c_avx512(crc, (const unsigned char *)p, len);
    if (mc_crc_kernel == MC_CRC_K_PCLMUL)
        return mc_crc32c_clmul(crc, (const unsigned char *)p, len);
#endif
#if MC_CRC_HAVE_HW
    if (mc_crc_hw) return mc_crc32c_hw(crc, (const unsigned char *)p, len);
#endif
    return mc_crc32c_sw(crc, (const unsigned char *)p, len);
}

#if MC_CRC_HAVE_HW

#define MC_FUSED_BLOCK(B, TAB)                                                             \
    while (len >= 3 * (size_t)(B)) {                                                       \
        crc1 = crc2 = 0;                                                                   \
        for (size_t i = 0; i < (size_t)(B); i += 8) {                                      \
            uint64_t a = mc_ld64(src + i), b = mc_ld64(src + (B) + i),                     \
                     c = mc_ld64(src + 2 * (B) + i);                                       \
            crc0 = MC_CRC64(crc0, a);                                                      \
            crc1 = MC_CRC64(crc1, b);                                                      \
            crc2 = MC_CRC64(crc2, c);                                                      \
            mc_st64(dst + i, a);                                                           \
            mc_st64(dst + (B) + i, b);                                                     \
            mc_st64(dst + 2 * (B) + i, c);                                                 \
        }                                                                                  \
        crc0 = mc_crc_shift(TAB, (uint32_t)crc0) ^ crc1;                                   \
        crc0 = mc_crc_shift(TAB, (uint32_t)crc0) ^ crc2;                                   \
        src += 3 * (size_t)(B);                                                            \
        dst += 3 * (size_t)(B);                                                            \
        len -= 3 * (size_t)(B);                                                            \
    }

/* one pass: every 8-byte word is loaded once, fed to the CRC unit and stored (three streams,
 * as mc_crc32c_hw): bound by memory, not by the CRC, once the data is out of cache */
MC_CRC_TARGET static uint32_t mc_copy_crc32c_hw(unsigned char *dst, const unsigned char *src,
                                                size_t len, uint32_t crc) {
    uint64_t crc0 = crc ^ 0xffffffffu, crc1, crc2;
    while (len && ((uintptr_t)src & 7)) {
        unsigned char c = *src++;
        *dst++ = c;
        crc0 = MC_CRC8(crc0, c);
        len--;
    }
    MC_FUSED_BLOCK(MC_CRC_LONG, mc_crc_long)
    MC_FUSED_BLOCK(MC_CRC_SHORT, mc_crc_short)
    while (len >= 8) {
        uint64_t a = mc_ld64(src);
        crc0 = MC_CRC64(crc0, a);
        mc_st64(dst, a);
        src += 8;
        dst += 8;
        len -= 8;
    }
    while (len--) {
        unsigned char c = *src++;
        *dst++ = c;
        crc0 = MC_CRC8(crc0, c);
    }
    return (uint32_t)crc0 ^ 0xffffffffu;
}
#undef MC_FUSED_BLOCK
#endif

/* the CRC of A || B from crc(A), crc(B) and len(B) (len2 < 2**48) */
static uint32_t mc_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    for (int k = 0; len2 && k < 48; k++, len2 >>= 1)
        if (len2 & 1) crc1 = mc_gf2_times(mc_crc_pow2[k], crc1);
    return crc1 ^ crc2;
}

#define MC_CRC_CHUNK (6 * MC_CRC_LONG) /* 48 KiB: copied, then checksummed while cached */

static uint32_t mc_copy_crc32c_chunked(void *dst, const void *src, size_t len, uint32_t crc) {
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    while (len) {
        size_t n = len < MC_CRC_CHUNK ? len : MC_CRC_CHUNK;
        memcpy(d, s, n);
        crc = mc_crc32c(crc, d, n);
        d += n;
        s += n;
        len -= n;
    }
    return crc;
}

/* with stream (a destination not read again soon: a put into a store segment), the folding
 * kernels write copies of MC_CRC_STREAM_AT bytes and more with non-temporal stores (no read
 * of the destination lines first: a third less memory traffic once out of cache); the other
 * kernels ignore it */
#define MC_CRC_STREAM_AT 4096

static uint32_t mc_copy_crc32c_ex(void *dst, const void *src, size_t len, uint32_t crc,
                                  int stream) {
#if MC_CRC_HAVE_FOLD
    int nt = stream && len >= MC_CRC_STREAM_AT;
    if (mc_crc_kernel == MC_CRC_K_AVX512)
        return mc_copy_crc32c_avx512((unsigned char *)dst, (const unsigned char *)src, len, crc,
                                     nt);
    if (mc_crc_kernel == MC_CRC_K_PCLMUL)
        return mc_copy_crc32c_clmul((unsigned char *)dst, (const unsigned char *)src, len, crc,
                                    nt);
#else
    (void)stream;
#endif
#if MC_CRC_HAVE_HW
    if (mc_crc_hw)
        return mc_copy_crc32c_hw((unsigned char *)dst, (const unsigned char *)src, len, crc);
#endif
    return mc_copy_crc32c_chunked(dst, src, len, crc);
}

static uint32_t mc_copy_crc32c(void *dst, const void *src, size_t len, uint32_t crc) {
    return mc_copy_crc32c_ex(dst, src, len, crc, 0);
}

#endif
