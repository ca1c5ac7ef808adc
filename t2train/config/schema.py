"""Typed configuration: one dataclass per concern, validated as a whole by ``Config.validate``.

Every field has a type the loader enforces and a rule ``validate`` checks; errors name the
dotted field, the value and what is allowed (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

# ConfigError: the config's own error, re-exported
from t2train.errors import ConfigError as ConfigError
from t2train.errors import require
from t2train.residual import BASELINE, components, registered
from t2train.residual.options import DesignOptions
from t2train.signals import parse_signals


@dataclass
class ModelShape:
    """Decoder shape and the residual design (``residual``); ``ModelConfig`` adds the
    designs' option sections."""

    residual: str = BASELINE  # the residual design (docs/residuals.md); "standard" is the baseline
    num_layers: int = 4  # decoder layers
    hidden_size: int = 256  # model width: the embedding and every sublayer's input and output
    num_attention_heads: int = 4  # query heads of attention
    num_query_groups: Optional[int] = None  # grouped-query attention; None = one KV head per head
    ffn_hidden_size: Optional[int] = None  # None = SwiGLU default, 8/3 * hidden rounded up to 64
    seq_length: int = 256  # tokens per sample; at most the dataset's sample length
    vocab_size: Optional[int] = None  # None = taken from the dataset's tokenizer
    # The vocabulary is padded to a multiple of this times parallel.tensor (Megatron's).
    make_vocab_size_divisible_by: int = 128
    tie_embeddings: bool = True  # the output layer shares the input embedding's weights
    rotary_base: int = 10000  # RoPE's base (theta)
    # Llama 3.1's RoPE frequency scaling by this factor (rope_type llama3: low_freq_factor 1,
    # high_freq_factor 4, original context 8192, Megatron's); 0 = none.
    rope_scaling_factor: float = 0.0
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2's)
    # Per-head RMSNorm of the attention sublayer's queries and keys before RoPE (Qwen3's;
    # Megatron's qk_layernorm). The local mixer's attention has none.
    qk_norm: bool = False
    # Width of one attention head (Megatron's kv_channels); None = hidden_size /
    # num_attention_heads. Qwen3 and some Llamas have wider heads (Qwen3-0.6B: 1024 / 16, 128).
    head_dim: Optional[int] = None
    # The Hugging Face class `t2train export hf` writes a `standard` model as: the one it was
    # imported from ("" = LlamaForCausalLM); not part of the model's math.
    hf_architecture: Literal[
        "", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    ] = ""
    norm_epsilon: float = 1e-5  # epsilon of the RMSNorms
    init_method_std: float = 0.02  # standard deviation of the weights' normal initialisation
    # flash: flash-attn (CUDA, t2train[gpu]); sdpa: torch's scaled_dot_product_attention;
    # auto: flash for bf16/fp16 on CUDA when flash-attn is installed, else sdpa.
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto"
    # Activation recompute: `selective` keeps each layer's GEMM and attention outputs and
    # recomputes the pointwise work (norms, RoPE, SwiGLU, dropout, the design's reads and
    # writes) in the backward (torchtitan's op-level policy; t2train/nn/recompute.py); `full`
    # keeps only each layer's input and reruns the layer. `t2train plan` shows the memory.
    recompute: Literal["none", "selective", "full"] = "none"
    # The fused hot path: `all` compiles every decoder layer with torch.compile (Inductor fuses
    # the norms, RoPE, SwiGLU, dropout and the design's read and write around the GEMMs;
    # t2train/nn/compiling.py), turns on Megatron's SwiGLU fusion and computes the loss without
    # an fp32 copy of the logits (t2train/nn/cross_entropy.py); `none` is the eager reference.
    # auto: all with CUDA, none on the CPU (where compiling costs more than it saves).
    fusions: Literal["auto", "all", "none"] = "auto"
    # Dropout probability of the attention weights and of every sublayer's output before the
    # residual design writes it (Megatron's attention and hidden dropout); 0 = none.
    dropout: float = 0.0

    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def q_dim(self) -> int:
        """Width of one token's queries (and of the attention's output): heads x head dim."""
        return self.num_attention_heads * self.resolved_head_dim()

    def kv_dim(self) -> int:
        """Width of one token's keys (and of its values): query groups x head dim."""
        return (self.num_query_groups or self.num_attention_heads) * self.resolved_head_dim()

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * -(-(8 * self.hidden_size // 3) // 64)

    def validate(self) -> None:
        require(
            self.residual in registered(),
            "model.residual",
            self.residual,
            f"must be one of {sorted(registered())}",
        )
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "make_vocab_size_divisible_by",
            "rotary_base",
        ):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "must be >= 1")
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "model.hidden_size",
            self.hidden_size,
            f"must be divisible by model.num_attention_heads={self.num_attention_heads}",
        )
        if self.head_dim is None:
            head_dim = self.hidden_size // self.num_attention_heads
            require(
                head_dim % 2 == 0,
                "model.hidden_size",
                self.hidden_size,
                f"head dim hidden_size/num_attention_heads={head_dim} must be even for RoPE",
            )
        else:
            require(
                self.head_dim >= 2 and self.head_dim % 2 == 0,
                "model.head_dim",
                self.head_dim,
                "must be even and >= 2 for RoPE (or null: hidden_size/num_attention_heads)",
            )
        if self.num_query_groups is not None:
            require(
                self.num_query_groups >= 1
                and self.num_attention_heads % self.num_query_groups == 0,
                "model.num_query_groups",
                self.num_query_groups,
                f"must be >= 1 and divide model.num_attention_heads={self.num_attention_heads}",
            )
        if self.ffn_hidden_size is not None:
            require(
                self.ffn_hidden_size >= 1,
                "model.ffn_hidden_size",
                self.ffn_hidden_size,
                "must be >= 1",
            )
        if self.vocab_size is not None:
            require(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "must be >= 2")
        require(self.norm_epsilon > 0, "model.norm_epsilon", self.norm_epsilon, "must be > 0")
        require(
            self.rope_scaling_factor == 0 or self.rope_scaling_factor >= 1,
            "model.rope_scaling_factor",
            self.rope_scaling_factor,
            "must be 0 (no scaling) or >= 1",
        )
        require(
            self.init_method_std > 0, "model.init_method_std", self.init_method_std, "must be > 0"
        )
        require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")


