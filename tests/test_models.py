"""The Llama-family model and its Hugging Face I/O: parity with transformers, round trips, errors."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from verispec.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights

ARCHS = {
    # name: (config class, model class, extra config)
    "llama-gqa-untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0),
    ),
    "llama-mha-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    ),
    "qwen2-bias-tied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None),
    ),
}


def _hf_model(name, seed=0):
    config_cls, model_cls, extra = ARCHS[name]
    config = getattr(transformers, config_cls)(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases too, so that a dropped bias would show
        for name_, param in model.named_parameters():
            if name_.endswith("bias"):
                param.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch, tmp_path):
    hf = _hf_model(arch)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids).logits
        full = model(ids, model.new_cache(3, 64))
        no_cache = model(ids)  # the training path: plain causal attention
        cache = model.new_cache(3, 64)  # the same sequence fed in pieces through the cache
        pieces = [model(ids[:, a:b], cache) for a, b in ((0, 17), (17, 18), (18, 23), (23, 40))]
    assert (full - reference).abs().max().item() <= 1e-4
    assert (no_cache - reference).abs().max().item() <= 1e-4
    assert (torch.cat(pieces, dim=1) - reference).abs().max().item() <= 1e-4


def test_ragged_prefill_matches_per_row(tmp_path):
    """Rows of different lengths in one cache give the logits each row gets alone."""
    hf = _hf_model("llama-gqa-untied")
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10], [3], [11, 12, 13]]
    with torch.no_grad():
        cache = model.new_cache(3, 32)
        model.prefill(prompts, cache)
        assert cache.host_lengths == [6, 1, 3]
        nxt = torch.tensor([[1, 2], [3, 4], [5, 6]])
        batched = model(nxt, cache)
        for row, prompt in enumerate(prompts):
            alone = hf(torch.tensor([prompt + nxt[row].tolist()])).logits[0, -2:]
            assert (batched[row] - alone).abs().max().item() <= 1e-4


def test_save_load_round_trip_and_transformers_reads_ours(tmp_path):
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=1234.0,
    )
    ours = init_weights(LlamaForCausalLM(config), std=0.2, seed=3).eval()
    save_pretrained(ours, tmp_path)
    again = load_pretrained(tmp_path)
    assert again.config == ours.config
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids, ours.new_cache(2, 16))).abs().max().item() <= 1e-4


def test_sharded_save_loads_back(tmp_path):
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        tie_word_embeddings=True,
    )
    ours = init_weights(LlamaForCausalLM(config), seed=4)
    save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(s.stat().st_size <= 20_000 + 4096 for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    again = load_pretrained(tmp_path)
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in ours.state_dict().items())
    assert again.lm_head.weight is again.model.embed_tokens.weight


def test_bfloat16_is_close_to_float32(tmp_path):
    hf = _hf_model("llama-gqa-untied")
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        f32 = load_pretrained(tmp_path)(ids, load_pretrained(tmp_path).new_cache(2, 32))
        bf16_model = load_pretrained(tmp_path, torch.bfloat16)
        bf16 = bf16_model(ids, bf16_model.new_cache(2, 32))
    assert bf16_model.dtype == torch.bfloat16 and bf16.dtype == torch.float32
    assert (bf16 - f32).abs().max().item() < 0.05 * f32.abs().max().item() + 0.05


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "JSONDecodeError"),
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "unreadable weights"),
        (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
        (lambda d: _edit_config(d, hidden_size=48), "shape"),
        (lambda d: _edit_config(d, model_type="gpt2"), "not a Llama-family"),
        (lambda d: _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    ],
)
def test_unreadable_checkpoints_raise_one_clear_error(tmp_path, damage, message):
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
    )
    save_pretrained(init_weights(LlamaForCausalLM(config)), tmp_path)
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=message) as info:
        load_pretrained(tmp_path)
    assert "\n" not in str(info.value)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    if changes.get("hidden_size"):
        config["head_dim"] = changes["hidden_size"] // config["num_attention_heads"]
    path.write_text(json.dumps(config))


def test_cache_rollback_is_a_length_change_not_a_copy():
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = init_weights(LlamaForCausalLM(config)).eval()
    cache = model.new_cache(2, 16)
    keys_storage = cache.keys.data_ptr()
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 6)), cache)
    before = cache.keys.clone()
    cache.rollback([2, 5])
    assert cache.host_lengths == [2, 5] and cache.lengths.tolist() == [2, 5]
    assert cache.keys.data_ptr() == keys_storage and torch.equal(cache.keys, before)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback([3, 5])  # cannot grow
    with pytest.raises(ValueError, match="overflow"):
        with torch.no_grad():
            model(torch.zeros(2, 12, dtype=torch.long), cache)
