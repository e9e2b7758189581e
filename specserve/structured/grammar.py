"""Compiling constraints (core.Constraint) into grammars over the model's vocabulary, with xgrammar.

One `Grammars` per tokenizer. Compiled grammars are kept by their text in a bounded LRU, so a workload that
repeats a few schemas compiles each once; a bad one raises ValueError naming what is wrong, which the engine
and the HTTP front-end turn into a refused request.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Callable

from specserve.core import Constraint
from specserve.structured.schema_support import unsupported_keyword

# Distinct constraints whose compiled grammars stay cached (each is a few kilobytes to a few megabytes).
DEFAULT_CACHE_SIZE = 256


class Grammars:
    """Compiles constraints for one tokenizer. `load_tokenizer` is called on the first compile: building the
    token table takes about a second, which engines that never see a constraint do not pay."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 1) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.cache_size = cache_size
        self.max_threads = max_threads
        self._compiler = None
        self._tokenizer = None  # loaded with the compiler
        self._cache: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()  # the front-end compiles on worker threads

    def compile(self, constraint: Constraint):
        """The compiled grammar (xgrammar.CompiledGrammar); ValueError if the constraint's text is invalid."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
            compiled = self._compile(constraint)
            self._cache[constraint] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def state(self, constraint: Constraint):
        """A fresh per-request grammar state (structured.state.GrammarState)."""
        from specserve.structured.state import GrammarState

        compiled = self.compile(constraint)
        return GrammarState(compiled, self.vocab_size, self.stop_token_ids, self._encode)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _compile(self, constraint: Constraint):
        if constraint.kind == "json_schema":
            _check_supported(constraint.text)
        compiler = self._get_compiler()
        try:
            if constraint.kind == "json_object":
                return compiler.compile_grammar(_json_grammar('{"type": "object"}'))
            if constraint.kind == "json_schema":
                return compiler.compile_grammar(_json_grammar(constraint.text))
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.text)
            if constraint.kind == "structural_tag":
                return compiler.compile_grammar(_structural_tag_grammar(constraint.text))
            return compiler.compile_grammar(constraint.text)
        except Exception as e:  # xgrammar raises RuntimeError, InvalidJSONError, ...: all mean "bad text"
            raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {_first_line(e)}") from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            self._tokenizer = self._load_tokenizer()
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=list(self.stop_token_ids) or None)
            # xgrammar's own cache would keep a second copy; ours is the one with a bound in entries.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler


# xgrammar (0.2.8) writes the characters of a string with a length bound as "anything but a quote, a
# backslash, CR or LF", which lets tabs and other control characters through raw; JSON forbids them in
# strings (parsers refuse such output), as xgrammar's unbounded strings do.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _check_supported(schema_text: str) -> None:
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return  # xgrammar names what is wrong with the text
    problem = unsupported_keyword(schema)
    if problem is not None:
        raise ValueError(f"unsupported json schema: {problem}")


def _json_grammar(schema: str):
    """The grammar of JSON text matching `schema`, compact (one space after ':' and ','; no other
    whitespace, which a model could otherwise repeat without end)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _structural_tag_grammar(text: str):
    """The grammar of an xgrammar structural tag (its JSON text), with JSON strings narrowed as above."""
    import xgrammar

    grammar = xgrammar.Grammar.from_structural_tag(text)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:500]
