/*
 * KiviAttention TensorRT plugin (IPluginV3) over the KIVI kernels (plugins/kernels/include/kiviKernels.h).
 * No TensorRT library symbols are used here (only header-inline code), so this file links without libnvinfer.
 */
#include "kiviAttentionPlugin.h"

#include "kiviKernels.h"
#include "kiviParams.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <limits>
#include <memory>

namespace trtllm_kivi
{
using namespace nvinfer1;
namespace kk = trtllm_kivi::kernels;

namespace
{
//! Run f() and turn any exception into a reported error: exceptions never leave the library.
template <typename T, typename F>
T guarded(char const* where, T onError, F&& f) noexcept
{
    try
    {
        return f();
    }
    catch (std::exception const& e)
    {
        reportError(std::string("KiviAttention ") + where + ": " + e.what());
    }
    catch (...)
    {
        reportError(std::string("KiviAttention ") + where + ": unknown exception");
    }
    return onError;
}

int32_t fail(std::string const& msg) noexcept
{
    reportError(msg);
    return -1;
}

std::string pointerString(void const* ptr)
{
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%p", ptr);
    return buf;
}

bool fitsInt32(int64_t v)
{
    return v >= 0 && v <= std::numeric_limits<int32_t>::max();
}

//! Host fields of one step from the input dims (dims must have passed checkInputDims). Returns "" or an error.
std::string makeStepParams(
    KiviAttentionParams const& p, Dims const* dims, DataType act, kk::KiviStepParams& s)
{
    int64_t const values[] = {dims[kIN_SLOT_IDS].d[0], dims[kIN_Q].d[0],
        dims[kIN_BUFFERS + kBUFFER_K_CODES].d[0], dims[kIN_BUFFERS + kBUFFER_K_WINDOW].d[0],
        dims[kIN_BLOCK_TABLE].d[1]};
    char const* names[] = {"batch (slot_ids length)", "tokens (q rows)", "num_blocks (k_codes rows)",
        "num_slots (k_window rows)", "max_blocks_per_seq (block_table columns)"};
    for (int32_t i = 0; i < 5; ++i)
    {
        if (!fitsInt32(values[i]))
        {
            return std::string("KiviAttention: ") + names[i] + "=" + std::to_string(values[i])
                + " must be in [0, 2147483647]";
        }
    }
    s = kk::KiviStepParams{};
    s.numHeads = p.numHeads;
    s.numKvHeads = p.numKvHeads;
    s.headDim = p.headDim;
    s.kBits = p.kBits;
    s.vBits = p.vBits;
    s.groupSize = p.groupSize;
    s.residualLength = p.residualLength;
    s.blockSize = p.blockSize;
    s.scaleDtype = p.scaleDtype; // kSCALE_DTYPE_* == KiviDataType codes
    s.sinkTokens = p.sinkTokens;
    s.keyGrouping = p.keyGrouping;
    s.actDtype = act == DataType::kBF16 ? kk::kKIVI_BFLOAT16 : kk::kKIVI_FLOAT16;
    s.batch = static_cast<int32_t>(values[0]);
    s.numTokens = static_cast<int32_t>(values[1]);
    s.numBlocks = static_cast<int32_t>(values[2]);
    s.numSlots = static_cast<int32_t>(values[3]);
    s.maxBlocksPerSeq = static_cast<int32_t>(values[4]);
    // Lengths live on the device: no host bound beyond the tensor sizes (0 = derived by the kernels).
    s.maxChunkLen = 0;
    s.maxSeqLen = 0;
    // A fixed SM count keeps the workspace TensorRT sized at build time valid on any device at run time.
    s.numSms = 0;
    return "";
}

//! Dims of the inputs of a DynamicPluginTensorDesc array: the build-time dims (may hold -1) or the profile max.
void collectDims(DynamicPluginTensorDesc const* in, bool useMax, Dims* dims)
{
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        dims[i] = useMax ? in[i].max : in[i].desc.dims;
    }
}

void collectTypes(DynamicPluginTensorDesc const* in, DataType* types)
{
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        types[i] = in[i].desc.type;
    }
}

