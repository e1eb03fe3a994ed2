"""Block-diffusion generation: the scheduler, sessions, KV cache, device loop, AR decoding and backends."""
