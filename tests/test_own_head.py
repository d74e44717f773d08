"""llamacpp/head.py: verispec's own output head, one kernel at every width.

The tiny toy target quantized to Q4_1 by llama.cpp's default recipe has SmolLM2-135M Q4_1's shape:
a Q4_1 body (vec_dot at every width) and a tied Q8_0 head (llamafile's sgemm from 2 columns on).
A second file has a Q4_1 body and an untied F16 head over a vocabulary of 320 (sgemm takes a head
whose rows are a multiple of 4; on some CPUs its Q8_0 product rounds as vec_dot does, its F16 one
does not). With the own head their logits must not depend on the pass although no placeholder is
added, and greedy speculative output must equal plain output on the compiled step. Negative
control: the F16-head file with llama.cpp's head and no placeholder gives other logits in other
pass shapes.
"""

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

import torch  # noqa: E402

from verispec import SamplingParams, generate_all  # noqa: E402
from verispec.drafters.ngram import PromptLookupDrafter  # noqa: E402
from verispec.llamacpp import LlamaCppModel, unavailable  # noqa: E402
from verispec.llamacpp.deviation import pass_shape_deviation  # noqa: E402
from verispec.llamacpp.head import head_tensor, own_head  # noqa: E402
from verispec.llamacpp.quantize import quantize  # noqa: E402
from verispec.models.gguf_convert import convert  # noqa: E402
from verispec.models.toy import make_toy_pair  # noqa: E402

if unavailable():
    pytest.skip(f"llama.cpp cannot run here: {unavailable()}", allow_module_level=True)

PROMPTS = [
    [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 32, 72, 101, 108, 108, 111, 32],
    [40, 41, 40, 41, 40, 41, 40, 41, 40],
    [100, 101, 102, 32, 102, 40, 120, 41, 58, 10, 32, 32, 114, 101, 116, 117, 114, 110],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gguf_convert import tiny_dir

    from verispec.models.toy import byte_level_tokenizer

    root = tmp_path_factory.mktemp("head")
    target, _ = make_toy_pair(root)
    f32 = convert(target, root / "target-f32.gguf")
    untied = tiny_dir(root / "untied", byte_level_tokenizer(), vocab_size=320, hidden_size=128, eos_token_id=256)
    f16_head = quantize(convert(untied, root / "untied.gguf"), root / "untied-q4_1.gguf", "q4_1", head_type=1)
    return {"f32": f32, "q4_1": quantize(f32, root / "target-q4_1.gguf", "q4_1"), "f16_head": f16_head}


def test_a_q4_1_body_with_a_q8_0_head_takes_the_own_head(files):
    name, type_, _, _, n_vocab = head_tensor(files["q4_1"])
    assert name == "token_embd.weight" and type_ == 8 and n_vocab == 257  # tied, GGML_TYPE_Q8_0
    model = LlamaCppModel(files["q4_1"])
    assert model.own_head and not model.sgemm_weights  # no matrix llama.cpp computes takes sgemm
    assert model.flash_attention  # so: flash attention, no placeholder in one-position passes
    assert not LlamaCppModel(files["f32"]).own_head  # the body takes sgemm too: the head changes nothing


@pytest.mark.parametrize("name", ["q4_1", "f16_head"])
def test_llama_cpp_s_one_position_logits_are_the_own_head_s_bit_for_bit(files, name):
    assert own_head(LlamaCppModel(files[name]))  # the check itself: array_equal on three one-token passes


@pytest.mark.parametrize("name", ["q4_1", "f16_head"])
def test_logits_do_not_depend_on_the_pass(files, name):
    model = LlamaCppModel(files[name])
    assert model.own_head and not model.sgemm_weights
    assert pass_shape_deviation(model, PROMPTS).largest == 0.0
    one = model(torch.tensor([PROMPTS[0][:9]]))[0]  # [9, V]
    rows = model(torch.tensor([PROMPTS[0][:9], PROMPTS[1][:9], PROMPTS[2][:9]]))  # [3, 9, V]
    assert torch.equal(rows[0], one)


def test_without_it_and_without_placeholders_the_head_makes_logits_depend_on_the_pass(files, monkeypatch):
    """The negative control: llama.cpp's Q8_0 head, and one-position passes left without their placeholder."""
    monkeypatch.setenv("VERISPEC_OWN_HEAD", "0")
    model = LlamaCppModel(files["f16_head"])
    assert not model.own_head and model.sgemm_weights
    model.sgemm_weights = False  # the cached property set by hand: no placeholder after a one-position pass
    assert pass_shape_deviation(model, PROMPTS).largest > 0.0


@pytest.mark.parametrize("name,k", [("q4_1", 1), ("q4_1", 2), ("q4_1", 4), ("f16_head", 4)])
def test_greedy_speculative_equals_plain(files, name, k):
    model = LlamaCppModel(files[name])
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = generate_all(model, PROMPTS, params, drafter=None, k=0)
    assert generate_all(model, PROMPTS, params, drafter=PromptLookupDrafter(), k=k) == plain
    for prompt, row in zip(PROMPTS, plain):  # batch 1 too: one-position passes of one sequence
        assert generate_all(model, [prompt], params, drafter=PromptLookupDrafter(), k=k) == [row]
