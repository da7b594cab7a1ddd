"""silero-vad (``silero-vad`` 6.x, MIT): a real streaming voice-activity model shipped both as
TorchScript (``silero_vad.jit``) and as ONNX (``silero_vad*.onnx``) with the same weights.

One inference is one step of a stream at 16 kHz, with the LSTM state passed explicitly on
both sides:

- inputs: ``input`` FP32 [-1, 576] (the previous chunk's last 64 samples, then 512 new samples:
  what the network itself takes; the package's wrappers keep that context internally),
  ``state`` FP32 [-1, 2, 128] (the recurrent state, zeros at the start of a stream);
- outputs: ``output`` FP32 [-1, 1] (speech probability of the chunk), ``stateN`` FP32
  [-1, 2, 128] (the state for the next chunk).

The package's tensors put the batch second (``state`` [2, batch, 128]); guard splits and
batches on the first axis, so both sides get the same thin adapter. Torch
(``guard.zoo.silero_vad:build``) calls the jit's inner 16 kHz network (stateless:
``forward(x, state) -> (prob, state)``; the jit's outer ``forward`` keeps its state in
attributes) between two transposes. ONNX is the package's ``silero_vad_op18_ifless.onnx`` with
its 16 kHz branch lifted out of the ``If`` on the sample rate (``quantize_dynamic`` does not
look into subgraphs: left inside, guard's int8 variant would be the fp32 model unchanged) and a
``Transpose`` on the state in and out. No ``sr`` input: the 8 kHz network (the other branch) is
not part of this entry. Every weight and every other node is the package's.

Inputs: a deterministic synthetic signal (silence, voiced "syllables" from a glottal pulse train
through vowel formants, noise), cut into consecutive chunks; each row's state is the state the
jit reference reaches after the chunks before it, so every row is a genuine step of the stream.
``import silero_vad`` is avoided: it sets torch to one thread process-wide; the files are found
through the package's import spec instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import cast

import numpy as np

from guard.backends.base import TensorSpec

NAME = "silero_vad"
TASK = "generic"
RATE, CHUNK, CONTEXT = 16000, 512, 64
INPUTS = [TensorSpec("input", "FP32", (-1, CONTEXT + CHUNK)),
          TensorSpec("state", "FP32", (-1, 2, 128))]
# The package's opset-18 ONNX whose branches hold no further If (silero_vad.onnx nests them).
ONNX_FILE = "silero_vad_op18_ifless.onnx"
OUTPUTS = [TensorSpec("output", "FP32", (-1, 1)), TensorSpec("stateN", "FP32", (-1, 2, 128))]


def data_dir() -> Path:
    from guard.zoo import ZooExtraMissing
    from guard.zoo.real import INSTALL, PACKAGES

    try:
        spec = importlib.util.find_spec("silero_vad")
    except (ImportError, ValueError):  # ValueError: a module entry without a spec
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ZooExtraMissing(
            f"zoo model '{NAME}' needs the package {PACKAGES[NAME]}, which is not installed: "
            f"{INSTALL} (or pip install '{PACKAGES[NAME]}')")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    for name in ("silero_vad.jit", ONNX_FILE):
        if not (folder / name).exists():
            raise FileNotFoundError(f"the silero_vad package ships no data/{name}")
    return folder


def build():
    """The torch side: the package's TorchScript with the state fed and returned explicitly."""
    import json

    import torch

    from guard.backends.torch import signature_json

    jit = torch.jit.load(str(data_dir() / "silero_vad.jit"), map_location="cpu")

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vad = jit

        def forward(self, input, state):
            prob, new_state = self.vad._model(input, state.transpose(0, 1).contiguous())
            return prob, new_state.transpose(0, 1)

    model = Step().eval()
    model.guard_signature = json.loads(signature_json(INPUTS, OUTPUTS))
    return model


