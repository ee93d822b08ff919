"""compiled_mtp: Multi-Token-Prediction speculative decoding on captured torch.compile graphs."""

from .capture.profile import DEFAULT_MODEL
from .runtime import RequestOutput, Runtime, SamplingParams, StepOutput

__all__ = ["DEFAULT_MODEL", "RequestOutput", "Runtime", "SamplingParams", "StepOutput"]
__version__ = "0.1.0"
