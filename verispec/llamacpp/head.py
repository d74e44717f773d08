"""verispec's own output head for a llama.cpp target (head.c): one kernel at every width.

Owns `OwnHead` (the C struct, its buffers, the callback a context installs and the logits of a
decode) and `own_head(model)` (an OwnHead where it applies to a file, else None).

llama.cpp's matrix products take llamafile's sgemm from 2 columns on and vec_dot for one, and they
round differently. Many files keep an output head of a type sgemm takes (Q8_0, F16, Q4_0) over a
body of types that take vec_dot at every width (Q4_1, K-quants): their logits would depend on the
pass only through the head, and a placeholder position in every one-position pass (a second pass
through the whole body) would be the price. With an OwnHead the context's graph stops after the
final norm (llama.cpp's cb_eval), and head.c computes the logits of every position with ggml's
one-column kernel: the logits llama.cpp's own head gives a one-position pass, bit for bit, checked
on the file before it is used (`own_head`). Applies where the head is the file's only sgemm matrix
whose results depend on the width on this CPU (`one_kernel_types`: on some CPUs Q8_0's do not),
the graph ends with the head (no soft-capping or scaling after it), and llama.cpp maps the file's
bytes as they are (exact kernels: nothing repacked). Knows nothing of caches, batches or speculation.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from ..models.gguf_header import tensor_table
from .lib import library

HEAD_NAMES = ("output.weight", "token_embd.weight")  # a tied head is the token embedding
SGEMM_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL"}  # llamafile's sgemm takes them from 2 columns
_F32 = 0  # GGML_TYPE_F32


class HeadStruct(ctypes.Structure):
    """`struct verispec_head` of head.h, field by field."""

    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("type", ctypes.c_int32),
        ("n_embd", ctypes.c_int32),
        ("n_vocab", ctypes.c_int32),
        ("mode", ctypes.c_int32),  # 0: off; 1: stop after result_norm; 2: copy it and go on
        ("hidden", ctypes.c_void_p),
        ("capacity", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("ubatches", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("quantized", ctypes.c_void_p),
        ("n_threads", ctypes.c_int32),
    ]


def matrix_types(path: Path, exclude: tuple[str, ...] = ()) -> set[str]:
    """The GGUF types of a file's matrices but those named in `exclude` (read from its header); {"F32"} where
    it cannot be read."""
    from gguf import GGMLQuantizationType

    try:
        tensors = tensor_table(path)
        return {
            GGMLQuantizationType(t.type).name
            for t in tensors
            if len(t.shape) > 1 and t.shape[1] > 1 and t.name not in exclude
        }
    except (OSError, ValueError):  # a file it cannot read: the regime that holds for every type
        return {"F32"}


@functools.cache
def one_kernel_types() -> frozenset[str]:
    """The types of SGEMM_TYPES whose matrix product gives each column's one-column results at every width
    on this CPU (kernels.c, measured on random data of three shapes through ggml's own mul_mat; a few
    milliseconds a type, once per process): they need neither a placeholder nor verispec's head.
    `VERISPEC_KERNEL_PROBE=0` takes none (every such type gets them)."""
    from .compiled import load
    from .lib import default_threads

    compiled = load()
    if compiled is None or os.environ.get("VERISPEC_KERNEL_PROBE", "1") == "0":
        return frozenset()
    library()  # ggml's CPU backend as verispec sets it up
    from gguf import GGMLQuantizationType

    shapes, threads = ((576, 256, 5), (128, 320, 3), (1024, 64, 9)), default_threads()
    return frozenset(
        name
        for name in SGEMM_TYPES
        if all(compiled.verispec_one_kernel(GGMLQuantizationType[name].value, *s, threads) == 1 for s in shapes)
    )


def width_dependent(types: set[str]) -> set[str]:
    """Those of `types` whose results depend on a product's width here (sgemm's types less `one_kernel_types`)."""
    return types & (SGEMM_TYPES - one_kernel_types())


def head_tensor(path: str | Path) -> tuple[str, int, int, int, int] | None:
    """(name, ggml type, offset in the file, n_embd, n_vocab) of a file's output head, or None."""
    try:
        tensors = {t.name: t for t in tensor_table(path) if t.name in HEAD_NAMES}
    except (OSError, ValueError):  # an unreadable header: llama.cpp's head
        return None
    tensor = next((tensors[name] for name in HEAD_NAMES if name in tensors), None)
    if tensor is None or len(tensor.shape) != 2:
        return None
    return tensor.name, tensor.type, tensor.offset, tensor.shape[0], tensor.shape[1]


