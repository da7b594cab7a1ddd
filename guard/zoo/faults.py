"""A seeded fault corpus for tier 2: pairs whose one broken layer is known.

Each case is a (reference, primary) pair plus the layer that was broken (``true_layer``, the
reference-side layer name tier 2 reports), or none for a clean pair. Built offline from seeded
MLPs, the zoo CNN and the real models (MiniLM, silero-vad) when their packages are installed:

- ``weight``: one layer's weight tensor perturbed, ``W + p * std(W) * N(0, 1)``, p from 0.1% to 10%;
- ``bias``: one layer's bias shifted by a share of its output's scale;
- ``activation``: one activation swapped for another (Relu -> Sigmoid);
- ``int8_outlier``: one Linear with an outlier weight (50x its largest), primary derived as int8;
- ``fp16_overflow``: one Linear whose output exceeds fp16's range (a LayerNorm after it hides it
  in fp32), primary derived as fp16;
- ``torch_onnx``: torch eager reference vs its ONNX export with one module's weights perturbed;
- the same and ONNX vs ONNX with the primary through ONNX Runtime's transformer optimiser,
  q/k/v packed into one Attention node (``packed_attention_cases``);
- ``clean``: fp32 vs fp32 (the same file twice, torch vs its export, ONNX Runtime at another
  thread count), int8/fp16 variants under the tolerances such a deployment sets, and the zoo
  detector (torch vs its export) on a batch where the two sorts break a score tie in another
  order: its ``stable_nms`` adapter resolves it, as the Comparator's tier 1 does.

silero-vad (the package's ONNX, its 16 kHz network; ``guard.zoo.silero_vad``) gives ONNX-vs-ONNX
cases on a real recurrent model: convolution and LSTM-gate weights perturbed 0.1-10%, a bias
shift, and clean pairs. Its torch side is TorchScript, which tier 2 cannot hook (no eager twin
ships), so it has no torch-vs-ONNX case. The seeded GRU and LSTM sequence classifiers
(``guard.zoo.layouts.recurrent``, among the layouts' families) give them: the recurrent module,
one ONNX GRU/LSTM op, faulted in its weights and biases, both exporters.

``gguf_cases``: SmolLM2-135M's GGUF run by llama.cpp (its graph captured by the eval callback)
against the transformers reference, one tensor requantized to a much lower type or perturbed,
and clean pairs (guard/verify/activation/gguf_align.py).

Used by ``benchmarks/localisation.py`` and, a seeded subset, by the unit tests.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from guard.verify.activation.checker import Side

FP32: dict[str, float] = {}  # tier 1's defaults (atol 1e-4, rtol 1e-3)
INT8 = {"rtol": 0.02}  # what an int8 deployment allows (per-layer int8 error ~0.2-0.7%)
FP16 = {"rtol": 0.01}


@dataclass
class FaultCase:
    name: str
    kind: str
    model: str
    reference: Path | Callable  # an ONNX file, or a factory of the torch eager reference
    primary: Path | Callable  # an fp32 ONNX file (derived to ``precision`` when not fp32)
    inputs: dict[str, np.ndarray]
    true_layer: str | None  # None: a clean pair
    precision: str = "fp32"
    tensor: dict = field(default_factory=dict)  # tier-1 tolerances of this deployment
    input_names: list[str] = field(default_factory=list)  # torch reference's positional inputs
    adapters: list = field(default_factory=list)  # the model's adapters (tier 1 runs through them)
    primary_threads: int = 1  # the primary's intra-op threads (the reference runs at 1)
    # torch.compile options: the primary is then ``primary`` (a factory of the eager module)
    # compiled, captured on the compiled code (guard/backends/activations/compiled.py).
    compiled: dict | None = None
    # A GGUF pair: ``reference`` the GGUF transformers dequantizes, ``primary`` the GGUF
    # llama.cpp runs (its graph captured by the eval callback), ``inputs`` token ids.
    gguf: bool = False

    @property
    def onnx_pair(self) -> bool:
        return isinstance(self.reference, Path) and not self.gguf

    def file(self, role: str) -> Path:
        """The ``role`` side ("reference", "primary") as its file."""
        side = getattr(self, role)
        if not isinstance(side, Path):
            raise TypeError(f"case {self.name}: the {role} is a module factory, not a file")
        return side

    def factory(self, role: str) -> Callable:
        """The ``role`` side ("reference", "primary") as its module factory."""
        side = getattr(self, role)
        if isinstance(side, Path):
            raise TypeError(f"case {self.name}: the {role} is a file ({side}), not a factory")
        return side

    def names_true_layer(self, name: str | None) -> bool:
        """Whether a reported layer is the broken one: the layer itself, or a unit tier 2
        compared as one that holds it (``layer2.0.conv1+layer2.0.bn1``, ``blocks.1.attn.{q,k,v}``
        packed into one Attention node)."""
        from guard.verify.activation.packed import members

        if name is None or self.true_layer is None:
            return False
        if name.endswith("]") and "[" in name:  # one output of a multi-output node: the node
            name = name[:name.index("[")]
        return name == self.true_layer or self.true_layer in members(name)

    def primary_variant(self) -> Path:
        """The primary as it runs: the fp32 file, or the variant derived at ``precision``.

        int8 is quantised with reduce_range (7-bit weights) where this CPU's int8 kernels
        saturate (x86-64 without VNNI/AMX, guard/machine.py), so that an int8 case's fault is
        the seeded one and not the instruction's: with 8-bit weights the seeded MLPs' clean int8
        variants were 3-9% of the output's scale off fp32 on an AMD EPYC (over the int8 rtol
        0.02, tier 2 then rightly blaming fc1), 0.5-0.9% with reduce_range."""
        if self.precision == "fp32":
            return self.file("primary")
        from guard.backends.derive import derive_onnx
        from guard.machine import int8_kernels_saturate

        return derive_onnx(self.file("primary"), self.precision,
                           reduce_range=self.precision == "int8" and int8_kernels_saturate())


# -- models ---------------------------------------------------------------------------------------
def mlp(seed: int, width: int = 32, depth: int = 4, act: str = "relu",
        norm_after: int | None = None):
    """x[N,16] -> depth x (Linear -> act) -> Linear -> y[N,8]; ``norm_after``: a LayerNorm after
    that Linear (fp16 overflow sites)."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            dims = [16] + [width] * depth
            for i in range(depth):
                setattr(self, f"fc{i + 1}", nn.Linear(dims[i], dims[i + 1]))
                setattr(self, f"act{i + 1}", nn.ReLU() if act == "relu" else nn.GELU())
            self.head = nn.Linear(width, 8)
            if norm_after is not None:
                self.norm = nn.LayerNorm(width)
            self.depth = depth

        def forward(self, x):
            for i in range(1, self.depth + 1):
                x = getattr(self, f"fc{i}")(x)
                if norm_after == i:
                    x = self.norm(x)
                x = getattr(self, f"act{i}")(x)
            return self.head(x)

    return MLP().eval()


