"""The OpenAI-compatible API as data (guard/protocol/openai/), the GENERATION ring record
(guard/ipc/wire.py) and the ``openai`` backend block's validation."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import pytest
import hypothesis

import fuzz_openai
from guard.plan.serving import parse_config
from guard.errors import ConfigError
from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.protocol import generation
from guard.protocol import openai as api

UPSTREAM = {"backend": "openai", "target": "http://127.0.0.1:8081", "model": "smol-q4"}


# -- requests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, why", [
    (b"not json", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[1, 2]", "JSON object"),
    ('{"model": "m", "prompt": "x"}'.encode("utf-16"), "not JSON in UTF-8"),
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deep"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "cannot read"),
    (b'{"model": "a", "prompt": "x", "model": "b"}', "'model' more than once"),
    (b'{"model": ["m"], "messages": [{"role": "user", "content": "x"}]}', "'model'"),
])
def test_a_body_guard_cannot_route_is_refused_saying_why(data, why):
    with pytest.raises(api.BadRequest, match=why):
        api.parse_request("chat", data)


def test_a_body_behind_a_byte_order_mark_is_read_past_it_and_forwarded_with_it():
    """RFC 8259 lets a parser ignore a leading BOM; llama-server and Envoy's json_to_metadata
    do, so guard does too: the call is read and routed, and its bytes go on with the BOM (the
    upstream's to answer), the model's name spliced after it."""
    data = b'\xef\xbb\xbf{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    call = api.parse_request("chat", data)
    assert (call.model, call.not_comparable) == ("m", "")
    assert api.set_model(data, "smol-q4") == data.replace(b'"m"', b'"smol-q4"')
    assert api.set_model(b'\xef\xbb\xbf{"messages": []}', "s") == \
        b'\xef\xbb\xbf{"model":"s","messages": []}'


@pytest.mark.parametrize("endpoint, data", [
    ("chat", b'{"model": "m"}'), ("chat", b'{"model": "m", "messages": []}'),
    ("chat", b'{"model": "m", "messages": "hi"}'),
    ("chat", b'{"model": "m", "messages": [{}], "stream": "yes"}'),
    ("chat", b'{"model": "m", "messages": [{}], "stream": 1}'),
    ("completions", b'{"model": "m"}'), ("responses", b'{"model": "m", "input": []}'),
])
def test_a_body_without_what_guard_reads_is_the_upstreams_to_answer(endpoint, data):
    """Forwarded, not refused: llama-server answers an empty chat, vLLM reads "stream": 1
    as true; what guard cannot read is not compared (``input``)."""
    call = api.parse_request(endpoint, data)
    assert (call.not_comparable, call.stream) == ("input", False)


def test_completions_calls_that_cannot_be_compared_say_why():
    assert api.parse_request("chat", b'{"model": "m", "messages": [{}], "stream": null}'
                             ).not_comparable == ""  # (null: false, as OpenAI's API has it)
    chat = '{"model": "m", "messages": [{"role": "user", "content": "x"}]%s}'
    assert api.parse_request("chat", (chat % "").encode()).not_comparable == ""
    # Several completions: the first is compared; the best of several is no sample.
    for extra, reason in ((', "n": 2', ""), (', "n": 0', "n"), (', "n": true', "n"),
                          (', "n": "2"', "n"), (', "best_of": 2', "n")):
        assert api.parse_request("chat", (chat % extra).encode()).not_comparable == reason
    # A chat's tools are decided by its answer (tool calls are compared by the server's ids);
    # the other endpoints cannot say them.
    tools = ', "tools": [{"type": "function", "function": {"name": "f"}}]'
    offered = api.parse_request("chat", (chat % tools).encode())
    assert offered.not_comparable == "" and offered.offers_tools
    none = api.parse_request("chat", (chat % ', "tool_choice": "none"').encode())
    assert none.not_comparable == "" and not none.offers_tools
    responses = '{"model": "m", "input": "x"%s}' % tools
    assert api.parse_request("responses", responses.encode()).not_comparable == "tools"
    # A prompt however it is written (text, token ids, a batch): a batch's first is choice 0's.
    for prompt, first in (('"a"', "a"), ('["a"]', "a"), ('["a", "b"]', "a"),
                          ("[1, 2, 3]", (1, 2, 3)), ("[[1, 2]]", (1, 2)),
                          ("[[1], [2, 3]]", (1,)), ("[]", None), ('[true]', None),
                          ("[-1]", None), ('[["a"]]', None), ('["a", [1]]', None),
                          ("null", None)):
        call = api.parse_request("completions", b'{"model": "m", "prompt": %s}' % prompt.encode())
        assert (call.prompt, call.not_comparable) == (first, "" if first else "prompt_list"), \
            prompt
    completion = '{"model": "m", "prompt": "x"%s}'
    for extra, reason in ((', "best_of": 3', "n"), (', "best_of": 1', ""),
                          (', "best_of": null', ""), (', "echo": true', "echo"),
                          (', "echo": false', ""), (', "suffix": "}"', "input"),
                          (', "suffix": ""', "input"), (', "suffix": null', "")):
        assert api.parse_request("completions", (completion % extra).encode()
                                 ).not_comparable == reason, extra
    assert api.parse_request("chat", (chat % ', "echo": true').encode()).not_comparable == "echo"


@pytest.mark.parametrize("extra, constraints, samplers", [
    ({}, (), ()),
    ({"response_format": {"type": "text"}, "logit_bias": {}, "grammar": "", "min_tokens": 0,
      "typical_p": 1.0, "mirostat_mode": 0, "tfs_z": 1.0, "xtc_probability": 0,
      "dry_multiplier": 0.0, "top_n_sigma": -1, "use_beam_search": False,
      "structured_outputs": {"backend": "xgrammar"}, "guided_json": None}, (), ()),
    ({"response_format": {"type": "json_object"}}, ("response_format",), ()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
     ("response_format",), ()),
    ({"logit_bias": {"50256": -100}, "min_tokens": 4}, ("logit_bias", "min_tokens"), ()),
    ({"grammar": 'root ::= "yes" | "no"'}, ("grammar",), ()),
    ({"json_schema": {"type": "object"}}, ("json_schema",), ()),
    ({"guided_choice": ["yes", "no"], "allowed_token_ids": [1, 2]},
     ("guided_choice", "allowed_token_ids"), ()),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("structured_outputs",), ()),
    ({"bad_words": ["Paris"]}, ("bad_words",), ()),
    ({"typical_p": 0.9, "mirostat_mode": 2}, (), ("typical_p", "mirostat_mode")),
    ({"mirostat": 1, "xtc_probability": 0.5, "dry_multiplier": 0.8},
     (), ("mirostat", "xtc_probability", "dry_multiplier")),
    ({"top_n_sigma": 1.5, "dynatemp_range": 0.5, "tfs_z": 0.95},
     (), ("tfs_z", "top_n_sigma", "dynatemp_range")),
    ({"use_beam_search": True, "grammar": "root ::= [a-z]+"}, ("grammar",),
     ("use_beam_search",)),
])
def test_decoding_outside_guards_transform_is_named_in_the_sampling(extra, constraints,
                                                                    samplers):
    """Fields that constrain decoding (OpenAI's, vLLM's, llama.cpp's spellings) or turn on a
    sampler guard does not model are named, in the table's order; their neutral values are
    not."""
    params = api.sampling_params({"model": "m", "prompt": "x", **extra})
    assert (params.constraints, params.other_samplers) == (constraints, samplers)
    record = generation.to_dict(generation.GenerationSample(
        model="m", endpoint="completions", completion_text="", tokens=(), sampling=params))
    assert generation.from_dict(record).sampling == params
    record["sampling"]["constraints"] = [1]
    with pytest.raises(ValueError, match="sampling.constraints: expected a list of strings"):
        generation.from_dict(record)
    del record["sampling"]["constraints"], record["sampling"]["other_samplers"]
    assert generation.from_dict(record).sampling.constraints == ()  # a record from before


def test_sampling_params_are_what_the_request_says_and_none_where_it_is_silent():
    body = {"model": "m", "prompt": "x", "temperature": 0, "top_k": 40, "min_p": 0.05,
            "max_tokens": 16, "stop": "\n", "seed": 3, "logprobs": 5}
    params = api.sampling_params(body)
    assert (params.temperature, params.top_k, params.min_p, params.max_tokens) == (0.0, 40,
                                                                                    0.05, 16)
    assert params.greedy and params.stop == ("\n",) and params.seed == 3
    assert params.logprobs == 5 and params.top_p is None and params.repetition_penalty is None
    chat = api.sampling_params({"logprobs": True, "top_logprobs": 3, "top_p": 0.9})
    assert (chat.logprobs, chat.top_p, chat.temperature) == (3, 0.9, None)
    assert api.sampling_params({"temperature": "hot", "top_k": 1.5}).temperature is None


def test_the_repetition_penalty_is_kept_under_the_name_the_client_used():
    """vLLM reads repetition_penalty, llama.cpp's servers repeat_penalty, each ignores the
    other: the sample keeps them apart (capture format_version 4), and a record from before,
    whose one field held either, reads as both."""
    vllms = api.sampling_params({"repetition_penalty": 1.2})
    llamas = api.sampling_params({"repeat_penalty": 1.3})
    assert (vllms.repetition_penalty, vllms.repeat_penalty) == (1.2, None)
    assert (llamas.repetition_penalty, llamas.repeat_penalty) == (None, 1.3)
    sample = generation.GenerationSample(model="m", endpoint="completions",
                                         completion_text="", tokens=(), prompt="x",
                                         sampling=llamas)
    data = generation.to_dict(sample)
    assert data["format_version"] == 4 < generation.FORMAT_VERSION
    assert generation.from_dict(json.loads(json.dumps(data))).sampling == llamas
    plain = generation.to_dict(replace(sample, sampling=api.sampling_params({})))
    assert plain["format_version"] == 1 and "repeat_penalty" not in plain["sampling"]
    older = dict(plain, sampling=dict(plain["sampling"], repetition_penalty=1.1))
    read = generation.from_dict(older).sampling
    assert (read.repetition_penalty, read.repeat_penalty) == (1.1, 1.1)


# -- byte-exact edits ----------------------------------------------------------------------------
def test_replacing_a_value_keeps_every_other_byte_as_the_server_wrote_it():
    data = (b'{ "id" : "c", "model":"up",\n "choices": [ {"text": "a \\"model\\": \\"x\\"",'
            b' "logprobs": {"tokens": ["a"], "n": [1, {"k": [2]}]}}, {"logprobs" :null} ],'
            b' "usage": {"model": "inner"} }')
    edited = api.replace_values(data, api.answer_edits("client", strip_logprobs=True))
    assert edited == (b'{ "id" : "c", "model":"client",\n "choices": [ {"text": "a \\"model\\": '
                      b'\\"x\\"", "logprobs": null}, {"logprobs" :null} ], "usage": {"model": '
                      b'"inner"} }')
    assert json.loads(edited)["usage"]["model"] == "inner"  # only the top-level key
    assert api.replace_values(data, {}) is data
    # The client's name is set whatever the upstream answered; an answer that says it already
    # is the server's bytes, not a copy.
    assert api.answer_edits("same", strip_logprobs=False) == {api.MODEL_PATH: b'"same"'}
    named = b'{"id": "c", "model": "same", "choices": []}'
    assert api.replace_values(named, api.answer_edits("same", False)) is named
    with pytest.raises(ValueError):  # broken on the way to the model key
        api.replace_values(b'{"choices": [, "model": "up"}', {api.MODEL_PATH: b'"x"'})
    with pytest.raises(ValueError):
        api.replace_values(b'{"id": nope, "model": "up"}', {api.MODEL_PATH: b'"x"'})
    # Past the last edited value the document is not read: what breaks there stays as it is.
    assert api.replace_values(b'{"model": "up", "choices": [', {api.MODEL_PATH: b'"x"'}) == (
        b'{"model": "x", "choices": [')


def test_a_request_body_is_given_the_upstreams_name_where_it_names_none():
    assert api.set_model(b'{"model": "smol", "prompt": "a"}', "smol-q4") == (
        b'{"model": "smol-q4", "prompt": "a"}')
    for body in (b'{"prompt": "a"}', b' {\n "prompt": "a"}', b'{"model": null, "prompt": "a"}',
                 b'{"prompt": "a", "n": 1, "model": ""}', b'{}'):
        edited = api.set_model(body, "smol-q4")
        assert json.loads(edited) == dict(json.loads(body), model="smol-q4")
    assert api.set_model(b'{"prompt": "a"}', "sm\u00f6l") == (
        '{"model":"sm\u00f6l","prompt": "a"}'.encode())  # UTF-8, as the body is
    with pytest.raises(ValueError):
        api.set_model(b'["prompt"]', "smol-q4")


def test_only_the_generation_model_serves_a_call_naming_none():
    assert api.served_model("smol", ["smol", "big"]) == "smol"
    assert api.served_model("", ["smol"]) == "smol"
    assert api.served_model("", ["smol", "big"]) is None and api.served_model("", []) is None
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert api.parse_request("chat", body).model == ""
    assert api.model_of(b'{"model": null, "prompt": "a"}') == ""
    with pytest.raises(api.BadRequest, match="'model' must be a string"):
        api.parse_request("chat", b'{"model": 7, "messages": [{"role": "user"}]}')


def test_replacement_agrees_with_a_parse_on_random_documents():
    rng = random.Random(7)

    def value(depth):
        kind = rng.randrange(6 if depth < 3 else 3)
        if kind == 0:
            return rng.choice([1, -2.5e-3, True, None])
        if kind in (1, 2):
            return rng.choice(["model", 'q"uote', "back\\slash", "ünï", "{[,:]}"])
        if kind == 3:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["model", "logprobs", "a", "choices"]): value(depth + 1)
                for _ in range(rng.randrange(4))}

    for _ in range(300):
        items = [("model", "up"), ("x", value(0)), ("id", rng.choice(["c-1", 3, None])),
                 ("choices", [{"logprobs": value(1), "text": value(1)}
                              for _ in range(rng.randrange(3))])]
        rng.shuffle(items)  # the model key first (the fast path), or after nested values
        doc = dict(items)
        data = json.dumps(doc, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1])).encode()
        edited = json.loads(api.replace_values(data, api.answer_edits("cl", True)))
        expected = dict(doc, model="cl",
                        choices=[dict(c, logprobs=None) for c in doc["choices"]])
        assert edited == expected
        renamed = api.replace_values(data, api.answer_edits("cl", False))
        assert json.loads(renamed) == dict(doc, model="cl")


# -- Server-Sent Events ----------------------------------------------------------------------------
def test_events_are_reassembled_from_chunks_cut_anywhere():
    stream = (b'data: {"a": 1}\n\n: comment\r\n\r\ndata: {"b":\r\ndata: 2}\r\r'
              b'event: x\ndata: [DONE]\n\n')
    expected = [b'data: {"a": 1}\n\n', b": comment\r\n\r\n", b'data: {"b":\r\ndata: 2}\r\r',
                b"event: x\ndata: [DONE]\n\n"]
    rng = random.Random(3)
    for _ in range(200):
        splitter, events, at = api.EventSplitter(), [], 0
        while at < len(stream):
            step = rng.randrange(1, 9)
            events += splitter.feed(stream[at:at + step])
            at += step
        assert events == expected and splitter.rest() == b""
    splitter = api.EventSplitter()
    assert splitter.feed(b"data: 1\n\ndata: partial") == [b"data: 1\n\n"]
    assert splitter.rest() == b"data: partial"
    assert api.event_data(expected[2]) == b'{"b":\n2}'
    assert api.event_data(expected[1]) is None
    assert api.event_data(expected[3]) == api.DONE


def test_an_event_that_never_ends_is_refused_past_the_limit():
    splitter = api.EventSplitter(limit=100)
    assert splitter.feed(b"data: 1\n\ndata: ") == [b"data: 1\n\n"]
    for _ in range(9):
        assert splitter.feed(b"x" * 10) == []
    with pytest.raises(api.EventTooLarge):
        splitter.feed(b"x" * 10)
    with pytest.raises(api.EventTooLarge):  # one chunk longer than the limit
        api.EventSplitter(limit=100).feed(b"data: " + b"x" * 200)
    splitter = api.EventSplitter(limit=100)  # events first, then the refusal
    assert splitter.feed(b"data: 1\n\ndata: " + b"x" * 200) == [b"data: 1\n\n"]
    with pytest.raises(api.EventTooLarge):
        splitter.feed(b"x")
    # An event of many pieces, its end arriving CR by LF: found once whole.
    splitter = api.EventSplitter(limit=1 << 20)
    pieces = [b"data: ", *[b"y" * 100] * 1000, b"\r", b"\n", b"\r", b"\n"]
    events = [e for piece in pieces for e in splitter.feed(piece)]
    assert events == [b"data: " + b"y" * 100_000 + b"\r\n\r\n"] and splitter.rest() == b""


def test_an_answer_nested_past_the_stack_is_not_json_guard_reads():
    nested = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": "up"}'
    with pytest.raises(ValueError, match="nested too deep"):
        api.replace_values(nested, api.answer_edits("client", False))
    assert api.gather_answer("chat", nested, streamed=False).error == "the answer is not JSON"


def test_an_event_is_edited_only_where_it_is_one_line_of_json():
    edits = api.answer_edits("client", False)
    assert api.edit_event(b'data: {"model": "up"}\n\n', edits) == b'data: {"model": "client"}\n\n'
    assert api.edit_event(b'data:{"model":"up"}\r\n\r\n', edits) == (
        b'data:{"model":"client"}\r\n\r\n')
    # The Responses API's events name themselves on a line before their data.
    assert api.edit_event(b'event: response.created\r\ndata: {"model": "up"}\r\n\r\n',
                          edits) == b'event: response.created\r\ndata: {"model": "client"}\r\n\r\n'
    for untouched in (b"data: [DONE]\n\n", b": ping\n\n", b'data: {"model":\ndata: "up"}\n\n',
                      b'data: {"id": broken, "model": "up"}\n\n', b"event: ping\n\n",
                      b'event: x\ndata: {"a": 1}\ndata: {"model": "up"}\n\n'):
        assert api.edit_event(untouched, edits) == untouched


# -- answers -> the sample -------------------------------------------------------------------------
def test_a_chat_stream_with_logprobs_becomes_the_sample_token_by_token():
    call = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Capital of France?"}],
        "temperature": 0, "stream": True}).encode())
    completion = api.Completion()
    chunks = [{"model": "up", "choices": [{"delta": {"role": "assistant"}}]}]
    for text, lp in ((" Paris", -0.26), (".", -1.5)):
        chunks.append({"model": "up", "choices": [{"delta": {"content": text}, "logprobs": {
            "content": [{"token": text, "logprob": lp, "top_logprobs": [
                {"token": text, "logprob": lp}, {"token": " Lyon", "logprob": -3.0}]}]}}]})
    chunks.append({"model": "up", "choices": [{"delta": {}, "finish_reason": "stop"}]})
    for c in chunks:
        api.gather(completion, "chat", c, streamed=True)
    assert [api.chunk_has_content(c, "chat") for c in chunks] == [False, True, True, False]
    sample = api.build_sample(call, completion, route="primary", request_id="r", streamed=True,
                              guard_logprobs=True)
    assert sample.completion_text == " Paris." and sample.finish_reason == "stop"
    assert [t.text for t in sample.tokens] == [" Paris", "."] and sample.has_logprobs
    assert sample.tokens[0].top == ((" Paris", -0.26), (" Lyon", -3.0))
    assert sample.sampling.greedy and sample.sampling.logprobs is None  # guard's, not asked
    assert sample.messages[0]["content"] == "Capital of France?" and sample.prompt is None
    assert sample.upstream_model == "up"


# vLLM 0.32's streamed chat chunks for one call, asked with return_token_ids (the left) and
# without (the right), as it sent them (SmolLM2, greedy, "Write ιώτα in Greek", 3 tokens).
_VLLM_CHUNKS = [(
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    b'0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":[1,9690,198],"prompt_text":null}',
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    b'0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":null,"prompt_text":null}'), (
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    b'0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":[153]}]}',
    b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    b'0,"delta":{"content":""},"logprobs":null,"finish_reason":null,"token_ids":null}]}'), (
    '{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    '0,"delta":{"content":"Χ"},"logprobs":null,"finish_reason":null,"token_ids":[117]}]}'
    .encode(),
    '{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    '0,"delta":{"content":"Χ"},"logprobs":null,"finish_reason":null,"token_ids":null}]}'
    .encode()), (
    '{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    '0,"delta":{"content":"ρ"},"logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"token_ids":[13583]}],"system_fingerprint":"vllm-0.32.0"}'.encode(),
    '{"id":"c","object":"chat.completion.chunk","created":1,"model":"smol","choices":[{"index":'
    '0,"delta":{"content":"ρ"},"logprobs":null,"finish_reason":"length","stop_reason":null,'
    '"token_ids":null}],"system_fingerprint":"vllm-0.32.0"}'.encode())]


def test_the_token_ids_guard_asks_vllm_for_become_the_sample_and_leave_the_answer():
    call = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Write ιώτα in Greek"}],
        "temperature": 0, "stream": True}).encode())
    assert not call.asked_token_ids
    body = api.sampled_body(call, 0, token_ids=True)
    assert body["return_token_ids"] is True and "logprobs" not in body
    assert api.sampled_body(call, 5, token_ids=False)["top_logprobs"] == 5
    edits = api.answer_edits("smol", strip_logprobs=False, strip_token_ids=True)
    completion = api.Completion()
    for asked, unasked in _VLLM_CHUNKS:
        event = b"data: " + asked + b"\n\n"
        assert api.edit_event(event, edits) == b"data: " + unasked + b"\n\n"  # byte for byte
        api.gather(completion, "chat", json.loads(asked), streamed=True)
    sample = api.build_sample(call, completion, route="primary", request_id="r", streamed=True)
    assert sample.prompt_token_ids == (1, 9690, 198)
    assert [(t.text, t.token_id, t.logprob) for t in sample.tokens] == [
        ("", 153, None), ("", 117, None), ("", 13583, None)]
    assert sample.completion_text == "Χρ" and not sample.has_logprobs
    # A completions answer carries both lists in its choice; unasked, both are null.
    answer = (b'{"choices":[{"index":0,"text":" une","finish_reason":"length",'
              b'"token_ids":[16520],"prompt_token_ids":[7026,1981]}],"usage":null}')
    assert api.replace_values(answer, edits) == (
        b'{"choices":[{"index":0,"text":" une","finish_reason":"length",'
        b'"token_ids":null,"prompt_token_ids":null}],"usage":null}')
    assert api.parse_request("completions", b'{"model": "m", "prompt": "x", '
                             b'"return_token_ids": true}').asked_token_ids


def test_a_chunks_tokens_are_told_from_its_bytes_as_from_its_parse():
    """The edge's unsampled calls parse no event: the byte test must say what the parse says
    for the chunks servers send (roles, empty and null contents, logprobs whose "content" is a
    list, tool calls, finish- and usage-only chunks, escapes and non-ASCII text)."""
    rng = random.Random(11)
    texts = ["", " Paris", 'a "quote"', "line\nbreak", "é ✓", "\\", "{}", None]
    for _ in range(400):
        endpoint = rng.choice(["chat", "completions"])
        text = rng.choice(texts)
        choice: dict = {"index": 0, "finish_reason": rng.choice([None, "stop"])}
        if endpoint == "chat":
            delta: dict = {}
            if rng.random() < 0.3:
                delta["role"] = "assistant"
            if rng.random() < 0.8:
                delta["content"] = text
            if rng.random() < 0.1:
                delta["tool_calls"] = [{"function": {"arguments": '{"content": "x"}'}}]
            choice["delta"] = delta
            if rng.random() < 0.3:
                choice["logprobs"] = {"content": [{"token": text or "x", "logprob": -0.1,
                                                   "top_logprobs": []}]}
        else:
            choice["text"] = text
            if rng.random() < 0.3:
                choice["logprobs"] = {"tokens": [text or "x"], "token_logprobs": [-0.1],
                                      "top_logprobs": [{"text": -0.5}], "text_offset": [0]}
        chunk = {"id": "c", "model": "m", "choices": [choice] if rng.random() < 0.9 else []}
        if rng.random() < 0.2:
            chunk["usage"] = rng.choice([None, {"completion_tokens": 3}])
        data = json.dumps(chunk, ensure_ascii=rng.random() < 0.5,
                          separators=rng.choice([(",", ":"), (", ", ": ")])).encode()
        assert api.data_has_content(data, endpoint) == api.chunk_has_content(chunk, endpoint), data
        assert api.data_needs_parse(data) == isinstance(chunk.get("usage"), dict), data


def test_a_completion_answer_with_token_ids_and_usage():
    completion = api.Completion()
    api.gather(completion, "completions", {"model": "up", "usage": {"completion_tokens": 2},
                                           "choices": [{"text": " Paris.", "finish_reason":
                                                        "length", "prompt_token_ids": [1, 2],
                                                        "logprobs": {
        "tokens": ["token_id:12", "token_id:13"], "token_logprobs": [-0.2, None],
        "top_logprobs": [{"token_id:12": -0.2}, None]}}]}, streamed=False)
    assert completion.completion_tokens == 2 and completion.prompt_token_ids == (1, 2)
    assert [t.token_id for t in completion.tokens] == [12, 13]
    assert completion.tokens[1].logprob is None and completion.tokens[1].top == ()
    errored = api.Completion()
    api.gather(errored, "chat", {"error": {"message": "boom"}}, streamed=True)
    assert errored.error == "boom"


# -- the Responses API ----------------------------------------------------------------------------
# An answer as vLLM 0.32 wrote it (a real server's bytes, trimmed of fields guard does not read).
RESPONSE = {"id": "resp_1", "object": "response", "model": "smol-up", "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"}, "instructions": None,
            "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"annotations": [], "type": "output_text",
                                     "text": "The capital",
                                     "logprobs": [{"token": "The", "bytes": [84, 104, 101],
                                                   "logprob": -1.88,
                                                   "top_logprobs": [{"token": "The",
                                                                     "logprob": -1.88},
                                                                    {"token": "L",
                                                                     "logprob": -1.96}]},
                                                  {"token": " capital", "logprob": -0.02,
                                                   "top_logprobs": [{"token": " capital",
                                                                     "logprob": -0.02}]}]}]}],
            "top_logprobs": 2, "usage": {"input_tokens": 37, "output_tokens": 2}}


def test_a_responses_call_is_the_chat_it_renders():
    body = {"model": "smol", "instructions": "Be brief.", "max_output_tokens": 16,
            "temperature": 0.0, "top_logprobs": 3, "include": ["message.output_text.logprobs"],
            "input": [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": [{"type": "output_text",
                                                          "text": "Hello!"}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Bye"},
                                   {"type": "input_text", "text": "now"}]}]}
    call = api.parse_request("responses", json.dumps(body).encode())
    assert call.not_comparable == "" and call.asked_logprobs and not call.stream
    assert api.responses_messages(body) == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye\nnow"})
    completion = api.Completion()
    api.gather(completion, "responses", RESPONSE, streamed=False)
    sample = api.build_sample(call, completion)
    assert (sample.endpoint, sample.messages) == ("chat", api.responses_messages(body))
    assert sample.completion_text == "The capital" and sample.has_logprobs
    assert [(t.text, t.top) for t in sample.tokens] == [
        ("The", (("The", -1.88), ("L", -1.96))), (" capital", ((" capital", -0.02),))]
    assert (sample.finish_reason, sample.upstream_model) == ("length", "smol-up")
    assert completion.completion_tokens == 2
    assert (sample.sampling.max_tokens, sample.sampling.logprobs, sample.sampling.greedy) == (
        16, 3, True)
    plain = api.parse_request("responses", b'{"model": "m", "input": "Hi"}')
    assert not plain.asked_logprobs
    assert api.build_sample(plain, completion).messages == ({"role": "user", "content": "Hi"},)
    assert api.sampling_params({"input": "x", "top_logprobs": 3}, "responses").logprobs is None
    json_mode = {"input": "x", "text": {"format": {"type": "json_object"}}}
    assert api.sampling_params(json_mode, "responses").constraints == ("text",)
    assert api.sampling_params({"input": "x", "text": {"format": {"type": "text"}}},
                               "responses").constraints == ()


def test_a_chats_text_parts_are_kept_and_read_as_one_string_and_other_parts_are_not_comparable():
    """Content given as parts (the OpenAI SDK's typed messages): the sample keeps them as sent
    (a probe and llama-server's /apply-template get the client's messages; llama-server joins
    a continued answer's parts otherwise than a user's), and the reference's template reads
    them as one string, joined as vLLM and llama-server join them; an image makes the call
    not comparable."""
    from guard.backends.scoring import template_messages
    from guard.protocol.generation import rendered_as_served

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "this?"}]
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": parts}]}
    call = api.parse_request("chat", json.dumps(body).encode())
    assert call.not_comparable == ""
    sample = api.build_sample(call, api.Completion(text=["A cat."]))
    assert sample.messages == tuple(body["messages"])
    assert template_messages(sample.messages) == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\nthis?"})
    # Empty parts: vLLM leaves them out, llama-server writes a newline after each part but
    # before the first text (both read off the servers: tests/e2e/test_llama_cpp_server.py,
    # benchmarks/reliability_llm.py --server vllm).
    parts[1:1] = [{"type": "text", "text": ""}]
    parts.insert(0, {"type": "text", "text": ""})
    sample = api.build_sample(api.parse_request("chat", json.dumps(body).encode()),
                              api.Completion(text=["A cat."]))
    assert template_messages(sample.messages)[-1]["content"] == "What is\nthis?"
    assert rendered_as_served(sample, "llama.cpp").messages[-1]["content"] == "What is\n\nthis?"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    body["messages"][1]["content"] = [parts[0], image]
    assert api.parse_request("chat", json.dumps(body).encode()).not_comparable == "input"
    body["messages"] = ["not a message"]
    assert api.parse_request("chat", json.dumps(body).encode()).not_comparable == "input"


@pytest.mark.parametrize("extra, reason", [
    ({"previous_response_id": "resp_0"}, "stateful"), ({"conversation": "conv_1"}, "stateful"),
    ({"background": True}, "stateful"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": [{"role": "system", "content": "only a system message"}]}, "input"),
])
def test_a_responses_call_guard_cannot_render_says_why(extra, reason):
    body = {"model": "m", "input": "Hi", **extra}
    assert api.parse_request("responses", json.dumps(body).encode()).not_comparable == reason


@pytest.mark.parametrize("data", [b'{"model": "m"}', b'{"model": "m", "input": []}',
                                  b'{"model": "m", "input": 3}'])
def test_a_responses_body_without_its_input_is_forwarded_not_compared(data):
    assert api.parse_request("responses", data).not_comparable == "input"


def _events(*events: dict) -> bytes:
    return b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
                    for e in events)


def test_a_streamed_responses_answer_is_its_terminal_event():
    created = {"type": "response.created", "sequence_number": 0,
               "response": dict(RESPONSE, status="in_progress", output=[], usage=None)}
    deltas = [{"type": "response.output_text.delta", "delta": text, "item_id": "msg_1",
               "output_index": 0, "content_index": 0, "sequence_number": i + 1}
              for i, text in enumerate(["The", " capital"])]
    done = {"type": "response.completed", "sequence_number": 3, "response": RESPONSE}
    whole = api.gather_answer("responses", _events(created, *deltas, done), streamed=True)
    assert "".join(whole.text) == "The capital" and len(whole.tokens) == 2
    assert whole.ended and not whole.error and whole.completion_tokens == 2
    cut = api.gather_answer("responses", _events(created, *deltas), streamed=True)
    assert cut.error == api.CUT_SHORT
    failed = api.gather_answer("responses", _events(created, {
        "type": "response.failed", "response": dict(RESPONSE, status="failed",
                                                    error={"message": "engine died"})}),
        streamed=True)
    assert failed.error == "engine died"
    errored = api.gather_answer("responses", _events({"type": "error", "message": "boom"}),
                                streamed=True)
    assert errored.error == "boom"
    # Tokens are told from the bytes as from the parsed events; only the ends need a parse.
    for event in (created, *deltas, done, dict(deltas[0], delta="")):
        data = json.dumps(event).encode()
        assert api.data_has_content(data, "responses") == api.chunk_has_content(
            event, "responses") == (event in deltas), event
        assert api.data_needs_parse(data, "responses") == (event is done)
    # A reasoning delta is a generated token too: time to first token is the first of them.
    reasoning_delta = {"type": "response.reasoning_text.delta", "delta": "hm"}
    assert api.data_has_content(json.dumps(reasoning_delta).encode(), "responses")
    assert api.chunk_has_content(reasoning_delta, "responses")


def test_reasoning_and_tool_calls_in_an_answer_make_it_unusable():
    reasoned = api.Completion()
    api.gather(reasoned, "responses", dict(RESPONSE, output=[
        {"type": "reasoning", "summary": []}, *RESPONSE["output"]]), streamed=False)
    assert api.unusable(reasoned) == "reasoning"
    called = api.Completion()
    api.gather(called, "responses", dict(RESPONSE, output=[
        {"type": "function_call", "name": "f", "arguments": "{}"}]), streamed=False)
    assert api.unusable(called) == "tools"
    # A chat's reasoning without the output's tokens: the sample could not say them.
    chat = api.Completion()
    api.gather(chat, "chat", {"choices": [{"message": {"content": "Paris",
                                                       "reasoning_content": "think"}}]},
               streamed=False)
    assert api.unusable(chat) == "reasoning" and api.unusable(api.Completion()) == ""
    # A Responses reasoning item with the client's logprobs: they cover the message text alone.
    logged = api.Completion()
    api.gather(logged, "responses", dict(RESPONSE, output=[
        {"type": "reasoning", "summary": []}, {"type": "message", "content": [
            {"type": "output_text", "text": "Paris", "logprobs": [
                {"token": "Paris", "logprob": -0.1, "top_logprobs": []}]}]}]), streamed=False)
    assert logged.tokens and api.unusable(logged) == "reasoning"
    nothing = api.Completion()
    api.gather(nothing, "chat", {"error": None, "choices": [{"text": "x"}]}, streamed=False)
    assert nothing.error == ""  # an error key that is null is no error


def test_a_tool_call_is_sampled_where_the_server_said_the_prompts_and_the_outputs_ids():
    """vLLM 0.32 with --tool-call-parser hermes (as measured on SmolLM2): the call comes back
    parsed (``tool_calls``, no content), its logprobs and token ids those of the call's raw
    text. With the prompt's ids too (``sample_token_ids``) it is compared; without ids, or
    with a call the answer does not name, it is not comparable (``tools``)."""
    call = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "temperature": 0}).encode())
    message = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    with_ids = {"prompt_token_ids": [1, 2, 3], "choices": [{
        "message": message, "token_ids": [10, 11, 12], "finish_reason": "tool_calls"}]}
    completion = api.Completion()
    api.gather(completion, "chat", with_ids, streamed=False)
    assert completion.tool_names == ["get_weather"]
    assert api.unusable(completion, call) == ""
    sample = api.build_sample(call, completion, route="primary")
    assert sample.tools and sample.tool_calls == ("get_weather",)
    assert sample.prompt_token_ids == (1, 2, 3) and sample.completion_text == ""
    assert generation.from_dict(json.loads(json.dumps(generation.to_dict(sample)))) == sample
    # The tools offered travel with the sample: a fallback's probe offers them again.
    from guard.backends.openai_generate import probe_body

    offered = {"tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    assert sample.tool_request == offered
    assert probe_body(sample, "up", 5, token_ids=True).items() >= {
        **offered, "return_token_ids": True}.items()
    with pytest.raises(ValueError, match="tool_request"):
        generation.from_dict({**generation.to_dict(sample), "tool_request": ["tools"]})
    without_ids = api.Completion()
    api.gather(without_ids, "chat", {"choices": [{"message": message}]}, streamed=False)
    assert api.unusable(without_ids, call) == "tools"
    # A text answer to a chat that offered tools: compared by the ids as well, or not at all.
    text = {"prompt_token_ids": [1, 2], "choices": [{
        "message": {"role": "assistant", "content": "Hi"}, "token_ids": [5]}]}
    answered = api.Completion()
    api.gather(answered, "chat", text, streamed=False)
    plain = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}]}).encode())
    assert api.unusable(answered, call) == "" and api.unusable(answered, plain) == ""
    bare = api.Completion()
    api.gather(bare, "chat", {"choices": [{"message": {"content": "Hi"}}]}, streamed=False)
    assert api.unusable(bare, call) == "tools" and api.unusable(bare, plain) == ""
    # llama-server: the output's ids in its logprobs, the prompt's asked of it afterwards
    # (guard/backends/llama_server_prompts.py): the output's alone suffice here.
    logged = api.Completion()
    api.gather(logged, "chat", {"choices": [{"message": message, "logprobs": {"content": [
        {"id": 10, "token": "<tool_call>", "logprob": -0.1, "top_logprobs": []}]}}]},
        streamed=False)
    assert api.unusable(logged, call) == "tools"
    assert api.unusable(logged, call, prompt_ids_asked=True) == ""
    assert api.unusable(without_ids, call, prompt_ids_asked=True) == "tools"
    # A streamed chat that lists tools (llama-server gives no logprobs there): the verifier's
    # to probe where it is asked to (options.probe_streamed_tool_chats), a whole one not.
    streamed = api.parse_request("chat", json.dumps({**call.body, "stream": True}).encode())
    assert api.unusable(without_ids, streamed, True, probed_if_streamed=True) == ""
    assert api.unusable(without_ids, streamed, True) == "tools"
    assert api.unusable(without_ids, call, True, probed_if_streamed=True) == "tools"


def test_llama_server_is_asked_no_logprobs_on_a_streamed_tool_chat_and_its_prompts_after():
    """llama-server answers 400 to logprobs on a streamed chat that offers tools; its
    prompts' ids are asked of it after the answer (``options.tokenize_prompts``)."""
    from guard.backends.openai import OpenAIOptions

    llama = OpenAIOptions(engine="llama.cpp")
    assert llama.refuses_logprobs(api.CallShape("chat", streamed=True, tools=True))
    assert not llama.refuses_logprobs(api.CallShape("chat", streamed=False, tools=True))
    assert not llama.refuses_logprobs(api.CallShape("chat", streamed=True, tools=False))
    assert not OpenAIOptions(engine="vllm").refuses_logprobs(
        api.CallShape("chat", streamed=True, tools=True))
    assert llama.asks_prompt_ids
    assert not OpenAIOptions(engine="llama.cpp", tokenize_prompts=False).asks_prompt_ids
    assert not OpenAIOptions(engine="vllm").asks_prompt_ids


def test_of_several_completions_in_one_answer_the_first_is_sampled():
    """n > 1 or a batch of prompts: the answer holds a choice per completion (vLLM streams
    them interleaved, a chunk per choice), each sampled on its own path; choice 0, the first
    prompt's, is the sample."""
    def chunk(index: int, text: str, **more) -> bytes:
        return json.dumps({"choices": [{"index": index, "text": text, **more}]}).encode()

    call = api.parse_request("completions", json.dumps({
        "model": "m", "prompt": ["The capital of France is", "Water boils at"], "n": 2,
        "temperature": 0.8, "stream": True}).encode())
    assert call.not_comparable == "" and call.prompt == "The capital of France is"
    completion = api.Completion()
    for data in (chunk(0, " Paris"), chunk(2, " 100"), chunk(1, " Lyon"), chunk(0, ","),
                 chunk(3, " degrees"), chunk(1, ".", finish_reason="stop"),
                 chunk(0, " France", finish_reason="length")):
        api.gather_event(completion, "completions", data)
    sample = api.build_sample(call, completion, route="primary")
    assert (sample.completion_text, sample.finish_reason) == (" Paris, France", "length")
    assert sample.sampling.n == 2 and sample.prompt == "The capital of France is"
    whole = {"choices": [
        {"index": 1, "message": {"role": "assistant", "content": "Lyon"}, "token_ids": [9]},
        {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "token_ids": [7],
         "finish_reason": "stop"}], "prompt_token_ids": [1, 2]}
    chat = api.Completion()
    api.gather(chat, "chat", whole, streamed=False)
    assert "".join(chat.text) == "Paris" and [t.token_id for t in chat.tokens] == [7]
    assert chat.prompt_token_ids == (1, 2) and chat.finish_reason == "stop"


def test_a_prompt_the_server_may_cut_is_sampled_only_with_the_ids_it_kept():
    """vLLM's ``truncate_prompt_tokens``: compared on the prompt ids the answer says (the
    sample keeps the client's value: the scorer does not take the cut for another template),
    not comparable (``input``) without them; the probe asks for the same cut."""
    from guard.backends.openai_generate import probe_body

    for endpoint, request in (("chat", {"messages": [{"role": "user", "content": "Hi"}]}),
                              ("completions", {"prompt": "The capital"}),
                              ("completions", {"prompt": [1, 2, 3, 4]})):
        call = api.parse_request(endpoint, json.dumps({
            "model": "m", "truncate_prompt_tokens": 2, **request}).encode())
        assert call.prompt_truncation == 2 and call.not_comparable == ""
        choice = {"text": " Paris"} if endpoint == "completions" else {
            "message": {"role": "assistant", "content": " Paris"}}
        bare = api.Completion()
        api.gather(bare, endpoint, {"choices": [choice]}, streamed=False)
        assert api.unusable(bare, call) == "input"
        said = api.Completion()
        api.gather(said, endpoint, {"prompt_token_ids": [3, 4], "choices": [choice]},
                   streamed=False)
        assert api.unusable(said, call) == ""
        sample = api.build_sample(call, said, route="primary")
        assert (sample.prompt_token_ids, sample.prompt_truncation) == ((3, 4), 2)
        data = generation.to_dict(sample)
        assert data["format_version"] == 2
        assert generation.from_dict(json.loads(json.dumps(data))) == sample
        assert probe_body(sample, "up", 5)["truncate_prompt_tokens"] == 2
    assert api.parse_request("chat", json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "Hi"}],
        "truncate_prompt_tokens": None}).encode()).prompt_truncation is None
    with pytest.raises(ValueError, match="prompt_truncation"):
        generation.from_dict({**data, "prompt_truncation": "2"})


