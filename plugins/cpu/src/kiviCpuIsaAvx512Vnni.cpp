// AVX-512 + VNNI + VBMI path (Ice Lake, Sapphire Rapids, Zen 4 and later): kiviCpuIsaAvx512.cpp with its integer
// dot products for 2-bit codes (S::kDOT8), compiled with -mavx512vnni -mavx512vbmi as well; only called when the CPU
// reports avx512vnni and avx512vbmi too.
#define KIVI_AVX512_VNNI 1
#include "kiviCpuIsaAvx512.cpp"
