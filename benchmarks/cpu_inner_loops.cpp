// How close the AVX2 paths' two inner loops (plugins/cpu/src/kiviCpuKernel.h) come to the core's FMA peak: the
// quantized-key scores of one 16-token tile (keyTile<2, NR>) and the 2-bit value accumulation over it (valueBlock, every
// 32-channel block, the op's row blocks), for the `avx2` decode (shift, mask, convert) and the `avx2denormal` one
// (keyTileDn / valueBlockDn, kiviCpuDenormal2.h: one AND, row blocks of 3, then 2 or 1), on L1-resident scratch as the op stages it, for the decode rows of a GQA group
// (SmolLM2: D 64, 3 rows; Llama-3-8B: D 128, 4 rows). Both loops do NR D 16 / 8 fp32 FMAs per tile; the floor assumes
// two 8-wide FMAs per cycle (Zen 3, Intel since Haswell). The core clock is measured in the same run by a dependent
// imul chain (3 cycles per imul on Intel and AMD cores; a dependent add-immediate chain runs faster than 1 per cycle
// on Golden Cove-class cores, which eliminate such adds at rename: it read 11.8 GHz on a 3 GHz Xeon). On a CPU with AVX-512 VNNI + VBMI the avx512vnni loops are timed too
// (cpu_inner_loops_vnni.cpp: keyTileDot8 / valueSpanDot8, with their count of 512-bit vpdpbusd per tile; Zen 4 issues
// one per cycle). Prints JSON (benchmarks/results/cpu_inner_loops_<machine>.json, e.g. _epyc-avx2, _zen4, _xeon):
//
//   bash build_scripts/build_cpu_kernels.sh --bench && build/cpu/kivi_cpu_inner_loops
#include "kiviCpuIsaAvx2Denormal.cpp" // the avx2 kernels and the avx2denormal ones (same S, same flags)
#include "cpu_inner_loops_timer.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using namespace trtllm_kivi::cpu::avx2denormal::kernel;
using Isa = trtllm_kivi::cpu::avx2denormal::S;

