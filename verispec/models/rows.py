"""Starting new rows in a cache that other rows are using: `prefill_rows`, `extend_rows`.

A batch whose requests come and go (engine.Batch, the server) reuses a finished row for a new
prompt. `prefill_rows(model, cache, rows, prompts)` empties those rows and writes the prompts
into them, leaving every other row as it was. A model may do it itself (`model.prefill_rows`:
verispec's Llama prefills into a scratch cache and copies the keys and values in; llama.cpp
writes the rows' own sequences); otherwise one forward over the whole batch with the other
rows fed padding, which `rollback` then takes back (it never copies, so this is exact for any
cache that keeps the rollback contract). Knows nothing of sampling or speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def prefill_rows(model, cache, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
    """Rows rows[i] of cache hold prompts[i] afterwards (length len(prompts[i]), may be 0); the
    other rows keep their lengths and contents."""
    rows, prompts = list(rows), [list(p) for p in prompts]
    if len(rows) != len(prompts):
        raise ValueError(f"prefill_rows needs one prompt per row, got {len(rows)} rows and {len(prompts)} prompts")
    if any(not 0 <= r < cache.batch_size for r in rows):
        raise ValueError(f"rows {rows} outside the cache's {cache.batch_size} rows")
    if hasattr(model, "prefill_rows"):
        return model.prefill_rows(prompts, cache, rows)
    lengths = cache.host_lengths
    for row in rows:
        lengths[row] = 0
    cache.rollback(lengths)  # the new rows start empty
    width = max((len(p) for p in prompts), default=0)
    if width == 0:
        return
    ids = torch.zeros(cache.batch_size, width, dtype=torch.long, device=model.device)  # the other rows: padding
    for row, prompt in zip(rows, prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    model(ids, cache)
    for row, prompt in zip(rows, prompts):
        lengths[row] = len(prompt)
    cache.rollback(lengths)


@torch.no_grad()
def extend_rows(model, cache, input_ids: torch.Tensor) -> None:
    """Write input_ids [B, T] at each row's length (a prompt read piece by piece), no logits
    needed: verispec's Llama runs its layers only, llama.cpp asks for no output."""
    if hasattr(model, "hidden_states"):
        model.hidden_states(input_ids, cache)
    elif hasattr(model, "write"):
        model.write(input_ids, cache)
    else:
        model(input_ids, cache)