# Answers to {"prompt": "The capital of France is Paris", "max_tokens": 1, "logprobs": 1,
# "echo": true, "temperature": 0} on SmolLM2, as the servers gave them (trimmed): vLLM 0.32's
# tokens are the prompt's and the generated one; llama-cpp-python 0.3.36's stop at the prompt
# and sit a position off (" capital" scored by the distribution that predicts " of").
VLLM_ECHO = {"choices": [{"index": 0, "text": "The capital of France is Paris.", "logprobs": {
    "tokens": ["The", " capital", " of", " France", " is", " Paris", "."],
    "token_logprobs": [None, -11.5393, -0.3376, -2.4386, -0.4509, -0.2581, -0.3801],
    "top_logprobs": [None, {" capital": -11.5393, "-": -0.8655}, {" of": -0.3376},
                     {" France": -2.4386, " the": -2.1845}, {" is": -0.4509},
                     {" Paris": -0.2581}, {".": -0.3801}]}, "finish_reason": "length"}]}
LLAMA_CPP_PYTHON_ECHO = {"choices": [{"index": 0, "text": "The capital of France is Paris.",
                                      "logprobs": {
    "tokens": ["The", " capital", " of", " France", " is", " Paris"],
    "token_logprobs": [None, -9.6000, -10.4625, -11.2256, -11.7948, -8.4526],
    "top_logprobs": [None, {" of": -0.4121, " capital": -9.6000}, {" the": -1.9880},
                     {" is": -0.4320}, {" Paris": -0.2644}, {".": -0.3762}]},
    "finish_reason": "length"}]}


