"""The one composition root: settings -> target, drafter, tokenizer, draft-length policy.

Owns `Settings` (what to load and how, validated where it is built, picklable so that a Ray replica can load the
same parts) and the functions that turn it into loaded parts: `load_model`, `load_target`, `load_drafter`,
`load_parts` (all of them, as a server loads them), `load_tokenizer`, `load_profiled`, `draft_policy` /
`measured_policy`, `prepare_engine` (the CPU kernel or llama.cpp's compiled step, built before any timed loop) and
the start-up notes. Every llama.cpp-specific import of the command line and the server lives here.

Errors name a setting as the command line spells it (`--threads`), the form in which users give it; notes (a
fallback, a capped thread count, a measured deviation) go to a `say` callable, so that the caller decides where they
are printed. Knows nothing of argparse or HTTP.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .llamacpp.regime import FLASH_ATTN_CHOICES
from .models.backend import BACKENDS, GGUF_TYPES, is_gguf, load, load_text_tokenizer
from .models.checkpoint import load_tokenizer as load_directory_tokenizer
from .models.checkpoint import parse_dtype
from .models.trained_drafts import trained_draft  # the draft `train draft --target` made for a file
from .policy import AdaptiveLength, FixedLength

Say = Callable[[str], None]
NO_DRAFT = "none"
AUTO_DRAFT = "auto"  # --draft auto (default): the built-in pair's draft, a draft trained for the file, else suffix
AUTO_MODEL_FREE = "suffix"  # auto's drafter for a target of the user's: model-free, learns from every request
MODEL_FREE = ("ngram", "suffix")  # --draft values that load no model: prompt lookup, suffix drafting
STRING = "string:"  # --draft string:MODEL: a draft of another tokenizer drafting text at T = 0 (string_level.py)


def to_stderr() -> Say:
    """A sink for start-up notes: each distinct note printed once, `verispec: NOTE`, on stderr."""
    said: set[str] = set()

    def say(note: str) -> None:
        if note not in said:
            said.add(note)
            print(f"verispec: {note}", file=sys.stderr, flush=True)

    return say


def _quiet(note: str) -> None:
    """A sink that drops notes."""


@dataclass(frozen=True)
class Settings:
    """What to load and how. `target` None: the built-in pair's target; `draft` a model directory
    or GGUF file, 'ngram' (prompt lookup), 'suffix' (suffix drafting), 'early-exit:L' (the
    target's first L layers), 'none', or 'auto' (None too, the default): the built-in draft with
    the built-in target, else suffix drafting (`auto_draft`).
    `k` a draft length or 'auto' (`k_max` bounds auto's choice). `resolved()` fills the defaults."""

    target: str | None = None
    draft: str | None = None
    backend: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    gguf_type: str | None = None
    exact_kernels: bool = True
    flash_attn: str = "auto"  # llama.cpp's -fa: auto, on, off (llamacpp/regime.py)
    k: int | str = "auto"
    k_max: int = 8
    confidence_threshold: float = 0.0
    draft_temperature: float | None = None  # a model draft's proposal temperature tau; None: auto (proposal.py)
    extra_drafts: tuple[str, ...] = field(default=(), repr=False)  # other candidates the target must suit (plan)
    draft_note: str | None = field(default=None, repr=False)  # resolved(): why --draft auto chose the draft it did

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.gguf_type is not None and self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"--threads must be an integer >= 1, got {self.threads!r}")
        if not isinstance(self.exact_kernels, bool):
            raise ValueError(f"--exact-kernels must be on or off, got {self.exact_kernels!r}")
        if self.flash_attn not in FLASH_ATTN_CHOICES:
            raise ValueError(f"--flash-attn must be one of {', '.join(FLASH_ATTN_CHOICES)}, got {self.flash_attn!r}")
        if not (isinstance(self.confidence_threshold, (int, float)) and 0.0 <= self.confidence_threshold < 1.0):
            raise ValueError(
                f"--confidence-threshold must be a probability in [0, 1), got {self.confidence_threshold!r}"
            )
        if self.draft_temperature is not None and not (
            isinstance(self.draft_temperature, (int, float)) and 0.0 <= self.draft_temperature <= 1.0
        ):
            raise ValueError(
                f"--draft-temperature must be 'auto' or a number in [0, 1], got {self.draft_temperature!r}"
            )
        if not (self.k == "auto" or _is_int(self.k)):
            raise ValueError(f"--k must be an integer or 'auto', got {self.k!r}")
        for spec in (self.draft, *self.extra_drafts):
            _check_draft(spec)
        parse_dtype(self.dtype)
        self.torch_device  # noqa: B018 (validates --device)
        draft_policy(self)  # the policy's own rules on k and k_max

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        """--device as a torch device, checked against this machine and the backend."""
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {self.device}: no CUDA device here (this torch is {torch.__version__})")
            if self.backend == "llamacpp":
                raise ValueError(
                    f"--device {self.device}: the llama.cpp backend runs on the CPU here; use --backend torch"
                )
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"--device {self.device}: there are {torch.cuda.device_count()} CUDA devices")
        return device

    @property
    def draft_spec(self) -> str | None:
        """The draft to load once resolved: None for no draft."""
        draft = self.resolved().draft
        return None if draft == NO_DRAFT else draft

    @property
    def auto_draft(self) -> str | None:
        """Why --draft auto chose its drafter, in a line, when it chose one for a target of the user's
        (None when the user named a draft, or the built-in pair runs its own draft)."""
        if self.draft not in (None, AUTO_DRAFT) or self.target is None:
            return None
        if (trained := trained_draft(self.target)) is not None:
            return f"--draft auto: the draft trained for this file ({trained}; --k {self.k}; --draft none turns it off)"
        return (
            f"--draft auto: suffix drafting (model-free: proposes what followed the same text before; --k {self.k} "
            "backs off where it does not pay; --draft none turns it off)"
        )

    def resolved(self) -> Settings:
        """The same settings with the defaults filled: the built-in pair where no target is given
        (its draft too, unless `draft` says otherwise), --draft auto's choice, and the torch
        backend for `auto` when a draft is early exit (it reads the target's own layers)."""
        target, draft = self.target, self.draft
        if target is None:
            from .pair import DRAFT_DIR, TARGET_DIR

            target = str(TARGET_DIR)
            draft = str(DRAFT_DIR) if draft in (None, AUTO_DRAFT) else draft
        if draft in (None, AUTO_DRAFT):
            draft = trained_draft(target) or AUTO_MODEL_FREE
        early_exit = any(str(spec).startswith("early-exit:") for spec in (draft, *self.extra_drafts))
        backend = "torch" if self.backend == "auto" and early_exit else self.backend
        if (target, draft, backend) == (self.target, self.draft, self.backend):
            return self
        return replace(self, target=target, draft=draft, backend=backend, draft_note=self.auto_draft or self.draft_note)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def combined(spec: str | None) -> tuple[str, str] | None:
    """(lookup, model) of a combined --draft 'A+B' (A 'ngram' or 'suffix', B a model), else None."""
    if spec is None or "+" not in spec or Path(spec).exists():
        return None
    lookup, model = spec.split("+", 1)
    return (lookup, model) if lookup in MODEL_FREE else None


