"""Structured output: OpenAI's ``response_format`` turned into an llguidance grammar, and the per-sequence matcher
the engine masks each constrained row's logits with.

``response_format`` ``{"type": "json_object"}`` constrains the output to one JSON object, ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`` to JSON valid against ``schema`` (always enforced, whatever
``strict`` says). The JSON is compact (no whitespace between tokens), so a model cannot spend its budget on
spaces. :func:`grammar_for` runs where the request is parsed and checks the schema once: the grammar travels in
:class:`k3.infer.sampling.SamplingParams` as a string (picklable to the engine process), and the engine builds a
:class:`Constraint` from it for each sequence. llguidance is an optional dependency (``pip install
'k3[structured]'``); without it a request asking for structured output gets one error naming ``response_format``.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

from k3.infer.sampling import SamplingError
from k3.ops.segments import to_device

EXTRA = "pip install 'k3[structured]'"
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance(param: str = "response_format", what: str = "response_format"):
    """The llguidance module, or one SamplingError naming ``param`` (``what`` asked for structured output) and
    the extra that installs it."""
    try:
        import llguidance
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise SamplingError(param, f"{what} needs structured output, which needs llguidance: {EXTRA}") from None
    return llguidance


def grammar_for(response_format) -> str | None:
    """An OpenAI ``response_format`` -> its llguidance grammar (a JSON string), None for plain text. One
    SamplingError (param ``response_format``) for a malformed value or a schema llguidance cannot compile."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise SamplingError(
                "response_format", "response_format.json_schema must be an object with a JSON schema object 'schema'"
            )
        if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise SamplingError(
                "response_format", "response_format.json_schema: 'name' must be a string and 'strict' a boolean"
            )
        schema = spec["schema"]
    else:
        raise SamplingError("response_format", 'response_format.type must be "text", "json_object" or "json_schema"')
    grammar, error = _schema_grammar(schema, "response_format")
    if error:
        raise SamplingError("response_format", f"response_format: the JSON schema is not valid: {error}")
    return grammar


def _schema_grammar(schema: dict, param: str, what: str | None = None) -> tuple[str | None, str | None]:
    """(the grammar of compact JSON valid against ``schema``, None) or (None, why llguidance refuses it)."""
    matcher = _llguidance(param, what or param).LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
    except ValueError as e:
        return None, str(e)
    error = matcher.validate_grammar(grammar)
    return (None, error) if error and not error.startswith("WARNING") else (grammar, None)


def schema_error(schema: dict, param: str, what: str) -> str | None:
    """Why ``schema`` is not a JSON schema llguidance can constrain output to (None: it is one); one
    SamplingError naming ``param`` where llguidance is missing (``what`` asked for it)."""
    return _schema_grammar(schema, param, what)[1]


def lark_grammar(lark: str, param: str, what: str) -> str:
    """The llguidance grammar of Lark text ``lark``, whose ``%json`` rules (:func:`json_rule`) are compact as
    grammar_for's; one SamplingError naming ``param`` where llguidance is missing or refuses it."""
    grammar = json.dumps({"grammars": [{"lark_grammar": lark}]})
    error = _llguidance(param, what).LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise SamplingError(param, f"{what}: the grammar is not valid: {error}")
    return grammar


def json_rule(schema: dict) -> str:
    """A Lark ``%json`` rule body of compact JSON valid against ``schema``."""
    return f"%json {json.dumps({**schema, 'x-guidance': _JSON_OPTIONS})}"


class Constraint:
    """One constrained sequence's llguidance matcher: the tokens its grammar allows next (:func:`allowed_rows`),
    the token sampled (:meth:`consume`), and whether the grammar is complete (:attr:`complete`). EOS is allowed
    only where the grammar may end."""

    def __init__(self, tokenizer, grammar: str):
        """``tokenizer``: an ``llguidance.LLTokenizer`` (:func:`ll_tokenizer`). One ValueError for a grammar
        the matcher refuses."""
        self.matcher = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"structured output: the grammar is refused: {self.matcher.get_error()}")

    def consume(self, token: int) -> str | None:
        """Advance past a sampled token; an error message where the grammar refuses it (None: accepted)."""
        if not self.matcher.consume_token(token):
            return f"ValueError: structured output: {self.matcher.get_error() or f'token {token} not allowed'}"
        return None

    @property
    def complete(self) -> bool:
        """The grammar has ended (its output is whole; nothing more may follow)."""
        return self.matcher.is_stopped()


def ll_tokenizer(tokenizer, vocab_size: int):
    """An ``llguidance.LLTokenizer`` of k3's Tokenizer (its HF ``tokenizers.Tokenizer``) over the model's
    ``vocab_size`` logits (ids past the tokenizer's are never allowed). One ValueError for a tokenizer without EOS
    (a grammar ends the output with it)."""
    if getattr(tokenizer, "eos_id", None) is None:
        raise ValueError("response_format needs a tokenizer with an end-of-text token")
    return _llguidance().LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_id)


def allowed_rows(constraints: list[Constraint | None], vocab_size: int, device) -> tuple[Tensor, dict[int, str]]:
    """The step's allowed tokens [B, vocab_size] bool on ``device`` (row i: constraints[i]'s grammar; every token
    for an unconstrained row), built as a host bitmask (32 tokens an int32) copied pinned and non-blocking, then
    unpacked on the device; and the rows whose matcher is in error (their message)."""
    lt = _llguidance().torch
    mask = torch.full(lt.get_bitmask_shape(len(constraints), vocab_size), -1, dtype=torch.int32)
    errors = {}
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if c.matcher.is_error():
            errors[i] = f"ValueError: structured output: {c.matcher.get_error()}"
            continue
        lt.fill_next_token_bitmask(c.matcher, mask, i)
    bits = to_device(mask, device)
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(len(constraints), -1)[:, :vocab_size]
    return allowed.bool(), errors
