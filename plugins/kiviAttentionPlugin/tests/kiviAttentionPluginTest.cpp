/*
 * Creator and host-side tests of the KiviAttention plugin (no GPU, no libnvinfer): field parsing, validation
 * messages, serialize -> create round trip, I/O types/shapes/aliasing, the status output, the profile workspace,
 * enqueue refusals (non-aliased cache buffers), the loadLibrary entry points.
 * Oracle: trtllm_kivi/format.py + trtllm_kivi/plugin.py (the field list and rules this mirrors) and the layouts of
 * format.buffer_shapes, written out here for one geometry.
 *
 *   kiviAttentionPluginTest                 run every test (exit code 0 = all passed)
 *   kiviAttentionPluginTest --print-fields  print the C++ field table as JSON (tests/test_plugin_fields.py)
 */
#include "kiviAttentionPlugin.h"
#include "kiviAttentionPluginExports.h"
#include "kiviParams.h"
#include "kiviTestUtils.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;
using namespace trtllm_kivi;
using trtllm_kivi::test::makeDims;

namespace
{
int32_t gFailures = 0;
int32_t gChecks = 0;

void check(bool ok, std::string const& what, int line)
{
    ++gChecks;
    if (!ok)
    {
        ++gFailures;
        std::fprintf(stderr, "FAIL (line %d): %s\n", line, what.c_str());
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)
#define CHECK_MSG(cond, msg) check((cond), std::string(#cond) + " -- " + (msg), __LINE__)

bool contains(std::string const& s, std::string const& part)
{
    return s.find(part) != std::string::npos;
}

//! Plugin fields as (name, value) pairs with storage, in any order.
struct Fields
{
    std::vector<std::string> names;
    std::vector<int32_t> values;
    std::vector<PluginField> fields;
    PluginFieldCollection fc{};

    Fields& set(std::string const& name, int32_t value)
    {
        for (size_t i = 0; i < names.size(); ++i)
        {
            if (names[i] == name)
            {
                values[i] = value;
                return *this;
            }
        }
        names.push_back(name);
        values.push_back(value);
        return *this;
    }
    Fields& erase(std::string const& name)
    {
        for (size_t i = 0; i < names.size(); ++i)
        {
            if (names[i] == name)
            {
                names.erase(names.begin() + static_cast<std::ptrdiff_t>(i));
                values.erase(values.begin() + static_cast<std::ptrdiff_t>(i));
            }
        }
        return *this;
    }
    PluginFieldCollection const* collection()
    {
        fields.clear();
        for (size_t i = 0; i < names.size(); ++i)
        {
            fields.emplace_back(names[i].c_str(), &values[i], PluginFieldType::kINT32, 1);
        }
        fc.nbFields = static_cast<int32_t>(fields.size());
        fc.fields = fields.data();
        return &fc;
    }
};

//! SmolLM2-135M geometry (9 heads, 3 KV heads, head_dim 64) with every KIVI field at its default, as plugin.py's
//! plugin_fields(KiviConfig(), 9, 3, 64) returns them.
Fields smolFields()
{
    Fields f;
    f.set("num_heads", 9).set("num_kv_heads", 3).set("head_dim", 64).set("k_bits", 2).set("v_bits", 2);
    f.set("group_size", 32).set("residual_length", 128).set("block_size", 128).set("scale_dtype", 0);
    f.set("key_grouping", 0).set("sink_tokens", 0).set("k_rotation", 0).set("v_rotation", 0);
    f.set("format_version", kFORMAT_VERSION);
    return f;
}

std::unique_ptr<KiviAttentionPlugin> create(Fields& f, TensorRTPhase phase = TensorRTPhase::kBUILD)
{
    clearLastError();
    IPluginV3* p = pluginCreator().createPlugin("layer0", f.collection(), phase);
    return std::unique_ptr<KiviAttentionPlugin>(static_cast<KiviAttentionPlugin*>(p));
}

//! createPlugin must refuse f with an error containing every part.
void expectRefused(Fields f, std::vector<std::string> const& parts, int line,
    TensorRTPhase phase = TensorRTPhase::kBUILD)
{
    auto p = create(f, phase);
    check(p == nullptr, "createPlugin refuses", line);
    for (auto const& part : parts)
    {
        check(contains(lastError(), part), "message '" + lastError() + "' contains '" + part + "'", line);
    }
}

//! Input dims of a step for the SmolLM2 fields: tokens T, batch B, num_blocks NB, num_slots S, table width MB.
//! Expected buffer shapes written out from format.buffer_shapes(KiviConfig(), 3, 64, NB, S):
//!   k_codes [NB, 3, 128/16, 64], k_scale/k_zero [NB, 3, 128/32, 64], v_codes [NB, 3, 128, 64/16],
//!   v_scale/v_zero [NB, 3, 128, 64/32], windows [S, 3, 128+32-1, 64].
std::vector<Dims> smolDims(int64_t t, int64_t b, int64_t nb, int64_t s, int64_t mb)
{
    return {makeDims({t, 9, 64}), makeDims({t, 3, 64}), makeDims({t, 3, 64}), makeDims({b}), makeDims({b}),
        makeDims({b}), makeDims({b, mb}), makeDims({nb, 3, 8, 64}), makeDims({nb, 3, 4, 64}),
        makeDims({nb, 3, 4, 64}), makeDims({nb, 3, 128, 4}), makeDims({nb, 3, 128, 2}), makeDims({nb, 3, 128, 2}),
        makeDims({s, 3, 159, 64}), makeDims({s, 3, 159, 64})};
}

//! getOutputShapes passes its inputs' expressions through and builds one constant (status: [1]). The builder
//! hands out distinct fake expressions and records the constants asked for; it never builds anything else.
class FakeExprBuilderImpl : public apiv::VExprBuilder
{
public:
    IDimensionExpr const* constant(int64_t value) override
    {
        constants.push_back(value);
        return reinterpret_cast<IDimensionExpr const*>(kCONSTANT_BASE + 16 * constants.size());
    }
    IDimensionExpr const* operation(DimensionOperation, IDimensionExpr const&, IDimensionExpr const&) override
    {
        ++operations;
        return nullptr;
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        ++operations;
        return nullptr;
    }
    static constexpr uintptr_t kCONSTANT_BASE = 0x900000;
    std::vector<int64_t> constants;
    int32_t operations{0};
};

class FakeExprBuilder : public IExprBuilder
{
public:
    FakeExprBuilder()
    {
        mImpl = &impl;
    }
    FakeExprBuilderImpl impl;
};

std::vector<DataType> smolTypes(DataType act, DataType scale = DataType::kHALF)
{
    DataType const i32 = DataType::kINT32;
    return {act, act, act, i32, i32, i32, i32, i32, scale, scale, i32, scale, scale, act, act};
}

//! The params smolFields() describes, written out.
KiviAttentionParams smolParamsDefaults()
{
    KiviAttentionParams p{};
    p.numHeads = 9;
    p.numKvHeads = 3;
    p.headDim = 64;
    p.kBits = 2;
    p.vBits = 2;
    p.groupSize = 32;
    p.residualLength = 128;
    p.blockSize = 128;
    p.scaleDtype = 0;
    p.keyGrouping = 0;
    p.formatVersion = kFORMAT_VERSION;
    return p;
}

// ---------------------------------------------------------------------------------------------- tests

void testIdentity()
{
    auto& c = pluginCreator();
    CHECK(std::string(c.getPluginName()) == "KiviAttention");
    CHECK(std::string(c.getPluginVersion()) == "1");
    CHECK(std::string(c.getPluginNamespace()) == "trtllm_kivi");
    PluginFieldCollection const* fc = c.getFieldNames();
    CHECK(fc != nullptr && fc->nbFields == 14);
    char const* names[] = {"num_heads", "num_kv_heads", "head_dim", "k_bits", "v_bits", "group_size",
        "residual_length", "block_size", "scale_dtype", "key_grouping", "sink_tokens", "k_rotation", "v_rotation",
        "format_version"};
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        CHECK_MSG(std::string(fc->fields[i].name) == names[i], fc->fields[i].name);
        CHECK(fc->fields[i].type == PluginFieldType::kINT32 && fc->fields[i].length == 1);
    }
    Fields f = smolFields();
    auto p = create(f);
    CHECK(p != nullptr);
    if (p == nullptr)
    {
        return;
    }
    CHECK(std::string(p->getPluginName()) == "KiviAttention");
    CHECK(std::string(p->getPluginVersion()) == "1");
    CHECK(std::string(p->getPluginNamespace()) == "trtllm_kivi");
    CHECK(p->getNbOutputs() == 10); // out, 8 cache buffers, status
    CHECK(p->getCapabilityInterface(PluginCapabilityType::kCORE) == static_cast<IPluginV3OneCore*>(p.get()));
    auto* build = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    CHECK(build == static_cast<IPluginV3OneBuildV2*>(p.get()));
    // TensorRT reads the aliasing API only from a build interface that reports version 2.
    CHECK(build != nullptr && build->getInterfaceInfo().major == 2);
    CHECK(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME) == static_cast<IPluginV3OneRuntime*>(p.get()));
    CHECK(contains(p->getMetadataString(), "num_heads=9 num_kv_heads=3 head_dim=64"));
}

