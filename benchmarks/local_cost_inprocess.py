"""guard's per-request Python in local mode, without gRPC: the servicer's ``ModelInferBytes``
(parse, signature check, ``Call``, route word, metrics, encode) around the ORT primary, against
the bare server's parse/encode (oip_load.py's, proxy_overhead.py's (a)) around the same backend.
CPU time per request, best of 3 passes of 20,000 requests. ``--prof``: cProfile of guard's path
instead.

Usage: ``.venv/bin/python benchmarks/local_cost_inprocess.py [--prof]``.
"""
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from tritonclient.grpc import service_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oip_load as oip
from guard import __version__
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe.metrics import GuardMetrics
from guard.plan.complete import load_config
from guard.serve.dataplane import DataPlane
from guard.serve.model import ServedModel
from guard.serve.servicer import InferenceServicer
from guard.zoo import classifier

work = Path(tempfile.mkdtemp(prefix="guard-inprocess-"))
onnx = classifier.export(work / "models")["onnx"]
(work / "g.yaml").write_text(yaml.safe_dump({"version": 1, "models": [{
    "name": "classifier", "primary": {"backend": "onnxruntime", "path": str(onnx),
                                      "options": {"intra_op_threads": 1}}}]}))
cfg = load_config(str(work / "g.yaml"))
metrics = GuardMetrics(__version__)
table = RouteTable()
slot = table.assign(["classifier"])["classifier"]
ring = SampleRing(1 << 20)
m = ServedModel(cfg.models[0], metrics, table, slot, ring)
m.load(0.5)
dp = DataPlane({"classifier": m}, metrics, 4)
dp.loading = False
dp.models_changed()
sv = InferenceServicer(dp)
reqs = [r.SerializeToString() for r in oip.build_requests(classifier.sample_inputs(64, seed=1))]


class Ctx:
    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()


ctx = Ctx()
N = 20000


async def guard_path():
    for i in range(N):
        (await sv.ModelInferBytes(reqs[i & 63], ctx))


def ort_only():
    raw = pb.ModelInferRequest.FromString(reqs[0]).raw_input_contents[0]
    x = {"image": np.frombuffer(raw, np.float32).reshape(1, 3, 32, 32)}
    b = m.backends["primary"]
    for _ in range(N):
        b.infer(x)


def bare():
    b = m.backends["primary"]
    for i in range(N):
        request = pb.ModelInferRequest.FromString(reqs[i & 63])
        inputs = {t.name: np.frombuffer(raw, dtype=np.float32).reshape(tuple(t.shape))
                  for t, raw in zip(request.inputs, request.raw_input_contents)}
        outputs = b.infer(inputs)
        response = pb.ModelInferResponse(model_name=request.model_name,
                                         model_version=request.model_version, id=request.id)
        for name, array in outputs.items():
            t = response.outputs.add(name=name, datatype="FP32")
            t.shape.extend(array.shape)
            response.raw_output_contents.append(array.tobytes())
        response.SerializeToString()


def timeit(f):
    best = 1e9
    for _ in range(3):
        t = time.process_time()
        f()
        best = min(best, time.process_time() - t)
    return best / N * 1e6


prof = "--prof" in sys.argv
if prof:
    import cProfile
    import pstats

    cProfile.run("asyncio.run(guard_path())", str(work / "cprof"))
    pstats.Stats(str(work / "cprof")).sort_stats("tottime").print_stats(25)
    sys.exit()
o = timeit(ort_only)
bb = timeit(bare)
g = timeit(lambda: asyncio.run(guard_path()))
print(f"backend.infer {o:.1f} us; bare path {bb:.1f} us (+{bb - o:.1f}); guard path {g:.1f} us "
      f"(+{g - o:.1f}); guard-bare {g - bb:+.1f} us")
