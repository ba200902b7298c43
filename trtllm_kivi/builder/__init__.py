"""Builder: compact Llama -> ONNX graph with KiviAttention nodes -> (with TensorRT) an engine; the CPU check runs the
graph with onnxruntime against the torch runtime.

    export_llama(model, cfg, op.ExportSpec(dtype, max_batch_size, max_seq_len, max_num_tokens)) -> onnx.ModelProto
    save_model(graph, path)                   graph + weights as external data (path + ".data")
    check_graph(model, graph, prompts, decode_steps) -> CheckResult   onnxruntime vs torch runtime
    build(BuildOptions(output=DIR, ...)) -> dict                      `trtllm-kivi build` (atomic folder)
    build_engine(onnx_path, engine_path, plugin_lib, spec, cfg)       TensorRT (where installed)
    trtexec_command(...)                      the same build as a trtexec line
"""

from .onnx_export import export_llama, graph_info, save_model

__all__ = ["export_llama", "graph_info", "save_model"]
