"""trtllm-kivi: 2-bit KIVI KV-cache quantization for TensorRT and PyTorch."""

from .format import FORMAT_VERSION, Geometry, KiviConfig

__version__ = "0.1.0"
__all__ = ["FORMAT_VERSION", "Geometry", "KiviConfig", "__version__"]
