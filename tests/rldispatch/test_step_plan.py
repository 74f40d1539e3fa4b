"""The step plan split over ranks: any split of its pieces, exchanged, gives every rank the one-process plan."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dispatch import PlanError, Topology
from protocol.store.keys import trajectory_key, trajectory_tag
from protocol.store.meta import KVBatchMeta
from rldispatch.config import load_config
from rldispatch.plan import PIECE_SETUP, make_step_plan, prepare_step_plan


def sampled(groups: int, n: int, seed: int) -> KVBatchMeta:
    rng = np.random.default_rng(seed)
    keys = [trajectory_key(f"g{u:03d}", s, 0) for u in range(groups) for s in range(n)]
    tags = [trajectory_tag(int(rng.integers(1, 30)), int(rng.integers(1, 90)), 2) for _ in keys]
    return KVBatchMeta("train", keys, tags)


def run_config(groups: int, n: int, mini: int, epochs: int, dynamic: bool):
    return load_config("grpo_tiny", [f"data.train_batch_size={groups}", f"rollout.n={n}",
                                     f"actor.ppo_mini_batch_size={mini}", f"actor.ppo_epochs={epochs}",
                                     f"actor.use_dynamic_bsz={str(dynamic).lower()}", "actor.max_token_len_per_gpu=400",
                                     "actor.micro_batch_size_per_gpu=1"])


def exchanged(job, world: int) -> dict:
    """What every rank holds after the exchange: each rank's share, through pickle as it travels."""
    done: dict = {}
    for rank in range(world):
        share = pickle.loads(pickle.dumps(job.run_share(rank, world)))
        assert not set(share) & set(done)  # no piece is computed twice
        done.update(share)
    return done


@settings(max_examples=25, deadline=None)
@given(minis=st.integers(1, 4), n=st.sampled_from([1, 2, 4]), mini=st.integers(1, 3), epochs=st.integers(1, 2),
       dynamic=st.booleans(), dp=st.sampled_from([1, 2, 4]), world=st.integers(1, 5), seed=st.integers(0, 99))
def test_any_split_of_the_pieces_gives_the_one_process_plan(minis, n, mini, epochs, dynamic, dp, world, seed):
    dp = dp if (mini * n) % dp == 0 else 1
    cfg, meta, topo = run_config(mini * minis, n, mini, epochs, dynamic), sampled(mini * minis, n, seed), \
        Topology.from_config({"backend": "fsdp"}, dp)
    want = make_step_plan(meta, topo, cfg, 2)
    job = prepare_step_plan(meta, topo, cfg, 2)
    got = job.finish(exchanged(job, world))
    assert got.keys == want.keys and got.padding_keys == want.padding_keys
    for mine, ref in ((got.train, want.train), (got.infer, want.infer)):
        assert mine.ranks == ref.ranks and mine.metrics == ref.metrics
        assert mine.baseline_workload == ref.baseline_workload
    # heaviest piece first to the least-loaded rank: no rank carries more than the lightest one plus one piece
    owners = job.owners(world)
    costs = [j.cost(i) + PIECE_SETUP for j in (job.train, job.infer) for i in range(len(j))]
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
    assert max(loads) - min(loads) <= max(costs) and job.owners(world) == owners
    # every rank names every DP rank's inference share from the plan alone (the keys of a planned fetch)
    for d in range(dp):
        assert got.infer_keys(d) == [got.keys[i] for i in got.infer.ranks[d].mini_batches[0].indices]
        assert [got.keys_of(mb.indices) for mb in got.mini_batches(d)] == \
            [[got.keys[i] for i in mb.indices] for mb in got.train.ranks[d].mini_batches]
    assert sorted(k for d in range(dp) for k in got.infer_keys(d)) == sorted(got.keys)


def test_a_failed_piece_is_raised_on_every_rank_and_a_missing_one_is_an_error():
    cfg, meta, topo = run_config(4, 2, 1, 1, False), sampled(4, 2, 0), Topology.from_config({"backend": "fsdp"}, 2)
    job = prepare_step_plan(meta, topo, cfg, 2)
    assert len(job.train) == 4 and len(job.infer) == 1

    def fails(piece: int):
        raise PlanError(f"piece {piece} cannot be planned")

    job.train.run = fails  # the failure of one rank's piece must reach every rank, not stop that rank alone
    owner = job.owners(2)[2]
    shares = [job.run_share(r, 2) for r in range(2)]
    assert isinstance(shares[owner][2], PlanError)
    done = {p: r for s in shares for p, r in pickle.loads(pickle.dumps(s)).items()}
    with pytest.raises(PlanError, match="piece 0 cannot be planned"):  # the first failed piece, in plan order
        job.finish(done)

    class Unpicklable(ValueError):
        def __init__(self, what, handle):
            super().__init__(what)
            self.handle = handle

    def fails_badly(piece: int):
        raise Unpicklable("no travel", lambda: None)

    job.train.run = fails_badly
    share = job.run_share(job.owners(2)[0], 2)
    assert isinstance(share[0], RuntimeError) and str(share[0]) == "Unpicklable: no travel"
    pickle.dumps(share)
    with pytest.raises(RuntimeError, match="misses 1 of its 5 planned mini-batches"):
        job.finish({p: None for p in range(4)})
