"""The plain-PyTorch GPT that t2train's ``standard`` is timed against: the strongest plain
training loop a user would write for the same model, and its eager twin.

Same shapes as t2train's ``standard`` model (pre-norm RMSNorm, RoPE, causal SDPA with grouped
queries, SwiGLU MLP without biases, tied or untied embeddings), fp32 parameters under bf16
autocast, AdamW (fused on CUDA) and gradient clipping, on the same micro-batches: no Megatron,
no pipeline schedule, no distributed optimizer. Compiled (``compiled=True``), it follows
torchtitan's recipe:

- RoPE's cos and sin are computed once, when the model is built, in the compute dtype, and
  passed into every block (not rebuilt from ``arange``/``pow``/``cos``/``sin`` inside each
  block's graph, as an earlier version of this file did);
- each block is compiled with ``torch.compile`` (the blocks share one graph);
- the loss is compiled too: the final norm, the output projection and the cross-entropy as
  one function, so the fp32 [tokens, vocabulary] logits are never materialised (the bf16
  logits are, as in t2train's loss);
- it is timed in a process of its own (``python -m t2train.bench.reference_gpt --serve``,
  which the GPU check starts once and sends each run to: ``tools/gpu_check/perf.py``), so
  that its compiles and its allocator start from nothing rather than after t2train's in the
  same process.

Eager (``compiled=False``) is the same module without ``torch.compile``: the cross-entropy then
runs over fp32 logits, as ``F.cross_entropy`` under autocast computes it.

Only what the presets' ``standard`` uses is built: a config with Qwen's query/key norms or
biases, Llama 3.1's RoPE scaling or dropout is refused rather than timed as something else.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

GIB = 2.0**30


@dataclass(frozen=True)
class ReferenceShape:
    """What the reference model is built from (plain data: it travels to the child process
    as JSON, which then imports torch and this module only)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    seq_length: int
    rotary_base: float
    norm_epsilon: float
    tie_embeddings: bool
    init_std: float

    @classmethod
    def of(cls, model, vocab_size: int) -> "ReferenceShape":
        """From a ``ModelConfig`` of the ``standard`` design."""
        unsupported = {
            "qk_norm": bool(getattr(model, "qk_norm", False)),
            "qkv_bias": bool(getattr(model, "qkv_bias", False)),
            "rope_scaling_factor": bool(getattr(model, "rope_scaling_factor", 0.0)),
            "dropout": bool(getattr(model, "dropout", 0.0)),
        }
        if any(unsupported.values()):
            raise ValueError(
                "the plain-PyTorch reference builds the presets' baseline model only; "
                f"not: {', '.join(name for name, on in unsupported.items() if on)}"
            )
        return cls(
            vocab_size=vocab_size,
            hidden_size=model.hidden_size,
            num_layers=model.num_layers,
            heads=model.num_attention_heads,
            kv_heads=model.num_query_groups or model.num_attention_heads,
            head_dim=model.resolved_head_dim(),
            ffn_hidden_size=model.resolved_ffn_hidden_size(),
            seq_length=model.seq_length,
            rotary_base=float(model.rotary_base),
            norm_epsilon=model.norm_epsilon,
            tie_embeddings=model.tie_embeddings,
            init_std=model.init_method_std,
        )