def test_an_echo_call_with_logprobs_is_compared_on_the_prompts_tokens_and_what_follows():
    """lm-eval's loglikelihood calls (echo, logprobs, max_tokens 1, not streamed) come back
    with the logprobs of the prompt's tokens: the sample is every token after the first, each
    with the primary's logprob, for the reference to score after that first token. An echo
    the sample cannot hold (streamed, without logprobs, a chat's) stays not comparable, and
    so does an answer whose tokens do not spell its text (llama-cpp-python's)."""
    from guard.backends.openai_generate import probe_body

    body = {"model": "smol", "prompt": "The capital of France is Paris", "max_tokens": 1,
            "logprobs": 1, "echo": True, "temperature": 0}
    call = api.parse_request("completions", json.dumps(body).encode())
    assert call.echo and call.not_comparable == "" and call.asked_logprobs
    completion = api.Completion()
    api.gather(completion, "completions", VLLM_ECHO, streamed=False)
    assert api.unusable(completion, call) == ""
    sample = api.build_sample(call, completion, route="primary")
    assert sample.echo and sample.prompt == "The capital of France is Paris"
    assert sample.completion_text == " capital of France is Paris."
    assert [t.text for t in sample.tokens] == [" capital", " of", " France", " is", " Paris", "."]
    assert sample.has_logprobs and sample.tokens[2].top[0] == (" the", -2.1845)
    data = generation.to_dict(sample)
    assert data["format_version"] == 3
    assert generation.from_dict(json.loads(json.dumps(data))) == sample
    from guard.replay.generation import prompt_text

    assert prompt_text(sample).startswith("(echo")  # the report shows the tokens once
    probe = probe_body(sample, "up", 5, token_ids=True)
    assert probe["echo"] is True and probe["prompt"] == body["prompt"]
    assert probe["max_tokens"] == 1 and "return_token_ids" not in probe
    shifted = api.Completion()
    api.gather(shifted, "completions", LLAMA_CPP_PYTHON_ECHO, streamed=False)
    assert api.unusable(shifted, call) == "echo"
    # A model whose tokenizer adds BOS: vLLM echoes it as the first token, outside the text
    # (measured on vLLM 0.32 with SmolLM2's tokenizer made to add <|im_start|>: tokens
    # ['<|im_start|>', 'The', ' capital', ...], logprobs [None, -8.2157, ...]).
    with_bos = json.loads(json.dumps(VLLM_ECHO))
    logprobs = with_bos["choices"][0]["logprobs"]
    logprobs["tokens"].insert(0, "<|im_start|>")
    logprobs["token_logprobs"][0] = -8.2157  # ("The" is predicted now, from BOS)
    logprobs["token_logprobs"].insert(0, None)
    logprobs["top_logprobs"][0] = {"The": -8.2157}
    logprobs["top_logprobs"].insert(0, None)
    bos_first = api.Completion()
    api.gather(bos_first, "completions", with_bos, streamed=False)
    assert api.unusable(bos_first, call) == ""
    scored = api.build_sample(call, bos_first, route="primary")
    assert scored.completion_text == "The capital of France is Paris."
    assert [t.text for t in scored.tokens][:2] == ["The", " capital"]
    for other in ({"stream": True}, {"logprobs": None}, {"logprobs": False}):
        assert api.parse_request("completions", json.dumps(
            {**body, **other}).encode()).not_comparable == "echo"
    with pytest.raises(ValueError, match="echo"):
        generation.from_dict({**data, "echo": "yes"})


