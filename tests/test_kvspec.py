"""runtime.kvspec.resolve_kv, the one way a KV choice is parsed and validated, from every source: the CLI flags
(commands/flags.py), a --kv-config file, a build folder's config, a Triton serving.json, the transformers adapter.

Oracles: KiviConfig built field by field (what a name and its knobs must give), and the rule that an authoritative
config (a --kv-config file, a build folder) wins while every flag that was given must agree with it; errors name
the flag and the value given first, then what is wrong, then the allowed values or what it contradicts."""

from __future__ import annotations

import argparse

import pytest

from trtllm_kivi.cli import build_parser
from trtllm_kivi.commands.flags import add_kv, kv_spec, kv_specs
from trtllm_kivi.commands.triton import serving_config
from trtllm_kivi.format import KiviConfig
from trtllm_kivi.runtime.kvspec import KVSpec, parse_kv, resolve_kv, write_kv_config
from trtllm_kivi.serving.config import ServingConfig

K4V2_B64 = KiviConfig(k_bits=4, v_bits=2, block_size=64, scale_dtype="bfloat16")


def _args(*argv: str, many: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_kv(p, default="fp16,kivi2" if many else "kivi2", many=many)
    return p.parse_args(list(argv))


def test_lists_defaults_and_knobs():
    assert [s.name for s in kv_specs(_args(many=True))] == ["fp16", "kivi2"]
    specs = kv_specs(_args("--kv", " KIVI4 , k4v2 ", "--group-size", "64", many=True))
    assert [s.name for s in specs] == ["kivi4", "k4v2"]
    assert specs[1].kivi == KiviConfig(k_bits=4, v_bits=2, group_size=64)
    with pytest.raises(ValueError, match=r"--kv ' , ' names no KV cache; allowed: KV cache: fp16"):
        kv_specs(_args("--kv", " , ", many=True))
    with pytest.raises(ValueError, match=r"--kv 'kivi2,kivi4' is not a KV cache spec; allowed: fp16"):
        kv_spec(_args("--kv", "kivi2,kivi4"))  # one cache: a list is not a name


def test_config_errors_name_what_was_given():
    with pytest.raises(ValueError, match=r"^--kv 'kivi2' --group-size 48: group_size=48 is not supported; "
                       r"allowed: 32, 64, 128$"):
        kv_spec(_args("--group-size", "48"))
    with pytest.raises(ValueError, match=r"^--kv 'kivi3': k_bits=3 is not supported; allowed: 2, 4, 8$"):
        parse_kv("kivi3")
    with pytest.raises(ValueError, match=r"^--kv 'fp16': a build needs a KIVI cache \(kivi2, .*\); fp16 is "
                       r"unquantized$"):
        resolve_kv("fp16", needs_kivi="a build")
    with pytest.raises(ValueError, match=r"KV options \['group'\] are not knobs of a KV cache spec; allowed: k_bits"):
        resolve_kv("kivi2", {"group": 64})
    with pytest.raises(ValueError, match=r"--kv 'kivi2' is an already parsed KVSpec: give the knobs \['k_bits'\]"):
        resolve_kv(parse_kv("kivi2"), {"k_bits": 4})


def test_a_kv_config_file_wins_and_flags_must_agree(tmp_path):
    path = write_kv_config(tmp_path / "kv.json", KVSpec("k4v2", kivi=K4V2_B64))
    assert kv_spec(_args("--kv-config", str(path))).kivi == K4V2_B64
    # the file's name, or a name that gives its config with the file's block size / scale dtype, agrees
    assert kv_spec(_args("--kv-config", str(path), "--kv", "K4V2", "--k-bits", "4")).kivi == K4V2_B64
    with pytest.raises(ValueError, match=rf"^--kv 'kivi2' \(kivi2 \(K 2-bit.*\)\) contradicts --kv-config {path} "
                       rf"\(kv 'k4v2': k4v2 \(K 4-bit.*\)\); give one of them$"):
        kv_spec(_args("--kv-config", str(path), "--kv", "kivi2"))
    with pytest.raises(ValueError, match=rf"^--block-size 128 contradicts --kv-config {path} \(block_size=64\)"):
        kv_spec(_args("--kv-config", str(path), "--block-size", "128"))
    # a many-spec command (eval) evaluates the file's recipe; other names are parsed with the knobs, not the file
    assert [s.name for s in kv_specs(_args("--kv-config", str(path), many=True))] == ["k4v2"]
    assert kv_specs(_args("--kv-config", str(path), many=True), kv="fp16")[0].kivi is None


def test_a_build_folder_wins_and_flags_must_agree(tmp_path):
    built = K4V2_B64
    assert kv_spec(_args(), built).kivi == built
    assert kv_spec(_args("--kv", "k4v2"), built).kivi == built  # block size and scale dtype are the folder's
    with pytest.raises(ValueError, match=r"^--scale-dtype 'float16' contradicts the build folder \(scale_dtype="
                       r"'bfloat16'\); a build folder runs the cache it was built for$"):
        kv_spec(_args("--scale-dtype", "float16"), built)
    # a --kv-config file next to a build folder must hold the folder's config
    same = write_kv_config(tmp_path / "same.json", KVSpec.of(built))
    assert kv_spec(_args("--kv-config", str(same)), built).kivi == built
    other = write_kv_config(tmp_path / "other.json", parse_kv("k4v2"))
    with pytest.raises(ValueError, match=rf"^--kv-config {other} \(kv 'k4v2'\) contradicts the build folder "
                       rf"\(kv 'k4v2': .*scales bfloat16\)\)"):
        kv_spec(_args("--kv-config", str(other)), built)


@pytest.mark.parametrize("kv, knobs", [
    ("kivi4", {}),
    ("k4v2+sink4+had:k@0-2.5/8", {"block_size": 64, "scale_dtype": "bfloat16"}),
    ("naive2", {"residual_length": 64}),
    ("fp16", {}),
])
def test_options_give_back_the_spec(kv, knobs):
    """KVSpec.options(): the knobs that, with the spec's name, give back its exact config (what serving.json
    stores)."""
    spec = parse_kv(kv, **knobs)
    assert spec.options() == knobs
    assert resolve_kv(spec.name, spec.options())[0] == spec


def test_triton_keeps_a_kv_config_files_knobs(tmp_path):
    """serving.json carries the --kv-config file's exact config (its block size and scale dtype are knobs, not part
    of the recipe name), and a bad kv in a serving config is refused when the config is made."""
    path = write_kv_config(tmp_path / "kv.json", KVSpec.of(K4V2_B64))
    args = build_parser().parse_args(["triton", "--model", "smollm2-135m", "-o", str(tmp_path / "repo"),
                                      "--kv-config", str(path)])
    cfg = serving_config(args)
    assert (cfg.kv, cfg.kv_options) == ("k4v2", {"block_size": 64, "scale_dtype": "bfloat16"})
    assert ServingConfig.from_json(cfg.to_json()).kv_spec().kivi == K4V2_B64
    with pytest.raises(ValueError, match=r"--kv 'int4' is not a KV cache spec"):
        ServingConfig(model="x", kv="int4")
    with pytest.raises(ValueError, match=r"KV options \['group'\] are not knobs"):
        ServingConfig(model="x", kv_options={"group": 64})
