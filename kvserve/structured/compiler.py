"""``GrammarCompiler``: a request's :class:`StructuredOutputsParams` -> a compiled
llguidance matcher, compiled once per distinct constraint and cached.

The grammar library is llguidance (installs from PyPI as a wheel with no torch
dependency; builds its token trie from the HF fast tokenizer). Each constraint maps
to one llguidance grammar:

    json           LLMatcher.grammar_from_json_schema(schema), compact whitespace
                   (", " and ": " separators, no free runs of blanks: a small model
                   otherwise tends to pad with newlines until max_tokens cuts it)
    json_object    the schema {"type": "object"}, the same way
    regex          LLMatcher.grammar_from_regex(regex)
    choice         the Lark grammar  start: "a" | "b" | ...
    grammar        Lark as given (GBNF, recognised by ``::=``, is converted to Lark)

:meth:`GrammarCompiler.check` compiles (or finds in the cache) and raises
:class:`RequestError` naming the field when the grammar is invalid, so a bad schema
is a 400 before anything is queued; :meth:`GrammarCompiler.matcher` hands out a
fresh copy of the compiled matcher (``deep_copy``: the compiled lexer and parser
tables are shared, only the parse state is new). Thread-safe: the server checks
on its event loop thread while the model runner asks for matchers on the engine's.

For ``within_max_tokens`` constraints (forced tool calls) :meth:`min_output_tokens`
is the length of the closing plan from the start (``kvserve.structured.budget``),
cached with the compiled grammar: the smallest ``max_tokens`` the engine accepts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.errors import RequestError
from kvserve.structured.budget import ClosingTables, closing_plan
from kvserve.structured.compile_pool import DEFAULT_TIMEOUT_S, CompilePool, CompileRefused
from kvserve.structured.limits import check_structure
from kvserve.structured.params import StructuredOutputsParams

# JSON output style: compact, no free whitespace (a schema's x-guidance overrides it).
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
# Compiled constraints kept (least recently used dropped first).
logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
# Bytes of compiled constraints kept, estimated as COMPILED_BYTES_PER_CHAR x the
# grammar's text (a compiled llguidance grammar is a few times its text).
DEFAULT_CACHE_BYTES = 256 << 20
COMPILED_BYTES_PER_CHAR = 16
# The server's own compile thread: a larger stack than the worker's (what compiled
# there compiles here).
COMPILE_STACK_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary.

    ``tokenizer``: a HF fast tokenizer; ``vocab_size``: the model's logits width (the
    masks cover it, tokens past the tokenizer's vocabulary are never allowed);
    ``eos_token_id``: the token the matcher allows once the grammar is complete.
    The llguidance tokenizer (about 0.5 s to build) is built on first use, or by
    :meth:`warm` (the server's startup calls it).

    Hostile input: a new constraint is first bounded in size and depth
    (``structured.limits``), then, with ``isolate`` (the default, when the tokenizer
    is a HF fast tokenizer), compiled in a worker process bounded by
    ``compile_timeout_s`` (``structured.compile_pool``), and only then compiled here
    on a dedicated thread with a large stack. A refusal at any stage is a
    :class:`RequestError` naming the field. The cache keeps at most ``cache_size``
    constraints and about ``cache_bytes`` bytes (least recently used dropped first).
    Compiles block the calling thread: the server calls :meth:`check` off its event
    loop.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        isolate: bool = True,
        compile_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.isolate = isolate
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._pool_failed = False
        self._compile_thread: ThreadPoolExecutor | None = None
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.num_cached_bytes = 0
        self._min_tokens: dict[tuple[str, str], int | None] = {}
        self._tables: ClosingTables | None = None
        self.num_compiled = 0  # cache misses, for tests and stats

    def _llg_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        return self._ll_tokenizer

    def warm(self) -> None:
        """Build the llguidance tokenizer now (blocking, thread-safe), so the first
        constrained request does not pay for it (0.5 s quiet, ~9 s measured on a loaded
        machine: long enough to time that request out), and start the compile worker.
        A tokenizer llguidance cannot take is left for the first constrained request to
        report."""
        with self._lock:
            try:
                self._llg_tokenizer()
            except Exception as e:  # noqa: BLE001 (reported by the request that needs it)
                logger.warning("grammar compiler: tokenizer not built at startup: %s", e)
        pool = self._compile_pool()
        if pool is not None:
            pool.warm()

    def _compile_pool(self) -> CompilePool | None:
        """The worker pool (started on first use); None without ``isolate`` or when
        the tokenizer cannot be handed to a worker (then compiles run here only)."""
        if not self.isolate:
            return None
        with self._pool_lock:
            if self._pool is None and not self._pool_failed:
                backend: Any = getattr(self.tokenizer, "backend_tokenizer", None)
                try:
                    from copy import copy

                    backend = copy(backend)
                    backend.no_padding()
                    backend.no_truncation()
                    text = backend.to_str()
                    self._pool = CompilePool(
                        text, self.vocab_size, self.eos_token_id, timeout_s=self.compile_timeout_s
                    )
                except Exception as e:  # noqa: BLE001 (not a HF fast tokenizer)
                    self._pool_failed = True
                    logger.warning(
                        "grammar compiler: no worker process (%s); constraints compile in "
                        "this process, bounded by size and depth only",
                        e,
                    )
            return self._pool

    def close(self) -> None:
        """Stop the compile worker (the server's shutdown calls it)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            self._pool_failed = True
        if pool is not None:
            pool.close()

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` (once; later calls hit the cache). Raises
        :class:`RequestError` with ``param="structured_outputs.<kind>"`` when the
        schema, regex or grammar is invalid. Changes nothing else."""
        self._compiled(params)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of the constrained output."""
        return self._compiled(params).deep_copy()

    def closing_tables(self) -> ClosingTables:
        """The closing-plan tables of this tokenizer (built on first use, ~0.1 s)."""
        with self._lock:
            if self._tables is None:
                tok = self._llg_tokenizer()
                n = min(int(tok.vocab_size), self.vocab_size)
                # ids past the tokenizer's vocabulary (padding) are never chosen
                raw = [tok.decode_bytes([i]) for i in range(n)] + [b""] * (self.vocab_size - n)
                special = {i for i in range(n) if tok.is_special_token(i)}
                special.discard(self.eos_token_id if self.eos_token_id is not None else -1)
                self._tables = ClosingTables(raw, self.eos_token_id, special)
            return self._tables

    def min_output_tokens(self, params: StructuredOutputsParams) -> int | None:
        """Tokens (EOS included) of the closing plan from the start of ``params``'s
        output: a ``max_tokens`` below it cannot end in a complete output. None when
        the plan walk finds no end (the constraint is then served unguarded).
        Compiles ``params`` first (RequestError as :meth:`check`)."""
        key = params.key()
        with self._lock:
            if key in self._min_tokens:
                return self._min_tokens[key]
        matcher = self.matcher(params)
        plan = closing_plan(matcher, 0, self.closing_tables(), self.eos_token_id)
        value = len(plan) if plan is not None else None
        with self._lock:
            self._min_tokens[key] = value
            while len(self._min_tokens) > self.cache_size:
                self._min_tokens.pop(next(iter(self._min_tokens)))
        return value

    def _compiled(self, params: StructuredOutputsParams) -> Any:
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind = params.kind
        field = f"structured_outputs.{kind}"
        value: Any = getattr(params, kind)
        check_structure(kind, value, field)
        pool = self._compile_pool()
        if pool is not None:
            try:
                pool.check(kind, list(value) if kind == "choice" else value)
            except CompileRefused as e:
                raise RequestError(
                    f"invalid {kind} for structured outputs: {_one_line(str(e))}; fix the "
                    f"{_WHAT[kind]} (for example {_EXAMPLE[kind]})",
                    param=field,
                    code="grammar_compiler_busy" if e.busy else "invalid_value",
                ) from None
        compiled = self._on_compile_thread(params)
        size = COMPILED_BYTES_PER_CHAR * len(key[1]) + 4096
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._sizes[key] = size
                self.num_cached_bytes += size
                self.num_compiled += 1
            self._cache.move_to_end(key)
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size or self.num_cached_bytes > self.cache_bytes
            ):
                old, _ = self._cache.popitem(last=False)
                self.num_cached_bytes -= self._sizes.pop(old, 0)
                self._min_tokens.pop(old, None)
            return self._cache.get(key, compiled)

    def _on_compile_thread(self, params: StructuredOutputsParams) -> Any:
        """``_compile(params)`` on the compiler's own thread (a large stack)."""
        with self._pool_lock:
            if self._compile_thread is None:
                old = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    self._compile_thread = ThreadPoolExecutor(1, "kvserve-grammar")
                    self._compile_thread.submit(lambda: None).result()
                finally:
                    threading.stack_size(old)
            executor = self._compile_thread
        return executor.submit(self._compile, params).result()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        kind = params.kind
        field = f"structured_outputs.{kind}"
        try:
            grammar = grammar_text(params)
        except (ValueError, TypeError) as e:
            raise RequestError(f"invalid {kind} for structured outputs: {e}", param=field) from None
        tokenizer = self._llg_tokenizer()
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if not error:
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else ""
        if not error:
            error = self._probe(matcher.deep_copy())
        if error:
            raise RequestError(
                f"invalid {kind} for structured outputs: {error.strip()}; fix the "
                f"{_WHAT[kind]} (for example {_EXAMPLE[kind]})",
                param=field,
            )
        return matcher

    def _probe(self, matcher: Any) -> str:
        """Walk the first ``PROBE_TOKENS`` tokens of one allowed path (the lowest
        allowed id each time); the error text when the constraint can produce no
        output at all (a schema whose ``$ref`` only refers to itself allows no first
        token) or its matcher fails on a token it allowed (a regex such as
        ``a{1000000}`` exceeds the lexer's limits on the first one), else "". A
        bounded check, not a proof: a failure deeper than the probe still ends the
        request with an error mid-generation (``StructuredBatch``)."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        # here, not at the top: importing the compiler must not load torch (the
        # simulator and the engine front import it)
        from kvserve.structured.bitmask import unpack_bitmask

        eos = self.eos_token_id
        for step in range(PROBE_TOKENS):
            if matcher.is_stopped() or matcher.is_accepting():
                return ""
            bitmask = allocate_token_bitmask(1, self.vocab_size)
            fill_next_token_bitmask(matcher, bitmask, 0)
            allowed = unpack_bitmask(bitmask, self.vocab_size)[0]
            if matcher.is_error():
                return (
                    f"it cannot be followed ({_first_line(matcher.get_error())} after {step} "
                    "tokens; for example a $ref that only refers to itself allows no output)"
                )
            if eos is not None and eos < self.vocab_size:
                allowed[eos] = False
            ids = allowed.nonzero()
            if ids.numel() == 0:
                return (
                    "it can never produce any output (no token is allowed "
                    + ("at the start" if step == 0 else f"after {step} tokens")
                    + "; for example a $ref that only refers to itself)"
                )
            if not matcher.consume_token(int(ids[0])) or matcher.is_error():
                return _first_line(matcher.get_error()) or "its matcher failed on a token"
        return ""


# Tokens of one path the compile-time probe walks (GrammarCompiler._probe).
PROBE_TOKENS = 16


def _one_line(text: str, limit: int = 600) -> str:
    """``text`` on one line (runs of whitespace as one space), at most ``limit``
    characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


_WHAT = {
    "json": "JSON schema",
    "json_object": "request",
    "regex": "regular expression",
    "choice": "choices",
    "grammar": "Lark grammar",
}
_EXAMPLE = {
    "json": '{"type": "object", "properties": {"name": {"type": "string"}}}',
    "json_object": '{"type": "json_object"}',
    "regex": '"[0-9]{3}-[a-z]+"',
    "choice": '["yes", "no"]',
    "grammar": 'start: "yes" | "no"',
}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet validated). Native code:
    call it only on a constraint :func:`check_structure` passed."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = params.kind
    if kind == "json":
        schema: Any = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
    if kind == "json_object":
        return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS))
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(str(params.regex)))
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in params.choice or ())
        return str(LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    text = str(params.grammar)
    if "::=" in text:
        text = gbnf_to_lark(text)
    return str(LLMatcher.grammar_from_lark(text))