@dataclass
class ModelConfig(DesignOptions, ModelShape):
    """Decoder shape, residual design and local mixer: the shape's fields, then one section
    per design option set (``model.ddl.dv``; ``t2train/residual/options.py``)."""

    def validate(self) -> None:
        ModelShape.validate(self)
        self.validate_sections()


@dataclass
class ParallelConfig:
    """Megatron-core parallel layout. Data parallel size = world size / (tensor * pipeline)."""

    tensor: int = 1  # tensor-parallel size (TP): each layer's heads and MLP split over ranks
    pipeline: int = 1  # pipeline-parallel size (PP): the layers split into this many stages
    virtual_pipeline: int = 1  # model chunks per pipeline rank (interleaved schedule; PP > 1)
    # Megatron's sequence parallelism: the norms and dropout split along the sequence over
    # the tensor-parallel ranks; needs parallel.tensor > 1.
    sequence_parallel: bool = False
    # Megatron's distributed optimizer: optimizer states sharded over data-parallel ranks
    # (train.engine=megatron; deepspeed shards with ZeRO instead).
    distributed_optimizer: bool = False
    # Residual-state units over pipeline hops: `naive` resends every unit; `cached` (with
    # virtual stages) skips units the receiving rank kept from its previous chunk.
    depth_cache: Literal["naive", "cached"] = "cached"
    # Pipeline hop tensors (t2train/parallel/hops.py): `exact` sends each hop with just the
    # units the receiver lacks; `padded` zero-pads every hop to the layout's largest (the
    # fixed shape of Megatron's schedules; a fallback if a Megatron upgrade changes the
    # schedule order the exact shapes follow).
    hop_shapes: Literal["exact", "padded"] = "exact"
    # A rank with no progress for longer ends the run (exit code 124), naming the phase and the
    # torch.distributed call it waits in (t2train/train/watchdog.py); it is also the process
    # groups' timeout. Under `t2train launch --max-restarts` the workers restart.
    collective_timeout_mins: float = 10.0

    def caches_depth_units(self) -> bool:
        """Whether hops skip units the receiver kept: a rank has a previous chunk of the same
        micro-batch only with virtual stages, so without them `cached` sends what `naive` does."""
        return self.depth_cache == "cached" and self.virtual_pipeline > 1

    def validate(self, model: ModelConfig) -> None:
        require(
            self.collective_timeout_mins > 0,
            "parallel.collective_timeout_mins",
            self.collective_timeout_mins,
            "must be > 0",
        )
        for name in ("tensor", "pipeline", "virtual_pipeline"):
            require(
                getattr(self, name) >= 1, f"parallel.{name}", getattr(self, name), "must be >= 1"
            )
        require(
            model.num_attention_heads % self.tensor == 0,
            "parallel.tensor",
            self.tensor,
            f"must divide model.num_attention_heads={model.num_attention_heads}",
        )
        groups = model.num_query_groups or model.num_attention_heads
        require(
            groups % self.tensor == 0,
            "parallel.tensor",
            self.tensor,
            f"must divide the number of query groups ({groups})",
        )
        chunks = self.pipeline * self.virtual_pipeline
        require(
            model.num_layers % chunks == 0,
            "model.num_layers",
            model.num_layers,
            f"must be divisible by parallel.pipeline * parallel.virtual_pipeline = {chunks}",
        )
        require(
            self.virtual_pipeline == 1 or self.pipeline > 1,
            "parallel.virtual_pipeline",
            self.virtual_pipeline,
            "needs parallel.pipeline > 1",
        )
        require(
            not self.sequence_parallel or self.tensor > 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            "needs parallel.tensor > 1; to run with "
            f"parallel.tensor={self.tensor}, add the override "
            "parallel.sequence_parallel=false",
        )
        if self.sequence_parallel:
            require(
                model.seq_length % self.tensor == 0,
                "model.seq_length",
                model.seq_length,
                f"must be divisible by parallel.tensor={self.tensor} with sequence_parallel",
            )


