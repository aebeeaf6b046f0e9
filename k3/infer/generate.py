"""Greedy decoding with the hybrid cache: prefill each prompt once, then one token per step."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def greedy_generate(model, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> Tensor:
    """input_ids [B, T] (each row one prompt) -> [B, T + n] with n <= max_new_tokens greedy tokens.

    Rows that emit ``eos_token_id`` keep emitting it; generation stops early when every row has.
    """
    cache = model.new_cache(input_ids.shape[0])
    logits = model(input_ids, cache=cache).logits[:, -1]
    out = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt[:, None])
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        logits = model(nxt[:, None], cache=cache).logits[:, -1]
    return torch.cat(out, dim=1)
