"""Workload traces: load public LLM-serving traces (and synthetic ones) into one request list.

Every loader returns a list of :class:`TraceRequest`, sorted by arrival, with arrivals in seconds from the
first request (the first is at 0.0). Formats (``load_trace(format, path, **kwargs)``), one module each:

=========== ===================================================================================================
``azure``    Azure LLM inference trace 2023 CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (datetime strings)
``mooncake`` Mooncake JSONL ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token
             prefix blocks, replayed as deterministic token ids so shared prefixes share ids)
``burstgpt`` BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` (s)
``sharegpt`` ShareGPT JSON ``[{id, conversations: [{from, value}]}]``: first human turn is the prompt text
``vidur``    Vidur CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (s), or sarathi-serve's lengths CSV
             ``num_prefill_tokens,num_decode_tokens,...`` without arrivals (all at 0)
``apex``     APEX+ JSONL ``StartTimeOffset`` (ns), ``ContextTokens``, ``GeneratedTokens`` (or ``InputTokens``,
             ``OutputTokens`` and other spellings); loadable and inspectable, not yet a scenario format
``synthetic`` Poisson/gamma arrivals at a rate, lengths fixed, uniform, lognormal or drawn from a lengths CSV
=========== ===================================================================================================

Every bad input raises :class:`TraceError` with one line ``<file>:<line>: <what is wrong>`` (values from
the file cut to 80 characters). Every loader takes ``stats=`` (a :class:`LoadStats` it fills: rows read,
loaded, skipped, changed and warned per reason, rows out of arrival order) and ``strict=`` (a row it would
change, warn about or re-order is then an error). A recorded output of 0 tokens is replayed as 1 token.
:func:`iter_trace` streams a file (azure, vidur, mooncake row by row) in arrival order; :mod:`~workbench.traces.day`
makes a day of traffic from a shorter trace (``repeat`` copies, or ``synthesize_day``).
Then :func:`apply_transforms` cuts, samples, rescales time and lengths; :func:`trace_stats` summarises;
:func:`ensure_prompt_ids` gives prompts that only have a length deterministic token ids.

Modules: ``common`` (the request type, the error, the load report, CSV/JSONL and value parsers,
:data:`BUILTIN_TRACE_DIR`), ``ids`` (prompt-id synthesis), one per format, ``formats`` (:func:`load_trace`),
``transforms``, ``summary``, ``rows`` (a parsed row), ``stream`` (:func:`iter_trace`), ``day`` (repeat,
synthesized days) and ``prefix`` (a trace's ideal prefix-cache hit rate and the shared-prefix trace
generator; imported from ``workbench.traces.prefix``, not re-exported here, as it needs ``engines``).
"""

from workbench.traces.apex import load_apex
from workbench.traces.azure import load_azure
from workbench.traces.burstgpt import load_burstgpt
from workbench.traces.common import BUILTIN_TRACE_DIR, LoadStats, TraceError, TraceRequest
from workbench.traces.day import repeat_requests, repeat_stream, synthesize_day
from workbench.traces.formats import EXTRA_FORMATS, FORMATS, load_trace
from workbench.traces.ids import (DEFAULT_VOCAB_HI, DEFAULT_VOCAB_LO, MOONCAKE_BLOCK_TOKENS, ensure_prompt_ids,
                                  mooncake_prompt_ids, synthesize_prompt_ids)
from workbench.traces.mooncake import load_mooncake
from workbench.traces.sharegpt import load_sharegpt
from workbench.traces.stream import STREAMED_FORMATS, iter_trace
from workbench.traces.summary import trace_stats, trace_stats_arrays
from workbench.traces.synthetic import LENGTH_DISTS, load_synthetic, synthetic_arrivals
from workbench.traces.transforms import apply_transforms
from workbench.traces.vidur import load_vidur

__all__ = [
    "BUILTIN_TRACE_DIR",
    "DEFAULT_VOCAB_HI",
    "DEFAULT_VOCAB_LO",
    "EXTRA_FORMATS",
    "FORMATS",
    "LENGTH_DISTS",
    "LoadStats",
    "MOONCAKE_BLOCK_TOKENS",
    "STREAMED_FORMATS",
    "TraceError",
    "TraceRequest",
    "apply_transforms",
    "ensure_prompt_ids",
    "iter_trace",
    "load_apex",
    "load_azure",
    "load_burstgpt",
    "load_mooncake",
    "load_sharegpt",
    "load_synthetic",
    "load_trace",
    "load_vidur",
    "mooncake_prompt_ids",
    "repeat_requests",
    "repeat_stream",
    "synthesize_day",
    "synthesize_prompt_ids",
    "synthetic_arrivals",
    "trace_stats",
    "trace_stats_arrays",
]
