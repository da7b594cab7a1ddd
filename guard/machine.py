"""The machine a figure was measured on, as benchmarks and the matrix report write it down."""

from __future__ import annotations

from pathlib import Path


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model(default: str = "unknown") -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); ``default`` where it cannot be read."""
    return _cpuinfo("model name") or default


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux); None where they cannot be read."""
    flags = _cpuinfo("flags")
    return None if flags is None else frozenset(flags.split())


# x86 instructions ONNX Runtime's int8 (U8S8) kernels use instead of AVX2's vpmaddubsw, which
# adds pairs of u8*s8 products in int16 and saturates when the weights use all 8 bits.
_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_kernels_saturate() -> bool:
    """Does this machine's CPU saturate in ONNX Runtime's int8 kernels? (``saturating_int8``)"""
    import platform

    return saturating_int8(cpu_flags(), platform.machine())


def saturating_int8(flags: frozenset[str] | None, machine: str) -> bool:
    """True on an x86-64 CPU whose int8 dot products saturate (AVX2 or AVX-512 without VNNI,
    e.g. AMD Zen 3 and older, Intel before Cascade Lake): there ONNX Runtime advises
    ``reduce_range`` (7-bit weights) for dynamic quantisation. False elsewhere (VNNI/AMX, ARM),
    and where the flags cannot be read (None: ONNX Runtime's own default then applies)."""
    if machine.lower() not in ("x86_64", "amd64"):
        return False
    return flags is not None and not (flags & _INT8_DOT_FLAGS)
