"""Replaying a generative model (``task: generation``): each item is one LLM call, scored by the
reference as configured now and judged by the registered tiers that take a sampled call, the
ones the sidecar's verifier runs (guard/verifier_process/generation_model.py): one
teacher-forced pass of the reference's scorer (``Scorer.score``), then ``Comparator.check``.

Where the completion comes from:

- a capture record: the completion that was compared live (the primary's answer, or its probe),
  scored again; nothing is asked of the primary, so a capture replays with the primary's server
  gone, and against another reference by naming it in the config;
- a JSONL prompt set (guard/replay/prompts.py, ``ReplayItem.generate``): the primary generates
  it first, over HTTP (guard/backends/openai_generate.py: top-5 logprobs per token, not
  streamed, the upstream's key, as the verifier's probe asks). The primary must answer: its
  ``GET /v1/models`` is awaited once (``options.ready_timeout_s``) before the first prompt,
  and a primary that never answers stops replay with a usage error naming it; one call it
  fails afterwards is that record's ``primary_error`` (an error, not a failed check).

The runner has ``ModelRunner``'s surface (``submit``/``collect``/``check``, ``run``,
``describe``), so the local and the Ray engine run it unchanged. Calls are scored one at a time
on the reference's thread (each is one forward pass of its own length: nothing stacks), ahead of
the checks on the engine's thread, as the tensor runner overlaps its sides.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from guard.backends import create_backend
from guard.backends.openai import OpenAIBackend, reported_settings
from guard.backends.llama_server_prompts import LlamaServerPrompts, for_primary
from guard.backends.openai_generate import PrimaryProbe
from guard.config import ModelConfig
from guard.errors import BackendError, GuardError
from guard.protocol.generation import GenerationSample, rendered_as_served
from guard.replay.items import (
    CHECKED,
    INPUT_ERROR,
    PRIMARY_ERROR,
    REFERENCE_ERROR,
    Batch,
    RecordOutcome,
    ReplayItem,
    outcome_of,
)
from guard.verify.pair import require_reference
from guard.verify.pipeline import Comparator

if TYPE_CHECKING:
    from guard.backends.scoring import ReferenceScores, Scorer
    from guard.verify.generation import GenerationTier

TIER = "generation"
_PROMPT_CHARS = 300  # the end of a call's prompt kept in the report beside its completion


@dataclass
class Scored:
    """One item after the reference's pass: the compared completion and its scores, or an
    outcome already final (an error)."""

    item: ReplayItem
    completion: GenerationSample | None = None
    scores: ReferenceScores | None = None
    outcome: RecordOutcome | None = None


@dataclass
class ScoredBatch:
    batch: Batch
    futures: list[Future] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)


def prompt_text(call: GenerationSample) -> str:
    """The end of a call's prompt (a chat's last message), for the report. An echo call's
    scored tokens are its prompt's (from the second on): the completion shows them."""
    if call.echo:
        text = "(echo: the prompt's own tokens scored, shown as the completion)"
    elif call.endpoint == "chat" and call.messages:
        last = call.messages[-1]
        content = last.get("content", "")
        if isinstance(content, list):  # text parts, as the client sent them
            content = "\n".join(str(part.get("text", "")) for part in content
                                 if isinstance(part, dict))
        text = f"{last.get('role', '?')}: {content}"
    elif call.prompt is None and call.prompt_token_ids:  # the client sent token ids
        text = f"({len(call.prompt_token_ids)} token ids)"
    else:
        text = call.prompt or ""
    return text if len(text) <= _PROMPT_CHARS else "…" + text[-_PROMPT_CHARS:]


