"""transformers models through the adapter (`verispec.models.hf`), vocabulary checks, `load_model`.

All models are tiny, randomly initialised from configs (no downloads): transformers' Llama and
GPT-2 (a non-Llama architecture: learned absolute positions, LayerNorm, Conv1D).

- Greedy: verispec's speculative output through the adapter equals transformers' own
  `generate(do_sample=False)`, token for token, in float32 (batch 1; batch 2 with ragged prompts
  against per-row `generate`), with a self-draft (whole blocks accepted) and an unrelated draft
  (almost every proposal rejected: a rollback per step).
- GPT-2 as target and as draft, mixed with verispec's own Llama model.
- Exactness at temperature 1: the joint distribution of a 2-token continuation (GPT-2 target,
  GPT-2 draft, vocab 16: 256 cells) over one batch of identical prompts matches the exact
  enumeration from transformers' own softmax (chi-square at a 1e-9 false-failure rate); a
  negative control (the adapter's hole mask switched off) fails.
- Rollback: ragged rollbacks, with and without compaction, give the logits of a fresh pass.
- Vocabulary checks and `load_model`'s routing; the command line with a GPT-2 target.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from stats_helpers import assert_distributed_as, chi_square, is_distributed_as, threshold

import verispec.models.hf as hf_module
from verispec.cli import main
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.checkpoint import CheckpointError, save_pretrained
from verispec.models.hf import HFCache, HFCausalLM, load_model
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.models.toy import byte_level_tokenizer, make_toy_pair
from verispec.models.vocab import check_same_tokenizer, match_vocab_size
from verispec.sampling import process_logits
from verispec.stats import SpecStats

transformers.logging.set_verbosity_error()  # random configs: token ids outside tiny vocabularies


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


VOCAB = 48


def hf_model(arch: str, seed: int, vocab_size: int = VOCAB, init: float = 0.5):
    """A random transformers model; init 0.5 gives peaked logits (float32 greedy has no near-ties)."""
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=256,
            initializer_range=init,
            bos_token_id=None,
            eos_token_id=None,
            activation_function="gelu",  # exact gelu: faster than gelu_new on CPU
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=init,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy decoding; checks that no step was a near-tie (the premise of exact equality)."""
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=steps,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    top2 = torch.stack(out.scores, dim=1)[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near-tie in the reference: pick another seed"
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == steps
    return tokens


@pytest.fixture(scope="module")
def models():
    return {arch: {"target": hf_model(arch, 0), "other": hf_model(arch, 1)} for arch in ("llama", "gpt2")}


# ---------------------------------------------------------------------------------------------
# (a) greedy speculative output == transformers' generate
# ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_new_tokens=20)
PROMPTS = {"batch1": [[5, 17, 33, 2, 41]], "batch2": [[5, 17, 33, 2, 41, 9, 8], [11, 3]]}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", sorted(PROMPTS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_speculative_greedy_equals_transformers_generate(models, arch, batch, k):
    hf_target, hf_other = models[arch]["target"], models[arch]["other"]
    prompts = PROMPTS[batch]
    expected = [hf_greedy(hf_target, p, GREEDY.max_new_tokens) for p in prompts]
    target = HFCausalLM(hf_target)
    assert generate_all(target, prompts, GREEDY, drafter=None) == expected  # plain decoding

    self_stats, other_stats = SpecStats(), SpecStats()
    assert generate_all(target, prompts, GREEDY, ModelDrafter(HFCausalLM(hf_target)), k=k, stats=self_stats) == expected
    assert self_stats.alpha_hat >= 0.98, self_stats.summary()  # whole blocks accepted, bonus tokens
    assert generate_all(target, prompts, GREEDY, ModelDrafter(HFCausalLM(hf_other)), k=k, stats=other_stats) == expected
    assert other_stats.alpha_hat < 0.5, other_stats.summary()  # mostly rejected: rollbacks every step


# ---------------------------------------------------------------------------------------------
# (b) GPT-2 as target and as draft
# ---------------------------------------------------------------------------------------------


def test_gpt2_as_draft_for_a_verispec_llama_target(models):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
    )
    target = init_weights(LlamaForCausalLM(config), std=0.3, seed=0).eval()
    prompts = PROMPTS["batch2"]
    plain = generate_all(target, prompts, GREEDY, drafter=None)
    stats = SpecStats()
    assert (
        generate_all(target, prompts, GREEDY, ModelDrafter(HFCausalLM(models["gpt2"]["target"])), k=3, stats=stats)
        == plain
    )
    assert stats.proposed > 0
    # and the other way round: verispec's Llama drafting for a GPT-2 target
    gpt2 = HFCausalLM(models["gpt2"]["target"])
    assert generate_all(gpt2, prompts, GREEDY, ModelDrafter(target), k=3) == generate_all(
        gpt2, prompts, GREEDY, drafter=None
    )