def _rename_inputs(graph, names: dict[str, str]) -> None:
    """Rename what nodes read (the 16 kHz branch reads the outer graph's names)."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """``{"onnx": folder/silero_vad.onnx}``: the package's 16 kHz network with the adapter."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}.onnx"
    if path.exists():
        return {"onnx": path}
    model = onnx.load(str(data_dir() / ONNX_FILE))
    graph = model.graph
    # The graph is one If on (sr == constant): pick the branch that runs at 16 kHz.
    branch_if = graph.node[-1]
    equal = next(n for n in graph.node if n.op_type == "Equal")
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    rate = next(int(values[name].reshape(-1)[0]) for name in equal.input if name in values)
    branches = {a.name: a.g for a in branch_if.attribute}
    branch = branches["then_branch" if rate == RATE else "else_branch"]
    if branch_if.op_type != "If" or rate not in (RATE, 8000):
        raise ValueError(f"{ONNX_FILE}: not the If-on-sample-rate graph this adapter expects")
    _rename_inputs(branch, {"state": "state_lbh"})
    nodes = [helper.make_node("Transpose", ["state"], ["state_lbh"], perm=[1, 0, 2],
                              name="guard/state_in")]
    nodes += list(branch.node)
    first, second = (o.name for o in branch.output)
    nodes += [helper.make_node("Identity", [first], ["output"], name="guard/output"),
              helper.make_node("Transpose", [second], ["stateN"], perm=[1, 0, 2],
                               name="guard/state_out")]
    used = {i for n in nodes for i in n.input}
    initializers = [i for i in graph.initializer if i.name in used] + list(branch.initializer)
    new_graph = helper.make_graph(
        nodes, "silero_vad_16k",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", CONTEXT + CHUNK]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, ["batch", 2, 128])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, ["batch", 2, 128])],
        initializers)
    out = helper.make_model(new_graph, opset_imports=list(model.opset_import),
                            producer_name="guard.zoo.silero_vad")
    out.ir_version = model.ir_version
    onnx.checker.check_model(out)
    partial = path.with_suffix(".onnx.partial")
    onnx.save(out, str(partial))
    partial.replace(path)
    return {"onnx": path}


def signal(seconds: float, seed: int = 0) -> np.ndarray:
    """A deterministic 16 kHz test signal: silence, voiced syllables, pauses and noise bursts."""
    rng = np.random.default_rng(seed)
    out = []
    total = int(seconds * RATE)
    t_done = 0
    while t_done < total:
        kind = rng.choice(["silence", "speech", "speech", "noise"])
        length = int(rng.uniform(0.2, 0.8) * RATE)
        t = np.arange(length) / RATE
        if kind == "silence":
            seg = 0.001 * rng.standard_normal(length)
        elif kind == "noise":
            seg = 0.05 * rng.standard_normal(length)
        else:
            f0 = rng.uniform(100, 220) * (1 + 0.1 * np.sin(2 * np.pi * 3 * t))
            phase = 2 * np.pi * np.cumsum(f0) / RATE
            source = cast(np.ndarray, sum(np.sin(k * phase) / k for k in range(1, 30)))
            formants = rng.choice([(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240),
                                   (530, 1840, 2480), (660, 1720, 2410)])
            seg = cast(np.ndarray, sum(_resonate(source, f, 80 + 0.05 * f) for f in formants))
            seg *= 0.3 * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) / (np.abs(seg).max() + 1e-9)
            seg += 0.002 * rng.standard_normal(length)
        out.append(seg)
        t_done += length
    return np.concatenate(out)[:total].astype(np.float32)


def _resonate(x: np.ndarray, freq: float, bandwidth: float) -> np.ndarray:
    """A two-pole resonator (one vowel formant)."""
    from scipy.signal import lfilter

    r = np.exp(-np.pi * bandwidth / RATE)
    return lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * freq / RATE), r * r], x)


def chunks(audio: np.ndarray) -> np.ndarray:
    """[n, 576]: each 512-sample chunk after the 64 samples before it (zeros before the start)."""
    padded = np.concatenate([np.zeros(CONTEXT, np.float32), audio])
    n = len(audio) // CHUNK
    return np.stack([padded[i * CHUNK:i * CHUNK + CONTEXT + CHUNK] for i in range(n)])


def sample_inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` consecutive steps of one stream, each with the state the jit reaches before it."""
    import torch

    frames = chunks(signal((n * CHUNK + 1) / RATE, seed))[:n]
    model = build()
    states = np.zeros((n, 2, 128), np.float32)
    state = torch.zeros(1, 2, 128)
    with torch.inference_mode():
        for i in range(n):
            states[i] = state[0].numpy()
            _, state = model(torch.from_numpy(frames[i:i + 1]), state)
    return {"input": frames, "state": states}
