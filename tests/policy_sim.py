"""A simulated machine for draft-length policies: a cost table, an acceptance rate and noise.

Each pass the policy chooses k; each of `batch` rows accepts draft positions one by one with
probability alpha until the first rejection (greedy betas: 1 for an accepted position, 0 for the
first rejected one) and commits the accepted tokens plus one; the pass takes seconds[k] times
lognormal noise, with rare stalls. Optionally each request ends after `request_tokens` tokens and is
replaced at once, and the draft reads each new one at its next drafting pass (`join_s`, reported as
joined_s, not in the pass's time; plain passes leave it for later). Throughput is committed tokens over
seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class Machine:
    seconds: list[float]  # an iteration's seconds at k = 0..k_max
    alpha: float  # acceptance per draft position
    batch: int = 1
    noise: float = 0.1  # sigma of the lognormal noise on every pass
    stall: float = 0.0  # chance that a pass takes ten times as long
    join_s: float = 0.0  # seconds the draft takes to read one request that joined
    request_tokens: int = 0  # tokens of a request (0: requests never end)

    def expected_throughput(self, k: int) -> float:
        """Tokens per second of fixed k, noise, stalls and the draft's reading of joined requests included."""
        tokens = self.batch * sum(self.alpha**i for i in range(k + 1))
        mean_time = self.seconds[k] * math.exp(self.noise**2 / 2) * (1 + 9 * self.stall)
        if k > 0 and self.request_tokens:
            mean_time += tokens / self.request_tokens * self.join_s
        return tokens / mean_time

    def best_k(self) -> int:
        return max(range(len(self.seconds)), key=self.expected_throughput)


def run(policy, machines: list[tuple[int, Machine]], passes: int, seed: int = 0) -> tuple[float, list[int]]:
    """Drive `policy` for `passes` passes; machines: (first pass, machine) in order (a change of machine
    at a pass). Returns (throughput over all passes, the k chosen at each pass)."""
    rng = random.Random(seed)
    tokens = seconds = served = 0.0  # served: tokens of the requests running, toward their end
    joined = 0  # requests that joined since the last drafting pass
    chosen = []
    for n in range(passes):
        machine = [m for start, m in machines if start <= n][-1]
        k = policy.choose(machine.batch)
        beta_sums, verified = [0.0] * k, [0] * k
        texts: dict[int, list[float | None]] = {}  # per row, its acceptance at each position committed
        before = tokens
        for row in range(machine.batch):
            accepted = 0
            while accepted < k:
                verified[accepted] += 1
                if rng.random() >= machine.alpha:
                    break
                beta_sums[accepted] += 1.0
                accepted += 1
            tokens += accepted + 1
            texts[row] = [1.0] * accepted + ([0.0] if accepted < k else [None])
        t = machine.seconds[k] * math.exp(machine.noise * rng.gauss(0, 1))
        t *= 10 if rng.random() < machine.stall else 1
        joined_s = 0.0
        if k > 0:
            joined_s, joined = machine.join_s * min(joined, machine.batch), 0
        committed = int(tokens - before)
        if machine.request_tokens:
            served += committed
            joined += int(served // machine.request_tokens)
            served %= machine.request_tokens
        policy.observe(
            k, beta_sums, verified, 0.0, t, machine.batch, k, joined_s=joined_s, committed=committed, texts=texts
        )
        seconds += t + joined_s
        chosen.append(k)
    return tokens / seconds, chosen


def replay(policy, matches: list[str], seconds: list[float], new_tokens: int = 64, rounds: int = 10) -> float:
    """Greedy decoding at one row replayed from a trace (tests/data/greedy_draft_matches.json): requests of
    `new_tokens` tokens, one per entry of `matches`, in turn, `rounds` times; at temperature 0 a draft of k
    tokens from position p accepts the run of 1s of matches[p:] up to k. A pass at k takes seconds[k]. Returns
    throughput, committed tokens over seconds."""
    tokens = elapsed = 0.0
    for _ in range(rounds):
        for match in matches:
            at = 0
            while at < new_tokens:
                k = policy.choose(1)
                accepted = 0
                while accepted < k and at + accepted < len(match) and match[at + accepted] == "1":
                    accepted += 1
                betas = [1.0] * accepted + ([0.0] if accepted < k else [])
                policy.observe(k, betas, [1] * len(betas), 0.0, seconds[k], 1, k, committed=accepted + 1)
                got = min(accepted + 1, new_tokens - at)
                tokens, elapsed, at = tokens + got, elapsed + seconds[k], at + got
    return tokens / elapsed