def model_spec(spec: str | None) -> str | None:
    """The --draft value's model (a directory or GGUF file), if it runs one: B of 'A+B', None for
    'ngram', 'suffix', 'early-exit:L' and 'none'."""
    parts = combined(spec)
    spec = parts[1] if parts else spec
    if spec is None or spec in (*MODEL_FREE, NO_DRAFT) or spec.startswith("early-exit:"):
        return None
    return spec.removeprefix(STRING) if spec.startswith(STRING) and not Path(spec).exists() else spec


def drafts_text(spec: str | None) -> bool:
    """Whether a --draft value is 'string:MODEL' (string-level drafting)."""
    return spec is not None and spec.startswith(STRING) and model_spec(spec) != spec


def _check_draft(spec: str | None) -> None:
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"--draft must be a path, 'ngram', 'suffix', 'early-exit:L' or 'none', got {spec!r}")
    parts = combined(spec)
    if spec is not None and "+" in spec and not Path(spec).exists():
        model = parts[1] if parts else ""
        if parts is None or model in (*MODEL_FREE, NO_DRAFT, "") or model.startswith("early-exit:"):
            raise ValueError(f"--draft {spec}: a combined draft is 'ngram+MODEL' or 'suffix+MODEL' (a model path)")
    if spec is not None and spec.startswith("early-exit:") and not spec.split(":", 1)[1].isdigit():
        raise ValueError(f"--draft early-exit:L needs a layer count L, got {spec!r}")
    if spec is not None and spec.startswith(STRING) and not Path(spec).exists():
        model = spec.removeprefix(STRING)
        if model in (*MODEL_FREE, NO_DRAFT, "") or model.startswith(("early-exit:", STRING)) or combined(model):
            raise ValueError(f"--draft {spec}: string-level drafting takes a draft model: 'string:MODEL' (a path)")


