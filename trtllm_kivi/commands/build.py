"""`trtllm-kivi build`: compile a Llama checkpoint into a build folder: an ONNX graph whose attentions are
KiviAttention nodes (+ external weights, tokenizer, build config), checked on the CPU with onnxruntime against the
torch runtime, and a TensorRT engine when a TensorRT builder (NVIDIA's TensorRT or TensorRT-RTX) and the plugin library
are present."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ..builder.build import BuildOptions, build
from . import flags

NAME = "build"
HELP = "compile a Llama checkpoint into an ONNX graph with KiviAttention nodes (+ TensorRT engine when available)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="build folder to write")
    flags.add_dtype(p, "float16", "activation dtype of the graph/engine")
    flags.add_capacity(p, 4, 2048, None, None)
    p.add_argument("--max-num-tokens", type=int, help="tokens per step, all sequences (default: --max-seq-len)")
    p.add_argument("--check-steps", type=int, default=64, help="decode steps of the onnxruntime check against "
                   "the torch runtime (default 64; 0 skips the check)")
    p.add_argument("--plugin-lib", help="KiviAttention plugin library for the engine (default: "
                   "$TRTLLM_KIVI_PLUGIN_LIB, build/plugins/ or build/plugins-rtx/)")
    p.add_argument("--tensorrt", choices=("auto", "on", "off"), default="auto",
                   help="the TensorRT engine: auto builds it when a TensorRT builder and the plugin library are here "
                        "and says why not otherwise; on fails with the reason instead; off never builds it "
                        "(default auto)")
    p.add_argument("--compute-capability", metavar="CC[,CC...]",
                   help="TensorRT-RTX targets, e.g. 8.6 or 8.0,12.0 (default: the GPU here, else 8.0,8.6,8.9,12.0,"
                        "12.1); NVIDIA's TensorRT builds for the GPU it runs on")
    p.add_argument("--force", action="store_true", help="replace an existing different build in DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    flags.add_kv(p)


def run(args: argparse.Namespace) -> int:
    kv = flags.kv_spec(args, needs_kivi="a build (its attention is the KiviAttention plugin)")
    assert kv.kivi is not None  # needs_kivi
    opts = BuildOptions(output=Path(args.output), model=args.model, kivi=kv.kivi, dtype=args.dtype,
                        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                        max_num_tokens=args.max_num_tokens, force=args.force, check_steps=args.check_steps,
                        plugin_lib=args.plugin_lib, tensorrt=args.tensorrt,
                        compute_capability=args.compute_capability.split(",") if args.compute_capability else None)
    # SIGTERM -> SystemExit, so the build's cleanup runs and no half-written folder is left.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        cfg = build(opts, progress=not args.quiet)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = Path(args.output)
    print(f"[build] {out}: {kv.describe()}, {cfg['dtype']} graph, max batch {cfg['maxima']['max_batch_size']}, "
          f"max seq len {cfg['maxima']['max_seq_len']}, max tokens/step {cfg['maxima']['max_num_tokens']}")
    for name in sorted(p.name for p in out.iterdir()):
        print(f"  {name:24s} {(out / name).stat().st_size:>12,d} bytes")
    chk = cfg["check"]
    if chk.get("skipped"):
        print("[check] skipped (--check-steps 0)")
    else:
        print(f"[check] onnxruntime vs torch runtime over a prefill of {chk['prefill_tokens']} tokens + "
              f"{chk['decode_steps']} decode steps (fp32 copy of the graph, weights rounded to {cfg['dtype']}): "
              f"max |logit diff| {chk['max_logit_diff']:.3g} (prefill {chk['max_logit_diff_prefill']:.3g}, decode "
              f"{chk['max_logit_diff_decode']:.3g}; logits up to {chk['max_logit_abs']:.3g}), greedy agreement "
              f"{chk['greedy_agreement']:.0%}, cache: {chk['code_words_differing']}/{chk['code_words']} code words "
              f"differ, scale/zero rel. diff {chk['scale_zero_rel_diff']:.3g}, window rel. diff "
              f"{chk['window_rel_diff']:.3g}, quantized tokens {chk['quantized_tokens']}: "
              f"{'PASSED' if chk['passed'] else 'FAILED'} (tolerance {chk['tolerances']['logit_atol']})")
    eng = cfg["engine"]
    if eng["built"]:
        flavour = "TensorRT-RTX" if eng.get("flavour") == "tensorrt_rtx" else "TensorRT"
        print(f"[engine] {out / eng['engine']} ({eng['bytes']:,d} bytes, {flavour} {eng['tensorrt']}, compute "
              f"capability {', '.join(eng.get('targets', []))}, {eng.get('seconds', 0):.1f} s, plugin embedded)")
    elif eng["reason"] == "--tensorrt off":
        print("[engine] not built (--tensorrt off). To build it on a TensorRT machine:\n  " + eng["trtexec"])
    else:
        print(f"[engine] not built: {eng['reason']}. To build it on a TensorRT machine:\n  {eng['trtexec']}")
    print(f"[run] trtllm-kivi run --engine {out} --prompt \"...\"")
    return 0
