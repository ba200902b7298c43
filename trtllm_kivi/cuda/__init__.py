"""CUDA path of the KIVI op: ctypes bindings of the kernel library (plugins/kernels) and its CPU model.

- `_abi`: the C ABI (library finder/loader, KiviStepParams mirror); standard library only.
- `ops`: torch wrappers (`kivi_attention_cuda_`, same contract as reference.kivi_attention_).
- `model`: a CPU-executable model of the kernels' decomposition (tiles, splits, partial softmax, combine, the
  magic-number code conversion, the flush index math), tested against the reference without a GPU.
"""

from ._abi import KiviLibrary, KiviStepParams, find_library, load_library


def is_available() -> bool:
    """True when torch sees a CUDA device and the kernel library file exists (nothing is loaded)."""
    import torch
    return torch.cuda.is_available() and find_library() is not None


__all__ = ["KiviLibrary", "KiviStepParams", "find_library", "load_library", "is_available"]
