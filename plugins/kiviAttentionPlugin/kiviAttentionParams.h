/*
 * KiviAttention plugin: fields, validation and I/O checks (host only; no CUDA, no libnvinfer symbols).
 *
 * The field table kFIELDS is the C++ copy of trtllm_kivi/op.py FIELDS (same names, same order, all int32
 * scalars); tests/test_plugin_fields.py parses it from kiviAttentionParams.cpp and compares it with fields.json,
 * format.py and op.py.
 */
#pragma once

#include "NvInferRuntime.h"
#include "kiviFormat.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trtllm_kivi
{

constexpr char const* kPLUGIN_NAME{"KiviAttention"};
constexpr char const* kPLUGIN_VERSION{"1"};
constexpr char const* kPLUGIN_NAMESPACE{"trtllm_kivi"};

// Inputs: q, k, v, slot_ids, past_len, chunk_len, block_table, then the kNUM_BUFFERS cache buffers
// (format.BUFFER_NAMES order). Outputs: out, then the cache buffers aliased to inputs kIN_BUFFERS + i.
constexpr int32_t kIN_Q = 0;
constexpr int32_t kIN_K = 1;
constexpr int32_t kIN_V = 2;
constexpr int32_t kIN_SLOT_IDS = 3;
constexpr int32_t kIN_PAST_LEN = 4;
constexpr int32_t kIN_CHUNK_LEN = 5;
constexpr int32_t kIN_BLOCK_TABLE = 6;
constexpr int32_t kIN_BUFFERS = 7;
constexpr int32_t kNB_INPUTS = kIN_BUFFERS + kNUM_BUFFERS; // 15
constexpr int32_t kOUT_OUT = 0;
constexpr int32_t kOUT_BUFFERS = 1;
//! int32 [1]: the OR of the kernels' KiviErrorBits over this step's sequences (0 = every sequence ran). A sequence
//! failing a device-side check is skipped (zero output rows, cache untouched); this output makes that observable.
constexpr int32_t kOUT_STATUS = kOUT_BUFFERS + kNUM_BUFFERS; // 9
constexpr int32_t kNB_OUTPUTS = kOUT_STATUS + 1;             // 10

//! sink_tokens: tokens [0, S) of each sequence kept in full precision (attention sinks), 0 ..= kMAX_SINK_TOKENS:
//! window rows [0, S) of each slot, before the ring (the windows have S + W rows).
constexpr int32_t kMAX_SINK_TOKENS = 128;
//! k_rotation / v_rotation codes: what this layer's cached K / V were multiplied by along head_dim before the op
//! (the op is rotation-agnostic; the field records the format so a rotated cache is never read unrotated).
constexpr int32_t kROTATION_NONE = 0;
constexpr int32_t kROTATION_HADAMARD = 1;

//! The plugin's creation state: exactly the plugin fields, in serialization order.
struct KiviAttentionParams
{
    int32_t numHeads{0};
    int32_t numKvHeads{0};
    int32_t headDim{0};
    int32_t kBits{kDEFAULT_K_BITS};
    int32_t vBits{kDEFAULT_V_BITS};
    int32_t groupSize{kDEFAULT_GROUP_SIZE};
    int32_t residualLength{kDEFAULT_RESIDUAL_LENGTH};
    int32_t blockSize{kDEFAULT_BLOCK_SIZE};
    int32_t scaleDtype{kSCALE_DTYPE_FLOAT16};
    int32_t keyGrouping{kKEY_GROUPING_PER_CHANNEL};
    int32_t sinkTokens{0};
    int32_t kRotation{0};  // kROTATION_NONE
    int32_t vRotation{0};  // kROTATION_NONE
    int32_t formatVersion{kFORMAT_VERSION};

    bool operator==(KiviAttentionParams const& o) const noexcept;
};

//! One plugin field: its name, where it lives in KiviAttentionParams, and whether the build phase needs it (the
//! runtime phase needs every field). Every field is required at build too: a graph that omitted one would get the
//! member's default above, which need not be what its runner allocates the cache for (an ONNX node without
//! residual_length built with R = 128). The defaults remain format.py's, what plugin_fields writes for a default
//! KiviConfig (fields.json "default").
struct FieldSpec
{
    char const* name;
    int32_t KiviAttentionParams::*member;
    bool requiredAtBuild;
};

constexpr size_t kNB_FIELDS = 14;
extern std::array<FieldSpec, kNB_FIELDS> const kFIELDS;

//! Parse a field collection into params (defaults for absent optional fields); returns "" or an error that names
//! the field. Refuses unknown and duplicate names, non-int32 or non-scalar fields, and (runtime phase) absent ones.
std::string parseFields(
    nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase, KiviAttentionParams& params);

//! Check every field's value; returns "" or an error naming the field, its value and the allowed values.
std::string validateParams(KiviAttentionParams const& p);

//! The fields of p (pointing into p, in kFIELDS order) as getFieldsToSerialize returns them.
std::vector<nvinfer1::PluginField> fieldsOf(KiviAttentionParams const& p);

//! "num_heads=9 num_kv_heads=3 ..." (metadata string, messages).
std::string describe(KiviAttentionParams const& p);

//! Data type of the scale/zero buffers for the scale_dtype field.
nvinfer1::DataType scaleDataType(KiviAttentionParams const& p) noexcept;

//! Whether a data type is an accepted activation type (q, k, v, out, windows): fp16 or bf16.
bool isActivationType(nvinfer1::DataType t) noexcept;

//! The data type input `index` must have when the activation type is `act`.
nvinfer1::DataType expectedInputType(KiviAttentionParams const& p, int32_t index, nvinfer1::DataType act) noexcept;

//! Name of input `index` ("q", ..., "block_table", "k_codes", ...).
char const* inputName(int32_t index) noexcept;

//! Check input types: activations fp16/bf16 and equal, int32 lengths/slots/table/codes, scales per scale_dtype.
std::string checkInputTypes(KiviAttentionParams const& p, nvinfer1::DataType const* types, int32_t nbInputs);

//! Check input ranks and dims against the fields and each other. Dims < 0 (build-time wildcards) are skipped.
std::string checkInputDims(KiviAttentionParams const& p, nvinfer1::Dims const* dims, int32_t nbInputs);

//! Expected dims of cache buffer b for numBlocks / numSlots (-1 keeps that dim a wildcard).
nvinfer1::Dims bufferDims(KiviAttentionParams const& p, int32_t b, int64_t numBlocks, int64_t numSlots);

//! Element size in bytes of a data type this plugin uses (0 for others).
int32_t dataTypeSize(nvinfer1::DataType t) noexcept;

//! Product of dims (0 if any dim < 0).
int64_t volume(nvinfer1::Dims const& d) noexcept;

// ---------------------------------------------------------------------------------------------- errors and logging

//! Report an error: to the TensorRT logger found through setLoggerFinder, else to stderr; also kept as lastError().
void reportError(std::string const& msg) noexcept;

//! The last error reported on this thread ("" if none): what the C++ tests check messages against.
std::string const& lastError() noexcept;
void clearLastError() noexcept;

//! Set by setLoggerFinder (kiviAttentionPluginExports.cpp).
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

} // namespace trtllm_kivi
