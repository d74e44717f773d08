"""llamacpp/head.py and kernels.c: verispec's own output head, and the types whose product needs neither it
nor a placeholder on this CPU.

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
from verispec.llamacpp.compiled import load  # noqa: E402
from verispec.llamacpp.deviation import pass_shape_deviation  # noqa: E402
from verispec.llamacpp.head import SGEMM_TYPES, head_tensor, one_kernel_types, own_head  # noqa: E402
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


@pytest.fixture
def no_probe(monkeypatch):
    """Every type sgemm takes counts as width-dependent (as on a CPU where Q8_0's kernels differ)."""
    monkeypatch.setenv("VERISPEC_KERNEL_PROBE", "0")
    one_kernel_types.cache_clear()
    yield
    monkeypatch.delenv("VERISPEC_KERNEL_PROBE")
    one_kernel_types.cache_clear()


def test_the_probe_sees_f32_and_f16_differ_and_keeps_to_sgemm_s_types():
    """F32 and F16 products round differently from 2 columns on (the negative control: the probe can see it);
    what agrees is a subset of sgemm's types; a dot-product type (Q4_1) agrees whatever the width."""
    compiled = load()
    assert compiled.verispec_one_kernel(0, 576, 256, 5, 2) == 0  # GGML_TYPE_F32
    assert compiled.verispec_one_kernel(1, 128, 320, 3, 2) == 0  # GGML_TYPE_F16
    assert compiled.verispec_one_kernel(3, 576, 256, 5, 2) == 1  # GGML_TYPE_Q4_1: vec_dot at every width
    assert one_kernel_types() <= SGEMM_TYPES - {"F32", "F16"}


def test_a_q4_1_body_with_a_q8_0_head_takes_the_own_head_where_q8_0_depends_on_the_width(files, no_probe):
    name, type_, _, _, n_vocab = head_tensor(files["q4_1"])
    assert name == "token_embd.weight" and type_ == 8 and n_vocab == 257  # tied, GGML_TYPE_Q8_0
    model = LlamaCppModel(files["q4_1"])
    assert model.own_head and not model.sgemm_weights  # no matrix llama.cpp computes takes sgemm
    assert model.flash_attention  # so: flash attention, no placeholder in one-position passes
    assert not LlamaCppModel(files["f32"]).own_head  # the body takes sgemm too: the head changes nothing


def test_where_q8_0_s_kernels_agree_the_file_needs_neither(files):
    model = LlamaCppModel(files["q4_1"])
    agrees = "Q8_0" in one_kernel_types()
    assert model.own_head is not agrees and not model.sgemm_weights
    assert pass_shape_deviation(model, PROMPTS).largest == 0.0


@pytest.mark.parametrize("name", ["q4_1", "f16_head"])
def test_llama_cpp_s_one_position_logits_are_the_own_head_s_bit_for_bit(files, name, no_probe):
    assert own_head(LlamaCppModel(files[name]))  # the check itself: array_equal on three one-token passes


@pytest.mark.parametrize("name", ["q4_1", "f16_head"])
def test_logits_do_not_depend_on_the_pass(files, name, no_probe):
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
def test_greedy_speculative_equals_plain(files, name, k, no_probe):
    model = LlamaCppModel(files[name])
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = generate_all(model, PROMPTS, params, drafter=None, k=0)
    assert generate_all(model, PROMPTS, params, drafter=PromptLookupDrafter(), k=k) == plain
    for prompt, row in zip(PROMPTS, plain):  # batch 1 too: one-position passes of one sequence
        assert generate_all(model, [prompt], params, drafter=PromptLookupDrafter(), k=k) == [row]
