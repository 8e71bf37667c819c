/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), hardware accelerated.
 *
 * x86-64: SSE4.2 `crc32` instruction (_mm_crc32_u64), three independent streams over
 * 8 KiB / 256 B blocks combined by "append zeros" operators (Mark Adler's method), so the
 * instruction's 3-cycle latency is hidden: ~3x one stream. aarch64: the ARMv8 CRC32C
 * instructions (__crc32cd) in the same shape. Anything else, or a CPU without them (checked
 * at run time): slice-by-8 tables.
 *
 * Conventions (the standard CRC32C, as iSCSI / ext4 / google-crc32c): initial value and final
 * xor 0xFFFFFFFF, so mc_crc32c(mc_crc32c(0, a), b) == mc_crc32c(0, a || b) and
 * mc_crc32c(0, "123456789") == 0xE3069283.
 *
 * mc_copy_crc32c copies and checksums in one pass over the data: with the CRC instruction each
 * 8-byte word is loaded once, checksummed and stored; without it, chunks small enough to stay
 * in the core's cache are copied, then checksummed from the copy. mc_crc32c_combine gives
 * crc(A || B) from crc(A), crc(B) and len(B).
 */
#ifndef MC_CRC32C_H
#define MC_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#define MC_CRC_TARGET __attribute__((target("sse4.2")))
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

#define MC_CRC_POLY 0x82f63b78u
#define MC_CRC_LONG 8192
#define MC_CRC_SHORT 256

static uint32_t mc_crc_sw[8][256];
static uint32_t mc_crc_long[4][256];
static uint32_t mc_crc_short[4][256];
static int mc_crc_hw = 0;
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

static void mc_crc32c_init(void) {
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
    mc_crc_hw = __builtin_cpu_supports("sse4.2");
#elif defined(__aarch64__)
    mc_crc_hw = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#endif
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

static inline uint32_t mc_crc32c(uint32_t crc, const void *p, size_t len) {
#if MC_CRC_HAVE_HW
    if (mc_crc_hw) return mc_crc32c_hw(crc, (const unsigned char *)p, len);
#endif
    return mc_crc32c_sw(crc, (const unsigned char *)p, len);
}

#if MC_CRC_HAVE_HW
static inline void mc_st64(unsigned char *p, uint64_t w) { memcpy(p, &w, 8); }

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

static uint32_t mc_copy_crc32c(void *dst, const void *src, size_t len, uint32_t crc) {
#if MC_CRC_HAVE_HW
    if (mc_crc_hw)
        return mc_copy_crc32c_hw((unsigned char *)dst, (const unsigned char *)src, len, crc);
#endif
    return mc_copy_crc32c_chunked(dst, src, len, crc);
}

#endif
