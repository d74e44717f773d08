"""A trained draft written out: its GGUF file, its model card, and reading it back.

Owns `write_draft_gguf` (a llama-architecture GGUF with the target's tokenizer copied field by
field, so every vocabulary check sees the same tokens; the subset head written as a full-size
`output.weight` whose rows outside the subset are zero, so llama.cpp's own programs load it too,
with the subset's ids under `verispec.draft.vocab_ids`), `is_subset_draft` / `load_subset_draft`
(verispec runs such a file on PyTorch with the subset head alone: q is 0 outside the subset, and
the head costs N rows instead of V) and `write_card`. Knows nothing of training or decoding.
"""

from __future__ import annotations

import datetime
import os
import platform
import struct
from pathlib import Path

import numpy as np
import torch

from .draft_head import SubsetHeadLlama

VOCAB_IDS_KEY = "verispec.draft.vocab_ids"
TARGET_KEY = "verispec.draft.target"


def write_draft_gguf(draft: SubsetHeadLlama, target_path: str | Path, path: Path) -> Path:
    """Write `draft` to path (atomically); returns path."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    from ..models.gguf_convert import _gguf_name, _permute, _write_metadata
    from ..models.llama import to_hf_state_dict

    config = draft.config
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(partial), "llama")
    _write_metadata(writer, config, "llama", f"verispec draft for {Path(target_path).name}")
    for key, field in GGUFReader(str(target_path)).fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
    writer.add_array(VOCAB_IDS_KEY, [int(i) for i in draft.vocab_ids.tolist()])
    writer.add_string(TARGET_KEY, Path(target_path).name)
    state = to_hf_state_dict({k: v.detach().float() for k, v in draft.state_dict().items()}, config)
    head = torch.zeros(config.vocab_size, config.hidden_size)
    head[draft.vocab_ids] = state.pop("lm_head.weight")
    state.pop("vocab_ids")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for name, tensor in [*state.items(), ("lm_head.weight", head)]:
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = _permute(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, config.num_key_value_heads)
        gguf_name = names.get(name) or _gguf_name(name, path)
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        elif gguf_name == "token_embd.weight" and array.shape[-1] % 32 == 0:
            writer.add_tensor(
                gguf_name,
                quants.quantize(array, GGMLQuantizationType.Q8_0),
                raw_shape=None,
                raw_dtype=GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(gguf_name, array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)
    return path


def is_subset_draft(path: str | Path) -> bool:
    """Whether a GGUF file is a verispec draft with a vocabulary subset."""
    from ..models.gguf_header import metadata

    try:
        return VOCAB_IDS_KEY in metadata(path, (VOCAB_IDS_KEY,))
    except (OSError, ValueError, IndexError, struct.error):  # not a whole GGUF file: the loader says what is wrong
        return False


def load_subset_draft(path: str | Path) -> SubsetHeadLlama:
    """A draft GGUF with `verispec.draft.vocab_ids` as verispec's PyTorch model with the subset head."""
    from ..models.gguf_header import metadata
    from ..models.gguf_torch import read_gguf_weights
    from ..models.llama import from_hf_state_dict

    vocab_ids = torch.tensor(metadata(path, (VOCAB_IDS_KEY,))[VOCAB_IDS_KEY], dtype=torch.long)
    config, state = read_gguf_weights(path)
    config = config.replace(tie_word_embeddings=False)
    draft = SubsetHeadLlama(config, vocab_ids)
    head = state.pop("lm_head.weight")
    state = from_hf_state_dict(state, config)
    state["lm_head.weight"] = head[vocab_ids].contiguous()
    state["vocab_ids"] = vocab_ids
    draft.load_state_dict(state)
    return draft.eval()


def write_card(out: Path, run, state: dict, seconds: float) -> Path:
    """out/MODEL_CARD.md: the target, the data, the time, the subset and the measured acceptance."""
    training, subset = state.get("training", {}), state.get("subset", {})
    chosen = training.get("chosen") or {}
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    data = "the Python standard library (the built-in pair's corpus and split)" if run.data is None else run.data
    lines = [
        f"# Draft for {Path(run.target).name}",
        "",
        f"Distilled by `verispec train draft --target {run.target}` on {datetime.date.today().isoformat()}, "
        f"on {os.cpu_count()} CPU cores ({cpu}), in {seconds / 60:.1f} minutes in all.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{Path(run.target).name}` (sha256 {state.get('target_sha', '?')}…) |",
        f"| data | {data} |",
        f"| teacher | {state.get('teacher', 'llama.cpp')}, top-{run.top_k} distributions over windows of "
        f"{run.seq_len} tokens |",
        f"| draft | the target's first {run.layers} layers as the start, its embedding (frozen), "
        f"an output head over {subset.get('size', '?'):,} tokens |",
        f"| subset cost | {subset.get('mass_outside', float('nan')):.4f} of the target's mass, "
        f"{subset.get('greedy_outside', float('nan')):.4f} of its argmaxes lie outside the subset |",
        f"| training | {training.get('steps', 0)} steps in {training.get('seconds', 0) / 60:.1f} min |",
        f"| held-out acceptance (teacher-forced, against llama.cpp's distributions) | greedy "
        f"{chosen.get('beta_greedy', float('nan')):.3f}, T = 1 at least {chosen.get('beta_t1', float('nan')):.3f} |",
        "",
        "The speed-up depends on your machine and prompts: measure it with",
        f"`verispec bench --target {run.target} --draft {out / 'draft.gguf'}` on your own prompts "
        "(`--prompts FILE.jsonl`), or predict it with `verispec plan`.",
        "",
        "Exactness does not depend on the draft: every committed token is distributed as the target's.",
        "",
    ]
    path = out / "MODEL_CARD.md"
    path.write_text("\n".join(lines))
    return path
