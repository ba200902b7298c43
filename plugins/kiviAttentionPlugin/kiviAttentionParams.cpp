/*
 * KiviAttention plugin: fields, validation and I/O checks. Mirrors trtllm_kivi/format.py (KiviConfig, Geometry,
 * buffer_shapes) and trtllm_kivi/plugin.py (FIELDS, config_from_fields).
 */
#include "kiviAttentionParams.h"

#include <atomic>
#include <cstdio>
#include <initializer_list>
#include <sstream>
#include <utility>

namespace trtllm_kivi
{
using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorRTPhase;

// BEGIN FIELD TABLE (parsed by tests/test_plugin_fields.py: one entry a line, plugin.py FIELDS order)
std::array<FieldSpec, kNB_FIELDS> const kFIELDS{{
    {"num_heads", &KiviAttentionParams::numHeads, true},
    {"num_kv_heads", &KiviAttentionParams::numKvHeads, true},
    {"head_dim", &KiviAttentionParams::headDim, true},
    {"k_bits", &KiviAttentionParams::kBits, true},
    {"v_bits", &KiviAttentionParams::vBits, true},
    {"group_size", &KiviAttentionParams::groupSize, true},
    {"residual_length", &KiviAttentionParams::residualLength, true},
    {"block_size", &KiviAttentionParams::blockSize, true},
    {"scale_dtype", &KiviAttentionParams::scaleDtype, true},
    {"key_grouping", &KiviAttentionParams::keyGrouping, true},
    {"sink_tokens", &KiviAttentionParams::sinkTokens, true},
    {"k_rotation", &KiviAttentionParams::kRotation, true},
    {"v_rotation", &KiviAttentionParams::vRotation, true},
    {"format_version", &KiviAttentionParams::formatVersion, true},
}};
// END FIELD TABLE

bool KiviAttentionParams::operator==(KiviAttentionParams const& o) const noexcept
{
    for (auto const& f : kFIELDS)
    {
        if (this->*f.member != o.*f.member)
        {
            return false;
        }
    }
    return true;
}

namespace
{
constexpr char const* kSCALE_DTYPE_NAMES[] = {"float16", "bfloat16", "float32"};
constexpr char const* kKEY_GROUPING_NAMES[] = {"per_channel", "per_token"};
constexpr char const* kROTATION_NAMES[] = {"none", "hadamard"};
constexpr char const* kINPUT_NAMES[kNB_INPUTS] = {"q", "k", "v", "slot_ids", "past_len", "chunk_len", "block_table",
    "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window"};

template <size_t N>
bool contains(int32_t const (&values)[N], int32_t v)
{
    for (int32_t x : values)
    {
        if (x == v)
        {
            return true;
        }
    }
    return false;
}

template <size_t N>
std::string join(int32_t const (&values)[N])
{
    std::string s;
    for (size_t i = 0; i < N; ++i)
    {
        s += (i ? ", " : "") + std::to_string(values[i]);
    }
    return s;
}

std::string notSupported(char const* name, int32_t value, std::string const& allowed)
{
    return std::string("KiviAttention field ") + name + "=" + std::to_string(value) + " is not supported; allowed: "
        + allowed;
}

std::string dimsString(Dims const& d)
{
    std::string s = "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        s += (i ? ", " : "") + std::to_string(d.d[i]);
    }
    return s + "]";
}

char const* typeName(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    default: return "another type";
    }
}
} // namespace

std::string parseFields(PluginFieldCollection const* fc, TensorRTPhase phase, KiviAttentionParams& params)
{
    if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr))
    {
        return "KiviAttention: the plugin field collection is null";
    }
    KiviAttentionParams p{};
    std::array<bool, kNB_FIELDS> seen{};
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& field = fc->fields[i];
        std::string const name = field.name != nullptr ? field.name : "";
        size_t k = 0;
        while (k < kNB_FIELDS && name != kFIELDS[k].name)
        {
            ++k;
        }
        if (k == kNB_FIELDS)
        {
            std::string known;
            for (auto const& f : kFIELDS)
            {
                known += (known.empty() ? "" : ", ") + std::string(f.name);
            }
            return "KiviAttention: unknown field '" + name + "'; expected: " + known;
        }
        if (seen[k])
        {
            return "KiviAttention field " + name + " is given twice";
        }
        if (field.type != PluginFieldType::kINT32 || field.length != 1 || field.data == nullptr)
        {
            return "KiviAttention field " + name + " must be one int32 (kINT32, length 1); got type "
                + std::to_string(static_cast<int32_t>(field.type)) + ", length " + std::to_string(field.length);
        }
        p.*kFIELDS[k].member = *static_cast<int32_t const*>(field.data);
        seen[k] = true;
    }
    std::string missing;
    for (size_t k = 0; k < kNB_FIELDS; ++k)
    {
        bool const required = phase == TensorRTPhase::kRUNTIME || kFIELDS[k].requiredAtBuild;
        if (!seen[k] && required)
        {
            missing += (missing.empty() ? "" : ", ") + std::string(kFIELDS[k].name);
        }
    }
    if (!missing.empty())
    {
        return std::string("KiviAttention: missing field(s) ") + missing
            + (phase == TensorRTPhase::kRUNTIME ? " in the serialized plugin" : "");
    }
    params = p;
    return "";
}

