"""Align a GGUF run by llama.cpp with its transformers reference, block by block.

llama.cpp's eval callback hands every node of the compute graph by name (``attn_norm-3``,
``Qcur-3``, ``kqv_out-3``, ``ffn_out-3``, ``l_out-3``: graph nodes, not the weights'
``blk.3.ffn_down``); each is mapped to the transformers module that computes the same tensor
(``model.layers.3.input_layernorm``, ``...self_attn.q_proj``, ``...mlp.down_proj``, the block),
by the table below (llama.cpp's ``llama`` graph: Llama, SmolLM2, Mistral and the models
converted as ``llama``). What a container computes with code of its own is compared where that
code's result is read: the attention's rope and softmax on what ``o_proj`` reads (llama.cpp's
``kqv_out``), the MLP's ``act_fn(gate) * up`` on what ``down_proj`` reads (``ffn_swiglu``), the
block's residual adds on its output (``l_out``).

The callback only observes, so isolation runs on the reference's side: the reference's module
fed llama.cpp's captured input of it (``ffn_swiglu-3`` into ``down_proj``; for a container's own
code, its children returning llama.cpp's tensors instead of computing), compared with
llama.cpp's output of it (``Pairing.against_primary``). A layer's isolated error is then the
error llama.cpp's kernels and weights add there, whatever reached it.

A quantized GGUF differs measurably at every matmul by design (llama.cpp also rounds the
activations to 8 bits in its quantized matmuls: 0.3-3% per projection on SmolLM2's Q4_1, fp32
reference). So a layer is judged against its peers, the same module in the other blocks
(``model.layers.*.mlp.down_proj``; a module without enough of them, such as ``lm_head``, against
every module of its class): it diverges where its isolated error stands out from theirs
(decide.py, ``PEER_FACTOR``). An error that only accumulates, every layer at its peers' level,
names none.

llama.cpp's ``llama`` graph computes q and k with their rows permuted per head (the GGUF
converter reorders them for its interleaved rope; transformers' GGUF loader permutes the weights
back): the captured ``Qcur``/``Kcur`` are permuted back before they are compared or fed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from guard.backends.activations import CaptureUnsupported
from guard.backends.activations.llama_cpp import LlamaCppSide
from guard.backends.activations.torch import ModuleCall, TorchCapture
from guard.backends.activations.transformers import TransformersSide
from guard.verify.activation.align import Alignment, Pairing
from guard.verify.activation.report import Unaligned

# llama.cpp architectures whose graph the table below names (llama.cpp's llm_build_llama).
ARCHITECTURES = ("llama",)
# Architectures whose q/k rows llama.cpp's converter permuted (transformers undoes it on load).
_PERMUTED_QK = ("llama",)


@dataclass(frozen=True)
class _Site:
    """One compared tensor: llama.cpp's node ``node`` and the reference's module ``module``
    (``{i}``: the block). ``feed``: llama.cpp's node fed to the module in isolation (``{prev}``:
    the block's input; None: the call's own input, the token ids). A container's own code is
    compared on what its child ``reads`` receives (else on its output), its children in
    ``replace`` returning llama.cpp's nodes; ``heads``: the head count whose rows llama.cpp
    permuted (q, k)."""

    node: str
    module: str
    feed: str | None
    reads: str | None = None
    replace: tuple[tuple[str, str], ...] = ()
    heads: str | None = None
    code: str = ""  # a container: what its own code computes (its layer's op label)


_L = "model.layers.{i}"
BLOCK = (
    _Site("attn_norm-{i}", f"{_L}.input_layernorm", "{prev}"),
    _Site("Qcur-{i}", f"{_L}.self_attn.q_proj", "attn_norm-{i}", heads="attention.head_count"),
    _Site("Kcur-{i}", f"{_L}.self_attn.k_proj", "attn_norm-{i}",
          heads="attention.head_count_kv"),
    _Site("Vcur-{i}", f"{_L}.self_attn.v_proj", "attn_norm-{i}"),
    _Site("kqv_out-{i}", f"{_L}.self_attn", "attn_norm-{i}", reads=f"{_L}.self_attn.o_proj",
          replace=((f"{_L}.self_attn.q_proj", "Qcur-{i}"), (f"{_L}.self_attn.k_proj", "Kcur-{i}"),
                   (f"{_L}.self_attn.v_proj", "Vcur-{i}")),
          code="rope and attention"),
    _Site("attn_out-{i}", f"{_L}.self_attn.o_proj", "kqv_out-{i}"),
    _Site("ffn_norm-{i}", f"{_L}.post_attention_layernorm", "ffn_inp-{i}"),
    _Site("ffn_gate-{i}", f"{_L}.mlp.gate_proj", "ffn_norm-{i}"),
    _Site("ffn_up-{i}", f"{_L}.mlp.up_proj", "ffn_norm-{i}"),
    _Site("ffn_swiglu-{i}", f"{_L}.mlp", "ffn_norm-{i}", reads=f"{_L}.mlp.down_proj",
          replace=((f"{_L}.mlp.gate_proj", "ffn_gate-{i}"), (f"{_L}.mlp.up_proj", "ffn_up-{i}")),
          code="act_fn(gate) * up"),
    _Site("ffn_out-{i}", f"{_L}.mlp.down_proj", "ffn_swiglu-{i}"),
    _Site("l_out-{i}", _L, "{prev}",
          replace=((f"{_L}.self_attn", "attn_out-{i}"), (f"{_L}.mlp", "ffn_out-{i}")),
          code="residual adds"),
)
FIRST = _Site("embd", "model.embed_tokens", None)
LAST = (_Site("result_norm", "model.norm", "{prev}"),
        _Site("result_output", "lm_head", "result_norm"))


def check_pair(reference, primary) -> None:
    """Raise ``CaptureUnsupported`` where a (reference, primary) pair with a llama.cpp side
    cannot be aligned: the other side must be transformers (llama.cpp is only observed, so the
    isolation runs on the other side), the graph one this table names."""
    sides = (reference, primary)
    if not any(isinstance(s, LlamaCppSide) for s in sides):
        return
    if not (isinstance(reference, TransformersSide) and isinstance(primary, LlamaCppSide)):
        raise CaptureUnsupported(
            f"tier 2 aligns a llama_cpp primary with a transformers reference (llama.cpp's "
            f"eval callback only observes: layers are isolated on the reference's modules); "
            f"this pair is {reference.kind}/{primary.kind}")
    if primary.architecture not in ARCHITECTURES:
        raise CaptureUnsupported(
            f"{primary.label}: tier 2 maps llama.cpp's graph of architecture "
            f"{', '.join(ARCHITECTURES)} to transformers' modules; {primary.path.name} is "
            f"'{primary.architecture}'")


def unpermute_heads(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's per-head row order of q/k (pairs interleaved) back to transformers' (halves):
    the inverse of the GGUF converter's permutation, on the last axis."""
    *lead, width = array.shape
    size = width // heads
    return array.reshape(*lead, heads, size // 2, 2).swapaxes(-1, -2).reshape(array.shape)


def peer_group(path: str) -> str:
    """The module in every block: ``model.layers.*.mlp.down_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


class _Llama:
    """llama.cpp's captured nodes, q and k in transformers' row order."""

    def __init__(self, side: LlamaCppSide, nodes: dict[str, np.ndarray]):
        self.nodes = nodes
        permuted = side.architecture in _PERMUTED_QK
        self.heads = {key: side.hyper(key) if permuted else None
                      for key in ("attention.head_count", "attention.head_count_kv")}
        self._heads_of: dict[str, int | None] = {}

    def mark(self, node: str, heads: str | None) -> None:
        self._heads_of[node] = self.heads.get(heads) if heads else None

    def __contains__(self, node: str) -> bool:
        return node in self.nodes

    def __getitem__(self, node: str) -> np.ndarray:
        array = self.nodes[node]
        heads = self._heads_of.get(node)
        return unpermute_heads(array, heads) if heads else array


def _fill(template: str, i: int | None, prev: str) -> str:
    return prev if template == "{prev}" else template.replace("{i}", str(i))


def align_transformers_llama_cpp(ref: TransformersSide, prim: LlamaCppSide,
                                 ref_cap: TorchCapture, prim_cap: dict[str, np.ndarray]
                                 ) -> Alignment:
    """The reference's modules paired with llama.cpp's nodes, in network order, each isolated
    on the reference's module fed llama.cpp's input of it; ``peers``: each layer's groups."""
    out = Alignment()
    llama = _Llama(prim, prim_cap)
    calls = {c.key: c for c in ref_cap.calls}
    blocks = prim.hyper("block_count") or 0
    sites: list[tuple[_Site, int | None, str]] = [(FIRST, None, "")]
    prev = FIRST.node
    for i in range(blocks):
        sites += [(site, i, prev) for site in BLOCK]
        prev = f"l_out-{i}"
    sites += [(site, None, prev) for site in LAST]
    for site in BLOCK:
        for i in range(blocks):
            llama.mark(site.node.replace("{i}", str(i)), site.heads)
    for site, block, before in sites:
        pairing = _pair(site, block, before, ref, llama, calls, out.unaligned)
        if pairing is not None:
            out.pairings.append(pairing)
            out.peers[pairing.value] = (peer_group(pairing.module), pairing.op)
    taken = {p.value for p in out.pairings}
    out.primary_only = [n for n in prim_cap if n not in taken]
    return out


def _pair(site: _Site, i: int | None, prev: str, ref: TransformersSide, llama: _Llama,
          calls: dict[str, ModuleCall], unaligned: list[Unaligned]) -> Pairing | None:
    node, path = _fill(site.node, i, prev), _fill(site.module, i, prev)
    feed = _fill(site.feed, i, prev) if site.feed is not None else None
    reads = _fill(site.reads, i, prev) if site.reads is not None else None
    replace = {_fill(p, i, prev): _fill(n, i, prev) for p, n in site.replace}
    call = calls.get(f"{path}#0")
    if call is None or not call.outputs:
        unaligned.append(Unaligned("primary", node, f"the reference has no module {path}"))
        return None
    needed = [node] + ([feed] if feed else []) + list(replace.values())
    missing = [n for n in needed if n not in llama]
    if missing:
        unaligned.append(Unaligned("reference", path, f"llama.cpp's graph computed no node "
                                   f"{', '.join(missing)}"))
        return None
    if reads is not None:
        inner = calls.get(f"{reads}#0")
        if inner is None or not inner.inputs:
            unaligned.append(Unaligned("reference", path, f"{reads} was not called"))
            return None
        reference, ref_key = inner.inputs[0], ""
    else:
        reference, ref_key = call.outputs[0], f"{call.key}.0"

    def isolate() -> tuple[np.ndarray, list[str]]:
        substitutes = {p: llama[n] for p, n in replace.items()}
        return ref.run_call(call.key, llama[feed] if feed else None, substitutes, reads), [node]

    op = f"{call.kind} ({site.code})" if site.code else call.kind
    return Pairing(path, op, path, node, reference, llama[node], isolate,
                   inputs=[feed] if feed else [], ref_key=ref_key, against_primary=True,
                   modules=[path])
