"""The megatron-core engine (TP / PP / VPP / DP, distributed optimizer) behind the common engine interface.

``backends.megatron.engine.MegatronEngine`` registers itself as ``actor.backend = "megatron"``; megatron-core's
module globals (parallel state, RNG tracker) stay inside this package.
"""
