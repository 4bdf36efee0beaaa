"""The real engine's torch side: the forward pass, the model executor, KV tensors and swap space, the
sampler and the model store."""

# Raise when a change to the real engine alters its step time without changing the compiled kernel's
# source (the GEMM backend or its row buckets, a fused op, the step's Python path): a simulator profile's
# fingerprint holds it, so cached profiles of the older engine are measured again.
ENGINE_SPEED_REVISION = 3  # 3: the executor keeps freed memory (engines.real.allocator)
