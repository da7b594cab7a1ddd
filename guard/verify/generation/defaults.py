"""What the tier compares against: the sampling defaults a primary's server applies where a
request says nothing (:class:`ServerDefaults`, a preset per engine, ``declared_defaults`` from
the primary block's options) and the tier's thresholds (:class:`GenerationThresholds`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from guard.protocol.generation import LOGPROBS_MODES, SAMPLING_FIELDS, generation_config_defaults


@dataclass(frozen=True)
class ServerDefaults:
    """The sampling transform a server applies where the request does not say (the backend
    block declares it: it depends on the server and its launch flags).

    A field that is None is not known: a sampled request that does not set it is not
    comparable (``temperature=None`` alone: only greedy requests and requests that set the
    temperature compare). ``temperature_last``: the server applies the truncations (top_k,
    top_p, min_p) at temperature 1 and the temperature after them (llama.cpp's sampler chain);
    otherwise temperature first (vLLM, transformers). Penalties follow vLLM's meaning: the
    repetition penalty over prompt and completion tokens, presence and frequency over
    completion tokens, within the last ``penalty_last_n`` tokens (-1: all);
    ``penalize_prompt`` false: the repetition penalty too sees only the completion's tokens
    (llama-cpp-python's sampler is handed the sampled tokens alone).

    ``distribution_fields``: the request fields outside the transform (constraints,
    samplers guard does not model: guard.protocol.openai.requests names them) that change
    this server's sampling distribution; the others it ignores (another engine's: vLLM 0.32
    reads no typical_p, mirostat or grammar and has dropped guided_json; llama.cpp reads no
    min_tokens, bad_words or structured_outputs) or reads without masking (vLLM's
    ignore_eos samples on past EOS; llama.cpp's masks EOS with a logit bias). None: every
    such field counts (the engine is not known).

    ``penalty_fields``: the request fields the server reads the repetition penalty from
    (vLLM ``repetition_penalty``, llama.cpp ``repeat_penalty``; each ignores the other name,
    so a penalty sent under it was not applied); both, first found, where the engine is
    not known. ``reads_repeat_last_n``: a request's ``repeat_last_n`` sets the window
    (llama.cpp's server; where the engine is not known, taken as said).
    ``penalties_share_window``: llama.cpp's one penalty sampler, where presence and frequency
    penalties count the same window of tokens as the repetition penalty, the prompt's among
    them where ``penalize_prompt`` (vLLM counts the completion's alone for those two).
    ``default_samplers``: samplers guard does not model that the server turns on where a
    request does not say (what llama-server's /props reports: a GGUF's or a launch flag's
    mirostat, XTC, DRY ...; a chain in an order guard does not model): its sampled calls are
    not comparable unless their logprobs are.

    ``min_p_first``: min_p cuts before top_p's nucleus is taken (vLLM: temperature,
    min_p, then top_k/top_p); otherwise after it (llama.cpp, transformers, SGLang). top_k and
    min_p both keep a prefix of the ranking and the best token, so only min_p and top_p
    depend on their order: top_p's nucleus over what min_p kept, renormalized, is smaller.

    ``logprobs_mode``: what the server's logprobs are (vLLM's ``--logprobs-mode``, whose names
    it takes: guard.protocol.generation.LOGPROBS_MODES). raw_logprobs, vLLM's default and
    every other engine's: the model's own distribution, before any sampling transform or constraint.
    processed_logprobs: after the transform (penalties, temperature, top_k/top_p/min_p; masked
    tokens at -9999), so the tier compares them with the reference's distribution under the
    same transform. raw_logits and processed_logits: logits, not a distribution; the tier
    does not read them (the reference alone judges, as for a completion without logprobs).
    """

    temperature: float | None = None
    top_p: float | None = 1.0
    top_k: int | None = 0  # 0: off
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    penalty_last_n: int = -1
    temperature_last: bool = False
    penalize_prompt: bool = True
    distribution_fields: frozenset[str] | None = None
    penalty_fields: tuple[str, ...] = ("repetition_penalty", "repeat_penalty")
    reads_repeat_last_n: bool = True
    penalties_share_window: bool = False
    min_p_first: bool = False
    default_samplers: tuple[str, ...] = ()
    logprobs_mode: str = "raw_logprobs"

    def acts_on(self, field: str) -> bool:
        """Whether the request field ``field`` (a constraint or another sampler) changes what
        this server samples from."""
        return self.distribution_fields is None or field in self.distribution_fields


# The constraint and sampler fields each engine's OpenAI-compatible server acts on, read in its
# source: vLLM 0.32's request models (vllm/entrypoints/openai/*/protocol.py; it ignores other
# fields with a warning), llama-server's request schema (tools/server/server-schema.cpp, the
# llama.cpp vendored by llama-cpp-python 0.3.36), llama-cpp-python 0.3.36's
# (llama_cpp/server/types.py).
VLLM_ACTS_ON = frozenset({"use_beam_search", "min_tokens", "structured_outputs",
                          "allowed_token_ids", "bad_words", "logit_bias", "response_format",
                          "text"})
LLAMA_SERVER_ACTS_ON = frozenset({"typical_p", "mirostat", "xtc_probability", "dry_multiplier",
                                  "top_n_sigma", "dynatemp_range", "samplers",
                                  "adaptive_target", "grammar", "json_schema",
                                  "response_format", "logit_bias", "ignore_eos"})
LLAMA_CPP_PYTHON_ACTS_ON = frozenset({"mirostat_mode", "min_tokens", "grammar", "logit_bias",
                                      "response_format"})

# vLLM without a model's generation_config.json (``--generation-config vllm``): temperature 1,
# no truncation, no penalty. OpenAI's API means the same.
NEUTRAL = ServerDefaults(temperature=1.0)

# Starting points for the backend block; the server's launch flags can change them.
SERVER_DEFAULTS: dict[str, ServerDefaults] = {
    # llama.cpp's server (llama-server): top_k 40, top_p 0.95, min_p 0.05, temperature 0.8,
    # repeat_penalty 1.0 over the last 64 tokens, the prompt's among them (its server hands
    # every prompt token to the sampler, init_sampler in server-context.cpp; measured on it:
    # benchmarks/llm_llama_server_penalties.py); temperature last. A server says its own at
    # GET /props, which the verifier reads (llama_server_defaults).
    "llama.cpp": ServerDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                penalty_last_n=64, temperature_last=True,
                                penalty_fields=("repeat_penalty",),
                                penalties_share_window=True,
                                distribution_fields=LLAMA_SERVER_ACTS_ON),
    # llama-cpp-python's server (llama_cpp.server): the same chain, but repeat_penalty 1.1
    # unless told (its server's default; its Llama API's is 1.0), over the last 64 sampled
    # tokens only (its sampler never sees the prompt's).
    "llama-cpp-python": ServerDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                       repetition_penalty=1.1, penalty_last_n=64,
                                       temperature_last=True, penalize_prompt=False,
                                       penalty_fields=("repeat_penalty",),
                                       reads_repeat_last_n=False,
                                       penalties_share_window=True,
                                       distribution_fields=LLAMA_CPP_PYTHON_ACTS_ON),
    # vLLM applies the sampling fields of the model's generation_config.json over its neutral
    # defaults (``--generation-config auto``, its default: 0.32 here): which they are is not
    # known until the block declares the file (options.generation_config) or the values
    # (options.server_defaults). Qwen2.5-Instruct's, for one, sample at temperature 0.7,
    # top_p 0.8, top_k 20 and repetition_penalty 1.05, not at vLLM's temperature 1. Its
    # sampler (vllm/v1/sample/sampler.py, 0.32): penalties, temperature, min_p, top_k/top_p.
    "vllm": ServerDefaults(temperature=None, top_p=None, top_k=None, min_p=None,
                           repetition_penalty=None, presence_penalty=None,
                           frequency_penalty=None, penalty_fields=("repetition_penalty",),
                           reads_repeat_last_n=False, min_p_first=True,
                           distribution_fields=VLLM_ACTS_ON),
    "openai": NEUTRAL,
    # Nothing known of the sampler: only greedy requests, and sampled requests that set the
    # temperature and every truncation, compare. Assuming "no truncation" where the server
    # has its own (llama.cpp's top_k 40, top_p 0.95, min_p 0.05; an instruct model's
    # generation_config.json under vLLM or SGLang) scores a healthy server's completions as
    # sharper than they should be: a llama.cpp primary at temperature 0.8, 12 completions of
    # 64 tokens, z -1.0 to -2.4 each, -5.9 pooled (benchmarks/llm_unknown_engine.py). The
    # penalties are taken as off (a greedy request is compared on that assumption).
    "unknown": ServerDefaults(top_p=None, top_k=None, min_p=None),
}


def server_defaults(declared: Mapping[str, Any] | None = None, engine: str = "unknown",
                    generation_config: Mapping[str, Any] | None = None,
                    reported: Mapping[str, Any] | None = None) -> ServerDefaults:
    """The defaults of ``engine`` (a key of SERVER_DEFAULTS: its sampler order and penalty
    window), with ``generation_config`` (the sampling fields vLLM takes from a model's
    generation_config.json, over its neutral defaults; engine vllm only), what the server
    ``reported`` it applies (llama-server's /props: :func:`llama_server_defaults`) and then
    what the backend block declares (None: not declared) laid over them, in that order."""
    if engine not in SERVER_DEFAULTS:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(SERVER_DEFAULTS)}")
    base = SERVER_DEFAULTS[engine]
    if generation_config is not None:
        if engine != "vllm":
            raise ValueError(f"generation_config: engine {engine} does not apply a model's "
                             "generation_config.json (vLLM does): declare server_defaults")
        # vLLM's neutral values under the file's, its sampler as it is
        neutral = {name: getattr(NEUTRAL, name) for name in SAMPLING_FIELDS}
        base = replace(base, **{**neutral,
                                **_known_fields(generation_config, "generation_config")})
    if reported is not None:
        base = llama_server_defaults(reported, base)
    return replace(base, **_known_fields(declared or {}, "server_defaults"))


# llama-server's samplers whose relative order guard models (its default chain: penalties, dry,
# top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature); the others act only when on.
_LLAMA_MODELLED = ("penalties", "top_k", "top_p", "min_p", "temperature")
# Its settings of guard's transform, by the field each sets (top_k and repeat_last_n apart).
_LLAMA_SETTINGS = (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                   ("repetition_penalty", "repeat_penalty"),
                   ("presence_penalty", "presence_penalty"),
                   ("frequency_penalty", "frequency_penalty"))
# The settings of its samplers guard does not model, each with the test for "on" (llama.cpp's
# common/sampling.cpp: mirostat 1 or 2, which replaces the whole chain, penalties included; XTC
# with a probability; typical_p below 1; DRY with a multiplier; top-n-sigma above 0; a dynamic
# temperature range). adaptive-p acts only where the chain names it ("adaptive_p").
_LLAMA_SAMPLERS_ON: dict[str, Any] = {
    "mirostat": lambda v: v > 0, "xtc_probability": lambda v: v > 0,
    "typical_p": lambda v: v < 1, "dry_multiplier": lambda v: v > 0,
    "top_n_sigma": lambda v: v > 0, "dynatemp_range": lambda v: v > 0,
}
# Of those, the ones that keep the argmax where the temperature is 0 (a greedy call is then
# still compared): top-n-sigma keeps the best token, a dynamic temperature is a temperature.
ARGMAX_KEEPING = frozenset({"top_n_sigma", "dynatemp_range"})


def llama_server_defaults(params: Mapping[str, Any], base: ServerDefaults) -> ServerDefaults:
    """``base`` (the llama.cpp preset) with what a llama-server reports it applies where a
    request does not say (``GET /props``'s ``default_generation_settings.params``: its
    defaults after the GGUF's ``general.sampling.*`` metadata and its launch flags): the
    values, the penalty window, the sampler chain's order, and the samplers guard does not
    model that are on. A setting missing from the answer keeps the preset's."""
    # llama-server holds its settings as float32 and writes them as doubles (0.8 comes as
    # 0.800000011920929): the shortest decimal that is the same float32 is what it meant.
    number = {key: float(value) if isinstance(value, int) else float(str(np.float32(value)))
              for key, value in params.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool)}
    told: dict[str, Any] = {field: number[key] for field, key in _LLAMA_SETTINGS
                            if key in number}
    if "top_k" in number:
        told["top_k"] = max(int(number["top_k"]), 0)  # (0 or less: off)
    if "repeat_last_n" in number:
        told["penalty_last_n"] = max(int(number["repeat_last_n"]), -1)
    on = tuple(name for name, test in _LLAMA_SAMPLERS_ON.items()
               if name in number and test(number[name]))
    chain = params.get("samplers")
    if isinstance(chain, list):
        if "adaptive_p" in chain:
            on += ("adaptive_p",)
        order = [name for name in chain if name in _LLAMA_MODELLED]
        kept = [name for name in order if name != "penalties"]
        if sorted(order) != sorted(_LLAMA_MODELLED) or order[0] != "penalties" or \
                "infill" in chain or kept[0] != "temperature" and kept[-1] != "temperature":
            on += ("samplers",)  # a chain guard does not rebuild
        else:
            told["temperature_last"] = kept[-1] == "temperature"
            told["min_p_first"] = kept.index("min_p") < kept.index("top_p")
    return replace(base, **told, default_samplers=base.default_samplers + on)


# Every key of /props' params that llama_server_defaults reads: what a capture record keeps of
# a server's report (GenerationSample.server_settings), so that a replay scores the call with
# the defaults the live verifier used, at a few hundred bytes instead of /props' whole answer.
LLAMA_SERVER_KEYS = tuple(key for _, key in _LLAMA_SETTINGS) + (
    "top_k", "repeat_last_n", "samplers", *_LLAMA_SAMPLERS_ON)


def llama_server_sampling(params: Mapping[str, Any]) -> dict[str, Any]:
    """What of a llama-server's /props params decides its sampling defaults (the keys
    :func:`llama_server_defaults` reads), as it reported them."""
    return {key: params[key] for key in LLAMA_SERVER_KEYS if key in params}


def reported_fields(defaults: ServerDefaults) -> dict[str, Any]:
    """What the event ``llama_server_defaults`` says of the defaults a server reported."""
    return {"temperature": defaults.temperature, "top_k": defaults.top_k,
            "top_p": defaults.top_p, "min_p": defaults.min_p,
            "repeat_penalty": defaults.repetition_penalty,
            "repeat_last_n": defaults.penalty_last_n,
            "temperature_last": defaults.temperature_last,
            "not_modelled": list(defaults.default_samplers)}


def _known_fields(values: Mapping[str, Any], key: str) -> dict[str, Any]:
    told = {k: v for k, v in values.items() if v is not None}
    unknown = sorted(set(told) - set(ServerDefaults.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown field")
    return told


@dataclass(frozen=True)
class GenerationThresholds:
    """The tier's defaults. Why these values: docs/generation.md (measured ladder)."""

    # Mean KLD per token (nats) over one completion, logprobs mode. Q8_0's ladder mean is
    # 0.0046 and Q2_K's 0.52: 0.05 sits near their geometric mean.
    max_mean_kld: float = 0.05
    # |z| of one sampled completion (N(0, 1) under agreement over many tokens: 4 is 6e-5
    # two-sided); a short one fails only where Chernoff's bound is at most exp(-max_abs_z^2/2).
    max_abs_z: float = 4.0
    # Reference margin (nats) above which an argmax flip is not kernel noise.
    margin_floor: float = 1.0
    # Greedy: the share of confident positions where the primary left the reference's argmax.
    max_greedy_disagreement: float = 0.05
    # Sampling at or below this temperature (or top_k 1) is checked as greedy: the server
    # leaves a confident argmax with a chance of e^(-margin_floor / T) at most, and the
    # sampled z would amplify kernel noise by 1 / T (guard/config/generation.py says more).
    near_greedy_temperature: float = 0.1
    # Weight of the untransformed distribution in the sampled surprise (finite for a token the
    # transform excludes).
    support_epsilon: float = 0.05
    # Fewer compared positions than this: not comparable (counted, not scored).
    min_tokens: int = 1
    # The server's prompt ids against the reference's own rendering of the same messages or
    # text: "must_match" fails a completion whose prompt the server rendered otherwise (chat
    # template or tokenizer drift); "server" takes the server's rendering as intended (a
    # deliberate --chat-template) and only reports the difference.
    prompt_rendering: str = "must_match"



def declared_defaults(primary_options: Mapping[str, Any] | None,
                      reported: Mapping[str, Any] | None = None) -> ServerDefaults:
    """The sampling defaults the primary's server applies: its block's ``options.engine``
    preset (sampler order, penalty window), the sampling fields of the generation_config.json
    that ``options.generation_config`` names (vLLM), what the server ``reported`` it applies
    (llama-server's /props: :func:`llama_server_defaults`), and ``options.server_defaults``
    over them; ``options.logprobs_mode`` says what its logprobs are."""
    options = dict(primary_options or {})
    source = options.get("generation_config")
    from_file = None
    if source is not None:
        from_file = generation_config_defaults(str(source))
    defaults = server_defaults(options.get("server_defaults"),
                               options.get("engine") or "unknown", from_file, reported)
    mode = options.get("logprobs_mode") or "raw_logprobs"
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode: {mode!r} is not one of {', '.join(LOGPROBS_MODES)}")
    return replace(defaults, logprobs_mode=mode)