def test_a_tokens_alternatives_are_best_first_whatever_order_the_server_lists_them():
    """vLLM's completions answer lists the chosen token first (here a sampled " France" that
    " the" outranks): the sample's top-1 is the best alternative, not the chosen one."""
    answer = {"choices": [{"text": " France", "logprobs": {
        "tokens": [" France"], "token_logprobs": [-2.4386],
        "top_logprobs": [{" France": -2.4386, " the": -2.1845}]}}]}
    completion = api.Completion()
    api.gather(completion, "completions", answer, streamed=False)
    (token,) = completion.tokens
    assert token.top == ((" the", -2.1845), (" France", -2.4386))


@pytest.mark.parametrize("endpoint, fields, asked", [
    ("completions", {}, False), ("completions", {"logprobs": None}, False),
    ("completions", {"logprobs": 0}, True), ("completions", {"logprobs": 3}, True),
    ("chat", {}, False), ("chat", {"logprobs": False}, False), ("chat", {"logprobs": True}, True),
    ("chat", {"top_logprobs": 2}, True), ("chat", {"logprobs": False, "top_logprobs": 0}, True)])
def test_what_counts_as_the_client_asking_for_logprobs(endpoint, fields, asked):
    """Where the client asked (in any form a server reads), guard adds no logprobs of its own
    and strips none from the answer: the client gets the server's answer to its own call."""
    prompt = {"prompt": "Hi"} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    call = api.parse_request(endpoint, json.dumps({"model": "m", **prompt, **fields}).encode())
    assert call.asked_logprobs is asked