def test_gpt2_target_with_gpt2_draft_sampling_is_reproducible_and_self_draft_accepts_all(models):
    gpt2 = HFCausalLM(models["gpt2"]["target"])
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=16)
    stats = SpecStats()
    first = generate_all(gpt2, prompts, params, ModelDrafter(gpt2), k=4, stats=stats)
    assert stats.alpha_hat >= 0.98, stats.summary()  # p == q, the draft cache keeps x_k and the bonus token
    assert all(len(row) == 16 for row in first)
    other = ModelDrafter(HFCausalLM(models["gpt2"]["other"]))
    assert generate_all(gpt2, prompts, params, other, k=4) == generate_all(
        gpt2, prompts, params, ModelDrafter(HFCausalLM(models["gpt2"]["other"])), k=4
    )


# ---------------------------------------------------------------------------------------------
# (c) exactness through the adapter: the joint distribution of two tokens
# ---------------------------------------------------------------------------------------------

SMALL_VOCAB = 16
JOINT_PROMPTS = ([3, 1, 4, 1, 5, 9], [2, 7, 1])  # ragged: the short rows hold holes from the first pass on
JOINT_N = 15_000  # rows per prompt, in one interleaved batch of 30,000
NEGATIVE_N = 5_000


@pytest.fixture(scope="module")
def small_gpt2():
    return hf_model("gpt2", 10, SMALL_VOCAB, init=0.3), hf_model("gpt2", 11, SMALL_VOCAB, init=0.3)


