"""The guard YAML config as typed models (pydantic v2).

Why pydantic: it gives typed settings, unknown-key rejection (``extra="forbid"``), error locations
we can turn into the ``dotted.path: message`` lines that CONTRACT.md promises, and the JSON Schema
for ``guard config schema``, all from one declaration. Every default is documented on its field.

Loading does only what needs no heavy imports: parse, validate, resolve relative paths against the
config file's folder, and check that artifacts exist. Building backends happens later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from guard.backends import BACKEND_NAMES, backend_kind, backend_kinds
from guard.backends.artifact import pin_required
from guard.backends.options import validate_backend_options
from guard.errors import ConfigError

# Backend names are registered once (guard/backends/__init__.py); what each backend is (the
# precisions it derives, its options, tier 2, the op repair) its own module declares.
BackendName = Literal[BACKEND_NAMES]
Precision = Literal["fp32", "fp16", "bf16", "int8"]
Task = Literal["classification", "detection", "segmentation", "embedding", "generic"]
Action = Literal["alert", "fallback_model", "fallback_ops"]


def __getattr__(name: str):
    """The tables this module once held, read from the backends' declarations."""
    if name == "IMPLEMENTED_BACKENDS":
        return frozenset(BACKEND_NAMES)
    if name == "DERIVABLE_PRECISIONS":
        return {n: k.precisions for n, k in backend_kinds().items()}
    if name == "ACTIVATION_BACKENDS":
        return frozenset(n for n, k in backend_kinds().items() if k.capture)
    if name == "REPAIRABLE_PRIMARIES":
        return {n: frozenset(k.keep_back) for n, k in backend_kinds().items() if k.keep_back}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _repairable_kinds() -> str:
    """'onnxruntime precision int8 or fp16 (nodes_to_exclude), ...' from the declarations."""
    parts = []
    for name, kind in backend_kinds().items():
        if kind.keep_back:
            precisions = sorted(kind.keep_back, key=["int8", "fp32", "fp16", "bf16"].index)
            option = kind.keep_back_strategy(precisions[0]).option
            parts.append(f"{name} precision {' or '.join(precisions)} ({option})")
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class ConfigContext:
    """Where a config came from, kept beside the validated models (``GuardConfig.context``,
    ``BackendConfig.context``) and passed explicitly to whoever needs it.

    - ``base_dir``: the config file's folder; relative paths were resolved against it and a
      ``module:factory`` is imported from it.
    - ``source_hash``: sha256 of the file's text, 16 hex digits (events and capture records
      name it, so that a verdict can be tied to the config that produced it; reload compares).
    - ``source_path``: the file as given (what a reload re-reads); None for a config that did
      not come from a file (a child process's copy, a test).
    """

    base_dir: Path | None = None
    source_hash: str = ""
    source_path: Path | None = None


