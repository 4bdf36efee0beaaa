"""The real engine's torch side: the forward pass, the model executor, KV tensors and swap space, the
sampler and the model store."""