//! Host-side check that the kernels run this configuration (pointers are dummies: only host fields count).
std::string checkKernelsSupport(kk::KiviStepParams s)
{
    alignas(256) static int32_t sDummy[64]; // the kernels check pointer alignment
    void* const d = sDummy;
    s.q = s.k = s.v = d;
    s.out = d;
    s.slotIds = s.pastLen = s.chunkLen = s.blockTable = sDummy;
    s.kCodes = s.kScale = s.kZero = s.vCodes = s.vScale = s.vZero = s.kWindow = s.vWindow = d;
    s.workspaceSize = kk::kiviWorkspaceSize(s);
    s.workspace = s.workspaceSize > 0 ? d : nullptr;
    char msg[512];
    if (kk::kiviValidate(s, kk::kPHASE_STEP, msg, sizeof(msg)) != 0)
    {
        return std::string("KiviAttention: the KIVI kernels do not support this configuration: ") + msg;
    }
    return "";
}
} // namespace

// ---------------------------------------------------------------------------------------------- plugin

KiviAttentionPlugin::KiviAttentionPlugin(KiviAttentionParams const& params)
    : mParams(params)
    , mMetadata(describe(params))
{
    initFieldsToSerialize();
}

KiviAttentionPlugin::KiviAttentionPlugin(KiviAttentionPlugin const& other)
    : IPluginV3()
    , IPluginV3OneCore()
    , IPluginV3OneBuildV2()
    , IPluginV3OneRuntime()
    , mParams(other.mParams)
    , mMetadata(other.mMetadata)
{
    initFieldsToSerialize(); // re-point the fields at this object's members
}

void KiviAttentionPlugin::initFieldsToSerialize()
{
    mDataToSerialize = fieldsOf(mParams);
    mFCToSerialize.nbFields = static_cast<int32_t>(mDataToSerialize.size());
    mFCToSerialize.fields = mDataToSerialize.data();
}

IPluginCapability* KiviAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    }
    return nullptr;
}

IPluginV3* KiviAttentionPlugin::clone() noexcept
{
    return guarded<IPluginV3*>("clone", nullptr, [&]() -> IPluginV3* { return new KiviAttentionPlugin(*this); });
}

char const* KiviAttentionPlugin::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* KiviAttentionPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* KiviAttentionPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t KiviAttentionPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t KiviAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept
{
    // out and status are fresh; every cache buffer output is its input, updated in place (no hidden state).
    return outputIndex >= kOUT_BUFFERS && outputIndex < kOUT_STATUS ? kIN_BUFFERS + outputIndex - kOUT_BUFFERS : -1;
}

int32_t KiviAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    return guarded<int32_t>("getOutputDataTypes", -1, [&]() -> int32_t {
        if (outputTypes == nullptr || nbOutputs != kNB_OUTPUTS)
        {
            return fail("KiviAttention has " + std::to_string(kNB_OUTPUTS) + " outputs, asked for "
                + std::to_string(nbOutputs));
        }
        std::string const err = checkInputTypes(mParams, inputTypes, nbInputs);
        if (!err.empty())
        {
            return fail(err);
        }
        outputTypes[kOUT_OUT] = inputTypes[kIN_Q];
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            outputTypes[kOUT_BUFFERS + b] = inputTypes[kIN_BUFFERS + b];
        }
        outputTypes[kOUT_STATUS] = DataType::kINT32;
        return 0;
    });
}

int32_t KiviAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /* shapeInputs */, int32_t /* nbShapeInputs */, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    return guarded<int32_t>("getOutputShapes", -1, [&]() -> int32_t {
        if (inputs == nullptr || outputs == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            return fail("KiviAttention expects " + std::to_string(kNB_INPUTS) + " inputs and "
                + std::to_string(kNB_OUTPUTS) + " outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
        }
        int32_t const ranks[kNB_INPUTS] = {3, 3, 3, 1, 1, 1, 2, 4, 4, 4, 4, 4, 4, 4, 4};
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            if (inputs[i].nbDims != ranks[i])
            {
                return fail(std::string("KiviAttention input ") + inputName(i) + " has rank "
                    + std::to_string(inputs[i].nbDims) + ", expected " + std::to_string(ranks[i]));
            }
        }
        // out has q's shape [tokens, H, D]; each cache buffer keeps its input's shape (aliased).
        outputs[kOUT_OUT] = inputs[kIN_Q];
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            outputs[kOUT_BUFFERS + b] = inputs[kIN_BUFFERS + b];
        }
        outputs[kOUT_STATUS].nbDims = 1; // [1]: the step's error bits
        outputs[kOUT_STATUS].d[0] = exprBuilder.constant(1);
        return outputs[kOUT_STATUS].d[0] != nullptr ? 0 : fail("KiviAttention: the expression builder failed");
    });
}