def test_the_clients_add_special_tokens_travels_with_the_sample_and_the_probe():
    """vLLM's ``add_special_tokens``: the sample keeps the client's value (None where it left
    the endpoint's default), written as capture format_version 3 (a version-2 reader would
    score such a prompt with a BOS), and a fallback's probe asks the same."""
    from guard.backends.openai_generate import probe_body

    answer = {"choices": [{"text": " Paris", "finish_reason": "length"}]}
    for given, kept in ((False, False), (True, True), ("no", None), (None, None)):
        body = {"model": "m", "prompt": "The capital", "temperature": 0}
        if given is not None:
            body["add_special_tokens"] = given
        call = api.parse_request("completions", json.dumps(body).encode())
        assert call.add_special_tokens is kept and call.not_comparable == ""
        completion = api.Completion()
        api.gather(completion, "completions", answer, streamed=False)
        sample = api.build_sample(call, completion, route="primary")
        assert sample.add_special_tokens is kept
        data = generation.to_dict(sample)
        assert data["format_version"] == (1 if kept is None else 3)
        assert generation.from_dict(json.loads(json.dumps(data))) == sample
        sent = probe_body(sample, "up", 5)
        assert sent.get("add_special_tokens", "unset") == ("unset" if kept is None else kept)
    with pytest.raises(ValueError, match="add_special_tokens"):
        generation.from_dict({**data, "add_special_tokens": "false"})


