/*
 * Registration tests of the built libtrtllm_kivi_plugin.so, without libnvinfer: this program defines
 * getPluginRegistry() itself (exported with -rdynamic, as libnvinfer would be in a TensorRT process) and returns a
 * registry that follows IPluginRegistry's documented contract (NvInferRuntimeCommon.h): registerCreator refuses a
 * second creator of the same namespace/name/version, and loadLibrary opens the library, calls getCreators and
 * "fails and returns nullptr if any of the plugins are already registered".
 *
 *   kiviAttentionPluginLoadTest LIB dlopen-then-loadLibrary   ctypes-style load (load-time registration), then
 *                                                              IPluginRegistry::loadLibrary on the same library
 *   kiviAttentionPluginLoadTest LIB loadLibrary                 loadLibrary first (trtexec --dynamicPlugins)
 * Either way the creator must end up registered exactly once and create a plugin. Exit code 0 = passed.
 */
#include "NvInferRuntime.h"
#include "NvInferVersion.h"
#include "kiviFormat.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{
int32_t gFailures = 0;

void check(bool ok, char const* what, int line)
{
    if (!ok)
    {
        ++gFailures;
        std::fprintf(stderr, "FAIL (line %d): %s\n", line, what);
    }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

std::string keyOf(IPluginCreatorInterface const& c, char const* ns)
{
    auto const& v3 = static_cast<IPluginCreatorV3One const&>(c);
    return std::string(ns) + "::" + v3.getPluginName() + "/" + v3.getPluginVersion();
}

class FakeRegistry : public IPluginRegistry
{
public:
    struct Entry
    {
        IPluginCreatorInterface* creator;
        std::string key;
    };
    std::vector<Entry> entries;
    int32_t registerCalls{0};
    int32_t deregisterCalls{0};

    void setErrorRecorder(IErrorRecorder* const) noexcept override {}
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool isParentSearchEnabled() const override
    {
        return false;
    }
    void setParentSearchEnabled(bool const) override {}
    PluginLibraryHandle loadLibrary(AsciiChar const* pluginPath) noexcept override
    {
        void* handle = dlopen(pluginPath, RTLD_LAZY | RTLD_LOCAL);
        if (handle == nullptr)
        {
            std::fprintf(stderr, "loadLibrary: %s\n", dlerror());
            return nullptr;
        }
        using GetCreators = IPluginCreatorInterface* const* (*) (int32_t&);
        auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
        if (getCreators == nullptr)
        {
            return nullptr;
        }
        int32_t n = 0;
        IPluginCreatorInterface* const* creators = getCreators(n);
        for (int32_t i = 0; i < n; ++i)
        {
            auto const& v3 = static_cast<IPluginCreatorV3One const&>(*creators[i]);
            if (!registerCreator(*creators[i], v3.getPluginNamespace()))
            {
                return nullptr; // "fails if any of the plugins are already registered"
            }
        }
        return handle;
    }
    void deregisterLibrary(PluginLibraryHandle) noexcept override {}
    bool registerCreator(IPluginCreatorInterface& creator, AsciiChar const* const pluginNamespace) noexcept override
    {
        ++registerCalls;
        std::string const key = keyOf(creator, pluginNamespace);
        for (auto const& e : entries)
        {
            if (e.key == key)
            {
                return false;
            }
        }
        entries.push_back({&creator, key});
        return true;
    }
    IPluginCreatorInterface* const* getAllCreators(int32_t* const numCreators) const noexcept override
    {
        *numCreators = static_cast<int32_t>(entries.size());
        return nullptr;
    }
    IPluginCreatorInterface* getCreator(AsciiChar const* const pluginName, AsciiChar const* const pluginVersion,
        AsciiChar const* const pluginNamespace) noexcept override
    {
        std::string const key = std::string(pluginNamespace) + "::" + pluginName + "/" + pluginVersion;
        for (auto const& e : entries)
        {
            if (e.key == key)
            {
                return e.creator;
            }
        }
        return nullptr;
    }
    bool deregisterCreator(IPluginCreatorInterface const& creator) noexcept override
    {
        ++deregisterCalls;
        for (auto it = entries.begin(); it != entries.end(); ++it)
        {
            if (it->creator == &creator)
            {
                entries.erase(it);
                return true;
            }
        }
        return false;
    }
    IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override
    {
        return nullptr;
    }
    int32_t releasePluginResource(AsciiChar const*) noexcept override
    {
        return 0;
    }
#if NV_TENSORRT_MAJOR > 10 || NV_TENSORRT_MINOR >= 10
    IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const numCreators) noexcept override
    {
        *numCreators = static_cast<int32_t>(entries.size());
        return nullptr;
    }
#endif
#if NV_TENSORRT_MAJOR < 11
    // TensorRT 10's registry still declares the IPluginV2 creator API (deprecated; unused by this plugin).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    bool registerCreator(IPluginCreator&, AsciiChar const* const) noexcept override
    {
        return false;
    }
    IPluginCreator* const* getPluginCreatorList(int32_t* const numCreators) const noexcept override
    {
        *numCreators = 0;
        return nullptr;
    }
    IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept
        override
    {
        return nullptr;
    }
    bool deregisterCreator(IPluginCreator const&) noexcept override
    {
        return false;
    }
#pragma GCC diagnostic pop
#endif
};

