"""Moved to trtllm_kivi.runtime.ort_session (the onnxruntime session is a runtime); re-exported for one release."""

from ..runtime.ort_session import ORT_DOMAIN, ORT_SCALE_DTYPES, ort_model, register_ops, session

__all__ = ["ORT_DOMAIN", "ORT_SCALE_DTYPES", "ort_model", "register_ops", "session"]