def test_a_prompt_of_token_ids_is_the_samples_prompt_as_the_server_read_it():
    answer = {"choices": [{"text": " Paris", "finish_reason": "length"}]}
    for prompt, text, ids in (([504, 3575], None, (504, 3575)), ([[7, 8]], None, (7, 8)),
                              (["The capital"], "The capital", None)):
        call = api.parse_request("completions", json.dumps({
            "model": "m", "prompt": prompt, "temperature": 0}).encode())
        completion = api.Completion()
        api.gather(completion, "completions", answer, streamed=False)
        sample = api.build_sample(call, completion, route="primary")
        assert (sample.prompt, sample.prompt_token_ids) == (text, ids)
        # The probe (a fallback's primary asked again) sends the prompt as the client did.
        from guard.backends.openai_generate import probe_body

        assert probe_body(sample, "up", 5)["prompt"] == (text if text else list(ids))


def test_a_chat_answer_with_reasoning_apart_is_sampled_with_the_whole_outputs_tokens():
    """vLLM 0.32 with a reasoning parser (as measured on SmolLM2 with --reasoning-parser
    olmo3): the message's ``reasoning`` and ``content`` are split, and its logprobs and token
    ids are those of every generated token, the tags and the stop token included. The sample
    keeps both texts and all the tokens; the reference aligns them."""
    call = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Capital of France?"}],
        "temperature": 0}).encode())
    texts = ["<", "think", ">", "Paris", ".", "</", "think", ">", "Paris", "<|im_end|>"]
    ids = [44, 17400, 46, 7042, 30, 9617, 17400, 46, 38634, 2]
    answer = {"model": "up", "choices": [{
        "message": {"role": "assistant", "content": "Paris", "reasoning": "Paris."},
        "logprobs": {"content": [{"token": t, "logprob": -0.1, "top_logprobs": []}
                                 for t in texts]},
        "token_ids": ids, "finish_reason": "stop"}]}
    completion = api.Completion()
    api.gather(completion, "chat", answer, streamed=False)
    assert api.unusable(completion) == ""
    sample = api.build_sample(call, completion, route="primary")
    assert (sample.completion_text, sample.reasoning_text) == ("Paris", "Paris.")
    assert [t.token_id for t in sample.tokens] == ids
    assert generation.from_dict(json.loads(json.dumps(generation.to_dict(sample)))) == sample
    assert generation.to_dict(sample)["format_version"] == 2
    # Streamed: the reasoning's deltas are tokens (TTFT, gaps) and gathered alike.
    streamed = api.Completion()
    chunks = [{"choices": [{"delta": {"reasoning": t} if i < 5 else {"content": t},
                            "logprobs": {"content": [{"token": t, "logprob": -0.1,
                                                      "top_logprobs": []}]}}]}
              for i, t in enumerate(texts[:-1])]
    for chunk in chunks:
        assert api.chunk_has_content(chunk, "chat")
        assert api.data_has_content(json.dumps(chunk).encode(), "chat")
        api.gather(streamed, "chat", chunk, streamed=True)
    assert "".join(streamed.reasoning_text) == "<think>Paris." and api.unusable(streamed) == ""
    # The same stream as Envoy's tap gives it, whole (the Envoy observer's path).
    body = b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks) + \
        b"data: [DONE]\n\n"
    tapped = api.gather_answer("chat", body, streamed=True)
    assert (tapped.reasoning_text, tapped.text, tapped.tokens) == (
        streamed.reasoning_text, streamed.text, streamed.tokens)
    assert api.unusable(tapped) == ""
    # Without tokens (no logprobs, no ids asked): not comparable, as before.
    bare = api.Completion()
    api.gather(bare, "chat", {"choices": [{"message": answer["choices"][0]["message"]}]},
               streamed=False)
    assert api.unusable(bare) == "reasoning"
    # Reasoning the answer leaves out (vLLM's include_reasoning false: no reasoning, and no
    # logprobs or ids either), which usage still counts: the answer did not come first.
    hidden = api.Completion()
    api.gather(hidden, "chat", {"choices": [{"message": {"content": "Paris"}}], "usage": {
        "completion_tokens": 10, "completion_tokens_details": {"reasoning_tokens": 7}}},
        streamed=False)
    assert hidden.reasoning_tokens == 7 and api.unusable(hidden) == "reasoning"
    plain = api.Completion()
    api.gather(plain, "chat", {"choices": [{"message": {"content": "Paris"}}], "usage": {
        "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 0}}},
        streamed=False)
    assert api.unusable(plain) == ""
    asked_without = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}],
        "include_reasoning": False}).encode())
    assert asked_without.not_comparable == "reasoning"


