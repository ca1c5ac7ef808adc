"""Keys and values of the tokens seen so far, so that generation feeds one new token per step.

Megatron's ``SelfAttention`` keeps them in a static-batching inference context
(``StaticInferenceContext``: buffers per layer, written at ``sequence_len_offset``). Every
residual design reads and writes the stream at one position at a time (the depth reads mix a
token's own layer states), so attention and the local mixer are the only sublayers that look
at earlier tokens, and a cache of their keys and values is exact for every design. The mixer
is a second ``SelfAttention`` with its layer's number, the key of Megatron's buffers, so it
gets a context of its own. A stream whose entry convolves over tokens (``entry_context``)
reads the newest embeddings kept here.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.inference.contexts import StaticInferenceContext
from torch import Tensor


class KVCache:
    """For ``batch`` sequences of at most ``max_length`` tokens (positions 0 .. max_length-1)."""

    def __init__(self, batch: int, max_length: int):
        self.max_length = max_length
        self.attention = StaticInferenceContext(batch, max_length)
        self.mixer = StaticInferenceContext(batch, max_length)
        self.embeddings: Optional[Tensor] = None  # [entry_context, b, h], the newest

    @property
    def length(self) -> int:
        """Tokens cached so far: the position of the next token fed."""
        return self.attention.sequence_len_offset

    def advance(self, tokens: int) -> None:
        """After a forward over ``tokens`` new tokens: the next ones follow them."""
        if self.length + tokens > self.max_length:
            raise ValueError(
                f"{self.length} + {tokens} tokens exceed the cache's {self.max_length}"
            )
        for context in (self.attention, self.mixer):
            context.sequence_len_offset += tokens
            context.enable_decode_mode()
