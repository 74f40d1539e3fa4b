"""Engines that run forward/backward/optimizer on a per-rank share: FSDP2 and Megatron-core."""
