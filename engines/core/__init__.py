"""What the real engine and the simulator share: requests, sampling parameters, configs, the block pool and
KV managers, the scheduler interface and its policies, and the engine loop. No torch."""
