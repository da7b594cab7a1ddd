"""The Prometheus metrics of CONTRACT.md, on their own registry.

Why prometheus_client: the reference implementation of the exposition format, classic
histograms, and a tiny surface. Each server gets its own ``CollectorRegistry`` so that several
servers can live in one process (tests) without sharing counters.

Buckets are deliberate: request latency from 100 us (a proxy hop) to 10 s; tensor errors on a log
scale, half a decade apart from 1e-8 to 100, because drift spans orders of magnitude (fp32 noise
~1e-6, fp16 ~1e-2, broken int8 ~1). No label carries a request id or any unbounded value: the
model label only ever holds configured model names (unknown names count as ``_unknown``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
ERROR_BUCKETS = tuple(10 ** (e / 2) for e in range(-16, 5))  # 1e-8 ... 1e2
# Mean KLD per token of a completion, in nats: half a decade apart from 1e-5 (an fp16 or F16
# copy) through 1e-3..1e-2 (8-bit and 4-bit quantizations) to 10 (a broken model).
KLD_BUCKETS = tuple(10 ** (e / 2) for e in range(-10, 3))  # 1e-5 ... 10
SHARE_BUCKETS = (0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)
POSITION_BUCKETS = tuple(2 ** e for e in range(11))  # 1 ... 1024 (0-based position + 1)
# A sampled completion's z: about N(0, 1) while it agrees; the check fails beyond |4|. (With
# negative buckets prometheus_client exposes no _sum, as OpenMetrics has it: dashboards read
# quantiles.)
Z_BUCKETS = (-8.0, -6.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)
# LLM calls: a first token from 5 ms (a small model, warm) to a minute (a long prompt queued);
# the gaps between tokens from 0.5 ms (a fast GPU server) to 10 s (a stall).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               10.0)
UNKNOWN_MODEL = "_unknown"


class GuardMetrics:
    def __init__(self, version: str, registry: CollectorRegistry | None = None,
                 serving: bool = True):
        """``serving``: the first serving process's registry (the one /metrics exposes). The
        verifier's and the extra serving processes' registries (``serving=False``) leave out
        the series only the first keeps (build info, reloads, the verifier's own health),
        since all are merged into one exposition by summing same-named series
        (guard/serve/merged_metrics.py)."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "guard_requests", "Inference requests answered, by the route that answered them.",
            ["model", "route"], registry=r,
        )
        self.request_errors = Counter(
            "guard_request_errors", "Inference requests that failed, by gRPC status code.",
            ["model", "code"], registry=r,
        )
        self.request_duration = Histogram(
            "guard_request_duration_seconds",
            "Time from request received to response ready, inside the guard.",
            ["model", "route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.mirror = Counter(
            "guard_mirror", "Mirrored samples by outcome (dropped: queue full or shutting down).",
            ["model", "outcome"], registry=r,
        )
        self.mirror_queue_depth = Gauge(
            "guard_mirror_queue_depth", "Samples waiting for the reference.", ["model"],
            registry=r,
        )
        self.reference_duration = Histogram(
            "guard_reference_duration_seconds", "Reference inference time per mirrored sample "
            "(a stacked forward's time shared over its samples).",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.checks = Counter(
            "guard_checks", "Verification checks by tier and result.",
            ["model", "tier", "result"], registry=r,
        )
        self.tensor_max_abs_error = Histogram(
            "guard_tensor_max_abs_error",
            "Largest absolute error over a sample's outputs, primary vs reference.",
            ["model"], buckets=ERROR_BUCKETS, registry=r,
        )
        self.drift_ratio = Gauge(
            "guard_drift_ratio", "Failing share of the current window.", ["model", "tier"],
            registry=r,
        )
        self.detector_statistic = Gauge(
            "guard_detector_statistic",
            "Statistic of a tier's trip detector (on the fallback: fed by probes of the "
            "primary): log-likelihood ratio for cusum/e_detector, failing share for window.",
            ["model", "tier"], registry=r,
        )
        self.detector_threshold = Gauge(
            "guard_detector_threshold",
            "The value guard_detector_statistic must reach for the tier to trip.",
            ["model", "tier"], registry=r,
        )
        # The rates a tier's pass/fail detector tests between (not for a scored tier): what
        # `guard deploy rules --fleet` pools replicas' counts with (guard/deploy/fleet.py).
        self.detector_p0 = Gauge(
            "guard_detector_p0",
            "In-control failure rate a tier's detector assumes: policy.p0, else measured at "
            "burn-in (policy.p0_max until then).",
            ["model", "tier"], registry=r,
        )
        self.detector_p1 = Gauge(
            "guard_detector_p1",
            "Failure rate a tier's detector alarms on (policy.p1, else p0 + policy.shift).",
            ["model", "tier"], registry=r,
        )
        # A scored tier's evidence, each sample's step of its trip detector split by sign (a
        # counter never falls): summed over replicas and a window, "for" minus "against" is the
        # fleet's log e-value, what `guard deploy rules --fleet` tests (guard/deploy/fleet.py).
        self.detector_evidence = Counter(
            "guard_detector_evidence_nats",
            "Log e-value of a scored tier's samples of the primary (each its trip detector's "
            "step, ln(1 + bet (score / null_mean - 1))), by sign: 'for' drift, 'against'.",
            ["model", "tier", "direction"], registry=r,
        )
        self.detector_samples = Gauge(
            "guard_detector_samples",
            "Samples a tier's trip detector has taken since it (re)started; it decides only "
            "from policy.min_samples on (the generated drift alert requires both).",
            ["model", "tier"], registry=r,
        )
        self.fallback_active = Gauge(
            "guard_fallback_active", "1 while the fallback serves (model) or ops are kept back.",
            ["model", "scope"], registry=r,
        )
        self.fallback_transitions = Counter(
            "guard_fallback_transitions", "Route changes, by the route taken.",
            ["model", "to"], registry=r,
        )
        # The generation tier (task: generation), one observation per compared completion
        # (guard_generation_tokens_total and the edge's own series: guard/serve/openai_edge.py).
        self.generation_kld = Histogram(
            "guard_generation_kld", "Mean KLD per token (nats, KL(primary || reference)) of a "
            "compared completion.", ["model"], buckets=KLD_BUCKETS, registry=r,
        )
        self.generation_top1_agreement = Histogram(
            "guard_generation_top1_agreement", "Share of a compared completion's positions "
            "whose top-1 token agrees with the reference's.", ["model"],
            buckets=SHARE_BUCKETS, registry=r,
        )
        self.generation_sampled_z = Histogram(
            "guard_generation_sampled_z", "z of a compared completion sampled without logprobs "
            "(no KLD and no same top-1 there): about N(0, 1) while the primary samples the "
            "reference's distribution; positive: more surprising to the reference than "
            "agreement allows.", ["model"], buckets=Z_BUCKETS, registry=r,
        )
        self.generation_first_divergence = Histogram(
            "guard_generation_first_divergence_position", "Position (1-based) of a failing "
            "completion's first divergent token.", ["model"], buckets=POSITION_BUCKETS,
            registry=r,
        )
        # Capture (guard/capture/): what was recorded for replay, what was lost, disk use.
        self.capture_records = Counter(
            "guard_capture_records",
            "Capture records by outcome: written; dropped (writer queue full or shutting "
            "down); disabled (not written because capture was disabled by an I/O error); "
            "error (a record that could not be encoded).",
            ["model", "outcome"], registry=r,
        )
        self.capture_bytes = Gauge(
            "guard_capture_bytes", "Bytes of segment files in the model's capture folder.",
            ["model"], registry=r,
        )
        self.capture_segments_deleted = Counter(
            "guard_capture_segments_deleted",
            "Segment files deleted (oldest first) to stay under capture.max_total_bytes.",
            ["model"], registry=r,
        )
        self.capture_enabled = Gauge(
            "guard_capture_enabled",
            "1 while capture writes; 0 once an I/O error or a full disk disabled it.",
            ["model"], registry=r,
        )
        self.capture_queue_depth = Gauge(
            "guard_capture_queue_depth", "Records waiting for the capture writer.", ["model"],
            registry=r,
        )
        # Envoy mode (guard/envoy/tap_filter.py, guard/envoy/observer.py): every observed call's
        # outcome. No model label: the model name is inside the body, which the observer does
        # not parse.
        self.observer_calls = Counter(
            "guard_observer_calls", "Calls Envoy copied to guard (its tap, or the ext_proc "
            "observer), by outcome: complete (handed to the verifier), incomplete (ext_proc "
            "only: the stream ended or was reset before the answer ended: a slow observer "
            "loses calls so), too_large (over the per-call byte limit, dropped), unsupported "
            "(compressed or streaming calls), error (a body that does not parse as gRPC "
            "messages, or tap output that is not a trace).",
            ["outcome"], registry=r,
        )
        # Both processes count here (the edge's reasons, the verifier's): merged by summing.
        self.generation_not_comparable = Counter(
            "guard_generation_not_comparable", "Calls never compared, by reason. At the HTTP "
            "edge (forwarded, never handed over): n (best_of > 1: n > 1 is compared by its "
            "first completion), echo (a streamed echo, one without logprobs, or an echo answer "
            "whose tokens do not spell its text), tools (a sampled chat "
            "that offers tools, without the prompt's and the output's token ids; tools on "
            "another endpoint), reasoning (a reasoning answer without the output's tokens: no "
            "logprobs or token ids), stateful (a Responses call continuing a conversation the "
            "server keeps, or a background one), input (a message part that is not text: an "
            "image, audio, a file; Responses input items that are not messages; a "
            "completion's fill-in-the-middle suffix; a prompt the server may cut, "
            "truncate_prompt_tokens, answered without its token ids), prompt_list (an empty or "
            "malformed batch of prompts), upstream_error (an error answer or event, an "
            "upstream down), incomplete (cut short by the client or the upstream), endpoint "
            "(a call to an endpoint guard forwards unchecked: embeddings, /tokenize ...). In "
            "the verifier "
            "(sampled, then not scored; also in guard_mirror_total{outcome=\"not_comparable\"}): "
            "sampling_unknown (a sampling field neither the request nor the server's declared "
            "defaults say), penalties (the server's penalties cannot be applied to the "
            "reference's scores), no_distribution (a sampled completion without logprobs and "
            "a remote reference), unaligned (the primary's tokens cannot be aligned), "
            "too_short (under checks.generation.min_tokens), constrained (no logprobs, and a "
            "grammar, JSON schema, logit bias or token mask chose the tokens), sampler (no "
            "logprobs, and a sampler guard does not model: mirostat, typical_p, XTC, DRY, "
            "beam search ...), logprobs_mode (the primary's logprobs are logits, or after the "
            "sampling transform, where its options.logprobs_mode says raw_logprobs).",
            ["model", "reason"], registry=r)
        # The OpenAI-compatible HTTP edge (guard/serve/openai_edge.py; every serving process
        # runs one, so the extra processes' registries, ``serving=False``, have these too; the
        # verifier's stay empty): tokens as they pass, per model and route.
        self.generation_ttft = Histogram(
            "guard_generation_ttft_seconds", "Time from a streamed call received to its first "
            "token written to the client (HTTP edge).", ["model", "route"],
            buckets=TTFT_BUCKETS, registry=r)
        self.generation_inter_token = Histogram(
            "guard_generation_inter_token_seconds", "Gaps between consecutive streamed tokens "
            "as they reached guard from the upstream (HTTP edge); streams of one completion "
            "only (n > 1 and batches of prompts interleave theirs).", ["model", "route"],
            buckets=GAP_BUCKETS, registry=r)
        self.generation_tokens = Counter(
            "guard_generation_tokens", "Completion tokens answered (usage.completion_tokens, "
            "else one per streamed token event).", ["model", "route"], registry=r)
        if not serving:
            return
        self.verifier_up = Gauge(
            "guard_verifier_up", "1 while the verifier process (reference, checks, detectors, "
            "capture, repair) runs and answers; serving goes on either way.", registry=r,
        )
        self.ring_used_bytes = Gauge(
            "guard_sample_ring_used_bytes", "Bytes of sampled requests waiting in the shared "
            "rings for the verifier process (all serving processes); at capacity new samples "
            "are dropped (guard_mirror_total{outcome=\"dropped\"}).", registry=r,
        )
        self.ring_capacity_bytes = Gauge(
            "guard_sample_ring_capacity_bytes", "Size of the shared sample rings "
            "(server.verifier.ring_bytes per serving process).", registry=r,
        )
        self.verifier_restarts = Counter(
            "guard_verifier_restarts", "Verifier processes that died or hung and were "
            "restarted (the samples they held count as dropped in guard_mirror_total).",
            registry=r,
        )
        self.serving_processes = Gauge(
            "guard_serving_processes", "Serving processes answering on the data-plane port "
            "(this one included; server.processes).", registry=r,
        )
        self.serving_process_restarts = Counter(
            "guard_serving_process_restarts", "Extra serving processes (server.processes > 1) "
            "that died and were restarted.", registry=r,
        )
        self.config_reloads = Counter(
            "guard_config_reloads", "Config reloads: applied, rejected (invalid: the old config "
            "stays), failed (a model did not load: its old version stays).", ["result"],
            registry=r,
        )
        for result in ("applied", "rejected", "failed"):
            self.config_reloads.labels(result)
        self.build_info = Gauge(
            "guard_build_info", "Always 1; the version label says which guard runs.",
            ["version"], registry=r,
        )
        self.build_info.labels(version=version).set(1)

    def declare_model(self, model: str, tiers: tuple[str, ...] = ("tensor",),
                      detectors: tuple[str, ...] | None = None) -> None:
        """Create a model's series at zero, so that rate() and alerts see them from the start:
        checks for every tier it runs, drift figures for those feeding a detector (default:
        all of ``tiers``)."""
        for route in ("primary", "fallback"):
            self.requests.labels(model, route)
        for outcome in ("compared", "dropped", "error", "timeout"):
            self.mirror.labels(model, outcome)
        for tier in tiers:
            for result in ("pass", "fail"):
                self.checks.labels(model, tier, result)
        for tier in tiers if detectors is None else detectors:
            self.drift_ratio.labels(model, tier).set(0)
        for scope in ("model", "ops"):
            self.fallback_active.labels(model, scope).set(0)
        for to in ("primary", "fallback_model", "fallback_ops"):
            self.fallback_transitions.labels(model, to)

    def declare_generation_model(self, model: str) -> None:
        """A generation model's own series at zero (besides ``declare_model``'s)."""
        self.generation_kld.labels(model)
        self.generation_top1_agreement.labels(model)
        self.generation_sampled_z.labels(model)
        self.generation_first_divergence.labels(model)
        for direction in ("for", "against"):  # both, so that "for" minus "against" always exists
            self.detector_evidence.labels(model, "generation", direction)

    def declare_served_model(self, model: str) -> None:
        """The serving process's series of a model at zero (requests; samples the ring
        refused); the verifier declares the rest (``declare_model``)."""
        for route in ("primary", "fallback"):
            self.requests.labels(model, route)
        self.mirror.labels(model, "dropped")

    def declare_capture(self, model: str) -> None:
        """A capturing model's series at zero (only models with a capture block have them)."""
        for outcome in ("written", "dropped", "disabled", "error"):
            self.capture_records.labels(model, outcome)
        self.capture_segments_deleted.labels(model)
        self.capture_bytes.labels(model).set(0)


def counts(metric, model: str, label: str) -> dict[str, int]:
    """Current values of a counter's children for one model, read from the registry (both
    processes' halves of the admin status read their counters this way)."""
    out: dict[str, int] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == model:
                out[sample.labels[label]] = int(sample.value)
    return out
