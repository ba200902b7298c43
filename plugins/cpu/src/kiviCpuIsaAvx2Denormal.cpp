// AVX2 path with the one-AND decode of 2-bit codes as subnormal floats (kiviCpuDenormal2.h): kiviCpuIsaAvx2.cpp
// compiled again with KIVI_AVX2_DENORMAL (same -m flags). `auto` picks it on AMD CPUs without AVX-512 (Zen 1-3); it
// runs on any AVX2 CPU when forced, slowly on Intel (subnormal operands take a microcode assist there).
#define KIVI_AVX2_DENORMAL 1
#include "kiviCpuIsaAvx2.cpp"