FakeRegistry gRegistry;

//! The registered KiviAttention creator builds a plugin from the SmolLM2 fields (op.py plugin_fields of a default
//! KiviConfig: every field is required).
bool createsPlugin()
{
    auto* creator = static_cast<IPluginCreatorV3One*>(gRegistry.getCreator("KiviAttention", "1", "trtllm_kivi"));
    if (creator == nullptr)
    {
        return false;
    }
    char const* names[] = {"num_heads", "num_kv_heads", "head_dim", "k_bits", "v_bits", "group_size",
        "residual_length", "block_size", "scale_dtype", "key_grouping", "sink_tokens", "k_rotation", "v_rotation",
        "format_version"};
    using namespace trtllm_kivi;
    int32_t const values[] = {9, 3, 64, kDEFAULT_K_BITS, kDEFAULT_V_BITS, kDEFAULT_GROUP_SIZE,
        kDEFAULT_RESIDUAL_LENGTH, kDEFAULT_BLOCK_SIZE, kSCALE_DTYPE_FLOAT16, kKEY_GROUPING_PER_CHANNEL,
        kDEFAULT_SINK_TOKENS, 0, 0, kFORMAT_VERSION};
    std::vector<PluginField> fields;
    for (int32_t i = 0; i < 14; ++i)
    {
        fields.emplace_back(names[i], &values[i], PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection fc{14, fields.data()};
    IPluginV3* plugin = creator->createPlugin("layer", &fc, TensorRTPhase::kBUILD);
    bool const ok = plugin != nullptr
        && std::strcmp(static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE))
                           ->getPluginName(),
               "KiviAttention")
            == 0;
    delete plugin;
    return ok;
}
} // namespace

//! What libnvinfer exports; the plugin library's registrar finds this one through dlsym(RTLD_DEFAULT).
extern "C" __attribute__((visibility("default"))) IPluginRegistry* getPluginRegistry() noexcept
{
    return &gRegistry;
}

int main(int argc, char** argv)
{
    if (argc != 3)
    {
        std::fprintf(stderr, "usage: %s LIB dlopen-then-loadLibrary|loadLibrary\n", argv[0]);
        return 2;
    }
    std::string const mode = argv[2];
    if (mode == "dlopen-then-loadLibrary")
    {
        void* h = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL); // what ctypes.CDLL(path, RTLD_GLOBAL) does
        CHECK(h != nullptr);
        CHECK(gRegistry.entries.size() == 1); // registered on load
        CHECK(createsPlugin());
    }
    else if (mode != "loadLibrary")
    {
        std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
        return 2;
    }
    void* handle = gRegistry.loadLibrary(argv[1]);
    CHECK(handle != nullptr); // no "already registered" failure
    CHECK(gRegistry.entries.size() == 1);
    CHECK(gRegistry.deregisterCalls == 1); // the load-time registration was withdrawn once
    CHECK(createsPlugin());
    std::printf("%s: %d registrations, %d withdrawals, %zu registered: %s\n", mode.c_str(), gRegistry.registerCalls,
        gRegistry.deregisterCalls, gRegistry.entries.size(), gFailures == 0 ? "ok" : "FAILED");
    return gFailures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
