// The timer of the inner-loop microbenchmark (cpu_inner_loops.cpp, cpu_inner_loops_vnni.cpp): best of 7 runs.
#pragma once
#include <algorithm>
#include <chrono>

template <class Fn>
static double bestSeconds(Fn fn)
{
    double best = 1e30;
    for (int rep = 0; rep < 7; ++rep)
    {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}