@dataclass(frozen=True)
class ReferenceTraining:
    """The optimizer's settings and the compute dtype, as the config sets them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    clip_grad: float
    dtype: str  # "bfloat16", "float16" or "float32" (no autocast)
    seed: int

    @classmethod
    def of(cls, train, dtype: torch.dtype) -> "ReferenceTraining":
        return cls(
            lr=train.lr,
            beta1=train.adam_beta1,
            beta2=train.adam_beta2,
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            clip_grad=train.clip_grad,
            dtype=str(dtype).removeprefix("torch."),
            seed=train.seed,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def rope_tables(shape: ReferenceShape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, head_dim] of every position, rotate-half layout, in ``dtype``."""
    d = shape.head_dim
    inv_freq = 1.0 / shape.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(shape.seq_length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [b, heads, s, d] with the tables of its first s positions."""
    s = x.shape[-2]
    first, second = x.chunk(2, dim=-1)
    return x * cos[:s] + torch.cat((-second, first), -1) * sin[:s]


class _Block(nn.Module):
    def __init__(self, shape: ReferenceShape):
        super().__init__()
        h, ffn = shape.hidden_size, shape.ffn_hidden_size
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.q_dim, self.kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.attn_norm = nn.RMSNorm(h, eps=shape.norm_epsilon)
        self.qkv = nn.Linear(h, self.q_dim + 2 * self.kv_dim, bias=False)
        self.proj = nn.Linear(self.q_dim, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=shape.norm_epsilon)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split([self.q_dim, self.kv_dim, self.kv_dim], -1)
        q = _rotate(q.view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, self.q_dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def head_loss(
    x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The final RMSNorm, the output projection and the mean cross-entropy over all tokens.
    Compiled, Inductor computes the log-softmax in fp32 from the bf16 logits without writing
    an fp32 copy of them."""
    logits = F.rms_norm(x, (x.shape[-1],), norm, eps) @ weight.t()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class ReferenceGPT(nn.Module):
    def __init__(self, shape: ReferenceShape, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embedding = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(shape.num_layers))
        self.final_norm = nn.RMSNorm(shape.hidden_size, eps=shape.norm_epsilon)
        self.eps = shape.norm_epsilon
        self.head = (
            None
            if shape.tie_embeddings
            else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        )
        for param in self.parameters():
            if param.dim() > 1:
                nn.init.normal_(param, std=shape.init_std)
        cos, sin = rope_tables(shape, dtype)  # once, in the dtype the blocks compute in
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.loss = head_loss

    def compile_parts(self, backend: str) -> None:
        """torchtitan's compile: each block, and the loss."""
        for block in self.blocks:
            block.compile(backend=backend)
        self.loss = torch.compile(head_loss, backend=backend)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        weight = self.embedding.weight if self.head is None else self.head.weight
        return self.loss(x, self.final_norm.weight, self.eps, weight, labels)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_reference_steps(
    shape: ReferenceShape,
    training: ReferenceTraining,
    steps: list[list[dict]],
    warmup: int,
    backend: Optional[str] = None,
) -> list[float]:
    """Seconds of every step on ``steps``' micro-batches (the first ``warmup`` are the
    warm-up); with a ``torch.compile`` ``backend``, the blocks and the loss compiled with it."""
    device = steps[0][0]["tokens"].device
    dtype = training.torch_dtype
    torch.manual_seed(training.seed)
    model = ReferenceGPT(shape, dtype).to(device)
    if backend is not None:
        model.compile_parts(backend)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=training.lr,
        betas=(training.beta1, training.beta2),
        eps=training.eps,
        weight_decay=training.weight_decay,
        fused=device.type == "cuda",
    )
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    seconds = []
    for micro_batches in steps:
        _synchronize(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for batch in micro_batches:
            with autocast:
                loss = model(batch["tokens"], batch["labels"]) / len(micro_batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.clip_grad)
        optimizer.step()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def count_parameters(shape: ReferenceShape) -> int:
    with torch.device("meta"):
        return sum(param.numel() for param in ReferenceGPT(shape).parameters())


def peak_memory_gib() -> float:
    """The peak CUDA allocation, or on the CPU the process's resident set size (as
    ``t2train bench step`` reports it)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB
    import psutil

    return psutil.Process().memory_info().rss / GIB


_LAST_COMPILED: dict = {}  # the shape and backend this process compiled for last


def run_spec(spec: dict) -> dict:
    """The child's work: the batches from ``spec["batches"]``, the steps timed, and what a
    ``DesignTiming`` needs back."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compiled_for = (json.dumps(spec["shape"], sort_keys=True), spec["backend"])
    if spec["backend"] is not None and _LAST_COMPILED.get("for") != compiled_for:
        # Another shape: its graphs compile afresh (with the last shape's graphs cached,
        # dynamo would compile this one's with dynamic shapes). The same shape again (a
        # repeat) reuses the graphs, which only shortens the warm-up.
        torch._dynamo.reset()
        _LAST_COMPILED["for"] = compiled_for
    steps = torch.load(spec["batches"], map_location=device)
    shape = ReferenceShape(**spec["shape"])
    training = ReferenceTraining(**spec["training"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = time_reference_steps(shape, training, steps, spec["warmup"], spec["backend"])
    return {
        "step_samples": seconds[spec["warmup"] :],
        "warmup_samples": seconds[: spec["warmup"]],
        "memory_gib": peak_memory_gib(),
        "params": count_parameters(shape),
        "device": str(device),
    }


def spec_for(
    shape: ReferenceShape,
    training: ReferenceTraining,
    batches: Path,
    warmup: int,
    backend: Optional[str],
) -> dict:
    return {
        "shape": asdict(shape),
        "training": asdict(training),
        "batches": str(batches),
        "warmup": warmup,
        "backend": backend,
    }


RESULT = "reference-result: "  # marks the serving process's answer on its stdout


def serve(lines, answer) -> None:
    """Time one spec per line of ``lines`` (JSON), answering each with ``RESULT`` and the
    result (or ``{"error": ...}``) as JSON; between runs everything is freed, so that the
    parent's own runs have the device to themselves."""
    import gc
    import traceback

    for line in lines:
        if not line.strip():
            continue
        try:
            result = run_spec(json.loads(line))
        except Exception as err:  # the parent reports it and goes on
            result = {
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc()[-2000:],
            }
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        answer(RESULT + json.dumps(result))


def main(argv=None) -> int:
    """``python -m t2train.bench.reference_gpt SPEC OUT``: one spec, its result to OUT;
    ``--serve``: specs from stdin, one a line, results to stdout (``serve``)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--serve"]:
        serve(sys.stdin, lambda text: print(text, flush=True))
        return 0
    spec_path, out = (Path(arg) for arg in args)
    out.write_text(json.dumps(run_spec(json.loads(spec_path.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
