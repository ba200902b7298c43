"""The KiviAttention plugin's field spec agrees everywhere: plugins/kiviAttentionPlugin/fields.json, the C++ field
table (kiviAttentionParams.cpp/.h), trtllm_kivi/plugin.py and trtllm_kivi/format.py.

Oracle: format.py (constants, KiviConfig defaults and validation) and plugin.py (field names and order). The C++
side is read from its source (always) and, when the creator test binary was built with TensorRT headers, from the
binary's --print-fields output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from trtllm_kivi import format as fmt
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.cuda import _abi
from trtllm_kivi.op import (FIELD_NAMES, MAX_SINK_TOKENS, PLUGIN_NAME, PLUGIN_NAMESPACE,
                            PLUGIN_VERSION, ROTATIONS, STATUS_BITS, STATUS_OUTPUT, config_from_fields,
                            describe_status, plugin_fields, rotations_from_fields)

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "plugins" / "kiviAttentionPlugin"
SPEC = json.loads((PLUGIN_DIR / "fields.json").read_text())
SPEC_FIELDS = {f["name"]: f for f in SPEC["fields"]}
GEOMETRY = ("num_heads", "num_kv_heads", "head_dim")


def test_identity_and_version():
    assert SPEC["plugin"] == {"name": PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE,
                              "interface": "IPluginV3"}
    assert SPEC["format_version"] == fmt.FORMAT_VERSION


def test_names_order_and_types():
    assert [f["name"] for f in SPEC["fields"]] == list(FIELD_NAMES)
    for f in SPEC["fields"]:
        assert (f["type"], f["length"]) == ("int32", 1), f["name"]


def test_defaults_are_format_defaults():
    # plugin_fields of a default KiviConfig is what the exporter writes for a default cache.
    # Every field is required at build too (a graph without residual_length must not build with a default).
    expected = plugin_fields(KiviConfig(), num_heads=9, num_kv_heads=3, head_dim=64)
    for name in FIELD_NAMES:
        f = SPEC_FIELDS[name]
        assert f["required_at_build"] is True, name
        assert f["default"] == (None if name in GEOMETRY else expected[name]), name
    assert SPEC_FIELDS["format_version"]["default"] == fmt.FORMAT_VERSION


def test_allowed_values_are_format_constants():
    allowed = {n: f["allowed"] for n, f in SPEC_FIELDS.items()}
    assert allowed["k_bits"]["values"] == list(fmt.SUPPORTED_BITS)
    assert allowed["v_bits"]["values"] == list(fmt.SUPPORTED_BITS)
    assert allowed["group_size"]["values"] == list(fmt.SUPPORTED_GROUP_SIZES)
    assert allowed["head_dim"]["values"] == list(fmt.SUPPORTED_HEAD_DIMS)
    assert allowed["scale_dtype"] == {"values": list(range(len(fmt.SUPPORTED_SCALE_DTYPES))),
                                      "names": list(fmt.SUPPORTED_SCALE_DTYPES)}
    assert allowed["key_grouping"] == {"values": list(range(len(fmt.SUPPORTED_KEY_GROUPINGS))),
                                       "names": list(fmt.SUPPORTED_KEY_GROUPINGS)}
    assert allowed["format_version"]["values"] == [fmt.FORMAT_VERSION]
    assert allowed["sink_tokens"] == {"min": 0, "max": MAX_SINK_TOKENS}
    for name in ("k_rotation", "v_rotation"):
        assert allowed[name] == {"values": list(range(len(ROTATIONS))), "names": list(ROTATIONS)}
    assert allowed["residual_length"]["min"] == 0
    assert allowed["block_size"] == {"min": 1, "multiple_of_field": "group_size"}
    assert allowed["num_heads"] == {"min": 1, "multiple_of_field": "num_kv_heads"}


def test_allowed_values_round_trip_through_plugin_py():
    # Every allowed value is accepted by plugin.py's config_from_fields (the Python reader of the same fields);
    # the first value outside each list is refused with a message naming the field.
    base = plugin_fields(KiviConfig(), 9, 3, 64)
    for name in ("k_bits", "v_bits", "group_size", "scale_dtype", "key_grouping", "k_rotation", "v_rotation",
                 "head_dim"):
        values = SPEC_FIELDS[name]["allowed"]["values"]
        for v in values:
            fields = dict(base, **{name: v})
            if name == "group_size":
                fields["block_size"] = 128  # a multiple of every allowed G
            cfg, _, _, d = config_from_fields(fields)
            assert (d if name == "head_dim" else fields[name]) == v
        bad = max(values) + 1
        if name == "head_dim":
            continue  # plugin.py's reader accepts any multiple of 32 (torch reference); the C++ creator refuses 65+
        with pytest.raises(ValueError, match=name):
            config_from_fields(dict(base, **{name: bad}))


def test_sink_and_rotation_fields_round_trip_per_layer_and_refusals():
    # FORMAT_VERSION 2: sink_tokens and each node's layer's rotation codes (0 = none, 1 = hadamard) come from the
    # KiviConfig (rotation per layer, for K and V separately) and are read back into it.
    assert FIELD_NAMES[-4:] == ("sink_tokens", "k_rotation", "v_rotation", "format_version")
    assert ROTATIONS == fmt.SUPPORTED_ROTATIONS and MAX_SINK_TOKENS == fmt.MAX_SINK_TOKENS
    cfg = KiviConfig(sink_tokens=4, k_rotation=("none", "hadamard"), v_rotation="hadamard")
    f0, f1 = plugin_fields(cfg, 9, 3, 64, layer=0), plugin_fields(cfg, 9, 3, 64, layer=1)
    assert list(f0) == list(FIELD_NAMES)
    assert (f0["sink_tokens"], f0["k_rotation"], f0["v_rotation"]) == (4, 0, 1)
    assert (f1["k_rotation"], f1["v_rotation"]) == (1, 1)
    assert rotations_from_fields(f0) == ("none", "hadamard")
    assert config_from_fields(f1)[0] == cfg.for_layer(1)  # a rotated cache's config is never read unrotated
    with pytest.raises(ValueError, match=r"sink_tokens=129 must be an integer in \[0, 128\]"):
        config_from_fields(dict(f0, sink_tokens=129))
    with pytest.raises(ValueError, match=r"k_rotation=2 is not supported; allowed: 0..1 \(none, hadamard\)"):
        config_from_fields(dict(f0, k_rotation=2))
    with pytest.raises(ValueError, match="v_rotation=2"):
        rotations_from_fields(dict(f0, v_rotation=2))


def test_status_bits_are_the_kernels_error_bits():
    # op.py names the bits the plugin's status output carries: kiviParams.h's KiviErrorBits (via _abi).
    assert STATUS_BITS.keys() == {_abi.ERR_LENGTH, _abi.ERR_CAPACITY, _abi.ERR_SLOT, _abi.ERR_BLOCK_ID}
    header = (ROOT / "plugins" / "kernels" / "include" / "kiviParams.h").read_text()
    assert dict(re.findall(r"(kKIVI_ERR_\w+) = (\d+),", header)) == {
        "kKIVI_ERR_LENGTH": "1", "kKIVI_ERR_CAPACITY": "2", "kKIVI_ERR_SLOT": "4", "kKIVI_ERR_BLOCK_ID": "8"}
    assert describe_status(0) == "none"
    assert describe_status(_abi.ERR_CAPACITY | _abi.ERR_SLOT) == f"{STATUS_BITS[2]}, {STATUS_BITS[4]}"
    assert describe_status(16 | 1) == f"{STATUS_BITS[1]}, unknown bits 0x10"


def test_io_spec_matches_buffer_order():
    head = ["q", "k", "v", "slot_ids", "past_len", "chunk_len", "block_table"]
    assert [i["name"] for i in SPEC["inputs"]] == head + list(fmt.BUFFER_NAMES)
    assert [o["name"] for o in SPEC["outputs"]] == ["out"] + list(fmt.BUFFER_NAMES) + [STATUS_OUTPUT]
    assert [o["aliased_input"] for o in SPEC["outputs"]] == ([None] + list(range(7, 7 + len(fmt.BUFFER_NAMES)))
                                                             + [None])
    assert SPEC["outputs"][-1] | {"doc": ""} == {"name": "status", "dtype": "int32", "shape": [1],
                                                 "aliased_input": None, "doc": ""}
    # Buffer dtypes as format.buffer_dtypes names them ("act" = activation, "scale" = scale_dtype).
    dtypes = fmt.buffer_dtypes(KiviConfig(scale_dtype="bfloat16"), "float16")
    symbolic = {"int32": "int32", "bfloat16": "scale", "float16": "act"}
    for spec in SPEC["inputs"][len(head):]:
        assert spec["dtype"] == symbolic[dtypes[spec["name"]]], spec["name"]
    assert SPEC["activation_dtypes"] == ["float16", "bfloat16"]


# ---------------------------------------------------------------------------------------------- the C++ side


def _cpp_constants() -> dict[str, int]:
    """kiviFormat.h's integer constants (generated from format.py; tests/test_format.py checks that)."""
    text = (ROOT / "plugins" / "include" / "kiviFormat.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"constexpr int32_t (\w+) = (-?\d+);", text)}


def _cpp_field_table() -> list[tuple[str, str, bool]]:
    """(field name, KiviAttentionParams member, required at build) from the table in kiviAttentionParams.cpp."""
    text = (PLUGIN_DIR / "kiviAttentionParams.cpp").read_text()
    table = text.split("// BEGIN FIELD TABLE", 1)[1].split("// END FIELD TABLE", 1)[0]
    rows = re.findall(r'\{"(\w+)", &KiviAttentionParams::(\w+), (true|false)\}', table)
    assert len(rows) == table.count("&KiviAttentionParams::"), "unparsed rows in the C++ field table"
    return [(name, member, req == "true") for name, member, req in rows]


def _cpp_member_defaults() -> dict[str, int]:
    """Default member initializers of KiviAttentionParams (kiviAttentionParams.h), resolved through kiviFormat.h."""
    text = (PLUGIN_DIR / "kiviAttentionParams.h").read_text()
    body = text.split("struct KiviAttentionParams", 1)[1].split("bool operator==", 1)[0]
    consts = _cpp_constants()
    out = {}
    for member, init in re.findall(r"int32_t (\w+)\{([^}]*)\};", body):
        out[member] = int(init) if re.fullmatch(r"-?\d+", init) else consts[init]
    return out


def test_cpp_field_table_matches_spec():
    table = _cpp_field_table()
    assert [name for name, _, _ in table] == list(FIELD_NAMES)
    defaults = _cpp_member_defaults()
    for name, member, required in table:
        spec = SPEC_FIELDS[name]
        assert required == spec["required_at_build"], name
        if spec["default"] is not None:
            assert defaults[member] == spec["default"], name
    # The creator's allowed lists come from kiviFormat.h.
    consts = _cpp_constants()
    assert consts["kFORMAT_VERSION"] == SPEC_FIELDS["format_version"]["default"]
    assert consts["kSCALE_DTYPE_FLOAT32"] == len(fmt.SUPPORTED_SCALE_DTYPES) - 1
    assert consts["kKEY_GROUPING_PER_TOKEN"] == len(fmt.SUPPORTED_KEY_GROUPINGS) - 1
    # The plugin's own constants for the sink and rotation fields (kiviAttentionParams.h) and its output count.
    header = (PLUGIN_DIR / "kiviAttentionParams.h").read_text()
    plugin_consts = {m[1]: m[2] for m in re.finditer(r"constexpr int32_t (\w+) = ([^;]+);", header)}
    assert int(plugin_consts["kMAX_SINK_TOKENS"]) == MAX_SINK_TOKENS
    assert [int(plugin_consts[f"kROTATION_{n.upper()}"]) for n in ROTATIONS] == list(range(len(ROTATIONS)))
    assert plugin_consts["kOUT_STATUS"] == "kOUT_BUFFERS + kNUM_BUFFERS"
    assert plugin_consts["kNB_OUTPUTS"] == "kOUT_STATUS + 1"


def test_cpp_input_names_match_spec():
    text = (PLUGIN_DIR / "kiviAttentionParams.cpp").read_text()
    array = re.search(r"kINPUT_NAMES\[kNB_INPUTS\] = \{(.*?)\};", text, re.S)[1]
    assert re.findall(r'"(\w+)"', array) == [i["name"] for i in SPEC["inputs"]]


def _creator_test_binary() -> Path | None:
    for build in (os.environ.get("TRTLLM_KIVI_PLUGIN_BUILD_DIR"), ROOT / "build" / "plugins"):
        if build and (Path(build) / "kiviAttentionPlugin" / "kiviAttentionPluginTest").is_file():
            return Path(build) / "kiviAttentionPlugin" / "kiviAttentionPluginTest"
    return None


@pytest.mark.skipif(_creator_test_binary() is None,
                    reason="kiviAttentionPluginTest not built (build_scripts/build_plugin.sh needs TensorRT headers)")
def test_cpp_binary_prints_spec_fields():
    out = subprocess.run([str(_creator_test_binary()), "--print-fields"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    printed = json.loads(out)
    assert [f["name"] for f in printed] == list(FIELD_NAMES)
    for f in printed:
        spec = SPEC_FIELDS[f["name"]]
        assert (f["type"], f["length"], f["required_at_build"]) == ("int32", 1, spec["required_at_build"])
        if spec["default"] is not None:
            assert f["default"] == spec["default"], f["name"]
