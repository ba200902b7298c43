/*
 * GPU test of the plugin's enqueue glue (no TensorRT runtime needed): two steps (prefill 200 + 37 tokens, then one
 * decode token + a 100-token chunk) of a ragged batch run from the same inputs and initial cache:
 *   A  trtllm_kivi::kernels::invokeKiviStep called directly (the oracle: the kernels' own API, which the kernel tests
 *      compare with the torch reference),
 *   B  KiviAttentionPlugin::enqueue with each cache output aliased to its input (TensorRT with aliasing),
 *   C  enqueue with separate output buffers (TensorRT without PreviewFeature::kALIASED_PLUGIN_IO_10_03): refused.
 * out and every cache buffer must be byte-identical across A and B, B's status output 0 (it starts as garbage), and
 * C must write nothing (no copy of the cache, no output). A third step claims a length past the block table:
 * the status output says kKIVI_ERR_CAPACITY and that sequence's rows are zero.
 * Exits 77 (ctest: skipped) when no CUDA device is present.
 */
#include "kiviAttentionPlugin.h"

#include "kiviKernels.h"
#include "kiviTestUtils.h"

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

using namespace nvinfer1;
using namespace trtllm_kivi;
using trtllm_kivi::test::makeDims;

namespace
{
constexpr int32_t kSKIP = 77;
int32_t gFailures = 0;

#define CHECK(cond)                                                                                                    \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            ++gFailures;                                                                                               \
            std::fprintf(stderr, "FAIL (line %d): %s\n", __LINE__, #cond);                                             \
        }                                                                                                              \
    } while (0)

#define CUDA_OK(call)                                                                                                  \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const e_ = (call);                                                                                 \
        if (e_ != cudaSuccess)                                                                                         \
        {                                                                                                              \
            std::fprintf(stderr, "CUDA error %s at line %d: %s\n", cudaGetErrorString(e_), __LINE__, #call);         \
            std::exit(EXIT_FAILURE);                                                                                   \
        }                                                                                                              \
    } while (0)

struct DeviceBuffer
{
    void* ptr{nullptr};
    size_t bytes{0};
    explicit DeviceBuffer(size_t n)
        : bytes(n)
    {
        CUDA_OK(cudaMalloc(&ptr, n > 0 ? n : 1));
        CUDA_OK(cudaMemset(ptr, 0, n > 0 ? n : 1));
    }
    ~DeviceBuffer()
    {
        cudaFree(ptr);
    }
    DeviceBuffer(DeviceBuffer const&) = delete;
    DeviceBuffer& operator=(DeviceBuffer const&) = delete;
    std::vector<unsigned char> download() const
    {
        std::vector<unsigned char> h(bytes);
        CUDA_OK(cudaMemcpy(h.data(), ptr, bytes, cudaMemcpyDeviceToHost));
        return h;
    }
};

template <typename T>
void upload(DeviceBuffer& d, std::vector<T> const& h)
{
    CUDA_OK(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

//! Deterministic N(0,1)-ish fp16 values (sum of uniforms from an LCG).
std::vector<__half> randomHalf(size_t n, uint32_t& state)
{
    std::vector<__half> v(n);
    for (auto& x : v)
    {
        float s = 0.0F;
        for (int32_t i = 0; i < 4; ++i)
        {
            state = state * 1664525U + 1013904223U;
            s += static_cast<float>(state >> 8) / 16777216.0F - 0.5F;
        }
        x = __float2half(s * 1.7F);
    }
    return v;
}

//! One layer's cache: the 8 buffers in format.BUFFER_NAMES order.
struct Cache
{
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    Cache(KiviAttentionParams const& p, int64_t numBlocks, int64_t numSlots, DataType act)
    {
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            DataType const t = expectedInputType(p, kIN_BUFFERS + b, act);
            size_t const n = static_cast<size_t>(volume(bufferDims(p, b, numBlocks, numSlots)));
            bufs.push_back(std::make_unique<DeviceBuffer>(n * static_cast<size_t>(dataTypeSize(t))));
        }
    }
    void fill(unsigned char byte)
    {
        for (auto& b : bufs)
        {
            CUDA_OK(cudaMemset(b->ptr, byte, b->bytes));
        }
    }
    void copyFrom(Cache const& o)
    {
        for (size_t i = 0; i < bufs.size(); ++i)
        {
            CUDA_OK(cudaMemcpy(bufs[i]->ptr, o.bufs[i]->ptr, bufs[i]->bytes, cudaMemcpyDeviceToDevice));
        }
    }
    bool equals(Cache const& o) const
    {
        for (size_t i = 0; i < bufs.size(); ++i)
        {
            if (bufs[i]->download() != o.bufs[i]->download())
            {
                std::fprintf(stderr, "cache buffer %s differs\n", inputName(kIN_BUFFERS + static_cast<int32_t>(i)));
                return false;
            }
        }
        return true;
    }
};
} // namespace

