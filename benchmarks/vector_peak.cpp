// The loops benchmarks/vector_peak.py times: independent AVX-512 instructions on registers, and the
// 8-row step of the bfloat16 panel products with its operands in L1. Built by that script with g++.
// Every instruction is asm volatile, so none is dropped though no result is read.
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#define R24(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
               X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define DECL(i) __m512 a##i = _mm512_setzero_ps();
static double seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
extern "C" double clock_hz(long iters) {
    long x = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; i++) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    return 4.0 * iters / seconds(t0);
}
// Instructions a second on each thread (the slowest thread's), kind 0 vfmadd231ps, 1 vdpbf16ps.
extern "C" double per_thread(int kind, long iters, int threads) {
    double slowest = 0;
    #pragma omp parallel num_threads(threads) reduction(max : slowest)
    {
        R24(DECL)
        __m512 x = _mm512_set1_ps(1e-8f);
        #pragma omp barrier
        auto t0 = std::chrono::steady_clock::now();
        for (long n = 0; n < iters; n++) {
            if (kind == 0) {
#define FMA(i) asm volatile("vfmadd231ps %1, %1, %0" : "+v"(a##i) : "v"(x));
                R24(FMA)
            } else {
#define DOT(i) asm volatile("vdpbf16ps %1, %1, %0" : "+v"(a##i) : "v"(x));
                R24(DOT)
            }
        }
        slowest = seconds(t0);
    }
    return 24.0 * iters / slowest;
}
// Steps a second of the 8-row, 3-panel block on bfloat16 panels, all operands in L1.
alignas(64) static int inputs[64];
alignas(64) static int panels[48];
extern "C" double block_steps(long iters) {
    R24(DECL)
    __m512 w0, w1, w2, b;
    auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < iters; n++) {
        asm volatile("vmovdqu64 (%3), %0\n\tvmovdqu64 64(%3), %1\n\tvmovdqu64 128(%3), %2"
                     : "=v"(w0), "=v"(w1), "=v"(w2) : "r"(panels));
#define ROW(r, A, B, C)                                                    \
        asm volatile("vpbroadcastd %1, %0" : "=v"(b) : "m"(inputs[r]));     \
        asm volatile("vdpbf16ps %1, %2, %0" : "+v"(A) : "v"(b), "v"(w0));   \
        asm volatile("vdpbf16ps %1, %2, %0" : "+v"(B) : "v"(b), "v"(w1));   \
        asm volatile("vdpbf16ps %1, %2, %0" : "+v"(C) : "v"(b), "v"(w2));
        ROW(0, a0, a1, a2) ROW(1, a3, a4, a5) ROW(2, a6, a7, a8) ROW(3, a9, a10, a11)
        ROW(4, a12, a13, a14) ROW(5, a15, a16, a17) ROW(6, a18, a19, a20) ROW(7, a21, a22, a23)
    }
    return iters / seconds(t0);
}
