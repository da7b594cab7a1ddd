"""llama.cpp's activations for tier 2: the nodes of a GGUF's compute graph, by name, through
the eval callback (``cb_eval`` in the context params), as llama.cpp's ``eval-callback``
example reads them.

The scheduler asks the callback about each node before computing it (``ask`` true: "do you
want this one?") and, for a node it wanted, hands it over once computed (``ask`` false); the
data is read with ``ggml_backend_tensor_get``, which copies from whatever buffer holds it (host
memory here, a GPU's on other builds). The callback only observes: nothing can be fed into the
graph, so a llama.cpp side is captured and never re-run. Tier 2 isolates on the reference's side
instead (its module fed llama.cpp's captured input, compared with llama.cpp's output of it:
guard/verify/activation/gguf_align.py).

What is kept: the float32 nodes of shape ``[n_tokens, width]`` under a plain name: the hidden
states between the ops, ``attn_norm-3``, ``Qcur-3``, ``kqv_out-3``, ``ffn_out-3``, ``l_out-3``,
``result_output`` (the graph's node names, not its weights' ``blk.3.ffn_down``). A name computed
several times keeps its last such node (``Qcur-3`` is the projection, then its reshape into heads
and the rope, which are 3-D: the projection, with its bias where the architecture adds one).
Views, permutes, cache writes and unnamed nodes are declined at ``ask``, so the scheduler splits
the graph only around the nodes taken. The whole sequence is one micro-batch (``n_ubatch`` =
``context_length``), so that each node is computed once.

The side is private: its own model and context loaded from the block's file, never the scorer's
or a server's. Its ``struct ggml_tensor`` view is the header's leading fields (``type``,
``buffer``, ``ne``, ``nb``), checked against ``ggml_nelements`` on every node read.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

import numpy as np

from guard.backends.activations import CaptureUnsupported
from guard.backends.gguf_quantize import file_type_name
from guard.backends.llama_cpp import quiet_llama_logs

# A node worth keeping is named like ``attn_norm-3`` or ``result_norm``: no view/permute suffix.
_PLAIN_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(-\d+)?$")
_UNNAMED = re.compile(r"^(node|leaf)_\d+$")
_GGML_TYPE_F32 = 0


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml.h's ``struct ggml_tensor`` (stable across ggml releases)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


def _ggml():
    """libggml with the few functions read here typed."""
    import llama_cpp._ggml as ggml

    lib = ggml.libggml
    pointer = [ctypes.c_void_p]
    for name, restype in (("ggml_get_name", ctypes.c_char_p), ("ggml_nbytes", ctypes.c_size_t),
                          ("ggml_nelements", ctypes.c_int64),
                          ("ggml_is_contiguous", ctypes.c_bool)):
        function = getattr(lib, name)
        function.argtypes, function.restype = pointer, restype
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


class LlamaCppSide:
    """A GGUF loaded by llama.cpp in a context of its own, its graph nodes captured per check."""

    kind = "llama_cpp"

    def __init__(self, path: str | Path, threads: int = 1, context_length: int = 1024,
                 label: str = "llama_cpp"):
        import llama_cpp
        from llama_cpp import _internals

        quiet_llama_logs()
        self.label = label
        self.path = Path(path)
        self.context_length = context_length
        self._lib = _ggml()
        self._lock = threading.Lock()
        self._taken: dict[str, np.ndarray] = {}
        self._error: str = ""
        # Kept referenced for the context's lifetime: llama.cpp holds the bare pointer.
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)
        try:
            self._model = _internals.LlamaModel(
                path_model=str(self.path), params=llama_cpp.llama_model_default_params(),
                verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise CaptureUnsupported(f"{label}: llama.cpp cannot load {self.path}: {exc}") from None
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = context_length
        params.n_threads = params.n_threads_batch = threads
        params.cb_eval = self._callback
        try:
            self._context = _internals.LlamaContext(model=self._model, params=params,
                                                    verbose=False)
            self._batch = _internals.LlamaBatch(n_tokens=context_length, embd=0, n_seq_max=1,
                                                verbose=False)
        except (ValueError, RuntimeError) as exc:
            self.close()
            raise CaptureUnsupported(f"{label}: llama.cpp cannot make a context for "
                                     f"{self.path}: {exc}") from None
        metadata = self._model.metadata()
        self.architecture = metadata.get("general.architecture", "")
        self.metadata = metadata
        name = file_type_name(metadata.get("general.file_type")) or "unknown"
        # What the pair computes in, for tier 2's rules: a quantized file is reduced precision.
        self.precision = "fp32" if name == "F32" else f"gguf {name}"

    def hyper(self, key: str) -> int | None:
        """An integer hyperparameter of the architecture (``attention.head_count``...)."""
        value = self.metadata.get(f"{self.architecture}.{key}")
        return int(value) if value is not None else None

    def tokenize(self, text: str) -> list[int]:
        """``text`` as llama.cpp tokenizes it for this file, BOS first where the model adds
        one (as its server tokenizes a completions prompt)."""
        return list(self._model.tokenize(text.encode("utf-8"), self._model.add_bos_token(),
                                         True))

    # -- the eval callback ------------------------------------------------------------------------
    def _wanted(self, tensor: int) -> tuple[bool, str, _TensorHead]:
        head = ctypes.cast(tensor, ctypes.POINTER(_TensorHead)).contents
        name = (self._lib.ggml_get_name(tensor) or b"").decode("utf-8", "replace")
        wanted = (head.type == _GGML_TYPE_F32 and head.ne[2] == 1 and head.ne[3] == 1
                  and bool(_PLAIN_NAME.match(name)) and not _UNNAMED.match(name)
                  and self._lib.ggml_is_contiguous(tensor))
        return wanted, name, head

    def _on_node(self, tensor, ask, _user_data) -> bool:
        try:
            wanted, name, head = self._wanted(tensor)
            if ask:
                return wanted
            if not wanted:
                return True
            count = int(head.ne[0]) * int(head.ne[1])
            if self._lib.ggml_nelements(tensor) != count:
                raise RuntimeError(f"node {name}: ggml_tensor's layout is not the one read here")
            data = np.empty((int(head.ne[1]), int(head.ne[0])), dtype=np.float32)
            self._lib.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
            self._taken[name] = data
        except Exception as exc:  # never raise through C: note it, the capture reports it
            self._error = self._error or f"{type(exc).__name__}: {exc}"
        return True

    # -- a capture ---------------------------------------------------------------------------
    def capture(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's nodes for one sequence of token ids (``inputs["input_ids"]``, shape
        ``[1, T]``), by node name, each ``[1, T, width]`` as transformers lays hidden states."""
        ids = np.asarray(inputs["input_ids"])
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"input_ids: one sequence [1, T] is captured, got {ids.shape}")
        tokens = [int(t) for t in ids[0]]
        if not tokens or len(tokens) > self.context_length:
            raise ValueError(f"{len(tokens)} tokens: a capture takes 1 to context_length "
                             f"({self.context_length})")
        with self._lock:
            self._taken, self._error = {}, ""
            self._context.kv_cache_clear()
            self._batch.set_batch(tokens, n_past=0, logits_all=True)
            self._context.decode(self._batch)
            taken, error = self._taken, self._error
            self._taken = {}
        if error:
            raise RuntimeError(f"{self.label}: reading llama.cpp's nodes: {error}")
        return {name: array[None] for name, array in taken.items()}

    def close(self) -> None:
        for part in ("_batch", "_context", "_model"):
            held = getattr(self, part, None)
            if held is not None:
                held.close()
                setattr(self, part, None)


def llama_cpp_side(spec, role: str, config, threads: int = 1, run_path=None,
                   label: str = "llama_cpp") -> LlamaCppSide:
    """Tier 2's side for a ``llama_cpp`` block (declared as its ``activations`` in
    guard/backends/llama_cpp.py): the block's GGUF in a llama.cpp context of its own."""
    from guard.backends.llama_cpp import LlamaCppOptions

    options = LlamaCppOptions.model_validate(spec.options)
    if spec.sha256 is not None:
        from guard.backends.artifact import read_artifact

        read_artifact(spec.path, spec.sha256)
    return LlamaCppSide(run_path or spec.path, options.threads or threads,
                        options.context_length, label)