# -- the ring record -------------------------------------------------------------------------------
def _sample() -> generation.GenerationSample:
    return generation.GenerationSample(
        model="smol", endpoint="completions", completion_text=" Paris ✓",
        tokens=(generation.TokenLogprob(" Paris", -0.25, ((" Paris", -0.25),), 7),),
        sampling=generation.SamplingParams(temperature=0.0, stop=("\n",)), prompt="Capital",
        route="fallback", request_id="req-1", streamed=True, request_seconds=0.5,
        first_token_seconds=0.1, upstream_model="smol-q4")


def _record(slot: int, epoch: int, traceparent: str) -> wire.Sample:
    call = _sample()
    return wire.Sample("smol", slot, call.route, epoch, wire.MIRROR, call.request_id,
                       traceparent, call.request_seconds, wire.Generation(call))


def test_a_generation_record_crosses_the_ring_and_reads_back_equal():
    producer = SampleRing(4096)
    consumer = SampleRing.attach(os.dup(producer.block.fd), 4096)
    try:
        assert wire.hand_off(producer, _record(3, 9, "tp"))
        handed = wire.decode(bytes(consumer.take()))
    finally:
        consumer.close()
        producer.close()
    assert handed.payload == wire.Generation(_sample())
    assert (handed.route, handed.slot, handed.epoch, handed.request_id) == ("fallback", 3, 9,
                                                                           "req-1")
    assert handed.request_seconds == 0.5 and handed.traceparent == "tp"
    with pytest.raises(wire.NotTensors):
        handed.payload.answer()


def test_a_corrupt_generation_record_is_rejected_naming_why():
    data = b"".join(bytes(p) for p in wire.encode(_record(0, 1, "")))
    body_at = data.index(b'{"model"')
    with pytest.raises(ValueError, match="not JSON"):
        wire.decode(data[:body_at] + b"\xff" + data[body_at + 1:])
    broken = data.replace(b'"endpoint":"completions"', b'"endpoint":"speech"     ')
    with pytest.raises(ValueError, match="endpoint"):
        wire.decode(broken)
    with pytest.raises(ValueError, match="truncated"):
        wire.decode(data[:-3])
    kind_at = 2  # the fixed header's payload kind
    with pytest.raises(ValueError, match="payload kind"):
        wire.decode(data[:kind_at] + b"\x09" + data[kind_at + 1:])


# -- the backend block --------------------------------------------------------------------------
def _doc(primary=None, http_port=8080, **model):
    return {"version": 1, "server": {"http_port": http_port} if http_port is not None else {},
            "models": [{"name": "smol", "task": "generation", "primary": primary or UPSTREAM,
                        **model}]}


def _problems(data, tmp_path) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path, "guard.yaml")
    return "; ".join(info.value.problems)


def test_an_openai_block_validates_with_its_options(tmp_path):
    primary = dict(UPSTREAM, options={"api_key_env": "SMOL_KEY", "sample_logprobs": 5,
                                      "server_defaults": {"top_k": 40, "min_p": 0.05}})
    config = parse_config(_doc(primary, fallback=dict(UPSTREAM, model="smol-q8")), tmp_path)
    assert config.server.http_port == 8080
    from guard.backends.openai import server_defaults

    defaults = server_defaults(config.models[0].primary)
    assert (defaults.top_k, defaults.min_p, defaults.temperature) == (40, 0.05, None)


@pytest.mark.parametrize("primary, model, http_port, says", [
    (dict(UPSTREAM, target="127.0.0.1:8081"), {}, 8080, "base URL"),
    (dict(UPSTREAM, options={"api_key_env": "sk-abc123"}), {}, 8080, "never the key itself"),
    (dict(UPSTREAM, options={"server_defaults": {"top_q": 1}}), {}, 8080, "top_q"),
    (dict(UPSTREAM, path="x.gguf"), {}, 8080, "not 'path'"),
    (dict(UPSTREAM, device="cuda"), {}, 8080, "takes no device: the remote server runs where"),
    (dict(UPSTREAM, precision="fp16"), {}, 8080, "cannot derive a precision"),
    ({"backend": "openai", "target": "http://h:1"}, {}, 8080, "'model'"),
    (UPSTREAM, {}, None, "server.http_port"),
    (UPSTREAM, {"task": "generic"}, 8080, "task"),
    (UPSTREAM, {"fallback": {"backend": "upstream", "target": "h:1", "model": "m"}}, 8080,
     "fallback.backend: a generation model's fallback is served by an OpenAI-compatible server"),
])
def test_a_bad_openai_block_names_its_path(tmp_path, primary, model, http_port, says):
    assert says in _problems(_doc(primary, http_port, **model), tmp_path)