std::string validateParams(KiviAttentionParams const& p)
{
    // Version first: a plan from another format version is refused before its other fields are interpreted.
    if (p.formatVersion != kFORMAT_VERSION)
    {
        return "KiviAttention field format_version=" + std::to_string(p.formatVersion)
            + " does not match this plugin library's FORMAT_VERSION=" + std::to_string(kFORMAT_VERSION)
            + "; rebuild the engine with this trtllm_kivi version or load the matching plugin library";
    }
    if (p.numHeads <= 0)
    {
        return "KiviAttention field num_heads=" + std::to_string(p.numHeads) + " must be a positive integer";
    }
    if (p.numKvHeads <= 0)
    {
        return "KiviAttention field num_kv_heads=" + std::to_string(p.numKvHeads) + " must be a positive integer";
    }
    if (p.numHeads % p.numKvHeads != 0)
    {
        return "KiviAttention field num_heads=" + std::to_string(p.numHeads) + " must be a multiple of num_kv_heads="
            + std::to_string(p.numKvHeads);
    }
    if (!contains(kSUPPORTED_HEAD_DIMS, p.headDim))
    {
        return notSupported("head_dim", p.headDim, join(kSUPPORTED_HEAD_DIMS));
    }
    if (!contains(kSUPPORTED_BITS, p.kBits))
    {
        return notSupported("k_bits", p.kBits, join(kSUPPORTED_BITS));
    }
    if (!contains(kSUPPORTED_BITS, p.vBits))
    {
        return notSupported("v_bits", p.vBits, join(kSUPPORTED_BITS));
    }
    if (!contains(kSUPPORTED_GROUP_SIZES, p.groupSize))
    {
        return notSupported("group_size", p.groupSize, join(kSUPPORTED_GROUP_SIZES));
    }
    // Bounded so that W = R + G - 1 and block arithmetic stay in int32.
    constexpr int32_t kMAX_RESIDUAL = (1 << 30);
    if (p.residualLength < 0 || p.residualLength > kMAX_RESIDUAL)
    {
        return "KiviAttention field residual_length=" + std::to_string(p.residualLength) + " must be in [0, "
            + std::to_string(kMAX_RESIDUAL) + "]";
    }
    if (p.blockSize <= 0 || p.blockSize % p.groupSize != 0)
    {
        return "KiviAttention field block_size=" + std::to_string(p.blockSize)
            + " must be a positive multiple of group_size=" + std::to_string(p.groupSize);
    }
    if (p.scaleDtype < 0 || p.scaleDtype > kSCALE_DTYPE_FLOAT32)
    {
        return notSupported("scale_dtype", p.scaleDtype, "0=float16, 1=bfloat16, 2=float32");
    }
    if (p.keyGrouping < 0 || p.keyGrouping > kKEY_GROUPING_PER_TOKEN)
    {
        return notSupported("key_grouping", p.keyGrouping, "0=per_channel, 1=per_token");
    }
    if (p.sinkTokens < 0 || p.sinkTokens > kMAX_SINK_TOKENS)
    {
        return "KiviAttention field sink_tokens=" + std::to_string(p.sinkTokens) + " must be in [0, "
            + std::to_string(kMAX_SINK_TOKENS) + "]";
    }
    for (auto const& r : {std::make_pair("k_rotation", p.kRotation), std::make_pair("v_rotation", p.vRotation)})
    {
        if (r.second != kROTATION_NONE && r.second != kROTATION_HADAMARD)
        {
            return notSupported(r.first, r.second, "0=none, 1=hadamard");
        }
    }
    return "";
}

std::vector<PluginField> fieldsOf(KiviAttentionParams const& p)
{
    std::vector<PluginField> fields;
    fields.reserve(kNB_FIELDS);
    for (auto const& f : kFIELDS)
    {
        fields.emplace_back(f.name, &(p.*f.member), PluginFieldType::kINT32, 1);
    }
    return fields;
}

