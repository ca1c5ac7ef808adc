"""From a t2train ``Config`` to Megatron's ``TransformerConfig`` and this rank's model chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from t2train.config.schema import Config, ModelConfig
from t2train.parallel.depth_cache import DepthCache
from t2train.parallel.hop_plan import HopPlan, plan_hops

if TYPE_CHECKING:
    # for annotations only: the model's modules, not for the config helpers `t2train plan` reads
    from t2train.model.gpt import T2GPTModel


@dataclass
class T2TransformerConfig(TransformerConfig):
    """Megatron's config plus the fields t2train's own modules read."""

    t2_attention_backend: str = "auto"
    t2_model: Optional[ModelConfig] = None  # the decoder hands it to the designs' modules
    t2_cached_hops: bool = False  # hops skip units the receiving rank kept (depth cache)
    t2_hop_shapes: str = "exact"  # parallel.hop_shapes: exact or padded
    t2_fused_loss: bool = False  # model.fusions: the loss without an fp32 copy of the logits
    t2_selective_recompute: bool = False  # model.recompute=selective (t2train/nn/recompute.py)


def compute_dtype(config: Config) -> torch.dtype:
    """bf16 on CUDA and fp32 on CPU unless ``train.precision`` says otherwise (fp8 runs keep
    bf16 parameters and activations: only their GEMMs' operands are cast)."""
    precision = config.train.precision_on(torch.cuda.is_available())
    return torch.float32 if precision == "fp32" else torch.bfloat16


def fusions_on(config: Config) -> bool:
    """``model.fusions`` resolved: ``auto`` is ``all`` with CUDA, ``none`` on the CPU."""
    fusions = config.model.fusions
    return fusions == "all" or (fusions == "auto" and torch.cuda.is_available())


def transformer_config(config: Config) -> T2TransformerConfig:
    model, parallel = config.model, config.parallel
    dtype = compute_dtype(config)
    on_cuda = torch.cuda.is_available()
    fused = fusions_on(config)
    return T2TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,  # None: Megatron's hidden_size / num_attention_heads
        ffn_hidden_size=model.resolved_ffn_hidden_size(),
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=(
            parallel.virtual_pipeline if parallel.virtual_pipeline > 1 else None
        ),
        sequence_parallel=parallel.sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        # the spec adds the norms; this makes finalize_model_grads sum their gradients over
        # the tensor ranks (each holds other heads)
        qk_layernorm=model.qk_norm,
        hidden_dropout=model.dropout,
        attention_dropout=model.dropout,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_cuda,
        # Megatron's SwiGLU as one compiled function (its jit_fuser is torch.compile). Its
        # RoPE and cross-entropy fusions need Transformer Engine, or cast the gradient to bf16
        # whatever the precision: the loss is t2train's own (t2_fused_loss).
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        recompute_granularity="full" if model.recompute == "full" else None,
        recompute_method="uniform" if model.recompute == "full" else None,
        recompute_num_layers=1 if model.recompute == "full" else None,
        deallocate_pipeline_outputs=True,
        # Batched isend/irecv to one peer can be matched out of order on gloo.
        batch_p2p_comm=on_cuda,
        t2_attention_backend=model.attention_backend,
        t2_model=model,
        t2_cached_hops=parallel.caches_depth_units(),
        t2_hop_shapes=parallel.hop_shapes,
        t2_fused_loss=fused,
        t2_selective_recompute=model.recompute == "selective",
    )


def build_model_chunks(
    config: Config, tf_config: T2TransformerConfig, vocab_size: int, hops: Optional[HopPlan] = None
) -> list[T2GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving),
    each sending and receiving its hops as ``hops`` says (the run's plan; made here when the
    caller has none)."""
    from t2train.kernels.dispatch import load_kernels  # noqa: PLC0415 - the model's modules: not for the config helpers `t2train plan` reads
    from t2train.model.gpt import T2GPTModel  # noqa: PLC0415 - the model's modules: not for the config helpers `t2train plan` reads
    from t2train.nn.compiling import compile_modules  # noqa: PLC0415 - the model's modules: not for the config helpers `t2train plan` reads
    from t2train.residual import get_design, kernel_table  # noqa: PLC0415 - the model's modules: not for the config helpers `t2train plan` reads

    fp8 = config.train.precision == "fp8"
    if fp8:
        from t2train.nn import float8  # noqa: PLC0415 - torchao: an optional extra, for fp8 runs only

        float8.require_fp8_device()
    hops = hops or plan_hops(config)
    virtual = config.parallel.virtual_pipeline
    cache = DepthCache() if config.parallel.caches_depth_units() else None
    chunks = []
    for vp_stage in range(virtual):
        vp = vp_stage if virtual > 1 else None
        chunk = T2GPTModel(
            tf_config,
            vocab_size=vocab_size,
            max_sequence_length=config.model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=config.model.tie_embeddings,
            rotary_base=config.model.rotary_base,
            vp_stage=vp,
            hops=hops,
            depth_cache=cache,
        )
        if fp8:  # before compiling: the compiled layers trace the float8 GEMMs
            float8.convert_to_float8(chunk, float8.recipe_config(config.train.fp8_recipe))
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    if fusions_on(config):  # all chunks' layers share the layer's code, and its recompile limit
        load_kernels(kernel_table().values())  # imported here, not inside the traced layers
        compile_modules(
            [layer for chunk in chunks for layer in chunk.decoder.layers],
            design_options=get_design(config.model.residual).inductor_options,
        )
    return chunks