void testRoundTrip()
{
    for (int32_t variant = 0; variant < 5; ++variant)
    {
        Fields f = smolFields();
        if (variant == 1)
        {
            f.set("num_heads", 32).set("num_kv_heads", 8).set("head_dim", 128).set("k_bits", 4).set("v_bits", 8);
            f.set("group_size", 64).set("residual_length", 0).set("block_size", 256).set("scale_dtype", 2);
        }
        if (variant == 2)
        {
            f.set("scale_dtype", 1).set("key_grouping", 1).set("group_size", 128).set("block_size", 128);
        }
        if (variant == 4) // rotation codes are carried (the op itself is rotation-agnostic)
        {
            f.set("k_rotation", 1).set("v_rotation", 0);
        }
        if (variant == 3) // the default fields, given in another order
        {
            f = Fields{};
            f.set("head_dim", 64).set("num_kv_heads", 3).set("num_heads", 9).set("format_version", kFORMAT_VERSION);
            f.set("v_rotation", 0).set("k_rotation", 0).set("sink_tokens", 0).set("key_grouping", 0);
            f.set("scale_dtype", 0).set("block_size", 128).set("residual_length", 128).set("group_size", 32);
            f.set("v_bits", 2).set("k_bits", 2);
        }
        auto p = create(f);
        CHECK_MSG(p != nullptr, lastError());
        if (p == nullptr)
        {
            continue;
        }
        PluginFieldCollection const* ser = p->getFieldsToSerialize();
        CHECK(ser != nullptr && ser->nbFields == 14);
        for (int32_t i = 0; i < ser->nbFields; ++i)
        {
            CHECK(std::string(ser->fields[i].name) == kFIELDS[static_cast<size_t>(i)].name);
            CHECK(ser->fields[i].type == PluginFieldType::kINT32 && ser->fields[i].length == 1);
        }
        if (variant == 3)
        {
            CHECK(p->params() == smolParamsDefaults());
        }
        if (variant == 4)
        {
            CHECK(p->params().kRotation == kROTATION_HADAMARD && p->params().vRotation == kROTATION_NONE);
            CHECK(contains(p->getMetadataString(), "k_rotation=1 v_rotation=0"));
            CHECK(contains(p->getMetadataString(), "rotation k=hadamard v=none"));
        }
        // Runtime phase: what TensorRT passes back at deserialization.
        clearLastError();
        std::unique_ptr<KiviAttentionPlugin> q(
            static_cast<KiviAttentionPlugin*>(pluginCreator().createPlugin("layer0", ser, TensorRTPhase::kRUNTIME)));
        CHECK_MSG(q != nullptr, lastError());
        if (q == nullptr)
        {
            continue;
        }
        CHECK(q->params() == p->params());
        PluginFieldCollection const* ser2 = q->getFieldsToSerialize();
        for (int32_t i = 0; i < ser2->nbFields; ++i)
        {
            CHECK(*static_cast<int32_t const*>(ser2->fields[i].data)
                == *static_cast<int32_t const*>(ser->fields[i].data));
        }
        // clone and attachToContext copy the fields and re-point the serialized collection at the copy.
        std::unique_ptr<IPluginV3> c(q->clone());
        auto* cc = static_cast<KiviAttentionPlugin*>(c.get());
        CHECK(cc != nullptr && cc->params() == q->params());
        CHECK(cc != nullptr && cc->getFieldsToSerialize()->fields[0].data != ser2->fields[0].data);
        std::unique_ptr<IPluginV3> a(q->attachToContext(nullptr));
        CHECK(a != nullptr && static_cast<KiviAttentionPlugin*>(a.get())->params() == q->params());
    }
}

