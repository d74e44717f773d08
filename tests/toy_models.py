"""Toy causal LMs for engine tests: exact distributions by enumeration, real rollback semantics.

`MarkovLM` is an order-2 Markov chain over a tiny vocabulary: the next-token logits are a fixed
random table `table[prev2, prev1] -> [V]`. It implements the target interface the engine uses
(`vocab_size`, `device`, `new_cache`, `prefill`, `forward(input_ids, cache) -> [B, T, V]`) and
works as the model inside `ModelDrafter`. Its cache (`TokenCache`) stores the token ids by
position and a valid length per row, with the same contract as `KVCache`: a forward of T tokens
writes positions lengths[b]..lengths[b]+T-1 and advances every length by T; `rollback` only
changes the lengths. The logits at a position read the token one position back from the cache,
so a wrong rollback (or a stale entry) changes the distribution. Positions before the start of a
sequence hold the BOS-like token 0.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from verispec.config import SamplingParams
from verispec.models.cache import CacheLengths
from verispec.sampling import process_logits

BOS = 0


class TokenCache(CacheLengths):
    """Token ids [B, S_max] by position, with KVCache's length bookkeeping (rollback = new lengths)."""

    def __init__(self, batch_size: int, max_length: int, device: torch.device | str):
        super().__init__(batch_size, max_length, device)
        self.tokens = torch.full((batch_size, max_length), BOS, dtype=torch.long, device=device)

    def valid(self, row: int) -> list[int]:
        """The committed token ids of one row."""
        return self.tokens[row, : self._host_lengths[row]].tolist()


def random_table(vocab_size: int, seed: int, scale: float) -> torch.Tensor:
    """A fixed random logit table [V, V, V], far from uniform, with one strongly negative entry per context."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, vocab_size, vocab_size, generator=generator) * scale
    low = torch.randint(vocab_size, (vocab_size, vocab_size, 1), generator=generator)
    return table.scatter(-1, low, -6.0)


class MarkovLM(nn.Module):
    """An order-2 Markov LM: logits(next | ..., prev2, prev1) = table[prev2, prev1]."""

    def __init__(self, seed: int = 0, vocab_size: int = 5, scale: float = 1.3, table: torch.Tensor | None = None):
        super().__init__()
        if table is None:
            table = random_table(vocab_size, seed, scale)
        if table.dim() != 3 or not table.shape[0] == table.shape[1] == table.shape[2]:
            raise ValueError(f"table must be [V, V, V], got {tuple(table.shape)}")
        self.register_buffer("table", table.float().clone())
        self.forward_calls = 0  # target passes, to count the work done

    @classmethod
    def perturbed(cls, other: MarkovLM, noise: float, seed: int) -> MarkovLM:
        """A model close to `other`: its table plus Normal(0, noise) (a moderately good draft)."""
        generator = torch.Generator().manual_seed(seed)
        return cls(table=other.table + noise * torch.randn(other.table.shape, generator=generator))

    @property
    def vocab_size(self) -> int:
        return self.table.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.table.device

    def new_cache(self, batch_size: int, max_length: int) -> TokenCache:
        return TokenCache(batch_size, max_length, self.device)

    def forward(self, input_ids: torch.Tensor, cache: TokenCache) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, T, V]; writes the tokens at cache.lengths.."""
        batch, length = input_ids.shape
        span = max(cache.host_lengths) + length
        if span > cache.max_length:
            raise ValueError(f"cache overflow: {span} positions needed, cache holds {cache.max_length}")
        positions = cache.lengths[:, None] + torch.arange(length, device=input_ids.device)  # [B, T]
        cache.tokens.scatter_(1, positions, input_ids)
        before = positions - 1
        prev = cache.tokens.gather(1, before.clamp_min(0))  # [B, T]
        prev = torch.where(before >= 0, prev, BOS)
        cache.advance(length)
        self.forward_calls += 1
        return self.table[prev, input_ids].float()  # [B, T, V]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: TokenCache) -> None:
        """Write ragged prompts [B][len_b] into an empty cache; lengths become len_b."""
        longest = max(len(p) for p in prompts)
        if longest == 0:
            return
        padded = [list(p) + [BOS] * (longest - len(p)) for p in prompts]
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)
        self(ids, cache)
        cache.rollback([len(p) for p in prompts])

    # --- exact distributions ---------------------------------------------------------------

    def next_logits(self, history: list[int]) -> torch.Tensor:
        """Raw logits [V] of the token after `history` (BOS before the start)."""
        padded = [BOS, BOS] + list(history)
        return self.table[padded[-2], padded[-1]]

    def next_probs(self, history: list[int], params: SamplingParams) -> torch.Tensor:
        """The processed distribution [V] (float32) the engine draws the next token from."""
        return process_logits(self.next_logits(history), params)

    def continuation_probs(self, prompt: list[int], length: int, params: SamplingParams) -> torch.Tensor:
        """Exact joint probabilities [V] * length (float64) of the next `length` tokens after `prompt`."""
        vocab = self.vocab_size
        probs = torch.zeros((vocab,) * length, dtype=torch.float64)
        for cell in itertools.product(range(vocab), repeat=length):
            p, history = 1.0, list(prompt)
            for token in cell:
                p *= float(self.next_probs(history, params)[token])
                if p == 0.0:
                    break
                history.append(token)
            probs[cell] = p
        return probs


