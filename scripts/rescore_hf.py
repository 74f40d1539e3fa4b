"""Score an exported Hugging Face folder again with transformers' own ``generate``, on a run's validation prompts.

    rldispatch export --checkpoint runs/grpo_smollm2 --out exported/smollm2-seed0
    python scripts/rescore_hf.py --run runs/grpo_smollm2 --model exported/smollm2-seed0 --out runs/rescore.json

The prompts are the run's own: its ``data.val_files`` read by the project's dataset (same chat template, same
filter), the first ``data.val_batch_size`` rows, as the trainer's validation takes them. Each is generated alone
(no padding), greedily, for at most ``data.max_response_length`` new tokens, stopping at the tokenizer's stop ids;
the response is decoded and scored exactly as the trainer's validation scores it (the built-in rule of the row's
``data_source``). Prints both accuracies and writes them, with every response, as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from protocol.algos.scorers import default_compute_score
from protocol.rollout.dataset import RLHFDataset, ground_truth_of
from protocol.rollout.tokenizer import HFTokenizer, decode_response

VAL_KEY = "val/score/mean"


def last_val(run: Path) -> tuple[int, float]:
    """The step and value of the run's last validation record."""
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    found = [(int(r["step"]), float(r[VAL_KEY])) for r in records if VAL_KEY in r]
    if not found:
        sys.exit(f"{run}/metrics.jsonl has no {VAL_KEY} record")
    return max(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="the run folder (config.json, metrics.jsonl)")
    ap.add_argument("--model", required=True, help="the exported Hugging Face folder")
    ap.add_argument("--out", type=Path, default=None, help="JSON with both scores and every response")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = json.loads((args.run / "config.json").read_text())
    data = config["data"]
    if config["custom_reward_function"].get("path"):
        sys.exit("the run scored validation with a custom reward function; this script knows the built-in rules only")
    tok = HFTokenizer(AutoTokenizer.from_pretrained(args.model), path=args.model)
    rows = RLHFDataset(data["val_files"], tok, data["max_prompt_length"], prompt_key=data["prompt_key"]).rows
    rows = rows[:data["val_batch_size"]]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    stops = sorted(tok.stop_token_ids)
    records, t0 = [], time.perf_counter()
    for row in rows:
        prompt = torch.tensor([tok.apply_chat_template(row["raw_prompt"], add_generation_prompt=True)])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=data["max_response_length"], eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)
        ids = out[0, prompt.shape[1]:].tolist()  # one row: it ends at its first stop token, no padding
        text = decode_response(tok, ids, stop_ids=tok.stop_token_ids)
        # the validation scorer: the built-in rule (training-only shaping never applies), math-verify as configured
        score = float(default_compute_score(row["data_source"], text, ground_truth_of(row), row.get("extra_info"),
                                            use_math_verify=bool(config["reward"]["math_verify"])))
        records.append({"score": score, "response_tokens": len(ids), "response": text})
    hf = sum(r["score"] for r in records) / len(records)
    step, run_val = last_val(args.run)
    result = {"run": str(args.run), "model": args.model, "prompts": len(records), "run_step": step,
              "run_val": run_val, "transformers_val": hf, "difference_points": 100 * (hf - run_val),
              "seconds": time.perf_counter() - t0, "records": records}
    print(f"{len(records)} prompts: run's last val (step {step}) {run_val:.4f}, transformers generate {hf:.4f} "
          f"({100 * (hf - run_val):+.1f} points)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