void testFieldErrors()
{
    expectRefused(smolFields().set("num_heads", 0), {"num_heads=0", "positive"}, __LINE__);
    expectRefused(smolFields().set("num_kv_heads", -1), {"num_kv_heads=-1", "positive"}, __LINE__);
    expectRefused(smolFields().set("num_heads", 10), {"num_heads=10", "multiple of num_kv_heads=3"}, __LINE__);
    expectRefused(smolFields().set("head_dim", 96), {"head_dim=96", "allowed: 64, 128"}, __LINE__);
    expectRefused(smolFields().set("k_bits", 3), {"k_bits=3", "allowed: 2, 4, 8"}, __LINE__);
    expectRefused(smolFields().set("v_bits", 1), {"v_bits=1", "allowed: 2, 4, 8"}, __LINE__);
    expectRefused(smolFields().set("group_size", 48), {"group_size=48", "allowed: 32, 64, 128"}, __LINE__);
    expectRefused(smolFields().set("residual_length", -1), {"residual_length=-1"}, __LINE__);
    expectRefused(smolFields().set("block_size", 48), {"block_size=48", "multiple of group_size=32"}, __LINE__);
    expectRefused(smolFields().set("block_size", 0), {"block_size=0"}, __LINE__);
    expectRefused(smolFields().set("scale_dtype", 3), {"scale_dtype=3", "0=float16, 1=bfloat16, 2=float32"}, __LINE__);
    expectRefused(smolFields().set("key_grouping", 2), {"key_grouping=2", "0=per_channel, 1=per_token"}, __LINE__);
    // The sink and rotation fields (FORMAT_VERSION 2): sinks are accepted in both phases (the kernels keep them:
    // windows of S + W rows), outside [0, 128] refused; rotation codes outside {0, 1} are refused.
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
    {
        Fields f = smolFields().set("sink_tokens", 4);
        auto p = create(f, phase);
        CHECK_MSG(p != nullptr, lastError());
        if (p != nullptr)
        {
            auto dims = smolDims(5, 2, 10, 4, 3);
            dims[13] = makeDims({4, 3, 163, 64}); // S + R + G - 1 window rows
            dims[14] = makeDims({4, 3, 163, 64});
            CHECK_MSG(checkInputDims(p->params(), dims.data(), 15).empty(),
                checkInputDims(p->params(), dims.data(), 15));
            auto plain = smolDims(5, 2, 10, 4, 3);
            CHECK(contains(checkInputDims(p->params(), plain.data(), 15), "expected [4, 3, 163, 64]"));
        }
    }
    expectRefused(smolFields().set("sink_tokens", 129), {"sink_tokens=129 must be in [0, 128]"}, __LINE__);
    expectRefused(smolFields().set("sink_tokens", -1), {"sink_tokens=-1 must be in [0, 128]"}, __LINE__);
    expectRefused(smolFields().set("k_rotation", 2), {"k_rotation=2", "0=none, 1=hadamard"}, __LINE__);
    expectRefused(smolFields().set("v_rotation", -1), {"v_rotation=-1", "0=none, 1=hadamard"}, __LINE__);
    expectRefused(smolFields().erase("v_rotation"), {"missing field(s) v_rotation", "serialized"}, __LINE__,
        TensorRTPhase::kRUNTIME);
    // A plan from another storage format: both versions named.
    expectRefused(smolFields().set("format_version", kFORMAT_VERSION + 1),
        {"format_version=" + std::to_string(kFORMAT_VERSION + 1), "FORMAT_VERSION=" + std::to_string(kFORMAT_VERSION)},
        __LINE__, TensorRTPhase::kRUNTIME);
    expectRefused(smolFields().set("num_layers", 30), {"unknown field 'num_layers'", "num_heads"}, __LINE__);
    expectRefused(smolFields().erase("head_dim"), {"missing field(s) head_dim"}, __LINE__);
    // The build phase needs every field too: no default may stand in for what the graph's runner allocates.
    expectRefused(smolFields().erase("residual_length"), {"missing field(s) residual_length"}, __LINE__);
    expectRefused(smolFields().erase("format_version").erase("k_rotation"),
        {"missing field(s) k_rotation, format_version"}, __LINE__);
    // The runtime phase needs every field (getFieldsToSerialize writes them all).
    expectRefused(smolFields().erase("k_bits").erase("format_version"),
        {"missing field(s) k_bits, format_version", "serialized"}, __LINE__, TensorRTPhase::kRUNTIME);

    // Field type, length, data and duplicates.
    Fields f = smolFields();
    PluginFieldCollection fc = *f.collection();
    std::vector<PluginField> fields(fc.fields, fc.fields + fc.nbFields);
    fc.fields = fields.data();
    float const x = 2.0F;
    fields[3] = PluginField("k_bits", &x, PluginFieldType::kFLOAT32, 1);
    clearLastError();
    CHECK(pluginCreator().createPlugin("l", &fc, TensorRTPhase::kBUILD) == nullptr);
    CHECK_MSG(contains(lastError(), "field k_bits must be one int32"), lastError());
    int32_t const two[2] = {2, 2};
    fields[3] = PluginField("k_bits", two, PluginFieldType::kINT32, 2);
    CHECK(pluginCreator().createPlugin("l", &fc, TensorRTPhase::kBUILD) == nullptr);
    CHECK_MSG(contains(lastError(), "k_bits") && contains(lastError(), "length 2"), lastError());
    fields[3] = PluginField("k_bits", nullptr, PluginFieldType::kINT32, 1);
    CHECK(pluginCreator().createPlugin("l", &fc, TensorRTPhase::kBUILD) == nullptr);
    CHECK_MSG(contains(lastError(), "k_bits"), lastError());
    fields[3] = fields[4]; // v_bits twice, k_bits absent
    CHECK(pluginCreator().createPlugin("l", &fc, TensorRTPhase::kBUILD) == nullptr);
    CHECK_MSG(contains(lastError(), "v_bits is given twice"), lastError());
    CHECK(pluginCreator().createPlugin("l", nullptr, TensorRTPhase::kBUILD) == nullptr);
    CHECK_MSG(contains(lastError(), "null"), lastError());
}

