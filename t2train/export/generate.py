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


def generate(model, prompt_ids: list[int], *args, **kwargs) -> list[int]:
    """``generate_batch`` for one prompt: its new token ids."""
    [new] = generate_batch(model, [prompt_ids], *args, **kwargs)
    return new


@torch.no_grad()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    vocab: int,
    context: int,
    eos_id: Optional[int] = None,
    top_p: Optional[float] = None,
    temperature: float = 1.0,
    seed: int = 0,
    stop: Optional[Callable[[list[int]], bool]] = None,
    cache: bool = True,
) -> list[list[int]]:
    """New token ids after each of ``prompts`` (a row stops after ``eos_id``, or once
    ``stop(its new ids)``, or at ``max_new_tokens``). ``vocab``: the tokenizer's size (the
    embedding's padding rows are never sampled); ``context``: tokens the model sees. Greedy,
    or nucleus sampling with ``top_p``, each row with its own generator seeded with ``seed``.

    With ``cache``, each step feeds only the newest token and attention reads the earlier
    ones' keys and values from a ``KVCache``; once the text outgrows ``context`` the window
    slides, every position changes and the window is run whole again, as without the cache.

    Each row gets the tokens it would get alone. As Megatron's static batching does, every row
    holds the same number of tokens at each step: the batch starts at the shortest prompt,
    and a row whose prompt is longer takes its next prompt token instead of the one it would
    generate, until its prompt is used up. So no row is padded, positions stay those of each
    row alone, and one KV cache serves the batch. A row that has ended is fed on, its tokens
    dropped, until every row has ended."""
    from t2train.model.kv_cache import KVCache

    if not prompts or not all(prompts):
        raise ValueError("the prompt encodes to no tokens")
    device = next(model.parameters()).device
    generators = [torch.Generator(device="cpu").manual_seed(seed) for _ in prompts]
    length = min(len(prompt) for prompt in prompts)
    rows = [list(prompt[:length]) for prompt in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    ended = [max_new_tokens < 1] * len(prompts)
    kv_cache = None
    while not all(ended):
        if kv_cache is not None and length <= context:
            feed = [row[kv_cache.length :] for row in rows]
        else:  # the first step, no cache, or a slid window
            feed = [row[-context:] for row in rows]
            kv_cache = KVCache(len(rows), context) if cache else None
        start = kv_cache.length if kv_cache is not None else 0
        positions = torch.arange(start, start + len(feed[0]), device=device).expand(len(rows), -1)
        logits = model(torch.tensor(feed, device=device), positions, None, kv_cache=kv_cache)[
            :, -1, :vocab
        ].cpu()
        for i, prompt in enumerate(prompts):
            if length < len(prompt):  # still in its prompt
                token = prompt[length]
            elif ended[i]:  # fed on, dropped
                token = rows[i][-1]
            else:
                token = next_token(logits[i], top_p, temperature, generators[i])
                new[i].append(token)
                ended[i] = (
                    token == eos_id
                    or len(new[i]) == max_new_tokens
                    or (stop is not None and stop(new[i]))
                )
            rows[i].append(token)
        length += 1
    return new
