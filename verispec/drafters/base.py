"""The drafter protocol: what the engine asks of anything that proposes tokens.

A drafter sees the same committed tokens as the target and proposes k tokens per step,
declaring the exact distributions it drew them from (or None when its proposals are
deterministic, so q is one-hot). After verification the engine tells it how many of the
proposals were accepted and which token followed; the drafter rolls any per-token state
back to the committed sequence in that one call.

A drafter that sets `shares_target_cache = True` is started with the target's cache as well,
`start(prompts, max_length, target_cache=cache)`, after the prompts were prefilled into it;
it may read that cache but must never write a committed position (early_exit.py).
A drafter may also offer `prefill()`: the engine calls it right after `start` when it will
draft from the first iteration (a fixed k > 0), so that reading the prompts is timed as
prefill; otherwise a model drafter reads them lazily, in its first proposal.

Optional, for a batch whose requests come and go (engine.Batch): a drafter whose
`can_change_rows` is true offers `keep_rows(rows)` (rows leave between steps: only the old
rows `rows`, ascending, remain, in that order, each as it stands) and `add_rows(prompts)` (new
requests after the other rows, their prompts committed), each called after the target's cache
did the same (so a drafter that shares it sees it done). Without them a batch keeps its
finished rows in place and takes no new ones.

Optional, for a target that runs whole iterations itself (llamacpp/step.py's compiled step): a
drafter whose proposals are exactly its own draft model's (the argmax at temperature 0, a draw
from q = the processed logits, sharpened by its proposal temperature, otherwise) offers
`own_model()`, that model with its cache, pending tokens and proposal temperature (`OwnModel`),
or None. A target's compiled step reads it once, at the start of a batch, and from then on runs
propose and commit itself: the drafter's own state is not kept up to date after, but for the
proposal temperature's estimates, which the compiled step feeds. A lookup (`is_lookup`: prompt lookup,
suffix drafting) offers `confident(k)` instead and no model: a compiled step verifies its proposals
(q one-hot) and leaves propose and commit to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import RowSampling


@dataclass(frozen=True)
class OwnModel:
    """A drafter's own draft model as it stands between two steps (`own_model()`)."""

    model: object  # the draft model (the model protocol)
    cache: object  # its own cache, row b the batch's row b
    pending: torch.Tensor  # [B, P] long: row b's first pending_count[b] tokens are committed, unread by the model
    pending_count: list[int]  # [B]
    confidence_threshold: float  # drafting stops once every running row's top q is below it (0: off)
    proposal: object | None = None  # proposal.ProposalTemperature: each row's proposal temperature (None: q)
    unread: list | None = None  # per row: a joined prompt's body the model has not read (None: nothing)


@runtime_checkable
class Drafter(Protocol):
    def start(self, prompts: list[list[int]], max_length: int) -> None:
        """Begin a batch: prompts [B][len_b] are committed; sequences will not exceed max_length."""

    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return draft_token_ids [B, k'] and draft_probs [B, k', V] (float32) or None, k' <= k
        (the same for every row; fewer when it has nothing worth proposing).

        `sampling` holds each row's settings and random stream: row b's q is processed with
        sampling.params[b] and drawn with sampling.draw (its own generator, or its invariant
        choice). draft_probs must be exactly the distribution each token was drawn from.
        """

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        """After verification: row b accepted num_accepted[b] proposals, then next_token_ids[b]
        (the recovered or bonus token, [B] long) was committed. Rows with active[b] False
        committed nothing this step and must be left as they were before propose."""


def is_lookup(drafter) -> bool:
    """A model-free drafter whose proposals are deterministic (q one-hot) and that can say which it stands
    behind (`confident(k)`): drafters/ngram.py, drafters/suffix.py."""
    return hasattr(drafter, "confident") and not hasattr(drafter, "own_model")


def check_rollback(target, drafter) -> None:
    """A ValueError where speculation would need a model to forget rejected positions and it cannot: a recurrent or
    hybrid llama.cpp model (`rolls_back` False) keeps one state per sequence, not a cell per position."""
    for role, model in (("target", target), ("draft", getattr(drafter, "model", None))):
        if drafter is not None and model is not None and not getattr(model, "rolls_back", True):
            raise ValueError(
                f"{model.path}: a {model.memory_kind} model cannot forget rejected positions, so it cannot be a "
                f"speculative {role} (decode it plainly: no draft)"
            )
