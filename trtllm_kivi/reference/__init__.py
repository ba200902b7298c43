"""Plain-torch executable spec of the KIVI format: quantizers, packing and the KiviAttention op."""

from .attention import KiviBuffers, append, attend, check_step, history, kivi_attention, kivi_attention_
from .kv import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from .quant import (dequantize_along, dequantize_groups, pack, pack_fragments, quantize_along, quantize_groups,
                    torch_dtype, unpack, unpack_fragments)
from .rotation import hadamard, rotate, unrotate

__all__ = [
    "KiviBuffers", "append", "attend", "check_step", "history", "kivi_attention", "kivi_attention_",
    "dequantize_keys", "dequantize_values", "quantize_keys", "quantize_values",
    "dequantize_along", "dequantize_groups", "pack", "pack_fragments", "quantize_along", "quantize_groups",
    "torch_dtype", "unpack", "unpack_fragments", "hadamard", "rotate", "unrotate",
]
