"""Write a Hugging Face folder from a training checkpoint of either backend.

    rldispatch export --checkpoint runs/qwen/checkpoints/step_100 --out exported/qwen-step100
    python scripts/export_hf.py --checkpoint runs/qwen --out exported/qwen-latest --verify    (a run folder: latest)

The checkpoint's saved run config names the backend and the architecture. FSDP (torch DCP) and Megatron
(megatron-core ``torch_dist``, any TP/PP/VPP) checkpoints are read in this one process, no torchrun needed. The
folder gets config.json (the starting checkpoint's own when ``model.hf_path`` was set), the weights as safetensors,
generation_config.json and the run's tokenizer files; ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``
loads it. ``--verify`` then compares transformers' logits with the project's model on random tokens.

A LoRA run's checkpoint (``actor.lora.rank`` > 0) holds the frozen base and the adapters: the folder gets the merged
weights ``W + (alpha / rank) B A``, and ``--adapter-out DIR`` also writes the adapters alone as a PEFT adapter folder
that ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the base model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["ExportError", "ExportResult", "resolve_checkpoint", "read_checkpoint", "export_checkpoint", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_FILE = "engine_state.pt"  # written by both engines' save_checkpoint


class ExportError(ValueError):
    """A checkpoint folder that cannot be exported, or an output folder that would be overwritten."""


@dataclass
class ExportResult:
    """What one export wrote and where it came from."""

    checkpoint: str
    backend: str
    step: int
    out: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_logit_diff: float | None = None
    adapter_files: list[str] = field(default_factory=list)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it holds a checkpoint, else the ``latest`` one of a run folder or checkpoints folder."""
    p = Path(path)
    if (p / _STATE_FILE).is_file():
        return p
    for marker in (p / "checkpoints" / "latest", p / "latest"):
        if marker.is_file():
            found = marker.parent / marker.read_text().strip()
            if (found / _STATE_FILE).is_file():
                return found
            raise ExportError(f"{marker} names {found}, which is not a complete checkpoint ({_STATE_FILE} missing)")
    raise ExportError(f"--checkpoint {path}: not a checkpoint folder ({_STATE_FILE} missing) nor a run folder with "
                      f"checkpoints/latest")


def _model_config(plain: dict[str, Any], where: Path):
    from backends.model.config import ModelConfig

    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(plain) - known)
    if unknown:
        raise ExportError(f"{where}: the saved model config has fields {unknown} this version does not know")
    try:
        return ModelConfig(**plain)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{where}: the saved model config is not valid here: {exc}") from exc


def read_checkpoint(path: Path) -> tuple[str, int, dict[str, Any], dict[str, torch.Tensor]]:
    """(backend, step, saved run config, full project-layout weights) of one checkpoint folder."""
    state = torch.load(path / _STATE_FILE, weights_only=False, map_location="cpu")
    extra = state.get("extra_state") or {}
    run_cfg = extra.get("config")
    if not isinstance(run_cfg, dict) or "model" not in run_cfg:
        raise ExportError(f"{path}/{_STATE_FILE} carries no run config (extra_state['config']); only checkpoints "
                          f"written by the trainer can be exported")
    backend = (run_cfg.get("actor") or {}).get("backend") or ("megatron" if "degrees" in state else "fsdp")
    cfg = _model_config(run_cfg["model"], path)
    if backend == "fsdp":
        from backends.fsdp.checkpoint import read_model_weights

        weights = read_model_weights(str(path))
    elif backend == "megatron":
        from backends.megatron.checkpoint import read_model_weights

        weights = read_model_weights(str(path), cfg)
    else:
        raise ExportError(f"{path}: unknown backend {backend!r} in the saved config (actor.backend)")
    return backend, int(extra.get("step", state.get("step", 0))), run_cfg, weights


def _generation_config(source: str, tokenizer: Any) -> dict[str, Any]:
    """The starting checkpoint's generation_config.json, else one naming the tokenizer's stop and pad ids."""
    from protocol.rollout.tokenizer import stop_token_ids

    if source and os.path.isfile(os.path.join(source, "generation_config.json")):
        with open(os.path.join(source, "generation_config.json")) as fh:
            return json.load(fh)
    stops = sorted(stop_token_ids(tokenizer))
    out: dict[str, Any] = {"eos_token_id": stops[0] if len(stops) == 1 else stops}
    for key in ("pad_token_id", "bos_token_id"):
        if getattr(tokenizer, key, None) is not None:
            out[key] = int(getattr(tokenizer, key))
    return out


