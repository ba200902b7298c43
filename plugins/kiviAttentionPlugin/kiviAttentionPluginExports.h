/*
 * Library entry points and the one creator instance shared by getCreators and the load-time registration.
 */
#pragma once

#include "kiviAttentionPlugin.h"

#include "NvInferRuntime.h"

//! Exported from the library (TensorRT's TENSORRTAPI is empty outside TensorRT's own build).
#define KIVI_PLUGIN_API __attribute__((visibility("default")))

namespace trtllm_kivi
{
//! The library's creator (one instance for both ways of registering it).
KiviAttentionPluginCreator& pluginCreator();

//! Called by the load-time registrar (kiviAttentionPluginRegistration.cpp) after it registered pluginCreator().
void noteStaticRegistration(nvinfer1::IPluginRegistry* registry) noexcept;
} // namespace trtllm_kivi

//! loadLibrary protocol: the creators of this library (withdraws the load-time registration first).
extern "C" KIVI_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
//! loadLibrary protocol: where to find TensorRT's logger for error messages.
extern "C" KIVI_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
//! FORMAT_VERSION (kiviFormat.h) this library was built for: trtllm_kivi/plugin.py checks it on load.
extern "C" KIVI_PLUGIN_API int32_t kiviGetFormatVersion();