def draft_policy(settings: Settings) -> FixedLength | AdaptiveLength:
    """The draft-length policy of `settings.k`, before anything is measured."""
    return AdaptiveLength(k_max=settings.k_max) if settings.k == "auto" else FixedLength(settings.k)


def measured_policy(settings: Settings, target, drafter, rows: int, context_length: int):
    """(policy, plain step seconds or None): with a draft, a plain step timed for the estimated speed-up, and with
    `--k auto` AdaptiveLength with priors from a quick cost profile of these models, so that it chooses well from the
    start."""
    if drafter is None:
        return draft_policy(settings), None
    from .analysis.profile import profile_costs

    if settings.k != "auto":
        plain = profile_costs(target, None, 0, batch_size=rows, context_length=context_length, repeats=3)
        return draft_policy(settings), plain.target_s[0]

    profile = profile_costs(
        target,
        getattr(drafter, "model", None),
        settings.k_max,
        batch_size=rows,
        context_length=context_length,
        repeats=3,
    )
    policy = AdaptiveLength(k_max=settings.k_max, prior_c=profile.c or 0.0, prior_r=profile.r, prior_batch=rows)
    return policy, profile.target_s[0]


# ---- models


def llamacpp_threads(settings: Settings, say: Say = _quiet) -> int | None:
    """--threads, capped at the cores this process may use (said), after --exact-kernels and
    --flash-attn are applied: llama.cpp settings of the whole process, fixed before its first model."""
    from . import llamacpp

    try:
        llamacpp.set_exact_kernels(settings.exact_kernels)
    except RuntimeError:
        setting = "on" if settings.exact_kernels else "off"
        raise ValueError(
            f"--exact-kernels {setting}: this process already runs llama.cpp with the other setting"
        ) from None
    from .llamacpp import regime

    regime.set_flash_attention(settings.flash_attn)
    threads, cores = settings.threads, llamacpp.default_threads()
    if threads is not None and threads > cores:
        say(f"--threads {threads} is more than the {cores} cores this process may use; using {cores}")
        threads = cores
    return threads


def load_model(settings: Settings, path: str, say: Say = _quiet, keep_torch_threads: bool = False):
    """The model at `path` (a directory or GGUF file) on --backend; a fallback of `auto` is said.
    Under llama.cpp torch keeps one thread (its work per step is a few [B, k+1, V] tensors)
    unless `keep_torch_threads` (a peer that runs on torch in the same process)."""
    settings = settings.resolved()
    device = settings.torch_device
    if device.type != "cpu" and is_gguf(path):
        raise ValueError(f"{path}: a GGUF file runs on llama.cpp, on the CPU here, not on --device {settings.device}")
    model, note = load(
        path,
        settings.backend,
        settings.torch_dtype,
        settings.gguf_type or "f32",
        device=device,
        n_threads=llamacpp_threads(settings, say),
    )
    if note:
        say(note)
    if not isinstance(model, torch.nn.Module) and not keep_torch_threads:
        torch.set_num_threads(1)
    return model


def deviation_note(target) -> str | None:
    """A line when a llama.cpp target's logits depend on the pass that computes them (measured
    once per file, build and setting: models/deviation.py); None when they do not."""
    if not hasattr(target, "shape_invariant") or not target.rolls_back:  # a recurrent model: one pass shape
        return None
    from .llamacpp.deviation import startup_deviation

    found = startup_deviation(target)
    if found.largest <= 0:
        return None
    setting = "on" if target.shape_invariant else "off"
    return (
        f"{target.path.name} ({target.config.description}): a logit differs by up to {found.largest:.3g} between "
        f"pass shapes here (--exact-kernels {setting}); greedy speculative output may differ from plain decoding "
        "at near-ties"
    )


