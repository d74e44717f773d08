"""`verispec bench-serve`: a bounded load generator for `verispec serve`, on loopback.

Owns `run_level` (n streamed completions at a fixed concurrency against one server: per
request the time to first token, the gaps between chunks, the tokens from `usage`, the text,
and the draft tokens proposed and accepted from the last chunk, verispec's or llama-server's)
and `bench_serve` (servers for plain decoding, fixed k and `auto` started in this process on
127.0.0.1 ports of their own, or one running server given by URL, and peer servers started
for each of their rounds only (peer.py); every concurrency level runs each mode in turn, and
`repeats` sweeps run every level, so that modes and a level's rounds are interleaved over the
whole run; medians per mode and level, throughput ratios to plain, to the best other mode and
to the peer's best measured in the same round, and greedy outputs compared request by request
with a reference mode). Reports JSON, CSV and a plot. Knows the HTTP API only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Level:
    mode: str
    concurrency: int
    requests: int
    throughput_tok_s: float  # completion tokens / wall seconds of the level
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float  # gaps between streamed chunks (a chunk may carry several tokens)
    itl_p99_s: float
    tpot_p50_s: float  # per request: (last chunk - first chunk) / (tokens - 1)
    errors: int
    warmup: bool = False  # a warm-up round: reported, left out of the medians and ratios
    drafted: int = 0  # draft tokens proposed, over the requests that reported them
    accepted: int = 0  # of which accepted
    prompt_tokens: int = 0  # usage.prompt_tokens over the completed requests
    texts: list = field(default_factory=list)  # request i's completion (None: it failed); not in as_dict


@dataclass
class _Completion:
    ttft_s: float
    arrivals: list[float]  # perf_counter of each chunk with choices
    tokens: int  # usage.completion_tokens
    text: str
    prompt_tokens: int
    drafted: int
    accepted: int


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def draft_counts(payload: dict) -> tuple[int, int] | None:
    """(draft tokens proposed, accepted) from a stream's chunk: verispec's usage chunk
    (`verispec.choices[].proposed`/`accepted`) or llama-server's last (`timings.draft_n`/
    `draft_n_accepted`, present once it drafted); None when the chunk has neither."""
    own = (payload.get("verispec") or {}).get("choices")
    if own:
        return sum(c.get("proposed", 0) for c in own), sum(c.get("accepted", 0) for c in own)
    timings = payload.get("timings") or {}
    if "draft_n" in timings:
        return int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    return None


async def _one(client, url: str, body: dict) -> _Completion | None:
    """One streamed request: its chunks' arrival times, its text, usage and draft counts; None for an
    error (a status other than 200, no tokens, or a server that closed the connection: counted, not raised)."""
    import httpx

    try:
        return await _stream(client, url, body)
    except httpx.TransportError:
        return None


async def _stream(client, url: str, body: dict) -> _Completion | None:
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = prompt_tokens = drafted = accepted = 0
    text = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("choices"):
                arrivals.append(time.perf_counter())
                text.append(payload["choices"][0].get("text") or "")
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
                prompt_tokens = payload["usage"].get("prompt_tokens", 0)
            counts = draft_counts(payload)
            if counts is not None:
                drafted, accepted = counts
    if not arrivals:
        return None
    return _Completion(arrivals[0] - start, arrivals, tokens, "".join(text), prompt_tokens, drafted, accepted)


async def _level(
    url: str,
    prompts: list,
    concurrency: int,
    requests: int,
    max_tokens: int,
    temperature: float,
    extra: dict | None = None,
) -> tuple[float, list]:
    import httpx

    queue = list(range(requests))
    results: list = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {
                    "prompt": prompts[i % len(prompts)],
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": i,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **(extra or {}),
                }
                results.append((i, await _one(client, url, body)))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, results


def run_level(
    url: str,
    mode: str,
    prompts: list[str],
    concurrency: int,
    requests: int,
    max_tokens: int,
    temperature: float = 0.0,
    warmup: bool = False,
    extra: dict | None = None,
) -> Level:
    """prompts: texts or token-id lists; request i sends prompt i mod len(prompts) with seed i,
    and `extra`'s fields (a peer's)."""
    wall, results = asyncio.run(_level(url, prompts, concurrency, requests, max_tokens, temperature, extra))
    done = [r for _, r in results if r is not None]
    tokens = sum(r.tokens for r in done)
    gaps = [b - a for r in done for a, b in itertools.pairwise(r.arrivals)]
    tpot = [(r.arrivals[-1] - r.arrivals[0]) / (r.tokens - 1) for r in done if r.tokens > 1]
    ttft = [r.ttft_s for r in done]
    texts: list = [None] * requests
    for i, r in results:
        texts[i] = None if r is None else r.text
    return Level(
        mode,
        concurrency,
        len(results),
        tokens / wall,
        len(done) / wall,
        _quantile(ttft, 0.5),
        _quantile(ttft, 0.99),
        _quantile(gaps, 0.5),
        _quantile(gaps, 0.99),
        _quantile(tpot, 0.5),
        len(results) - len(done),
        warmup,
        sum(r.drafted for r in done),
        sum(r.accepted for r in done),
        sum(r.prompt_tokens for r in done),
        texts,
    )


def summarize(levels: list[Level], peer: str | None = None, reference: str | None = None) -> list[dict]:
    """Medians over repeats per (mode, concurrency), with the throughput ratios measured in the
    same repeats, each the median over rounds of this mode / the other in the same round (a
    round's load on a shared machine moves every mode alike): to plain where plain ran; to the
    best other mode, the one with the highest median; and, stricter, `_by_round`, to the fastest
    other mode of each round (the maximum of several noisy measurements is biased upwards:
    simulated, five modes equally fast over three rounds that vary by 10% put any one of them at
    a median 0.91 of the fastest of each round); with three rounds or more, a 95% interval for
    the ratio to the best other (`_bootstrap`). With `peer` (a prefix of mode names), each other
    mode's ratio to the peer's best mode too, chosen the same way; with `reference` (a mode),
    each other mode's completions compared with its, request by request (`_identical`); the
    acceptance (alpha_hat = accepted / drafted) where a mode drafted. Warm-up rounds are left out."""
    levels = [lv for lv in levels if not lv.warmup]
    rows = []
    keys = sorted({(lv.mode, lv.concurrency) for lv in levels}, key=lambda key: (key[1], key[0] != "plain", key[0]))
    modes = list(dict.fromkeys(lv.mode for lv in levels))
    for mode, concurrency in keys:
        runs = [lv for lv in levels if lv.mode == mode and lv.concurrency == concurrency]
        row = {"mode": mode, "concurrency": concurrency, "repeats": len(runs)}
        for name in (
            "throughput_tok_s",
            "requests_per_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "itl_p50_s",
            "itl_p99_s",
            "tpot_p50_s",
        ):
            row[name] = statistics.median(getattr(lv, name) for lv in runs)
        row["errors"] = sum(lv.errors for lv in runs)
        row["prompt_tokens"] = statistics.median(lv.prompt_tokens for lv in runs)
        drafted = sum(lv.drafted for lv in runs)
        if drafted:
            row["alpha_hat"] = sum(lv.accepted for lv in runs) / drafted
        plain = [lv for lv in levels if lv.mode == "plain" and lv.concurrency == concurrency]
        if plain and mode != "plain" and len(plain) == len(runs):
            row["throughput_vs_plain"] = statistics.median(
                a.throughput_tok_s / b.throughput_tok_s for a, b in zip(runs, plain)
            )
        names = [other for other in modes if other != mode]
        others = [[lv for lv in levels if lv.mode == other and lv.concurrency == concurrency] for other in names]
        if others and all(len(runs_other) == len(runs) for runs_other in others):
            row["throughput_vs_best_other"] = _vs_best_other(runs, others, range(len(runs)))
            if len(runs) >= 3:
                row["throughput_vs_best_other_ci95_low"], row["throughput_vs_best_other_ci95_high"] = _bootstrap(
                    runs, others
                )
            row["throughput_vs_best_other_by_round"] = statistics.median(  # stricter: the fastest other of each round
                run.throughput_tok_s / max(rest.throughput_tok_s for rest in round_)
                for run, *round_ in zip(runs, *others)
            )
        peers = [runs_other for other, runs_other in zip(names, others) if peer and other.startswith(peer)]
        if peers and not mode.startswith(peer) and all(len(runs_other) == len(runs) for runs_other in peers):
            row["throughput_vs_peer_best"] = _vs_best_other(runs, peers, range(len(runs)))
        same = [lv for lv in levels if lv.mode == reference and lv.concurrency == concurrency]
        if reference and mode != reference and len(same) == len(runs):
            row["identical_to"] = reference
            row["identical_requests"], row["compared_requests"] = _identical(runs, same)
        rows.append(row)
    return rows


def _identical(runs: list[Level], reference: list[Level]) -> tuple[int, int]:
    """(requests whose completion equals the reference's, requests compared), round by round:
    request i of a round against request i of the reference's round (the same prompt and seed),
    where both completed."""
    pairs = [(a, b) for run, ref in zip(runs, reference) for a, b in zip(run.texts, ref.texts)]
    compared = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in compared), len(compared)


def _vs_best_other(runs: list[Level], others: list[list[Level]], rounds) -> float:
    """Over the rounds given (indices, repeats allowed): the median, round by round, of this mode's
    throughput / that of the other mode whose median over those rounds is the highest."""
    best = max(others, key=lambda runs_other: statistics.median(runs_other[i].throughput_tok_s for i in rounds))
    return statistics.median(runs[i].throughput_tok_s / best[i].throughput_tok_s for i in rounds)


def _bootstrap(
    runs: list[Level], others: list[list[Level]], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """[2.5%, 97.5%] percentiles of `_vs_best_other` over rounds drawn with replacement (whole
    rounds: every mode's run of a round together, as they shared its load), the best other mode
    chosen again in each draw, so that the interval carries the choice's upward bias too. Rounds
    of a busy 2-core machine scatter 10%: one run's ratio of 0.95 can be a draw of one at 0.98."""
    draw, n = random.Random(seed), len(runs)
    values = sorted(_vs_best_other(runs, others, [draw.randrange(n) for _ in range(n)]) for _ in range(resamples))
    return values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]


def write_csv(rows: list[dict], path: str) -> None:
    import csv

    names = list(dict.fromkeys(name for row in rows for name in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(row["mode"] for row in rows):
        points = sorted((row["concurrency"], row["throughput_tok_s"]) for row in rows if row["mode"] == mode)
        axis.plot([c for c, _ in points], [t for _, t in points], marker="o", label=mode)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("completion tokens / s")
    axis.set_title("verispec serve: throughput against concurrency")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def bench_serve(
    servers: dict,
    prompts: list,
    concurrency: list[int],
    requests: int | None,
    max_tokens: int,
    temperature: float,
    repeats: int,
    progress=None,
    warmups: int = 0,
) -> list[Level]:
    """servers: mode -> base URL, or a peer's mode (peer.LlamaServerMode: `start(concurrency)`
    -> URL, `stop()`, `body`) started for each of its rounds with as many slots as the level's
    concurrency and stopped after it, so that no two servers decode at once. prompts: texts or
    token-id lists. First, at each level in turn, `warmups` rounds of every mode
    that are reported but not measured (vLLM's `bench serve --num-warmups`: a server's first
    requests at a new load pay for what it has not seen yet, e.g. `--k auto` timing passes at a
    batch size new to it); then `repeats` sweeps, each one measured round of every mode at every
    level, so that a level's rounds are spread over the whole run: a server process can run
    slower than the others for minutes, and a level whose rounds all fell in such a stretch would
    read it as that mode's speed. By default a round sends max(16, 2 * concurrency) requests, so
    that a round lasts long enough to average over a busy host's moments; each round of a level
    starts one mode later than the one before, so that no mode always runs right after the same
    other."""
    levels, modes, rounds = [], list(servers.items()), {c: 0 for c in concurrency}

    def round_(c: int, warmup: bool) -> None:
        start, rounds[c] = rounds[c] % len(modes), rounds[c] + 1
        for mode, server in modes[start:] + modes[:start]:
            url = server if isinstance(server, str) else server.start(c)
            try:
                extra = None if isinstance(server, str) else server.body
                n = requests or max(16, 2 * c)
                levels.append(run_level(url, mode, prompts, c, n, max_tokens, temperature, warmup, extra))
            finally:
                if not isinstance(server, str):
                    server.stop()
            if progress is not None:
                progress(levels[-1])

    for c in concurrency:
        for _ in range(warmups):
            round_(c, warmup=True)
    for _ in range(repeats):
        for c in concurrency:
            round_(c, warmup=False)
    return levels


def as_dict(level: Level) -> dict:
    """A level for the JSON report, without its completions."""
    return {name: value for name, value in asdict(level).items() if name != "texts"}