std::string describe(KiviAttentionParams const& p)
{
    std::ostringstream os;
    for (size_t k = 0; k < kNB_FIELDS; ++k)
    {
        os << (k ? " " : "") << kFIELDS[k].name << "=" << p.*kFIELDS[k].member;
    }
    if (p.scaleDtype >= 0 && p.scaleDtype <= kSCALE_DTYPE_FLOAT32 && p.keyGrouping >= 0
        && p.keyGrouping <= kKEY_GROUPING_PER_TOKEN)
    {
        os << " (" << kSCALE_DTYPE_NAMES[p.scaleDtype] << " scales, " << kKEY_GROUPING_NAMES[p.keyGrouping]
           << " keys";
        if (p.kRotation == kROTATION_HADAMARD || p.vRotation == kROTATION_HADAMARD)
        {
            os << ", rotation k=" << kROTATION_NAMES[p.kRotation == kROTATION_HADAMARD ? 1 : 0]
               << " v=" << kROTATION_NAMES[p.vRotation == kROTATION_HADAMARD ? 1 : 0];
        }
        os << ")";
    }
    return os.str();
}

DataType scaleDataType(KiviAttentionParams const& p) noexcept
{
    switch (p.scaleDtype)
    {
    case kSCALE_DTYPE_BFLOAT16: return DataType::kBF16;
    case kSCALE_DTYPE_FLOAT32: return DataType::kFLOAT;
    default: return DataType::kHALF;
    }
}

bool isActivationType(DataType t) noexcept
{
    return t == DataType::kHALF || t == DataType::kBF16;
}

DataType expectedInputType(KiviAttentionParams const& p, int32_t index, DataType act) noexcept
{
    switch (index)
    {
    case kIN_Q:
    case kIN_K:
    case kIN_V:
    case kIN_BUFFERS + kBUFFER_K_WINDOW:
    case kIN_BUFFERS + kBUFFER_V_WINDOW: return act;
    case kIN_BUFFERS + kBUFFER_K_SCALE:
    case kIN_BUFFERS + kBUFFER_K_ZERO:
    case kIN_BUFFERS + kBUFFER_V_SCALE:
    case kIN_BUFFERS + kBUFFER_V_ZERO: return scaleDataType(p);
    default: return DataType::kINT32; // slot_ids, past_len, chunk_len, block_table, k_codes, v_codes
    }
}

char const* inputName(int32_t index) noexcept
{
    return index >= 0 && index < kNB_INPUTS ? kINPUT_NAMES[index] : "?";
}

std::string checkInputTypes(KiviAttentionParams const& p, DataType const* types, int32_t nbInputs)
{
    if (nbInputs != kNB_INPUTS || types == nullptr)
    {
        return "KiviAttention expects " + std::to_string(kNB_INPUTS) + " inputs, got " + std::to_string(nbInputs);
    }
    DataType const act = types[kIN_Q];
    if (!isActivationType(act))
    {
        return std::string("KiviAttention input q has type ") + typeName(act)
            + "; supported activation types: float16, bfloat16";
    }
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        DataType const want = expectedInputType(p, i, act);
        if (types[i] != want)
        {
            return std::string("KiviAttention input ") + kINPUT_NAMES[i] + " has type " + typeName(types[i])
                + ", expected " + typeName(want) + " (activations " + typeName(act) + ", scale_dtype "
                + std::to_string(p.scaleDtype) + ")";
        }
    }
    return "";
}

Dims bufferDims(KiviAttentionParams const& p, int32_t b, int64_t numBlocks, int64_t numSlots)
{
    int64_t const hkv = p.numKvHeads;
    int64_t const d = p.headDim;
    int64_t const bs = p.blockSize;
    int64_t const g = p.groupSize;
    int64_t const gv = valueGroupSize(p.groupSize, p.headDim);
    int64_t const kpw = codesPerWord(p.kBits);
    int64_t const vpw = codesPerWord(p.vBits);
    bool const perChannel = p.keyGrouping == kKEY_GROUPING_PER_CHANNEL;
    Dims dims{};
    dims.nbDims = 4;
    auto set = [&dims](int64_t a, int64_t bb, int64_t c, int64_t e) {
        dims.d[0] = a;
        dims.d[1] = bb;
        dims.d[2] = c;
        dims.d[3] = e;
    };
    switch (b)
    {
    case kBUFFER_K_CODES: perChannel ? set(numBlocks, hkv, bs / kpw, d) : set(numBlocks, hkv, bs, d / kpw); break;
    case kBUFFER_K_SCALE:
    case kBUFFER_K_ZERO: perChannel ? set(numBlocks, hkv, bs / g, d) : set(numBlocks, hkv, bs, d / gv); break;
    case kBUFFER_V_CODES: set(numBlocks, hkv, bs, d / vpw); break;
    case kBUFFER_V_SCALE:
    case kBUFFER_V_ZERO: set(numBlocks, hkv, bs, d / gv); break;
    default: set(numSlots, hkv, p.sinkTokens + windowCapacity(p.residualLength, p.groupSize), d); break; // windows
    }
    return dims;
}