def export(module, path: Path, example: dict[str, np.ndarray], outputs: list[str]) -> Path:
    """The TorchScript exporter (node names ``/fc1/Gemm``, weights under their module names)."""
    import torch

    args = tuple(torch.from_numpy(a) for a in example.values())
    names = list(example)
    axes = {n: {0: "batch"} for n in names + outputs}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17,
                          input_names=names, output_names=outputs, dynamic_axes=axes)
    return path


# -- faults on an ONNX file -----------------------------------------------------------------------
def _edit(src: Path, dst: Path, node_name: str, change: Callable) -> Path:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.name == node_name)

    def weight(index: int):
        init = inits[node.input[index]]
        return init, numpy_helper.to_array(init).copy()

    def put(init, array):
        init.CopyFrom(numpy_helper.from_array(array.astype(numpy_helper.to_array(init).dtype),
                                              init.name))

    change(node, weight, put)
    onnx.save(model, str(dst))
    return dst


def perturb_weight(src: Path, dst: Path, node: str, share: float, seed: int) -> Path:
    rng = np.random.default_rng(seed)

    def change(n, weight, put):
        init, w = weight(1)
        put(init, w + share * w.std() * rng.standard_normal(w.shape))

    return _edit(src, dst, node, change)


def shift_bias(src: Path, dst: Path, node: str, share: float, seed: int) -> Path:
    rng = np.random.default_rng(seed)

    def change(n, weight, put):
        init, b = weight(2)
        _, w = weight(1)
        # the layer's output scale ~ |W| rows: shift a quarter of the channels
        scale = float(np.abs(w).sum(axis=-1).mean()) if w.ndim == 2 else float(np.abs(w).mean())
        mask = rng.random(b.shape) < 0.25
        put(init, b + share * scale * mask * np.sign(rng.standard_normal(b.shape)))

    return _edit(src, dst, node, change)


def swap_activation(src: Path, dst: Path, node: str, to: str = "Sigmoid") -> Path:
    def change(n, weight, put):
        n.op_type = to

    return _edit(src, dst, node, change)


def outlier_weight(src: Path, dst: Path, node: str, factor: float) -> Path:
    """The largest weight of a layer made ``factor`` times larger: per-tensor int8 then spends
    its range on one value and rounds the rest of that layer coarsely."""
    def change(n, weight, put):
        init, w = weight(1)
        index = np.unravel_index(np.abs(w).argmax(), w.shape)
        w[index] = np.abs(w).max() * factor
        put(init, w)

    return _edit(src, dst, node, change)


# -- the corpus -----------------------------------------------------------------------------------
def mlp_inputs(n: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1000 + seed).standard_normal((n, 16)).astype(np.float32)}


def _mlp_file(folder: Path, seed: int, **kw) -> tuple[Path, object]:
    module = mlp(seed, **kw)
    tag = "".join(f"_{k}{v}" for k, v in sorted(kw.items()))
    return export(module, folder / f"mlp{seed}{tag}.onnx", mlp_inputs(2, seed), ["y"]), module


def weight_cases(folder: Path, seeds=range(6),
                 shares=(0.001, 0.003, 0.01, 0.03, 0.1)) -> list[FaultCase]:
    """Per seeded MLP, one layer (chosen by the seed) perturbed at each share."""
    out = []
    for seed in seeds:
        clean, _ = _mlp_file(folder, seed)
        layer = f"/fc{1 + seed % 4}/Gemm"
        for share in shares:
            name = f"mlp{seed}-weight-{share:g}"
            prim = perturb_weight(clean, folder / f"{name}.onnx", layer, share, seed)
            out.append(FaultCase(name, "weight", f"mlp{seed}", clean, prim,
                                 mlp_inputs(8, seed), layer, tensor=FP32))
    return out