void testTypesAndAliasing()
{
    Fields f = smolFields();
    auto p = create(f);
    if (p == nullptr)
    {
        CHECK(false);
        return;
    }
    CHECK(p->getAliasedInput(0) == -1);
    for (int32_t o = 1; o < 9; ++o)
    {
        CHECK(p->getAliasedInput(o) == 6 + o); // outputs 1..8 -> inputs 7..14
    }
    CHECK(p->getAliasedInput(9) == -1); // status is fresh
    CHECK(p->getAliasedInput(10) == -1);
    for (DataType act : {DataType::kHALF, DataType::kBF16})
    {
        auto in = smolTypes(act);
        DataType out[10];
        CHECK(p->getOutputDataTypes(out, 10, in.data(), 15) == 0);
        CHECK(out[0] == act);
        for (int32_t b = 0; b < 8; ++b)
        {
            CHECK(out[1 + b] == in[static_cast<size_t>(7 + b)]);
        }
        CHECK(out[9] == DataType::kINT32);
        // supportsFormatCombination accepts exactly this combination, output types included.
        std::vector<DynamicPluginTensorDesc> io(25);
        for (int32_t i = 0; i < 25; ++i)
        {
            io[static_cast<size_t>(i)].desc.format = TensorFormat::kLINEAR;
            io[static_cast<size_t>(i)].desc.type = i < 15 ? in[static_cast<size_t>(i)] : out[i - 15];
        }
        for (int32_t pos = 0; pos < 25; ++pos)
        {
            CHECK_MSG(p->supportsFormatCombination(pos, io.data(), 15, 10), std::to_string(pos));
        }
        io[24].desc.type = DataType::kFLOAT; // status must be int32
        CHECK(!p->supportsFormatCombination(24, io.data(), 15, 10));
        io[24].desc.type = DataType::kINT32;
        io[8].desc.type = DataType::kFLOAT; // k_scale fp32 while scale_dtype=float16
        CHECK(!p->supportsFormatCombination(8, io.data(), 15, 10));
        io[8].desc.type = DataType::kHALF;
        io[2].desc.type = act == DataType::kHALF ? DataType::kBF16 : DataType::kHALF; // v differs from q
        CHECK(!p->supportsFormatCombination(2, io.data(), 15, 10));
        io[2].desc.type = act;
        io[3].desc.type = DataType::kINT64; // slot_ids int64
        CHECK(!p->supportsFormatCombination(3, io.data(), 15, 10));
        io[3].desc.type = DataType::kINT32;
        io[13].desc.format = TensorFormat::kHWC8;
        CHECK(!p->supportsFormatCombination(13, io.data(), 15, 10));
        CHECK(!p->supportsFormatCombination(0, io.data(), 14, 10));
        CHECK(!p->supportsFormatCombination(0, io.data(), 15, 9)); // the pre-status output count
    }
    std::vector<DynamicPluginTensorDesc> io(25);
    io[0].desc.format = TensorFormat::kLINEAR;
    io[0].desc.type = DataType::kFLOAT;
    CHECK(!p->supportsFormatCombination(0, io.data(), 15, 10)); // fp32 activations: not in the kernels
    auto bad = smolTypes(DataType::kFLOAT);
    DataType out[10];
    clearLastError();
    CHECK(p->getOutputDataTypes(out, 9, smolTypes(DataType::kHALF).data(), 15) != 0);
    CHECK_MSG(contains(lastError(), "has 10 outputs, asked for 9"), lastError());
    CHECK(p->getOutputDataTypes(out, 10, bad.data(), 15) != 0);
    CHECK_MSG(contains(lastError(), "input q has type float32") && contains(lastError(), "float16, bfloat16"),
        lastError());
    bad = smolTypes(DataType::kHALF, DataType::kBF16);
    CHECK(p->getOutputDataTypes(out, 10, bad.data(), 15) != 0);
    CHECK_MSG(contains(lastError(), "input k_scale has type bfloat16, expected float16"), lastError());

    // scale_dtype selects the scale/zero type: bf16 scales with fp16 activations, fp32 scales with bf16.
    for (int32_t sd = 0; sd < 3; ++sd)
    {
        Fields g = smolFields();
        g.set("scale_dtype", sd);
        auto ps = create(g);
        DataType const scale = sd == 0 ? DataType::kHALF : sd == 1 ? DataType::kBF16 : DataType::kFLOAT;
        auto in = smolTypes(DataType::kBF16, scale);
        CHECK(ps != nullptr && ps->getOutputDataTypes(out, 10, in.data(), 15) == 0 && out[2] == scale);
    }
}