def exact_two_tokens(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(x1, x2 | prompt) [V * V] from transformers' own full forward passes (no cache), processed as the engine
    does."""
    with torch.no_grad():
        first = process_logits(model(torch.tensor([prompt])).logits[0, -1], params).double()  # [V]
        pairs = torch.tensor([prompt + [x] for x in range(SMALL_VOCAB)])
        second = process_logits(model(pairs).logits[:, -1], params).double()  # [V, V]
    return (first[:, None] * second).ravel().numpy()


def joint_counts(target, draft, params: SamplingParams, n: int) -> tuple[list[np.ndarray], SpecStats]:
    """Counts [V * V] of the 2-token continuation of each of JOINT_PROMPTS, n rows each, k = 2."""
    stats = SpecStats()
    outputs = np.asarray(generate_all(target, list(JOINT_PROMPTS) * n, params, ModelDrafter(draft), k=2, stats=stats))
    assert outputs.shape == (len(JOINT_PROMPTS) * n, 2)
    cells = outputs[:, 0] * SMALL_VOCAB + outputs[:, 1]
    return [
        np.bincount(cells[i :: len(JOINT_PROMPTS)], minlength=SMALL_VOCAB**2) for i in range(len(JOINT_PROMPTS))
    ], stats


def test_joint_distribution_of_two_tokens_is_exact_through_the_adapter(small_gpt2):
    hf_target, hf_draft = small_gpt2
    params = SamplingParams(temperature=1.0, seed=2024, max_new_tokens=2)
    counts, stats = joint_counts(HFCausalLM(hf_target), HFCausalLM(hf_draft), params, JOINT_N)
    for prompt, observed in zip(JOINT_PROMPTS, counts):
        assert_distributed_as(
            observed,
            exact_two_tokens(hf_target, prompt, params),
            are_counts=True,
            label=f"gpt2 T=1 k=2 prompt {prompt}",
        )
    assert 0 < stats.accepted < stats.proposed  # acceptances and rejections (residual draws)
    assert stats.accepted_by_position[1] > 0  # whole blocks accepted (bonus tokens)


def test_negative_control_hidden_positions_left_visible(small_gpt2, monkeypatch):
    """Without the hole mask the short rows see the right-padding of the ragged prefill (and any
    rejected token left in the middle of a row): the same test must fail, by far."""
    hf_target, hf_draft = small_gpt2
    monkeypatch.setattr(HFCache, "attention_mask", lambda self, num_new: None)
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=2)
    counts, _ = joint_counts(HFCausalLM(hf_target), HFCausalLM(hf_draft), params, NEGATIVE_N)
    exact = exact_two_tokens(hf_target, JOINT_PROMPTS[1], params)
    statistic, df = chi_square(counts[1], exact)
    assert not is_distributed_as(counts[1], exact, are_counts=True)
    assert statistic > 3 * threshold(df), (statistic, threshold(df))


# ---------------------------------------------------------------------------------------------
# (d) rollback == fresh prefill
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compacted"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ragged_rollbacks_equal_a_fresh_pass(models, arch, compact, monkeypatch):
    """Prefix, k junk proposals, a ragged rollback, a continuation, many times over: every row's
    logits equal those of transformers' own full pass over its committed tokens."""
    if compact:  # compact at every rollback (normally only when holes outnumber the committed columns)
        monkeypatch.setattr(hf_module, "_COMPACT_SLACK", -(10**9))
    hf = hf_model(arch, 0, init=0.2)  # logits of order 1, so that atol 1e-5 is float32 rounding, not a tolerance
    model = HFCausalLM(hf)
    generator = torch.Generator().manual_seed(0)
    sequences = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    with torch.no_grad():
        cache = model.new_cache(3, 128)
        model.prefill(sequences, cache)
        for _ in range(10):
            junk = torch.randint(VOCAB, (3, 4), generator=generator)
            model(junk, cache)
            accepted = torch.randint(0, 3, (3,), generator=generator).tolist()
            cache.rollback([len(s) + a for s, a in zip(sequences, accepted)])
            continuation = torch.randint(VOCAB, (3, 2), generator=generator)
            logits = model(continuation, cache)  # [3, 2, V]
            for b, sequence in enumerate(sequences):
                sequence += junk[b, : accepted[b]].tolist() + continuation[b].tolist()
                reference = hf(torch.tensor([sequence])).logits[0, -2:]
                torch.testing.assert_close(logits[b], reference, atol=1e-5, rtol=0)
            assert cache.host_lengths == cache.lengths.tolist() == [len(s) for s in sequences]
        if compact:
            assert cache.num_columns == max(cache.host_lengths)
        assert cache.num_columns < sum(len(s) for s in sequences)  # trailing holes were cropped


def test_batch_one_rollback_is_a_crop(models):
    model = HFCausalLM(models["gpt2"]["target"])
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        model.prefill([[1, 2, 3, 4]], cache)
        model(torch.tensor([[5, 6, 7, 8]]), cache)
        cache.rollback([6])
        assert cache.num_columns == cache.hf.get_seq_length() == 6
        assert cache.attention_mask(1) is None  # no holes, no mask: only the new tokens are fed
        with pytest.raises(ValueError, match="rollback lengths"):
            cache.rollback([7])  # rollback only lowers lengths
        with pytest.raises(ValueError, match="KV cache overflow"):
            model(torch.zeros(1, 59, dtype=torch.long), cache)


def test_long_greedy_run_with_forced_rejections_equals_plain(models):
    target = HFCausalLM(models["llama"]["target"])
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12]]
    params = SamplingParams(temperature=0, max_new_tokens=60)
    stats = SpecStats()
    assert generate_all(
        target, prompts, params, ModelDrafter(HFCausalLM(models["llama"]["other"])), k=4, stats=stats
    ) == generate_all(target, prompts, params, drafter=None)
    assert all(r.proposed - r.accepted > 40 for r in stats.requests)


