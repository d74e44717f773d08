"""The commands that write models: `convert` (GGUF), `quantize` (verispec's int8/int4) and `toy`
(a tiny random pair). Each checks its output first, calls verispec.models and says what it
wrote. Knows nothing of decoding.
"""

from __future__ import annotations

import argparse

from ..models.backend import GGUF_TYPES, is_gguf
from .common import check_directory, check_writable, fail


def add_parsers(commands) -> None:
    quant = commands.add_parser("quantize", help="weight-only int8 (per channel) or int4 (group-wise) copy of a model")
    quant.add_argument("--model", required=True, help="float model directory")
    quant.add_argument("--out", required=True, help="directory to write")
    quant.add_argument(
        "--bits", type=int, default=8, choices=[4, 8], help="8 (default, per output channel) or 4 (group-wise)"
    )
    quant.add_argument("--group-size", type=int, default=64, help="with --bits 4: 32, 64 or 128")
    quant.add_argument(
        "--calibration", help="with --bits 4: a data directory of 'verispec train data' (GPTQ on its training split)"
    )
    quant.add_argument(
        "--float-head", action="store_true", help="keep the output head in float (default: int8 per channel)"
    )
    quant.add_argument(
        "--calibration-windows", type=int, default=32, help="256-token windows of calibration text (default 32)"
    )

    conv = commands.add_parser(
        "convert", help="write a Hugging Face model directory as one GGUF file, or a GGUF file in another type"
    )
    conv.add_argument(
        "--model",
        required=True,
        help="float model directory (Llama, Mistral or Qwen2; a quantized directory "
        "is refused), or a .gguf file to quantize",
    )
    conv.add_argument("--out", required=True, help="the .gguf file to write (written whole, then renamed into place)")
    conv.add_argument(
        "--type",
        default="f32",
        type=str.lower,
        choices=GGUF_TYPES,
        metavar="TYPE",
        help="f32 (default), f16, bf16, q8_0, q4_0 (from a directory: written by verispec's converter, matrices "
        "whose rows are not whole 32-value blocks stay f16), or any type of llama-quantize: q4_1, q5_0, "
        "q5_1, q2_k, q3_k_s/m/l, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, iq4_nl, iq4_xs (llama.cpp's own "
        "quantizer, llama_model_quantize; a .gguf input always goes through it); any case",
    )

    toy = commands.add_parser("toy", help="write a tiny random target/draft pair (for smoke tests)")
    toy.add_argument("out", help="directory to create; holds target/ and draft/")
    toy.add_argument("--weights-seed", type=int, default=0, help="random seed of the weights (default 0)")
    toy.add_argument(
        "--sizes",
        default="tiny",
        choices=["tiny", "presets"],
        help="presets: the built-in pair's architectures (random weights)",
    )


def quantize(args: argparse.Namespace) -> int:
    import torch

    from ..models.checkpoint import load_pretrained, save_pretrained
    from ..models.quantize import GROUP_SIZES, quantize_model, weight_bytes

    if args.bits == 4 and args.group_size not in GROUP_SIZES:
        return fail(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {args.group_size}")
    check_directory(args.out, "--out")
    model = load_pretrained(args.model)
    before = weight_bytes(model)
    calibration = None
    if args.calibration:
        from ..training.data import load_tokens

        tokens = load_tokens(args.calibration, "train")
        starts = torch.randint(
            0, len(tokens) - 257, (args.calibration_windows,), generator=torch.Generator().manual_seed(0)
        )
        calibration = torch.stack([tokens[s : s + 256] for s in starts.tolist()])
    quantize_model(model, args.bits, args.group_size, calibration, head_bits=None if args.float_head else 8)
    save_pretrained(model, args.out, max_shard_bytes=50_000_000, tokenizer_from=args.model)
    print(
        f"wrote {args.out}: int{args.bits} ({model.quantization['method']}) weights, {before / 1e6:.1f} MB -> "
        f"{weight_bytes(model) / 1e6:.1f} MB read per pass"
    )
    return 0


def convert(args: argparse.Namespace) -> int:
    import time

    from ..models.gguf_convert import convert as convert_directory

    check_writable(args.out, "--out")
    start = time.perf_counter()
    try:
        if is_gguf(args.model):
            from ..llamacpp.quantize import quantize as quantize_gguf

            path = quantize_gguf(args.model, args.out, args.type)
        else:
            path = convert_directory(args.model, args.out, args.type)
    except ImportError as error:
        return fail(f"verispec convert needs the gguf package (pip install 'verispec[llamacpp]'): {error}")
    print(f"wrote {path}: {args.type}, {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s")
    return 0


def toy(args: argparse.Namespace) -> int:
    from ..models.toy import make_toy_pair

    check_directory(args.out, "OUT")
    target, draft = make_toy_pair(args.out, seed=args.weights_seed, sizes=args.sizes)
    print(f"wrote {target} and {draft} (random weights)")
    return 0