@dataclass
class TrainConfig:
    """Optimisation and schedule. Batch sizes are in sequences."""

    steps: int = 200  # optimizer steps of the whole run
    micro_batch_size: int = 8  # sequences per forward and backward of one data-parallel rank
    # Sequences per optimizer step over all data-parallel ranks (micro-batches accumulate).
    global_batch_size: int = 32
    lr: float = 3e-3  # peak learning rate, reached at the end of the warm-up
    min_lr: float = 3e-4  # the learning rate the decay ends at
    warmup_steps: int = 20  # linear from 0 to train.lr
    # After the warm-up (Megatron's OptimizerParamScheduler): `cosine` or `linear` decay to
    # min_lr at train.steps; `constant` holds train.lr (min_lr unused); `wsd` (warm-up, stable,
    # decay) holds train.lr, then decays to min_lr over the last lr_wsd_decay_fraction of
    # train.steps, shaped by lr_wsd_decay_style: a run can stop or branch before its decay.
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    lr_wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's beta1
    adam_beta2: float = 0.95  # AdamW's beta2
    adam_eps: float = 1e-8  # AdamW's epsilon
    clip_grad: float = 1.0  # clip the gradients' global norm to this; 0 = no clipping
    seed: int = 1234  # of the initialisation, dropout and the data order
    # megatron: Megatron-core DDP/distributed optimizer and pipeline schedules (every layout);
    # deepspeed: DeepSpeed ZeRO (the `deepspeed` section) on Megatron-core TP, PP = 1.
    engine: Literal["megatron", "deepspeed"] = "megatron"
    # auto: bf16 on CUDA, fp32 on CPU. fp8: bf16 weights and activations with the attention's
    # and MLP's GEMMs in float8 (torchao's float8 training, t2train/nn/float8.py; needs a
    # GPU of compute capability 8.9+ and t2train[fp8]).
    precision: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    # fp8's scaling: one scale per tensor, or per row (rowwise: closer to bf16, slower).
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    eval_interval: int = 50  # evaluate on the validation split every this many steps
    eval_batches: int = 4  # global batches per evaluation (the same ones every time)
    log_interval: int = 10  # log the scalars (console, TensorBoard, W&B) every this many steps
    # Save and stop at the next step boundary (exit code 75, see t2train/train/preemption.py)
    # on these signals, or once this process has run exit_duration_mins (0 = no limit).
    # SIGINT is Ctrl-C: a second Ctrl-C stops at once, without saving (exit code 130).
    exit_signals: str = "SIGUSR1,SIGTERM,SIGINT"
    exit_duration_mins: float = 0.0
    # The LR schedule a resumed run follows when this config's differs from the checkpoint's
    # (e.g. train.steps changed): `checkpoint` keeps the checkpoint's horizon, warm-up and LRs
    # (Megatron's default), `config` takes this config's. The resume line names the one used.
    schedule_on_resume: Literal["checkpoint", "config"] = "checkpoint"
    # An update whose loss or gradients are non-finite is skipped (train/skipped_steps); after
    # this many skipped in a row the run stops (exit code 3) without saving anything new.
    max_skipped_steps: int = 5
    # Also skip a step whose loss exceeds this factor times the mean of the last
    # loss_spike_window applied steps' losses (0 = off; Megatron engine only).
    loss_spike_factor: float = 0.0
    loss_spike_window: int = 20

    def precision_on(self, cuda: bool) -> str:
        """``precision`` with ``auto`` resolved: bf16 on CUDA, fp32 on the CPU."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if cuda else "fp32"

    def wsd_decay_steps(self) -> int:
        """The last steps a ``wsd`` schedule decays over: lr_wsd_decay_fraction of steps."""
        return round(self.lr_wsd_decay_fraction * self.steps)

    def validate(self) -> None:
        for name in (
            "steps",
            "micro_batch_size",
            "global_batch_size",
            "eval_interval",
            "eval_batches",
            "log_interval",
        ):
            require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name), "must be >= 1")
        require(
            self.global_batch_size % self.micro_batch_size == 0,
            "train.global_batch_size",
            self.global_batch_size,
            f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
        )
        require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        require(
            0 <= self.min_lr <= self.lr,
            "train.min_lr",
            self.min_lr,
            f"must be in [0, train.lr={self.lr}]",
        )
        require(
            0 <= self.warmup_steps < self.steps,
            "train.warmup_steps",
            self.warmup_steps,
            f"must be in [0, train.steps={self.steps}); for a run this short set "
            f"train.warmup_steps={max(0, self.steps // 10)}",
        )
        require(
            0 < self.lr_wsd_decay_fraction <= 1,
            "train.lr_wsd_decay_fraction",
            self.lr_wsd_decay_fraction,
            "must be in (0, 1]",
        )
        if self.lr_decay_style == "wsd":
            # Megatron's WSD decay would otherwise overlap the warm-up (the LR jumps) or be empty.
            decay, after_warmup = self.wsd_decay_steps(), self.steps - self.warmup_steps
            require(
                1 <= decay <= after_warmup,
                "train.lr_wsd_decay_fraction",
                self.lr_wsd_decay_fraction,
                f"decays over {decay} of train.steps={self.steps}; must be 1 to "
                f"{after_warmup} steps (those after train.warmup_steps={self.warmup_steps})",
            )
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            require(
                0 <= getattr(self, name) < 1,
                f"train.{name}",
                getattr(self, name),
                "must be in [0, 1)",
            )
        require(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "must be > 0")
        require(
            self.clip_grad >= 0,
            "train.clip_grad",
            self.clip_grad,
            "must be >= 0 (0 disables clipping)",
        )
        # numpy seeds must be < 2**32, and each pipeline stage adds 100 * its rank.
        require(0 <= self.seed < 2**31, "train.seed", self.seed, "must be in [0, 2**31)")
        parse_signals(self.exit_signals)
        require(
            self.exit_duration_mins >= 0,
            "train.exit_duration_mins",
            self.exit_duration_mins,
            "must be >= 0 (0 disables the time limit)",
        )
        require(
            self.max_skipped_steps >= 1,
            "train.max_skipped_steps",
            self.max_skipped_steps,
            "must be >= 1",
        )
        require(
            self.loss_spike_factor == 0 or self.loss_spike_factor > 1,
            "train.loss_spike_factor",
            self.loss_spike_factor,
            "must be 0 (off) or > 1",
        )
        require(
            self.loss_spike_window >= 1,
            "train.loss_spike_window",
            self.loss_spike_window,
            "must be >= 1",
        )


@dataclass
class DataConfig:
    """A prepared dataset directory (``t2train data prepare``): MDS shards plus tokenizer."""

    # The dataset (required to train): trained on (unless ``mix`` is set) and evaluated on (val).
    path: str = ""
    remote: Optional[str] = None  # object-store URL streamed into ``path`` as a local cache
    shuffle: bool = True  # shuffle the training samples (the validation split is not)
    num_workers: int = 0  # data-loader worker processes per rank; 0 = read in the rank itself
    # Train on several prepared datasets instead, mixed by relative weight:
    # "DIR=WEIGHT,DIR=WEIGHT", e.g. "data/web=3,data/code=1" (75% / 25% of every epoch's
    # samples). They must share data.path's tokenizer; data.remote applies to data.path if listed.
    mix: str = ""
    # Also evaluate on these prepared datasets' val splits, each logged as val/<LABEL>/loss:
    # "LABEL=DIR,LABEL=DIR", e.g. "web=data/web,code=data/code" (data.path's tokenizer).
    eval_sets: str = ""
    # Fixes the sample order independently of the number of nodes (mosaicml-streaming); it must
    # divide, or be a multiple of, the node count a run starts on (1 fits any). A resumed run
    # keeps the value of its checkpoint, on any node count that divides or is a multiple of it.
    num_canonical_nodes: int = 1
    # Unpack shards here (e.g. node-local scratch) instead of beside them in the datasets.
    cache_dir: str = ""

    def validate(self) -> None:
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0")
        require(
            self.num_canonical_nodes >= 1,
            "data.num_canonical_nodes",
            self.num_canonical_nodes,
            "must be >= 1",
        )
        require(
            not (self.cache_dir and self.remote),
            "data.cache_dir",
            self.cache_dir,
            "cannot be combined with data.remote (data.path is then the cache)",
        )
        self.mix_weights()
        self.labelled_eval_sets()

    def labelled_eval_sets(self) -> list[tuple[str, str]]:
        """``eval_sets`` as (label, dataset directory) pairs, [] when unset; checks its
        syntax."""
        if not self.eval_sets:
            return []
        pairs = []
        for entry in self.eval_sets.split(","):
            label, _, path = entry.strip().partition("=")
            require(
                bool(re.fullmatch(r"[A-Za-z0-9_.-]+", label)) and bool(path),
                "data.eval_sets",
                self.eval_sets,
                f"entry {entry.strip()!r} must be "
                "LABEL=DIR with a label of letters, digits, '_', '.' or '-', entries "
                "separated by commas",
            )
            pairs.append((label, path))
        labels = [label for label, _ in pairs]
        require(
            len(set(labels)) == len(labels),
            "data.eval_sets",
            self.eval_sets,
            "must use each label once",
        )
        return pairs

    def mix_weights(self) -> list[tuple[str, float]]:
        """``mix`` as (dataset directory, weight) pairs, [] when unset; checks its syntax."""
        if not self.mix:
            return []
        pairs: list[tuple[str, float]] = []
        for entry in self.mix.split(","):
            path, _, weight = entry.strip().rpartition("=")
            try:
                value = float(weight)
            except ValueError:
                value = float("nan")
            require(
                bool(path) and 0 < value < float("inf"),  # NaN: not a number
                "data.mix",
                self.mix,
                f"entry {entry.strip()!r} must be DIR=WEIGHT with a weight > 0, "
                "entries separated by commas",
            )
            pairs.append((path, value))
        paths = [path for path, _ in pairs]
        require(
            len(set(paths)) == len(paths),
            "data.mix",
            self.mix,
            "must name each dataset directory once",
        )
        return pairs


@dataclass
class CheckpointConfig:
    """Megatron dist-checkpointing saves under ``<run_dir>/checkpoints``."""

    interval: int = 100  # steps between saves; the last step is always saved
    resume: str = "auto"  # auto | none | a checkpoint directory
    # A checkpoint whose files do not match the checksums recorded when it was saved (a shard
    # truncated or overwritten): with resume=auto, `fall_back` resumes from the newest one that
    # verifies and says which it skipped and why; `stop` refuses (exit code 2), naming both.
    on_damaged: Literal["fall_back", "stop"] = "fall_back"
    overwrite: bool = False  # with resume=none, allow reusing a non-empty run directory
    # Retention: keep the newest keep_last checkpoints plus every keep_every-th step
    # (0 = keep all / none extra). The newest is never deleted.
    keep_last: int = 0
    keep_every: int = 0
    # Write shards from a forked process while training continues; published when done.
    async_save: bool = False
    # Save again right after loading, in this run's layout and engine: with train.steps equal
    # to the checkpoint's step this reshards a checkpoint for another (TP, PP, DP) without
    # training; after loading init_from's weights it saves them as step 0.
    save_on_resume: bool = False
    # A save that fails (read-only or full disk, a rank's write error) leaves the previous
    # checkpoint published; then `stop` ends the run (exit code 3) naming the path and the OS
    # error, `continue` warns, counts it (checkpoint/failed_saves) and trains on. A run whose
    # last save (at train.steps or at an early stop) failed exits with code 74 under either.
    on_save_error: Literal["stop", "continue"] = "stop"
    # `t2train train` then writes the final checkpoint as a Hugging Face folder next to it
    # (checkpoints/step_N-hf, as `t2train export hf` does); not after a run stopped early.
    export_hf_on_finish: bool = False
    # A fresh start (no checkpoint of this run to resume) begins from the model weights of this
    # checkpoint or run directory, of any layout and either engine: e.g. a Hugging Face Llama
    # brought in with `t2train import hf`; or of a plain state dict (.pt, .safetensors) of
    # `t2train ckpt convert`, or its folder. Optimizer, LR schedule, data position and step
    # start anew.
    init_from: str = ""

    def validate(self) -> None:
        require(self.interval >= 1, "checkpoint.interval", self.interval, "must be >= 1")
        require(
            self.keep_last >= 0,
            "checkpoint.keep_last",
            self.keep_last,
            "must be >= 0 (0 keeps every checkpoint)",
        )
        require(
            self.keep_every >= 0,
            "checkpoint.keep_every",
            self.keep_every,
            "must be >= 0 (0: no extra checkpoints kept)",
        )
        require(
            bool(self.resume),
            "checkpoint.resume",
            self.resume,
            "must be 'auto', 'none' or a checkpoint directory",
        )


@dataclass
class DeepSpeedConfig:
    """``train.engine=deepspeed``: what t2train/engine/deepspeed/config.py writes into
    DeepSpeed's JSON config, beside batch sizes, optimizer, clipping and precision."""

    # What ZeRO shards over data-parallel ranks: 1 optimizer states, 2 + gradients,
    # 3 + parameters.
    zero_stage: int = 1
    offload_optimizer: bool = False  # optimizer states and their update on the host (CUDA only)
    offload_params: bool = False  # parameters on the host between uses (ZeRO-3, CUDA only)
    # A DeepSpeed JSON adding fields t2train does not set (bucket sizes, comms logging, ...);
    # a field t2train sets must have the same value there, else the run stops naming both.
    config_file: str = ""

    def validate(self) -> None:
        require(
            self.zero_stage in (1, 2, 3),
            "deepspeed.zero_stage",
            self.zero_stage,
            "must be 1, 2 or 3 (plain data parallelism is train.engine=megatron)",
        )
        require(
            not self.offload_params or self.zero_stage == 3,
            "deepspeed.offload_params",
            self.offload_params,
            "needs deepspeed.zero_stage=3",
        )