def load_target(settings: Settings, say: Say = _quiet):
    """(target, its text tokenizer); a measured deviation is said. ValueError without a tokenizer."""
    settings = settings.resolved()
    target = load_model(settings, settings.target, say)
    note = deviation_note(target)
    if note:
        say(note)
    tokenizer = load_text_tokenizer(settings.target, target)
    if tokenizer is None:
        raise ValueError(f"{settings.target}: no tokenizer.json, so text cannot be encoded")
    return target, tokenizer


def load_drafter(settings: Settings, target, say: Say = _quiet, spec: str | None = None):
    """The drafter of --draft (or of `spec`, a candidate): None for 'none'; prompt lookup for
    'ngram'; suffix drafting for 'suffix'; the target's first L layers for 'early-exit:L'; else a model,
    wrapped in a ModelDrafter with --confidence-threshold where its vocabulary is the target's, in a
    TokenIntersectionDrafter where it differs (a StringLevelDrafter for 'string:MODEL'; the mode is said)."""
    settings = settings.resolved()
    spec = settings.draft if spec is None else spec
    _check_draft(spec)
    if spec == NO_DRAFT:
        return None
    if not getattr(target, "rolls_back", True):
        say(f"{settings.target}: a {target.memory_kind} model cannot forget rejected positions: plain decoding")
        return None
    parts = combined(spec)
    if parts:
        from .drafters.combined import CombinedDrafter

        lookup, model = (load_drafter(settings, target, say, part) for part in parts)
        if not hasattr(model, "append_pending"):
            raise ValueError(f"--draft {spec}: {parts[1]} cannot be combined (a draft of another tokenizer)")
        return CombinedDrafter(lookup, model)
    if spec == "ngram":
        from .drafters.ngram import PromptLookupDrafter

        return PromptLookupDrafter(device=target.device)
    if spec == "suffix":
        from .drafters.suffix import SuffixDrafter

        return SuffixDrafter(keep_corpus=True, device=target.device)  # earlier requests of this process: a corpus
    if spec.startswith("early-exit:"):
        from .drafters.early_exit import EarlyExitDrafter
        from .models.llama import LlamaForCausalLM

        if not isinstance(target, LlamaForCausalLM):
            raise ValueError(
                f"--draft {spec}: early exit needs verispec's PyTorch Llama as the target "
                "(a Llama-family directory with --backend torch)"
            )
        return EarlyExitDrafter(target, int(spec.split(":", 1)[1]))
    from .drafters.model import ModelDrafter
    from .models.vocab import check_same_tokenizer, match_vocab_size, vocabularies_differ

    path = model_spec(spec)
    draft = load_model(settings, path, say)
    if not getattr(draft, "rolls_back", True):
        raise ValueError(f"--draft {spec}: a {draft.memory_kind} model cannot forget rejected positions: no draft")
    if hasattr(draft, "shape_invariant"):
        draft.shape_invariant = False  # only the target's logits must not depend on the pass
    if vocabularies_differ(settings.target, path):
        return _intersection_drafter(settings, target, draft, spec, say)
    if drafts_text(spec):
        raise ValueError(
            f"--draft {spec}: {path} shares the target's tokenizer; string-level drafting is for a draft with "
            f"another one (give --draft {path})"
        )
    check_same_tokenizer(settings.target, path, target.vocab_size, draft.vocab_size)
    if isinstance(draft, torch.nn.Module) and not isinstance(target, torch.nn.Module):  # it alternates with llama.cpp
        torch.set_num_threads(getattr(target, "n_threads", None) or torch.get_num_threads())  # c 0.40, not 0.45
    draft = match_vocab_size(draft, target.vocab_size)
    return ModelDrafter(draft, settings.confidence_threshold, settings.draft_temperature)


def _intersection_drafter(settings: Settings, target, draft, spec: str, say: Say):
    """A draft whose tokenizer differs from the target's: token-level intersection, or with 'string:' string-level
    drafting at temperature 0 (said)."""
    from .drafters.cross_vocab import TokenIntersectionDrafter
    from .drafters.string_level import StringLevelDrafter
    from .models.token_text import token_text_of

    texts = token_text_of(settings.target, target), token_text_of(model_spec(spec), draft)
    if None in texts:
        raise ValueError(f"--draft {spec}: its vocabulary differs from the target's and cannot be read as text")
    kind = StringLevelDrafter if drafts_text(spec) else TokenIntersectionDrafter
    drafter = kind(draft, texts[1], texts[0], target.vocab_size, settings.confidence_threshold)
    say(f"--draft {spec}: {drafter.mode_line()}")
    return drafter