int main()
{
    int32_t devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    {
        std::printf("no CUDA device: skipped\n");
        return kSKIP;
    }
    // SmolLM2-like geometry with KIVI-2 defaults (plugin.py plugin_fields(KiviConfig(), 9, 3, 64)).
    KiviAttentionParams p{};
    p.numHeads = 9;
    p.numKvHeads = 3;
    p.headDim = 64;
    KiviAttentionPlugin plugin(p);
    DataType const act = DataType::kHALF;
    int64_t const numBlocks = 8;
    int64_t const numSlots = 3;
    int64_t const maxBlocks = 4;
    std::vector<int32_t> const blockTable = {5, 2, 7, 0, 1, 3, 4, 6};
    std::vector<int32_t> const slots = {2, 0};
    Cache cacheA(p, numBlocks, numSlots, act);
    Cache cacheB(p, numBlocks, numSlots, act);
    Cache cacheCIn(p, numBlocks, numSlots, act);
    Cache cacheCOut(p, numBlocks, numSlots, act);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    uint32_t rng = 12345U;
    std::vector<std::vector<int32_t>> const pasts = {{0, 0}, {200, 37}};
    std::vector<std::vector<int32_t>> const chunks = {{200, 37}, {1, 100}};
    for (size_t step = 0; step < pasts.size(); ++step)
    {
        int64_t const tokens = chunks[step][0] + chunks[step][1];
        auto const qh = randomHalf(static_cast<size_t>(tokens * 9 * 64), rng);
        auto const kh = randomHalf(static_cast<size_t>(tokens * 3 * 64), rng);
        auto const vh = randomHalf(static_cast<size_t>(tokens * 3 * 64), rng);
        DeviceBuffer q(qh.size() * 2), k(kh.size() * 2), v(vh.size() * 2);
        DeviceBuffer slotIds(8), pastLen(8), chunkLen(8), table(blockTable.size() * 4);
        upload(q, qh);
        upload(k, kh);
        upload(v, vh);
        upload(slotIds, slots);
        upload(pastLen, pasts[step]);
        upload(chunkLen, chunks[step]);
        upload(table, blockTable);
        std::vector<Dims> dims = {makeDims({tokens, 9, 64}), makeDims({tokens, 3, 64}), makeDims({tokens, 3, 64}),
            makeDims({2}), makeDims({2}), makeDims({2}), makeDims({2, maxBlocks})};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            dims.push_back(bufferDims(p, b, numBlocks, numSlots));
        }
        std::vector<PluginTensorDesc> inDesc(kNB_INPUTS);
        std::vector<PluginTensorDesc> outDesc(kNB_OUTPUTS);
        outDesc[kOUT_STATUS].dims = makeDims({1});
        outDesc[kOUT_STATUS].type = DataType::kINT32;
        outDesc[kOUT_STATUS].format = TensorFormat::kLINEAR;
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            inDesc[static_cast<size_t>(i)].dims = dims[static_cast<size_t>(i)];
            inDesc[static_cast<size_t>(i)].type = expectedInputType(p, i, act);
            inDesc[static_cast<size_t>(i)].format = TensorFormat::kLINEAR;
        }
        outDesc[0] = inDesc[0];
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            outDesc[static_cast<size_t>(1 + b)] = inDesc[static_cast<size_t>(kIN_BUFFERS + b)];
        }
        CHECK(plugin.onShapeChange(inDesc.data(), kNB_INPUTS, outDesc.data(), kNB_OUTPUTS) == 0);

        // A: the launcher directly.
        kernels::KiviStepParams s{};
        s.numHeads = 9;
        s.numKvHeads = 3;
        s.headDim = 64;
        s.kBits = p.kBits;
        s.vBits = p.vBits;
        s.groupSize = p.groupSize;
        s.residualLength = p.residualLength;
        s.blockSize = p.blockSize;
        s.scaleDtype = p.scaleDtype;
        s.keyGrouping = p.keyGrouping;
        s.actDtype = kernels::kKIVI_FLOAT16;
        s.batch = 2;
        s.numTokens = static_cast<int32_t>(tokens);
        s.numBlocks = static_cast<int32_t>(numBlocks);
        s.numSlots = static_cast<int32_t>(numSlots);
        s.maxBlocksPerSeq = static_cast<int32_t>(maxBlocks);
        size_t const wsBytes = kernels::kiviWorkspaceSize(s);
        DeviceBuffer ws(wsBytes);
        DeviceBuffer outA(qh.size() * 2), outB(qh.size() * 2), outC(qh.size() * 2);
        DeviceBuffer statusB(4), statusC(4);
        CUDA_OK(cudaMemset(statusB.ptr, 0x5A, 4)); // the plugin clears it
        CUDA_OK(cudaMemset(statusC.ptr, 0x5A, 4));
        CUDA_OK(cudaMemset(outC.ptr, 0x7B, outC.bytes));
        s.q = q.ptr;
        s.k = k.ptr;
        s.v = v.ptr;
        s.out = outA.ptr;
        s.slotIds = static_cast<int32_t const*>(slotIds.ptr);
        s.pastLen = static_cast<int32_t const*>(pastLen.ptr);
        s.chunkLen = static_cast<int32_t const*>(chunkLen.ptr);
        s.blockTable = static_cast<int32_t const*>(table.ptr);
        void** const slotsOfS[kNUM_BUFFERS]
            = {&s.kCodes, &s.kScale, &s.kZero, &s.vCodes, &s.vScale, &s.vZero, &s.kWindow, &s.vWindow};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            *slotsOfS[b] = cacheA.bufs[static_cast<size_t>(b)]->ptr;
        }
        s.workspace = wsBytes > 0 ? ws.ptr : nullptr;
        s.workspaceSize = wsBytes;
        CHECK(kernels::invokeKiviStep(s, stream) == cudaSuccess);

        // B: enqueue, aliased. C: enqueue into separate outputs (garbage-filled): refused, nothing written.
        std::vector<void const*> inB = {q.ptr, k.ptr, v.ptr, slotIds.ptr, pastLen.ptr, chunkLen.ptr, table.ptr};
        std::vector<void const*> inC = inB;
        std::vector<void*> outPtrB = {outB.ptr};
        std::vector<void*> outPtrC = {outC.ptr};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            inB.push_back(cacheB.bufs[static_cast<size_t>(b)]->ptr);
            outPtrB.push_back(cacheB.bufs[static_cast<size_t>(b)]->ptr);
            inC.push_back(cacheCIn.bufs[static_cast<size_t>(b)]->ptr);
            outPtrC.push_back(cacheCOut.bufs[static_cast<size_t>(b)]->ptr);
        }
        outPtrB.push_back(statusB.ptr);
        outPtrC.push_back(statusC.ptr);
        Cache cInBefore(p, numBlocks, numSlots, act);
        cInBefore.copyFrom(cacheCIn);
        cacheCOut.fill(0xA5);
        Cache cOutBefore(p, numBlocks, numSlots, act);
        cOutBefore.copyFrom(cacheCOut);
        std::vector<unsigned char> const outCBefore = outC.download();
        CHECK(plugin.enqueue(inDesc.data(), outDesc.data(), inB.data(), outPtrB.data(), ws.ptr, stream) == 0);
        CHECK(plugin.enqueue(inDesc.data(), outDesc.data(), inC.data(), outPtrC.data(), ws.ptr, stream) != 0);
        CHECK(std::strstr(lastError().c_str(), "is not its input's buffer") != nullptr);
        CUDA_OK(cudaStreamSynchronize(stream));

        CHECK(outA.download() == outB.download());
        CHECK(cacheA.equals(cacheB));
        int32_t status = -1;
        CUDA_OK(cudaMemcpy(&status, statusB.ptr, 4, cudaMemcpyDeviceToHost));
        CHECK(status == 0);
        CHECK(cacheCIn.equals(cInBefore)); // refused: nothing read into or written to the separate outputs
        CHECK(cacheCOut.equals(cOutBefore));
        CHECK(outC.download() == outCBefore);
        std::printf("step %zu (%lld tokens): %s\n", step + 1, static_cast<long long>(tokens),
            gFailures == 0 ? "A == B, status 0, separate outputs refused" : "MISMATCH");
    }

    // A length past the block table's capacity (device lengths: no host check can see it): sequence 1 claims
    // past_len 5000 (capacity 4 x 128 + 159). It is skipped (zero rows, cache untouched) and status says so.
    {
        std::vector<int32_t> const past = {201, 5000}; // sequence 0 holds 200 + 1 tokens
        std::vector<int32_t> const chunk = {1, 1};
        uint32_t r2 = 777U;
        auto const qh = randomHalf(2 * 9 * 64, r2);
        auto const kh = randomHalf(2 * 3 * 64, r2);
        DeviceBuffer q(qh.size() * 2), k(kh.size() * 2), v(kh.size() * 2), out(qh.size() * 2), status(4);
        DeviceBuffer slotIds(8), pastLen(8), chunkLen(8), table(blockTable.size() * 4);
        upload(q, qh);
        upload(k, kh);
        upload(v, kh);
        upload(slotIds, slots);
        upload(pastLen, past);
        upload(chunkLen, chunk);
        upload(table, blockTable);
        CUDA_OK(cudaMemset(out.ptr, 0x7B, out.bytes));
        std::vector<PluginTensorDesc> inDesc(kNB_INPUTS);
        std::vector<PluginTensorDesc> outDesc(kNB_OUTPUTS);
        std::vector<Dims> dims = {makeDims({2, 9, 64}), makeDims({2, 3, 64}), makeDims({2, 3, 64}), makeDims({2}),
            makeDims({2}), makeDims({2}), makeDims({2, maxBlocks})};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            dims.push_back(bufferDims(p, b, numBlocks, numSlots));
        }
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            inDesc[static_cast<size_t>(i)].dims = dims[static_cast<size_t>(i)];
            inDesc[static_cast<size_t>(i)].type = expectedInputType(p, i, act);
            inDesc[static_cast<size_t>(i)].format = TensorFormat::kLINEAR;
        }
        std::vector<void const*> in = {q.ptr, k.ptr, v.ptr, slotIds.ptr, pastLen.ptr, chunkLen.ptr, table.ptr};
        std::vector<void*> outs = {out.ptr};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            in.push_back(cacheB.bufs[static_cast<size_t>(b)]->ptr);
            outs.push_back(cacheB.bufs[static_cast<size_t>(b)]->ptr);
        }
        outs.push_back(status.ptr);
        Cache before(p, numBlocks, numSlots, act);
        before.copyFrom(cacheB);
        kernels::KiviStepParams s{};
        s.numHeads = 9;
        s.numKvHeads = 3;
        s.headDim = 64;
        s.kBits = s.vBits = 2;
        s.groupSize = 32;
        s.residualLength = 128;
        s.blockSize = 128;
        s.batch = 2;
        s.numTokens = 2;
        s.numBlocks = static_cast<int32_t>(numBlocks);
        s.numSlots = static_cast<int32_t>(numSlots);
        s.maxBlocksPerSeq = static_cast<int32_t>(maxBlocks);
        DeviceBuffer ws(kernels::kiviWorkspaceSize(s));
        CHECK(plugin.enqueue(inDesc.data(), outDesc.data(), in.data(), outs.data(), ws.ptr, stream) == 0);
        CUDA_OK(cudaStreamSynchronize(stream));
        int32_t bits = -1;
        CUDA_OK(cudaMemcpy(&bits, status.ptr, 4, cudaMemcpyDeviceToHost));
        CHECK(bits == kernels::kKIVI_ERR_CAPACITY);
        std::vector<unsigned char> const o = out.download();
        bool zeroRow = true;
        for (size_t i = 9 * 64 * 2; i < o.size(); ++i)
        {
            zeroRow = zeroRow && o[i] == 0;
        }
        CHECK(zeroRow); // the skipped sequence's row (token 1) is zero, not garbage
        // ... and its window (slot 0: the first slot of k_window / v_window) untouched.
        size_t const slotBytes = size_t(3) * 159 * 64 * 2;
        for (int32_t b : {kBUFFER_K_WINDOW, kBUFFER_V_WINDOW})
        {
            auto const now = cacheB.bufs[static_cast<size_t>(b)]->download();
            auto const was = before.bufs[static_cast<size_t>(b)]->download();
            CHECK(std::equal(now.begin(), now.begin() + static_cast<std::ptrdiff_t>(slotBytes), was.begin()));
        }
        std::printf("overflowing sequence: status %d (kKIVI_ERR_CAPACITY = %d)\n", bits, kernels::kKIVI_ERR_CAPACITY);
    }
    CUDA_OK(cudaStreamDestroy(stream));
    return gFailures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