std::string checkInputDims(KiviAttentionParams const& p, Dims const* dims, int32_t nbInputs)
{
    if (nbInputs != kNB_INPUTS || dims == nullptr)
    {
        return "KiviAttention expects " + std::to_string(kNB_INPUTS) + " inputs, got " + std::to_string(nbInputs);
    }
    // Wildcard-aware equality: a dim < 0 (unknown at build time) matches anything.
    auto same = [](int64_t a, int64_t b) { return a < 0 || b < 0 || a == b; };
    auto mismatch = [&](int32_t i, Dims const& want) {
        return std::string("KiviAttention input ") + kINPUT_NAMES[i] + " has dims " + dimsString(dims[i])
            + ", expected " + dimsString(want) + " (-1: any) for " + describe(p);
    };
    int32_t const ranks[kNB_INPUTS] = {3, 3, 3, 1, 1, 1, 2, 4, 4, 4, 4, 4, 4, 4, 4};
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        if (dims[i].nbDims != ranks[i])
        {
            return std::string("KiviAttention input ") + kINPUT_NAMES[i] + " has rank " + std::to_string(dims[i].nbDims)
                + ", expected " + std::to_string(ranks[i]);
        }
    }
    int64_t const tokens = dims[kIN_Q].d[0];
    Dims want{};
    want.nbDims = 3;
    want.d[0] = tokens;
    want.d[1] = p.numHeads;
    want.d[2] = p.headDim;
    for (int32_t j = 0; j < 3; ++j)
    {
        if (!same(dims[kIN_Q].d[j], want.d[j]))
        {
            return mismatch(kIN_Q, want);
        }
    }
    want.d[1] = p.numKvHeads;
    for (int32_t i : {kIN_K, kIN_V})
    {
        for (int32_t j = 0; j < 3; ++j)
        {
            if (!same(dims[i].d[j], want.d[j]))
            {
                return mismatch(i, want);
            }
        }
    }
    int64_t const batch = dims[kIN_SLOT_IDS].d[0];
    for (int32_t i : {kIN_PAST_LEN, kIN_CHUNK_LEN, kIN_BLOCK_TABLE})
    {
        if (!same(dims[i].d[0], batch))
        {
            return std::string("KiviAttention input ") + kINPUT_NAMES[i] + " has " + std::to_string(dims[i].d[0])
                + " rows, expected batch=" + std::to_string(batch) + " (the length of slot_ids)";
        }
    }
    int64_t numBlocks = dims[kIN_BUFFERS + kBUFFER_K_CODES].d[0];
    int64_t numSlots = dims[kIN_BUFFERS + kBUFFER_K_WINDOW].d[0];
    for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
    {
        Dims const w = bufferDims(p, b, numBlocks, numSlots);
        for (int32_t j = 0; j < 4; ++j)
        {
            if (!same(dims[kIN_BUFFERS + b].d[j], w.d[j]))
            {
                return mismatch(kIN_BUFFERS + b, w);
            }
        }
        // A wildcard first buffer leaves the pool size to the next known one.
        if (b < kBUFFER_K_WINDOW && numBlocks < 0)
        {
            numBlocks = dims[kIN_BUFFERS + b].d[0];
        }
        if (b >= kBUFFER_K_WINDOW && numSlots < 0)
        {
            numSlots = dims[kIN_BUFFERS + b].d[0];
        }
    }
    return "";
}

int32_t dataTypeSize(DataType t) noexcept
{
    switch (t)
    {
    case DataType::kFLOAT:
    case DataType::kINT32: return 4;
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    default: return 0;
    }
}

int64_t volume(Dims const& d) noexcept
{
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        if (d.d[i] < 0)
        {
            return 0;
        }
        v *= d.d[i];
    }
    return v;
}

// ---------------------------------------------------------------------------------------------- errors and logging

namespace
{
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

std::string& lastErrorStorage() noexcept
{
    thread_local std::string sLastError;
    return sLastError;
}
} // namespace

void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    // First finder wins, as in TensorRT's own plugin libraries.
    nvinfer1::ILoggerFinder* expected = nullptr;
    gLoggerFinder.compare_exchange_strong(expected, finder);
}

void reportError(std::string const& msg) noexcept
{
    try
    {
        lastErrorStorage() = msg;
    }
    catch (...) // out of memory while copying the message: still log it below
    {
    }
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
    {
        logger->log(nvinfer1::ILogger::Severity::kERROR, msg.c_str());
    }
    else
    {
        std::fprintf(stderr, "[trtllm_kivi] ERROR: %s\n", msg.c_str());
    }
}

std::string const& lastError() noexcept
{
    return lastErrorStorage();
}

void clearLastError() noexcept
{
    lastErrorStorage().clear();
}

} // namespace trtllm_kivi
