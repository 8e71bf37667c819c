/* memcpy(3) that avoids a slow case of the string instructions.
 *
 * glibc copies blocks between ~2 KiB and its non-temporal threshold with `rep movsb`. On AMD
 * Zen cores that instruction runs at a fraction of memory bandwidth when the destination sits
 * just above the source modulo 4 KiB ((dst - src) mod 4096 in [1, 63]): measured 0.5-0.8 GB/s
 * against 3-3.7 GB/s otherwise for 16 KiB copies. That is the everyday layout of a store read
 * (a page-aligned segment replica into a malloc'd buffer that starts 16 bytes into its page),
 * so copies in that band use a plain 64-bytes-per-step vector loop instead. */
#ifndef MC_COPY_H
#define MC_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define MC_COPY_VECTOR 1
#endif

static inline void mc_copy(void *dst, const void *src, size_t n) {
#ifdef MC_COPY_VECTOR
    uintptr_t gap = ((uintptr_t)dst - (uintptr_t)src) & 4095u;
    if (n >= 1024 && gap != 0 && gap < 64) {
        uint8_t *d = (uint8_t *)dst;
        const uint8_t *s = (const uint8_t *)src;
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_storeu_si128((__m128i *)(d + 0), a);
            _mm_storeu_si128((__m128i *)(d + 16), b);
            _mm_storeu_si128((__m128i *)(d + 32), c);
            _mm_storeu_si128((__m128i *)(d + 48), e);
            s += 64;
            d += 64;
            n -= 64;
        }
        if (n)
            memcpy(d, s, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* A copy whose destination will not be read again soon (a put into a store segment):
 * non-temporal stores skip reading the destination lines into the cache first, a third less
 * memory traffic for copies larger than the cache. Call mc_copy_fence() after a batch. */
static inline void mc_copy_stream(void *dst, const void *src, size_t n) {
#ifdef MC_COPY_VECTOR
    if (n >= 4096) {
        uint8_t *d = (uint8_t *)dst;
        const uint8_t *s = (const uint8_t *)src;
        size_t head = (16 - ((uintptr_t)d & 15u)) & 15u;
        if (head) {
            memcpy(d, s, head);
            d += head;
            s += head;
            n -= head;
        }
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)(d + 0), a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
            s += 64;
            d += 64;
            n -= 64;
        }
        if (n)
            memcpy(d, s, n);
        return;
    }
#endif
    mc_copy(dst, src, n);
}

static inline void mc_copy_fence(void) {
#ifdef MC_COPY_VECTOR
    _mm_sfence();
#endif
}

#endif