def test_unsupported_cache_layers_are_refused():
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with pytest.raises(ValueError, match="cannot be rolled back"):
        HFCausalLM(transformers.MistralForCausalLM(config))


# ---------------------------------------------------------------------------------------------
# (e) vocabulary checks
# ---------------------------------------------------------------------------------------------

TOKENS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(20)]


def write_tokenizer(directory, tokens=TOKENS, special=("<eos>",)):
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(special))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_identical_tokenizers_pass_and_padding_is_allowed(tmp_path):
    target, draft = write_tokenizer(tmp_path / "t"), write_tokenizer(tmp_path / "d")
    assert check_same_tokenizer(target, draft, 22, 22).startswith("same tokenizer (22 tokens)")
    assert check_same_tokenizer(target, draft, 22, 64)  # draft embedding padded larger
    assert check_same_tokenizer(target, draft, 32, 22)  # target padded to a multiple
    with pytest.raises(ValueError, match="the draft model has 20 output logits, fewer than its tokenizer's 22"):
        check_same_tokenizer(target, draft, 22, 20)


@pytest.mark.parametrize(
    "draft_tokens, special, message",
    [
        (
            TOKENS[:5] + ["w13"] + TOKENS[6:15] + ["w3"] + TOKENS[16:],
            ("<eos>",),
            "token 'w3' is id 5 in the target, id 15 in the draft",
        ),
        (TOKENS[:-1] + ["other"], ("<eos>",), "token 'w19' is id 21 in the target, absent from the draft"),
        (TOKENS + ["extra"], ("<eos>",), "token 'extra' is id 22 in the draft, absent from the target"),
        (TOKENS, (), "token '<eos>' (id 1) is special in the target, not in the draft"),
    ],
    ids=["swapped", "missing", "extra", "special"],
)
def test_different_tokenizers_fail_naming_the_first_difference(tmp_path, draft_tokens, special, message):
    target, draft = write_tokenizer(tmp_path / "t"), write_tokenizer(tmp_path / "d", draft_tokens, special)
    with pytest.raises(ValueError) as error:
        check_same_tokenizer(target, draft, 32, 32)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_without_tokenizer_json_only_sizes_are_compared(tmp_path):
    target, bare = write_tokenizer(tmp_path / "t"), tmp_path / "bare"
    bare.mkdir()
    assert "compared vocab sizes only" in check_same_tokenizer(target, bare, 22, 22)
    assert "compared vocab sizes only" in check_same_tokenizer(bare, target, 22, 22)
    with pytest.raises(ValueError, match="draft vocab size 24 differs from the target's 22"):
        check_same_tokenizer(target, bare, 22, 24)


def test_a_draft_padded_larger_drafts_exactly(models):
    """match_vocab_size: a GPT-2 draft with 64 logits (16 of padding) for a 48-token target."""
    target = HFCausalLM(models["gpt2"]["target"])
    padded = HFCausalLM(hf_model("gpt2", 0, vocab_size=64))
    prompts = PROMPTS["batch2"]
    drafter = ModelDrafter(match_vocab_size(padded, target.vocab_size))
    assert generate_all(target, prompts, GREEDY, drafter, k=3) == generate_all(target, prompts, GREEDY, drafter=None)
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=8)
    small = match_vocab_size(
        HFCausalLM(hf_model("gpt2", 1, vocab_size=40)), VOCAB
    )  # logits padded with -inf; ids >= 40 fed as 0
    assert all(len(row) == 8 for row in generate_all(target, prompts, params, ModelDrafter(small), k=2))
    assert match_vocab_size(target, VOCAB) is target


