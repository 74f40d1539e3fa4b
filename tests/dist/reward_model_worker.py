"""2-rank worker: the FSDP reward-model engine scores as the single-process RewardModel (itself equal to
transformers') with DP=2 and with Ulysses SP=2, any micro-batch split, padding samples scored 0. Prints 'OK <check>'."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backends.base import Share  # noqa: E402
from backends.config import EngineConfig, FSDPConfig  # noqa: E402
from backends.fsdp.reward_model import FSDPRewardModelEngine  # noqa: E402
from backends.model.reward_model import RewardModelError, load_reward_model, read_reward_config  # noqa: E402
from dispatch.topology import Topology  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402
from tensordict import TensorDict  # noqa: E402

TOL = 1e-5  # fp32: the same sums in differently shaped GEMMs (and, with SP, a different attention split)


def samples(vocab: int, n: int = 8, padding=(3,)):
    g = torch.Generator().manual_seed(11)
    ids, masks = [], []
    for i in range(n):
        p, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        ids.append(torch.randint(1, vocab, (p + r,), generator=g))
        m = torch.ones(r, dtype=torch.long)
        m[int(torch.randint(0, r, (1,), generator=g)):] = 0 if i % 3 == 1 else 1  # some end in non-policy tokens
        m[0] = 1
        masks.append(m)
    return TensorDict({"input_ids": to_nested(ids), "response_mask": to_nested(masks),
                       "is_padding": torch.tensor([i in padding for i in range(n)])}, batch_size=[n])


def main() -> None:
    dist.init_process_group("gloo")
    path = sys.argv[1]
    data = samples(read_reward_config(path).vocab_size)
    ref = load_reward_model(path)
    with torch.no_grad():
        want = torch.cat([ref(r, torch.arange(len(r)), torch.tensor([0, len(r)], dtype=torch.int32))
                          for r in data["input_ids"].unbind()])
    want = torch.where(data["is_padding"], 0.0, want)
    for sp in (1, 2):
        fsdp = FSDPConfig(ulysses_sp=sp)
        topo = Topology.from_config(fsdp, dist.get_world_size())
        eng = FSDPRewardModelEngine(EngineConfig(model=read_reward_config(path), fsdp=fsdp, seed=0), topo)
        assert eng.optimizer is None and not any(p.requires_grad for p in eng.model.parameters())
        # rank 0 holds 3 samples, rank 1 the other 5: with micro_batch_size 2 one micro-batch takes them 2 and 3
        # forwards, and they must run the same number (each gathers the sharded weights)
        cut = 3 if topo.dp_size == 2 else len(data)
        mine = list(range(cut)) if topo.dp_rank(dist.get_rank()) == 0 else list(range(cut, len(data)))
        half = (len(mine) + 1) // 2
        for split, mbs in (([list(range(half)), list(range(half, len(mine)))], None),
                           ([list(range(len(mine)))], None), ([list(range(len(mine)))], 2)):
            eng.micro_batch_size = mbs
            out = eng.infer_batch(Share(data[mine], split))
            if out is None:
                continue
            got = out["scores"]
            d = float((got - want[mine]).abs().max())
            assert d < TOL, (sp, split, got, want[mine])
            for row, mask, s, pad in zip(out["rm_scores"].unbind(), data[mine]["response_mask"].unbind(), got,
                                         data[mine]["is_padding"]):
                last = int(torch.nonzero(mask).max())
                assert float(row[last]) == float(s) and int((row != 0).sum()) <= 1, (row, mask, s)
                assert not bool(pad) or float(s) == 0.0
        if sp == 1:  # sequences over max_length: an error naming the keys, or their last max_length tokens
            eng.max_length, eng.micro_batch_size = 4, None
            try:
                eng.infer_batch(Share(data[mine], [list(range(len(mine)))]))
            except RewardModelError as exc:
                assert "reward.model.max_length=4" in str(exc) and "reward.model.truncation=left" in str(exc)
            else:
                raise AssertionError("a sequence over max_length was scored")
            eng.truncation = "left"
            out = eng.infer_batch(Share(data[mine], [list(range(len(mine)))]))
            if out is not None:
                rows = [data["input_ids"][j][-4:] for j in mine]
                with torch.no_grad():
                    cut_want = torch.stack([ref(r, torch.arange(len(r)), torch.tensor([0, len(r)],
                                                                                      dtype=torch.int32))[0]
                                            for r in rows])
                cut_want = torch.where(data[mine]["is_padding"], 0.0, cut_want)
                assert float((out["scores"] - cut_want).abs().max()) < TOL
                assert out["rm_truncated"].tolist() == [len(data["input_ids"][j]) > 4 for j in mine]
        if dist.get_rank() == 0:
            print(f"OK reward model dp={topo.dp_size} sp={sp} max|fsdp-single|={d:.1e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
