"""Put first on PYTHONPATH, this makes a Python process and every child it starts (they inherit
the variable) behave as an install of guard with only the ``llm-remote`` extra: the packages
that extra does not bring cannot be imported. Each process it is active in, and each import it
refuses, is appended to the file $GUARD_BLOCKED_IMPORTS_LOG (a probe of an optional package is
allowed to fail; what a run needs and cannot get shows as the run failing).
tests/e2e/test_vllm.py runs `guard serve` so."""

import os
import sys
from importlib.abc import MetaPathFinder

BLOCKED = ("torch", "transformers", "llama_cpp", "tensorflow", "onnxruntime", "openvino",
           "accelerate", "gguf")


class _Refuse(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in BLOCKED:
            log = os.environ.get("GUARD_BLOCKED_IMPORTS_LOG")
            if log:
                with open(log, "a") as handle:
                    handle.write(f"{os.getpid()} refused {name}\n")
            raise ModuleNotFoundError(f"No module named '{name}' (blocked: llm-remote install)",
                                      name=name)
        return None


sys.meta_path.insert(0, _Refuse())
if os.environ.get("GUARD_BLOCKED_IMPORTS_LOG"):
    with open(os.environ["GUARD_BLOCKED_IMPORTS_LOG"], "a") as handle:
        handle.write(f"{os.getpid()} active {' '.join(sys.argv)[:200]}\n")
