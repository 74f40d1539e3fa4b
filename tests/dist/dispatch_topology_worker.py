"""Checks Topology's rank maps against torch's DeviceMesh and megatron-core's parallel state on a gloo world,
and that every rank, planning on its own with its own hash seed, arrives at the same DispatchPlan.

Run under torchrun with 4 (or 8) processes; prints one "OK <case>" line per checked case on rank 0.
"""
from __future__ import annotations

import sys
import time

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dispatch import Topology


def check(cond: bool, msg: str) -> None:
    if not cond:
        print(f"FAIL rank {dist.get_rank()}: {msg}", flush=True)
        sys.exit(1)


def fsdp_cases(world: int, rank: int) -> list[str]:
    done = []
    for sp in [d for d in (2, 4) if world % d == 0]:
        topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": sp}, world)
        mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))
        c = topo.coords(rank)
        check([c["dp"], c["sp"]] == list(mesh.get_coordinate()), f"ulysses sp={sp}: {c} vs {mesh.get_coordinate()}")
        check(mesh["dp"].get_local_rank() == topo.dp_rank(rank), f"sp={sp}: dp rank")
        dp_group_ranks = dist.get_process_group_ranks(mesh["dp"].get_group())
        sp_group_ranks = dist.get_process_group_ranks(mesh["sp"].get_group())
        check(sorted(sp_group_ranks) == topo.ranks_of_dp(topo.dp_rank(rank)), f"sp={sp}: replica ranks")
        check(all(topo.coords(r)["sp"] == c["sp"] for r in dp_group_ranks), f"sp={sp}: dp group shares sp")
        check(topo.dp_size == mesh["dp"].size(), f"sp={sp}: dp size")
        done.append(f"fsdp ulysses_sp={sp}")
    for fsdp_size in [d for d in (-1, 2) if d == -1 or world % d == 0]:
        topo = Topology.from_config({"backend": "fsdp", "fsdp_size": fsdp_size}, world)
        c = topo.coords(rank)
        if fsdp_size == -1:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
            check(c["shard"] == mesh.get_local_rank() and c["replicate"] == 0, f"fsdp_size=-1: {c}")
        else:
            mesh = init_device_mesh("cpu", (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))
            check([c["replicate"], c["shard"]] == list(mesh.get_coordinate()),
                  f"hsdp fsdp_size={fsdp_size}: {c} vs {mesh.get_coordinate()}")
        check(topo.dp_size == world, "fsdp_size must not change DP")
        done.append(f"fsdp fsdp_size={fsdp_size}")
    return done


def megatron_cases(world: int, rank: int) -> list[str]:
    from megatron.core import parallel_state as ps

    cases = [dict(tp=2, pp=2, cp=1, ep=1, etp=1), dict(tp=1, pp=2, cp=2, ep=1, etp=1),
             dict(tp=2, pp=1, cp=2, ep=1, etp=1), dict(tp=1, pp=1, cp=2, ep=2, etp=1),
             dict(tp=2, pp=1, cp=1, ep=2, etp=1), dict(tp=2, pp=1, cp=1, ep=2, etp=2),
             dict(tp=1, pp=2, cp=1, ep=2, etp=1), dict(tp=1, pp=1, cp=1, ep=4, etp=1)]
    done = []
    for case in cases:
        if world % (case["tp"] * case["pp"] * case["cp"]) or world % (case["etp"] * case["ep"] * case["pp"]):
            continue
        topo = Topology.from_config({"backend": "megatron", **case}, world)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
            context_parallel_size=case["cp"], expert_model_parallel_size=case["ep"],
            expert_tensor_parallel_size=case["etp"], create_gloo_process_groups=False)
        try:
            c = topo.coords(rank)
            got = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                   "cp": ps.get_context_parallel_rank(), "dp": ps.get_data_parallel_rank(),
                   "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
                   "edp": ps.get_expert_data_parallel_rank()}
            mine = {k: c[k] for k in got}
            check(mine == got, f"megatron {case}: ours {mine} vs megatron-core {got}")
            check(topo.dp_size == ps.get_data_parallel_world_size(), f"megatron {case}: dp size")
            dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
            check(all(topo.coords(r)["tp"] == c["tp"] and topo.coords(r)["pp"] == c["pp"] for r in dp_ranks),
                  f"megatron {case}: dp group")
            mp = sorted(dist.get_process_group_ranks(ps.get_model_parallel_group()))
            replica = sorted(r for r in topo.ranks_of_dp(c["dp"]) if topo.coords(r)["cp"] == c["cp"])
            check(mp == replica, f"megatron {case}: model-parallel group {mp} vs replica {replica}")
            last = ps.is_pipeline_last_stage()
            check(topo.is_reporting(rank) == (last and c["tp"] == 0 and c["cp"] == 0), f"megatron {case}: reporting")
        finally:
            ps.destroy_model_parallel()
        done.append(f"megatron {case}")
    return done


def plan_cases(world: int, rank: int) -> list[str]:
    """Every rank computes the same plan on its own (no collective in planning), whatever its hash seed."""
    from dispatch import BatchSettings, WorkloadModel, build_plan, make_padding, padding_count, synthetic_lengths

    done = []
    topo = Topology.from_config({"backend": "megatron", "tp": 2}, world)
    seq = synthetic_lengths("bimodal", 96, seed=3, max_len=4096)
    uids = [f"g{i // 4:04d}x" for i in range(96)]
    tags = [{"seq_len": int(s), "prompt_len": 1, "response_len": int(s) - 1, "is_padding": False, "uid": u}
            for s, u in zip(seq, uids)]
    keys = [f"{u}_{i % 4}_0" for i, u in enumerate(uids)]
    for name, settings in [
        ("shuffled tokens", BatchSettings(ppo_mini_batch_size=8, rollout_n=4, ppo_epochs=2, shuffle=True, seed=11,
                                          max_token_len_per_gpu=9000, workload=WorkloadModel.from_hidden_size(256))),
        ("groups fixed", BatchSettings(ppo_mini_batch_size=4, rollout_n=4, group_partition=True,
                                       micro_batch_size_per_gpu=2)),
        ("inference", BatchSettings(rollout_n=4, max_token_len_per_gpu=5000, small_ends=True)),
    ]:
        pad = make_padding(padding_count(len(tags), settings.padding_multiple(topo)), seed=0, fields=[])
        plan = build_plan(tags + pad.tags, topo, settings, keys=keys + pad.keys)
        mine = ([[(mb.epoch, mb.index, mb.indices, mb.micro_batches) for mb in r.mini_batches] for r in plan.ranks],
                sorted(plan.metrics.items()))
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        check(all(g == gathered[0] for g in gathered), f"plan {name!r} differs between ranks")
        done.append(f"plan identical on all ranks: {name}")
    return done


def main() -> None:
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    done = fsdp_cases(world, rank) + megatron_cases(world, rank) + plan_cases(world, rank)
    dist.barrier()
    if rank == 0:
        for d in done:
            print("OK", d, flush=True)
        print(f"worker time {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    from worker_exit import run_worker

    run_worker(main)