@dataclass
class LogConfig:
    run_dir: str = "runs/{name}"  # {name} expands to the run name
    tensorboard: bool = True  # write TensorBoard event files into the run directory
    # Residual-stream diagnostics (RMS per layer, design internals; t2train/monitor/
    # diagnostics.py) every this many steps, from one forward of a held-out micro-batch; 0 = off.
    diagnostics_interval: int = 100
    # Peak TFLOP/s of one device for MFU; 0 = look the GPU up in t2train/monitor/mfu.py.
    peak_tflops: float = 0.0
    all_ranks: bool = False  # every rank prints its console lines (debugging); else rank 0
    # At log steps, name on the console a rank whose forward passes took this many times the
    # median of the other ranks of its pipeline stage (t2train/monitor/stragglers.py); 0 = never.
    straggler_factor: float = 1.25
    # Also log the scalars to Weights & Biases (t2train/monitor/wandb_sink.py): online, or
    # offline into <run_dir>/wandb (wandb sync uploads it later); needs t2train[wandb].
    wandb: Literal["off", "online", "offline"] = "off"
    wandb_project: str = "t2train"  # the W&B project log.wandb logs to
    # A torch.profiler trace of these training steps ("N" or "FIRST-LAST"), written to
    # <run_dir>/profile/ (t2train/monitor/profiler.py); "" = off.
    profile_steps: str = ""
    profile_ranks: str = "0"  # global ranks that profile: "all", or e.g. "0,8"
    # On CUDA, the allocator's history over the profiled steps as a memory snapshot.
    memory_snapshot: bool = False

    def profile_window(self) -> Optional[tuple[int, int]]:
        """``profile_steps`` as (first, last), None when off; checks its syntax."""
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition("-")
        try:
            window = (int(first), int(last or first))
        except ValueError:
            window = (0, -1)
        require(
            1 <= window[0] <= window[1],
            "log.profile_steps",
            self.profile_steps,
            "must be a step N or a range FIRST-LAST of steps >= 1",
        )
        return window

    def profiles_rank(self, rank: int) -> bool:
        if self.profile_ranks == "all":
            return True
        try:
            ranks = {int(part) for part in self.profile_ranks.split(",")}
        except ValueError:
            ranks = set()
        require(
            bool(ranks),
            "log.profile_ranks",
            self.profile_ranks,
            "must be 'all' or global ranks separated by commas, e.g. 0,8",
        )
        return rank in ranks

    def validate(self) -> None:
        require(bool(self.run_dir), "log.run_dir", self.run_dir, "must be a directory path")
        require(
            self.straggler_factor == 0 or self.straggler_factor > 1,
            "log.straggler_factor",
            self.straggler_factor,
            "must be 0 (never warn) or above 1",
        )
        self.profile_window()
        self.profiles_rank(0)
        require(
            not self.memory_snapshot or bool(self.profile_steps),
            "log.memory_snapshot",
            True,
            "needs log.profile_steps (the snapshot covers the profiled steps)",
        )
        require(
            self.wandb == "off" or importlib.util.find_spec("wandb") is not None,
            "log.wandb",
            self.wandb,
            "needs the wandb package: pip install 't2train[wandb]'",
        )
        require(
            self.diagnostics_interval >= 0,
            "log.diagnostics_interval",
            self.diagnostics_interval,
            "must be >= 0 (0 turns diagnostics off)",
        )
        require(
            self.peak_tflops >= 0,
            "log.peak_tflops",
            self.peak_tflops,
            "must be >= 0 (0 looks the GPU up in the peak table)",
        )