def _verify(out: str, seed: int = 0) -> float:
    """Max |logit difference| between transformers' model of ``out`` and the project's, on random packed rows."""
    from transformers import AutoModelForCausalLM

    from backends.model.hf import load_hf_checkpoint

    ours = load_hf_checkpoint(out).eval()
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    lens = [7, 5]
    ids = torch.randint(0, ours.cfg.vocab_size, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        a = ours(ids, pos, cu)
        b = torch.cat([theirs(input_ids=ids[s:e][None]).logits[0] for s, e in zip(cu[:-1], cu[1:])])
    return float((a - b).abs().max())


def _lora_spec(run_cfg: dict[str, Any], weights: dict[str, torch.Tensor], path: Path):
    """The run's LoRA settings when its checkpoint holds adapters, else None (adapters without settings: refused)."""
    from backends.config import LoraConfig
    from backends.model.lora import is_adapter_name

    has = any(is_adapter_name(n) for n in weights)
    plain = (run_cfg.get("actor") or {}).get("lora") or {}
    try:
        lora = LoraConfig(**plain)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path}: the saved actor.lora config is not valid here: {exc}") from exc
    if has != lora.enabled:
        raise ExportError(f"{path}: the checkpoint {'holds' if has else 'holds no'} LoRA adapters but the saved "
                          f"config has actor.lora.rank={lora.rank}")
    return lora.spec() if has else None


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32",
                      overwrite: bool = False, verify: bool = False,
                      max_shard_bytes: int | None = None, adapter_out: str | os.PathLike | None = None) -> ExportResult:
    """Export one checkpoint (or a run folder's latest) to the Hugging Face folder ``out`` (adapters merged);
    ``adapter_out``: also the LoRA adapters alone, as a PEFT folder."""
    from backends.model.hf_export import save_hf_checkpoint
    from protocol.rollout.tokenizer import load_tokenizer, resolve_tokenizer

    if dtype not in _DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {list(_DTYPES)}")
    path = resolve_checkpoint(checkpoint)
    out = os.fspath(out)
    targets = [("--out", out)] + ([("--adapter-out", os.fspath(adapter_out))] if adapter_out else [])
    for flag, folder in targets:
        if os.path.isdir(folder) and os.listdir(folder) and not overwrite:
            raise ExportError(f"{flag} {folder} exists and is not empty; choose a new folder or pass --overwrite")
    backend, step, run_cfg, weights = read_checkpoint(path)
    cfg = _model_config(run_cfg["model"], path)
    spec = _lora_spec(run_cfg, weights, path)
    if adapter_out and spec is None:
        raise ExportError(f"--adapter-out: {path} was not trained with LoRA (actor.lora.rank=0), it has no adapters")
    for _, folder in targets:
        if os.path.isdir(folder) and os.listdir(folder):
            shutil.rmtree(folder)
    adapters = weights
    if spec is not None:
        from backends.model.lora import merge_adapters

        weights = merge_adapters(weights, spec.scale)
    source = cfg.hf_path if cfg.hf_path and os.path.isdir(cfg.hf_path) else ""
    result = ExportResult(checkpoint=str(path), backend=backend, step=step, out=out)
    if cfg.hf_path and not source:
        result.notes.append(f"the starting checkpoint {cfg.hf_path} is gone: config.json rebuilt from the run config")
    tok_source = resolve_tokenizer((run_cfg.get("data") or {}).get("tokenizer"), cfg.hf_path)
    tokenizer = load_tokenizer(tok_source) if tok_source == "char" or os.path.isdir(tok_source) else None
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": int(max_shard_bytes)}
    result.files = save_hf_checkpoint(out, weights, cfg, dtype=_DTYPES[dtype], source=source or None,
                                      generation_config=_generation_config(source, tokenizer) if tokenizer else None,
                                      **kwargs)
    if tokenizer is None:
        result.notes.append(f"the run's tokenizer {tok_source!r} is no longer there: no tokenizer files and no "
                            f"generation_config.json written")
    else:  # an HF tokenizer folder as it was, or the built-in char tokenizer in its Hugging Face form
        before = set(os.listdir(out))
        tokenizer.save_pretrained(out)
        result.files += sorted(set(os.listdir(out)) - before)
    if spec is not None:
        result.notes.append(f"LoRA adapters (rank {spec.rank}, alpha {spec.alpha:g}, on {', '.join(spec.targets)}) "
                            f"merged into the weights")
        if adapter_out:
            from backends.model.peft_export import save_peft_adapter

            result.adapter_files = save_peft_adapter(os.fspath(adapter_out), adapters, spec,
                                                     base_model=cfg.hf_path, dtype=_DTYPES[dtype])
    if verify:
        result.max_logit_diff = _verify(out)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rldispatch export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="RUN_DIR/checkpoints/step_N, or a run folder (its checkpoints/latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write (new or empty)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="dtype of the written weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--verify", action="store_true",
                        help="reload with transformers and compare its logits with the project's model")
    parser.add_argument("--adapter-out", default=None,
                        help="a LoRA run only: also write its adapters as a PEFT adapter folder here")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into files of this size")
    args = parser.parse_args(argv)
    try:
        res = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, overwrite=args.overwrite,
                                verify=args.verify, max_shard_bytes=int(args.max_shard_gb * 1024**3),
                                adapter_out=args.adapter_out)
    except (ValueError, KeyError) as exc:  # every refusal above and the loaders' errors name the problem
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {res.backend} checkpoint {res.checkpoint} (step {res.step}) to {res.out}: "
          f"{', '.join(res.files)}")
    if res.adapter_files:
        print(f"PEFT adapter written to {args.adapter_out}: {', '.join(res.adapter_files)}")
    for note in res.notes:
        print(f"note: {note}")
    if res.max_logit_diff is not None:
        print(f"verify: max |logits(transformers) - logits(project)| = {res.max_logit_diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
