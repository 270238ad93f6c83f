"""`response_format` (JSON mode, JSON schema) as constrained decoding through llguidance.

llguidance compiles the schema into a matcher over this model's own tokenizer
(its HF `tokenizers` JSON) and gives, before every generated token, the set of
tokens that keep the output a prefix of valid JSON for the schema; the sampler
sets every other logit to -inf (ds4ref.scheduler.sampling). Once the JSON is
complete only end-of-sentence is allowed, so the answer is exactly one value.

In thinking mode the constraint starts after `</think>`: the reasoning is free
text, the answer is the JSON.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .chat import THINK_END


class StructuredOutputError(ValueError):
    """A constraint that cannot be built: a 400 naming `param`, with OpenAI error code `code`."""
    code = "invalid_response_format"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of ds4ref
        raise StructuredOutputError("response_format needs the llguidance package (pip install llguidance)",
                                    "response_format") from None
    return llguidance


class GrammarConstraint:
    """One request's matcher (a JSON schema's, or a forced tool call's: serve/tool_grammar.py):
    `allowed()` before each token, `accept(token)` after it."""

    def __init__(self, matcher: Any, vocab_size: int, start_after: Optional[int] = None) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.start_after = start_after
        self.started = start_after is None

    def allowed(self) -> Optional[np.ndarray]:
        if not self.started:
            return None
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        if not self.started:
            self.started = token == self.start_after
            return
        self.matcher.consume_token(int(token))


def _ll_tokenizer(tokenizer: Any) -> Any:
    cached = getattr(tokenizer, "_llguidance", None)
    if cached is None:
        llg = _llguidance()
        cached = llg.LLTokenizer(tokenizer._hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)
        tokenizer._llguidance = cached
    return cached


def warm_structured(tokenizer: Any) -> None:
    """Pay structured output's one-time cost before serving: llguidance's tokenizer, built from
    the whole vocabulary (1.9 s for DeepSeek-V4's 129280 tokens on the 2-core machine; a grammar's
    compile and first mask are then about 1 ms each). Nothing without llguidance (a request
    asking for structured output gets that error)."""
    try:
        _ll_tokenizer(tokenizer)
    except StructuredOutputError:
        pass


def structured_output(tokenizer: Any, response_format: Any, thinking: bool = False
                      ) -> tuple[Optional[GrammarConstraint], Optional[dict]]:
    """(constraint for the sampler, schema for the system prompt) of a ResponseFormat, or (None, None)."""
    if response_format is None or response_format.type == "text":
        return None, None
    schema = response_format.json_schema.schema_ if response_format.type == "json_schema" else None
    llg = _llguidance()
    grammar = llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"the JSON schema cannot be used: {error}", "response_format.json_schema.schema")
    matcher = llg.LLMatcher(_ll_tokenizer(tokenizer), grammar)
    start = tokenizer.token_to_id(THINK_END) if thinking else None
    return GrammarConstraint(matcher, tokenizer.vocab_size, start), schema