# Recorded in checkpoints with the config. 2: the local mixer is an axis of its own
# (model.shortswa.window > 0 turns it on); 1 (absent): it was on only with model.residual=shortswa.
CONFIG_FORMAT = 2


@dataclass
class Config:
    name: str = "t2train"  # the run's name: log.run_dir's {name} (runs/<name> by default)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> "Config":
        require(
            bool(self.name) and "/" not in self.name,
            "name",
            self.name,
            "must be a non-empty run name without '/'",
        )
        self.model.validate()
        self.parallel.validate(self.model)
        for part in components(self.model):
            part.check(self)
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.deepspeed.validate()
        self.log.validate()
        if self.train.engine == "deepspeed":
            self._validate_deepspeed_engine()
        if self.train.precision == "fp8":
            self._validate_fp8()
        return self

    def _validate_fp8(self) -> None:
        """What ``train.precision=fp8`` needs beyond a GPU with FP8 (checked where the model
        is built, ``t2train/nn/float8.py``, which also checks the GEMMs' shapes)."""
        require(
            importlib.util.find_spec("torchao") is not None,
            "train.precision",
            "fp8",
            "needs the torchao package: pip install 't2train[fp8]'",
        )
        # The weight gradient's GEMM runs over the micro-batch's tokens, and torch._scaled_mm
        # needs its inner dimension a multiple of 16.
        tokens = self.model.seq_length * self.train.micro_batch_size
        require(
            tokens % 16 == 0,
            "train.micro_batch_size",
            self.train.micro_batch_size,
            f"with train.precision=fp8 model.seq_length x train.micro_batch_size = {tokens} "
            "tokens per micro-batch must be a multiple of 16",
        )

    def _validate_deepspeed_engine(self) -> None:
        """What DeepSpeed ZeRO replaces or cannot run: Megatron's pipeline and its optimizer."""
        why = "is not supported with train.engine=deepspeed"
        require(
            self.parallel.pipeline == 1,
            "parallel.pipeline",
            self.parallel.pipeline,
            "must be 1 with train.engine=deepspeed (pipeline stages need Megatron's "
            "schedules: use train.engine=megatron)",
        )
        require(
            not self.parallel.sequence_parallel,
            "parallel.sequence_parallel",
            True,
            f"{why} (its norm gradients need Megatron's tensor-parallel all-reduce)",
        )
        # each tensor rank holds other heads, so the q/k norms' gradients differ between them
        require(
            not self.model.qk_norm or self.parallel.tensor == 1,
            "model.qk_norm",
            True,
            f"with parallel.tensor={self.parallel.tensor} {why} (the q/k norms' gradients "
            "need Megatron's tensor-parallel all-reduce): use parallel.tensor=1",
        )
        require(
            not self.parallel.distributed_optimizer,
            "parallel.distributed_optimizer",
            True,
            f"{why}: ZeRO (deepspeed.zero_stage) shards the optimizer instead",
        )
        require(not self.checkpoint.async_save, "checkpoint.async_save", True, why)
        require(
            self.train.precision != "fp8",
            "train.precision",
            self.train.precision,
            f"{why} (the float8 GEMMs are built and checked with train.engine=megatron)",
        )
        require(
            self.train.loss_spike_factor == 0,
            "train.loss_spike_factor",
            self.train.loss_spike_factor,
            f"{why} (DeepSpeed applies the update itself; "
            "it skips non-finite gradients on its own)",
        )

    def validate_world(self, world_size: int) -> int:
        """Check the layout against the launched world; returns the data-parallel size."""
        model_parallel = self.parallel.tensor * self.parallel.pipeline
        launch = (
            f"; start {model_parallel} processes or more with `t2train launch "
            f"--nproc-per-node={model_parallel} ...` (same arguments)"
            if world_size < model_parallel
            else ""
        )
        require(
            world_size % model_parallel == 0,
            "parallel.tensor*parallel.pipeline",
            model_parallel,
            f"must divide the world size {world_size}{launch}",
        )
        dp = world_size // model_parallel
        per_step = self.train.micro_batch_size * dp
        require(
            self.train.global_batch_size % per_step == 0,
            "train.global_batch_size",
            self.train.global_batch_size,
            f"must be a multiple of micro_batch_size * data_parallel = {per_step}",
        )
        if self.parallel.virtual_pipeline > 1:
            micro_batches = self.micro_batches_per_step(dp)
            require(
                micro_batches % self.parallel.pipeline == 0,
                "train.global_batch_size",
                self.train.global_batch_size,
                f"gives {micro_batches} micro-batches per step; the interleaved schedule "
                f"needs a multiple of parallel.pipeline={self.parallel.pipeline}",
            )
        return dp

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Megatron pads the vocabulary so every tensor-parallel shard has the same size."""
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor
        return -(-vocab_size // multiple) * multiple

    def micro_batches_per_step(self, data_parallel: int) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return self.train.global_batch_size // (self.train.micro_batch_size * data_parallel)

    @property
    def run_dir(self) -> str:
        return self.log.run_dir.format(name=self.name)

    def with_absolute_paths(self) -> "Config":
        """This config with its dataset and checkpoint paths made absolute (against the
        working directory), as a run records them: its checkpoints' config and its
        ``config.yaml`` then work from any directory (export, generate, eval, resume)."""

        def absolute(path: str) -> str:
            return os.path.abspath(path) if path else path

        data, checkpoint = self.data, self.checkpoint
        entries = (entry.strip().rpartition("=") for entry in data.mix.split(",") if data.mix)
        mix = ",".join(f"{absolute(path)}={weight}" for path, _, weight in entries)
        eval_sets = ",".join(
            f"{label}={absolute(path)}" for label, path in data.labelled_eval_sets()
        )
        resume = (
            checkpoint.resume
            if checkpoint.resume in ("auto", "none")
            else absolute(checkpoint.resume)
        )
        return dataclasses.replace(
            self,
            data=dataclasses.replace(
                data,
                path=absolute(data.path),
                mix=mix,
                eval_sets=eval_sets,
                cache_dir=absolute(data.cache_dir),
            ),
            checkpoint=dataclasses.replace(
                checkpoint, resume=resume, init_from=absolute(checkpoint.init_from)
            ),
        )
