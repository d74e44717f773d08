"""Every architecture users run, on tiny GGUF files written here (tests/gguf_archs.py): exact, or refused.

Llama with `add_bos_token` (Llama 3 / Mistral-style), Qwen2 (q/k/v biases), Qwen3 (q/k norms),
Gemma 3 (sliding-window layers, a window of 8 positions, far shorter than these contexts, so every
rollback happens after the window moved) and Phi-3 (fused qkv and gate-up): greedy speculative output
equals plain output at k = 1, 2, 4 and auto with prompt lookup, suffix drafting and a draft model, and a
seeded sampled row equals plain sampling's (prompt lookup's coupled rule; invariant mode with a draft
model). A recurrent model (Mamba), whose state cannot forget rejected positions, decodes plainly with
one line saying why, and the engine refuses to speculate on it. Negative control: on Gemma 3, a
rollback that also loses a cell the sliding window still reads (what a pruned window cache does to
a rollback; verispec's contexts keep llama.cpp's full-size window cache, `swa_full`) makes speculative
output differ from plain output, so the comparison can fail.
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

sys.path.insert(0, str(Path(__file__).parent))

import gguf_archs  # noqa: E402
from test_prompt_tokens import _directory  # noqa: E402

from verispec.assemble import Settings, load_drafter  # noqa: E402
from verispec.config import SamplingParams  # noqa: E402
from verispec.drafters.model import ModelDrafter  # noqa: E402
from verispec.drafters.ngram import PromptLookupDrafter  # noqa: E402
from verispec.drafters.suffix import SuffixDrafter  # noqa: E402
from verispec.engine import generate_all  # noqa: E402
from verispec.llamacpp import LlamaCppModel, unavailable  # noqa: E402
from verispec.llamacpp.context import LlamaCppCache  # noqa: E402
from verispec.llamacpp.lib import library  # noqa: E402
from verispec.policy import AdaptiveLength  # noqa: E402

if unavailable():
    pytest.skip(f"llama.cpp cannot run here: {unavailable()}", allow_module_level=True)

ATTENTION = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
BOS = 257
TEXTS = [b"the cat sat on the mat, the cat sat on the mat, and the cat sat on the", b"def f(x):\n    return f(x)\n"]
PROMPTS = [[BOS, *text] for text in TEXTS]  # ids under 256 (bytes, in the byte-level vocabulary's order)
LENGTHS = (1, 2, 4, "auto")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    source = _directory(root / "dir", bos=True)
    from verispec.models.gguf_convert import convert

    vocabulary = convert(source, root / "vocabulary.gguf")
    made = {arch: gguf_archs.write(arch, root / f"{arch}.gguf", vocabulary) for arch in (*ATTENTION, "mamba")}
    made["draft"] = gguf_archs.write("llama", root / "draft.gguf", vocabulary, seed=5)
    return made


@pytest.fixture(scope="module")
def draft_model(files):
    model = LlamaCppModel(files["draft"])
    model.shape_invariant = False  # a draft's logits need not be invariant
    return model


def _drafters(draft_model):
    return {
        "prompt lookup": PromptLookupDrafter,
        "suffix": SuffixDrafter,
        "draft model": lambda: ModelDrafter(draft_model),
    }


def _k(k):
    return AdaptiveLength(k_max=4) if k == "auto" else k


@pytest.mark.parametrize("arch", ATTENTION)
def test_greedy_speculative_output_equals_plain_output(files, draft_model, arch):
    target = LlamaCppModel(files[arch])
    greedy = SamplingParams(temperature=0, max_new_tokens=48)
    plain = generate_all(target, PROMPTS, greedy)
    assert all(len(row) == 48 for row in plain)
    for name, make in _drafters(draft_model).items():
        for k in LENGTHS:
            assert generate_all(target, PROMPTS, greedy, make(), _k(k)) == plain, (arch, name, k)


@pytest.mark.parametrize("arch", ATTENTION)
def test_a_seeded_sampled_row_equals_plain_sampling(files, draft_model, arch):
    target = LlamaCppModel(files[arch])
    coupled = SamplingParams(temperature=1.0, max_new_tokens=32, seed=11)  # prompt lookup: the coupled rule
    plain = generate_all(target, PROMPTS[:1], coupled)
    assert generate_all(target, PROMPTS[:1], coupled, PromptLookupDrafter(), 4) == plain
    invariant = SamplingParams(temperature=1.0, max_new_tokens=32, seed=11, sampling="invariant")
    plain = generate_all(target, PROMPTS[:1], invariant)
    assert generate_all(target, PROMPTS[:1], invariant, ModelDrafter(draft_model), 3) == plain


def test_the_sliding_window_file_slides_and_its_bos_is_the_files(files):
    target = LlamaCppModel(files["gemma3"])
    assert len(PROMPTS[0]) + 48 > 4 * gguf_archs.WINDOW  # the window moves many times in every run
    from verispec.llamacpp import GGUFTokenizer

    tokenizer = GGUFTokenizer(LlamaCppModel(files["llama"]))
    assert tokenizer.encode("the").ids == [BOS, *tokenizer.encode("the", add_special_tokens=False).ids]
    assert target.rolls_back and target.memory_kind == ""


def test_negative_control_a_rollback_that_keeps_rejected_cells_is_caught(files, monkeypatch):
    target = LlamaCppModel(files["gemma3"])
    greedy = SamplingParams(temperature=0, max_new_tokens=48)
    plain = generate_all(target, PROMPTS, greedy)
    monkeypatch.setattr(LlamaCppModel, "compiled_step", lambda *args: None)  # the Python step's rollback
    assert generate_all(target, PROMPTS, greedy, PromptLookupDrafter(), 4) == plain  # the right rollback
    rollback, forgotten = LlamaCppCache.rollback, []

    def forgetful(cache, lengths):  # rolls back, and loses a cell the window still reads (as a pruned SWA cache)
        rows = [(seq, new) for seq, old, new in zip(cache.seqs, cache.host_lengths, lengths) if new < old]
        rollback(cache, lengths)
        for seq, new in rows:
            forgotten.append(library().llama_memory_seq_rm(cache.context.memory, seq, new - 3, new - 2))

    monkeypatch.setattr(LlamaCppCache, "rollback", forgetful)
    assert generate_all(target, PROMPTS, greedy, PromptLookupDrafter(), 4) != plain and any(forgotten)


def test_a_recurrent_model_decodes_plainly_and_says_why(files, capsys):
    target = LlamaCppModel(files["mamba"])
    assert not target.rolls_back and target.memory_kind == "recurrent" and not target.shape_invariant
    said = []
    assert load_drafter(Settings(target=str(files["mamba"]), draft="ngram"), target, said.append) is None
    assert said == [f"{files['mamba']}: a recurrent model cannot forget rejected positions: plain decoding"]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    assert len(generate_all(target, PROMPTS[:1], greedy)[0]) == 16  # plain decoding runs
    with pytest.raises(ValueError, match="recurrent model cannot forget rejected positions"):
        generate_all(target, PROMPTS[:1], greedy, ModelDrafter(target), 2)  # never a wrong token
    with pytest.raises(ValueError, match="cannot forget rejected positions: no draft"):
        load_drafter(Settings(target=str(files["llama"]), draft=str(files["mamba"])), LlamaCppModel(files["llama"]))
