"""The megatron-core engine: TP / PP / VPP / CP / DP parallel state, GPTModel chunks, the pipeline schedule and the
distributed optimizer behind the project's :class:`backends.base.Engine` interface.

megatron-core keeps its parallel state in module globals; they live only inside this package. One engine per
process at a time: :meth:`MegatronEngine.close` tears the state down so tests can build another configuration.
"""
from __future__ import annotations

import math
import time
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from backends.base import Engine, Share, register_engine
from backends.config import EngineConfig, EngineConfigError
from backends.megatron import checkpoint as ckpt
from backends.megatron.batch import MicroBatch, ShareError, make_micro_batch, share_lengths
from backends.megatron.convert import ConversionError, expected_project_names, from_megatron_shards, to_megatron_shard
from backends.megatron.cpu_shim import apply_cpu_shim
from backends.megatron.logprob import vocab_parallel_logprobs_entropy
from backends.megatron.lora import apply_megatron_lora
from backends.megatron.model import TE_RENAMES, build_model_chunks, te_available, transformer_config
from backends.model.lora import LoraSpec, merge_adapters, seeded_adapters
from backends.optim import StepSnapshot, all_finite, lr_factor
from dispatch.topology import Topology
from protocol.algos.losses import entropy_bonus, kl_loss, policy_loss
from protocol.batch.nested import to_nested

__all__ = ["MegatronEngine", "TopologyMismatch", "parallel_coords", "check_engine_config"]

_TRAIN_FIELDS = ("old_log_probs", "advantages")


class TopologyMismatch(ValueError):
    """The dispatch layer's topology disagrees with the engine config or with megatron-core's parallel state."""


def parallel_coords() -> dict[str, int]:
    """This rank's coordinates as megatron-core's parallel state sees them (dp excludes cp, as logical DP does)."""
    from megatron.core import parallel_state as ps

    return {
        "dp": ps.get_data_parallel_rank(with_context_parallel=False),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(with_context_parallel=False),
    }


def check_engine_config(config: EngineConfig) -> None:
    """Refuse configurations the megatron engine cannot run, before any parallel state is created (the run checks
    them when it loads its config, so every rank stops there with the same one-line message)."""
    from backends.megatron.model import check_model_fits

    par, opt = config.megatron, config.optim
    if config.lora.enabled and par.sequence_parallel:
        raise EngineConfigError(f"actor.lora.rank={config.lora.rank} with actor.megatron.sequence_parallel=true: "
                                f"the megatron LoRA layers run megatron-core's local layer spec, which has no "
                                f"sequence parallelism here; set actor.megatron.sequence_parallel=false")
    for key in ("tp", "pp", "vpp", "cp"):
        if int(getattr(par, key)) < 1:
            raise EngineConfigError(f"actor.megatron.{key} must be >= 1, got {getattr(par, key)}")
    if par.dynamic_cp:
        raise EngineConfigError("actor.megatron.dynamic_cp=true is not supported by the megatron engine; set it to "
                                "false")
    if par.cp > 1:
        raise EngineConfigError(f"actor.megatron.cp={par.cp}: context parallel is not implemented by this engine yet "
                                f"(it needs per-rank THD sequence partitioning on GPU); set actor.megatron.cp=1")
    if par.ep != 1 or par.etp != 1:
        raise EngineConfigError(f"actor.megatron.ep / actor.megatron.etp must be 1 for the dense decoder, got "
                                f"ep={par.ep}, etp={par.etp}")
    if par.use_distributed_optimizer and opt.name != "adamw":
        raise EngineConfigError(f"actor.megatron.use_distributed_optimizer=true needs actor.optim.name='adamw' "
                                f"(megatron-core's distributed optimizer supports Adam only), got "
                                f"{opt.name!r}; set actor.megatron.use_distributed_optimizer=false to use SGD")
    check_model_fits(config.model, par)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


