"""Topology -> logical DP -> balanced, padded, mini/micro-batched per-rank shares.

Pure planning over tags and topology: no model code, no torch.distributed. Typical use::

    topo = Topology.from_config({"backend": "megatron", "tp": 2, "pp": 2}, world_size)
    settings = BatchSettings(ppo_mini_batch_size=M, rollout_n=G, max_token_len_per_gpu=8192)
    settings.check(topo)                                   # at start-up
    pad = make_padding(padding_count(len(keys), settings.padding_multiple(topo)), global_steps=step)
    plan = build_plan(tags + pad.tags, topo, settings, keys=keys + pad.keys)
    mb = plan.for_rank(rank).mini_batches[k]               # -> Share(data[mb.indices], mb.micro_batches)
"""
from dispatch.balance import (
    PartitionError,
    balance_partitions,
    contiguous_partitions,
    differencing_partitions,
    greedy_partitions,
    imbalance,
    karmarkar_karp,
    lower_bound,
    partition_loads,
    refine_partitions,
)
from dispatch.microbatch import MicroBatchError, min_micro_batches, pack_micro_batches, small_ends_order, split_micro_batches
from dispatch.padding import (
    DENSE_FIELDS,
    FLOAT_FIELDS,
    INT_FIELDS,
    PADDING_UID_PREFIX,
    PaddingBatch,
    PaddingError,
    is_padding_key,
    make_padding,
    padding_count,
)
from dispatch.plan import (DispatchPlan, MiniBatchPlan, MiniBatchWork, PlanError, PlanJob, PlanTags, RankPlan,
                           build_plan, read_plan_tags, restore_order, reverse_index)
from dispatch.settings import BatchSettings, DispatchConfigError
from dispatch.synthetic import DISTRIBUTIONS, synthetic_lengths
from dispatch.topology import Backend, BackendName, FSDPParallel, MegatronParallel, ParallelSection, Topology, \
    TopologyError, parallel_section
from dispatch.workload import DEFAULT_HIDDEN_SIZE, WorkloadError, WorkloadModel

__all__ = [
    "Backend", "BackendName", "FSDPParallel", "MegatronParallel", "ParallelSection", "parallel_section",
    "Topology", "TopologyError",
    "PartitionError", "balance_partitions", "karmarkar_karp", "differencing_partitions", "greedy_partitions",
    "contiguous_partitions",
    "refine_partitions", "partition_loads", "lower_bound", "imbalance",
    "WorkloadModel", "WorkloadError", "DEFAULT_HIDDEN_SIZE",
    "BatchSettings", "DispatchConfigError",
    "PaddingBatch", "PaddingError", "make_padding", "padding_count", "is_padding_key", "PADDING_UID_PREFIX",
    "INT_FIELDS", "FLOAT_FIELDS", "DENSE_FIELDS",
    "MicroBatchError", "pack_micro_batches", "min_micro_batches", "split_micro_batches", "small_ends_order",
    "DISTRIBUTIONS", "synthetic_lengths",
    "PlanError", "MiniBatchPlan", "MiniBatchWork", "PlanJob", "RankPlan", "DispatchPlan", "build_plan",
    "reverse_index", "restore_order",
    "PlanTags", "read_plan_tags",
]