void testShapes()
{
    Fields f = smolFields();
    auto p = create(f);
    if (p == nullptr)
    {
        CHECK(false);
        return;
    }
    auto dims = smolDims(5, 2, 10, 4, 3);
    CHECK_MSG(checkInputDims(p->params(), dims.data(), 15).empty(), checkInputDims(p->params(), dims.data(), 15));
    // Build-time wildcards.
    auto wild = smolDims(-1, -1, -1, -1, -1);
    CHECK(checkInputDims(p->params(), wild.data(), 15).empty());
    // A mismatch names the input, its dims and the expected ones.
    auto d = smolDims(5, 2, 10, 4, 3);
    d[13] = makeDims({4, 3, 160, 64}); // window capacity must be R + G - 1 = 159
    std::string err = checkInputDims(p->params(), d.data(), 15);
    CHECK_MSG(contains(err, "input k_window has dims [4, 3, 160, 64], expected [4, 3, 159, 64]"), err);
    d = smolDims(5, 2, 10, 4, 3);
    d[0] = makeDims({5, 8, 64});
    err = checkInputDims(p->params(), d.data(), 15);
    CHECK_MSG(contains(err, "input q has dims [5, 8, 64], expected [5, 9, 64]"), err);
    d = smolDims(5, 2, 10, 4, 3);
    d[1] = makeDims({4, 3, 64}); // k rows differ from q rows
    CHECK(contains(checkInputDims(p->params(), d.data(), 15), "input k has dims [4, 3, 64]"));
    d = smolDims(5, 2, 10, 4, 3);
    d[5] = makeDims({3});
    CHECK(contains(checkInputDims(p->params(), d.data(), 15), "input chunk_len has 3 rows, expected batch=2"));
    d = smolDims(5, 2, 10, 4, 3);
    d[11] = makeDims({9, 3, 128, 2}); // v_scale from another pool size
    CHECK(contains(checkInputDims(p->params(), d.data(), 15), "input v_scale has dims [9, 3, 128, 2]"));
    d = smolDims(5, 2, 10, 4, 3);
    d[6] = makeDims({2});
    CHECK(contains(checkInputDims(p->params(), d.data(), 15), "input block_table has rank 1, expected 2"));

    // Per-token keys (the naive control) store keys like values: format.buffer_shapes's per_token branch.
    Fields g = smolFields();
    g.set("key_grouping", 1).set("k_bits", 4);
    auto pt = create(g);
    CHECK(pt != nullptr);
    if (pt != nullptr)
    {
        Dims kc = bufferDims(pt->params(), kBUFFER_K_CODES, 10, 4);
        Dims ks = bufferDims(pt->params(), kBUFFER_K_SCALE, 10, 4);
        CHECK(kc.nbDims == 4 && kc.d[0] == 10 && kc.d[1] == 3 && kc.d[2] == 128 && kc.d[3] == 8);
        CHECK(ks.nbDims == 4 && ks.d[2] == 128 && ks.d[3] == 2);
    }

    // getOutputShapes: out takes q's shape, buffers their inputs' (expressions are passed through untouched).
    std::vector<DimsExprs> in(15);
    for (size_t i = 0; i < 15; ++i)
    {
        in[i].nbDims = dims[i].nbDims;
        for (int32_t j = 0; j < in[i].nbDims; ++j)
        {
            in[i].d[j] = reinterpret_cast<IDimensionExpr const*>(0x1000 + 16 * (8 * i + static_cast<size_t>(j)));
        }
    }
    std::vector<DimsExprs> out(10);
    FakeExprBuilder builder;
    CHECK(p->getOutputShapes(in.data(), 15, nullptr, 0, out.data(), 10, builder) == 0);
    CHECK(out[0].nbDims == 3 && out[0].d[1] == in[0].d[1]);
    for (size_t b = 0; b < 8; ++b)
    {
        CHECK(out[1 + b].nbDims == 4 && out[1 + b].d[3] == in[7 + b].d[3]);
    }
    // status: [1], the one constant built.
    CHECK(builder.impl.constants == std::vector<int64_t>{1} && builder.impl.operations == 0);
    CHECK(out[9].nbDims == 1
        && out[9].d[0] == reinterpret_cast<IDimensionExpr const*>(FakeExprBuilderImpl::kCONSTANT_BASE + 16));
    CHECK(p->getOutputShapes(in.data(), 15, nullptr, 0, out.data(), 9, builder) != 0);
    in[1].nbDims = 2;
    clearLastError();
    CHECK(p->getOutputShapes(in.data(), 15, nullptr, 0, out.data(), 10, builder) != 0);
    CHECK_MSG(contains(lastError(), "input k has rank 2, expected 3"), lastError());
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(
    std::vector<Dims> const& dims, std::vector<Dims> const& maxDims, std::vector<DataType> const& types)
{
    std::vector<DynamicPluginTensorDesc> d(dims.size());
    for (size_t i = 0; i < dims.size(); ++i)
    {
        d[i].desc.dims = dims[i];
        d[i].desc.type = types[i];
        d[i].desc.format = TensorFormat::kLINEAR;
        d[i].min = dims[i];
        d[i].opt = maxDims[i];
        d[i].max = maxDims[i];
    }
    return d;
}

void testConfigureAndWorkspace()
{
    Fields f = smolFields();
    auto p = create(f);
    if (p == nullptr)
    {
        CHECK(false);
        return;
    }
    auto types = smolTypes(DataType::kHALF);
    auto in = dynamicDescs(smolDims(-1, -1, 64, 8, -1), smolDims(512, 8, 64, 8, 16), types);
    std::vector<DynamicPluginTensorDesc> out(10);
    clearLastError();
    CHECK_MSG(p->configurePlugin(in.data(), 15, out.data(), 10) == 0, lastError());
    size_t const ws = p->getWorkspaceSize(in.data(), 15, out.data(), 10);
    // More tokens / a wider table at the profile max never need less workspace.
    auto bigger = dynamicDescs(smolDims(-1, -1, 64, 8, -1), smolDims(4096, 64, 64, 8, 64), types);
    CHECK(p->getWorkspaceSize(bigger.data(), 15, out.data(), 10) >= ws);
    CHECK(p->configurePlugin(in.data(), 15, out.data(), 9) != 0); // the status output is required

    // The workspace covers every step of the profile, from the steps' own split plans. Oracle: the kernels'
    // kiviWorkspaceSize of each step of a small profile (tokens 1..512, batch 1..8, a fixed 16-block table) and
    // kiviLaunchPlan: its maximum, at the largest batch's per-sequence info.
    {
        kernels::KiviStepParams s{};
        s.numHeads = 9;
        s.numKvHeads = 3;
        s.headDim = 64;
        s.kBits = s.vBits = 2;
        s.groupSize = 32;
        s.residualLength = 128;
        s.blockSize = 128;
        s.numBlocks = 64;
        s.numSlots = 8;
        s.maxBlocksPerSeq = 16;
        size_t most = 0;
        for (int32_t t = 1; t <= 512; ++t)
        {
            for (int32_t b = 1; b <= 8; ++b)
            {
                s.numTokens = t;
                s.batch = b;
                kernels::KiviLaunchPlan const plan = kernels::kiviLaunchPlan(s);
                most = std::max(most, plan.partialBytes);
                CHECK(kernels::kiviWorkspaceSize(s) == plan.seqInfoBytes + plan.partialBytes);
            }
        }
        auto fixed = dynamicDescs(smolDims(1, 1, 64, 8, 16), smolDims(512, 8, 64, 8, 16), types);
        size_t const seqInfo8 = 256; // 8 sequences x 8 int32, rounded to 256 bytes
        CHECK_MSG(p->getWorkspaceSize(fixed.data(), 15, out.data(), 10) == most + seqInfo8,
            std::to_string(p->getWorkspaceSize(fixed.data(), 15, out.data(), 10)) + " vs " + std::to_string(most));
    }
    // The workspace of a long-prefill profile: a Llama-3-8B layer (32 q heads, 8 KV heads, D 128) with a profile
    // of 1..8192 tokens, 1..8 sequences and a 256-block table (32K context) was given 140,708,096 bytes (a bound on
    // T x numSplits at 8192 tokens: (8192 + 264) x 32 rows of 130 fp32). The most any step uses, with the plan of the
    // decode and prefill kernels (132 SMs x 3 CTAs; from 16 tokens a sequence may be a prefill one, so a batch-1 step
    // has at most 8 decode tiles + floor(4 T / 64) + 1 prefill tiles): 255 tokens split 2 ways (8 + 16 tiles x 8 KV
    // heads x 2 splits = 384 <= 396 slots; at 256 tokens 8 + 17 tiles leave no room for a second split).
    {
        Fields g = smolFields();
        g.set("num_heads", 32).set("num_kv_heads", 8).set("head_dim", 128);
        auto pl = create(g);
        CHECK(pl != nullptr);
        if (pl != nullptr)
        {
            std::vector<Dims> lo = {makeDims({1, 32, 128}), makeDims({1, 8, 128}), makeDims({1, 8, 128}),
                makeDims({1}), makeDims({1}), makeDims({1}), makeDims({1, 256})};
            std::vector<Dims> hi = {makeDims({8192, 32, 128}), makeDims({8192, 8, 128}), makeDims({8192, 8, 128}),
                makeDims({8}), makeDims({8}), makeDims({8}), makeDims({8, 256})};
            for (int32_t b = 0; b < kNUM_BUFFERS; ++b)
            {
                lo.push_back(bufferDims(pl->params(), b, 2048, 8));
                hi.push_back(lo.back());
            }
            auto llama = dynamicDescs(lo, hi, types);
            CHECK_MSG(pl->configurePlugin(llama.data(), 15, out.data(), 10) == 0, lastError());
            size_t const rows = 255 * 32 * 2;
            size_t const want = (rows * 128 * 4 + 255) / 256 * 256 + (rows * 2 * 4 + 255) / 256 * 256 + 256;
            size_t const got = pl->getWorkspaceSize(llama.data(), 15, out.data(), 10);
            CHECK_MSG(got == want && want == 8486656, std::to_string(got));
            std::printf("  Llama-3-8B layer, 1..8192 tokens, 1..8 sequences, 32K context: workspace %zu bytes "
                        "(was 140708096)\n", got);
        }
    }

    // Refused at build time: what the kernels cannot run (per-token keys), and dims that contradict the fields.
    Fields g = smolFields();
    g.set("key_grouping", 1);
    auto pt = create(g);
    CHECK(pt != nullptr);
    if (pt != nullptr)
    {
        auto d = smolDims(-1, -1, 64, 8, -1);
        auto m = smolDims(512, 8, 64, 8, 16);
        for (size_t b = 0; b < 8; ++b)
        {
            d[7 + b] = bufferDims(pt->params(), static_cast<int32_t>(b), 64, 8);
            m[7 + b] = d[7 + b];
        }
        auto ind = dynamicDescs(d, m, types);
        clearLastError();
        CHECK(pt->configurePlugin(ind.data(), 15, out.data(), 10) != 0);
        CHECK_MSG(contains(lastError(), "key_grouping=1"), lastError());
    }
    auto wrong = dynamicDescs(smolDims(-1, -1, 64, 8, -1), smolDims(512, 8, 64, 8, 16), types);
    wrong[7].desc.dims = makeDims({64, 3, 16, 64}); // k_codes for 4-bit keys while k_bits=2
    clearLastError();
    CHECK(p->configurePlugin(wrong.data(), 15, out.data(), 10) != 0);
    CHECK_MSG(contains(lastError(), "input k_codes has dims [64, 3, 16, 64], expected [64, 3, 8, 64]"), lastError());
}

void testEnqueueRefusesWithoutLaunching()
{
    // Unsupported combinations return an error before any CUDA call (this runs on a machine without a GPU).
    Fields f = smolFields();
    auto p = create(f);
    if (p == nullptr)
    {
        CHECK(false);
        return;
    }
    auto dims = smolDims(5, 2, 10, 4, 3);
    auto types = smolTypes(DataType::kHALF);
    std::vector<PluginTensorDesc> in(15);
    std::vector<PluginTensorDesc> out(10);
    for (size_t i = 0; i < 15; ++i)
    {
        in[i].dims = dims[i];
        in[i].type = types[i];
        in[i].format = TensorFormat::kLINEAR;
    }
    std::vector<void const*> inPtrs(15, nullptr);
    std::vector<void*> outPtrs(10, nullptr);
    in[8].type = DataType::kFLOAT; // k_scale fp32 with scale_dtype=float16
    clearLastError();
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), nullptr, nullptr) != 0);
    CHECK_MSG(contains(lastError(), "input k_scale has type float32, expected float16"), lastError());
    in[8].type = DataType::kHALF;
    in[0].dims = makeDims({5, 9, 128});
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), nullptr, nullptr) != 0);
    CHECK_MSG(contains(lastError(), "input q has dims [5, 9, 128]"), lastError());
    in[0].dims = dims[0];
    // Null device pointers: the kernels' host validation refuses them by name.
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), nullptr, nullptr) != 0);
    CHECK_MSG(contains(lastError(), "null pointer"), lastError());
    CHECK(p->onShapeChange(in.data(), 15, out.data(), 10) == 0);

    // Fake, aligned, never dereferenced device addresses: every check before the first CUDA call passes on them.
    alignas(256) static unsigned char sFake[64][256];
    for (size_t i = 0; i < 15; ++i)
    {
        inPtrs[i] = sFake[i];
    }
    outPtrs[0] = sFake[20];
    for (size_t b = 0; b < 8; ++b)
    {
        outPtrs[1 + b] = sFake[30 + b]; // separate outputs: TensorRT without aliased plugin I/O
    }
    outPtrs[9] = sFake[40];
    clearLastError();
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), sFake[50], nullptr) != 0);
    CHECK_MSG(contains(lastError(), "output k_codes") && contains(lastError(), "is not its input's buffer")
            && contains(lastError(), "never copied") && contains(lastError(), "kALIASED_PLUGIN_IO_10_03"),
        lastError());
    for (size_t b = 0; b < 8; ++b)
    {
        outPtrs[1 + b] = const_cast<void*>(inPtrs[7 + b]);
    }
    outPtrs[7] = sFake[37]; // only k_window separate: still refused, by name
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), sFake[50], nullptr) != 0);
    CHECK_MSG(contains(lastError(), "output k_window"), lastError());
    outPtrs[7] = const_cast<void*>(inPtrs[13]);
    outPtrs[9] = nullptr; // aliased buffers, no status output
    CHECK(p->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), sFake[50], nullptr) != 0);
    CHECK_MSG(contains(lastError(), "status output is a null pointer"), lastError());

    in[14].dims = makeDims({5, 3, 159, 64}); // v_window slots differ from k_window's
    CHECK(p->onShapeChange(in.data(), 15, out.data(), 10) != 0);
    CHECK_MSG(contains(lastError(), "input v_window has dims [5, 3, 159, 64], expected [4, 3, 159, 64]"), lastError());
}

