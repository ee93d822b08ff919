"""compiled_mtp: Multi-Token-Prediction speculative decoding on captured torch.compile graphs."""

from .runtime import RequestOutput, Runtime, SamplingParams, StepOutput

__all__ = ["Runtime", "SamplingParams", "RequestOutput", "StepOutput"]
__version__ = "0.1.0"
