// The avx512vnni path's two inner loops (plugins/cpu/src/kiviCpuIsaAvx512.cpp, S::kDOT8), for cpu_inner_loops.cpp:
// the quantized-key scores of one 16-token tile (keyTileDot8, row blocks of 4 as Attn::scoresPerChannel) and the
// 2-bit value accumulation over a 512-token split (valueSpanDot8 per 32-channel block, row blocks of 4 as
// Attn::valuesAccumulateDot8), on L1-resident scratch. Compiled with the path's own -m flags (CMakeLists.txt);
// main() calls it only when the CPU reports avx512vnni and avx512vbmi. keyTileDot8's inline-asm vpdpbusd must take
// its accumulator by value: by reference, g++ 12 keeps the accumulators in memory here (not inlined), unlike inside
// the kernel's scoresPerChannel, and the keys number overstates the kernel's loop (D 128, 4 rows: 603 vs 427 cycles
// per tile; tests/test_cpu_native.py checks the kernel's disassembly for it).
#include "kiviCpuIsaAvx512Vnni.cpp"
#include "cpu_inner_loops_timer.h"
#include <cstdlib>
#include <vector>

namespace
{
namespace V = trtllm_kivi::cpu::avx512vnni;
using trtllm_kivi::cpu::kDOT8_DIGITS;
using trtllm_kivi::cpu::kDOT8_VALUE_DWORDS;
using trtllm_kivi::cpu::kSCORE_STRIDE;
using trtllm_kivi::cpu::kSPLIT_LEN;

template <int D, int NR>
void keyBlock(const int32_t* tw, const int32_t* dig, const float* rec, const float* cz, float* sc)
{
    V::S::keyTileDot8<D, NR>(tw, dig, rec, cz, sc, kSCORE_STRIDE);
}

template <int D, int NR>
void valueBlock(const int32_t* tw, int nt, int j, const int32_t* const* dig, float* acc)
{
    V::S::valueSpanDot8<D, NR>(tw, nt, j, dig, 1e-6f, acc);
}

// Seconds of reps x 32 key tiles and of reps x (one split's values) for NR rows.
template <int D, int NR>
void timeLoops(int reps, double* keys, double* values)
{
    constexpr int TILE_WORDS = 16 * D * 2 / 32, NT = kSPLIT_LEN / 16;
    std::vector<int32_t> tw(NT * TILE_WORDS), kdig(NR * kDOT8_DIGITS * D / 4), vdig(NR * kDOT8_VALUE_DWORDS);
    for (auto* v : {&tw, &kdig, &vdig})
        for (auto& x : *v)
            x = std::rand();
    std::vector<float> rec(NR, 1e-6f), cz(NR, 0.0f), scores(NR * kSCORE_STRIDE), acc(NR * D, 0.0f);
    *keys = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
            for (int t = 0; t < NT; ++t)
            {
                for (int r0 = 0; r0 < NR; r0 += 4) // scoresPerChannel's row blocks
                {
                    const int32_t* w = tw.data() + t * TILE_WORDS;
                    const int32_t* dg = kdig.data() + r0 * kDOT8_DIGITS * D / 4;
                    float* sc = scores.data() + r0 * kSCORE_STRIDE + 16 * t;
                    switch (std::min(4, NR - r0))
                    {
                    case 1: keyBlock<D, 1>(w, dg, rec.data() + r0, cz.data() + r0, sc); break;
                    case 2: keyBlock<D, 2>(w, dg, rec.data() + r0, cz.data() + r0, sc); break;
                    case 3: keyBlock<D, 3>(w, dg, rec.data() + r0, cz.data() + r0, sc); break;
                    default: keyBlock<D, 4>(w, dg, rec.data() + r0, cz.data() + r0, sc); break;
                    }
                }
                asm volatile("" ::: "memory");
            }
    });
    *values = bestSeconds([&] {
        for (int r = 0; r < reps; ++r)
        {
            for (int j = 0; j < D / 32; ++j) // Gv 32: channel block j is value group j
                for (int r0 = 0, nr; r0 < NR; r0 += nr)
                {
                    const int32_t* dig[4];
                    nr = std::min(4, NR - r0);
                    for (int i = 0; i < nr; ++i)
                        dig[i] = vdig.data() + (r0 + i) * kDOT8_VALUE_DWORDS + j * NT * 16;
                    float* ac = acc.data() + r0 * D;
                    switch (nr)
                    {
                    case 1: valueBlock<D, 1>(tw.data(), NT, j, dig, ac); break;
                    case 2: valueBlock<D, 2>(tw.data(), NT, j, dig, ac); break;
                    case 3: valueBlock<D, 3>(tw.data(), NT, j, dig, ac); break;
                    default: valueBlock<D, 4>(tw.data(), NT, j, dig, ac); break;
                    }
                }
            asm volatile("" ::: "memory");
        }
    });
}
} // namespace

// Cycles per 16-token tile (keys, values) of the avx512vnni loops for head_dim d and nr rows (the shapes of
// cpu_inner_loops.cpp); false for another shape.
bool vnniCyclesPerTile(int d, int nr, double ghz, double* keys, double* values)
{
    const int reps = 4000;
    if (d == 64 && nr == 3)
        timeLoops<64, 3>(reps, keys, values);
    else if (d == 128 && nr == 4)
        timeLoops<128, 4>(reps, keys, values);
    else if (d == 128 && nr == 1)
        timeLoops<128, 1>(reps, keys, values);
    else
        return false;
    const double cyc = ghz * 1e9 / (double(reps) * (kSPLIT_LEN / 16));
    *keys *= cyc;
    *values *= cyc;
    return true;
}
