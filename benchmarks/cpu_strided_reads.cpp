// Why plugins/cpu reads the store in memory order: one thread walks 48 KiB "splits" made of 24 pieces of 2 KiB,
// either contiguous (stride 2048) or 2 KiB apart from each other as one KV head's blocks are in a [block][Hkv][...]
// store (stride 6144 = SmolLM2's 3 heads), with optional FMA work per 32 bytes and optional software prefetch.
//
//   g++ -O2 -mavx2 -mfma -o build/strided benchmarks/cpu_strided_reads.cpp
//   build/strided MODE WORK [BYTES] [STRIDE]
//     MODE 0: no prefetch; 1: prefetcht1 the next split at its start; 2: the same with prefetcht0;
//          3: prefetcht1 one piece of the next split per piece processed.  WORK: 8-wide FMA chains x WORK per 32 bytes
//     (0: reads only). BYTES: buffer size (default 512 MiB; a small one gives the compute time alone).
// Prints ns per split and GB/s. On a 2-core AMD EPYC Zen 3: MODE 0 WORK 0 reads 8.7 GB/s contiguous and
// 3.3 GB/s strided; with WORK 4 strided takes about memory + compute time, contiguous about the compute time.
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv)
{
    if (argc < 3)
    {
        std::fprintf(stderr, "usage: %s MODE WORK [BYTES] [STRIDE]\n", argv[0]);
        return 2;
    }
    const int mode = std::atoi(argv[1]), work = std::atoi(argv[2]);
    const size_t n = argc > 3 ? size_t(std::atoll(argv[3])) : size_t(1) << 29;
    const size_t piece = 2048, stride = argc > 4 ? size_t(std::atoll(argv[4])) : 6144, perSplit = 24;
    const size_t nSplits = n / stride / perSplit;
    if (mode < 0 || mode > 3 || work < 0 || stride < piece || nSplits == 0)
    {
        std::fprintf(stderr, "MODE must be 0..3, WORK >= 0, STRIDE >= %zu, BYTES >= STRIDE x %zu\n", piece, perSplit);
        return 2;
    }
    char* buf = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
    std::memset(buf, 1, n);
    // 8 independent FMA chains in registers (named: an array here would live in memory at -O2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    auto at = [&](size_t split, size_t p) { return buf + (split * perSplit + p) * stride; };
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t s = 0; s < nSplits; ++s)
    {
        if ((mode == 1 || mode == 2) && s + 1 < nSplits)
            for (size_t p = 0; p < perSplit; ++p)
                for (size_t i = 0; i < piece; i += 64)
                {
                    if (mode == 1)
                        _mm_prefetch(at(s + 1, p) + i, _MM_HINT_T1);
                    else
                        _mm_prefetch(at(s + 1, p) + i, _MM_HINT_T0);
                }
        for (size_t p = 0; p < perSplit; ++p)
        {
            if (mode == 3 && s + 1 < nSplits)
                for (size_t i = 0; i < piece; i += 64)
                    _mm_prefetch(at(s + 1, p) + i, _MM_HINT_T1);
            const char* src = at(s, p);
            for (size_t i = 0; i < piece; i += 32)
            {
                const __m256 x = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
                for (int w = 0; w < work; ++w)
                {
                    a0 = _mm256_fmadd_ps(x, a0, x), a1 = _mm256_fmadd_ps(x, a1, x);
                    a2 = _mm256_fmadd_ps(x, a2, x), a3 = _mm256_fmadd_ps(x, a3, x);
                    a4 = _mm256_fmadd_ps(x, a4, x), a5 = _mm256_fmadd_ps(x, a5, x);
                    a6 = _mm256_fmadd_ps(x, a6, x), a7 = _mm256_fmadd_ps(x, a7, x);
                }
            }
        }
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float sink[8];
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
        _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    _mm256_storeu_ps(sink, sum);
    std::printf("mode %d work %d stride %zu: %.1f ns per split (%.2f GB/s) [%g]\n", mode, work, stride,
        dt / double(nSplits) * 1e9, double(nSplits * perSplit * piece) / dt / 1e9, double(sink[0]));
    std::free(buf);
    return 0;
}
