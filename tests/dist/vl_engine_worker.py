"""2-rank worker: the FSDP engine with a vision-language policy (the folder given) on DP=2, each rank its own share
of a batch mixing 2, 1 and 0 images and a padding sample: every sequence's log-probs equal the single-process model's
under two micro-batch splits; one training step on both ranks leaves both ranks with the same full weights, vision
tower included. Prints 'OK <check>'."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backends.base import Share  # noqa: E402
from backends.config import EngineConfig, OptimConfig  # noqa: E402
from backends.fsdp.engine import FSDPEngine  # noqa: E402
from backends.fsdp.share import GRIDS, PIXELS  # noqa: E402
from backends.model.vision import load_vl_checkpoint  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from vl_common import reference_logprobs, vl_rows  # noqa: E402

CASES = [([5, 6, 7, 8, 9], [(1, 2, 6), (1, 6, 4)]), ([10, 11, 12], [(1, 4, 4)]), ([13, 14, 15, 16], []),
         ([17, 18], [(1, 2, 2)]), ([19, 20, 21], []), ([3, 4, 5, 6], [])]  # the last one: padding


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = load_vl_checkpoint(sys.argv[1])
    ids, masks, pixels, grids = vl_rows(model.vl.vision.patch_dim, CASES)
    want = reference_logprobs(model, ids, pixels, grids)
    mine = list(range(rank, len(CASES), 2))  # rank 0: 2 images, none, none; rank 1: 1 image, 1 image, padding
    data = TensorDict({"input_ids": to_nested([ids[i] for i in mine]),
                       "response_mask": to_nested([masks[i] for i in mine]),
                       PIXELS: to_nested([pixels[i] for i in mine]), GRIDS: to_nested([grids[i] for i in mine]),
                       "is_padding": torch.tensor([i == len(CASES) - 1 for i in mine])}, batch_size=[len(mine)])
    eng = FSDPEngine(EngineConfig(model=model.vl.text, vision=model.vl, optim=OptimConfig(name="sgd", lr=0.5)))
    for split in ([[0, 1, 2]], [[2], [0, 1]]):
        got = eng.infer_batch(Share(data, split))["log_probs"].unbind()
        for j, i in enumerate(mine):
            if i != len(CASES) - 1:
                torch.testing.assert_close(got[j], want[i], rtol=1e-5, atol=1e-5)
    print(f"OK rank {rank} log-probs dp=2", flush=True)
    train = data.clone()
    train["old_log_probs"] = eng.infer_batch(Share(data, [[0, 1, 2]]))["log_probs"]
    train["advantages"] = to_nested([torch.full((3,), 1.0 - 0.5 * j) for j in range(len(mine))])
    metrics = eng.train_batch(Share(train, [[0, 1], [2]]))
    full = {n: p.detach().full_tensor() for n, p in eng.model.named_parameters()}
    other = [None, None]
    dist.all_gather_object(other, {n: t.sum().item() for n, t in full.items()})
    assert other[0] == other[1], "the ranks hold different weights after the step"
    assert metrics["grad_norm"] > 0 and any(not torch.equal(full[n], model.state_dict()[n]) for n in full
                                            if n.startswith("visual.blocks.0."))
    print(f"OK rank {rank} step dp=2", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
