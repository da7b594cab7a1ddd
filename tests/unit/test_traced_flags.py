"""The cuDNN flags torch.jit.trace bakes into convolutions, read and rewritten on the CPU (where
they change no arithmetic: the GPU half is tests/gpu/test_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from guard.backends import create_backend
from guard.backends.traced_flags import (TORCH_DEFAULTS, ConvFlags, traced_conv_flags,
                                         tracing_flags, with_conv_flags)
from guard.config import BackendConfig
from guard.errors import ConfigError

PINNED = ConvFlags(benchmark=False, deterministic=True, cudnn_enabled=True, allow_tf32=False)


class TwoConvs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.body = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))

    def forward(self, image):
        return torch.nn.functional.conv2d(self.body(self.stem(image)), torch.ones(2, 4, 1, 1))


def trace(flags: ConvFlags = TORCH_DEFAULTS):
    with tracing_flags(flags), torch.no_grad():
        return torch.jit.trace(TwoConvs().eval(), torch.zeros(1, 3, 8, 8))


def test_a_trace_records_the_tracing_process_flags_on_every_convolution_submodules_included():
    assert traced_conv_flags(trace()) == [TORCH_DEFAULTS] * 3
    assert traced_conv_flags(trace(PINNED)) == [PINNED] * 3


def test_a_scripted_convolution_reads_the_process_flags_so_none_are_baked():
    assert traced_conv_flags(torch.jit.script(TwoConvs())) == []


def test_rewriting_sets_every_convolution_and_leaves_the_arithmetic_and_the_original_alone():
    image = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    original = trace()
    rewritten, changed = with_conv_flags(original, PINNED)
    assert changed == 3 and rewritten is not original
    assert traced_conv_flags(rewritten) == [PINNED] * 3
    assert torch.equal(rewritten(image), TwoConvs().eval()(image).detach())
    again, changed_again = with_conv_flags(rewritten, PINNED)
    assert again is rewritten and changed_again == 0


def backend_on(path, role: str, option: str = "as_traced"):
    return create_backend(BackendConfig(backend="torch", path=str(path),
                                        options={"traced_conv_flags": option}), role)


@pytest.fixture
def traced_file(tmp_path):
    path = tmp_path / "two_convs.pt"
    torch.jit.save(trace(), str(path))
    return path


@pytest.mark.parametrize("role, option", [("reference", "as_traced"), ("primary", "process")])
def test_a_reference_and_a_primary_told_to_follow_get_the_process_flags(traced_file, role, option,
                                                                          monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    backend = backend_on(traced_file, role, option)
    settled = backend._settle_conv_flags(torch.jit.load(str(traced_file)))
    assert {flags.allow_tf32 for flags in traced_conv_flags(settled)} == {False}
    said = backend._details["traced_conv_flags"]
    assert said.startswith("process: 3 of 3 traced convolutions rewritten") and \
        "allow_tf32=False" in said


def test_a_primary_runs_as_traced_and_says_so_when_that_means_tf32(traced_file, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    backend = backend_on(traced_file, "primary")
    module = torch.jit.load(str(traced_file))
    with caplog.at_level(logging.WARNING, logger="guard.backends.torch"):
        assert backend._settle_conv_flags(module) is module
    assert backend._details["traced_conv_flags"] == (
        "as traced: allow_tf32=True on 3 of 3 convolutions")
    assert "traced_conv_flags: process" in caplog.text and "3 of 3" in caplog.text


def test_the_option_is_checked_by_name(tmp_path):
    from guard.plan.complete import parse_config

    (tmp_path / "m.pt").touch()
    doc = {"version": 1, "models": [{
        "name": "m", "primary": {"backend": "torch", "path": "m.pt",
                                 "options": {"traced_conv_flags": "eager"}},
        "reference": {"backend": "torch", "path": "m.pt"}}]}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, tmp_path)
    assert "traced_conv_flags" in str(err.value) and "as_traced" in str(err.value)


def test_the_zoos_traces_carry_torchs_defaults_whatever_the_process_has_pinned(tmp_path):
    """A zoo export made after a reference pinned TF32 off is the same file as one made before
    (on a GPU the first GPU matrix ran traces of both kinds, by export order)."""
    from guard.backends.determinism import pin_torch_reference
    from guard.zoo import zoo_entry

    pin_torch_reference(1)
    pinned = ConvFlags.of_process()
    path = zoo_entry("resnet").export(tmp_path, 0)["torchscript"]
    assert set(traced_conv_flags(torch.jit.load(str(path)))) == {TORCH_DEFAULTS}
    assert ConvFlags.of_process() == pinned  # the process's own flags are back
