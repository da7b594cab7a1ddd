"""The OpenAI-compatible HTTP API as data: requests, answers (plain JSON or Server-Sent Events),
the byte-exact edits the edge makes to them, and the :class:`GenerationSample` they add up to.

Protocol-free of any HTTP library: the edge (guard/serve/openai_edge.py) feeds it bytes and
gets bytes back, and so can any other observer of the same traffic (Envoy mode, capture
replay). One module per job, their public names gathered here (``from guard.protocol import
openai as api``; ``api.parse_request``):

- ``requests``: the checked endpoints, a client's body parsed into a call, its sampling
  transform, a sampled call's body;
- ``json_edits``: the byte-exact edits of an answer's JSON (the model's name, logprobs and
  token ids guard asked for);
- ``sse``: Server-Sent Events reassembled across chunks, and edited one by one;
- ``answers``: an answer or its events gathered into a completion, whether it can be compared,
  and the sample of a call;
- ``errors``: OpenAI's error body and the gRPC status name of an HTTP status.
"""

from guard.protocol.openai.requests import (
    BadRequest,
    CONSTRAINT_FIELDS,
    Call,
    CallShape,
    PATHS,
    ParsedCall,
    SAMPLER_FIELDS,
    chat_messages,
    first_prompt,
    lists_tools,
    model_of,
    served_model,
    parse_request,
    responses_messages,
    sampled_body,
    sampling_params,
)
from guard.protocol.openai.json_edits import (
    LOGPROBS_PATH,
    MODEL_PATH,
    TOKEN_ID_PATHS,
    answer_edits,
    replace_values,
    set_model,
    value_spans,
)
from guard.protocol.openai.sse import EventSplitter, EventTooLarge, edit_event, event_data
from guard.protocol.openai.answers import (
    CUT_SHORT,
    Completion,
    DONE,
    RESPONSE_ENDS,
    RESPONSE_FAILS,
    build_sample,
    chunk_has_content,
    data_has_content,
    data_needs_parse,
    gather,
    gather_answer,
    gather_event,
    unusable,
)
from guard.protocol.openai.errors import error_body, status_code_name

__all__ = [
    "BadRequest",
    "CONSTRAINT_FIELDS",
    "CUT_SHORT",
    "Call",
    "CallShape",
    "Completion",
    "DONE",
    "EventSplitter",
    "EventTooLarge",
    "LOGPROBS_PATH",
    "MODEL_PATH",
    "PATHS",
    "ParsedCall",
    "RESPONSE_ENDS",
    "RESPONSE_FAILS",
    "SAMPLER_FIELDS",
    "TOKEN_ID_PATHS",
    "answer_edits",
    "build_sample",
    "chat_messages",
    "first_prompt",
    "chunk_has_content",
    "data_has_content",
    "data_needs_parse",
    "edit_event",
    "error_body",
    "event_data",
    "gather",
    "gather_answer",
    "gather_event",
    "lists_tools",
    "model_of",
    "served_model",
    "parse_request",
    "replace_values",
    "set_model",
    "responses_messages",
    "sampled_body",
    "sampling_params",
    "status_code_name",
    "unusable",
    "value_spans",
]
