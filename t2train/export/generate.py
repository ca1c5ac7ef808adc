"""``t2train generate CHECKPOINT --prompt TEXT``: greedy or top-p sampling with the run's model
and tokenizer, for a quick look at what a run has learned.

Each new token is fed alone, attention reading the earlier tokens' keys and values from a
KV cache (exact for every residual design: ``t2train/model/kv_cache.py``); past the run's
``seq_length`` the context is the newest ``seq_length`` tokens, run whole at each step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def next_token(
    logits: Tensor, top_p: Optional[float], temperature: float, generator: Optional[torch.Generator]
) -> int:
    """Greedy (``top_p`` None) or nucleus sampling from the last position's ``logits`` [vocab]:
    the smallest set of most likely tokens whose probability reaches ``top_p``."""
    if top_p is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered  # mass of the more likely tokens
    ordered = ordered.masked_fill(before >= top_p, 0.0)
    choice = torch.multinomial(ordered / ordered.sum(), 1, generator=generator)
    return int(order[choice])


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    vocab: int,
    context: int,
    eos_id: Optional[int] = None,
    top_p: Optional[float] = None,
    temperature: float = 1.0,
    seed: int = 0,
    stop: Optional[Callable[[list[int]], bool]] = None,
    cache: bool = True,
) -> list[int]:
    """New token ids after ``prompt_ids`` (stops after ``eos_id``, or once ``stop(new ids)``).
    ``vocab``: the tokenizer's size (the embedding's padding rows are never sampled);
    ``context``: tokens the model sees. With ``cache``, each step feeds only the newest token
    and attention reads the earlier ones' keys and values from a ``KVCache``; once the text
    outgrows ``context`` the window slides, every position changes and the window is run
    whole again, as without the cache."""
    from t2train.model.kv_cache import KVCache

    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    new: list[int] = []
    kv_cache = None
    for _ in range(max_new_tokens):
        if kv_cache is not None and len(ids) <= context:
            feed = ids[kv_cache.length :]
        else:  # the first step, no cache, or a slid window
            feed = ids[-context:]
            kv_cache = KVCache(1, context) if cache else None
        start = kv_cache.length if kv_cache is not None else 0
        positions = torch.arange(start, start + len(feed), device=device).unsqueeze(0)
        logits = model(torch.tensor([feed], device=device), positions, None, kv_cache=kv_cache)[
            0, -1, :vocab
        ].cpu()
        token = next_token(logits, top_p, temperature, generator)
        ids.append(token)
        new.append(token)
        if token == eos_id or (stop is not None and stop(new)):
            break
    return new
