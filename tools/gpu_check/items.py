"""What the timing sections share: the config a variant runs at in a check, the fields a timed
item records (``perf.py`` for step cost and MFU, ``memory.py`` for the planner), its FLOPs per
token by both conventions, and a row timed several times (the headline's repeats) as one.
"""

from __future__ import annotations

import statistics

from tools.gpu_check.plan import Plan


def variant_config(plan: Plan, preset: str, overrides: tuple, variant: str):
    from t2train.bench.variants import variant_config as config_of

    return config_of(preset, None, [f"data.path={plan.data}", *overrides], variant)


def timing_item(name: str, timing, **extra) -> dict:
    """A timed row: the median step and what follows from it, and every step's time (the
    timed ones, and the warm-up's apart)."""
    return dict(
        extra,
        name=name,
        params=timing.params,
        tokens_per_step=timing.tokens_per_step,
        step_ms=timing.step_seconds * 1e3,
        tokens_per_s=timing.tokens_per_sec,
        memory_gib=timing.memory_gib,
        warmup_s=timing.warmup_seconds,
        step_samples_ms=[seconds * 1e3 for seconds in timing.step_samples],
        warmup_samples_ms=[seconds * 1e3 for seconds in timing.warmup_samples],
    )


def flop_counts(model, vocab_size: int) -> dict:
    """Training FLOPs per token (forward + backward) by both conventions:

    - ``flops_per_token``: t2train's (``t2train/model/flops.py``), what MFU is judged by:
      the matmuls, causal attention (a query attends to the keys up to its own: 6 * L * h *
      (s + 1) for the scores and the mixing), the design's and the mixer's own FLOPs;
    - ``flops_per_token_6n``: ``6N + 12 * L * h * s`` (PaLM's appendix B, nanoGPT's and
      torchtitan's MFU): N the parameters a token multiplies (every parameter but an input
      embedding that is not tied to the output layer: a lookup costs no FLOPs), the attention
      term full (non-causal), h the queries' width; a design's FLOPs that come with no
      parameters are not in it.
    """
    from t2train.model.flops import parameters
    from t2train.monitor.mfu import model_flops_per_token

    embedding = 0 if model.tie_embeddings else vocab_size * model.hidden_size
    n = parameters(model, vocab_size) - embedding
    return {
        "flops_per_token": model_flops_per_token(model, vocab_size),
        "flops_per_token_6n": 6 * n + 12 * model.num_layers * model.q_dim() * model.seq_length,
    }


REPEAT_FIELDS = (
    "step_ms",
    "tokens_per_s",
    "memory_gib",
    "warmup_s",
    "seconds",
    "step_samples_ms",
    "warmup_samples_ms",
)


def add_repeat(item: dict, repeat: dict, max_spread: float) -> dict:
    """``item`` (a row timed before) with a later repeat of it (a ``timing_item`` of the same
    row, with its ``seconds``) merged in: ``repeats`` keeps each repeat's numbers; the row's
    step time is the median of every timed step of all repeats, its memory the largest peak,
    its warm-up the first repeat's (the cold compile), its seconds their sum; ``spread`` is
    the largest repeat median over the smallest, less 1, and ``repeats_differ`` says whether
    it exceeds ``max_spread``."""
    repeats = item.get("repeats") or [{key: item[key] for key in REPEAT_FIELDS if key in item}]
    repeats = [*repeats, {key: repeat[key] for key in REPEAT_FIELDS if key in repeat}]
    return dict(item, **summary_of_repeats(repeats, item["tokens_per_step"], max_spread))


def summary_of_repeats(repeats: list[dict], tokens_per_step: int, max_spread: float) -> dict:
    samples = [sample for repeat in repeats for sample in repeat["step_samples_ms"]]
    step_ms = statistics.median(samples)
    medians = [repeat["step_ms"] for repeat in repeats]
    spread = max(medians) / min(medians) - 1
    return {
        "repeats": repeats,
        "step_ms": step_ms,
        "tokens_per_s": tokens_per_step / step_ms * 1e3,
        "memory_gib": max(repeat["memory_gib"] for repeat in repeats),
        "warmup_s": repeats[0].get("warmup_s"),
        "seconds": sum(repeat.get("seconds", 0.0) for repeat in repeats),
        "step_samples_ms": samples,
        "spread": spread,
        "repeats_differ": spread > max_spread,
    }