# ---------------------------------------------------------------------------------------------
# (f) load_model routing, and the command line
# ---------------------------------------------------------------------------------------------


def test_load_model_routes_llama_family_to_verispec_and_others_to_the_adapter(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    verispec_llama = init_weights(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
            )
        )
    )
    save_pretrained(verispec_llama, tmp_path / "llama")
    assert type(load_model(tmp_path / "llama")) is LlamaForCausalLM

    qwen2 = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    qwen2.save_pretrained(tmp_path / "qwen2")
    loaded = load_model(tmp_path / "qwen2")
    assert type(loaded) is LlamaForCausalLM
    with torch.no_grad():
        assert (loaded(ids) - qwen2(ids).logits).abs().max() < 1e-4

    gpt2 = hf_model("gpt2", 0)
    gpt2.save_pretrained(tmp_path / "gpt2")
    loaded = load_model(tmp_path / "gpt2")
    assert type(loaded) is HFCausalLM
    with torch.no_grad():
        assert (loaded(ids, loaded.new_cache(2, 16)) - gpt2(ids).logits).abs().max() < 1e-5


def test_load_model_errors_are_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "missing")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSONDecodeError"):
        load_model(tmp_path / "garbled")
    hf_model("gpt2", 0).config.save_pretrained(tmp_path / "no-weights")
    with pytest.raises(CheckpointError, match="transformers cannot load it") as error:
        load_model(tmp_path / "no-weights")
    assert "\n" not in str(error.value)
    mistral = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=8,
    )
    transformers.MistralForCausalLM(mistral).save_pretrained(
        tmp_path / "sliding"
    )  # verispec's model refuses it, so does the adapter
    with pytest.raises(CheckpointError, match="cannot be rolled back"):
        load_model(tmp_path / "sliding")


def test_cli_generates_with_a_gpt2_target_and_a_draft_of_another_tokenizer(tmp_path, capsys):
    _, toy_draft = make_toy_pair(tmp_path / "toy")  # verispec Llama models, byte-level tokenizer (257 tokens)
    tokenizer = byte_level_tokenizer()
    gpt2_dir = tmp_path / "gpt2"
    hf_model("gpt2", 0, vocab_size=tokenizer.get_vocab_size()).save_pretrained(gpt2_dir)
    tokenizer.save(str(gpt2_dir / "tokenizer.json"))
    common = ["generate", "def f(x):", "--target", str(gpt2_dir), "--max-new-tokens", "10"]
    assert main(common + ["--draft", str(toy_draft), "--k", "3"]) == 0  # GPT-2 target, verispec Llama draft
    spec = capsys.readouterr().out.splitlines()
    assert main(common + ["--draft", str(toy_draft), "--no-speculation"]) == 0  # (--k with it is refused)
    plain = capsys.readouterr().out.splitlines()
    assert spec[:-1] == plain[:-1] and "alpha_hat" in spec[-1]

    vocab = json.loads((gpt2_dir / "tokenizer.json").read_text())
    swapped = vocab["model"]["vocab"]
    swapped["a"], swapped["b"] = swapped["b"], swapped["a"]
    (toy_draft / "tokenizer.json").write_text(json.dumps(vocab))  # the draft's ids of 'a' and 'b' swapped
    assert main(common + ["--draft", str(toy_draft), "--k", "3"]) == 0  # another tokenizer: token-level intersection
    out, err = capsys.readouterr()
    assert "token-level intersection: " in err and out.splitlines()[:-1] == plain[:-1]