@register_engine("megatron")
class MegatronEngine(Engine):
    """megatron-core engine; ``MegatronEngine(config, topology)`` after ``torch.distributed.init_process_group``.

    Weights start from ``initial_model(config.model, config.seed)`` (a checkpoint or a seeded init) converted to megatron-core's layout,
    so both backends begin from the same model.
    """

    def __init__(self, config: EngineConfig, topology: Topology) -> None:
        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine needs torch.distributed.init_process_group() to have been called")
        self.config = config
        self.topology = topology
        par = config.megatron
        self._check_topology_config(topology, par)
        check_engine_config(config)
        apply_cpu_shim()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        # LoRA adapts megatron-core's local-spec linears (TE's fused norm + linear hides the normed input an
        # adapter needs), so an adapted model runs the local spec even where transformer-engine is present
        self.use_te = te_available() and not config.lora.enabled
        self.packed = self.use_te  # THD packed sequences need the TE attention kernels
        self._closed = False
        self._owns_state = not ps.model_parallel_is_initialized()
        if not self._owns_state:
            self._join_parallel_state(par)
        else:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=par.tp,
                pipeline_model_parallel_size=par.pp,
                virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
                context_parallel_size=par.cp,
                expert_model_parallel_size=par.ep,
                expert_tensor_parallel_size=par.etp,
                **({} if config.dist_timeout_s is None else
                   {"distributed_timeout_minutes": float(config.dist_timeout_s) / 60.0}),
            )
        try:
            if self._owns_state:
                model_parallel_cuda_manual_seed(int(config.seed))
            self._check_topology_parallel_state(topology)
            self.tcfg = transformer_config(config.model, par,
                                           dtype=torch.bfloat16 if self.use_te else torch.float32)
            chunks = self._build_chunks()
            self._build_ddp_and_optimizer(chunks)
            self.set_weights(self._initial_weights())
        except BaseException:
            if self._owns_state:
                ps.destroy_model_parallel()
            raise
        self.step = 0

    # ------------------------------------------------------------------ set-up
    #: True for an engine that may run beside another one in the same process (the critic beside the actor): it
    #: joins megatron-core's parallel state when one exists, which must have its degrees, and leaves it at close()
    joins_parallel_state: ClassVar[bool] = False

    def _join_parallel_state(self, par) -> None:
        from megatron.core import parallel_state as ps

        if not self.joins_parallel_state:
            raise RuntimeError("megatron-core parallel state is already initialised in this process; close() the "
                               "previous MegatronEngine first")
        have = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                "cp": ps.get_context_parallel_world_size()}
        want = {key: int(getattr(par, key)) for key in have}
        if have != want:
            raise TopologyMismatch(f"{type(self).__name__} joins this process's megatron-core parallel state, which "
                                   f"has degrees {have}; its config asks for {want}")

    @property
    def _lora(self) -> LoraSpec | None:
        return self.config.lora.spec() if self.config.lora.enabled else None

    def _build_chunks(self) -> list:
        """The model chunks; with ``actor.lora`` their target linears adapted and every other weight frozen."""
        chunks = build_model_chunks(self.config.model, self.config.megatron, self.tcfg, use_te=self.use_te)
        if self._lora is not None:
            for chunk in chunks:
                apply_megatron_lora(chunk, self.config.model, self._lora, self.config.megatron.tp)
        return chunks

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        """The project-layout weights the engine starts from (a checkpoint or the seeded initial policy; with LoRA
        also the seeded adapters, the same as the FSDP engine draws)."""
        from backends.model.hf import initial_model

        weights = initial_model(self.config.model, int(self.config.seed)).state_dict()
        if self._lora is not None:
            weights.update(seeded_adapters(self.config.model, self._lora, int(self.config.seed)))
        return weights

    def _to_shard(self, sd: dict[str, torch.Tensor], **where) -> dict[str, torch.Tensor]:
        return to_megatron_shard(sd, self.config.model, lora=self._lora, **where)

    def _from_shards(self, shards: list[dict], layers: list[int]) -> dict[str, torch.Tensor]:
        return from_megatron_shards(shards, self.config.model, layers=layers)

    def _expected_names(self) -> list[str]:
        return expected_project_names(self.config.model, self._lora)

    @staticmethod
    def _check_topology_config(topology: Topology, par) -> None:
        if getattr(topology, "backend", "megatron") != "megatron":
            raise TopologyMismatch(f"topology.backend is {topology.backend!r}; the megatron engine needs a "
                                   "topology built with backend='megatron'")
        for key in ("tp", "pp", "vpp", "cp", "ep"):
            want = getattr(par, key)
            got = getattr(topology, key, want)
            if int(got) != int(want):
                raise TopologyMismatch(f"topology.{key} = {got} but megatron.{key} = {want}; build the topology "
                                       "from the same megatron config section")
        world = dist.get_world_size()
        if int(getattr(topology, "world_size", world)) != world:
            raise TopologyMismatch(f"topology.world_size = {topology.world_size} but torch.distributed has "
                                   f"{world} ranks")

    def _check_topology_parallel_state(self, topology: Topology) -> None:
        """Every rank's (dp, tp, pp, cp, reporting) from megatron-core must equal the dispatch layer's."""
        mine = parallel_coords()
        from megatron.core import parallel_state as ps

        mine["reporting"] = int(mine["tp"] == 0 and mine["cp"] == 0 and ps.is_pipeline_last_stage(ignore_virtual=True))
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)
        if int(topology.dp_size) != mine["dp_size"]:
            raise TopologyMismatch(f"topology.dp_size = {topology.dp_size} but megatron-core's data-parallel size "
                                   f"is {mine['dp_size']}")
        for rank, got in enumerate(gathered):
            want_dp = int(topology.dp_rank(rank))
            coords = topology.coords(rank)
            want = {"dp": want_dp}
            for key in ("tp", "pp", "cp"):
                if key in coords:
                    want[key] = int(coords[key])
            want["reporting"] = int(bool(topology.is_reporting(rank)))
            for key, value in want.items():
                if got[key] != value:
                    raise TopologyMismatch(
                        f"global rank {rank}: dispatch says {key} = {value}, megatron-core's parallel state says "
                        f"{got[key]} (dispatch {want}, megatron-core {got})")

    def _build_ddp_and_optimizer(self, chunks: list) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        par, opt = self.config.megatron, self.config.optim
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=par.use_distributed_optimizer, check_for_nan_in_grad=False,
        )
        self.chunks = [
            DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]

        def finalize(model, num_tokens, **kwargs):
            # the loss already divides by the step's global token / sequence counts: sum gradients, no rescale
            finalize_model_grads(model, None, **kwargs)

        self.tcfg.finalize_model_grads_func = finalize
        self.tcfg.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        self.tcfg.grad_sync_func = None
        self.tcfg.param_sync_func = None
        ocfg = OptimizerConfig(
            optimizer="adam" if opt.name == "adamw" else "sgd",
            lr=opt.lr, min_lr=opt.lr * opt.min_lr_ratio, weight_decay=opt.weight_decay,
            adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_eps=opt.eps, decoupled_weight_decay=True,
            sgd_momentum=0.0, clip_grad=opt.clip_grad,
            bf16=self.tcfg.bf16, params_dtype=self.tcfg.params_dtype,
            use_distributed_optimizer=par.use_distributed_optimizer,
        )
        # no per-parameter overrides: weight decay applies to every parameter (norms included), exactly like
        # backends.optim.build_optimizer, so both engines take the same step
        self.optimizer = get_megatron_optimizer(ocfg, self.chunks, config_overrides={})
        self._sub_optimizers = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def close(self) -> None:
        """Release the model, optimizer and megatron-core's parallel state (another engine may be built after); an
        engine that joined another's parallel state leaves it to that one."""
        if self._closed:
            return
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as tp_random

        self.chunks, self.optimizer, self._sub_optimizers = [], None, []
        dist.barrier()
        if self._owns_state:
            ps.destroy_model_parallel()
            tp_random.initialize_rng_tracker(force_reset=True)
        self._closed = True

    # ------------------------------------------------------------------ interface: parallel facts
    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size(with_context_parallel=False)

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(with_context_parallel=False)

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=False)

    @property
    def is_reporting_rank(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                and ps.is_pipeline_last_stage(ignore_virtual=True))

    # ------------------------------------------------------------------ weights
    def _chunk_layout(self, chunk) -> tuple[list[int], bool, bool]:
        gpt = _unwrap(chunk)
        layers = [int(layer.layer_number) - 1 for layer in gpt.decoder.layers] if hasattr(gpt, "decoder") else []
        return layers, bool(gpt.pre_process), bool(gpt.post_process)

    def _param_name(self, gpt, name: str) -> str:
        if not self.use_te:
            return name
        for local, te in TE_RENAMES.items():
            if name.endswith(local):
                return name[: -len(local)] + te
        return name

    @torch.no_grad()
    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        from megatron.core import parallel_state as ps

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        sd = {k: v.detach().to("cpu", torch.float32) for k, v in state_dict.items()}
        for chunk in self.chunks:
            layers, pre, post = self._chunk_layout(chunk)
            shard = self._to_shard(sd, tp_rank=tp_rank, tp_size=tp, layers=layers, pre_process=pre,
                                   post_process=post)
            gpt = _unwrap(chunk)
            params = dict(gpt.named_parameters())
            for name, value in shard.items():
                pname = self._param_name(gpt, name)
                if pname not in params:
                    raise ConversionError(f"converted weight {name!r} has no parameter {pname!r} in the megatron "
                                          f"model chunk (has {sorted(params)[:8]}...)")
                p = params.pop(pname)
                if tuple(p.shape) != tuple(value.shape):
                    raise ConversionError(f"converted weight {name!r} has shape {tuple(value.shape)}, the megatron "
                                          f"parameter {pname!r} has {tuple(p.shape)}")
                p.copy_(value.to(p.device, p.dtype))
            if params:
                raise ConversionError(f"megatron parameters not set by the converter: {sorted(params)}")
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def _adapted_modules(self) -> list[torch.nn.Module]:
        return list(self.chunks)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights in the project layout on every rank; a LoRA actor's are merged, ``W + (alpha / rank) B A``."""
        weights = self.adapter_weights()
        return merge_adapters(weights, self._lora.scale, inplace=True) if self._lora is not None else weights

    @torch.no_grad()
    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """Full weights in the project layout, a LoRA actor's adapters apart (``...q_proj.lora_A`` / ``lora_B``)."""
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
        tp = ps.get_tensor_model_parallel_world_size()
        full: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            layers, _, _ = self._chunk_layout(chunk)
            gpt = _unwrap(chunk)
            inverse = {self._param_name(gpt, n): n for n in _canonical_names(gpt)}
            local = {inverse.get(n, n): p.detach().to("cpu", torch.float32).clone()
                     for n, p in gpt.named_parameters()}
            shards: list[dict] = [None] * tp  # type: ignore[list-item]
            dist.all_gather_object(shards, local, group=tp_group)
            full.update(self._from_shards(shards, layers))
        parts: list[dict] = [None] * ps.get_pipeline_model_parallel_world_size()  # type: ignore[list-item]
        dist.all_gather_object(parts, full, group=ps.get_pipeline_model_parallel_group())
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update(part)
        missing = sorted(set(self._expected_names()) - set(out))
        if missing:
            raise ConversionError(f"gathered megatron weights lack {missing}")
        return out

    # ------------------------------------------------------------------ forward / backward
    def _micro_batches(self, share: Share, fields: tuple[str, ...]) -> list[MicroBatch]:
        if not isinstance(share, Share):
            raise TypeError(f"expected a backends.base.Share, got {type(share).__name__}")
        par = self.config.megatron
        n_mb = len(share.micro_batches)
        if par.vpp > 1 and n_mb % par.pp:
            raise ShareError(f"with megatron.vpp = {par.vpp} the micro-batch count must be a multiple of "
                             f"megatron.pp = {par.pp}; the share has {n_mb} micro-batches")
        budget = self.config.max_token_len_per_gpu
        seq, _ = share_lengths(share.data)
        pad_to = None
        multiple = par.tp if par.sequence_parallel else 1  # sequence parallel splits tokens over TP ranks
        if par.vpp > 1:  # the interleaved schedule needs one activation shape for all micro-batches
            if self.packed:
                longest = max(int(seq[mb].sum()) for mb in share.micro_batches if mb)
                pad_to = (1, -(-longest // multiple) * multiple)
            else:
                pad_to = (max(len(mb) for mb in share.micro_batches),
                          max(int(seq[mb].max()) for mb in share.micro_batches if mb))
        out = []
        for k, mb in enumerate(share.micro_batches):
            if budget is not None:
                tokens = int(seq[mb].sum())
                if tokens > budget:
                    raise ShareError(f"micro-batch {k} holds {tokens} tokens, over max_token_len_per_gpu = {budget}")
            out.append(make_micro_batch(share.data, mb, response_fields=fields, packed=self.packed,
                                        pad_multiple=multiple, pad_to=pad_to,
                                        device=self.device))
        return out

    def _token_outputs(self, logits: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool):
        from megatron.core import parallel_state as ps

        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local).index_select(0, mb.logit_index)
        tp = ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        return vocab_parallel_logprobs_entropy(
            flat, mb.target_ids, vocab_start=ps.get_tensor_model_parallel_rank() * v_local, group=group,
            temperature=temperature, with_entropy=with_entropy)

    def _run_schedule(self, mbs: list[MicroBatch], loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
            return out, partial(loss_func, mb)

        fwd_bwd = get_forward_backward_func()
        iters = [iter(mbs) for _ in self.chunks]
        return fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(mbs),
            seq_length=max(mb.seq_len for mb in mbs),
            micro_batch_size=max(mb.batch for mb in mbs),
            forward_only=forward_only,
        )

    def _forward_only(self, mbs: list[MicroBatch], loss_func) -> list | None:
        """The schedule run forward only, in eval mode; each micro-batch's outputs on the replica's reporting rank,
        None elsewhere."""
        for c in self.chunks:
            c.eval()
        store = self._run_schedule(mbs, loss_func, forward_only=True)
        for c in self.chunks:
            c.train()
        return store if self.is_reporting_rank else None

    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False) -> TensorDict | None:
        mbs = self._micro_batches(share, ())

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            logp, ent = self._token_outputs(logits, mb, temperature, with_entropy)
            out = {"log_probs": logp.float().cpu()}
            if with_entropy:
                out["entropy"] = ent.float().cpu()
            return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), out

        store = self._forward_only(mbs, loss_func)
        if store is None:
            return None
        n = share.data.batch_size[0]
        per_sample: dict[str, list] = {"log_probs": [None] * n}
        if with_entropy:
            per_sample["entropy"] = [None] * n
        for mb, out in zip(mbs, store):
            for key in per_sample:
                for pos, vals in zip(mb.positions, torch.split(out[key], mb.response_lens)):
                    per_sample[key][pos] = vals
        return TensorDict({k: to_nested(v) for k, v in per_sample.items()}, batch_size=[n])

    def _global_counts(self, mbs: list[MicroBatch]) -> tuple[float, float]:
        """The step's (tokens, sequences) over all micro-batches and DP replicas, all-reduced once before backward.

        Counted over the DP group only: the TP / PP / CP ranks of a replica hold the same share and must not count
        it twice. Also checks that every DP rank runs the same number of micro-batches.
        """
        tokens = seqs = 0.0
        for mb in mbs:
            mask = mb.fields["response_mask"].bool()
            real = ~mb.is_padding if mb.is_padding is not None else torch.ones(mb.num_samples, dtype=torch.bool,
                                                                                 device=mask.device)
            tokens += float((mask & real[:, None]).sum())
            seqs += float(real.sum())
        n_mb = float(len(mbs))
        t = torch.tensor([tokens, seqs, n_mb, n_mb * n_mb], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        if float(t[3]) * self.dp_size != float(t[2]) ** 2:
            raise ShareError(f"every DP rank must run the same number of micro-batches; DP rank {self.dp_rank} has "
                             f"{len(mbs)}, the mean over {self.dp_size} ranks is {float(t[2]) / self.dp_size:g}")
        return float(t[0]), float(t[1])

    def _loss(self, mb: MicroBatch, logits: torch.Tensor, counts: tuple[float, float]):
        """This micro-batch's share of the step loss (policy, entropy bonus, KL) and its metric shares."""
        lcfg = self.config.loss
        temperature = float(getattr(lcfg, "temperature", 1.0))
        horizon = getattr(lcfg, "horizon", None)
        logp, ent = self._token_outputs(logits, mb, temperature, True)  # entropy is always reported
        rmax = mb.fields["response_mask"].shape[1]

        def pad(flat: torch.Tensor) -> torch.Tensor:
            rows = torch.split(flat, mb.response_lens)
            return torch.stack([torch.nn.functional.pad(r, (0, rmax - r.numel())) for r in rows])

        mask = mb.fields["response_mask"].bool()
        if mb.is_padding is not None:
            mask = mask & ~mb.is_padding[:, None]
        tokens, seqs = counts
        logp_pad = pad(logp)
        pg, m = policy_loss(mb.fields["old_log_probs"], logp_pad, mb.fields["advantages"], mask,
                            clip_ratio_low=lcfg.clip_ratio_low, clip_ratio_high=lcfg.clip_ratio_high,
                            clip_ratio_c=lcfg.clip_ratio_c, loss_agg_mode=lcfg.loss_agg_mode,
                            global_tokens=tokens, global_seqs=seqs, horizon=horizon,
                            rollout_is_weights=mb.fields.get("rollout_is_weights"))
        loss = pg
        ent_share = entropy_bonus(pad(ent), mask, lcfg.loss_agg_mode, tokens, seqs, horizon=horizon)
        if lcfg.entropy_coeff != 0.0:
            loss = loss - lcfg.entropy_coeff * ent_share
        kl = torch.zeros((), device=loss.device)
        if lcfg.use_kl_loss:
            kl = kl_loss(logp_pad, mb.fields["ref_log_prob"], mask, lcfg.kl_loss_type, lcfg.loss_agg_mode,
                         tokens, seqs, horizon=horizon)
            loss = loss + lcfg.kl_loss_coef * kl
        metrics = torch.stack([x.detach().float().reshape(()) for x in
                               (loss, pg, m["clipfrac"], m["approx_kl"], ent_share, kl)]).cpu()
        return loss, torch.tensor(1, dtype=torch.int), {"metrics": metrics}

    def train_batch(self, share: Share) -> dict[str, float]:
        fields = _TRAIN_FIELDS + (("ref_log_prob",) if self.config.loss.use_kl_loss else ()) \
            + (("rollout_is_weights",) if "rollout_is_weights" in share.data.keys() else ())
        sums, common = self._train_step(share, fields, _call_loss, 6)
        names = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss")
        return {**{k: float(v) for k, v in zip(names, sums.tolist())}, **common}

    def _train_step(self, share: Share, fields: tuple[str, ...], loss_call, n_sums: int
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One optimizer step over the share's micro-batches, ``loss_call(engine, counts, ...)`` as the schedule's
        loss; returns the step's ``n_sums`` metric sums (each replica's reporting rank adds its own) and the fields
        every engine reports (grad norm, lr, counts, skip flags, time, step)."""
        t0 = time.perf_counter()
        mbs = self._micro_batches(share, fields)
        counts = self._global_counts(mbs)
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run_schedule(mbs, partial(loss_call, self, counts), forward_only=False)
        lr = self.config.optim.lr * lr_factor(self.step, self.config.optim)
        for opt in self._sub_optimizers:
            for g in opt.param_groups:
                g["lr"] = lr
        grad_norm, skipped, nonfinite = self._optimizer_step()
        self.step += 1
        local = torch.zeros(n_sums, dtype=torch.float64)
        if self.is_reporting_rank:
            for out in store:
                local += out["metrics"].double()
        local = local.to(self.device)
        dist.all_reduce(local)  # reporting ranks hold one replica each: the sum is the step's value
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return local, {"grad_norm": float(grad_norm), "lr": lr, "tokens": counts[0], "seqs": counts[1],
                       "skipped": float(skipped), "nonfinite": float(nonfinite), "micro_batches": float(len(mbs)),
                       "time": float(elapsed), "global_step": float(self.step)}

    @torch.no_grad()
    def _optimizer_step(self) -> tuple[float, bool, bool]:
        """Prepare grads, norm, skip on a non-finite norm, else clip and step; a step that leaves a non-finite
        weight is rolled back (``rollback_nonfinite``). Returns (pre-clip norm, skipped, non-finite)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.optimizer.zero_grad()
            return grad_norm, True, True
        clip = self.config.optim.clip_grad
        for opt in self._sub_optimizers:
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=grad_norm)
        inner = [getattr(opt, "optimizer", opt) for opt in self._sub_optimizers]
        model_params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]  # LoRA: the adapters
        main_params = [p for o in inner for g in o.param_groups for p in g["params"]]
        before = StepSnapshot(model_params + main_params, inner) if self.config.rollback_nonfinite else None
        self.optimizer.step_with_ready_grads()
        if all_finite(model_params, device=self.device):
            return grad_norm, False, False
        if before is not None:
            before.restore()
        return grad_norm, True, True

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None:
        ckpt.save(self, path, extra_state or {})

    def load_checkpoint(self, path: str) -> dict:
        return ckpt.load(self, path)


def _call_loss(engine: MegatronEngine, counts, mb: MicroBatch, logits: torch.Tensor):
    return engine._loss(mb, logits, counts)


def _canonical_names(gpt) -> list[str]:
    names = []
    for n, _ in gpt.named_parameters():
        for local, te in TE_RENAMES.items():
            if n.endswith(te):
                n = n[: -len(te)] + local
        names.append(n)
    return names
