"""megatron-core GPTModel built to the project's decoder architecture (RMSNorm, SwiGLU, rotary, GQA, q/k/v bias, q/k norm).

Rotary frequencies are the project's own (``backends.model.llama.rope_inv_freq``) installed in megatron-core's
RotaryEmbedding: its ``rope_scaling`` flag fixes the llama3 low/high frequency factors and the original context length
(1, 4, 8192) and its linear interpolation divides positions rather than frequencies, so neither matches every
Hugging Face checkpoint bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.config import MegatronConfig
from backends.model.config import ModelConfig
from backends.model.llama import rope_inv_freq
from protocol.config import ConfigError

__all__ = ["MegatronModelError", "check_model_fits", "transformer_config", "layer_spec", "build_model_chunks",
           "install_rotary", "te_available", "TE_RENAMES"]

# local-spec parameter names -> transformer-engine spec names (the TE spec fuses each pre-norm into the next linear)
TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class MegatronModelError(ConfigError):
    """The model and the Megatron parallel degrees do not fit together; the message names the keys."""


def te_available() -> bool:
    """True when transformer-engine and CUDA are both present (then the TE layer spec is used)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_model_fits(model: ModelConfig, par: MegatronConfig) -> None:
    """Raise :class:`MegatronModelError` when heads, kv heads, vocabulary or layers do not split over TP / PP / VPP."""
    tp, pp, vpp = par.tp, par.pp, par.vpp
    for key in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
        if getattr(model, key) % tp:
            why = "; replicated kv heads are not supported" if key == "num_kv_heads" else ""
            raise MegatronModelError(f"actor.megatron.tp={tp} does not divide model.{key}={getattr(model, key)}: "
                                     f"tensor parallelism splits it evenly over the TP ranks{why}")
    if vpp > 1 and pp < 2:
        raise MegatronModelError(f"actor.megatron.vpp={vpp} needs actor.megatron.pp >= 2, got pp={pp}")
    if model.num_layers % (pp * vpp):
        raise MegatronModelError(
            f"actor.megatron.pp x actor.megatron.vpp = {pp} x {vpp} = {pp * vpp} does not divide "
            f"model.num_layers={model.num_layers}: every pipeline stage holds the same number of layers")
    if par.sequence_parallel and not te_available():
        raise MegatronModelError("actor.megatron.sequence_parallel=true needs transformer-engine on a GPU (fused "
                                 "norms); set it to false")
    if par.cp > 1 and not te_available():
        raise MegatronModelError(f"actor.megatron.cp={par.cp} needs transformer-engine attention on a GPU; set "
                                 f"actor.megatron.cp=1")


def transformer_config(model: ModelConfig, par: MegatronConfig, *, dtype: torch.dtype = torch.float32):
    """The megatron-core TransformerConfig equal in architecture to :class:`backends.model.llama.LlamaModel`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_model_fits(model, par)
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # weights come from the project's model through the converter, but megatron-core only tags TP-sharded
        # parameters (needed for grad norms and checkpoints) on its initialisation path, so keep it on
        perform_initialization=True,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher that accepts variable sequence lengths
        # micro-batches are padded to their own longest sequence; the interleaved schedule (VPP) cannot exchange
        # varying shapes, so there every micro-batch of a call is padded to one shape instead
        variable_seq_lengths=par.vpp == 1,
        # with virtual pipeline stages over gloo, batched p2p silently gives wrong results
        batch_p2p_comm=not (par.vpp > 1 and not on_gpu),
        calculate_per_token_loss=True,  # the loss function already divides by the step's global counts
        deallocate_pipeline_outputs=False,
        cuda_graph_scope=[],  # no CUDA graphs; megatron-core's default "full" is deprecated (it asks for [])
    )


def layer_spec(model: ModelConfig, *, use_te: bool | None = None):
    """transformer-engine layer spec where CUDA and TE are present, megatron-core's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = te_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)  # norm type from the config
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=model.qk_norm)


def install_rotary(gpt, model: ModelConfig) -> None:
    """Give ``gpt``'s rotary embedding the project's inverse frequencies for ``model.rope_type`` (exact HF rope)."""
    rot = getattr(gpt, "rotary_pos_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise MegatronModelError(f"the megatron-core GPTModel has no rotary embedding to receive model.rope_type="
                                 f"{model.rope_type!r}")
    inv = rope_inv_freq(model)
    if tuple(rot.inv_freq.shape) != tuple(inv.shape):
        raise MegatronModelError(f"megatron-core rotary has {tuple(rot.inv_freq.shape)} frequencies, model.head_dim="
                                 f"{model.head_dim} needs {tuple(inv.shape)}")
    rot.inv_freq = inv.to(rot.inv_freq.device)


def build_model_chunks(model: ModelConfig, par: MegatronConfig, tcfg, *, use_te: bool | None = None) -> list:
    """One GPTModel per virtual pipeline stage of this rank (one chunk when VPP is off), on this rank's device."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(model, use_te=use_te)
    cpu_rng = torch.get_rng_state()  # CPU initialisation draws from the global generator: leave it as found
    chunks = []
    n_vp = par.vpp if par.vpp > 1 else 1
    for vp in range(n_vp):
        vp_stage = vp if par.vpp > 1 else None
        gpt = GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=model.rope_theta,
            vp_stage=vp_stage,
        )
        install_rotary(gpt, model)
        if torch.cuda.is_available():
            gpt = gpt.cuda()
        chunks.append(gpt)
    torch.set_rng_state(cpu_rng)
    return chunks