def small_weight_cases(folder: Path) -> list[FaultCase]:
    """Six small faults near tier 1's defaults: seeded MLPs, one Linear perturbed by 0.5-5%."""
    out = []
    for seed, share in zip(range(6), (0.005, 0.01, 0.02, 0.03, 0.04, 0.05)):
        clean, _ = _mlp_file(folder, seed)
        layer = f"/fc{1 + (seed + 1) % 4}/Gemm"
        name = f"mlp{seed}-small-{share:g}"
        prim = perturb_weight(clean, folder / f"{name}.onnx", layer, share, 100 + seed)
        out.append(FaultCase(name, "weight", f"mlp{seed}", clean, prim, mlp_inputs(8, seed),
                             layer, tensor=FP32))
    return out


def other_fault_cases(folder: Path, seeds=range(4)) -> list[FaultCase]:
    out = []
    for seed in seeds:
        clean, module = _mlp_file(folder, seed)
        inputs = mlp_inputs(8, seed)
        layer = f"/fc{1 + (seed + 2) % 4}/Gemm"
        name = f"mlp{seed}-bias"
        out.append(FaultCase(name, "bias", f"mlp{seed}", clean,
                             shift_bias(clean, folder / f"{name}.onnx", layer, 0.05, seed),
                             inputs, layer, tensor=FP32))
        act = f"/act{1 + seed % 4}/Relu"
        name = f"mlp{seed}-activation"
        out.append(FaultCase(name, "activation", f"mlp{seed}", clean,
                             swap_activation(clean, folder / f"{name}.onnx", act), inputs, act,
                             tensor=FP32))
        layer = f"/fc{2 + seed % 3}/Gemm"
        name = f"mlp{seed}-int8-outlier"
        prim = outlier_weight(clean, folder / f"{name}.onnx", layer, 50.0)
        # The reference is the same outlier model in fp32: the fault is what int8 does to it.
        out.append(FaultCase(name, "int8_outlier", f"mlp{seed}", prim, prim, inputs, layer,
                             precision="int8", tensor=INT8))
        site = 1 + seed % 3
        big = mlp(seed, norm_after=site)
        with _no_grad():
            lin = getattr(big, f"fc{site}")
            lin.weight.mul_(1e5)  # outputs beyond fp16's 65504; the LayerNorm hides it in fp32
            lin.bias.mul_(1e5)
        path = export(big, folder / f"mlp{seed}-fp16-overflow.onnx", mlp_inputs(2, seed), ["y"])
        out.append(FaultCase(f"mlp{seed}-fp16-overflow", "fp16_overflow", f"mlp{seed}", path,
                             path, mlp_inputs(8, seed), f"/fc{site}/Gemm", precision="fp16",
                             tensor=FP16))
        name = f"mlp{seed}-torch-onnx"
        module_path = f"fc{1 + (seed + 3) % 4}"
        prim = perturb_weight(clean, folder / f"{name}.onnx", f"/{module_path}/Gemm", 0.02,
                              seed)
        out.append(FaultCase(name, "torch_onnx", f"mlp{seed}", lambda seed=seed: mlp(seed),
                             prim, inputs, module_path, tensor=FP32, input_names=["x"]))
    return out


def clean_cases(folder: Path, seeds=range(2)) -> list[FaultCase]:
    out = []
    for seed in seeds:
        clean, _ = _mlp_file(folder, seed)
        inputs = mlp_inputs(8, seed)
        out.append(FaultCase(f"mlp{seed}-clean-fp32", "clean", f"mlp{seed}", clean, clean,
                             inputs, None, tensor=FP32))
        out.append(FaultCase(f"mlp{seed}-clean-torch-onnx", "clean", f"mlp{seed}",
                             lambda seed=seed: mlp(seed), clean, inputs, None, tensor=FP32,
                             input_names=["x"]))
        out.append(FaultCase(f"mlp{seed}-clean-int8", "clean", f"mlp{seed}", clean, clean,
                             inputs, None, precision="int8", tensor=INT8))
        out.append(FaultCase(f"mlp{seed}-clean-fp16", "clean", f"mlp{seed}", clean, clean,
                             inputs, None, precision="fp16", tensor=FP16))
    clean, _ = _mlp_file(folder, 0)
    out.append(FaultCase("mlp0-clean-threads", "clean", "mlp0", clean, clean, mlp_inputs(8, 0),
                         None, tensor=FP32, primary_threads=2))
    return out


def zoo_cnn_cases(folder: Path) -> list[FaultCase]:
    from guard.zoo import classifier

    paths = classifier.export(folder / "zoo")
    clean = paths["onnx"]
    inputs = {"image": classifier.sample_inputs(4, seed=5)}
    out = [FaultCase("cnn-clean-fp32", "clean", "zoo-cnn", clean, clean, inputs, None),
           FaultCase("cnn-clean-threads", "clean", "zoo-cnn", clean, clean, inputs, None,
                     primary_threads=2)]
    for node, share in (("node_conv2d", 0.01), ("node_conv2d_1", 0.03), ("node_linear", 0.01),
                        ("node_Gemm_8", 0.1)):
        name = f"cnn-weight-{node}-{share:g}"
        out.append(FaultCase(name, "weight", "zoo-cnn", clean,
                             perturb_weight(clean, folder / f"{name}.onnx", node, share, 7),
                             inputs, node, tensor=FP32))
    return out


