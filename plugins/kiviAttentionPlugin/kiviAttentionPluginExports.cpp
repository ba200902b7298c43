/*
 * The entry points TensorRT looks up in a plugin library loaded with IPluginRegistry::loadLibrary
 * (trtexec --dynamicPlugins, version-compatible engines with --setPluginsToSerialize): getCreators and
 * setLoggerFinder, plus kiviGetFormatVersion for trtllm_kivi/plugin.py. No libnvinfer symbols are used.
 */
#include "kiviAttentionPluginExports.h"

#include <atomic>

namespace trtllm_kivi
{
namespace
{
std::atomic<nvinfer1::IPluginRegistry*> gStaticRegistry{nullptr};
} // namespace

KiviAttentionPluginCreator& pluginCreator()
{
    static KiviAttentionPluginCreator sCreator;
    return sCreator;
}

void noteStaticRegistration(nvinfer1::IPluginRegistry* registry) noexcept
{
    gStaticRegistry.store(registry);
}
} // namespace trtllm_kivi

extern "C" KIVI_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    nbCreators = 0;
    try
    {
        // loadLibrary registers what this returns and fails if a creator of that name is already registered: undo
        // the registration done when the library was opened, so the creator is registered once, with this handle.
        nvinfer1::IPluginRegistry* registry = trtllm_kivi::gStaticRegistry.exchange(nullptr);
        if (registry != nullptr)
        {
            registry->deregisterCreator(trtllm_kivi::pluginCreator());
        }
        static nvinfer1::IPluginCreatorInterface* const kPLUGIN_CREATOR_LIST[] = {&trtllm_kivi::pluginCreator()};
        nbCreators = 1;
        return kPLUGIN_CREATOR_LIST;
    }
    catch (...)
    {
        trtllm_kivi::reportError("KiviAttention getCreators: could not construct the plugin creator");
    }
    return nullptr;
}

extern "C" KIVI_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    trtllm_kivi::setPluginLoggerFinder(finder);
}

extern "C" KIVI_PLUGIN_API int32_t kiviGetFormatVersion()
{
    return trtllm_kivi::kFORMAT_VERSION;
}
