"""The FSDP2 engine: packed (remove-padding) micro-batches, optional HSDP mesh and Ulysses SP, global-count losses."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.utils.rnn import pad_sequence

from backends.base import Engine, Share, register_engine
from backends.config import EngineConfig
from backends.fsdp import checkpoint as ckpt
from backends.fsdp.share import ShareView, read_share
from backends.fsdp.ulysses import check_sp_heads, gather_seq, pad_to_multiple, ulysses_attention
from dispatch.topology import Topology
from backends.comm import allreduce_counts
from protocol.algos.logprob import logprobs_of_targets, response_logit_positions
from backends.model.hf import check_hf_config
from backends.model.llama import LlamaModel
from backends.model.lora import apply_lora, init_adapters, merge_adapters
from backends.optim import StepSnapshot, all_finite, build_lr_scheduler, build_optimizer, clip_grad_norm, lr_factor
from protocol.algos.losses import entropy_bonus, global_counts, kl_loss, policy_loss
from protocol.batch.nested import to_nested

__all__ = ["FSDPEngine", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, key: str, on_gpu: bool) -> torch.dtype:
    """Map a dtype name from config (``auto`` = bf16 on GPU, fp32 on CPU) to a torch dtype."""
    if name == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"{key} must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@register_engine("fsdp")
class FSDPEngine(Engine):
    """FSDP2 (``fully_shard`` per decoder block and at the root) over the project's Llama model.

    Mesh: 1-D over all ranks, or 2-D (replicate x shard) when ``fsdp.fsdp_size`` < world. Ranks are grouped into
    (dp, sp) with ``sp = fsdp.ulysses_sp`` fastest: DP rank = rank // sp, SP rank = rank % sp.
    """

    def __init__(self, config: EngineConfig, topology: Topology | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDPEngine needs torch.distributed.init_process_group to have been called")
        self.config = config
        world, rank = dist.get_world_size(), dist.get_rank()
        self.world_size, self.rank = world, rank
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        fc = config.fsdp
        sp = int(fc.ulysses_sp)
        check_sp_heads(config.model.num_heads, config.model.num_kv_heads, sp)
        if world % sp:
            raise ValueError(f"actor.fsdp.ulysses_sp={sp} must divide the world size {world}")
        fsdp_size = world if fc.fsdp_size in (-1, None) else int(fc.fsdp_size)
        if fsdp_size < 1 or world % fsdp_size:
            raise ValueError(f"actor.fsdp.fsdp_size={fc.fsdp_size} must be -1 or a divisor of the world size {world}")
        self.sp_size = sp
        self._dp_size = world // sp
        self._dp_rank, self.sp_rank = rank // sp, rank % sp
        if topology is not None:
            self._check_topology(topology)
        self.topology = topology
        dev = self.device.type
        if fsdp_size == world:
            self.fsdp_mesh = init_device_mesh(dev, (world,), mesh_dim_names=("fsdp",))
        else:
            self.fsdp_mesh = init_device_mesh(dev, (world // fsdp_size, fsdp_size),
                                              mesh_dim_names=("replicate", "shard"))
        self.dp_sp_mesh = init_device_mesh(dev, (self._dp_size, sp), mesh_dim_names=("dp", "sp"))
        if config.dist_timeout_s is not None:  # mesh groups take torch's default timeout, not the default group's
            for mesh in (self.fsdp_mesh, self.dp_sp_mesh):
                for i in range(mesh.ndim):
                    mesh.get_group(i).set_timeout(timedelta(seconds=float(config.dist_timeout_s)))
        self._dp_group = self.dp_sp_mesh["dp"].get_group()
        self.sp_group = self.dp_sp_mesh["sp"].get_group()
        self._attention = ulysses_attention(self.sp_group) if sp > 1 else None

        torch.manual_seed(config.seed)
        param_dtype = resolve_dtype(fc.param_dtype, "actor.fsdp.param_dtype", on_gpu)
        reduce_dtype = resolve_dtype(fc.reduce_dtype, "actor.fsdp.reduce_dtype", on_gpu)
        self.model = self._build_model(MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        # with LoRA only the adapters train: they alone get gradients, optimizer state and pre-step snapshots
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # a frozen model (a reward model) has nothing to optimise
        self.optimizer = build_optimizer(self.trainable, config.optim) if self.trainable else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim) if self.trainable else None
        self.global_step = 0
        # FSDP averages gradients over all `world` ranks of its mesh. Each DP replica's loss is its share of the
        # step loss (normalised by the global counts); its sp ranks all carry that whole share, and the sequence
        # all-gather's backward sums their sp copies. Scaling by world / sp = dp_size turns the average into the
        # plain sum of the replicas' shares, i.e. the single-process full-batch gradient.
        self.loss_scale = float(self._dp_size)

    # ---- model ----------------------------------------------------------------------------------------------
    def _build_model(self, mp: MixedPrecisionPolicy) -> LlamaModel:
        """The fully sharded model: per decoder block and at the root.

        From a checkpoint (``model.hf_path``) the model is built on the meta device, sharded, materialised empty
        and each rank reads only its own rows from the safetensors files, so no rank holds the full model. A
        random start (no checkpoint) is built whole from the seed (the same weights for every world size).
        With ``actor.lora.rank`` > 0 the target projections get adapters before sharding (FSDP2 shards the frozen
        base and the adapters alike), drawn from the seed after sharding, each rank its own rows.
        """
        cfg, lora, vl = self.config.model, self.config.lora, self.config.vision
        if vl is not None:
            return self._build_vl_model(mp)
        if cfg.hf_path:
            check_hf_config(cfg)
            with torch.device("meta"):
                model = LlamaModel(cfg)
        else:
            model = LlamaModel.from_seed(cfg, self.config.seed).to(self.device)
        if lora.enabled:
            apply_lora(model, lora.spec())
        model.activation_checkpointing = bool(self.config.fsdp.activation_checkpointing)
        for layer in model.layers:
            fully_shard(layer, mesh=self.fsdp_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.fsdp_mesh, mp_policy=mp)
        if cfg.hf_path:
            model.to_empty(device=self.device)
            ckpt.load_hf_shards(model, cfg.hf_path)
        if lora.enabled:
            init_adapters(model, self.config.seed)
        return model

    def _build_vl_model(self, mp: MixedPrecisionPolicy):
        """A vision-language policy (:class:`backends.model.vision.VLModel`) from its folder: each vision block and
        decoder layer sharded, each rank reading its own rows. Ulysses SP and LoRA are not built for it."""
        from backends.model.vision import VLModel, vl_name, vl_state_dict

        vl = self.config.vision
        if self.sp_size > 1 or self.config.lora.enabled:
            raise ValueError("a vision-language policy runs without actor.fsdp.ulysses_sp and actor.lora so far; "
                             "set actor.fsdp.ulysses_sp=1 and actor.lora.rank=0")
        if not vl.text.hf_path:
            raise ValueError("a vision-language policy starts from its Hugging Face folder (model.hf_path)")
        with torch.device("meta"):
            model = VLModel(vl)
        model.activation_checkpointing = bool(self.config.fsdp.activation_checkpointing)
        for block in model.visual.blocks:
            fully_shard(block, mesh=self.fsdp_mesh, mp_policy=mp)
        for layer in model.layers:
            fully_shard(layer, mesh=self.fsdp_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.fsdp_mesh, mp_policy=mp)
        model.to_empty(device=self.device)
        ckpt.load_hf_shards(model, vl.text.hf_path, convert=lambda sd, _: vl_state_dict(sd, vl), rename=vl_name)
        if self.config.freeze_vision_tower:  # no gradients, optimizer state or snapshots for the tower
            model.visual.requires_grad_(False)
        return model

    # ---- topology -------------------------------------------------------------------------------------------
    def _check_topology(self, topology: Topology) -> None:
        dp = getattr(topology, "dp_size", None)
        dpr = topology.dp_rank(self.rank) if hasattr(topology, "dp_rank") else None
        rep = topology.is_reporting(self.rank) if hasattr(topology, "is_reporting") else self.sp_rank == 0
        if dp != self._dp_size or dpr != self._dp_rank or rep != (self.sp_rank == 0):
            raise ValueError(f"topology says dp_size={dp}, dp_rank({self.rank})={dpr}, but the FSDP engine with "
                             f"ulysses_sp={self.sp_size} on {self.world_size} ranks has dp_size={self._dp_size}, "
                             f"dp_rank={self._dp_rank}; build the topology from the same actor.fsdp config")

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_group(self) -> Any:
        return self._dp_group

    @property
    def is_reporting_rank(self) -> bool:
        return self.sp_rank == 0

    # ---- forward ---------------------------------------------------------------------------------------------
    def _logprobs(self, view: ShareView, mb: list[int], temperature: float, with_entropy: bool,
                  entropy_grad: bool = True):
        """Flat log-probs (and entropy) of the response tokens of micro-batch ``mb``, samples in ``mb`` order."""
        ids = torch.cat([view.input_ids[i] for i in mb]).to(self.device, torch.long)
        lens = [view.seq_lens[i] for i in mb]
        rls = [view.response_lens[i] for i in mb]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        cu_cpu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        cu = cu_cpu.to(self.device)
        images = {}
        if self.config.vision is not None:  # [3, T] multimodal positions; the micro-batch's images in sample order
            pos, images = self._vl_inputs(view, mb)
        if self.sp_size == 1:
            lpos, tpos = response_logit_positions(cu_cpu, rls)
            logits = self.model(ids, pos, cu, logits_positions=lpos.to(self.device), **images)  # responses only
            targets = ids.index_select(0, tpos.to(self.device))
            if with_entropy and not entropy_grad:
                lp, _ = logprobs_of_targets(logits, targets, temperature, False)
                with torch.no_grad():
                    _, ent = logprobs_of_targets(logits.detach(), targets, temperature, True)
                return lp, ent
            return logprobs_of_targets(logits, targets, temperature, with_entropy)
        total = ids.shape[0]
        ids_p, pos_p, cu_p, _ = pad_to_multiple(ids, pos, cu, self.sp_size)
        tl = ids_p.shape[0] // self.sp_size
        local = slice(self.sp_rank * tl, (self.sp_rank + 1) * tl)
        logits = self.model(ids_p[local], pos_p[local], cu_p, attention=self._attention)
        labels = torch.roll(ids_p, -1)[local]  # the logits at t predict token t + 1
        z = logits.float() / temperature
        logp = z.log_softmax(-1)
        lp_local = logp.gather(-1, labels[:, None]).squeeze(-1)
        idx = response_logit_positions(cu_cpu, rls)[0].to(self.device)
        lp = gather_seq(lp_local, self.sp_group)[:total].index_select(0, idx)
        ent = None
        if with_entropy:
            zz = z if entropy_grad else z.detach()
            ent_local = torch.logsumexp(zz, -1) - (zz.softmax(-1) * zz).sum(-1)
            ent = gather_seq(ent_local, self.sp_group)[:total].index_select(0, idx)
        return lp, ent

    def _vl_inputs(self, view: ShareView, mb: list[int]) -> tuple[torch.Tensor, dict]:
        """A vision-language micro-batch's [3, T] positions and its images (pixel_values, image_grid_thw) in
        sample order; a sample without images contributes text positions only."""
        from backends.model.vision import packed_vl_inputs

        images = [(view.pixel_values[i], view.image_grid_thw[i]) for i in mb] \
            if view.image_grid_thw is not None else [None] * len(mb)
        return packed_vl_inputs(self.config.vision, [view.input_ids[i] for i in mb], images, self.device)

    def _padded(self, rows: list[torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """Right-padded [m, L] of the rows, built on the host and copied to the device once."""
        return pad_sequence([r.to(dtype) for r in rows], batch_first=True).to(self.device, non_blocking=True)

    # ---- train -----------------------------------------------------------------------------------------------
    def _step_counts(self, view: ShareView, share: Share) -> tuple[float, float, int]:
        """The optimizer step's real token and sequence counts over every DP replica (what a loss is normalised by),
        all-reduced once before the first backward, and this rank's micro-batch count, checked equal on every rank."""
        mask_all = pad_sequence([m.bool() for m in view.response_mask], batch_first=True) if view.n else \
            torch.zeros(0, 0, dtype=torch.bool)
        tokens, seqs = global_counts(mask_all, view.is_padding)
        n_mb = len(share.micro_batches)
        g_tokens, g_seqs, s_mb, s_mb2 = allreduce_counts([tokens, seqs, n_mb, n_mb * n_mb], self._dp_group,
                                                      self.device)
        if s_mb2 * self._dp_size != s_mb * s_mb:
            raise ValueError(f"every DP rank must run the same number of micro-batches; DP rank {self._dp_rank} has "
                             f"{n_mb}, the mean over {self._dp_size} ranks is {s_mb / self._dp_size:g}")
        if n_mb == 0:
            raise ValueError("train_batch got a share with no micro-batches; every DP rank needs at least one")
        return g_tokens, g_seqs, n_mb

    def _apply_gradients(self) -> tuple[float, float, bool, bool]:
        """Clip and step the trainable parameters, then advance the schedule; returns (grad_norm, lr, finite,
        nonfinite). A non-finite gradient norm skips the step; a step that makes a weight non-finite is rolled back
        with ``rollback_nonfinite``."""
        grad_norm, finite = clip_grad_norm(self.trainable, self.config.optim.clip_grad)
        lr = self.lr_scheduler.get_last_lr()[0]
        nonfinite = False
        if finite:
            before = StepSnapshot(self.trainable, [self.optimizer]) if self.config.rollback_nonfinite else None
            self.optimizer.step()
            # a finite gradient can still make a non-finite weight (a huge lr, an update overflowing the dtype)
            nonfinite = not all_finite(self.trainable, device=self.device)
            if nonfinite and before is not None:
                before.restore()
        else:  # a non-finite gradient norm: keep the parameters and the optimizer state, report the skip
            self.optimizer.zero_grad(set_to_none=True)
            nonfinite = True
        self.lr_scheduler.step()
        self.global_step += 1
        return grad_norm, lr, finite, nonfinite

    def train_batch(self, share: Share) -> dict[str, float]:
        """One optimizer step on this replica's share; metrics are global (identical on every rank)."""
        t0 = time.perf_counter()
        lc = self.config.loss
        view = read_share(share, train=True, use_kl_loss=lc.use_kl_loss,
                          max_tokens=self.config.max_token_len_per_gpu)
        temperature = float(getattr(lc, "temperature", 1.0))
        horizon = getattr(lc, "horizon", None)
        g_tokens, g_seqs, n_mb = self._step_counts(view, share)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        want_ent = lc.entropy_coeff != 0
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)  # loss, pg, clipfrac, approx_kl, entropy, kl
        for i, mb in enumerate(share.micro_batches):
            self.model.set_requires_gradient_sync(i == n_mb - 1)
            lp, ent = self._logprobs(view, mb, temperature, with_entropy=True, entropy_grad=want_ent)
            rls = [view.response_lens[j] for j in mb]
            lp_p = pad_sequence(list(lp.split(rls)), batch_first=True)
            ent_p = pad_sequence(list(ent.split(rls)), batch_first=True)
            mask = self._padded([view.response_mask[j] for j in mb], torch.bool)
            if view.is_padding is not None:
                mask = mask & ~view.is_padding[mb].to(self.device)[:, None]
            old = self._padded([view.old_log_probs[j] for j in mb])
            adv = self._padded([view.advantages[j] for j in mb])
            isw = self._padded([view.rollout_is_weights[j] for j in mb]) if view.rollout_is_weights is not None \
                else None
            pg, m = policy_loss(old, lp_p, adv, mask, clip_ratio_low=lc.clip_ratio_low,
                                clip_ratio_high=lc.clip_ratio_high, clip_ratio_c=lc.clip_ratio_c,
                                loss_agg_mode=lc.loss_agg_mode, global_tokens=g_tokens, global_seqs=g_seqs,
                                horizon=horizon, rollout_is_weights=isw)
            loss = pg
            ent_share = entropy_bonus(ent_p, mask, lc.loss_agg_mode, g_tokens, g_seqs, horizon=horizon)
            if want_ent:
                loss = loss - lc.entropy_coeff * ent_share
            kl = torch.zeros((), device=self.device)
            if lc.use_kl_loss:
                ref = self._padded([view.ref_log_prob[j] for j in mb])
                kl = kl_loss(lp_p, ref, mask, lc.kl_loss_type, lc.loss_agg_mode, g_tokens, g_seqs, horizon=horizon)
                loss = loss + lc.kl_loss_coef * kl
            (loss * self.loss_scale).backward()
            sums += torch.stack([x.detach().to(self.device, torch.float64).reshape(())
                                 for x in (loss, pg, m["clipfrac"], m["approx_kl"], ent_share, kl)])
        self.model.set_requires_gradient_sync(True)
        grad_norm, lr, finite, nonfinite = self._apply_gradients()
        tot = allreduce_counts(sums.tolist(), self._dp_group, self.device)
        return {
            "loss": tot[0], "pg_loss": tot[1], "pg_clipfrac": tot[2], "ppo_kl": tot[3], "entropy": tot[4],
            "kl_loss": tot[5], "grad_norm": grad_norm, "lr": lr, "tokens": g_tokens, "seqs": g_seqs,
            "skipped": 0.0 if finite and not nonfinite else 1.0, "nonfinite": float(nonfinite),
            "micro_batches": float(n_mb), "time": time.perf_counter() - t0,
            "global_step": float(self.global_step),
        }

    # ---- infer -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def infer_batch(self, share: Share, *, temperature: float = 1.0, with_entropy: bool = False):
        """Log-probs (and entropy) of every response token, jagged, in share order, on SP rank 0 of each replica."""
        view = read_share(share, train=False, max_tokens=self.config.max_token_len_per_gpu)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
        self.model.eval()
        lps: list[torch.Tensor | None] = [None] * view.n
        ents: list[torch.Tensor | None] = [None] * view.n
        try:
            for mb in share.micro_batches:
                lp, ent = self._logprobs(view, mb, temperature, with_entropy)
                rls = [view.response_lens[j] for j in mb]
                for j, x in zip(mb, lp.split(rls)):
                    lps[j] = x.float().cpu()
                if with_entropy:
                    for j, x in zip(mb, ent.split(rls)):
                        ents[j] = x.float().cpu()
        finally:
            self.model.train()
            ckpt.reshard(self.model)  # a no-grad forward leaves the root's parameters gathered: free them
        if not self.is_reporting_rank:
            return None
        out = {"log_probs": to_nested(lps)}
        if with_entropy:
            out["entropy"] = to_nested(ents)
        return TensorDict(out, batch_size=[view.n])

    # ---- weights and checkpoints -----------------------------------------------------------------------------
    def _adapted_modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Full weights in the base layout; a LoRA actor's are merged, ``W + (alpha / rank) B A``."""
        weights = ckpt.full_weights(self.model)  # fresh copies: merged in place
        return merge_adapters(weights, self.config.lora.spec().scale, inplace=True) if self.has_adapters else weights

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """Full weights with the adapters apart (``...q_proj.weight``, ``...q_proj.lora_A``, ``...lora_B``)."""
        return ckpt.full_weights(self.model)

    def set_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full weights in the model's own names (a LoRA actor's include ``lora_A`` / ``lora_B``)."""
        ckpt.load_full_weights(self.model, state_dict)

    def save_checkpoint(self, path: str, extra_state: dict | None = None) -> None:
        ckpt.save(path, self.model, self.optimizer, self.lr_scheduler, self.global_step, extra_state)

    def load_checkpoint(self, path: str) -> dict:
        self.global_step, extra = ckpt.load(path, self.model, self.optimizer, self.lr_scheduler)
        # the optimizer settings are this engine's config, not the saved ones (a resume may change lr or decay)
        oc = self.config.optim
        self.lr_scheduler.base_lrs = [oc.lr for _ in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["initial_lr"], g["lr"] = oc.lr, oc.lr * lr_factor(self.lr_scheduler.last_epoch, oc)
            g["weight_decay"] = oc.weight_decay
            if "betas" in g:
                g["betas"], g["eps"] = tuple(oc.betas), oc.eps
        self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        return extra
