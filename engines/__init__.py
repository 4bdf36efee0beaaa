"""Serving engines: the shared core (requests, KV managers, policies, the engine loop), the real model
(``engines.real``), the simulator (``engines.sim``) and the factory that assembles an engine from them.

The public offline API is exported here: ``LLM``, ``SamplingParams`` (and ``LLMEngine``, ``RequestOutput``).
"""

from engines.core.llm_engine import LLMEngine, RequestOutput
from engines.core.sampling_params import SamplingParams
from engines.llm import LLM

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
