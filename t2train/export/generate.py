"""``t2train generate CHECKPOINT --prompt TEXT``: greedy or top-p sampling with the run's model
and tokenizer, for a quick look at what a run has learned.

No KV cache: each new token runs the model over the context again (at most the run's
``seq_length`` most recent tokens), which is exact for every residual design and fast
enough for the models a quick look is for.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def next_token(logits: Tensor, top_p: Optional[float], temperature: float,
               generator: Optional[torch.Generator]) -> int:
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
def generate(model, prompt_ids: list[int], max_new_tokens: int, vocab: int, context: int,
             eos_id: Optional[int] = None, top_p: Optional[float] = None,
             temperature: float = 1.0, seed: int = 0,
             stop: Optional[Callable[[list[int]], bool]] = None) -> list[int]:
    """New token ids after ``prompt_ids`` (stops after ``eos_id``, or once ``stop(new ids)``).
    ``vocab``: the tokenizer's size (the embedding's padding rows are never sampled);
    ``context``: tokens the model sees."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], device=device)
        positions = torch.arange(window.shape[1], device=device).unsqueeze(0)
        logits = model(window, positions, None)[0, -1, :vocab].cpu()
        token = next_token(logits, top_p, temperature, generator)
        ids.append(token)
        new.append(token)
        if token == eos_id or (stop is not None and stop(new)):
            break
    return new
