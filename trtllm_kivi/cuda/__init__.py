"""CUDA path of the KIVI op: ctypes bindings of the kernel library (plugins/kernels) and its CPU model.

- `_abi`: the C ABI (library finder/loader, KiviStepParams mirror); standard library only.
- `ops`: torch wrappers (`kivi_attention_cuda_`, same contract as reference.kivi_attention_).
- CPU models of the kernels, tested against the reference without a GPU (imports point down this list):
  `model` (the step: attention, then the append kernel's flush index math and arithmetic) -> `split_model`
  (lane-level emulation of the split decode kernel, decode variants >= 2) -> `mma_model` (the baseline decode kernel,
  the tolerance both are checked with) -> `prefill_model` (the prefill attention kernel) -> `fragments` (MMA fragment
  layouts, the magic-number code conversion, the tensor-core product) and `launch` (the launch plan and the prepare
  kernel) -> `variants` (the decode variants and the plan table).
"""

from ._abi import KiviLibrary, KiviStepParams, find_library, load_library


def is_available() -> bool:
    """True when torch sees a CUDA device and the kernel library file exists (nothing is loaded)."""
    import torch
    return torch.cuda.is_available() and find_library() is not None


__all__ = ["KiviLibrary", "KiviStepParams", "find_library", "load_library", "is_available"]