class GenerationRunner:
    def __init__(self, config: ModelConfig):
        reference = require_reference(config)
        self.name = config.name
        self.config = config
        # (a scorer: the plan refuses any other reference for a generation model,
        # guard/plan/serving.py llm_role_problems)
        self.scorer = cast("Scorer", create_backend(reference, "reference",
                                                    config.mirror.threads))
        self.comparator = Comparator.for_model(config)
        self.engine = config.primary.options.get("engine", "unknown")  # (how it renders chats)
        self._primary: PrimaryProbe | None = None  # built for the first prompt to generate
        self._prompts: LlamaServerPrompts | None = None  # (with it, where the primary is asked)
        self._reference = ThreadPoolExecutor(max_workers=1,
                                             thread_name_prefix=f"replay-{self.name}-reference")

    def load(self) -> "GenerationRunner":
        try:
            self.scorer.load()
        except BackendError as exc:
            raise exc.at(f"models[{self.name}].reference") from None
        return self

    def npz_inputs(self):
        raise GuardError(f"model '{self.name}' is generative (task: generation): replay takes "
                         "its captures (.gcap) or a JSONL prompt set (.jsonl), not .npz inputs")

    def describe(self) -> dict:
        primary = self.config.primary
        return {"reference": self.scorer.describe().summary(),
                "primary": f"openai {primary.model}@{primary.target}",
                "tiers": list(self.comparator.tiers), "noise_floor": None}

    def close(self) -> None:
        self._reference.shutdown(wait=True)
        self.scorer.close()

    # -- one batch ---------------------------------------------------------------------------
    def run(self, batch: Batch) -> list[RecordOutcome]:
        return self.check(self.collect(self.submit(batch)))

    def submit(self, batch: Batch) -> ScoredBatch:
        """Hand every item to the reference's thread (generating first where asked)."""
        return ScoredBatch(batch, [self._reference.submit(self._score, item)
                                   for item in batch.items])

    def collect(self, submitted: ScoredBatch) -> ScoredBatch:
        submitted.scored = [future.result() for future in submitted.futures]
        return submitted

    def check(self, collected: ScoredBatch) -> list[RecordOutcome]:
        outcomes = []
        for scored in collected.scored:
            if scored.outcome is not None:
                outcomes.append(scored.outcome)
                continue
            assert scored.completion is not None, "scored without a completion"
            result = self.comparator.check(scored.scores, scored.completion)
            reports = self.comparator.tier_reports(result)
            if TIER in reports:  # the prompt beside the completion, for the report's reader
                reports[TIER].details["prompt"] = prompt_text(scored.completion)
            outcomes.append(outcome_of(scored.item, CHECKED, tiers=reports))
        return outcomes

    # -- on the reference's thread ---------------------------------------------------------------
    def _score(self, item: ReplayItem) -> Scored:
        if item.generation is None:
            return Scored(item, outcome=outcome_of(
                item, INPUT_ERROR, f"a tensor record: model '{self.name}' is generative "
                "(its records hold a sampled call)"))
        completion = item.generation
        if item.generate:
            try:
                completion = self.primary()(item.generation)
                if self._prompts is not None:  # the prompt as the primary's server read it
                    completion = self._prompts(completion)
            except GuardError as exc:
                if self._primary is None:  # never reached: nothing will be generated
                    raise
                return Scored(item, outcome=outcome_of(item, PRIMARY_ERROR, str(exc)))
        completion = rendered_as_served(completion, self.engine)
        try:
            scores = self.scorer.score(completion)
        except Exception as exc:  # noqa: BLE001 - reported per record
            return Scored(item, outcome=outcome_of(item, REFERENCE_ERROR,
                                                   f"{type(exc).__name__}: {exc}"))
        return Scored(item, completion, scores)

    def primary(self) -> PrimaryProbe:
        """The primary's generator, once its server answers (GuardError: it never does)."""
        if self._primary is None:
            spec = self.config.primary
            try:
                backend = OpenAIBackend(spec, "primary")
                backend.load()  # waits for GET /v1/models (options.ready_timeout_s)
                generator = PrimaryProbe(spec, backend.options.timeout_s)
                self._prompts = for_primary(spec, backend.options.timeout_s)
            except BackendError as exc:
                raise GuardError(f"models[{self.name}].primary: a prompt set is generated by "
                                 f"the primary, which does not answer: {exc}") from None
            tier = cast("GenerationTier", self.comparator.tier(TIER))
            if tier.reads_the_server:  # (as the live verifier does at load)
                tier.take_report(self.name, backend.base, reported_settings(spec))
            self._primary = generator
        return self._primary
