"""``transformers`` ``options.onednn_linear`` (on by default): a CPU fp32 reference's linear
layers run by oneDNN score what torch's own modules score, within summation-order noise, and
tier 2's copy of the model keeps torch's modules (it hooks and re-runs them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
if not torch.backends.mkldnn.is_available():  # pragma: no cover - depends on the torch build
    pytest.skip("this torch is built without oneDNN", allow_module_level=True)

from guard.backends import create_backend, onednn_linear  # noqa: E402
from guard.backends.onednn_linear import OneDnnLinear, unusable, use_onednn_linears  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.zoo import llm  # noqa: E402


@pytest.mark.parametrize("pointwise", [True, False], ids=["inductors-ops", "public-op"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24), (1, 1, 24)])
def test_a_replaced_linear_computes_what_torchs_does(bias, shape, pointwise, monkeypatch):
    """Both paths: inductor's oneDNN ops where this torch has them (it does: see below), the
    public mkldnn_linear where it does not."""
    monkeypatch.setattr(onednn_linear, "_pointwise_works", lambda: pointwise)
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape, generator=generator)
    with torch.inference_mode():
        expected = linear(x)
        replaced = OneDnnLinear(linear)
        got = replaced(x)
        # a strided view in (a slice of the positions, as logits_to_keep hands the LM head)
        view = torch.randn(3, 9, 24, generator=generator)[:, 2:7]
        torch.testing.assert_close(replaced(view), linear(view), atol=1e-5, rtol=1e-5)
    assert replaced.pointwise is pointwise
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_pinned_torch_has_the_faster_path():
    """torch 2.13 (the torch extra's pin) has inductor's oneDNN linear ops: a torch upgrade
    that drops or changes them falls back to the public op (slower: the module's docs), and
    this says so."""
    assert onednn_linear._pointwise_works()


def test_only_plain_linears_large_enough_are_replaced_and_hooks_still_see_them():
    class Scaled(torch.nn.Linear):  # a subclass may do more than a product: left alone
        pass

    assert 256 * 256 >= onednn_linear.MIN_WEIGHTS > 256 * 4  # (a product too small to win)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(256, 256)),
                                torch.nn.Linear(256, 4), Scaled(4, 2))
    assert use_onednn_linears(model) == 2
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if name}
    assert kinds == {"0": "OneDnnLinear", "1": "ReLU", "2": "Sequential",
                     "2.0": "OneDnnLinear", "3": "Linear", "4": "Scaled"}
    seen = []
    model[2][0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.inference_mode():
        model(torch.randn(3, 256))
    assert seen == [torch.Size([3, 256])]


def test_it_says_where_it_cannot_run():
    assert unusable("cpu", torch.float32) is None
    assert "fp32" in unusable("cpu", torch.bfloat16)
    assert "cuda" in unusable("cuda", torch.float32)


@pytest.fixture(scope="module")
def scorers():
    """The shipped GGUF's fp32 reference twice: oneDNN's linear layers (the default), torch's."""
    try:
        path = llm.smollm2_gguf()
    except FileNotFoundError as exc:  # pragma: no cover - depends on the install
        pytest.skip(str(exc))
    made = {}
    for onednn in (True, False):
        made[onednn] = create_backend(BackendConfig(
            backend="transformers", path=str(path),
            options={"onednn_linear": onednn, "cache_prompt": False}), "reference")
        made[onednn].load()
    yield made
    for scorer in made.values():
        scorer.close()


def test_the_reference_scores_as_with_torchs_kernels(scorers):
    fast, plain = scorers[True], scorers[False]
    assert fast.describe().details["linear_kernels"] == "onednn"
    assert plain.describe().details["linear_kernels"] == "torch"
    assert isinstance(fast.model.lm_head, OneDnnLinear)
    assert type(plain.model.lm_head) is torch.nn.Linear
    for prompt in llm.PROMPTS[:3]:
        ids = fast.encode_prompt(prompt)
        completion = fast.vocab.encode(" Paris, and the answer is given in one short line.")
        got = fast.forward(ids + completion, len(ids))
        expected = plain.forward(ids + completion, len(ids))
        assert got.shape == expected.shape == (len(completion), fast.vocab.size)
        # fp32 in another summation order, over 30 layers: ~1e-4 nats, the same best tokens
        np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)
        assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()
    # and its greedy continuation, which runs the KV cache one token at a time
    prompt = fast.encode_prompt(llm.PROMPTS[0])
    assert fast.greedy(prompt, 8) == plain.greedy(prompt, 8)


def test_tier_twos_copy_keeps_torchs_modules(scorers):
    from guard.backends.activations.transformers import transformers_side

    spec = scorers[True].spec
    side = transformers_side(spec, "reference", None)
    try:
        linears = [m for m in side.module.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and not any(isinstance(m, OneDnnLinear) for m in side.module.modules())
    finally:
        side.close()


# -- the torch backend's references: a factory's module, TorchScript, a torch.export program ----
@pytest.mark.parametrize("kind", ["factory", "torchscript", "exported"])
def test_a_torch_reference_runs_its_linear_layers_by_onednn(kind, tmp_path):
    """The zoo's CNN (two linear layers after its convolutions) in each of the torch backend's
    artifact kinds: as the reference (onednn_linear, on by default) it runs the large product
    (2048 x 128) by oneDNN, the small one (128 x 10) by torch's kernels, and answers what
    torch's kernels answer within fp32's summation-order noise; with the option off, and as a
    primary, it runs as loaded."""
    import hashlib

    from guard.zoo import classifier

    images = classifier.sample_inputs(4)
    sha256 = None
    if kind == "factory":
        path = "guard.zoo.classifier:build"
    else:
        model, example = classifier.build(), (torch.from_numpy(images),)
        if kind == "torchscript":
            path = str(tmp_path / "cnn.pt")
            torch.jit.save(torch.jit.trace(model, example), path)
        else:
            path = str(tmp_path / "cnn.pt2")
            torch.export.save(torch.export.export(model, example), path)
            sha256 = hashlib.sha256((tmp_path / "cnn.pt2").read_bytes()).hexdigest()

    def loaded(role: str, **options):
        backend = create_backend(BackendConfig(backend="torch", path=path, sha256=sha256,
                                               options=options), role, 1)
        backend.load()
        return backend

    fast, plain, primary = loaded("reference"), loaded("reference", onednn_linear=False), \
        loaded("primary")
    assert fast.describe().details["linear_kernels"] == "onednn, linear layers: 1"
    assert "linear_kernels" not in plain.describe().details
    assert "linear_kernels" not in primary.describe().details
    name = fast.describe().inputs[0].name
    got, expected = (b.infer({name: images}) for b in (fast, plain))
    (output,) = expected
    np.testing.assert_allclose(got[output], expected[output], rtol=1e-5, atol=1e-5)
    assert (got[output].argmax(1) == expected[output].argmax(1)).all()
    np.testing.assert_array_equal(primary.infer({name: images})[output], expected[output])
    for backend in (fast, plain, primary):
        backend.close()


def test_tier_twos_torch_side_keeps_torchs_modules():
    from guard.backends.activations.torch import torch_side
    from guard.config import ActivationCheckConfig

    side = torch_side(BackendConfig(backend="torch", path="guard.zoo.classifier:build"),
                      "reference", ActivationCheckConfig())
    try:
        assert sum(isinstance(m, torch.nn.Linear) for m in side.module.modules()) == 2
        assert not any(isinstance(m, OneDnnLinear) for m in side.module.modules())
    finally:
        side.close()