def test_the_key_variable_must_be_set_when_the_backend_loads(monkeypatch):
    from guard.backends.openai import OpenAIBackend
    from guard.config import BackendConfig
    from guard.errors import BackendError

    monkeypatch.delenv("GUARD_TEST_NO_SUCH_KEY", raising=False)
    spec = BackendConfig.model_validate(dict(UPSTREAM, options={
        "api_key_env": "GUARD_TEST_NO_SUCH_KEY"}))
    with pytest.raises(BackendError, match="GUARD_TEST_NO_SUCH_KEY"):
        OpenAIBackend(spec, "primary").load()
    monkeypatch.setenv("GUARD_TEST_NO_SUCH_KEY", "s3cret")
    backend = OpenAIBackend(spec, "primary")
    backend._authorization = "Bearer s3cret"
    headers = backend.headers({"Authorization": "Bearer client", "Connection": "keep-alive",
                               "Accept-Encoding": "gzip", "X-Custom": "1"}, "req-9")
    assert headers["Authorization"] == "Bearer s3cret" and headers["X-Custom"] == "1"
    assert "Connection" not in headers and "Accept-Encoding" not in headers
    assert headers["X-Request-Id"] == "req-9"


def test_an_edge_without_aiohttp_names_the_extra_to_install():
    """server.http_port without the llm-remote extra: a GuardError naming it, not a traceback
    from an import (the module is imported only when the port is set)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from guard.errors import GuardError\n"
            "try:\n    import guard.serve.openai_edge\n"
            "except GuardError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "server.http_port" in out.stdout and "pip install '.[llm-remote]'" in out.stdout


@hypothesis.settings(max_examples=300, derandomize=True, database=None, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(case=fuzz_openai.cases)
@hypothesis.example(case=fuzz_openai.Case(
    "/v1/completions", b'{"model": "smol", "prompt": "x", "max_tokens": 1, "stop": 5}'))
def test_any_body_is_a_call_a_refusal_or_not_comparable_and_its_sample_builds(case):
    """Whatever JSON a client sends (tests/fuzz_openai.py's bodies: any value in any field),
    reading it never raises but BadRequest, and a comparable call's sample builds: a
    ``"stop": 5`` that llama-server answers raised TypeError in the hand-off, after the
    client had its answer (found by benchmarks/reliability_llm.py)."""
    endpoint = api.PATHS.get(case.path)
    if endpoint is None:
        return
    try:
        call = api.parse_request(endpoint, case.data)
    except api.BadRequest:
        return
    api.sampling_params(call.body, endpoint)
    if not call.not_comparable:
        completion = api.Completion()
        api.gather(completion, endpoint, {"choices": [{"index": 0, "text": "x",
                                                       "message": {"content": "x"}}]},
                   streamed=False)
        api.build_sample(call, completion, route="primary")


def test_a_chat_llama_server_continues_is_scored_as_it_renders_and_answers_it():
    """engine llama.cpp: a chat ending with the assistant's message is continued (prefill),
    rendered llama.cpp's way, and the content its answer repeats is taken off the completion;
    once only; other engines and chats that open a new turn are left as they are."""
    chat = generation.GenerationSample(
        model="m", endpoint="chat", completion_text="{\"name\": \"Ann\"}", tokens=(),
        messages=({"role": "user", "content": "JSON?"}, {"role": "assistant", "content": "{"}))
    served = generation.rendered_as_served(chat, "llama.cpp")
    assert served.completion_text == '"name": "Ann"}'
    assert served.chat_template_args == {"add_generation_prompt": False,
                                         "continue_final_message": True,
                                         generation.LLAMA_CPP_CONTINUATION: True}
    assert generation.rendered_as_served(served, "llama.cpp") == served
    assert generation.rendered_as_served(chat, "vllm") == chat
    new_turn = replace(chat, messages=chat.messages[:1])
    assert generation.rendered_as_served(new_turn, "llama.cpp") == new_turn
    asked = replace(chat, chat_template_args={"continue_final_message": False,
                                              "add_generation_prompt": True})
    assert generation.rendered_as_served(asked, "llama.cpp") == asked  # (--no-prefill asked)
    # A record that says it (guard's own argument) reads back.
    assert generation.from_dict(generation.to_dict(served)) == served


def test_envoy_modes_tool_chat_of_llama_server_makes_a_sample_where_its_prompt_is_asked():
    """In Envoy mode a traced tool chat with the output's ids (the client asked logprobs of
    llama-server) is a sample where the verifier asks the server for its prompt, and not
    comparable (``tools``) where it does not."""
    from guard.envoy.llm_calls import NotComparable, ObservedHttpCall, parse, sample

    request = json.dumps({"model": "smol", "logprobs": True,
                          "messages": [{"role": "user", "content": "Weather in Paris?"}],
                          "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    answer = json.dumps({"model": "smol", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        "logprobs": {"content": [{"id": 10, "token": "<tool_call>", "logprob": -0.1,
                                  "top_logprobs": []}]}}]})
    call = ObservedHttpCall("/v1/chat/completions", "r1", "", "primary", 200,
                            "application/json", request.encode(), answer.encode(), 0.1)
    parsed = parse(call)
    assert parsed is not None and parsed.offers_tools
    made = sample(call, parsed, "primary", prompt_ids_asked=True)
    assert made.tools and made.tool_calls == ("get_weather",) and made.prompt_token_ids is None
    with pytest.raises(NotComparable, match="tools"):
        sample(call, parsed, "primary")


@pytest.mark.parametrize("message,tool_turn", [
    ({"role": "tool", "content": "18 C", "tool_call_id": "call-1"}, True),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}, True),
    ({"role": "assistant", "content": "", "tool_calls": []}, True),
    ({"role": "function", "name": "get_weather", "content": "18 C"}, True),
    ({"role": "assistant", "content": "Hi", "tool_calls": None}, False),
    ({"role": "user", "content": "Hi"}, False),
])
def test_a_chat_with_earlier_tool_turns_is_compared_as_a_tool_chat(message, tool_turn):
    """Each engine renders a conversation's earlier calls and results its own way (found by
    the fuzzer: a llama-server with a Hermes template writes a tool's result as a user turn,
    where SmolLM2's own template writes a ``tool`` turn): such a chat is compared, like one
    that offers tools, on the server's prompt ids, never on the reference's rendering."""
    call = api.parse_request("chat", json.dumps({
        "model": "smol", "messages": [{"role": "user", "content": "Weather?"}, message]}).encode())
    assert call.offers_tools is tool_turn and not call.defines_tools
    assert (call.tool_request == {}) is tool_turn  # (no tool fields: none to send again)


def test_a_request_id_that_is_not_utf8_can_still_be_sampled_and_handed_over():
    """aiohttp reads header bytes that are not UTF-8 as surrogates, which no UTF-8 encoder
    takes: the sample's id (hashed, handed to the verifier, captured) holds U+FFFD there."""
    from guard.serve.openai_edge import request_id

    assert request_id({"x-request-id": "req-1"}) == "req-1"
    sent = b"req-\xff\xfe".decode("utf-8", "surrogateescape")
    assert request_id({"x-request-id": sent}) == "req-\ufffd\ufffd"
    assert request_id({"x-request-id": sent}).encode("utf-8")
    assert len(request_id({})) == 32


@pytest.mark.parametrize("answer, unasked", [
    (b'{"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[]}}],"id":"c"}',
     b'{"choices":[{"index":0,"delta":{"content":"Hi"}}],"id":"c"}'),
    (b'{"choices": [{"logprobs": {"content": [{"t": 1}]} , "index": 0}]}',
     b'{"choices": [{"index": 0}]}'),
    (b'{"choices":[{"logprobs":null}]}', b'{"choices":[{}]}'),
    (b'{"choices":[{"index":0,"logprobs":{}},{"index":1,"logprobs":{}}]}',
     b'{"choices":[{"index":0},{"index":1}]}'),
], ids=["last", "first-spaced", "only", "two-choices"])
def test_logprobs_a_server_writes_no_key_for_are_taken_out_whole(answer, unasked):
    """llama-server writes no ``logprobs`` key in a chat answer nobody asked logprobs of: what
    guard asked for itself goes with its key and one comma, every other byte as it was."""
    from guard.protocol.openai.json_edits import REMOVE

    edits = api.answer_edits("c", True, unasked_logprobs=REMOVE)
    assert api.replace_values(answer, edits) == unasked


def test_removing_what_has_no_key_leaves_null_and_the_json_whole():
    from guard.protocol.openai.json_edits import REMOVE

    assert api.replace_values(b'{"choices": [1, 2]}', {("choices", "*"): REMOVE}) == \
        b'{"choices": [null, null]}'