// cpu_inner_loops_vnni.cpp (its own -m flags)
bool vnniCyclesPerTile(int d, int nr, double ghz, double* keys, double* values);
static bool hasVnni()
{
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi")
        && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static double clockGhz()
{
    const long n = 100000000;
    const double s = bestSeconds([&] {
        long x = 3;
        for (long i = 0; i < n; ++i)
            asm volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
    });
    return 12.0 * n / s / 1e9;
}

// Cycles per 16-token tile of keyTile and of valueBlock over all D / 32 channel blocks (a 512-token split of tiles).
template <int D, int NR>
static void measure(double ghz, bool last)
{
    constexpr int TILE_WORDS = 16 * D * 2 / 32, NT = trtllm_kivi::cpu::kSPLIT_LEN / 16, NG = D / 32;
    using A = Attn<D>;
    std::vector<int32_t> tw(NT * TILE_WORDS);
    std::vector<float> qs(NR * D), cz(NR), scores(NR * A::scoreStride()), acc(NR * D, 0.0f);
    std::vector<float> coef(static_cast<size_t>(NR * NG) * A::scoreStride());
    for (auto& x : tw)
        x = std::rand();
    for (auto& x : qs)
        x = std::rand() / float(RAND_MAX);
    for (auto& x : coef)
        x = std::rand() / float(RAND_MAX) * 1e-3f;
    const int reps = 4000;
    const double keys = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
            for (int t = 0; t < NT; ++t)
            {
                A::template keyTile<2, NR>(tw.data() + t * TILE_WORDS, qs.data(), cz.data(), scores.data() + 16 * t);
                asm volatile("" ::: "memory");
            }
    });
    const int64_t cs = int64_t(NG) * A::scoreStride();
    const double values = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
        {
            for (int k = 0; k < D / 32; ++k) // Gv 32: block k is value group k; row blocks as valuesAccumulate's
                for (int r0 = 0, nr; r0 < NR; r0 += nr)
                {
                    const float* cf = coef.data() + r0 * cs + k;
                    float* ac = acc.data() + r0 * D;
                    switch (nr = NR - r0 < A::QRB ? NR - r0 : A::QRB)
                    {
                    case 1: A::template valueBlock<2, 1>(tw.data(), 0, 16 * NT, k, cf, NG, cs, ac); break;
                    case 2: A::template valueBlock<2, 2>(tw.data(), 0, 16 * NT, k, cf, NG, cs, ac); break;
                    default: A::template valueBlock<2, 3>(tw.data(), 0, 16 * NT, k, cf, NG, cs, ac); break;
                    }
                }
            asm volatile("" ::: "memory");
        }
    });
    // row blocks as the op's (dnRowBlock: 3 first, then 2 or 1): RB0 rows, then RB1 (0: none)
    constexpr int RB0 = dnRowBlock(NR), RB1 = NR > RB0 ? dnRowBlock(NR - RB0) : 0;
    static_assert(RB0 + RB1 == NR, "two row blocks cover the shapes measured");
    const double keysDn = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
            for (int t = 0; t < NT; ++t)
            {
                float* sc = scores.data() + 16 * t;
                Isa::template keyTileDn<D, RB0>(tw.data() + t * TILE_WORDS, qs.data(), cz.data(), sc, A::scoreStride());
                if constexpr (RB1 > 0)
                    Isa::template keyTileDn<D, RB1>(tw.data() + t * TILE_WORDS, qs.data() + RB0 * D, cz.data() + RB0,
                        sc + RB0 * A::scoreStride(), A::scoreStride());
                asm volatile("" ::: "memory");
            }
    });
    const double valuesDn = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
        {
            for (int k = 0; k < D / 32; ++k) // as valuesAccumulate's dn branch
            {
                Isa::template valueBlockDn<D, RB0>(tw.data(), NT, k, coef.data() + k, NG, cs, acc.data());
                if constexpr (RB1 > 0)
                    Isa::template valueBlockDn<D, RB1>(tw.data(), NT, k, coef.data() + RB0 * cs + k, NG, cs,
                        acc.data() + RB0 * D);
            }
            asm volatile("" ::: "memory");
        }
    });
    const double floor = NR * D * 16 / 8 / 2.0, tiles = double(reps) * NT, cyc = ghz * 1e9 / tiles;
    const double kc = keys * cyc, vc = values * cyc, kd = keysDn * cyc, vd = valuesDn * cyc;
    std::printf("  {\"head_dim\": %d, \"rows\": %d, \"fma_floor_cycles_per_tile\": %.0f,\n", D, NR, floor);
    std::printf("   \"avx2\": {\"keyTile_cycles_per_tile\": %.1f, \"keyTile_over_floor\": %.2f, ", kc, kc / floor);
    std::printf("\"valueBlock_cycles_per_tile\": %.1f, \"valueBlock_over_floor\": %.2f},\n", vc, vc / floor);
    std::printf("   \"avx2denormal\": {\"row_blocks\": \"%d%s\", \"keyTileDn_cycles_per_tile\": %.1f, "
                "\"keyTileDn_over_floor\": %.2f, ", RB0, RB1 ? (RB1 == 2 ? " + 2" : " + 1") : "", kd, kd / floor);
    std::printf("\"valueBlockDn_cycles_per_tile\": %.1f, \"valueBlockDn_over_floor\": %.2f}", vd, vd / floor);
    double kv, vv;
    if (hasVnni() && vnniCyclesPerTile(D, NR, ghz, &kv, &vv))
    {
        // NR D 16 2-bit products x 3 digits, 64 per 512-bit vpdpbusd
        const double dpFloor = NR * D * 16 * trtllm_kivi::cpu::kDOT8_DIGITS / 64.0;
        std::printf(",\n   \"avx512vnni\": {\"vpdpbusd_per_tile\": %.0f, \"keyTileDot8_cycles_per_tile\": %.1f, "
                    "\"valueSpanDot8_cycles_per_tile\": %.1f}", dpFloor, kv, vv);
    }
    std::printf("}%s\n", last ? "" : ",");
}

static std::string cpuModel()
{
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);)
        if (line.rfind("model name", 0) == 0)
            return line.substr(line.find(':') + 2);
    return "unknown";
}

int main()
{
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    {
        std::fprintf(stderr, "cpu_inner_loops: this CPU has no AVX2 + FMA\n");
        return 1;
    }
    const double ghz = clockGhz();
    std::printf("{\"benchmark\": \"cpu_inner_loops\", \"paths\": [\"avx2\", \"avx2denormal\"%s], \"cpu_model\": \"%s\", \"compiler\": \"g++ %s\",\n",
        hasVnni() ? ", \"avx512vnni\"" : "", cpuModel().c_str(), __VERSION__);
    std::printf(" \"core_clock_ghz_measured\": %.2f,\n", ghz);
    std::printf(" \"unit\": \"core cycles per 16-token tile, L1-resident, 1 thread, best of 7\",\n \"shapes\": [\n");
    measure<64, 3>(ghz, false);
    measure<128, 4>(ghz, false);
    measure<128, 1>(ghz, true); // MHA (e.g. Llama-2-7B): one decode row per KV head
    std::printf(" ]}\n");
    return 0;
}