# A Python model given as "package.module:factory" instead of a file.
FACTORY_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _unit_interval(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be in [0, 1]")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _non_negative(value: float) -> float:
    if value < 0:
        raise ValueError("must be >= 0")
    return value


Fraction = Annotated[float, AfterValidator(_unit_interval)]
PositiveFloat = Annotated[float, AfterValidator(_positive)]
NonNegativeFloat = Annotated[float, AfterValidator(_non_negative)]


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port in [0, 65535] (0 picks a free port)")
    return value


Port = Annotated[int, AfterValidator(_port)]


def _positive_int(value: int) -> int:
    if value < 1:
        raise ValueError("must be >= 1")
    return value


PositiveInt = Annotated[int, AfterValidator(_positive_int)]


class Strict(BaseModel):
    """Base for every config block: unknown keys are errors, values are not coerced silently."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class WithContext(Strict):
    """A block that knows where its config came from (``context``, set by parse_config): not
    a field, so no key of the YAML, not in the schema or a dump; copies keep it."""

    _context: ConfigContext = PrivateAttr(default_factory=ConfigContext)

    @property
    def context(self) -> ConfigContext:
        return self._context

    @context.setter
    def context(self, context: ConfigContext) -> None:
        self._context = context


class TlsConfig(Strict):
    """TLS on the data plane (OIP + health). With ``client_ca_file``, mutual TLS: clients must
    present a certificate signed by that CA. Kubernetes gRPC probes cannot speak TLS: with TLS
    on, probe with an exec or TCP probe instead."""

    cert_file: str = Field(description="PEM certificate chain of the server.")
    key_file: str = Field(description="PEM private key of the server.")
    client_ca_file: str | None = Field(None, description="PEM CA for client certs (mTLS).")


# -- hardening2: authenticated control listeners (admin API, tap) --------------------------------
def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or 'localhost': reachable only from this network namespace (in a Pod,
    from every container of the Pod)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientAuthTlsConfig(TlsConfig):
    """TLS on a control listener (admin API, tap). ``client_ca_file`` turns on mutual TLS;
    ``allowed_identities`` then names the client certificates that may call: a call whose
    certificate carries none of them (subject alternative names, or the common name of a
    certificate without SANs) is refused with PERMISSION_DENIED. Certificate files are re-read
    when they change (checked at each new connection)."""

    allowed_identities: list[str] = Field(
        default_factory=list,
        description="Client certificate identities (a SAN: DNS name, URI such as a SPIFFE id, "
        "or the CN of a certificate without SANs) allowed to call; empty: any certificate "
        "signed by client_ca_file. Needed (with client_ca_file) off loopback.",
    )

    @model_validator(mode="after")
    def _check_identities(self) -> "ClientAuthTlsConfig":
        if self.allowed_identities and not self.client_ca_file:
            raise ValueError("allowed_identities needs client_ca_file (mutual TLS): without "
                             "client certificates there is no identity to check")
        return self


def _off_loopback_needs_mtls(host: str, tls: ClientAuthTlsConfig | None, what: str) -> str:
    """Why a control listener on ``host`` is refused, or ""."""
    if is_loopback(host) or (tls is not None and tls.client_ca_file and
                             tls.allowed_identities):
        return ""
    return (f"{host!r} is not loopback: the {what} would accept anyone who can reach it; set "
            f"{'tls' if what == 'tap' else 'admin_tls'} with client_ca_file and "
            "allowed_identities (mutual TLS), or listen on 127.0.0.1")


class TapListenerConfig(Strict):
    """The guard.v1.Tap listener (tap mode), apart from the data plane. Absent: no Tap service.
    Only models with ``tap: true`` can be observed on it."""

    host: str = Field("127.0.0.1", description="Address of the Tap listener (loopback unless "
                      "tls with client authentication and allowed_identities is set).")
    port: Port = Field(8004, description="Port of the Tap listener (0 picks a free one).")
    tls: ClientAuthTlsConfig | None = Field(None, description="TLS / mutual TLS on the Tap "
                                            "listener, with an allow-list of client identities.")

# -- end hardening2 -------------------------------------------------------------------------------


class VerifierConfig(Strict):
    """The verifier process: reference, checks, detectors, capture and repair run there, out of
    the serving process and its interpreter lock (guard/verifier/)."""

    ring_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Shared-memory ring that carries sampled requests and answers from the "
        "serving process to the verifier. Full: the sample is dropped and counted "
        "(guard_mirror_total{outcome=\"dropped\"}); the request path never waits.",
    )
    hang_timeout_s: PositiveFloat = Field(
        10.0,
        description="A verifier whose heartbeat is older than this is hung: it is killed and "
        "restarted. Serving goes on on the last route meanwhile.",
    )
    restart_backoff_s: PositiveFloat = Field(
        0.5, description="First wait before restarting a dead verifier; doubles per failure "
        "in a row, up to 30 s, and resets once a verifier has run for a minute.",
    )
    start_timeout_s: PositiveFloat = Field(
        600.0, description="Longest wait at start-up for the verifier to load the references "
        "and measure noise floors; past it `guard serve` fails.",
    )


class ServerConfig(Strict):
    host: str = Field("0.0.0.0", description="Address the data plane and metrics listen on.")
    grpc_port: Port = Field(8001, description="Open Inference Protocol (KServe v2) gRPC port.")
    metrics_port: Port = Field(9090, description="Prometheus text exposition at /metrics.")
    admin_port: Port = Field(8003, description="guard.v1 admin API port.")
    admin_host: str = Field(
        "127.0.0.1", description="The admin API changes routes: loopback only unless set."
    )
    workers: Annotated[int, Field(ge=0)] = Field(
        4,
        description="Threads that run primary/fallback inference for the request path. 0 runs "
        "inference on the event loop itself: no thread hop (~0.1-0.3 ms saved per request on a "
        "busy CPU), but one inference at a time and a slow call stalls every other RPC: only "
        "for models that answer in well under a millisecond. Upstream models are forwarded "
        "asynchronously and never use these threads.",
    )
    max_message_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Largest gRPC message accepted or sent; larger gets RESOURCE_EXHAUSTED.",
    )
    tls: TlsConfig | None = Field(None, description="TLS / mutual TLS on the data plane.")
    reload_interval_s: NonNegativeFloat = Field(
        2.0,
        description="How often the config file is checked for changes (0: only on SIGHUP). "
        "Follows symlinks, so a Kubernetes ConfigMap volume's '..data' swap is seen; a subPath "
        "mount never updates.",
    )
    shutdown_grace_s: NonNegativeFloat = Field(
        30.0, description="On SIGTERM: how long in-flight requests may take to finish."
    )
    max_concurrent_requests: PositiveInt = Field(
        256,
        description="Inference requests inside the guard at once; more are refused with "
        "RESOURCE_EXHAUSTED (counted in guard_request_errors_total), so that a burst cannot "
        "queue without bound in front of the model.",
    )
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    # -- hardening2 ----------------------------------------------------------------------------
    admin_tls: ClientAuthTlsConfig | None = Field(
        None, description="TLS / mutual TLS on the admin API. Required, with client_ca_file and "
        "allowed_identities, when admin_host is not loopback.")
    tap: TapListenerConfig | None = Field(
        None, description="The guard.v1.Tap listener for models with 'tap: true'; off when "
        "absent.")
    sampling_key_file: str | None = Field(
        None, description="File holding the secret (at least 16 bytes) that keys the hash of "
        "request ids deciding which requests are mirrored and captured. Give every replica the "
        "same one (a Secret) so that they pick the same requests. Unset: the environment "
        "variable GUARD_SAMPLING_KEY, else a random key per start (replicas then disagree).")

    # -- end hardening2 ------------------------------------------------------------------------
    processes: PositiveInt = Field(
        1,
        description="Serving processes on grpc_port (SO_REUSEPORT: the kernel spreads client "
        "connections over them), for nodes with more cores than one interpreter can use. The "
        "first is `guard serve` itself (admin, metrics, reload, the verifier); each other one "
        "serves only the data plane and gRPC health, shares the route words and the verifier, "
        "hands its samples over through a ring of its own (server.verifier.ring_bytes each), "
        "and is restarted with backoff if it dies. Default 1: on a 2-core machine a second "
        "process did not pay (no more req/s; higher p99 and CPU per request; "
        "benchmarks/results/serving_processes.md). Takes effect on restart.",
    )


class BackendConfig(WithContext):
    backend: BackendName
    path: str | None = Field(
        None,
        description="The artifact (.onnx, .pt TorchScript, .pt2 torch.export) or, for torch, "
        "a Python factory 'package.module:function'. Relative to the config file.",
    )
    precision: Precision = Field(
        "fp32", description="Variant the guard derives itself from the fp32 artifact."
    )
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific settings, checked per backend."
    )
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="Expected sha256 of the artifact file: the backend reads the file "
        "once, hashes those bytes and loads them. Required for a torch.export program (.pt2), "
        "whose loader can unpickle; an error on upstream and 'module:factory' backends, which "
        "have no artifact file to pin."
    )
    target: str | None = Field(None, description="upstream only: host:port of an OIP server.")
    model: str | None = Field(None, description="upstream only: model name on that server.")


    @property
    def _base_dir(self) -> Path | None:
        """``context.base_dir`` under its old name, for code not yet moved to ``context``
        (guard/verify/activation/torch_side.py)."""
        return self._context.base_dir

    @_base_dir.setter
    def _base_dir(self, base_dir: Path | None) -> None:
        self._context = dataclasses.replace(self._context, base_dir=base_dir)

    @field_validator("sha256")
    @classmethod
    def _check_sha256(cls, value: str | None, info: ValidationInfo) -> str | None:
        backend = info.data.get("backend")
        if backend in BACKEND_NAMES and not backend_kind(backend).artifact and value is not None:
            raise ValueError(f"backend '{backend}' has no artifact to pin (the remote server "
                             "loads its own model): remove sha256")
        why = pin_required(info.data.get("path"))
        if why and value is None:
            raise ValueError(f"required: {why}; pin the file with sha256: <hex digest> "
                             "(sha256sum FILE)")
        return value

    @model_validator(mode="after")
    def _check_backend(self) -> "BackendConfig":
        kind = backend_kind(self.backend)
        if not kind.artifact:
            kind.check(self)
            return self
        if self.path is None:
            raise ValueError(f"backend '{self.backend}' needs 'path'")
        if self.target is not None or self.model is not None:
            raise ValueError("'target' and 'model' are for backend 'upstream' only")
        if self.precision not in kind.precisions:
            raise ValueError(
                f"precision '{self.precision}' cannot be derived by backend '{self.backend}' "
                f"(it can derive: {', '.join(sorted(kind.precisions))})"
            )
        if kind.check is not None:
            kind.check(self)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device '{self.device}' must be cpu, cuda or cuda:N")
        return self

    @property
    def is_factory(self) -> bool:
        return bool(self.path and FACTORY_REF.match(self.path)) and not Path(self.path).exists()

    def describe(self) -> str:
        if not backend_kind(self.backend).artifact:
            return f"{self.backend} {self.model}@{self.target}"
        suffix = "" if self.precision == "fp32" else f" {self.precision}"
        return f"{self.backend}{suffix} {self.path}"


class MirrorConfig(Strict):
    sample_rate: Fraction = Field(
        0.05,
        description="Share of requests mirrored onto the reference. With a request id, the "
        "decision is a keyed hash of the id (server.sampling_key_file), so replicas that share the "
        "key agree on which requests are mirrored and clients cannot choose.",
    )
    queue_size: PositiveInt = Field(
        64, description="Samples waiting for the reference; a full queue drops and counts."
    )
    queue_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Bytes of samples (inputs and answers) waiting for the reference, in the "
        "verifier process: past it a sample is dropped and counted, whatever queue_size says.",
    )
    timeout_s: PositiveFloat = Field(
        5.0, description="Longest wait for one reference (or probe) inference."
    )
    threads: PositiveInt = Field(
        1, description="CPU threads the reference may use (its intra-op thread pool)."
    )
    # 10: under contention a nice-10 thread gets ~1/10 of a nice-0 one's CPU share (Linux CFS
    # weights 110 vs 1024), so the request path keeps its cores; idle CPU still goes to it.
    nice: int = Field(
        10, ge=0, le=19, description="Niceness added to the mirror's threads (reference "
        "call, checks) and to an op repair's, on Linux: they yield the CPU to the request "
        "path. A mirror that cannot keep up then drops samples (counted) instead of slowing "
        "clients. 0: off."
    )


class NoiseFloorConfig(Strict):
    """The reference against itself at load (batch 1 vs batched, two thread counts).

    Tier 1 then allows ``atol + rtol * max|ref| + multiplier * floor`` per output: drift is
    judged beyond the noise the reference makes on its own (Diffy's idea, for tensors).
    """

    enabled: bool = Field(True, description="Measure the floor when the model loads.")
    inputs: str | None = Field(
        None,
        description="An .npz of input arrays (batched along axis 0) to measure on; default: "
        "inputs generated from the model's signature (seeded).",
    )
    samples: PositiveInt = Field(4, description="Rows used (batch 1 each, then batched).")
    thread_counts: list[PositiveInt] = Field(
        default_factory=lambda: [1, 2],
        description="Thread counts the reference is run with; every pair is compared.",
    )
    multiplier: NonNegativeFloat = Field(
        1.0, description="How many floors tier 1 allows on top of atol + rtol * max|ref|."
    )


class ArbitrationConfig(Strict):
    """fp64 arbitration (torch._dynamo's accuracy rule) when tier 1 fails.

    A float64 run of the reference's own model is the truth; the primary is judged acceptable
    when ``err(primary) <= multiplier * err(reference) + atol / 10`` (errors: max abs vs fp64).
    Only torch references can run in fp64; for others the verdict says it was not available.
    """

    enabled: bool = Field(
        False, description="Run the fp64 arbiter on every tier-1 failure (one extra inference)."
    )
    multiplier: PositiveFloat = Field(2.0, description="m in the rule above (dynamo uses 2-3).")
    forgive: bool = Field(
        False,
        description="Count a tier-1 failure as a pass when the arbiter finds the reference, not "
        "the primary, to be the side further from fp64.",
    )


class TensorCheckConfig(Strict):
    atol: NonNegativeFloat = Field(1.0e-4, description="Absolute tolerance.")
    rtol: NonNegativeFloat = Field(
        1.0e-3, description="Relative tolerance, scaled by max|reference| of the output."
    )
    outputs: dict[str, "OutputTolerance"] = Field(
        default_factory=dict, description="Per-output overrides of atol/rtol, by output name."
    )
    noise_floor: NoiseFloorConfig = Field(default_factory=NoiseFloorConfig)
    arbitration: ArbitrationConfig = Field(default_factory=ArbitrationConfig)


class OutputTolerance(Strict):
    atol: NonNegativeFloat | None = None
    rtol: NonNegativeFloat | None = None


class ActivationCheckConfig(Strict):
    """Tier 2 (activation alignment): off unless ``sample_rate`` > 0 or ``on_failure``.

    It runs in the mirror worker after tier 1, never on the request path, on capture sessions
    of its own built from the artifacts (never the production sessions).
    """

    sample_rate: Fraction = Field(
        0.0, description="Share of compared (mirrored) samples that also get tier 2.")
    on_failure: bool = Field(
        False, description="Also run tier 2 on every tier-1 failure while the mirror queue "
        "is at most max_queue_fill full (the mirror's budget comes first).")
    max_queue_fill: Fraction = Field(
        0.5, description="on_failure runs only while queue depth / queue_size is at most this.")
    rel_error: PositiveFloat | None = Field(
        None, description="A fixed allowance on each layer's isolated relative error. Default "
        "(unset): derived per layer, the relative error tier 1 allows at the output plus "
        "checks.tensor.noise_floor.multiplier times the reference's own noise on that layer "
        "(measured as the tier-1 floor is: batch 1 vs batched, thread counts).")
    top_k: PositiveInt = Field(5, description="Suspects reported, ranked by isolated error.")
    max_isolated: PositiveInt = Field(
        64, description="Most layers re-run in isolation per sample (largest propagated error "
        "first): each is a small session of its own, built once.")
    torch_factory: str | None = Field(
        None, description="For a TorchScript or .pt2 side (Python hooks cannot see inside "
        "them): an eager 'module:factory' of the same architecture; the artifact's weights "
        "are loaded into it.")

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0 or self.on_failure

    @model_validator(mode="after")
    def _check(self) -> "ActivationCheckConfig":
        if self.torch_factory is not None and not FACTORY_REF.match(self.torch_factory):
            raise ValueError("torch_factory must be 'package.module:function'")
        return self


class ClassificationTaskConfig(Strict):
    """Top-1 agreement, top-k overlap and logit-margin flips, per row of the logits output."""

    logits_output: str | None = Field(
        None, description="Output holding logits or probabilities [..., classes]; default: "
        "'logits' when the model has it, else its only output."
    )
    top_k: PositiveInt = Field(5, description="k of the top-k overlap (capped at the classes).")
    tie_margin: NonNegativeFloat | None = Field(
        None,
        description="A flip whose reference margin (ref[top1_ref] - ref[top1_primary]) is at "
        "most this is a near-tie flip, reported apart and not counted against agreement. "
        "Default: 2 x tier 1's allowed error for the output (each logit may move by that much).",
    )
    min_top1_agreement: Fraction = Field(
        1.0, description="Pass when the share of rows without a real (beyond-margin) flip is "
        "at least this."
    )
    min_topk_overlap: Fraction = Field(
        0.0, description="Pass when the mean tie-aware top-k overlap is at least this "
        "(0: reported only)."
    )


class DetectionTaskConfig(Strict):
    """Boxes matched by IoU with class agreement; mAP of the primary against the reference."""

    boxes_output: str = Field("boxes", description="Boxes [N, 4] or [B, N, 4] as x1, y1, x2, y2.")
    scores_output: str = Field("scores", description="Scores [N] or [B, N].")
    classes_output: str | None = Field(
        "labels", description="Class ids [N] or [B, N]; when the model lacks this output the "
        "match is class-agnostic (stated in the result)."
    )
    score_threshold: float = Field(
        0.0, description="Detections scoring at most this are padding and ignored."
    )
    match_iou: Fraction = Field(0.5, description="IoU at which a primary box matches.")
    min_map: Fraction = Field(
        0.9, description="Pass when the primary's mAP (reference as ground truth) is at least this."
    )
    max_count_mismatch: int | None = Field(
        0, ge=0, description="Pass when the box counts differ by at most this per image "
        "(null: not judged)."
    )


class SegmentationTaskConfig(Strict):
    """mIoU and pixel agreement of the argmax masks."""

    mask_output: str | None = Field(
        None, description="Class scores [B, C, H, W] (argmax over class_axis) or an integer "
        "label mask; default: 'mask' when present, else the only output."
    )
    class_axis: int = Field(1, description="Axis of the class scores.")
    min_pixel_agreement: Fraction = Field(0.99, description="Share of equal pixels needed.")
    min_miou: Fraction = Field(
        0.9, description="Mean IoU over classes present on either side needed."
    )


class EmbeddingTaskConfig(Strict):
    """Cosine per vector and nearest-neighbour agreement over the batch."""

    embedding_output: str | None = Field(
        None, description="Embeddings [B, D]; default: 'embedding' when present, else the only "
        "output."
    )
    min_cosine: Fraction = Field(0.999, description="Every vector's cosine must reach this.")
    min_neighbour_agreement: Fraction = Field(
        1.0, description="Share of rows whose nearest neighbour in the batch agrees (needs a "
        "batch of 3 or more; smaller batches report it as not applicable)."
    )
    # 0.01: reduced precision moves pairwise cosine similarities by 1e-3..1e-2 (MiniLM int8
    # per-channel: a row whose two nearest reference neighbours score 0.047 and 0.045, two
    # unrelated sentences, swaps them). A lead that small is not a decision the model made.
    neighbour_tie: NonNegativeFloat = Field(
        0.01, description="Reference neighbours within this cosine similarity of the best "
        "count as tied: picking any of them is agreement."
    )


class TaskCheckConfig(Strict):
    """Tier 3 (task-level agreement). Only the block of the model's ``task`` is read; setting
    another task's block is an error. ``task: generic`` runs tier 1 only."""

    enabled: bool = Field(True, description="Run tier 3 for models whose task is not generic.")
    classification: ClassificationTaskConfig = Field(default_factory=ClassificationTaskConfig)
    detection: DetectionTaskConfig = Field(default_factory=DetectionTaskConfig)
    segmentation: SegmentationTaskConfig = Field(default_factory=SegmentationTaskConfig)
    embedding: EmbeddingTaskConfig = Field(default_factory=EmbeddingTaskConfig)


def _adapter_entry(value: Any) -> Any:
    """``name`` or ``{name: {options}}`` or ``{name: X, ...options}`` -> ``{name, options}``."""
    if isinstance(value, str):
        return {"name": value, "options": {}}
    if isinstance(value, dict) and "name" not in value and len(value) == 1:
        (name, options), = value.items()
        return {"name": name, "options": options if options is not None else {}}
    if isinstance(value, dict) and "name" in value and "options" not in value:
        return {"name": value["name"], "options": {k: v for k, v in value.items() if k != "name"}}
    return value


class AdapterConfig(Strict):
    """A deterministic post-processing adapter applied to both sides before tiers 1 and 3."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "AdapterConfig":
        from guard.verify.adapters import ADAPTERS, validate_adapter_options

        if self.name not in ADAPTERS:
            raise ValueError(
                f"unknown adapter '{self.name}' (available: {', '.join(sorted(ADAPTERS))})"
            )
        problems = validate_adapter_options(self.name, self.options)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ChecksConfig(Strict):
    tensor: TensorCheckConfig = Field(default_factory=TensorCheckConfig)
    activation: ActivationCheckConfig = Field(default_factory=ActivationCheckConfig)
    task: TaskCheckConfig = Field(default_factory=TaskCheckConfig)


class RepairConfig(Strict):
    """``action: fallback_ops``: how the guard searches for the ops to keep back."""

    buffer: PositiveInt = Field(
        32, description="Recent mirrored inputs kept in memory: suspects are found on the "
        "failing ones, every candidate is validated on all of them.")
    suspect_samples: PositiveInt = Field(
        4, description="Failing buffered samples tier 2 runs on to rank the suspects.")
    min_isolated_error: NonNegativeFloat = Field(
        0.001, description="Suspects whose isolated relative error is below this are ignored.")
    max_ops: PositiveInt = Field(16, description="Most candidate ops the search starts from.")
    max_candidates: PositiveInt = Field(
        24, description="Most variants rebuilt and validated in one repair.")
    budget_s: PositiveFloat = Field(
        300.0, description="Wall-clock budget of one repair; past it the best passing variant "
        "found so far is used, or the whole-model fallback stays.")
    max_failure_share: Fraction = Field(
        0.0, description="Share of buffered samples a candidate may fail (tier 1 and 3) and "
        "still be accepted.")
    # 1: the fallback serves while the repair runs, and ONNX Runtime's own default would spin
    # a thread per core for every candidate session.
    threads: PositiveInt = Field(
        1, description="Intra-op threads of each candidate session while it is validated "
        "(ONNX Runtime primaries; torch's thread pool is process-wide and TensorRT runs on "
        "the GPU): the repair's CPU budget beside the fallback that serves meanwhile. The "
        "variant that passes is loaded again with the primary's own options and validated "
        "once more before it serves.")


class PolicyConfig(Strict):
    """When to switch a model to its fallback, and when to switch it back.

    The trigger is a detector per tier on the stream of per-sample failures. ``cusum`` (the
    default) is a one-sided Bernoulli CUSUM from the in-control failure rate p0 to the alarm
    rate p1 with threshold h = ln(ARL0): on average at least ARL0 compared samples pass
    between false alarms. ``e_detector`` is its variant for when p0 is only known as an upper
    bound and the alarm rate is unknown (a mixture over several). ``window`` is the v0 rule
    (failing share of the last ``window`` samples over ``trip_ratio``). Recovery is decided by
    a second detector with a lower rate, on probes of the primary.
    """

    action: Action = Field(
        "alert",
        description="alert: report only. fallback_model: route the model to its fallback "
        "while the detector says it drifts. fallback_ops: route to the fallback, find the ops "
        "that drift (tier 2), rebuild the primary with them kept back at reference precision "
        "and route back to it. Primaries it can rebuild: onnxruntime int8/fp16 (ONNX nodes, "
        "nodes_to_exclude), torch_compile fp32/fp16/bf16 with a torch reference (submodules "
        "run eagerly in fp32, eager_fp32_modules), tensorrt int8/fp16 (layers pinned to fp32, "
        "fp32_layers).",
    )
    repair: RepairConfig = Field(default_factory=RepairConfig)
    detector: Literal["cusum", "e_detector", "window"] = Field(
        "cusum", description="The trip/recovery rule: cusum, e_detector or window.")
    # -- sequential detectors (cusum, e_detector) --
    arl0: PositiveFloat | None = Field(
        None, description="Expected compared samples between false alarms, per tier "
        "(threshold h = ln(arl0)). Default 1e5 unless false_alarms_per_day is given.")
    threshold: Literal["exact", "bound"] = Field(
        "exact", description="cusum threshold: exact = the smallest h whose in-control ARL "
        "(Markov chain of the CUSUM at p0) is at least arl0; bound = ln(arl0), which keeps the "
        "promise for any CUSUM but raises ~100x fewer false alarms than asked, and detects "
        "later. The e_detector always uses ln(arl0) (its p0 is only a bound).")
    false_alarms_per_day: PositiveFloat | None = Field(
        None, description="Instead of arl0: false alarms per day, converted to arl0 through "
        "expected_rps x mirror.sample_rate x 86400 compared samples per day.")
    expected_rps: PositiveFloat | None = Field(
        None, description="Requests per second the model is expected to serve (only with "
        "false_alarms_per_day).")
    p0: Fraction | None = Field(
        None, description="In-control failure rate. Unset: measured during burn_in (primary "
        "vs reference, one-sided Wilson upper bound at 90%), clipped to [p0_min, p0_max].")
    p0_min: Fraction = Field(0.001, description="Floor of a measured p0.")
    p0_max: Fraction = Field(
        0.05, description="Ceiling of a measured p0, and the p0 used during burn-in (a model "
        "broken from the start still trips during its burn-in).")
    burn_in: PositiveInt = Field(
        500, description="Compared samples on the primary that measure p0 when it is unset.")
    shift: PositiveFloat = Field(
        0.02, description="Alarm rate p1 = p0 + shift (cusum), or the base of the mixture of "
        "alarm rates (e_detector).")
    p1: Fraction | None = Field(None, description="Pin the cusum alarm rate instead of shift.")
    recover_rate: Fraction | None = Field(
        None, description="Failure rate of probes at which the primary counts as recovered "
        "(the recovery detector tests it against p1). Default: p0.")
    recover_arl0: PositiveFloat = Field(
        1000.0, description="Expected probes of a still-drifting primary between false "
        "recoveries (recovery threshold = ln(recover_arl0)).")
    # -- window detector --
    window: PositiveInt = Field(100, description="Compared samples kept per tier.")
    min_samples: PositiveInt = Field(20, description="No decision on fewer samples than this.")
    trip_ratio: Fraction = Field(
        0.2, description="window: switch to the fallback when the failing share exceeds this."
    )
    recover_ratio: Fraction = Field(
        0.05,
        description="window: switch back when the failing share of fresh probe samples is at "
        "most this (lower than trip_ratio: hysteresis).",
    )
    # -- dwell and rollout --
    dwell_s: NonNegativeFloat = Field(
        30.0,
        description="Minimum time on the fallback before the primary is probed again. It "
        "grows with repeated trips (dwell_s x trips, Envoy's ejection rule), up to max_dwell_s; "
        "each dwell_s spent healthy on the primary takes one trip off the count.",
    )
    max_dwell_s: NonNegativeFloat | None = Field(
        None, description="Cap of the growing dwell; default 10 x dwell_s (Envoy's 30 s base "
        "and 300 s cap). Set it equal to dwell_s for a fixed dwell.")
    primary_dwell_s: NonNegativeFloat = Field(
        0.0, description="Minimum time on the primary after routing back before it may trip "
        "again (the detector keeps counting meanwhile).")
    dry_run_percent: Annotated[float, AfterValidator(lambda v: _percent(v))] = Field(
        0.0, description="Share (0-100) of trips that are evaluated and reported (event "
        "drift_dry_run) but not enforced: a way to roll the policy out.")

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.recover_ratio > self.trip_ratio:
            raise ValueError("recover_ratio must not exceed trip_ratio (hysteresis)")
        if self.min_samples > self.window:
            raise ValueError("min_samples must not exceed window")
        if self.arl0 is not None and self.false_alarms_per_day is not None:
            raise ValueError("give arl0 or false_alarms_per_day, not both")
        if (self.false_alarms_per_day is None) != (self.expected_rps is None):
            raise ValueError("false_alarms_per_day and expected_rps go together")
        if self.arl0 is not None and self.arl0 <= 1:
            raise ValueError("arl0 must be > 1 (samples between false alarms)")
        if self.p0_min > self.p0_max:
            raise ValueError("p0_min must not exceed p0_max")
        if self.p0 is not None and not 0 < self.p0 < 1:
            raise ValueError("p0 must be in (0, 1)")
        if self.p0_min <= 0 or self.p0_max >= 1:
            raise ValueError("p0_min and p0_max must be in (0, 1)")
        if self.p1 is not None:
            low = self.p0 if self.p0 is not None else self.p0_max
            if not low < self.p1 < 1:
                raise ValueError(
                    f"p1 must be in ({low}, 1): above p0 (or p0_max while p0 is measured)")
        if self.recover_rate is not None and self.p1 is not None and self.recover_rate >= self.p1:
            raise ValueError("recover_rate must be below p1 (hysteresis)")
        if self.max_dwell_s is not None and self.dwell_s > self.max_dwell_s:
            raise ValueError("dwell_s must not exceed max_dwell_s")
        return self

    @property
    def dwell_cap_s(self) -> float:
        return self.max_dwell_s if self.max_dwell_s is not None else 10.0 * self.dwell_s

    def arl0_for(self, sample_rate: float) -> float:
        """ARL0 in compared samples: given, or converted from false alarms per day."""
        if self.false_alarms_per_day is not None and self.expected_rps is not None:
            per_day = self.expected_rps * sample_rate * 86400.0
            return max(per_day / self.false_alarms_per_day, 2.0)
        return self.arl0 if self.arl0 is not None else 1.0e5


def _percent(value: float) -> float:
    if not 0.0 <= value <= 100.0:
        raise ValueError("must be in [0, 100]")
    return value


class CaptureConfig(Strict):
    """Recording of sampled traffic to segment files for ``guard replay`` (guard/capture/)."""

    dir: str = Field(
        description="Folder for segment files (relative to the config file); each model writes "
        "into its own subfolder '<dir>/<model name>/', so models may share a dir."
    )
    mode: Literal["all", "failures"] = Field(
        "all",
        description="all: record a sample of every request (mirrored ones carry the reference's "
        "answer and the verdicts). failures: record only mirrored samples that failed a check.",
    )
    sample_rate: Fraction = Field(
        1.0,
        description="Share of requests (mode all) or of failing samples (mode failures) "
        "recorded, independent of mirror.sample_rate. With a request id the decision is the "
        "mirror's hash of the id: at a capture rate <= the mirror rate every recorded request "
        "was also mirrored, and replicas agree.",
    )
    queue_size: PositiveInt = Field(
        1024,
        description="Records waiting for the writer thread, which writes in bursts about every "
        "10 ms; a full queue drops and counts.",
    )
    max_segment_bytes: PositiveInt = Field(
        64 * 1024 * 1024, description="A segment file is closed and a new one opened past this."
    )
    max_segment_age_s: PositiveFloat = Field(
        600.0, description="A segment file older than this is closed (even when idle)."
    )
    max_total_bytes: PositiveInt = Field(
        1024 * 1024 * 1024,
        description="Disk cap for the model's capture folder: past it the oldest segments are "
        "deleted first (guard_capture_segments_deleted_total).",
    )

    @model_validator(mode="after")
    def _check(self) -> "CaptureConfig":
        if self.max_segment_bytes > self.max_total_bytes:
            raise ValueError("max_segment_bytes must not exceed max_total_bytes")
        return self


# A model name becomes a folder name (capture.dir/<name>/): no '/', no '..', no leading dot.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def _model_name(value: str) -> str:
    if not MODEL_NAME.fullmatch(value):
        raise ValueError(
            f"model name {value!r} must start with a letter or digit and hold only letters, "
            "digits, '_', '.' and '-' (at most 128 characters): it names the model's capture "
            "folder")
    return value


class ModelConfig(Strict):
    name: Annotated[str, AfterValidator(_model_name)] = Field(
        description="The model_name clients send; also the name of the model's capture folder: "
        "letters, digits, '_', '.', '-', starting with a letter or digit.")
    task: Task = "generic"
    tap: bool = Field(
        False, description="hardening2: true: this model's own server answers its clients and "
        "reports each answer to guard over guard.v1.Tap (server.tap's listener); guard never "
        "answers it (ModelInfer for it is FAILED_PRECONDITION). false: guard answers it in the "
        "path and Tap/Observe for it is refused, so that nobody else can feed its detectors.")
    primary: BackendConfig
    reference: BackendConfig | None = Field(
        None, description="The trusted backend that sampled requests are mirrored onto."
    )
    fallback: BackendConfig | None = Field(
        None, description="Where traffic goes when the policy switches the model."
    )
    mirror: MirrorConfig = Field(default_factory=MirrorConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    adapters: list[Annotated[AdapterConfig, BeforeValidator(_adapter_entry)]] = Field(
        default_factory=list,
        description="Deterministic adapters applied, in order, to both sides' outputs before "
        "tiers 1 and 3: stable_nms, tie_aware_topk, canonical_order, float64_softmax.",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    capture: CaptureConfig | None = Field(
        None, description="Record sampled traffic for offline replay; off when absent."
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.policy.action == "fallback_model" and self.fallback is None:
            raise ValueError("policy.action 'fallback_model' needs a 'fallback' backend")
        if self.policy.action == "fallback_ops":
            if self.fallback is None or self.reference is None:
                raise ValueError("policy.action 'fallback_ops' needs a 'reference' (to find "
                                 "and validate the ops) and a 'fallback' (served meanwhile)")
            primary = self.primary
            if primary.precision not in backend_kind(primary.backend).keep_back:
                raise ValueError(
                    "policy.action 'fallback_ops' rebuilds the primary with ops kept back, "
                    f"which it can for {_repairable_kinds()}; this primary is "
                    f"{primary.backend} {primary.precision} (primary.backend, "
                    "primary.precision)")
            if backend_kind(self.reference.backend).capture is None:
                raise ValueError(
                    "policy.action 'fallback_ops' finds the ops with tier 2, which cannot "
                    f"capture reference.backend '{self.reference.backend}'")
        if self.capture is not None and self.capture.mode == "failures" and (
            self.reference is None or self.mirror.sample_rate == 0
        ):
            raise ValueError("capture.mode 'failures' needs a 'reference' and "
                             "mirror.sample_rate > 0 (failures are found by the mirror)")
        other = sorted(
            block for block in self.checks.task.model_fields_set
            if block in ("classification", "detection", "segmentation", "embedding")
            and block != self.task
        )
        if other:
            raise ValueError(
                f"checks.task.{other[0]} is set but the model's task is '{self.task}'"
            )
        for backend in dict.fromkeys(
                spec.backend for spec in (self.primary, self.reference, self.fallback) if spec):
            check_model = backend_kind(backend).check_model
            if check_model is not None:
                check_model(self)
        policy = self.policy
        if (policy.false_alarms_per_day is not None and policy.detector != "window"
                and self.mirror.sample_rate > 0 and policy.arl0_for(self.mirror.sample_rate) <= 2.0):
            raise ValueError(
                "policy.false_alarms_per_day: fewer compared samples per day "
                "(expected_rps x mirror.sample_rate x 86400) than allowed false alarms")
        if self.checks.activation.enabled:
            if self.reference is None:
                raise ValueError("checks.activation needs a 'reference' backend to compare with")
            for role in ("primary", "reference"):
                backend = getattr(self, role).backend
                if backend_kind(backend).capture is None:
                    can = sorted(n for n, k in backend_kinds().items() if k.capture)
                    raise ValueError(
                        f"checks.activation: tier 2 cannot capture the intermediate tensors of "
                        f"{role} backend '{backend}' (it can: "
                        f"{', '.join(can)}); set sample_rate: 0 and "
                        "on_failure: false for this model")
        return self


class GuardConfig(WithContext):
    version: Literal[1]
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)


    @model_validator(mode="after")
    def _unique_names(self) -> "GuardConfig":
        seen: set[str] = set()
        for model in self.models:
            if model.name in seen:
                raise ValueError(f"model name '{model.name}' appears twice")
            seen.add(model.name)
        return self

    def model(self, name: str) -> ModelConfig:
        return next(m for m in self.models if m.name == name)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _message(error: dict[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    message = str(error["msg"])
    # pydantic prefixes messages raised from our validators.
    return message.removeprefix("Value error, ")


def format_validation_error(exc: ValidationError) -> list[str]:
    """One ``dotted.path: message`` line per problem, in the order the fields are declared."""
    lines = []
    for error in exc.errors():
        # Literal/union errors carry the discriminating value in the loc; keep the field path.
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        lines.append(f"{_dotted(loc)}: {_message(error)}")
    return lines


# -- hardening2 --------------------------------------------------------------------------------
def _absolute(base_dir: Path, value: str) -> Path:
    """``value`` against the config file's folder, symlinks NOT followed: under a Kubernetes
    ConfigMap volume the file is reached through the '..data' symlink, whose target changes on
    every update; a path through it would change too, and every model would reload."""
    return Path(os.path.normpath(os.path.join(base_dir, os.path.expanduser(value))))


def _check_server(server: ServerConfig, base_dir: Path) -> list[str]:
    """Server problems beyond the schema: files that must exist (made absolute here) and control
    listeners off loopback without client authentication."""
    problems = []
    blocks = (("server.tls", server.tls), ("server.admin_tls", server.admin_tls),
              ("server.tap.tls", server.tap.tls if server.tap else None))
    for where, tls in blocks:
        for key in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(tls, key, None)
            if value is None:
                continue
            resolved = _absolute(base_dir, value)
            if not resolved.is_file():
                problems.append(f"{where}.{key}: file not found: {resolved}")
            setattr(tls, key, str(resolved))
    if server.sampling_key_file is not None:
        resolved = _absolute(base_dir, server.sampling_key_file)
        server.sampling_key_file = str(resolved)
        try:
            size = len(resolved.read_bytes().strip())
        except OSError as exc:
            problems.append(f"server.sampling_key_file: cannot read {resolved}: "
                            f"{exc.strerror or exc}")
        else:
            if size < 16:
                problems.append(f"server.sampling_key_file: holds {size} bytes; a sampling "
                                "key needs at least 16 (e.g. `head -c 32 /dev/urandom > FILE`)")
    why = _off_loopback_needs_mtls(server.admin_host, server.admin_tls, "admin API")
    if why:
        problems.append(f"server.admin_host: {why}")
    if server.tap is not None:
        why = _off_loopback_needs_mtls(server.tap.host, server.tap.tls, "tap")
        if why:
            problems.append(f"server.tap.host: {why}")
    return problems
# -- end hardening2 ----------------------------------------------------------------------------


def parse_config(data: Any, base_dir: Path | ConfigContext,
                 source: str | None = None) -> GuardConfig:
    """Validate a parsed YAML document; resolve and check artifact paths against ``base_dir``
    (a folder, or the whole ``ConfigContext`` the config and its backend blocks then carry)."""
    context = base_dir if isinstance(base_dir, ConfigContext) else ConfigContext(base_dir)
    base_dir = context.base_dir
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping with 'version' and 'models'"], source)
    try:
        config = GuardConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), source) from None
    problems = _check_server(config.server, base_dir)
    for i, model in enumerate(config.models):
        if model.tap and config.server.tap is None:
            problems.append(f"models[{i}].tap: needs server.tap (the Tap listener that the "
                            "model's own server reports to)")
        for role in ("primary", "reference", "fallback"):
            spec: BackendConfig | None = getattr(model, role)
            if spec is None or spec.path is None:
                continue
            spec.context = context
            if ("factory" in backend_kind(spec.backend).formats and FACTORY_REF.match(spec.path)
                    and not (base_dir / spec.path).exists()):
                # A Python factory, imported when the backend loads: code, not a file to pin.
                if spec.sha256 is not None:
                    problems.append(
                        f"models[{i}].{role}.sha256: '{spec.path}' is a Python factory, not an "
                        "artifact file: sha256 cannot pin it; remove sha256 (or export the "
                        "model to .pt/.pt2/.onnx and pin that)")
                continue
            resolved = _absolute(base_dir, spec.path)
            if not resolved.exists():
                problems.append(f"models[{i}].{role}.path: file not found: {resolved}")
            spec.path = str(resolved)
        if model.capture is not None:
            model.capture.dir = str(_absolute(base_dir, model.capture.dir))
        floor = model.checks.tensor.noise_floor
        if floor.inputs is not None:
            resolved = _absolute(base_dir, floor.inputs)
            if not resolved.exists():
                problems.append(
                    f"models[{i}].checks.tensor.noise_floor.inputs: file not found: {resolved}")
            floor.inputs = str(resolved)
        for role in ("primary", "reference", "fallback"):
            spec = getattr(model, role)
            if spec is not None:
                problems += [
                    f"models[{i}].{role}.options{line}"
                    for line in validate_backend_options(spec.backend, spec.options)
                ]
    if problems:
        raise ConfigError(problems, source)
    config.context = context
    return config


def read_yaml(path: str | Path) -> tuple[str, Any]:
    """A YAML file's text and data; ``ConfigError`` with one ``(file)`` or ``(yaml)`` line
    (the line and column of a syntax error) when it cannot be read or parsed. Every YAML the
    guard reads (its config, the matrix config, the config behind alert rules) goes through it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"(file): cannot read: {exc.strerror or exc}"], str(path)) from None
    try:
        return text, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"(yaml): {where}{problem}"], str(path)) from None


def load_config(path: str | Path) -> GuardConfig:
    """Read, validate and resolve a config file; raises ``ConfigError`` naming every problem."""
    path = Path(path)
    text, data = read_yaml(path)
    # Not path.resolve(): see _absolute (ConfigMap '..data' symlinks).
    context = ConfigContext(base_dir=Path(os.path.abspath(path)).parent,
                            source_hash=hashlib.sha256(text.encode()).hexdigest()[:16],
                            source_path=path)
    return parse_config(data, context, str(path))


def config_json_schema() -> dict[str, Any]:
    return GuardConfig.model_json_schema()
