"""Weight-only quantization: formats, kernels against dequantised references, I/O, exactness as a draft."""

import pytest
import torch
import torch.nn.functional as F

from verispec.cli import main
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.checkpoint import load_pretrained, save_pretrained
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.models.quantize import (
    QuantLinear,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    unpack_int4,
    weight_bytes,
)
from verispec.stats import SpecStats


def test_int4_packing_round_trips_every_code():
    q = torch.arange(-8, 8, dtype=torch.int16).repeat(3, 4)  # [3, 64]
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(q).shape == (3, 32) and pack_int4(q).dtype == torch.uint8


def test_round_to_nearest_error_is_at_most_half_a_step():
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(0))
    q8, s8 = quantize_int8(w)
    assert (q8.float() * s8[:, None] - w).abs().le(s8[:, None] / 2 + 1e-6).all()
    packed, s4 = quantize_int4(w, 32)
    step = s4.repeat_interleave(32, dim=1)
    assert (dequantize_int4(packed, s4, 32) - w).abs().le(step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 16, 17])
def test_kernels_match_the_dequantised_weight(bits, group, rows):
    layer = torch.nn.Linear(256, 48, bias=True)
    quant = QuantLinear.from_linear(layer, bits, group)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        assert torch.allclose(quant(x), F.linear(x, quant.dequantized(), quant.bias), atol=1e-4)


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="bits"):
        QuantLinear(64, 8, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear(64, 8, bits=4, group_size=48)


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(
        vocab_size=120,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    return init_weights(LlamaForCausalLM(config), std=0.1, seed=3).eval()


@pytest.mark.parametrize(
    "bits, ratio, error", [(8, 0.27, 0.05), (4, 0.16, 0.5)]
)  # int4, group 32: (0.5 + 4/32) / 4 bytes
def test_quantized_model_reads_fewer_bytes_and_stays_close(model, bits, ratio, error, tmp_path):
    save_pretrained(model, tmp_path / "float")
    quant = quantize_model(load_pretrained(tmp_path / "float"), bits, 32)

    def layer_bytes(m):
        return weight_bytes(m) - model.lm_head.weight.numel() * 4  # the head stays float

    assert layer_bytes(quant) <= ratio * layer_bytes(model)
    ids = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, approx = model(ids), quant(ids)
    relative_rms = ((approx - full).pow(2).mean() / full.pow(2).mean()).sqrt()
    assert relative_rms < error  # random weights, the worst case for round-to-nearest
    save_pretrained(quant, tmp_path / "q")
    again = load_pretrained(tmp_path / "q")
    assert again.quantization == quant.quantization
    with torch.no_grad():
        assert torch.equal(again(ids), approx)


@pytest.mark.parametrize("tied", [True, False])
def test_the_output_head_is_int8_and_a_tied_embedding_stays_float(model, tied, tmp_path):
    import copy

    float_model = (
        init_weights(LlamaForCausalLM(model.config.replace(tie_word_embeddings=True)), std=0.1, seed=3).eval()
        if tied
        else model
    )
    quant = quantize_model(copy.deepcopy(float_model), 8)
    kept = quantize_model(copy.deepcopy(float_model), 8, head_bits=None)
    assert (
        isinstance(quant.lm_head, QuantLinear) and quant.lm_head.bits == 8 and isinstance(kept.lm_head, torch.nn.Linear)
    )
    assert torch.equal(quant.model.embed_tokens.weight, float_model.model.embed_tokens.weight)  # float rows
    head = float_model.lm_head.weight.numel()
    assert weight_bytes(kept) - weight_bytes(quant) == head * 4 - (
        head + float_model.vocab_size * 4
    )  # float32 -> int8 + scales
    save_pretrained(quant, tmp_path / "q")
    again = load_pretrained(tmp_path / "q")
    assert again.quantization["head_bits"] == 8 and isinstance(again.lm_head, QuantLinear)
    ids = torch.randint(0, 120, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids), quant(ids))
        assert ((quant(ids) - float_model(ids)).pow(2).mean() / float_model(ids).pow(2).mean()).sqrt() < 0.05
    with pytest.raises(ValueError, match="head_bits"):
        quantize_model(copy.deepcopy(float_model), 8, head_bits=4)


def test_quantized_target_as_draft_is_exact_and_accepted(model):
    """The quantized copy drafts for its float original: greedy output unchanged, acceptance high."""
    import copy

    draft = quantize_model(copy.deepcopy(model), 8)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    stats = SpecStats()
    assert generate_all(model, prompts, params, ModelDrafter(draft), k=4, stats=stats) == generate_all(
        model, prompts, params
    )
    assert stats.beta >= 0.9


def test_quantize_command(model, tmp_path, capsys):
    save_pretrained(model, tmp_path / "float")
    assert (
        main(
            [
                "quantize",
                "--model",
                str(tmp_path / "float"),
                "--out",
                str(tmp_path / "q4"),
                "--bits",
                "4",
                "--group-size",
                "32",
            ]
        )
        == 0
    )
    assert "int4" in capsys.readouterr().out
    assert load_pretrained(tmp_path / "q4").quantization["bits"] == 4
    assert (
        main(
            [
                "quantize",
                "--model",
                str(tmp_path / "float"),
                "--out",
                str(tmp_path / "x"),
                "--bits",
                "4",
                "--group-size",
                "48",
            ]
        )
        == 2
    )
    assert "--group-size" in capsys.readouterr().err


def test_gptq_beats_round_to_nearest_on_inputs_like_its_calibration():
    """On correlated inputs, compensating each column's rounding error lowers the output error."""
    from verispec.models.quantize import gptq_int4

    generator = torch.Generator().manual_seed(0)
    mixing = torch.randn(128, 128, generator=generator) * 0.3 + torch.eye(128)
    calibration = torch.randn(2048, 128, generator=generator) @ mixing  # correlated features
    held_out = torch.randn(512, 128, generator=generator) @ mixing
    weight = torch.randn(64, 128, generator=generator)
    reference = held_out @ weight.T
    errors = {}
    for name, (packed, scale) in {"rtn": quantize_int4(weight, 32), "gptq": gptq_int4(weight, calibration, 32)}.items():
        errors[name] = (held_out @ dequantize_int4(packed, scale, 32).T - reference).pow(2).mean().item()
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


def test_gptq_model_quantization_records_its_method(model):
    import copy

    calibration = torch.randint(0, 120, (4, 32), generator=torch.Generator().manual_seed(2))
    quant = quantize_model(copy.deepcopy(model), 4, 32, calibration=calibration)
    assert quant.quantization["method"] == "gptq"
    with torch.no_grad():
        assert torch.isfinite(quant(calibration[:1])).all()
    with pytest.raises(ValueError, match="bits = 4"):
        quantize_model(copy.deepcopy(model), 8, calibration=calibration)
