"""A policy learns a preference from a reward model alone (docs/reward_models.md, "Learning from a reward model").

1. Train a tiny one-label Qwen2 sequence classifier on CPU to score a sequence (a grpo_tiny prompt + a random
   response) +1 when its response contains the target character and -1 otherwise; save it as a Hugging Face folder.
2. Run grpo_tiny with that reward model as the only reward (``reward.rule_weight=0``) for each seed, and, as
   the control, with the same architecture untrained (random weights). The rule-based scorer is this file's
   :func:`contains_target` (1 when the response contains the target, else 0): with ``rule_weight=0`` it does not
   train anything, it measures — ``reward/rule/mean`` is the rate of sampled responses with the target and the
   greedy validation score the rate under greedy decoding.

    python scripts/reward_model_demo.py --out runs/rm_demo --seeds 0 1 2 --steps 60
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TARGET = "z"
#: the characters random responses are drawn from (what grpo_tiny's policy writes: the repeat task's words, digits)
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


def contains_target(data_source, solution_str, ground_truth, extra_info=None, **_):
    """1.0 when the response contains the target character, else 0.0 (the measured behaviour)."""
    return 1.0 if TARGET in solution_str else 0.0


def _examples(n: int, seed: int, train_file: str):
    """(prompt + response ids, label) pairs: half the responses contain the target character."""
    from protocol.rollout.dataset import RLHFDataset
    from protocol.rollout.tokenizer import load_tokenizer

    tok = load_tokenizer("char")
    prompts = [tok.apply_chat_template(r["raw_prompt"], add_generation_prompt=True)
               for r in RLHFDataset([train_file], tok, max_prompt_length=64)]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(1, 8)
        text = [rng.choice(_ALPHABET.replace(TARGET, "")) for _ in range(length)]
        positive = rng.random() < 0.5
        if positive:
            for _ in range(rng.randint(1, 2)):
                text[rng.randrange(length)] = TARGET
        ids = list(rng.choice(prompts)) + tok.encode("".join(text)) + ([tok.eos_token_id] if rng.random() < 0.5 else [])
        out.append((ids, 1.0 if positive else -1.0))
    return out


def build_reward_model(out: Path, train_file: str, *, steps: int, seed: int = 0, trained: bool = True) -> dict:
    """Train (or, ``trained=False``, only initialise) the classifier and save it to ``out``; returns its accuracy
    on held-out examples."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, use_sliding_window=False, num_labels=1,
                                   pad_token_id=0)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    data, held = _examples(4096, seed, train_file), _examples(512, seed + 1, train_file)

    def batch(rows):
        width = max(len(ids) for ids, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        return ids, mask, torch.tensor([y for _, y in rows])

    if trained:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rng = random.Random(seed)
        for _ in range(steps):
            ids, mask, y = batch(rng.sample(data, 64))
            loss = torch.nn.functional.mse_loss(model(input_ids=ids, attention_mask=mask).logits[:, 0], y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        ids, mask, y = batch(held)
        pred = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    accuracy = float(((pred > 0) == (y > 0)).float().mean())
    model.save_pretrained(str(out))
    return {"accuracy": accuracy, "trained": trained, "steps": steps if trained else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/rm_demo")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    ap.add_argument("--rm-steps", type=int, default=400, help="reward model training steps")
    args = ap.parse_args(argv)
    from protocol.rollout.tasks.data import write_task_data
    from rldispatch.config import load_config

    out = Path(args.out).resolve()
    d = load_config("grpo_tiny", []).data
    folder = out / "data" / d.task  # the rows learning_curves.py trains on (same task, sizes and seed)
    if not (folder / "train.parquet").is_file():
        write_task_data(str(folder), d.task, train=d.train_size, val=d.val_size, seed=0)
    train_file = str(folder / "train.parquet")
    models = {}
    for name, trained in (("trained", True), ("untrained", False)):
        rm = out / f"rm_{name}"
        if not (rm / "demo.json").is_file():
            models[name] = build_reward_model(rm, train_file, steps=args.rm_steps, trained=trained)
            (rm / "demo.json").write_text(json.dumps(models[name]))
        models[name] = json.loads((rm / "demo.json").read_text())
        print(f"reward model {name}: held-out accuracy {models[name]['accuracy']:.3f}", flush=True)
    for name in ("trained", "untrained"):
        overrides = [f"reward.model.hf_path={out / f'rm_{name}'}", "reward.rule_weight=0",
                     f"custom_reward_function.path={Path(__file__).resolve()}",
                     "custom_reward_function.name=contains_target"]
        subprocess.run([sys.executable, str(REPO / "scripts" / "learning_curves.py"), "--layouts", "fsdp-dp2",
                        "--seeds", *map(str, args.seeds), "--steps", str(args.steps), "--val-freq", "10",
                        "--out-dir", str(out / name), "--reward-threshold", "0.5", "--override", *overrides],
                       check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
