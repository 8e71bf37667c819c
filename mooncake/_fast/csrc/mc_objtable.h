/* C helpers of the object table (_objtable.pyx): a seeded 64-bit string hash, a UTF-8
 * validator that admits encoded surrogates (Python's "surrogatepass"), and a sort of
 * (seq, handle) pairs. */
#ifndef MC_OBJTABLE_H
#define MC_OBJTABLE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t mc_mix(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}
static inline uint64_t mc_r8(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t mc_r4(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* A wyhash-style keyed hash: 128-bit multiply-fold mixing of 16-byte lanes. */
static inline uint64_t mc_hash(const void *key, size_t len, uint64_t seed) {
    const uint8_t *p = (const uint8_t *)key;
    const uint64_t s0 = 0xa0761d6478bd642full, s1 = 0xe7037ed1a0b428dbull;
    uint64_t a, b;
    seed ^= mc_mix(seed ^ s0, s1);
    if (len <= 16) {
        if (len >= 4) {
            a = (mc_r4(p) << 32) | mc_r4(p + ((len >> 3) << 2));
            b = (mc_r4(p + len - 4) << 32) | mc_r4(p + len - 4 - ((len >> 3) << 2));
        } else if (len > 0) {
            a = ((uint64_t)p[0] << 16) | ((uint64_t)p[len >> 1] << 8) | p[len - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        size_t i = len;
        while (i > 16) {
            seed = mc_mix(mc_r8(p) ^ s1, mc_r8(p + 8) ^ seed);
            p += 16;
            i -= 16;
        }
        a = mc_r8(p + i - 16);
        b = mc_r8(p + i - 8);
    }
    a ^= s1;
    b ^= seed;
    {
        __uint128_t r = (__uint128_t)a * b;
        a = (uint64_t)r;
        b = (uint64_t)(r >> 64);
    }
    return mc_mix(a ^ s0 ^ (uint64_t)len, b ^ s1);
}

/* 1 if s[0:n] is UTF-8 as Python's "surrogatepass" decoder accepts it (encoded surrogates
 * U+D800..U+DFFF allowed; overlong forms and code points above U+10FFFF not), else 0. */
static inline int mc_utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) { i += 8; continue; }
        }
        unsigned c = s[i], c1;
        if (c < 0x80) { i++; continue; }
        if (c < 0xC2) return 0;
        if (c < 0xE0) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
            continue;
        }
        if (c < 0xF0) {
            if (i + 2 >= n) return 0;
            c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0;
            i += 3;
            continue;
        }
        if (c < 0xF5) {
            if (i + 3 >= n) return 0;
            c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && c1 < 0x90) return 0;
            if (c == 0xF4 && c1 >= 0x90) return 0;
            i += 4;
            continue;
        }
        return 0;
    }
    return 1;
}

typedef struct { int64_t seq; int64_t h; } mc_seqpair;

/* where a handle's key is: arena offset (-1: free handle), byte length, hash */
typedef struct { int64_t off; uint32_t len; uint32_t hash; } mc_keyref;

static int mc_seqpair_cmp(const void *x, const void *y) {
    const mc_seqpair *a = (const mc_seqpair *)x, *b = (const mc_seqpair *)y;
    if (a->seq != b->seq) return a->seq < b->seq ? -1 : 1;
    return (a->h > b->h) - (a->h < b->h);
}

static inline void mc_sort_seqpairs(mc_seqpair *p, size_t n) {
    if (n > 1) qsort(p, n, sizeof(mc_seqpair), mc_seqpair_cmp);
}

static inline void mc_prefetch(const void *p) { __builtin_prefetch(p, 1, 1); }

#endif
