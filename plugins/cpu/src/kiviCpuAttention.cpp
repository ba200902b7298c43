// Dispatcher of the native CPU KiviAttention op: validation, ISA choice, the thread pool, the work decomposition and
// the append (quantize, pack, flush, window write). Compiled without -m flags and with -ffp-contract=off: the quantizer
// must match trtllm_kivi/reference/quant.py bit for bit (IEEE fp32 division, round half to even, RNE fp16/bf16 casts).
#include "kiviCpuApi.h"
#include "kiviCpuCommon.h"
#include "kiviCpuIsa.h"
#include "kiviFormat.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace trtllm_kivi
{
namespace cpu
{
namespace
{

thread_local std::string tLastError;

int32_t fail(const std::string& msg)
{
    tLastError = msg;
    return kiviCpuInvalidValue;
}

// ------------------------------------------------------------------------------------------------ ISA selection

bool cpuHas(int32_t isa)
{
#if defined(KIVI_CPU_HAVE_X86)
    __builtin_cpu_init();
    if (isa == kiviCpuIsaAvx2 || isa == kiviCpuIsaAvx2Denormal)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == kiviCpuIsaAvx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
            && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    if (isa == kiviCpuIsaAvx512Vnni)
        return cpuHas(kiviCpuIsaAvx512) && __builtin_cpu_supports("avx512vnni")
            && __builtin_cpu_supports("avx512vbmi");
#endif
    return isa == kiviCpuIsaPortable;
}

int32_t envIsa()
{
    const char* e = std::getenv("TRTLLM_KIVI_CPU_ISA");
    if (e == nullptr || *e == 0 || std::strcmp(e, "auto") == 0)
        return kiviCpuIsaAuto;
    if (std::strcmp(e, "portable") == 0)
        return kiviCpuIsaPortable;
    if (std::strcmp(e, "avx2") == 0)
        return kiviCpuIsaAvx2;
    if (std::strcmp(e, "avx2denormal") == 0)
        return kiviCpuIsaAvx2Denormal;
    if (std::strcmp(e, "avx512") == 0)
        return kiviCpuIsaAvx512;
    if (std::strcmp(e, "avx512vnni") == 0)
        return kiviCpuIsaAvx512Vnni;
    return -1;
}

int32_t resolveIsa(int32_t isa)
{
    if (isa == kiviCpuIsaAuto)
        isa = envIsa();
    if (isa == kiviCpuIsaAuto)
    {
        for (int32_t i = kiviCpuIsaAvx512Vnni; i > kiviCpuIsaAvx2; --i)
            if (cpuHas(i))
                return i;
#if defined(KIVI_CPU_HAVE_X86)
        // AMD multiplies subnormal operands at full speed (kiviCpuDenormal2.h); Intel takes an assist per operand
        if (cpuHas(kiviCpuIsaAvx2))
            return __builtin_cpu_is("amd") ? kiviCpuIsaAvx2Denormal : kiviCpuIsaAvx2;
#endif
        return kiviCpuIsaPortable;
    }
    return isa;
}

const IsaKernels* kernelsFor(int32_t isa)
{
    const int32_t r = resolveIsa(isa);
    if (r < kiviCpuIsaPortable || r > kiviCpuIsaAvx2Denormal)
    {
        tLastError = "isa=" + std::to_string(isa) + " (or $TRTLLM_KIVI_CPU_ISA) is not a path; allowed: 0 auto, "
            "1 portable, 2 avx2, 3 avx512, 4 avx512vnni, 5 avx2denormal ($TRTLLM_KIVI_CPU_ISA: "
            "auto|portable|avx2|avx2denormal|avx512|avx512vnni)";
        return nullptr;
    }
    if (!cpuHas(r))
    {
        static const char* names[] = {"auto", "portable", "avx2", "avx512", "avx512vnni", "avx2denormal"};
        tLastError = std::string("isa path ") + names[r] + " is not supported by this CPU (or not compiled in)";
        return nullptr;
    }
#if defined(KIVI_CPU_HAVE_X86)
    if (r == kiviCpuIsaAvx512Vnni)
        return &kAvx512VnniKernels;
    if (r == kiviCpuIsaAvx512)
        return &kAvx512Kernels;
    if (r == kiviCpuIsaAvx2)
        return &kAvx2Kernels;
    if (r == kiviCpuIsaAvx2Denormal)
        return &kAvx2DenormalKernels;
#endif
    return &kPortableKernels;
}

// ------------------------------------------------------------------------------------------------ thread pool

// Spin-wait hint (x86: pause) for the pool's short waits.
static inline void cpuRelax()
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
}

// Spins until done() or `ns` nanoseconds have passed (the clock read once per 64 pauses); true if done.
template <class Done>
static bool spinFor(int64_t ns, Done done)
{
    const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (;;)
    {
        for (int i = 0; i < 64; ++i)
        {
            if (done())
                return true;
            cpuRelax();
        }
        if (std::chrono::steady_clock::now() >= end)
            return done();
    }
}

// A persistent pool: run(n, fn) calls fn(item, thread) for item in [0, n) on up to `threads` threads (the caller is
// thread 0) and returns when all are done. Items are taken in order from an atomic counter. Idle workers spin before
// sleeping on a condition variable (waking a sleeping worker took ~45 us here, and the notify ~20 us, against ~1.1 ms
// of 2-thread work per SmolLM2 layer at 8K). How long they spin follows the gap between the last two runs: up to twice
// that gap, in [kSPIN_MIN_NS, kSPIN_MAX_NS], when calls come back to back (the op called layer after layer with only
// Python between, ~30 us), kSPIN_MIN_NS when they are far apart. In a model step torch's GEMMs run between the op's
// calls on the same cores, and a worker spinning through them slowed SmolLM2 decode at 512 tokens 1.5x (a fixed
// 200 us spin); with ~1 ms gaps the spin stays at kSPIN_MIN_NS there.
class ThreadPool
{
public:
    ~ThreadPool()
    {
        {
            std::lock_guard<std::mutex> lock(mMutex);
            mStop = true;
            mGeneration.fetch_add(1);
        }
        mCv.notify_all();
        for (auto& t : mWorkers)
            t.join();
    }

    void run(int threads, int64_t n, const std::function<void(int64_t, int)>& fn)
    {
        if (threads > n)
            threads = int(n);
        if (threads <= 1)
        {
            for (int64_t i = 0; i < n; ++i)
                fn(i, 0);
            return;
        }
        std::lock_guard<std::mutex> runLock(mRunMutex); // one step at a time through the pool
        const auto start = std::chrono::steady_clock::now();
        while (int(mWorkers.size()) < threads - 1)
        {
            const int id = int(mWorkers.size()) + 1;
            mWorkers.emplace_back([this, id] { worker(id); });
        }
        {
            std::lock_guard<std::mutex> lock(mMutex);
            mFn = &fn;
            mN = n;
            mNext.store(0);
            mWanted = threads - 1;
            mPending.store(threads - 1);
            mGeneration.fetch_add(1);
        }
        mCv.notify_all();
        drain(0);
        if (!spinFor(kSPIN_MIN_NS, [this] { return mPending.load() == 0; }))
        {
            std::unique_lock<std::mutex> lock(mMutex);
            mDoneCv.wait(lock, [this] { return mPending.load() == 0; });
        }
        mFn = nullptr;
        // the workers' next spin: from the gap between the previous run's end and this run's start
        const auto end = std::chrono::steady_clock::now();
        const int64_t gap = std::chrono::duration_cast<std::chrono::nanoseconds>(start - mLastEnd).count();
        mSpinNs.store(gap >= 0 && gap < kSPIN_MAX_NS ? std::clamp(2 * gap, kSPIN_MIN_NS, kSPIN_MAX_NS) : kSPIN_MIN_NS);
        mLastEnd = end;
    }

private:
    static constexpr int64_t kSPIN_MIN_NS = 25000;  // ~2000 pauses: the shortest spin, and the one after a long gap
    static constexpr int64_t kSPIN_MAX_NS = 250000;

    void drain(int tid)
    {
        for (int64_t i = mNext.fetch_add(1); i < mN; i = mNext.fetch_add(1))
            (*mFn)(i, tid);
    }

    void worker(int id)
    {
        uint64_t seen = 0;
        for (;;)
        {
            spinFor(mSpinNs.load(), [&] { return mGeneration.load() != seen; });
            std::unique_lock<std::mutex> lock(mMutex);
            mCv.wait(lock, [&] { return mGeneration.load() != seen; });
            seen = mGeneration.load();
            if (mStop)
                return;
            if (id > mWanted)
                continue;
            lock.unlock();
            drain(id);
            lock.lock();
            if (mPending.fetch_sub(1) == 1)
                mDoneCv.notify_one();
        }
    }

    std::vector<std::thread> mWorkers;
    std::mutex mMutex, mRunMutex;
    std::condition_variable mCv, mDoneCv;
    const std::function<void(int64_t, int)>* mFn = nullptr;
    std::atomic<int64_t> mNext{0};
    int64_t mN = 0;
    int mWanted = 0;
    std::atomic<int> mPending{0};
    std::atomic<uint64_t> mGeneration{0};
    std::atomic<int64_t> mSpinNs{kSPIN_MIN_NS};
    std::chrono::steady_clock::time_point mLastEnd{};
    bool mStop = false;
};

ThreadPool& pool()
{
    static ThreadPool p;
    return p;
}

std::atomic<int32_t> gNumThreads{0};

int32_t defaultThreads()
{
    const int32_t set = gNumThreads.load();
    if (set > 0)
        return set;
    if (const char* e = std::getenv("TRTLLM_KIVI_CPU_THREADS"))
    {
        const int n = std::atoi(e);
        if (n > 0)
            return n;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc ? int32_t(hc) : 1;
}

// ------------------------------------------------------------------------------------------------ validation

bool oneOf(int32_t v, std::initializer_list<int32_t> allowed)
{
    for (int32_t a : allowed)
        if (v == a)
            return true;
    return false;
}

std::string str(int64_t v)
{
    return std::to_string(v);
}

int32_t checkLengths(int32_t batch, int32_t numTokens, int32_t numSlots, const int32_t* slotIds,
    const int32_t* pastLen, const int32_t* chunkLen)
{
    int64_t total = 0;
    for (int32_t b = 0; b < batch; ++b)
    {
        if (pastLen[b] < 0 || chunkLen[b] < 0)
            return fail("sequence " + str(b) + ": past_len=" + str(pastLen[b]) + " and chunk_len=" + str(chunkLen[b])
                + " must be >= 0");
        if (slotIds[b] < 0 || slotIds[b] >= numSlots)
            return fail("sequence " + str(b) + ": slot id " + str(slotIds[b]) + " out of range [0, " + str(numSlots)
                + ")");
        for (int32_t o = 0; o < b; ++o)
            if (slotIds[o] == slotIds[b])
                return fail("slot id " + str(slotIds[b]) + " appears twice in the step (sequences " + str(o) + " and "
                    + str(b) + "); slots must be distinct");
        if (int64_t(pastLen[b]) + chunkLen[b] > (int64_t(1) << 30))
            return fail("sequence " + str(b) + ": length " + str(int64_t(pastLen[b]) + chunkLen[b])
                + " exceeds 2^30 tokens");
        total += chunkLen[b];
    }
    if (total != numTokens)
        return fail("sum(chunk_len)=" + str(total) + " must equal the number of tokens " + str(numTokens));
    return 0;
}

int32_t validate(const KiviCpuParams& p)
{
    if (p.numHeads <= 0 || p.numKvHeads <= 0 || p.numHeads % p.numKvHeads != 0)
        return fail("num_heads=" + str(p.numHeads) + " must be a positive multiple of num_kv_heads="
            + str(p.numKvHeads));
    if (!oneOf(p.headDim, {64, 128}))
        return fail("head_dim=" + str(p.headDim) + " is not supported by the CPU kernels; allowed: 64, 128");
    if (!oneOf(p.kBits, {2, 4, 8}) || !oneOf(p.vBits, {2, 4, 8}))
        return fail("k_bits=" + str(p.kBits) + ", v_bits=" + str(p.vBits) + " not supported; allowed: 2, 4, 8");
    if (!oneOf(p.groupSize, {32, 64, 128}))
        return fail("group_size=" + str(p.groupSize) + " not supported; allowed: 32, 64, 128");
    if (p.blockSize <= 0 || p.blockSize % p.groupSize != 0)
        return fail("block_size=" + str(p.blockSize) + " must be a positive multiple of group_size="
            + str(p.groupSize));
    if (p.residualLength < 0)
        return fail("residual_length=" + str(p.residualLength) + " must be >= 0");
    if (!oneOf(p.scaleDtype, {0, 1, 2}) || !oneOf(p.actDtype, {0, 1, 2}))
        return fail("scale_dtype=" + str(p.scaleDtype) + ", act_dtype=" + str(p.actDtype)
            + " not supported; allowed: 0 float16, 1 bfloat16, 2 float32");
    if (!oneOf(p.keyGrouping, {0, 1}))
        return fail("key_grouping=" + str(p.keyGrouping) + " not supported; allowed: 0 per_channel, 1 per_token");
    if (p.sinkTokens < 0 || p.sinkTokens > kMAX_SINKS)
        return fail("sink_tokens=" + str(p.sinkTokens) + " must be in [0, " + str(kMAX_SINKS) + "]");
    if (!oneOf(p.phase, {kiviCpuPhaseStep, kiviCpuPhaseAttention, kiviCpuPhaseAppend}))
        return fail("phase=" + str(p.phase) + " not supported; allowed: 1 attention, 2 append, 3 step");
    if (p.batch < 0 || p.numTokens < 0 || p.numBlocks < 0 || p.numSlots <= 0 || p.maxBlocksPerSeq < 0)
        return fail("batch=" + str(p.batch) + ", num_tokens=" + str(p.numTokens) + ", num_blocks="
            + str(p.numBlocks) + ", num_slots=" + str(p.numSlots) + ", max_blocks_per_seq=" + str(p.maxBlocksPerSeq)
            + " must be >= 0 (num_slots >= 1)");
    if (p.batch > 0 && (!p.slotIds || !p.pastLen || !p.chunkLen || (p.maxBlocksPerSeq > 0 && !p.blockTable)))
        return fail("slot_ids, past_len, chunk_len and block_table must be non-null");
    const void* ptrs[] = {p.kCodes, p.kScale, p.kZero, p.vCodes, p.vScale, p.vZero, p.kWindow, p.vWindow};
    for (int i = 0; i < 8; ++i)
        if (ptrs[i] == nullptr && (i >= 6 || p.numBlocks > 0))
            return fail("cache buffer " + str(i) + " (format.BUFFER_NAMES order) is null");
    if (p.numTokens > 0 && (!p.q || !p.k || !p.v || (p.phase != kiviCpuPhaseAppend && !p.out)))
        return fail("q, k, v and out must be non-null");
    if (int32_t rc = checkLengths(p.batch, p.numTokens, p.numSlots, p.slotIds, p.pastLen, p.chunkLen))
        return rc;
    const int64_t capacity = int64_t(p.maxBlocksPerSeq) * p.blockSize;
    for (int32_t b = 0; b < p.batch; ++b)
    {
        const int32_t end = p.pastLen[b] + p.chunkLen[b];
        const int32_t nq = numQuantized(end, p.sinkTokens, p.residualLength, p.groupSize);
        if (nq > capacity)
            return fail("sequence " + str(b) + ": length " + str(end) + " needs " + str(nq)
                + " quantized tokens, past the block table's capacity of " + str(capacity) + " ("
                + str(p.maxBlocksPerSeq) + " blocks of " + str(p.blockSize) + ")");
        const int32_t used = (nq + p.blockSize - 1) / p.blockSize;
        for (int32_t i = 0; i < used; ++i)
        {
            const int32_t id = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + i];
            if (id < 0 || id >= p.numBlocks)
                return fail("sequence " + str(b) + ": block id " + str(id) + " (block-table entry " + str(i)
                    + ") out of range [0, " + str(p.numBlocks) + ")");
        }
    }
    return 0;
}

int32_t validateDense(const KiviCpuDenseParams& p)
{
    if (p.numHeads <= 0 || p.numKvHeads <= 0 || p.numHeads % p.numKvHeads != 0)
        return fail("num_heads=" + str(p.numHeads) + " must be a positive multiple of num_kv_heads="
            + str(p.numKvHeads));
    if (!oneOf(p.headDim, {64, 128}))
        return fail("head_dim=" + str(p.headDim) + " is not supported by the CPU kernels; allowed: 64, 128");
    if (!oneOf(p.actDtype, {0, 1, 2}) || !oneOf(p.cacheDtype, {0, 1, 2}))
        return fail("act_dtype=" + str(p.actDtype) + ", cache_dtype=" + str(p.cacheDtype)
            + " not supported; allowed: 0 float16, 1 bfloat16, 2 float32");
    if (p.batch < 0 || p.numTokens < 0 || p.numSlots <= 0 || p.maxSeqLen <= 0)
        return fail("batch=" + str(p.batch) + ", num_tokens=" + str(p.numTokens) + ", num_slots=" + str(p.numSlots)
            + ", max_seq_len=" + str(p.maxSeqLen) + " must be >= 0 (slots, max_seq_len >= 1)");
    if (p.batch > 0 && (!p.slotIds || !p.pastLen || !p.chunkLen))
        return fail("slot_ids, past_len and chunk_len must be non-null");
    if (!p.kCache || !p.vCache || (p.numTokens > 0 && (!p.q || !p.k || !p.v || !p.out)))
        return fail("q, k, v, out, k_cache and v_cache must be non-null");
    if (int32_t rc = checkLengths(p.batch, p.numTokens, p.numSlots, p.slotIds, p.pastLen, p.chunkLen))
        return rc;
    for (int32_t b = 0; b < p.batch; ++b)
        if (int64_t(p.pastLen[b]) + p.chunkLen[b] > p.maxSeqLen)
            return fail("sequence " + str(b) + ": " + str(p.pastLen[b]) + " + " + str(p.chunkLen[b])
                + " tokens exceeds the cache capacity max_seq_len=" + str(p.maxSeqLen));
    return 0;
}

// ------------------------------------------------------------------------------------------------ quantizer

// One group of n values x[i * stride] -> codes[i] and the stored scale/zero (reference/quant.py quantize_groups).
void quantizeGroup(const float* x, int n, int stride, int bits, int32_t sdt, uint32_t* codes, int codeStride,
    void* scaleBuf, void* zeroBuf, int64_t szIdx)
{
    float mn = x[0], mx = x[0];
    bool nan = false;
    for (int i = 0; i < n; ++i)
    {
        const float v = x[int64_t(i) * stride];
        if (v != v)
            nan = true;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    if (nan) // torch.amin/amax propagate NaN
        mn = mx = std::nanf("");
    const float maxq = float((1 << bits) - 1);
    const float scale = (mx - mn) / maxq;
    storeScalar(scaleBuf, szIdx, sdt, scale);
    storeScalar(zeroBuf, szIdx, sdt, mn);
    const float s = loadScalar(scaleBuf, szIdx, sdt), z = loadScalar(zeroBuf, szIdx, sdt);
    for (int i = 0; i < n; ++i)
    {
        float q = std::nearbyint((x[int64_t(i) * stride] - z) / s); // round half to even (default rounding mode)
        if (q != q || s == 0.0f)
            q = 0.0f; // torch.where(s == 0, 0, q) and nan_to_num
        else
            q = q < 0.0f ? 0.0f : (q > maxq ? maxq : q);
        codes[int64_t(i) * codeStride] = uint32_t(q);
    }
}

// (token within the tile, channel) of the code at bit 16 half + bits pos of word j of lane `lane` in FRAGMENT order:
// format.fragment_coord, line for line.
void fragmentCoord(bool keys, int32_t lane, int32_t j, int32_t half, int32_t pos, int32_t bits, int32_t& tok,
    int32_t& ch)
{
    const int32_t g = lane / 4, t = lane % 4;
    const int32_t pi = j * (16 / bits) + pos;
    const int32_t r = pi % 4, i = pi / 4;
    if (keys)
    {
        tok = g + 8 * (r & 1);
        ch = 16 * i + 8 * (r >> 1) + 2 * t + half;
    }
    else
    {
        tok = 8 * (r >> 1) + 2 * t + half;
        ch = 16 * i + g + 8 * (r & 1);
    }
}

// codes [16 tokens][D] of one tile -> its 32 * nw words in FRAGMENT order (reference/quant.py pack_fragments).
void packTile(const uint32_t* codes, int32_t D, int32_t bits, bool keys, int32_t* out)
{
    const int32_t nw = fragmentWordsPerLane(D, bits);
    for (int32_t lane = 0; lane < kFRAGMENT_LANES; ++lane)
        for (int32_t j = 0; j < nw; ++j)
        {
            uint32_t word = 0;
            for (int32_t half = 0; half < 2; ++half)
                for (int32_t pos = 0; pos < 16 / bits; ++pos)
                {
                    int32_t tok, ch;
                    fragmentCoord(keys, lane, j, half, pos, bits, tok, ch);
                    word |= codes[tok * D + ch] << (16 * half + pos * bits);
                }
            out[lane * nw + j] = int32_t(word);
        }
}

// Flush store indices [q0, q1) (tokens S + j) of one (sequence, KV head) and write its window rows; the reference's
// `append`.
void appendHead(const KiviCpuParams& p, int32_t b, int32_t tokOffset, int32_t g, std::vector<float>& kbuf,
    std::vector<float>& vbuf)
{
    const int32_t D = p.headDim, Hkv = p.numKvHeads, G = p.groupSize, BS = p.blockSize, S = p.sinkTokens;
    const int32_t R = p.residualLength, W = windowCapacity(R, G);
    const int32_t Gv = valueGroupSize(G, D);
    const int32_t s = p.pastLen[b], c = p.chunkLen[b], e = s + c, slot = p.slotIds[b];
    const int32_t q0 = numQuantized(s, S, R, G), q1 = numQuantized(e, S, R, G);
    const int64_t winHead = (int64_t(slot) * Hkv + g) * windowRows(S, R, G);
    auto src = [&](const void* win, const void* chunk, int32_t t, int32_t d) -> float {
        if (t < s)
            return loadScalar(win, (winHead + windowRow(t, S, R, G)) * D + d, p.actDtype);
        return loadScalar(chunk, (int64_t(tokOffset + t - s) * Hkv + g) * D + d, p.actDtype);
    };
    kbuf.resize(size_t(G) * D);
    vbuf.resize(size_t(G) * D);
    std::vector<uint32_t> codes(size_t(G) * D); // [G tokens][D]
    const int32_t kpw = codesPerWord(p.kBits);
    const int64_t kTile = 16 * D * p.kBits / 32, vTile = 16 * D * p.vBits / 32; // words per 16-token tile
    for (int32_t j0 = q0; j0 < q1; j0 += G)
    {
        for (int32_t i = 0; i < G; ++i)
            for (int32_t d = 0; d < D; ++d)
            {
                kbuf[size_t(i) * D + d] = src(p.kWindow, p.k, S + j0 + i, d);
                vbuf[size_t(i) * D + d] = src(p.vWindow, p.v, S + j0 + i, d);
            }
        const int32_t blk = p.blockTable[int64_t(b) * p.maxBlocksPerSeq + j0 / BS];
        const int32_t r = j0 % BS;
        const int64_t headBlk = int64_t(blk) * Hkv + g;
        int32_t* kc = static_cast<int32_t*>(p.kCodes);
        int32_t* vc = static_cast<int32_t*>(p.vCodes);
        if (p.keyGrouping == 0) // per channel: one group of G tokens per channel, FRAGMENT order
        {
            for (int32_t d = 0; d < D; ++d)
                quantizeGroup(&kbuf[d], G, D, p.kBits, p.scaleDtype, codes.data() + d, D, p.kScale, p.kZero,
                    (headBlk * (BS / G) + r / G) * D + d);
            for (int32_t t0 = 0; t0 < G; t0 += 16)
                packTile(codes.data() + size_t(t0) * D, D, p.kBits, true,
                    kc + headBlk * (BS / 16) * kTile + (r + t0) / 16 * kTile);
        }
        else // per token (naive control): groups of Gv channels, LINEAR order along channels
            for (int32_t i = 0; i < G; ++i)
            {
                const int64_t row = headBlk * BS + r + i;
                for (int32_t g0 = 0; g0 < D; g0 += Gv)
                    quantizeGroup(&kbuf[size_t(i) * D + g0], Gv, 1, p.kBits, p.scaleDtype, codes.data() + g0, 1,
                        p.kScale, p.kZero, row * (D / Gv) + g0 / Gv);
                for (int32_t w = 0; w < D / kpw; ++w)
                {
                    uint32_t word = 0;
                    for (int32_t j = 0; j < kpw; ++j)
                        word |= codes[size_t(w) * kpw + j] << (j * p.kBits);
                    kc[row * (D / kpw) + w] = int32_t(word);
                }
            }
        for (int32_t i = 0; i < G; ++i) // values: per token, groups of Gv channels
        {
            const int64_t row = headBlk * BS + r + i;
            for (int32_t g0 = 0; g0 < D; g0 += Gv)
                quantizeGroup(&vbuf[size_t(i) * D + g0], Gv, 1, p.vBits, p.scaleDtype, codes.data() + size_t(i) * D + g0,
                    1, p.vScale, p.vZero, row * (D / Gv) + g0 / Gv);
        }
        for (int32_t t0 = 0; t0 < G; t0 += 16)
            packTile(codes.data() + size_t(t0) * D, D, p.vBits, false,
                vc + headBlk * (BS / 16) * vTile + (r + t0) / 16 * vTile);
    }
    // Window rows (format.py): sinks t < S at row t; of the other tokens only [max(s, e - W), e) (older ones would be
    // overwritten anyway) at row S + (t - S) % W.
    const int32_t esz = dtypeBytes(p.actDtype);
    const int32_t sinkEnd = S < e ? S : e;
    auto copyRow = [&](int32_t t) {
        const int64_t dst = ((winHead + windowRow(t, S, R, G)) * D) * esz;
        const int64_t srcOff = ((int64_t(tokOffset + t - s) * Hkv + g) * D) * esz;
        std::memcpy(static_cast<char*>(p.kWindow) + dst, static_cast<const char*>(p.k) + srcOff, size_t(D) * esz);
        std::memcpy(static_cast<char*>(p.vWindow) + dst, static_cast<const char*>(p.v) + srcOff, size_t(D) * esz);
    };
    for (int32_t t = s; t < sinkEnd; ++t)
        copyRow(t);
    int32_t first = s > sinkEnd ? s : sinkEnd;
    first = first > e - W ? first : e - W;
    for (int32_t t = first; t < e; ++t)
        copyRow(t);
}

// ------------------------------------------------------------------------------------------------ attention

// Plans the sequences of a step and runs attention (phase 1), then merges of decode partials and `after(b, g)` for
// every (sequence, KV head) (phase 2; the append for the KIVI op).
int32_t runAttention(Ctx& ctx, const IsaKernels& k, int threads, int32_t batch, const int32_t* slotIds,
    const int32_t* pastLen, const int32_t* chunkLen, bool attend,
    const std::function<void(int32_t, int32_t, int32_t)>& after)
{
    std::vector<SeqPlan> seqs;
    std::vector<int32_t> offsets(size_t(batch) + 1, 0);
    for (int32_t b = 0; b < batch; ++b)
        offsets[b + 1] = offsets[b] + chunkLen[b];
    int64_t partialFloats = 0;
    for (int32_t b = 0; b < batch; ++b)
    {
        if (chunkLen[b] == 0)
            continue;
        SeqPlan sp{};
        sp.seq = b;
        sp.slot = slotIds[b];
        sp.past = pastLen[b];
        sp.chunk = chunkLen[b];
        sp.tokOffset = offsets[b];
        sp.sink = sp.past < ctx.sinks ? sp.past : ctx.sinks;
        sp.nq = ctx.dense ? 0 : numQuantized(sp.past, ctx.sinks, ctx.R, ctx.G);
        sp.nKeys = sp.past + sp.chunk;
        sp.numSplits = numSplitsOf(sp.nKeys, ctx.sinks);
        sp.numQTiles = (sp.chunk + kQ_TILE - 1) / kQ_TILE;
        // Decode-like chunks parallelize over key splits (partials merged afterwards); longer chunks have enough
        // query tiles. Either way the same partials are merged in the same order (same bits).
        sp.parallel = (sp.numQTiles == 1 && sp.numSplits > 1) ? 1 : 0;
        if (sp.parallel)
        {
            sp.partialBase = partialFloats;
            partialFloats += int64_t(ctx.Hkv) * sp.numSplits * sp.chunk * ctx.grp * (ctx.D + 2);
        }
        seqs.push_back(sp);
    }
    // per-calling-thread buffers, grown and kept until the thread exits (a workspace the size of its largest call; no
    // allocation, zeroing or page faults per call). New floats are NaN, so a read of a float no kernel wrote would
    // turn outputs NaN (the kernels write every scratch and partial float before reading it).
    thread_local std::vector<float> partials, scratch;
    if (partials.size() < size_t(partialFloats > 0 ? partialFloats : 1))
        partials.resize(size_t(partialFloats > 0 ? partialFloats : 1), std::nanf(""));
    ctx.seqs = seqs.data();
    ctx.partials = partials.data();

    // Decode items take every KV head of a split (memory order, kernel::Attn::splitPartial) when that leaves enough
    // items for the threads, else one head each; the bits are the same either way (a head's arithmetic does not
    // depend on which heads share its item).
    const int nThreads = threads < 1 ? 1 : threads;
    int64_t decodeSplits = 0;
    for (const SeqPlan& sp : seqs)
        decodeSplits += sp.parallel ? sp.numSplits : 0;
    const int32_t headsPerItem = decodeSplits >= 4 * int64_t(nThreads) ? ctx.Hkv : 1;
    std::vector<WorkItem> items;
    // per sequence split over items: how many of its items are left; the thread that finishes the last one merges the
    // sequence's partials at once (a second pool run for the merges cost a barrier per call)
    std::vector<std::atomic<int32_t>> left(seqs.size());
    if (attend)
        for (int32_t i = 0; i < int32_t(seqs.size()); ++i)
        {
            const SeqPlan& sp = seqs[i];
            left[size_t(i)].store(sp.parallel ? sp.numSplits * (ctx.Hkv / headsPerItem) : 0);
            if (sp.parallel)
                for (int32_t j = 0; j < sp.numSplits; ++j)
                    for (int32_t g = 0; g < ctx.Hkv; g += headsPerItem)
                        items.push_back({i, g, 0, j, headsPerItem});
            else
                for (int32_t g = 0; g < ctx.Hkv; ++g)
                    for (int32_t t = 0; t < sp.numQTiles; ++t)
                        items.push_back({i, g, t, -1, 1});
        }
    // Items are taken from one counter in list order; listed as is, the threads would alternate over one sequence's
    // consecutive splits, and the prefetch of the next split's first block (kernel::Attn::scoresPerChannel) would land
    // in the other core's L2. Interleaving nThreads contiguous chunks of the list lets each thread walk its own chunk
    // in order (2 threads: 0.945x the op's time; the bits do not depend on which thread computes an item).
    if (nThreads > 1 && items.size() >= size_t(2 * nThreads))
    {
        std::vector<WorkItem> order;
        order.reserve(items.size());
        const size_t n = items.size(), chunk = (n + size_t(nThreads) - 1) / size_t(nThreads);
        for (size_t i = 0; i < chunk; ++i)
            for (size_t t = 0; t < size_t(nThreads); ++t)
                if (t * chunk + i < n)
                    order.push_back(items[t * chunk + i]);
        items.swap(order);
    }
    const int64_t perThread = scratchFloatsPerThread(ctx.grp, ctx.D);
    if (scratch.size() < size_t(perThread) * nThreads)
        scratch.resize(size_t(perThread) * nThreads, std::nanf(""));
    // the calling thread's buffer (a thread_local named inside the lambdas would be each worker's own)
    float* const scratchBase = scratch.data();
    pool().run(nThreads, int64_t(items.size()), [&](int64_t i, int tid) {
        const WorkItem& it = items[size_t(i)];
        float* const buf = scratchBase + perThread * tid;
        k.attendItem(ctx, it, buf);
        if (it.split >= 0 && left[size_t(it.seqIdx)].fetch_sub(1) == 1) // the sequence's last split item
            for (int32_t g = 0; g < ctx.Hkv; ++g)
                k.mergeItem(ctx, WorkItem{it.seqIdx, g, 0, -1, 1}, buf);
    });
    // phase 2, after every read of the cache: the appends (write the cache)
    if (after)
        pool().run(nThreads, int64_t(batch) * ctx.Hkv, [&](int64_t j, int) {
            const int32_t b = int32_t(j / ctx.Hkv), g = int32_t(j % ctx.Hkv);
            after(b, g, offsets[b]);
        });
    return 0;
}

} // namespace
} // namespace cpu
} // namespace trtllm_kivi

