"""Byte-exact edits of an answer's JSON.

The client's answer is the upstream's answer. The edge changes only the value of the top-level
``"model"`` key (the upstream's name back to the client's), and, where guard itself asked for
logprobs or token ids on a sampled call, those values back to what the server answers when
nobody asked (``null``, or no key at all: ``REMOVE``). Each edit splices the value's bytes in
place (:func:`replace_values`): every other byte (spacing, key order, number spelling, escapes)
stays as the server wrote it, which a ``json.loads``/``json.dumps`` round trip would not
keep."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable


MODEL_PATH = ("model",)
LOGPROBS_PATH = ("choices", "*", "logprobs")
# Where vLLM puts the ids ``return_token_ids`` asks for: the prompt's at the top of a chat
# answer (its first chunk, streamed) and in each choice of a completions answer, the
# completion's in each choice. vLLM writes every one of them as null when they are not asked
# for, so null is the client's answer byte for byte (vLLM 0.32, checked by the e2e test).
TOKEN_ID_PATHS = (("prompt_token_ids",), ("choices", "*", "prompt_token_ids"),
                  ("choices", "*", "token_ids"))
# The scan walks the keys on the way to the wanted values and skips every other value with the
# json module's C scanner (``raw_decode``), so an edit costs a few microseconds per event.
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
# (CPython's C scanner; typeshed does not declare json.decoder.scanstring)
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]


def _skip_space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)  # (always a match: the pattern takes an empty run too)
    return match.end() if match is not None else at


def read_json(data: bytes | str, strict: bool = False) -> Any:
    """``json.loads``, with what Python's json cannot read a ValueError too: nesting deeper
    than the interpreter's stack (RecursionError), as well as text that is not JSON
    (JSONDecodeError) and an integer past int()'s digits (ValueError). ``strict``: NaN and
    Infinity, which Python reads and RFC 8259 does not have, are refused too (for JSON guard
    will write into a request of its own)."""
    try:
        return json.loads(data, parse_constant=_not_json if strict else None)
    except RecursionError:
        raise ValueError("nested too deep") from None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _value_end(text: str, at: int) -> int:
    try:
        return _DECODER.raw_decode(text, at)[1]
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON at {exc.pos}: {exc.msg}") from None
    except RecursionError:  # nested deeper than the interpreter's stack: not ours to read
        raise ValueError(f"not JSON guard reads at {at}: nested too deep") from None
    except ValueError as exc:  # an integer of more digits than int() converts
        raise ValueError(f"not JSON guard reads at {at}: {exc}") from None


def _spans(text: str, at: int, paths: tuple, prefix: tuple, found: list,
           member: int = -1) -> int:
    """Scan the value at ``at`` (no leading space); append (start, end, path, member) of wanted
    values (``member``: where the object member holding it begins, its key's quote; -1 for an
    array's element or the document); return where the value ends."""
    if prefix in paths:
        end = _value_end(text, at)
        found.append((at, end, prefix, member))
        return end
    depth = len(prefix)
    wanted = [p for p in paths if len(p) > depth and p[:depth] == prefix]
    opener = text[at:at + 1]
    if not wanted or opener not in ("{", "["):
        return _value_end(text, at)
    closer = "}" if opener == "{" else "]"
    at = _skip_space(text, at + 1)
    if text[at:at + 1] == closer:
        return at + 1
    while True:
        begins = at
        if opener == "{":
            if text[at:at + 1] != '"':
                raise ValueError(f"not JSON at {at}: expected a key")
            key, at = _scanstring(text, at + 1)
            at = _skip_space(text, at)
            if text[at:at + 1] != ":":
                raise ValueError(f"not JSON at {at}: expected ':'")
            at = _skip_space(text, at + 1)
            step = key
        else:
            step = "*"
        if any(p[depth] == step for p in wanted):
            at = _spans(text, at, paths, (*prefix, step), found,
                        begins if opener == "{" else -1)
        else:
            at = _value_end(text, at)
        if depth == 0 and all("*" not in p for p in paths) and len(found) == len(paths):
            return len(text)  # every exact path found: the rest stays as it is
        at = _skip_space(text, at)
        sep = text[at:at + 1]
        if sep == closer:
            return at + 1
        if sep != ",":
            raise ValueError(f"not JSON at {at}: expected ',' or '{closer}'")
        at = _skip_space(text, at + 1)


def value_spans(data: bytes | str,
                paths: Iterable[tuple[str, ...]]) -> list[tuple[int, int, tuple, int]]:
    """(start, end, path, member) of every value at ``paths`` in the JSON ``data`` (character
    offsets of its UTF-8 text; ``member``: where the object member holding it begins, -1 for an
    array's element), in document order. Paths are tuples of keys, ``"*"`` standing for every
    element of an array. ValueError for data that is not JSON."""
    text = data.decode() if isinstance(data, (bytes, bytearray)) else data
    found: list = []
    _spans(text, _skip_space(text, 0), tuple(paths), (), found)
    return found


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which a client may put before its JSON

# The fast path of the one edit every answer needs: a top-level "model" key reached over
# top-level keys whose values are strings or scalars (how servers write their chunks: "id",
# "object", "created", "model", then "choices"), in one C-level regex match.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_SCALAR = rb"(?:" + _STRING + rb"|true|false|null|-?\d[\d.eE+-]*)"
_LEADING_MODEL = re.compile(rb"\{(?:\s*" + _STRING + rb"\s*:\s*" + _SCALAR + rb"\s*,)*?"
                            rb'\s*"model"\s*:\s*(' + _STRING + rb")\s*[,}]")


def _leading_model(data: bytes, value: bytes) -> bytes | None:
    """``data`` with its leading top-level ``model`` set to ``value`` (the fast path's match);
    the bytes as they came where it already is; None where the match does not apply."""
    match = _LEADING_MODEL.match(data)
    if match is None:
        return None
    if data[match.start(1):match.end(1)] == value:
        return data  # the name it already has: not a copy
    return data[:match.start(1)] + value + data[match.end(1):]


# A replacement that removes the member holding the value (its key, the value and one comma),
# as a server that writes no key where nobody asked (llama-server's chat logprobs).
REMOVE = b""


def replace_values(data: bytes, replacements: dict[tuple[str, ...], bytes]) -> bytes:
    """``data`` with the values at these paths replaced by the given JSON bytes (``REMOVE``:
    the object member holding the value taken out); every other byte as it was. Paths that
    are not there are left out (nothing added). Once every exact path is found the rest of the
    document is not read: a document that breaks off after them is edited there and forwarded
    as it is."""
    if len(replacements) == 1 and MODEL_PATH in replacements:
        edited = _leading_model(data, replacements[MODEL_PATH])
        if edited is not None:
            return edited
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    spans = value_spans(text, replacements)
    if not spans:
        return data
    out, at = [], 0
    for start, end, path, member in spans:
        value = replacements[path]
        if value == REMOVE:  # (an array's element has no key to go with it: null there)
            if member >= 0:
                start, end = _member_span(text, member, end)
            else:
                value = b"null"
        out += [text[at:start], value.decode()]
        at = end
    out.append(text[at:])
    return "".join(out).encode()


def _member_span(text: str, member: int, end: int) -> tuple[int, int]:
    """The span that removes the object member from ``member`` to ``end`` with one of its
    commas: the one before it, else (the object's first member) the one after it."""
    before = len(text[:member].rstrip())
    if text[before - 1:before] == ",":
        return before - 1, end
    after = _skip_space(text, end)
    if text[after:after + 1] == ",":
        return member, _skip_space(text, after + 1)
    return member, end  # the object's only member


def set_model(data: bytes, name: str) -> bytes:
    """A request body (a JSON object) naming the model ``name``: its ``model`` value replaced,
    or the key put first where the body has none (a client of a one-model server may send
    none; guard's upstream is told the name the block says it serves). ValueError for data
    that is not a JSON object. A leading byte order mark stays where it is."""
    if data.startswith(BOM):
        return BOM + set_model(data[len(BOM):], name)
    value = json.dumps(name, ensure_ascii=False).encode()
    edited = _leading_model(data, value)
    if edited is not None:
        return edited
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    spans = value_spans(text, [MODEL_PATH])  # (one scan: found, or where it goes)
    if spans:
        start, end, _, _ = spans[0]
        return (text[:start] + value.decode() + text[end:]).encode()
    opening = data.find(b"{")
    if opening < 0 or data[:opening].strip():
        raise ValueError("not a JSON object")
    rest = data[opening + 1:]
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return data[:opening + 1] + b'"model":' + value + comma + rest


def answer_edits(client_model: str, strip_logprobs: bool, strip_token_ids: bool = False,
                 unasked_logprobs: bytes = b"null") -> dict[tuple[str, ...], bytes]:
    """The edits an answer (or each streamed chunk) of this call needs.

    The answer's ``model`` is always set to the client's name (``client_model``: the name the
    call named, or the model guard routed a call naming none to), not only where the block's
    upstream name differs: a server may answer another name than it was asked (llama.cpp's
    llama-server its file's path or ``--alias``, llama-cpp-python's server its path for a call
    naming none), and the client of guard is told the name guard serves. Where the answer
    already says it, the edit is a regex match that returns the bytes as they came."""
    edits: dict[tuple[str, ...], bytes] = {
        MODEL_PATH: json.dumps(client_model, ensure_ascii=False).encode()}
    if strip_logprobs:  # as the server answers unasked: null, or no key (REMOVE)
        edits[LOGPROBS_PATH] = unasked_logprobs
    if strip_token_ids:
        edits.update(dict.fromkeys(TOKEN_ID_PATHS, b"null"))
    return edits