def real_cases(folder: Path) -> list[FaultCase]:
    """MiniLM (its ONNX export, MatMul weights perturbed). Empty without the package."""
    try:
        from guard.zoo import minilm
        paths = minilm.export(folder / "minilm")
    except Exception:
        return []
    import onnx

    clean = paths["onnx"]
    inputs = minilm.sample_inputs(4)
    graph = onnx.load(str(clean), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    matmuls = [n.name for n in graph.node
               if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits]
    out = [FaultCase("minilm-clean-fp32", "clean", "minilm", clean, clean, inputs, None)]
    picks = [matmuls[i] for i in (0, len(matmuls) // 3, len(matmuls) // 2, -1)]
    for i, (node, share) in enumerate(zip(picks, (0.01, 0.03, 0.1, 0.03))):
        name = f"minilm-weight-{i}-{share:g}"
        out.append(FaultCase(name, "weight", "minilm", clean,
                             perturb_weight(clean, folder / f"{name}.onnx", node, share, i),
                             inputs, node, tensor=FP32))
    return out


def silero_cases(folder: Path) -> list[FaultCase]:
    """silero-vad's ONNX (16 kHz network) vs itself with one weight changed, and clean pairs.
    Empty without the package."""
    try:
        from guard.zoo import silero_vad
        clean = silero_vad.export(folder / "silero_vad")["onnx"]
        inputs = silero_vad.sample_inputs(8)
    except Exception:
        return []
    out = [FaultCase("vad-clean-fp32", "clean", "silero_vad", clean, clean, inputs, None),
           FaultCase("vad-clean-threads", "clean", "silero_vad", clean, clean, inputs, None,
                     primary_threads=2)]
    # encoder convolutions, the LSTM cell's input and hidden Gemms, the decoder convolution
    for i, (node, share) in enumerate((("node_conv1d_1", 0.001), ("node_conv1d_2", 0.01),
                                       ("node_conv1d_3", 0.03), ("node_conv1d_4", 0.1),
                                       ("node_linear_1", 0.01), ("node_linear", 0.03),
                                       ("node_conv1d_5", 0.001))):
        name = f"vad-weight-{node}-{share:g}"
        out.append(FaultCase(name, "weight", "silero_vad", clean,
                             perturb_weight(clean, folder / f"{name}.onnx", node, share, 20 + i),
                             inputs, node, tensor=FP32))
    name = "vad-bias-node_conv1d_2"
    out.append(FaultCase(name, "bias", "silero_vad", clean,
                         shift_bias(clean, folder / f"{name}.onnx", "node_conv1d_2", 0.05, 3),
                         inputs, "node_conv1d_2", tensor=FP32))
    return out


# -- the field's architectures: faults in leaf modules at every depth ---------------------------
# Per family: (module, tensor, share) faults (weights 0.1-10%, a LayerNorm's gamma, a
# BatchNorm's statistics, an attention projection, a bias), the exporters its torch-vs-ONNX
# cases use, and whether it gets fp16 cases. guard.zoo.layouts' hand-written encoder and
# torchvision-layout ResNet, and guard.zoo.families' transformers models built from configs.
LAYOUT_FAULTS = {
    "encoder": (("blocks.1.attn.q", "weight", 0.02), ("blocks.0.mlp.fc2", "weight", 0.01),
                ("blocks.0.ln2", "weight", 0.03), ("blocks.1.attn.v", "bias", 0.1),
                ("blocks.0.attn.out", "weight", 0.005), ("head", "weight", 0.03)),
    "resnet": (("layer2.0.conv1", "weight", 0.02), ("layer3.1.conv2", "weight", 0.01),
               ("layer1.0.bn1", "running_var", 0.03), ("layer2.0.downsample.0", "weight", 0.03),
               ("conv1", "weight", 0.005), ("fc", "weight", 0.03)),
    # an nn.GRU / nn.LSTM the exporter turns into one ONNX op: aligned as one unit
    "gru": (("rnn", "weight_hh_l0", 0.03), ("rnn", "weight_ih_l0", 0.01),
            ("rnn", "bias_hh_l0", 0.1), ("embed", "weight", 0.02), ("head", "weight", 0.03)),
    "lstm": (("rnn", "weight_hh_l0", 0.03), ("rnn", "weight_ih_l0", 0.01),
             ("rnn", "bias_ih_l0", 0.1), ("embed", "weight", 0.02), ("head", "weight", 0.03)),
}
FAMILY_FAULTS = {
    "bert": (("model.bert.encoder.layer.1.attention.self.query", "weight", 0.02),
             ("model.bert.encoder.layer.0.output.LayerNorm", "weight", 0.03),
             ("model.bert.encoder.layer.0.intermediate.dense", "bias", 0.1),
             ("model.classifier", "weight", 0.01)),
    "vit": (("model.vit.layers.1.attention.q_proj", "weight", 0.02),
            ("model.vit.layers.0.mlp.fc2", "weight", 0.005),
            ("model.vit.layers.0.layernorm_before", "weight", 0.03),
            ("model.vit.embeddings.patch_embeddings.projection", "weight", 0.01)),
    "hf_resnet": (("model.resnet.encoder.stages.1.layers.0.layer.0.convolution", "weight", 0.02),
                  ("model.resnet.encoder.stages.0.layers.0.layer.1.normalization",
                   "running_var", 0.05),
                  ("model.resnet.embedder.embedder.convolution", "weight", 0.003),
                  ("model.classifier.1", "weight", 0.03)),
    "convnext": (("model.convnext.encoder.stages.1.layers.0.pwconv1", "weight", 0.02),
                 ("model.convnext.encoder.stages.0.layers.0.dwconv", "weight", 0.01),
                 ("model.convnext.encoder.stages.1.layers.0.layernorm", "weight", 0.03),
                 ("model.classifier", "weight", 0.1)),
    "mobilenet_v2": (("model.mobilenet_v2.layer.5.conv_3x3.convolution", "weight", 0.02),
                     ("model.mobilenet_v2.layer.10.expand_1x1.normalization", "running_var",
                      0.05),
                     ("model.classifier", "weight", 0.01)),
    "whisper_encoder": (("model.layers.1.self_attn.k_proj", "weight", 0.02),
                        ("model.conv2", "weight", 0.01), ("model.layers.0.fc1", "bias", 0.1),
                        ("model.layer_norm", "weight", 0.03)),
    "llama": (("model.model.layers.1.self_attn.v_proj", "weight", 0.02),
              ("model.model.layers.0.mlp.up_proj", "weight", 0.01),
              ("model.model.layers.1.post_attention_layernorm", "weight", 0.03),
              ("model.lm_head", "weight", 0.005)),
}
FAMILIES = tuple(LAYOUT_FAULTS) + tuple(FAMILY_FAULTS) + ("encoder_ort",)
EXPORTERS = ("torchscript", "dynamo")
# MobileNetV2's dynamo export takes ~1 min a file here: the TorchScript exporter's alone.
_FAMILY_EXPORTERS = {"mobilenet_v2": ("torchscript",)}
_FP16_FAMILIES = ("encoder", "resnet", "bert", "vit", "hf_resnet")


def _family(family: str):
    """(factory of the seeded module, its inputs)."""
    from guard.zoo import families, layouts

    if family == "encoder":
        return layouts.encoder, layouts.encoder_inputs(4, seed=1)
    if family == "resnet":
        return layouts.resnet, layouts.resnet_inputs(4, seed=1)
    if family in ("gru", "lstm"):
        return functools.partial(layouts.recurrent, family), layouts.recurrent_inputs(4, seed=1)
    return families.BUILDERS[family], families.inputs(family)


def true_node(clean: Path, primary: Path) -> str | None:
    """The first node, in graph order, that reads a weight the primary changed (through the
    TorchScript exporter's Identity nodes, which it adds where weights were equal and so
    shared: a bias of zeros): the layer an ONNX-vs-ONNX comparison should name."""
    import onnx
    from onnx import numpy_helper

    a, b = onnx.load(str(clean)).graph, onnx.load(str(primary)).graph
    theirs = {i.name: numpy_helper.to_array(i) for i in b.initializer}
    changed = {i.name for i in a.initializer
               if i.name in theirs and not np.array_equal(numpy_helper.to_array(i), theirs[i.name])}
    changed |= {i.name for i in b.initializer if i.name not in {j.name for j in a.initializer}}
    for node in b.node:  # the primary's graph: the changed weight is its own initializer there
        if changed & set(node.input):
            if node.op_type == "Identity":  # the exporter's weight plumbing (deduplication)
                changed.update(node.output)
                continue
            return node.name
    return None


def _kind(module: str, tensor: str) -> str:
    if tensor == "running_var":
        return "bn_stats"
    if tensor.startswith("bias"):
        return "bias"
    leaf = module.split(".")[-1].lower()
    return "norm_gamma" if "norm" in leaf or leaf.startswith("ln") else "weight"


def family_cases(folder: Path, families=("encoder", "resnet"), exporters=EXPORTERS,
                 faults: dict | None = None, onnx_pairs: bool = True, clean: bool = True,
                 fp16: bool = False) -> list[FaultCase]:
    """Per family and exporter: the torch eager module as reference vs the ONNX export of a
    copy with one leaf module's tensor changed (``true_layer``: the module path), the same
    fault ONNX vs ONNX (the clean export as reference; ``true_layer``: the node that reads the
    changed weight), and the clean pair torch vs its export. With ``fp16``: the first fault and
    the clean export, ONNX vs their fp16 variants, for the families in ``_FP16_FAMILIES``."""
    from guard.zoo import layouts

    faults = faults or {**LAYOUT_FAULTS, **FAMILY_FAULTS}
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for family in families:
        build, inputs = _family(family)
        model = build()
        for exporter in [e for e in exporters if e in _FAMILY_EXPORTERS.get(family, EXPORTERS)]:
            dynamo = exporter == "dynamo"
            tag = f"{family}-{exporter}"
            base = layouts.export(model, folder / f"{tag}.onnx", inputs, dynamo=dynamo)
            if clean:
                out.append(FaultCase(f"{tag}-clean-torch-onnx", "clean", tag, build, base,
                                     inputs, None, tensor=FP32, input_names=list(inputs)))
            for i, (module, tensor, share) in enumerate(faults[family]):
                name = f"{tag}-{module}.{tensor}-{share:g}"
                broken = layouts.perturbed(model, module, share, seed=i, tensor=tensor)
                prim = layouts.export(broken, folder / f"{name}.onnx", inputs, dynamo=dynamo)
                kind = _kind(module, tensor)
                out.append(FaultCase(f"{name}-torch", kind, tag, build, prim, inputs, module,
                                     tensor=FP32, input_names=list(inputs)))
                if onnx_pairs:
                    node = true_node(base, prim)
                    out.append(FaultCase(f"{name}-onnx", kind, tag, base, prim, inputs, node,
                                         tensor=FP32))
                    if fp16 and i == 0 and family in _FP16_FAMILIES:
                        out.append(FaultCase(f"{name}-onnx-fp16", kind, tag, base, prim, inputs,
                                             node, precision="fp16", tensor=FP16))
            if fp16 and clean and family in _FP16_FAMILIES:
                out.append(FaultCase(f"{tag}-clean-fp16", "clean", tag, base, base, inputs,
                                     None, precision="fp16", tensor=FP16))
    return out


def layout_cases(folder: Path, families=("encoder", "resnet"), **kw) -> list[FaultCase]:
    """The hand-written layouts' cases (guard.zoo.layouts), as family_cases builds them."""
    return family_cases(folder, families, **kw)


# -- a runtime-optimised primary: q/k/v packed into one Attention node ---------------------------
# ONNX Runtime's transformer optimiser (onnxruntime.transformers.optimizer, the fusions alone:
# opt_level 0, so the file does not depend on this CPU) on the hand-written encoder's export:
# model_type "clip" is the pattern set that fuses a pre-norm attention without a mask (the
# "bert" one expects a mask input and fuses none here). It fuses the second block's attention
# (q, k, v and the attention's own code) into one Attention node whose weight packs the three
# projections', folds each Linear's bias, the residual add and the next LayerNorm into
# SkipLayerNormalization, and GELU with fc1's bias into BiasGelu. The first block's attention,
# whose LayerNorm reads the embedding directly, stays unfused. A user who serves the optimised
# file as the primary keeps the plain export, or the torch module, as the reference.
PACKED_FAMILY = "encoder_ort"
PACKED_FAULTS = (("blocks.1.attn.q", "weight", 0.02), ("blocks.1.attn.k", "weight", 0.005),
                 ("blocks.1.attn.v", "bias", 0.1), ("blocks.1.ln1", "weight", 0.03),
                 ("blocks.0.mlp.fc2", "weight", 0.01), ("blocks.0.attn.q", "weight", 0.02))


def ort_optimised(path: Path, heads: int = 4, hidden: int = 32,
                  model_type: str = "clip") -> Path:
    """``path`` through ONNX Runtime's transformer optimiser, saved beside it (``-ort.onnx``)."""
    from onnxruntime.transformers import optimizer

    out = path.with_name(path.stem + "-ort.onnx")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = optimizer.optimize_model(str(path), model_type=model_type, num_heads=heads,
                                         hidden_size=hidden, opt_level=0)
        model.save_model_to_file(str(out))
    return out


def packed_attention_cases(folder: Path, exporters=EXPORTERS, faults=PACKED_FAULTS,
                           clean: bool = True, onnx_pairs: bool = True) -> list[FaultCase]:
    """Per exporter: the encoder's torch module (and its plain export, ONNX vs ONNX) as the
    reference, the optimised export of a copy with one module changed as the primary, and the
    clean pairs. ``true_layer``: the module, or the node of the plain export reading the
    changed weight; a unit that lists it counts (``blocks.1.attn.{q,k,v}``)."""
    from guard.zoo import layouts

    folder.mkdir(parents=True, exist_ok=True)
    build, inputs = _family("encoder")
    model = build()
    out = []
    for exporter in exporters:
        dynamo = exporter == "dynamo"
        tag = f"{PACKED_FAMILY}-{exporter}"
        base = layouts.export(model, folder / f"{tag}.onnx", inputs, dynamo=dynamo)
        packed = ort_optimised(base)
        if clean:
            out.append(FaultCase(f"{tag}-clean-torch-onnx", "clean", tag, build, packed, inputs,
                                 None, tensor=FP32, input_names=list(inputs)))
            if onnx_pairs:
                out.append(FaultCase(f"{tag}-clean-onnx", "clean", tag, base, packed, inputs,
                                     None, tensor=FP32))
        for i, (module, tensor, share) in enumerate(faults):
            name = f"{tag}-{module}.{tensor}-{share:g}"
            broken = layouts.perturbed(model, module, share, seed=i, tensor=tensor)
            plain = layouts.export(broken, folder / f"{name}.onnx", inputs, dynamo=dynamo)
            prim = ort_optimised(plain)
            kind = _kind(module, tensor)
            out.append(FaultCase(f"{name}-torch", kind, tag, build, prim, inputs, module,
                                 tensor=FP32, input_names=list(inputs)))
            if onnx_pairs:
                out.append(FaultCase(f"{name}-onnx", kind, tag, base, prim, inputs,
                                     true_node(base, plain), tensor=FP32))
    return out


# -- eager vs torch.compile ----------------------------------------------------------------------
INDUCTOR = {"backend": "inductor"}


def compiled_cases(families=("encoder", "resnet"), faults: dict | None = None,
                   clean: bool = True) -> list[FaultCase]:
    """Per hand-written layout: the eager module as the reference, a copy with one leaf's
    tensor changed (LAYOUT_FAULTS) under torch.compile (inductor) as the primary, and the clean
    module compiled. Nothing is exported; ``true_layer`` is the module path."""
    from guard.zoo import layouts

    faults = faults or LAYOUT_FAULTS
    out = []
    for family in families:
        build, inputs = _family(family)
        tag = f"compiled-{family}"
        if clean:
            out.append(FaultCase(f"{tag}-clean", "clean", tag, build, build, inputs, None,
                                 tensor=FP32, input_names=list(inputs), compiled=INDUCTOR))
        for i, (module, tensor, share) in enumerate(faults[family]):
            def broken(build=build, module=module, tensor=tensor, share=share, i=i):
                return layouts.perturbed(build(), module, share, seed=i, tensor=tensor)

            out.append(FaultCase(f"{tag}-{module}.{tensor}-{share:g}", _kind(module, tensor),
                                 tag, build, broken, inputs, module, tensor=FP32,
                                 input_names=list(inputs), compiled=INDUCTOR))
    return out


# -- GGUF engines: llama.cpp's graph against the transformers reference -------------------------
# SmolLM2-135M (guard.zoo.llm): the shipped Q4_1 dequantized by transformers (fp32) as the
# reference; as the primary, llama.cpp on the shipped file with one tensor requantized to a much
# lower type or perturbed (``W + share * std(W) * N(0, 1)``, stored F32), and clean pairs: the
# shipped file itself, its F16 and Q8_0 requantizations (every layer changed alike: no one layer
# broken). K-quants need 256-wide rows: only ffn_down (1536) takes Q2_K/Q3_K here.
GGUF_TEXT = ("The capital of France is Paris. The largest planet in our solar system is "
             "Jupiter, and the")
GGUF_FAULTS = (
    ("blk.3.ffn_down.weight", "Q2_K"), ("blk.17.ffn_down.weight", "Q2_K"),
    ("blk.26.ffn_down.weight", "Q3_K"),
    ("blk.5.attn_k.weight", 0.1), ("blk.0.attn_q.weight", 0.1), ("blk.25.attn_v.weight", 0.2),
    ("blk.20.attn_output.weight", 0.1), ("blk.12.ffn_gate.weight", 0.1),
    ("blk.14.ffn_up.weight", 0.1), ("blk.8.attn_norm.weight", 0.05),
    ("blk.22.ffn_norm.weight", 0.05),
)
GGUF_CLEAN = ("Q4_1", "F16", "Q8_0")
# llama.cpp's weight names -> transformers' module (model.layers.N.<this>).
_GGUF_MODULES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_module(tensor: str) -> str:
    """``blk.3.ffn_down.weight`` -> ``model.layers.3.mlp.down_proj``."""
    _, block, name, _ = tensor.split(".")
    return f"model.layers.{block}.{_GGUF_MODULES[name]}"


def gguf_ids(path: Path, text: str = GGUF_TEXT) -> np.ndarray:
    """``text`` as llama.cpp tokenizes it for this GGUF (BOS first): ``[1, T]`` int64."""
    import llama_cpp
    from llama_cpp import _internals

    from guard.backends.llama_cpp import quiet_llama_logs

    quiet_llama_logs()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
    try:
        return np.asarray([model.tokenize(text.encode(), True, False)], dtype=np.int64)
    finally:
        model.close()


def gguf_cases(faults=GGUF_FAULTS, clean=GGUF_CLEAN) -> list[FaultCase]:
    """SmolLM2's GGUF cases (cached files, guard.zoo.llm); empty without the model's wheel,
    llama-cpp-python or transformers."""
    try:
        import llama_cpp  # noqa: F401
        import transformers  # noqa: F401

        from guard.zoo import llm
        shipped = llm.smollm2_gguf()
    except (ImportError, FileNotFoundError):
        return []
    inputs = {"input_ids": gguf_ids(shipped)}
    ladder = llm.quant_ladder(tuple(r for r in clean if r != llm.SHIPPED))
    out = [FaultCase(f"gguf-clean-{rung}", "clean", "smollm2-gguf", shipped,
                     shipped if rung == llm.SHIPPED else ladder[rung], inputs, None,
                     precision=f"gguf {rung}", gguf=True) for rung in clean]
    for tensor, change in faults:
        if isinstance(change, str):
            primary, kind = llm.one_tensor_requantized(tensor, change), "requantized"
        else:
            primary, kind = llm.one_tensor_perturbed(tensor, change), "weight"
        out.append(FaultCase(f"gguf-{tensor}-{change}", kind, "smollm2-gguf", shipped, primary,
                             inputs, gguf_module(tensor), precision=f"gguf {llm.SHIPPED}",
                             gguf=True))
    return out


@functools.lru_cache(maxsize=2)
def _transformers_module(path: str):
    """The reference model of a GGUF, loaded once per process (each case's side wraps it)."""
    from guard.backends.onednn_linear import with_torch_kernels
    from guard.backends.transformers import TransformersScorer
    from guard.config import BackendConfig

    scorer = TransformersScorer(with_torch_kernels(BackendConfig(backend="transformers",
                                                                 path=path)), "reference")
    scorer.load()
    return scorer.model


def _gguf_checker(case: FaultCase, top_k: int):
    from guard.backends.activations.llama_cpp import LlamaCppSide
    from guard.backends.activations.transformers import TransformersSide
    from guard.config import ActivationCheckConfig, TensorCheckConfig
    from guard.verify.activation import ActivationChecker

    reference = TransformersSide(_transformers_module(str(case.reference)), label="reference")
    primary = LlamaCppSide(case.file("primary"), label="primary")
    config = ActivationCheckConfig(on_failure=True, top_k=top_k)
    return ActivationChecker(config, reference, primary, tensor=TensorCheckConfig(**case.tensor))


# A batch of the zoo detector on which torch's sort and ONNX Runtime's TopK order the tied
# candidates (scores capped at 1.0) differently (row 2 of sample_inputs(16, seed=5) on the
# x86-64 machines measured); whether they do on another CPU, the pair is clean either way.
NMS_TIE_SEED, NMS_TIE_ROWS = 5, [0, 1, 2, 3]


def nms_clean_case(folder: Path) -> FaultCase:
    """The zoo detector, torch vs its ONNX export, tied scores broken in another order: the
    raw outputs differ, the ``stable_nms`` adapter resolves it, and nothing is to be blamed."""
    from guard.zoo import detector

    paths = detector.export(folder / "detector")
    image = detector.sample_inputs(16, seed=NMS_TIE_SEED)[NMS_TIE_ROWS]
    return FaultCase("det-clean-nms-ties", "clean", "detector", lambda: detector.build(),
                     paths["onnx"], {"image": image}, None, tensor=FP32,
                     input_names=["image"], adapters=list(detector.ADAPTERS))


def tier1_for(case: FaultCase) -> tuple[object, bool] | None:
    """Tier 1 as the Comparator runs it for a case with adapters: both sides' outputs through the
    model's adapters, then compared at the case's tolerances. Returns (the ``TensorCheck``,
    whether the raw outputs, without adapters, would pass); None without adapters."""
    if not case.adapters:
        return None
    import onnxruntime as ort

    from guard.verify.adapters import build_adapter
    from guard.verify.tensor import Tolerance, compare_outputs

    session = ort.InferenceSession(str(case.primary), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    prim = dict(zip(names, session.run(None, case.inputs)))
    if case.onnx_pair:
        ref_session = ort.InferenceSession(str(case.reference),
                                           providers=["CPUExecutionProvider"])
        ref = dict(zip(names, ref_session.run(names, case.inputs)))
    else:
        import torch

        with torch.no_grad():
            result = case.factory("reference")()(*(torch.from_numpy(case.inputs[n])
                                        for n in case.input_names))
        result = result if isinstance(result, (tuple, list)) else (result,)
        ref = {n: t.numpy() for n, t in zip(names, result)}
    tolerance = Tolerance(case.tensor.get("atol", 1e-4), case.tensor.get("rtol", 1e-3))
    raw = compare_outputs(ref, prim, tolerance)
    for item in case.adapters:
        (adapter, options), = (item.items() if isinstance(item, dict) else ((item, {}),))
        chain = build_adapter(adapter, options)
        ref, prim = chain.apply(ref), chain.apply(prim)
    return compare_outputs(ref, prim, tolerance), raw.passed


def check(case: FaultCase, checker=None):
    """Tier 2 on one case, with tier 1's verdict where the case has adapters (as the mirror
    worker passes it). Closes the checker it builds."""
    own = checker is None
    checker = checker or checker_for(case)
    try:
        tier1 = tier1_for(case)
        return checker.check(case.inputs, tier1=tier1[0] if tier1 else None)
    finally:
        if own:
            checker.close()


@contextlib.contextmanager
def _no_grad():
    import torch

    with torch.no_grad():
        yield


def corpus(folder: str | Path, real: bool = True, families: bool = True,
           compiled: bool = True, gguf: bool = True) -> list[FaultCase]:
    """``families``: the field's architectures too (the transformers ones where it is
    installed; the recurrent classifiers among them); ``compiled``: eager vs torch.compile on
    the hand-written layouts; ``gguf``: SmolLM2's GGUF run by llama.cpp against transformers
    (where the llm extra and the model's wheel are installed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cases = (weight_cases(folder) + small_weight_cases(folder) + other_fault_cases(folder)
             + clean_cases(folder) + zoo_cnn_cases(folder) + [nms_clean_case(folder)])
    cases += (real_cases(folder) + silero_cases(folder)) if real else []
    if families:
        names = tuple(LAYOUT_FAULTS)
        try:
            import transformers  # noqa: F401

            names += tuple(FAMILY_FAULTS)
        except ImportError:
            pass
        cases += family_cases(folder / "families", names, fp16=True)
        cases += packed_attention_cases(folder / "packed")
    if compiled:
        cases += compiled_cases()
    if gguf:
        cases += gguf_cases()
    return cases


# -- running a case through tier 2 ----------------------------------------------------------------
def checker_for(case: FaultCase, top_k: int = 50):
    """Tier 2 for one case, as ``on_failure`` builds it, every activation key at its default."""
    from guard.config import ActivationCheckConfig, TensorCheckConfig
    from guard.verify.activation import ActivationChecker
    from guard.backends.activations.onnx import OnnxSide
    from guard.backends.activations.torch import TorchSide

    if case.gguf:
        return _gguf_checker(case, top_k)
    primary: Side
    reference: Side
    if case.compiled is not None:
        from guard.backends.activations.compiled import CompiledTorchSide

        primary = CompiledTorchSide(case.factory("primary")(), case.input_names, case.compiled,
                                    label="primary")
    elif case.precision != "fp32":
        primary = OnnxSide(case.primary_variant(), source_path=case.file("primary"),
                           label="primary")
    else:
        primary = OnnxSide(case.file("primary"), label="primary", threads=case.primary_threads)
    if case.onnx_pair:
        reference = OnnxSide(case.file("reference"), label="reference")
    else:
        reference = TorchSide(case.factory("reference")(), case.input_names, label="reference")
    config = ActivationCheckConfig(on_failure=True, top_k=top_k)
    return ActivationChecker(config, reference, primary, tensor=TensorCheckConfig(**case.tensor))


def rank_of_true_layer(case: FaultCase, report) -> int | None:
    """1 when tier 2 names the broken layer (or the unit holding it), 2 when it is the first
    suspect after that..., None when it is not among them."""
    names = ranked_names(report)
    return next((i + 1 for i, n in enumerate(names) if case.names_true_layer(n)), None)


def ranked_names(report) -> list[str]:
    """The first divergence, then the suspects by isolated error over allowance."""
    names = [report.first_divergence.name] if report.first_divergence else []
    return names + [s.name for s in report.suspects if s.name not in names]
