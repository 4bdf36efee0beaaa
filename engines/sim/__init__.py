"""The simulator: the event loop on a virtual clock, the cost-model executor, measured and analytic cost
models, the profiler, the GPU and model catalogues, and speculative decoding. No torch at module level."""
