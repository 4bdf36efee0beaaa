"""Serving engines: paged continuous batching, static batching baseline, and their shared parts."""

from engines.llm_engine import LLM, LLMEngine, RequestOutput
from engines.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