using namespace trtllm_kivi;
using namespace trtllm_kivi::cpu;

extern "C" {

// The storage layout these kernels read and write: FORMAT_VERSION 3 (fragment-order per-channel K and V codes, sinks).
// trtllm_kivi.cpu refuses the library when it differs from format.FORMAT_VERSION.
constexpr int32_t kIMPLEMENTED_FORMAT_VERSION = 3;
static_assert(kIMPLEMENTED_FORMAT_VERSION == kFORMAT_VERSION,
    "plugins/include/kiviFormat.h changed FORMAT_VERSION: port the CPU kernels' layout, then this constant");

int32_t kiviCpuFormatVersion(void)
{
    return kIMPLEMENTED_FORMAT_VERSION;
}

size_t kiviCpuParamsSize(void)
{
    return sizeof(KiviCpuParams);
}

size_t kiviCpuDenseParamsSize(void)
{
    return sizeof(KiviCpuDenseParams);
}

int32_t kiviCpuIsaSupported(int32_t isa)
{
    return isa == kiviCpuIsaAuto ? 1 : (isa >= kiviCpuIsaPortable && isa <= kiviCpuIsaAvx2Denormal && cpuHas(isa));
}

int32_t kiviCpuResolveIsa(int32_t isa)
{
    return resolveIsa(isa);
}

int32_t kiviCpuSplitLen(void)
{
    return kSPLIT_LEN;
}

void kiviCpuSetNumThreads(int32_t n)
{
    gNumThreads.store(n > 0 ? n : 0);
}

int32_t kiviCpuGetNumThreads(void)
{
    return defaultThreads();
}

const char* kiviCpuLastError(void)
{
    return tLastError.c_str();
}

int32_t kiviCpuStep(const KiviCpuParams* params)
{
    tLastError.clear();
    if (params == nullptr)
        return fail("params is null");
    const KiviCpuParams& p = *params;
    try
    {
        if (int32_t rc = validate(p))
            return rc;
        const IsaKernels* k = kernelsFor(p.isa);
        if (k == nullptr)
            return kiviCpuUnsupportedIsa;
        Ctx c{};
        c.dense = false;
        c.H = p.numHeads;
        c.Hkv = p.numKvHeads;
        c.D = p.headDim;
        c.grp = p.numHeads / p.numKvHeads;
        c.kBits = p.kBits;
        c.vBits = p.vBits;
        c.G = p.groupSize;
        c.Gv = valueGroupSize(p.groupSize, p.headDim);
        c.BS = p.blockSize;
        c.W = windowCapacity(p.residualLength, p.groupSize);
        c.sinks = p.sinkTokens;
        c.winRows = windowRows(p.sinkTokens, p.residualLength, p.groupSize);
        c.keyGrouping = p.keyGrouping;
        c.scaleDtype = p.scaleDtype;
        c.actDtype = p.actDtype;
        c.cacheDtype = p.actDtype;
        c.maxBlocks = p.maxBlocksPerSeq;
        c.R = p.residualLength;
        c.smScale = 1.0f / std::sqrt(float(p.headDim));
        c.q = p.q;
        c.k = p.k;
        c.v = p.v;
        c.out = p.out;
        c.blockTable = p.blockTable;
        c.kCodes = static_cast<const int32_t*>(p.kCodes);
        c.kScale = p.kScale;
        c.kZero = p.kZero;
        c.vCodes = static_cast<const int32_t*>(p.vCodes);
        c.vScale = p.vScale;
        c.vZero = p.vZero;
        c.kWin = p.kWindow;
        c.vWin = p.vWindow;
        const int threads = p.numThreads > 0 ? p.numThreads : defaultThreads();
        std::function<void(int32_t, int32_t, int32_t)> append;
        if (p.phase & kiviCpuPhaseAppend)
            append = [&p](int32_t b, int32_t g, int32_t off) {
                if (p.chunkLen[b] == 0)
                    return;
                thread_local std::vector<float> kb, vb;
                appendHead(p, b, off, g, kb, vb);
            };
        return runAttention(c, *k, threads, p.batch, p.slotIds, p.pastLen, p.chunkLen,
            (p.phase & kiviCpuPhaseAttention) != 0, append);
    }
    catch (const std::exception& e)
    {
        tLastError = std::string("internal error: ") + e.what();
        return kiviCpuInternal;
    }
}

int32_t kiviCpuDense(const KiviCpuDenseParams* params)
{
    tLastError.clear();
    if (params == nullptr)
        return fail("params is null");
    const KiviCpuDenseParams& p = *params;
    try
    {
        if (int32_t rc = validateDense(p))
            return rc;
        const IsaKernels* k = kernelsFor(p.isa);
        if (k == nullptr)
            return kiviCpuUnsupportedIsa;
        // write the chunk first: FullCache attends over the cached (converted) rows, the chunk included
        const int32_t D = p.headDim, Hkv = p.numKvHeads;
        int32_t off = 0;
        for (int32_t b = 0; b < p.batch; ++b)
        {
            const int32_t s = p.pastLen[b], cl = p.chunkLen[b], slot = p.slotIds[b];
            for (int32_t i = 0; i < cl; ++i)
                for (int32_t g = 0; g < Hkv; ++g)
                {
                    const int64_t src = (int64_t(off + i) * Hkv + g) * D;
                    const int64_t dst = ((int64_t(slot) * Hkv + g) * p.maxSeqLen + s + i) * D;
                    for (int32_t d = 0; d < D; ++d)
                    {
                        storeScalar(p.kCache, dst + d, p.cacheDtype, loadScalar(p.k, src + d, p.actDtype));
                        storeScalar(p.vCache, dst + d, p.cacheDtype, loadScalar(p.v, src + d, p.actDtype));
                    }
                }
            off += cl;
        }
        Ctx c{};
        c.dense = true;
        c.H = p.numHeads;
        c.Hkv = Hkv;
        c.D = D;
        c.grp = p.numHeads / Hkv;
        c.G = 32;
        c.Gv = 32;
        c.BS = 32;
        c.W = 1;
        c.winRows = 1;
        c.actDtype = p.actDtype;
        c.cacheDtype = p.cacheDtype;
        c.maxSeqLen = p.maxSeqLen;
        c.smScale = 1.0f / std::sqrt(float(D));
        c.q = p.q;
        c.k = p.k;
        c.v = p.v;
        c.out = p.out;
        c.kWin = p.kCache;
        c.vWin = p.vCache;
        const int threads = p.numThreads > 0 ? p.numThreads : defaultThreads();
        return runAttention(c, *k, threads, p.batch, p.slotIds, p.pastLen, p.chunkLen, true, nullptr);
    }
    catch (const std::exception& e)
    {
        tLastError = std::string("internal error: ") + e.what();
        return kiviCpuInternal;
    }
}

} // extern "C"
