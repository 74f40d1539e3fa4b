"""4-rank worker: the Megatron engine (TP=2 x PP=2) started from Hugging Face checkpoints of several architectures.

``argv[1:]`` are checkpoint folders, each holding ``reference.pt`` written by the launching test: packed samples
and transformers' own per-token log-probs of their responses. For each folder: the engine's log-probs equal the
reference within LOGPROB_TOL, and the weights gathered back from the TP/PP shards equal the checkpoint's exactly
(converter both ways). Prints one ``OK <arch>`` line per checkpoint.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

# the config reader without transformers is checked equal to AutoConfig in test_hf_architectures.py; keeping four
# ranks from importing transformers saves most of this launch's start-up time
sys.modules["transformers"] = None  # type: ignore[assignment]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_common import MegatronConfig, engine_config, share_of, topology  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from backends.megatron.engine import MegatronEngine  # noqa: E402
from backends.model.hf import load_hf_checkpoint, read_hf_config  # noqa: E402
from protocol.batch.nested import to_nested  # noqa: E402

# fp32 with TP-split matmul partial sums and masked (not per-sequence) attention: each log-prob is a difference of
# logits of magnitude <= ~25 with a few float32 roundings (2^-24 relative) per reduction, so a few 1e-6
LOGPROB_TOL = 1e-5


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def check(path: str) -> None:
    ref = torch.load(os.path.join(path, "reference.pt"), weights_only=True)
    cfg = read_hf_config(path)
    seqs, resp_lens, want = ref["sequences"], ref["response_lens"], ref["log_probs"]
    data = TensorDict({"input_ids": to_nested([torch.tensor(s) for s in seqs]),
                       "response_mask": to_nested([torch.ones(r, dtype=torch.long) for r in resp_lens])},
                      batch_size=[len(seqs)])
    par = MegatronConfig(tp=2, pp=2, use_distributed_optimizer=False)
    topo = topology(par, dist.get_world_size())
    eng = MegatronEngine(engine_config(par, model=cfg), topo)
    try:
        out = eng.infer_batch(share_of(data, list(range(len(seqs))), 2))
        worst = 0.0
        if out is not None:
            for got, exp in zip(out["log_probs"].unbind(), want):
                worst = max(worst, float((got - exp).abs().max()))
            assert worst <= LOGPROB_TOL, (cfg.model_type, worst)
        worst_t = torch.tensor(worst)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        weights = eng.get_weights()
        loaded = load_hf_checkpoint(path).state_dict()
        assert sorted(weights) == sorted(loaded), sorted(set(weights) ^ set(loaded))
        for name, t in loaded.items():
            assert torch.equal(weights[name], t), name
        log(f"OK {os.path.basename(path)} tp=2 pp=2 max|megatron-transformers|={float(worst_t):.2e} "
            f"weights round-trip exact ({len(loaded)} tensors)")
    finally:
        eng.close()


def main() -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        for path in sys.argv[1:]:
            check(path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
