"""Acceptance and timing statistics, per request and in aggregate.

Conventions (stated wherever a number is printed):
- proposed / accepted: draft tokens proposed and accepted; alpha_hat = accepted / proposed.
- beta_i = sum_x min(p_i(x), q_i(x)): the exact acceptance probability at draft position i,
  averaged over *verified* positions (those whose accept/reject decision was made: every
  position up to and including the first rejection). It has lower variance than counting.
- acceptance by position: accepted_by_position[i] / verified_by_position[i] is the
  conditional rate at position i given positions < i were accepted (the refined model's alpha_i).
- mean tokens per target pass = 1 + accepted / passes: it INCLUDES the recovered or bonus
  token, so it lies in 1..k+1 (vLLM's "mean acceptance length"; gpt-fast's "mean accepted"
  excludes it and is this minus 1).
Owns the counting only; the engine decides what to observe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _grow(values: list, size: int, fill: float | int = 0) -> None:
    values.extend([fill] * (size - len(values)))


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    beta_sum_by_position: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def observe(self, num_draft: int, num_accepted: int, beta: list[float] | None = None) -> None:
        """One target pass that verified num_draft proposals and accepted num_accepted of them."""
        self.target_passes += 1
        self.proposed += num_draft
        self.accepted += num_accepted
        for counts in (self.proposed_by_position, self.verified_by_position, self.accepted_by_position):
            _grow(counts, num_draft)
        _grow(self.beta_sum_by_position, num_draft, 0.0)
        for i in range(num_draft):
            self.proposed_by_position[i] += 1
            if i <= num_accepted:
                self.verified_by_position[i] += 1
                if beta is not None:
                    self.beta_sum_by_position[i] += beta[i]
            if i < num_accepted:
                self.accepted_by_position[i] += 1

    @property
    def alpha_hat(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def proposal_length_shares(self) -> list[float]:
        """w_j = the share of target passes that verified j proposals, j = 0..longest (theory.mixed_speedup)."""
        if not self.target_passes:
            return []
        at_least = [self.target_passes, *self.proposed_by_position, 0]  # at_least[j]: passes with >= j proposals
        return [(at_least[j] - at_least[j + 1]) / self.target_passes for j in range(len(at_least) - 1)]

    @property
    def beta(self) -> float:
        verified = sum(self.verified_by_position)
        return sum(self.beta_sum_by_position) / verified if verified else float("nan")

    @property
    def mean_tokens_per_pass(self) -> float:
        return 1 + self.accepted / self.target_passes if self.target_passes else float("nan")


@dataclass
class SpecStats(RequestStats):
    """The aggregate over a batch of requests, plus wall-clock timings."""

    requests: list[RequestStats] = field(default_factory=list)
    prefill_time_s: float = 0.0  # prompts into the target's cache and the drafter's
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    total_time_s: float = 0.0  # prefill included
    placeholder_guess: bool = False  # no draft: the proposals were guesses in padded passes (drafters/placeholder.py)
    draft_given: bool = False  # a drafter was given (not the placeholder's guesser)
    passes_k0: int = 0  # target passes for which the policy chose k = 0
    passes_empty: int = 0  # target passes with k > 0 chosen for which the drafter proposed nothing

    def add(self, request: RequestStats) -> None:
        """Fold a finished request's counts into the aggregate."""
        self.requests.append(request)
        self.prompt_tokens += request.prompt_tokens
        self.generated_tokens += request.generated_tokens
        self.target_passes += request.target_passes
        self.proposed += request.proposed
        self.accepted += request.accepted
        for name in ("proposed_by_position", "verified_by_position", "accepted_by_position", "beta_sum_by_position"):
            mine, theirs = getattr(self, name), getattr(request, name)
            _grow(mine, len(theirs), 0.0 if name.startswith("beta") else 0)
            for i, value in enumerate(theirs):
                mine[i] += value

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / v if v else float("nan") for a, v in zip(self.accepted_by_position, self.verified_by_position)]

    @property
    def beta_by_position(self) -> list[float]:
        return [b / v if v else float("nan") for b, v in zip(self.beta_sum_by_position, self.verified_by_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else float("nan")

    def estimated_speedup(self, plain_step_s: float) -> float:
        """Decoding speed-up over plain decoding, estimated as (tokens x a plain step's time, profiled
        separately) / this run's decoding time (prefill excluded, every overhead included). A plain
        loop's own per-token overhead (sampling) is not in plain_step_s, so this leans slightly high;
        `verispec bench` measures the ratio instead."""
        decoding_s = self.total_time_s - self.prefill_time_s
        return self.generated_tokens * plain_step_s / decoding_s if decoding_s > 0 else float("nan")

    def summary(self, plain_step_s: float | None = None) -> str:
        """One line: the figures a user reads after a run (with plain_step_s: the estimated speed-up)."""
        line = f"{self.generated_tokens} tokens in {self.total_time_s:.2f} s ({self.tokens_per_s:.1f} tok/s)"
        if self.placeholder_guess and self.proposed:
            line += (
                f" | no draft, {self.target_passes} target passes; where a one-position pass carries a second"
                f" position (exact kernels), it checked a guess: {self.accepted}/{self.proposed} right,"
                f" {self.mean_tokens_per_pass:.2f} tokens/pass"
            )
        elif self.proposed:
            line += (
                f" | alpha_hat {self.alpha_hat:.3f} ({self.accepted}/{self.proposed}), beta {self.beta:.3f},"
                f" mean tokens/target pass {self.mean_tokens_per_pass:.2f} (incl. recovered/bonus)"
            )
            if plain_step_s is not None:
                speedup = self.estimated_speedup(plain_step_s)
                line += f" | estimated speed-up ~{speedup:.2f}x (a plain step profiled at {plain_step_s * 1000:.1f} ms)"
        elif self.draft_given:
            line += (
                f" | 0 proposals in {self.target_passes} target passes: the draft length chosen was 0 for"
                f" {self.passes_k0}, the draft had nothing to propose for {self.passes_empty}"
            )
        else:
            line += f" | no speculation, {self.target_passes} target passes"
        return (
            line
            + f" | prefill {self.prefill_time_s:.2f} s, draft {self.draft_time_s:.2f} s,"
            + f" target {self.target_time_s:.2f} s"
        )

    def to_dict(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "target_passes": self.target_passes,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "alpha_hat": self.alpha_hat,
            "beta": self.beta,
            "acceptance_by_position": self.acceptance_by_position,
            "beta_by_position": self.beta_by_position,
            "mean_tokens_per_pass": self.mean_tokens_per_pass,
            "prefill_time_s": self.prefill_time_s,
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "total_time_s": self.total_time_s,
            "tokens_per_s": self.tokens_per_s,
            "placeholder_guess": self.placeholder_guess,
        }
