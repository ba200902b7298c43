// Helpers shared by the plugin's C++ tests.
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>
#include <vector>

namespace trtllm_kivi
{
namespace test
{

inline nvinfer1::Dims makeDims(std::vector<int64_t> const& d)
{
    nvinfer1::Dims dims{};
    dims.nbDims = static_cast<int32_t>(d.size());
    for (size_t i = 0; i < d.size(); ++i)
    {
        dims.d[i] = d[i];
    }
    return dims;
}

} // namespace test
} // namespace trtllm_kivi