class RecordingLogger : public ILogger
{
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        if (severity == Severity::kERROR)
        {
            messages.emplace_back(msg);
        }
    }
    std::vector<std::string> messages;
};

class Finder : public ILoggerFinder
{
public:
    explicit Finder(ILogger* logger)
        : mLogger(logger)
    {
    }
    ILogger* findLogger() override
    {
        return mLogger;
    }

private:
    ILogger* mLogger;
};

void testExports()
{
    int32_t n = -1;
    IPluginCreatorInterface* const* creators = getCreators(n);
    CHECK(n == 1 && creators != nullptr && creators[0] == &pluginCreator());
    auto* c = static_cast<IPluginCreatorV3One*>(creators[0]);
    CHECK(std::string(c->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE");
    CHECK(std::string(c->getPluginName()) == "KiviAttention");
    CHECK(kiviGetFormatVersion() == kFORMAT_VERSION);
    // Errors go to TensorRT's logger once setLoggerFinder gave one (stderr before).
    static RecordingLogger sLogger;
    static Finder sFinder(&sLogger);
    setLoggerFinder(&sFinder);
    expectRefused(smolFields().set("k_bits", 5), {"k_bits=5"}, __LINE__);
    CHECK(!sLogger.messages.empty() && contains(sLogger.messages.back(), "k_bits=5"));
}

int printFields()
{
    // Defaults from a default-constructed KiviAttentionParams (format.py's defaults; every field is required).
    KiviAttentionParams const defaults{};
    std::printf("[\n");
    for (size_t k = 0; k < kNB_FIELDS; ++k)
    {
        std::printf("  {\"name\": \"%s\", \"type\": \"int32\", \"length\": 1, \"required_at_build\": %s, "
                    "\"default\": %d}%s\n",
            kFIELDS[k].name, kFIELDS[k].requiredAtBuild ? "true" : "false", defaults.*kFIELDS[k].member,
            k + 1 < kNB_FIELDS ? "," : "");
    }
    std::printf("]\n");
    return 0;
}
} // namespace

int main(int argc, char** argv)
{
    if (argc > 1 && std::strcmp(argv[1], "--print-fields") == 0)
    {
        return printFields();
    }
    std::vector<std::pair<char const*, std::function<void()>>> tests = {{"identity", testIdentity},
        {"roundTrip", testRoundTrip}, {"fieldErrors", testFieldErrors}, {"typesAndAliasing", testTypesAndAliasing},
        {"shapes", testShapes}, {"configureAndWorkspace", testConfigureAndWorkspace},
        {"enqueueRefusesWithoutLaunching", testEnqueueRefusesWithoutLaunching}, {"exports", testExports}};
    for (auto const& t : tests)
    {
        int32_t const before = gFailures;
        t.second();
        std::printf("%-34s %s\n", t.first, gFailures == before ? "ok" : "FAILED");
    }
    std::printf("%d checks, %d failed\n", gChecks, gFailures);
    return gFailures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