class OwnHead:
    """One context's head: the struct head.c fills (hidden rows of each decode) and reads (the
    weight), and a logits buffer that grows to the most rows a decode asked for."""

    def __init__(
        self, compiled, weights: np.memmap, type_: int, n_embd: int, n_vocab: int, capacity: int, threads: int
    ):
        self._compiled, self._weights = compiled, weights  # the mapping outlives the struct's pointer
        self.n_vocab, self.capacity = n_vocab, capacity
        self._hidden = np.zeros((capacity, n_embd), np.float32)
        row_bytes = int(compiled.verispec_head_row_bytes(type_, n_embd))
        self._quantized = np.zeros(capacity * row_bytes, np.uint8)
        self._logits = np.zeros((0, n_vocab), np.float32)
        self.struct = HeadStruct(
            weights.ctypes.data, type_, n_embd, n_vocab, 1, self._hidden.ctypes.data, capacity, 0, 0, 0,
            self._quantized.ctypes.data, threads,
        )  # fmt: skip
        self.eval_callback = ctypes.cast(compiled.verispec_head_callback, library().ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(self.struct), ctypes.c_void_p)

    def reset(self) -> None:
        self.struct.rows = self.struct.ubatches = self.struct.overflow = 0

    @property
    def rows(self) -> int:
        return int(self.struct.rows)

    def logits_buffer(self, rows: int) -> np.ndarray:
        """The buffer head.c writes logits into, [at least rows, V] float32 (grown where smaller)."""
        if len(self._logits) < rows:
            self._logits = np.zeros((rows, self.n_vocab), np.float32)
        return self._logits

    def logits(self, rows: int) -> np.ndarray:
        """[rows, V] float32 of the rows copied since `reset` (a view, rewritten by the next call)."""
        if self.struct.overflow or rows != self.struct.rows:
            raise RuntimeError(f"the output head copied {self.struct.rows} hidden rows for {rows} outputs")
        out = self.logits_buffer(rows)
        self._compiled.verispec_head_logits(ctypes.addressof(self.struct), rows, out.ctypes.data)
        return out[:rows]


def _candidate(model) -> tuple | None:
    """The head's tensor where only the head keeps the file from vec_dot at every width, else None."""
    found = head_tensor(Path(model.path))
    if found is None or not model.shape_invariant:
        return None
    name, type_, _, _, n_vocab = found
    body = matrix_types(model.path, exclude=HEAD_NAMES)  # the token embedding is a table unless it is the head
    from gguf import GGMLQuantizationType

    if n_vocab != model.vocab_size or width_dependent(body) or not width_dependent({GGMLQuantizationType(type_).name}):
        return None
    return found


def new_head(model, capacity: int, threads: int) -> OwnHead | None:
    """An OwnHead for a context of `model` holding `capacity` outputs a decode, or None where the
    file does not qualify or the compiled library is missing (`own_head` has checked it)."""
    from .compiled import load

    found, compiled = _candidate(model), load()
    if found is None or compiled is None or not compiled.verispec_head_supported(found[1]):
        return None
    _, type_, offset, n_embd, n_vocab = found
    row_bytes = _row_bytes(type_, n_embd)
    weights = np.memmap(model.path, dtype=np.uint8, mode="r", offset=offset, shape=(n_vocab * row_bytes,))
    return OwnHead(compiled, weights, type_, n_embd, n_vocab, capacity, threads)


def _row_bytes(type_: int, n_embd: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_)]
    return n_embd // block * size


def own_head(model) -> bool:
    """Whether `model`'s shape-invariant contexts compute the output head themselves: the file
    qualifies (`_candidate`), and on one-position passes the head gives llama.cpp's own logits bit
    for bit (a small context of its own whose graph goes on after the final norm: mode 2)."""
    if os.environ.get("VERISPEC_OWN_HEAD", "1") == "0":  # llama.cpp's head and a placeholder per one-position pass
        return False
    head = new_head(model, 1, model.n_threads)
    if head is None:
        return False
    lib = library()
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 64, 64, 64, 1
    params.n_threads = params.n_threads_batch = model.n_threads
    params.no_perf = True
    params.cb_eval = head.eval_callback
    params.cb_eval_user_data = head.user_data
    context = lib.llama_init_from_model(model.weights.handle, params)
    if not context:
        return False
    batch, same = lib.llama_batch_init(1, 0, 1), True
    try:
        batch.n_tokens, batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 1, 0, 1
        head.struct.mode = 2
        for position, token in enumerate((model.config.bos_token_id or 0, 1, 2)):
            head.reset()
            batch.token[0], batch.pos[0] = token, position
            if lib.llama_decode(context, batch) != 0:
                return False
            theirs = np.ctypeslib.as_array(lib.llama_get_logits(context), shape=(1, head.n_vocab))
            same = same and np.array_equal(head.logits(1), theirs)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(context)
    return same