bool KiviAttentionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0
        || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    if (pos == kIN_Q)
    {
        return isActivationType(desc.type);
    }
    DataType const act = inOut[kIN_Q].desc.type; // decided first (pos 0)
    if (pos < nbInputs)
    {
        return desc.type == expectedInputType(mParams, pos, act);
    }
    int32_t const o = pos - nbInputs;
    if (o == kOUT_STATUS)
    {
        return desc.type == DataType::kINT32;
    }
    return desc.type == (o == kOUT_OUT ? act : expectedInputType(mParams, kIN_BUFFERS + o - kOUT_BUFFERS, act));
}

int32_t KiviAttentionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return guarded<int32_t>("configurePlugin", -1, [&]() -> int32_t {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            return fail("KiviAttention expects " + std::to_string(kNB_INPUTS) + " inputs and "
                + std::to_string(kNB_OUTPUTS) + " outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
        }
        DataType types[kNB_INPUTS];
        Dims dims[kNB_INPUTS];
        collectTypes(in, types);
        std::string err = checkInputTypes(mParams, types, nbInputs);
        for (bool useMax : {false, true})
        {
            if (err.empty())
            {
                collectDims(in, useMax, dims);
                err = checkInputDims(mParams, dims, nbInputs);
            }
        }
        kk::KiviStepParams s{};
        if (err.empty())
        {
            err = makeStepParams(mParams, dims, types[kIN_Q], s); // profile max
        }
        if (err.empty())
        {
            err = checkKernelsSupport(s); // refuse at build what enqueue could not run
        }
        return err.empty() ? 0 : fail(err);
    });
}

size_t KiviAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /* outputs */, int32_t /* nbOutputs */) const noexcept
{
    return guarded<size_t>("getWorkspaceSize", 0, [&]() -> size_t {
        if (inputs == nullptr || nbInputs != kNB_INPUTS)
        {
            return 0;
        }
        Dims dims[kNB_INPUTS];
        collectDims(inputs, /* useMax */ true, dims);
        kk::KiviStepParams s{};
        if (!checkInputDims(mParams, dims, nbInputs).empty()
            || !makeStepParams(mParams, dims, inputs[kIN_Q].desc.type, s).empty())
        {
            return 0; // configurePlugin reports the problem
        }
        // Every step of the profile runs in this workspace: sized from the split plans of the steps between the
        // profile's min and max (a decode step splits its keys, a long prefill step does not), not the max alone.
        auto const lo = [&](int32_t input, int32_t dim) {
            int64_t const v = inputs[input].min.nbDims > dim ? inputs[input].min.d[dim] : -1;
            return static_cast<int32_t>(v < 0 || v > std::numeric_limits<int32_t>::max() ? -1 : v); // -1: unknown
        };
        return kk::kiviWorkspaceSizeForProfile(s, lo(kIN_Q, 0), lo(kIN_SLOT_IDS, 0), lo(kIN_BLOCK_TABLE, 1));
    });
}

char const* KiviAttentionPlugin::getTimingCacheID() noexcept
{
    return mMetadata.c_str();
}

char const* KiviAttentionPlugin::getMetadataString() noexcept
{
    return mMetadata.c_str();
}

int32_t KiviAttentionPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    return guarded<int32_t>("onShapeChange", -1, [&]() -> int32_t {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            return fail("KiviAttention expects " + std::to_string(kNB_INPUTS) + " inputs and "
                + std::to_string(kNB_OUTPUTS) + " outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
        }
        DataType types[kNB_INPUTS];
        Dims dims[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            types[i] = in[i].type;
            dims[i] = in[i].dims;
        }
        std::string err = checkInputTypes(mParams, types, nbInputs);
        if (err.empty())
        {
            err = checkInputDims(mParams, dims, nbInputs);
        }
        return err.empty() ? 0 : fail(err);
    });
}

