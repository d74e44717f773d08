"""Weight-only quantization of a Llama-family model's linear layers.

Owns the formats and `QuantLinear`:
- int8, one float32 scale per output channel (symmetric, round-to-nearest);
- int4, one float32 scale per group of `group_size` weights along the input (32, 64 or 128;
  symmetric, round-to-nearest), packed two to a byte: within every 16 weights, byte j holds
  weight j in its low nibble and weight j+8 in its high nibble, each stored as q + 8.
The forward pass reads the packed weights (csrc/skinny_linear.cpp dequantises them in
registers for 1..16 rows), so a decoding pass moves 4x (int8) or about 7x (int4) fewer weight
bytes than float32. The decoder layers take the chosen format; the output head is int8 by
default (the largest single matrix of a small-vocabulary model's pass); the embedding table
stays float (one row per token). Other shapes dequantise on the fly (correct, not fast). A quantized model
saves and loads as a directory: config.json with a `quantization_config`, safetensors with
`qweight` and `scale` tensors. Knows nothing of speculation: a quantized model is simply a
model, usable as a target or as a draft.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import int4_linear, int8_linear

GROUP_SIZES = (32, 64, 128)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], scale [N]); w ~ q * scale."""
    scale = (weight.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [N, K/2], scale [N, K/group]); w ~ q * scale, q in -7..7."""
    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // group, group)
    scale = (groups.abs().amax(dim=2) / 7).clamp_min(1e-12)  # [N, K/group]
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).view(rows, cols).to(torch.int16)
    return pack_int4(q), scale


@torch.no_grad()
def gptq_int4(
    weight: torch.Tensor, inputs: torch.Tensor, group: int, damping: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 with GPTQ's error compensation (Frantar et al. 2023), same format as quantize_int4.

    Columns are quantized in order; each column's rounding error, weighted by the inverse
    Hessian H = X^T X of the calibration inputs X [n, K], is pushed onto the columns not yet
    quantized, so that the layer's output on inputs like X moves as little as possible. A
    group's scale is fixed from the (updated) weights when the group is reached.
    """
    w = weight.detach().float().clone()  # [N, K]
    rows, cols = w.shape
    x = inputs.reshape(-1, cols).float()
    hessian = x.T @ x / len(x)  # [K, K]
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1.0
    w[:, dead] = 0.0
    hessian += damping * hessian.diagonal().mean() * torch.eye(cols)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)  # [K, K]
    q = torch.zeros(rows, cols, dtype=torch.int16)
    scale = torch.zeros(rows, cols // group)
    for i in range(cols):
        if i % group == 0:
            scale[:, i // group] = (w[:, i : i + group].abs().amax(dim=1) / 7).clamp_min(1e-12)
        s = scale[:, i // group]
        q[:, i] = torch.round(w[:, i] / s).clamp(-8, 7).to(torch.int16)
        error = (w[:, i] - q[:, i] * s) / hinv[i, i]  # [N]
        w[:, i + 1 :] -= error[:, None] * hinv[i, i + 1 :][None, :]
    return pack_int4(q), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in -8..7 -> uint8 [N, K/2] in the kernel's layout."""
    rows, cols = q.shape
    blocks = (q + 8).view(rows, cols // 16, 2, 8)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).to(torch.uint8).view(rows, cols // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> q [N, K] in -8..7 (int16)."""
    rows = packed.shape[0]
    blocks = packed.view(rows, -1, 8).to(torch.int16)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).view(rows, -1) - 8


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    q = unpack_int4(packed).float()
    return (q.view(q.shape[0], -1, group) * scale[..., None]).view(q.shape)


class QuantLinear(nn.Module):
    """A linear layer with int8 or group-wise int4 weights (inference only)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int = 64, bias: bool = False):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if bits == 4 and (group_size not in GROUP_SIZES or in_features % group_size):
            raise ValueError(
                f"group_size must be one of {GROUP_SIZES} and divide in_features ({in_features}), got {group_size!r}"
            )
        if in_features % 16:
            raise ValueError(f"in_features must be a multiple of 16 to quantize, got {in_features}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        if bits == 8:
            self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scale", torch.ones(out_features))
        else:
            self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scale", torch.ones(out_features, in_features // group_size))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, bits: int, group_size: int = 64) -> QuantLinear:
        quant = cls(layer.in_features, layer.out_features, bits, group_size, bias=layer.bias is not None)
        with torch.no_grad():
            qweight, scale = quantize_int8(layer.weight) if bits == 8 else quantize_int4(layer.weight, group_size)
            quant.qweight.copy_(qweight)
            quant.scale.copy_(scale)
            if layer.bias is not None:
                quant.bias.copy_(layer.bias.float())
        return quant.to(layer.weight.device)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] these codes stand for."""
        if self.bits == 8:
            return self.qweight.float() * self.scale[:, None]
        return dequantize_int4(self.qweight, self.scale, self.group_size)

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return int8_linear(x, self.qweight, self.scale, self.bias)
        return int4_linear(x, self.qweight, self.scale, self.group_size, dequantize_int4, self.bias)


QUANTIZED_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_model(
    model: nn.Module,
    bits: int,
    group_size: int = 64,
    calibration: torch.Tensor | None = None,
    head_bits: int | None = 8,
) -> nn.Module:
    """Replace the decoder layers' projections by QuantLinear, in place; with head_bits = 8 the
    output head too (int8 per channel, round-to-nearest: a tied head gets its own codes and the
    embedding table stays float, as it is read one row per token). None leaves the head float.

    Round-to-nearest by default; with `calibration` token ids [n, T] and bits = 4, GPTQ: each
    projection's inputs are recorded on the calibration text (float model, one pass) and its
    rounding errors compensated. The model must be float32 (activations stay float32). The
    format is recorded in `model.quantization` so that checkpoint I/O can save and rebuild it.
    """
    if model.dtype != torch.float32:
        raise ValueError(f"quantize a float32 model, got {model.dtype}")
    if calibration is not None and bits != 4:
        raise ValueError("calibration (GPTQ) is for bits = 4")
    if head_bits not in (None, 8):
        raise ValueError(f"head_bits must be 8 or None, got {head_bits!r}")
    targets = [
        (getattr(layer, path.split(".")[0]), path.split(".")[1])
        for layer in model.model.layers
        for path in QUANTIZED_LAYERS
    ]
    inputs = (
        _record_inputs(model, [getattr(parent, name) for parent, name in targets], calibration)
        if calibration is not None
        else None
    )
    for index, (parent, name) in enumerate(targets):
        layer = getattr(parent, name)
        if inputs is None:
            setattr(parent, name, QuantLinear.from_linear(layer, bits, group_size))
        else:
            quant = QuantLinear(layer.in_features, layer.out_features, 4, group_size, bias=layer.bias is not None)
            quant.qweight, quant.scale = gptq_int4(layer.weight, inputs[index], group_size)
            if layer.bias is not None:
                quant.bias = layer.bias.detach().float().clone()
            setattr(parent, name, quant)
    if head_bits is not None:
        model.lm_head = QuantLinear.from_linear(model.lm_head, head_bits)
    model.quantization = {
        "bits": bits,
        "group_size": group_size,
        "method": "rtn" if calibration is None else "gptq",
        "head_bits": head_bits,
    }
    return model


@torch.no_grad()
def _record_inputs(model: nn.Module, layers: list[nn.Module], calibration: torch.Tensor) -> list[torch.Tensor]:
    """The inputs [n*T, K] each of `layers` sees while the model reads the calibration text."""
    recorded: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.register_forward_pre_hook(lambda _, args, i=i: recorded[i].append(args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(layers)
    ]
    try:
        for batch in calibration.split(8):
            model(batch)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(chunks) for chunks in recorded]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a full forward pass reads: every matrix but the embedding tables (one
    row per token), each tensor once (a head tied to the embedding counts), quantized ones
    packed. Works for transformers models too (GPT-2's Conv1D matrices count). A model that is
    not a torch module (a GGUF on llama.cpp) reports its own size (its whole file of tensors)."""
    if not isinstance(model, nn.Module):
        return model.config.size_bytes
    total, seen = 0, set()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_bytes
            continue
        for parameter in module.parameters(recurse=False):
            if parameter.dim() < 2 or parameter.data_ptr() in seen:
                continue
            if id(parameter) in embeddings and isinstance(module, nn.Embedding):
                continue
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    return total