def toy_text(pieces: list[str], special: tuple[int, ...] = ()):
    """A TokenText (verispec.models.token_text) over these pieces: id i stands for pieces[i] (its
    UTF-8 bytes); text is encoded by greedy longest match, so two piece lists tokenize one text
    differently (drafts with another tokenizer, tests/test_cross_vocab.py)."""
    from verispec.models.token_text import TokenText

    table = {p: i for i, p in enumerate(pieces) if i not in special}
    longest = max(len(p) for p in table)

    def encode(text: str) -> list[int]:
        ids, at = [], 0
        while at < len(text):
            for size in range(min(longest, len(text) - at), 0, -1):
                if text[at : at + size] in table:
                    ids.append(table[text[at : at + size]])
                    at += size
                    break
            else:
                raise ValueError(f"{text[at]!r} is no token")
        return ids

    return TokenText(tuple(p.encode() for p in pieces), frozenset(special), encode)


def retokenized_draft(source, directory, drop_every: int = 3, text: str = ""):
    """A copy of the model directory `source` with another tokenizer: every `drop_every`-th merged
    token that no merge uses is dropped (with the merge that makes it), merges of adjacent tokens
    of `text` that the source lacks are added (embedding: the first part's), and the tokens are
    renumbered (special tokens last), the embedding (tied head) rows following. Text is then
    tokenized differently, the ids differ, and each side has tokens the other lacks; no download."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    from verispec.models.checkpoint import load_pretrained, save_pretrained
    from verispec.models.llama import LlamaForCausalLM
    from verispec.models.toy import EOS

    source, directory = Path(source), Path(directory)
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"]]
    inputs = {part for merge in merges for part in merge}
    dropped = {a + b for a, b in merges if a + b not in inputs and vocab[a + b] % drop_every == 0}
    spec["model"]["merges"] = [[a, b] for a, b in merges if a + b not in dropped]
    for t in dropped:
        del spec["model"]["vocab"][t]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode(text).ids]
    added: dict[str, str] = {}  # new token -> the token whose embedding it starts from
    for a, b in zip(pieces, pieces[1:]):
        if a + b not in vocab and a + b not in added and len(added) < 64:
            added[a + b] = a
            spec["model"]["merges"].append([a, b])
    special = {entry["content"]: entry["id"] for entry in spec["added_tokens"]}
    vocab = {**vocab, **special}
    order = sorted(
        [t for t in vocab if t not in dropped] + list(added), key=lambda t: (t in special, vocab.get(t, 1e9))
    )
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for entry in spec["added_tokens"]:
        entry["id"] = spec["model"]["vocab"][entry["content"]]
    model = load_pretrained(source)
    rows = torch.tensor([vocab[added.get(t, t)] for t in order])
    config = model.config.replace(vocab_size=len(order), eos_token_id=spec["model"]["vocab"][EOS])
    draft = LlamaForCausalLM(config).to(model.dtype)
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][rows]
    draft.load_state_dict(state, strict=False)
    save_pretrained(draft, directory)
    (directory / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return directory
