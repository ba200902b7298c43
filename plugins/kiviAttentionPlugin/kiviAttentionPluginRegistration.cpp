/*
 * Load-time registration of the KiviAttention creator (what REGISTER_TENSORRT_PLUGIN does), in a file of its own:
 * the creator tests link everything else.
 *
 * REGISTER_TENSORRT_PLUGIN calls libnvinfer's getPluginRegistry() directly, which leaves an undefined symbol that
 * only resolves when libnvinfer is in the global scope. The tensorrt Python module loads libnvinfer RTLD_LOCAL, so
 * this registrar looks the function up at load time instead: in the global scope, then in an already-loaded
 * libnvinfer.so.<major>. Without TensorRT in the process it registers nothing (and links, loads and logs nothing).
 * When the library is opened by IPluginRegistry::loadLibrary, getCreators withdraws this registration.
 */
#include "kiviAttentionPluginExports.h"

#include "NvInferVersion.h"

#include <dlfcn.h>

#include <string>

namespace trtllm_kivi
{
namespace
{
using GetPluginRegistryFn = nvinfer1::IPluginRegistry* (*) ();

nvinfer1::IPluginRegistry* findPluginRegistry() noexcept
{
    void* symbol = dlsym(RTLD_DEFAULT, "getPluginRegistry");
    if (symbol == nullptr)
    {
        std::string const soname = "libnvinfer.so." + std::to_string(NV_TENSORRT_MAJOR);
        void* handle = dlopen(soname.c_str(), RTLD_LAZY | RTLD_NOLOAD); // only if already loaded
        if (handle != nullptr)
        {
            symbol = dlsym(handle, "getPluginRegistry");
            dlclose(handle); // drops the reference RTLD_NOLOAD took; the library stays loaded
        }
    }
    return symbol != nullptr ? reinterpret_cast<GetPluginRegistryFn>(symbol)() : nullptr;
}

class KiviAttentionPluginRegistrar
{
public:
    KiviAttentionPluginRegistrar() noexcept
    {
        try
        {
            nvinfer1::IPluginRegistry* registry = findPluginRegistry();
            if (registry != nullptr && registry->registerCreator(pluginCreator(), kPLUGIN_NAMESPACE))
            {
                noteStaticRegistration(registry);
            }
        }
        catch (...)
        {
            reportError("KiviAttention: registering the plugin creator failed");
        }
    }
};

KiviAttentionPluginRegistrar const gKiviAttentionPluginRegistrar{};
} // namespace
} // namespace trtllm_kivi