int32_t KiviAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    return guarded<int32_t>("enqueue", -1, [&]() -> int32_t {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr)
        {
            return fail("KiviAttention enqueue: null tensor descriptors or pointers");
        }
        DataType types[kNB_INPUTS];
        Dims dims[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            types[i] = inputDesc[i].type;
            dims[i] = inputDesc[i].dims;
        }
        std::string err = checkInputTypes(mParams, types, kNB_INPUTS);
        if (err.empty())
        {
            err = checkInputDims(mParams, dims, kNB_INPUTS);
        }
        kk::KiviStepParams s{};
        if (err.empty())
        {
            err = makeStepParams(mParams, dims, types[kIN_Q], s);
        }
        if (!err.empty())
        {
            return fail(err);
        }
        // The cache buffers are updated in place: each output must be its input (TensorRT with
        // PreviewFeature::kALIASED_PLUGIN_IO_10_03, the runner binding present.* to past.*). Anything else is refused,
        // never served by copying every cache pool each step.
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            if (outputs[kOUT_BUFFERS + b] != inputs[kIN_BUFFERS + b])
            {
                return fail(std::string("KiviAttention enqueue: output ") + inputName(kIN_BUFFERS + b) + " ("
                    + pointerString(outputs[kOUT_BUFFERS + b]) + ") is not its input's buffer ("
                    + pointerString(inputs[kIN_BUFFERS + b]) + "); the cache is updated in place and never copied: "
                    + "build the engine with PreviewFeature::kALIASED_PLUGIN_IO_10_03 and bind every cache output "
                    + "to the address of the input ICudaEngine::getAliasedInputTensor names");
            }
        }
        s.q = inputs[kIN_Q];
        s.k = inputs[kIN_K];
        s.v = inputs[kIN_V];
        s.out = outputs[kOUT_OUT];
        s.slotIds = static_cast<int32_t const*>(inputs[kIN_SLOT_IDS]);
        s.pastLen = static_cast<int32_t const*>(inputs[kIN_PAST_LEN]);
        s.chunkLen = static_cast<int32_t const*>(inputs[kIN_CHUNK_LEN]);
        s.blockTable = static_cast<int32_t const*>(inputs[kIN_BLOCK_TABLE]);
        void** const buffers[kNUM_BUFFERS] = {&s.kCodes, &s.kScale, &s.kZero, &s.vCodes, &s.vScale, &s.vZero,
            &s.kWindow, &s.vWindow};
        for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
        {
            *buffers[b] = outputs[kOUT_BUFFERS + b];
        }
        // The kernels OR KiviErrorBits into status (cleared here, on the stream: no host synchronization).
        s.errorFlag = static_cast<int32_t*>(outputs[kOUT_STATUS]);
        s.workspace = workspace;
        s.workspaceSize = kk::kiviWorkspaceSize(s);
        char msg[512];
        if (kk::kiviValidate(s, kk::kPHASE_STEP, msg, sizeof(msg)) != 0)
        {
            return fail(std::string("KiviAttention enqueue: ") + msg);
        }
        if (s.errorFlag == nullptr)
        {
            return fail("KiviAttention enqueue: the status output is a null pointer");
        }
        cudaError_t e = cudaMemsetAsync(s.errorFlag, 0, sizeof(int32_t), stream);
        if (e != cudaSuccess)
        {
            return fail(std::string("KiviAttention enqueue: clearing the status output failed: ")
                + cudaGetErrorString(e));
        }
        e = kk::invokeKiviStep(s, stream);
        if (e != cudaSuccess)
        {
            std::string const detail = kk::kiviGetLastErrorMessage();
            return fail(std::string("KiviAttention enqueue: the KIVI kernels failed: ")
                + (detail.empty() ? cudaGetErrorString(e) : detail));
        }
        return 0;
    });
}

IPluginV3* KiviAttentionPlugin::attachToContext(IPluginResourceContext* /* context */) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* KiviAttentionPlugin::getFieldsToSerialize() noexcept
{
    return &mFCToSerialize;
}

// ---------------------------------------------------------------------------------------------- creator

KiviAttentionPluginCreator::KiviAttentionPluginCreator()
{
    for (auto const& f : kFIELDS)
    {
        mPluginAttributes.emplace_back(f.name, nullptr, PluginFieldType::kINT32, 1);
    }
    mFC.nbFields = static_cast<int32_t>(mPluginAttributes.size());
    mFC.fields = mPluginAttributes.data();
}

char const* KiviAttentionPluginCreator::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* KiviAttentionPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* KiviAttentionPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* KiviAttentionPluginCreator::getFieldNames() noexcept
{
    return &mFC;
}

IPluginV3* KiviAttentionPluginCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept
{
    return guarded<IPluginV3*>("createPlugin", nullptr, [&]() -> IPluginV3* {
        KiviAttentionParams params{};
        std::string err = parseFields(fc, phase, params);
        if (err.empty())
        {
            err = validateParams(params);
        }
        if (!err.empty())
        {
            reportError(err + " (layer '" + (name != nullptr ? name : "") + "')");
            return nullptr;
        }
        return new KiviAttentionPlugin(params);
    });
}

} // namespace trtllm_kivi
