"""The start-up warnings filter: each known warning is hidden where it really fires, nothing else is, our own code
stays off the deprecated collectives, and two engines run, save and re-save a checkpoint without a console line."""
from __future__ import annotations

import re
import subprocess
import tempfile
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rldispatch.known_warnings import (DEPRECATED_COLLECTIVES, KNOWN_LOG_LINES, KNOWN_WARNINGS, add_warning_filters,
                                       is_known)

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("protocol", "dispatch", "backends", "rldispatch")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env,
                          timeout=180)


def test_our_code_calls_no_deprecated_collective():
    """The collectives filter may only ever hide megatron-core's calls: no project module names an old collective."""
    pattern = re.compile(r"\b(dist|distributed)\.(" + "|".join(DEPRECATED_COLLECTIVES) + r")\b")
    hits = [f"{path.relative_to(REPO)}:{n}" for pkg in PROJECT_PACKAGES for path in sorted((REPO / pkg).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


# (category, message, issuing module) as seen on the console of 2-rank megatron runs (train, resume) before the filter
REAL_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
     "megatron.core.optimizer"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm", "megatron.core.models.gpt.gpt_layer_specs"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                    "`torch.distributed.reduce_scatter_single` instead.", "torch.distributed.c10d_logger"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                    "`torch.distributed.all_gather_single` instead.", "torch.distributed.c10d_logger"),
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute "
                  "won't be populated during autograd.backward().", "megatron.core.optimizer.optimizer"),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` "
                    "instead.", "megatron.core.dist_checkpointing.strategies.torch"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor.",
     "torch.distributed.checkpoint.default_planner"),
    (UserWarning, "When using async grad allreduce it is recommended to set the environment variable "
                  "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", "megatron.core.tensor_parallel.layers"),
)


@pytest.mark.parametrize("category, text, module", REAL_WARNINGS, ids=lambda v: str(v)[:30])
def test_each_filter_is_narrow(category, text, module):
    if torch.cuda.is_available() and "CUDA_DEVICE_MAX_CONNECTIONS" in text:
        pytest.skip("a real hint on a GPU: not filtered there")
    """A known message from its own module is hidden; the same message from one of our modules, or another message
    of the same category from the same module, still shows."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        add_warning_filters()
        warnings.warn_explicit(text, category, "x.py", 1, module=module)
        warnings.warn_explicit(text, category, "x.py", 2, module="backends.megatron.engine")
        warnings.warn_explicit("something else entirely", category, "x.py", 3, module=module)
    assert [w.lineno for w in seen] == [2, 3]
    assert is_known(text) and not is_known("something else entirely")


def test_every_filter_has_a_reason_and_a_real_example():
    matched = {i for _, text, _ in REAL_WARNINGS for i, k in enumerate(KNOWN_WARNINGS) if re.match(k.message, text)}
    assert matched == set(range(len(KNOWN_WARNINGS)))
    assert all(len(k.why) > 40 for k in KNOWN_WARNINGS) and all(len(why) > 40 for _, _, why in KNOWN_LOG_LINES)


def test_megatron_import_warnings_fire_and_are_filtered():
    """Importing megatron-core's optimizer and layer specs warns about Apex / transformer-engine; after install()
    the same import prints nothing."""
    imports = "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
    loud = _python(imports)
    assert loud.returncode == 0, loud.stderr
    assert "not installed" in loud.stderr
    quiet = _python(f"from rldispatch.known_warnings import install; install(); {imports}")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""


def test_fx_tracing_log_line_fires_and_is_filtered():
    """torch.nested's own is_fx_tracing() check logs once per process; after install() it does not."""
    name, pattern, _ = KNOWN_LOG_LINES[0]
    build = ("import torch; torch.nested.nested_tensor_from_jagged(torch.ones(3, 2), torch.tensor([0, 1, 3]))")
    loud = _python(build)
    assert loud.returncode == 0 and re.search(pattern, loud.stderr), loud.stderr
    quiet = _python(f"from rldispatch.known_warnings import install; install(); {build}")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""


@pytest.mark.dist
def test_engines_resave_one_folder_quietly(torchrun):
    """Megatron (DP=2, distributed optimizer) and FSDP: step, save, save again into the same folder over a stale
    shard file, load; a foreign folder is refused; not one warning or WARNING log line on either rank."""
    pytest.importorskip("megatron.core")
    out = torchrun("checkpoint_dir_worker.py", 2, timeout=400)
    for want in ("OK megatron dp=2 dist_opt save twice", "OK megatron refuses", "OK megatron tp=2 step",
                 "OK fsdp dp=2 save twice",
                 "OK fsdp refuses", "OK quiet"):
        assert want in out, f"missing {want!r} in:\n{out}"