def load_profiled(settings: Settings, name: str, say: Say = _quiet):
    """A model to time (`profile`): a directory or GGUF file on --backend, or a preset name of
    verispec.training with random weights on torch (costs only)."""
    from .models.llama import LlamaForCausalLM, init_weights
    from .models.presets import PRESETS

    if not Path(name).exists() and name in PRESETS:
        return init_weights(LlamaForCausalLM(PRESETS[name])).to(settings.torch_dtype).eval()
    return load_model(settings, model_spec(name) or name, say)


def eos_ids(target) -> tuple[int, ...]:
    """The target's end-of-sequence ids (transformers configs may list several)."""
    eos = target.config.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)


@dataclass
class Parts:
    """Loaded parts of one Settings, as a server uses them."""

    settings: Settings  # resolved: the paths actually loaded
    target: object
    tokenizer: object
    drafter: object | None
    policy: object  # FixedLength or AdaptiveLength
    eos: tuple[int, ...]


def load_parts(settings: Settings, say: Say = _quiet) -> Parts:
    """Target, tokenizer, drafter and policy, as `verispec serve` and every Ray replica load them."""
    settings = settings.resolved()
    target, tokenizer = load_target(settings, say)
    drafter = load_drafter(settings, target, say)
    if drafter is not None and settings.draft_note:
        say(settings.draft_note)
    return Parts(settings, target, tokenizer, drafter, draft_policy(settings), eos_ids(target))


def load_tokenizer(settings: Settings, say: Say = _quiet):
    """The target's text tokenizer alone: a directory's tokenizer.json, read without its weights;
    a GGUF file's own vocabulary (the file is mapped, not copied)."""
    settings = settings.resolved()
    if is_gguf(settings.target):
        return load_target(settings, say)[1]
    return load_directory_tokenizer(settings.target)


# ---- the engine underneath


def prepare_engine(target, drafter=None, rows: int = 1, draft_rows: int = 0) -> list[dict]:
    """Build and measure what the decoding loop uses now, not inside a timed run: a torch
    target's CPU kernel, calibrated for up to `rows` rows (a torch draft model's for
    `draft_rows`), or llama.cpp's compiled step when a draft is given. Returns the kernel
    choices measured for the target (none on llama.cpp)."""
    if isinstance(target, torch.nn.Module):
        from .models.kernels import calibrate, kernel_status

        kernel_status()  # load (or build, once) the CPU kernel
        choices = calibrate(target, rows)
        if draft_rows and isinstance(getattr(drafter, "model", None), torch.nn.Module):
            calibrate(drafter.model, draft_rows)
        return choices
    if drafter is not None:
        from .llamacpp import step_status

        step_status()  # build (once) the compiled step
        if isinstance(getattr(drafter, "model", None), torch.nn.Module):  # a torch draft (a vocabulary-subset one)
            from .models.kernels import calibrate, kernel_status

            kernel_status()
            calibrate(drafter.model, max(rows, draft_rows))
    return []


def engine_description(target, dtype: str) -> str:
    """What runs a target's passes, in words: torch with its kernel, or llama.cpp with its build."""
    if isinstance(target, torch.nn.Module):
        from .models.kernels import kernel_status

        return f"{dtype}, {kernel_status()}"
    from .llamacpp import step_status, system_info

    return f"llama.cpp, {target.config.description}, {target.n_threads} threads; {system_info()}; {step_status()}"


def llamacpp_unavailable() -> str | None:
    """Why llama.cpp does not run here, or None when it does."""
    from .llamacpp import unavailable

    return unavailable()


def gguf_files(settings: Settings, drafts: Sequence[str | None]) -> tuple[Path, list[Path | None]]:
    """The GGUF files of the target and of each model draft ('ngram', 'suffix', 'none' and None: no file),
    a directory converted once to --gguf-type (cached)."""
    from .models.backend import gguf_file

    settings = settings.resolved()
    gguf_type = settings.gguf_type or "f32"
    files = [None if model_spec(spec) is None else gguf_file(model_spec(spec), gguf_type) for spec in drafts]
    return gguf_file(settings.target, gguf_type), files
