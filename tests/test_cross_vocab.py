"""Drafts with another tokenizer (`verispec.drafters.cross_vocab`): token-level intersection.

The target and the draft are order-2 Markov toys (tests/toy_models.py) over two different
vocabularies of byte strings: the target's a, b, c, ab, ca; the draft's c, a, bc, b, abc, cb (other
ids, other merges), so the intersection is a, b, c. The joint distribution of three tokens must
match the target's exactly (chi-square at a false-failure rate of 1e-9) in rejection mode and in
invariant mode; negative controls (q not renormalised, q declared as if the ids were shared,
uniform noise in invariant mode) must fail the same test. Greedy output equals plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, chi_square, is_distributed_as, threshold
from toy_models import MarkovLM, toy_text

import verispec.drafters.cross_vocab as cross_vocab
from verispec.config import SamplingParams
from verispec.drafters.cross_vocab import TokenIntersectionDrafter, intersect, restricted_q
from verispec.drafters.draft_text import DraftText
from verispec.drafters.string_level import StringLevelDrafter
from verispec.engine import generate_all
from verispec.sampling import RowSampling, process_logits
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET_PIECES = ["a", "b", "c", "ab", "ca"]
DRAFT_PIECES = ["c", "a", "bc", "b", "abc", "cb"]
PROMPT = [3, 1, 4]  # "abbca": the draft reads a, b, bc, a
TOKENS = 3
N = 30_000
NEGATIVE_N = 20_000


@pytest.fixture(scope="module")
def pair():
    """(target, draft model): the draft's table is the target's where the bytes agree, plus noise."""
    target = MarkovLM(seed=1)
    to_target = [TARGET_PIECES.index(p) if p in TARGET_PIECES else TARGET_PIECES.index(p[0]) for p in DRAFT_PIECES]
    index = torch.tensor(to_target)
    table = target.table[index][:, index][:, :, index]  # [6, 6, 6]
    noise = torch.randn(table.shape, generator=torch.Generator().manual_seed(7))
    return target, MarkovLM(table=table + noise)


def drafter(pair, kind=TokenIntersectionDrafter, **kwargs) -> TokenIntersectionDrafter:
    target, draft = pair
    return kind(draft, toy_text(DRAFT_PIECES), toy_text(TARGET_PIECES), target.vocab_size, **kwargs)


def joint_counts(target, made, params: SamplingParams, k: int, n: int):
    stats = SpecStats()
    tokens = np.asarray(generate_all(target, [PROMPT] * n, params, made, k=k, stats=stats))
    cells = np.ravel_multi_index(tokens.T, (target.vocab_size,) * TOKENS)
    return np.bincount(cells, minlength=target.vocab_size**TOKENS), stats


def test_the_intersection_matches_bytes_and_special_tokens_by_text():
    inter = intersect(toy_text(TARGET_PIECES), toy_text(DRAFT_PIECES))
    assert dict(zip(inter.draft_ids.tolist(), inter.target_ids.tolist())) == {0: 2, 1: 0, 3: 1}
    assert inter.to_draft.tolist() == [1, 3, 0, -1, -1] and len(inter) == 3 and inter.draft_size == 6
    # a special token matches only a special token of the same text, never text that spells it
    target, draft = toy_text(["a", "<s>", "<e>"], special=(1, 2)), toy_text(["<e>", "a", "<s>"], special=(0,))
    assert dict(zip(*(t.tolist() for t in (lambda i: (i.draft_ids, i.target_ids))(intersect(target, draft))))) == {
        0: 2,
        1: 0,
    }
    with pytest.raises(ValueError, match="shares no token"):
        intersect(toy_text(["a"]), toy_text(["b"]))


def test_restricted_q_is_the_processed_draft_on_the_intersection_renormalised():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 3.0, -1.0], [0.0, 0.0, 5.0, 0.0, 5.0, 5.0]])
    inter = intersect(toy_text(TARGET_PIECES), toy_text(DRAFT_PIECES))
    params = SamplingParams(temperature=0.9, top_k=3)
    q, best = restricted_q(logits, RowSampling(params, 2), inter, 5)
    processed = process_logits(logits, params)
    expected = torch.zeros(5)
    expected[[2, 0, 1]] = processed[0, [0, 1, 3]]
    torch.testing.assert_close(q[0], expected / expected.sum())
    assert best.tolist() == [0, 2]
    # row 1: top-3 is bc, abc, cb, all outside the intersection: q one-hot at the best intersection token
    assert q[1].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "setting, k",
    [(dict(temperature=1.0), 1), (dict(temperature=1.0), 3), (dict(temperature=0.8, top_k=2), 3)],
    ids=["T1-k1", "T1-k3", "T0.8-topk2-k3"],  # top-k 2: rows whose restricted mass is zero
)
def test_joint_distribution_is_exact_in_rejection_mode(pair, setting, k):
    target, _ = pair
    params = SamplingParams(**setting, seed=100 + k, max_new_tokens=TOKENS)
    counts, stats = joint_counts(target, drafter(pair), params, k, N)
    exact = target.continuation_probs(PROMPT, TOKENS, params).ravel()
    assert_distributed_as(counts, exact, are_counts=True, label=f"cross-vocabulary {setting} k={k}")
    assert 0 < stats.accepted < stats.proposed, stats.summary()
    assert stats.accepted_by_position[k - 1] > 0


def test_joint_distribution_is_exact_in_invariant_mode_and_equals_plain_decoding(pair):
    target, _ = pair
    params = SamplingParams(temperature=1.0, seed=300, max_new_tokens=TOKENS, sampling="invariant")
    counts, stats = joint_counts(target, drafter(pair), params, 3, N)
    assert_distributed_as(counts, target.continuation_probs(PROMPT, TOKENS, params).ravel(), are_counts=True)
    assert 0 < stats.accepted < stats.proposed, stats.summary()
    prompts = [[b % 5, (b * 3) % 5, 1][: 1 + b % 3] for b in range(300)]
    params = SamplingParams(temperature=0.9, seed=301, max_new_tokens=10, sampling="invariant")
    assert generate_all(target, prompts, params, drafter(pair), k=3) == generate_all(target, prompts, params)


def _assert_fails(counts, exact):
    statistic, df = chi_square(counts, exact)
    assert not is_distributed_as(counts, exact, are_counts=True)
    assert statistic > 3 * threshold(df), (statistic, threshold(df))


def test_negative_control_q_not_renormalised(pair, monkeypatch):
    """Drawn in proportion to the restricted mass (the same draw) but declared without dividing by it."""
    real = cross_vocab.restricted_q

    def unnormalised(logits, sampling, inter, size):
        q, best = real(logits, sampling, inter, size)
        mass = (
            torch.zeros_like(q)
            .index_add_(1, inter.target_ids, sampling.process(logits[:, None].float())[:, 0][:, inter.draft_ids])
            .sum(dim=-1, keepdim=True)
        )
        return torch.where(mass > 0, q * mass, q), best

    monkeypatch.setattr(cross_vocab, "restricted_q", unnormalised)
    target, _ = pair
    params = SamplingParams(temperature=1.0, seed=400, max_new_tokens=TOKENS)
    counts, _ = joint_counts(target, drafter(pair), params, 3, NEGATIVE_N)
    _assert_fails(counts, target.continuation_probs(PROMPT, TOKENS, params).ravel())


class _DeclaresSharedIds:
    """A RowSampling whose draws use the real restricted q while the drafter declares q as if the
    two vocabularies shared ids (the draft's processed distribution read by id, renormalised)."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def draw(self, probs, positions, modes=("invariant", "rejection")):
        return self.real.draw(self.drawn_from.pop(), positions, modes)


def test_negative_control_q_declared_as_if_the_ids_were_shared(pair, monkeypatch):
    real = cross_vocab.restricted_q

    def declared(logits, sampling, inter, size):
        q, best = real(logits, sampling, inter, size)
        sampling.drawn_from = [q[:, None]]
        wrong = sampling.process(logits[:, None].float())[:, 0, :size]
        return wrong / wrong.sum(dim=-1, keepdim=True), best

    monkeypatch.setattr(cross_vocab, "restricted_q", declared)
    propose = TokenIntersectionDrafter.propose
    monkeypatch.setattr(
        TokenIntersectionDrafter, "propose", lambda self, k, sampling: propose(self, k, _DeclaresSharedIds(sampling))
    )
    target, _ = pair
    params = SamplingParams(temperature=1.0, seed=500, max_new_tokens=TOKENS)
    counts, _ = joint_counts(target, drafter(pair), params, 3, NEGATIVE_N)
    _assert_fails(counts, target.continuation_probs(PROMPT, TOKENS, params).ravel())


def test_negative_control_invariant_mode_with_uniform_noise(pair, monkeypatch):
    """No drafter error can change invariant mode's tokens (it commits the target's own choices);
    the test's power there is shown by breaking the rule's noise instead."""
    import verispec.invariant as invariant

    gumbel = invariant.gumbel_noise
    monkeypatch.setattr(invariant, "gumbel_noise", lambda *args: torch.exp(-torch.exp(-gumbel(*args))))
    target, _ = pair
    params = SamplingParams(temperature=1.0, seed=600, max_new_tokens=TOKENS, sampling="invariant")
    counts, _ = joint_counts(target, drafter(pair), params, 3, NEGATIVE_N)
    _assert_fails(counts, target.continuation_probs(PROMPT, TOKENS, params).ravel())


@pytest.mark.parametrize("kind", [TokenIntersectionDrafter, StringLevelDrafter])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_plain_decoding(pair, k, kind):
    target, _ = pair
    prompts = [[3, 1, 4], [0], [2, 2, 3, 4, 1, 0, 3]]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    stats = SpecStats()
    assert generate_all(target, prompts, params, drafter(pair, kind), k=k, stats=stats) == generate_all(
        target, prompts, params
    )
    assert stats.accepted > 0


def test_string_level_drafting_proposes_the_targets_tokens_for_the_drafts_text(pair):
    """The draft's tokens "abc" and "cb" have no target token of their bytes (outside the intersection); drafted
    as text they become the target's "ab" "c" and "c" "b". At T > 0 it drafts as the intersection does (the same
    tokens from the same seed)."""
    target, _ = pair
    made = drafter(pair, StringLevelDrafter)
    made.start([[3, 1, 4]], 16)
    assert made._target_ids(0, [DRAFT_PIECES.index("abc"), DRAFT_PIECES.index("cb")]) == [3, 2, 2, 1]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    assert generate_all(target, [[3, 1, 4]] * 4, sampled, made, k=3) == generate_all(
        target, [[3, 1, 4]] * 4, sampled, drafter(pair), k=3
    )


def test_draft_text_reencodes_the_committed_text_incrementally():
    """After every commit the draft ids spell the committed text, re-encoded from an anchor."""
    target = toy_text(TARGET_PIECES)
    draft = toy_text(DRAFT_PIECES)
    text = DraftText(target, draft, intersect(target, draft).to_draft.tolist(), [3])
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        text.extend(
            torch.randint(0, 5, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator).tolist()
        )
        spelled = "".join(DRAFT_PIECES[d] for d in text.ids)
        assert spelled == "".join(TARGET_PIECES[t] for t in text.history)
    assert text._anchor[0] > 0  # the anchor moved: only a tail is re-encoded


# ---------------------------------------------------------------------------------------------
# The built-in target with a draft of another tokenizer: the built-in draft re-tokenized
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    from toy_models import retokenized_draft

    from verispec.models.checkpoint import load_pretrained, load_tokenizer
    from verispec.models.token_text import text_of_hf
    from verispec.pair import DRAFT_DIR, HELDOUT_PROMPTS, TARGET_DIR

    text = (HELDOUT_PROMPTS.read_text())[:20000]
    directory = retokenized_draft(DRAFT_DIR, tmp_path_factory.mktemp("retokenized") / "draft", text=text)
    target, draft = load_pretrained(TARGET_DIR), load_pretrained(directory)
    texts = text_of_hf(load_tokenizer(TARGET_DIR), target.vocab_size), text_of_hf(load_tokenizer(directory))
    return target, draft, texts, load_tokenizer(TARGET_DIR), directory


@pytest.mark.parametrize("kind", [TokenIntersectionDrafter, StringLevelDrafter])
def test_builtin_target_with_a_retokenized_draft_gives_plain_greedy_output(builtin, kind):
    target, draft, (target_text, draft_text), tokenizer, _ = builtin
    made = kind(draft, draft_text, target_text, target.vocab_size)
    inter = made.intersection
    assert 0.5 * len(draft_text) < len(inter) < len(draft_text) == draft.vocab_size < target.vocab_size
    sources = [
        "def add(a, b):\n    return a + b\n\n\ndef mul(",
        "import os\n\nclass Loader:\n    def __init__(self, path",
    ]
    prompts = [tokenizer.encode(s).ids for s in sources]
    assert draft_text.encode(sources[0]) != prompts[0]  # the draft reads other ids
    params = SamplingParams(temperature=0, max_new_tokens=40)
    stats = SpecStats()
    assert generate_all(target, prompts, params, made, k=4, stats=stats) == generate_all(target, prompts, params)
    assert stats.alpha_hat > 0.3, stats.summary()


def test_draft_text_of_a_byte_level_bpe_equals_encoding_the_whole_text(builtin):
    """Re-encoded incrementally from an anchor, the draft ids are those of the whole text (for
    ordinary text), and a character split across target tokens waits for its last byte."""
    _, _, (target_text, draft_text), tokenizer, _ = builtin
    source = "def f(x):\n    # naïve — ünïcode ✓\n    return [y * 2 for y in range(x)]  # done\n" * 3
    ids = tokenizer.encode(source).ids
    text = DraftText(target_text, draft_text, intersect(target_text, draft_text).to_draft.tolist(), ids[:3])
    for at in range(3, len(ids), 2):
        text.extend(ids[at : at + 2])
        committed = b"".join(target_text.pieces[t] for t in text.history)
        spelled = b"".join(draft_text.pieces[d] for d in text.ids)
        assert committed.startswith(spelled) and len(committed) - len(spelled) < 4
    assert text.ids == draft_text.encode(source) and text._anchor[0] > 0


def test_assemble_picks_the_intersection_drafter_and_says_which_mode(builtin):
    from verispec.assemble import Settings, load_drafter
    from verispec.drafters.model import ModelDrafter
    from verispec.pair import DRAFT_DIR

    target, _, _, _, directory = builtin
    said = []
    made = load_drafter(Settings(draft=str(directory), backend="torch"), target, said.append)
    assert isinstance(made, TokenIntersectionDrafter)
    line = f"token-level intersection: {len(made.intersection)} of {len(made.draft_text)} draft tokens"
    assert said == [f"--draft {directory}: {line}"]
    share = made.mode_line(["def f(x):\n    return x\n", "import os\n"])
    assert ", share of the draft's probability mass 0." in share
    same = load_drafter(Settings(draft=str(DRAFT_DIR), backend="torch"), target, said.append)
    assert isinstance(same, ModelDrafter) and len(said) == 1  # the same vocabulary: nothing to say


def test_a_draft_that_can_propose_little_of_the_prompt_is_said_not_to_pay(pair):
    from verispec.drafters.cross_vocab import PROPOSABLE_FLOOR, cannot_pay

    made = drafter(pair)  # the draft has "a", "b", "c" of the target's pieces, not "ab" (3) or "ca" (4)
    assert made.proposable([[3, 4, 3, 0]]) == 0.25 and made.proposable([[0, 1], [2, 3]]) == 0.75
    assert "only 25% of the prompt's tokens" in cannot_pay(made, [[3, 4, 3, 0]], "d.gguf") and PROPOSABLE_FLOOR > 0.25
    assert cannot_pay(made, [[0, 1], [2, 3]], "d.gguf") is None
    assert cannot_pay(drafter(pair, StringLevelDrafter), [[3, 4, 3, 0]], "string:d.gguf") is None  # drafts text


def test_string_prefix_drafts_text_and_is_refused_for_a_shared_tokenizer(builtin):
    from verispec.assemble import Settings, load_drafter
    from verispec.pair import DRAFT_DIR

    target, _, _, _, directory = builtin
    said = []
    made = load_drafter(Settings(draft=f"string:{directory}", backend="torch"), target, said.append)
    assert isinstance(made, StringLevelDrafter)
    line = f"token-level intersection: {len(made.intersection)} of {len(made.draft_text)} draft tokens"
    assert said == [f"--draft string:{directory}: string-level drafting at temperature 0; otherwise {line}"]
    with pytest.raises(ValueError, match="shares the target's tokenizer"):
        load_drafter(Settings(draft=f"string:{DRAFT_DIR}", backend="torch"), target)
    with pytest.raises(ValueError, match="string-level drafting takes a draft model"):
        Settings(draft="string:ngram")


def test_plan_says_the_mode_and_the_intersections_share_on_the_prompts(builtin, tmp_path, capsys):
    from verispec.cli import main
    from verispec.pair import TARGET_DIR

    *_, directory = builtin
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return"}\n')
    args = ["plan", "--target", str(TARGET_DIR), "--draft", str(directory), "--draft", f"string:{directory}"]
    assert main([*args, "--backend", "torch", "--prompts", str(prompts), "--max-new-tokens", "8", "--k-max", "2"]) == 0
    out, err = capsys.readouterr()
    assert "token-level intersection: " in err and ", share of the draft's probability mass 0." in err
    assert f"--draft string:{directory}: string-level drafting at temperature 0" in err
    assert str(directory) in out and f"string:{directory}" in out  # both candidates ranked


@pytest.mark.parametrize("prefix", ["", "string:"])
def test_gguf_target_with_a_gguf_draft_of_another_tokenizer_gives_plain_greedy_output(
    builtin, tmp_path_factory, prefix
):
    """On llama.cpp: both models as GGUF files (each read with its own GGUF vocabulary), assembled as a user's
    --target / --draft are: the intersection (or string-level) drafter runs and greedy output is plain's."""
    from verispec.assemble import Settings, load_drafter, load_target
    from verispec.models.gguf_convert import convert
    from verispec.pair import TARGET_DIR

    *_, directory = builtin
    out = tmp_path_factory.mktemp("gguf-vocab")
    files = [convert(source, out / f"{name}.gguf", "f32") for name, source in (("t", TARGET_DIR), ("d", directory))]
    settings = Settings(target=str(files[0]), draft=prefix + str(files[1]), backend="llamacpp", threads=1)
    target, tokenizer = load_target(settings)
    made = load_drafter(settings, target)
    assert isinstance(made, StringLevelDrafter if prefix else TokenIntersectionDrafter)
    assert type(made.model).__name__ == "LlamaCppModel"
    prompts = [tokenizer.encode(s).ids for s in ("def add(a, b):\n    return a + b\n\n\ndef mul(", "import os\n")]
    params, stats = SamplingParams(temperature=0, max_new_tokens=32), SpecStats()
    assert generate_all(target, prompts, params, made, k=4, stats=stats) == generate_all(target, prompts, params)
    assert stats.alpha_hat > 0.2, stats.summary()
