"""Structured outputs: text that follows a JSON schema, a regex, a choice or a grammar.

vLLM v1's design, on xgrammar. `StructuredOutputsParams` (`SamplingParams.structured_outputs`)
names one constraint and is checked on construction by xgrammar's parsers, which need no
tokenizer (0.4 ms for a typical JSON schema), so a bad schema, regex or grammar is refused
where the request is made, as a `ValueError` naming `structured_outputs`.

Compiling a constraint against the vocabulary (xgrammar precomputes token masks) costs more:
on this project's 2-core CPU with SmolLM2's 49,152 tokens, 7-12 ms for a typical JSON schema,
about a decode step, and 240 ms once for xgrammar's tokenizer info. So `StructuredOutputManager`
compiles on a thread of its own (xgrammar releases the GIL: a Python loop beside a compile kept
63% of its pace on the loaded machine) and caches compiled grammars by spec; a request whose
spec is cached gets its matcher at once (0.06 ms), the others wait in the scheduler's
queue as `WAITING_FOR_FSM` without holding back the requests behind them.

Each request (each child of `n > 1`) has its own matcher (`StructuredOutputGrammar`), advanced
by the scheduler on every token it appends. Each step, `grammar_bitmask` fills one row of
allowed tokens per sampled position of a constrained request (per draft position too: the
matcher advances over the drafts and rolls back) and the sampler sets every other logit of
those rows to -inf. A matcher that has terminated (it accepted EOS where the grammar ends)
finishes its request with "stop". A request resumed after a worker died first accepts the
tokens emitted before. A step whose batch has no constraint does none of this.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.request import Request

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# (xgrammar's source form: "json_schema" | "regex" | "ebnf", its text, any_whitespace)
GrammarKey = tuple[str, str, bool]
# Compiled grammars kept, by the bytes xgrammar reports: a 3-property schema over SmolLM2's
# vocabulary takes 42 KB, so this holds about 1,500 such schemas.
CACHE_BYTES = 64 << 20
_REFUSED_RESUME = "structured_outputs refuses the tokens the resumed request emitted"
# The most whitespace characters JSON may have between two tokens (room for indentation 8
# levels deep at 2 spaces). Unbounded, a weak model can spend its tokens on whitespace: the
# tests' random-weight model at temperature 0.7 wrote 300 tokens of it after `{"name": "...",`
# on a 4-property schema; bounded at 20, it closed the object in 71 tokens.
MAX_WHITESPACE = 20
# xgrammar prefixes its errors with a timestamp and a C++ source position.
_XGR_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] \S+: ")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's text (vLLM's names); exactly one of the first five is set.

    - `json`: a JSON schema (a dict, or its JSON text) the text is an instance of;
    - `regex`: a regular expression the whole text matches;
    - `choice`: the text is one of these strings;
    - `grammar`: an EBNF grammar in xgrammar's dialect (GBNF's), whose rule `root` is the text;
    - `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).

    `disable_any_whitespace` (json, json_object): no whitespace between JSON tokens; otherwise
    up to `MAX_WHITESPACE` characters of it.

    Validated on construction, with xgrammar's parsers: a bad value raises `ValueError`
    naming `structured_outputs`. On the wire it is the map of the fields set (`from_dict`).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    @classmethod
    def from_dict(cls, fields_set: dict[str, Any]) -> StructuredOutputsParams:
        """From the map of the fields set (the wire's and the API's form)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in set(fields_set) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {known}")
        return cls(**fields_set)

    def __post_init__(self) -> None:
        given = self._kinds_set()
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        self._check_types()
        try:
            _parse(self.key)
        except RuntimeError as e:  # every xgrammar error is one
            raise ValueError(f"structured_outputs {self.kind} is invalid: {_message(e)}") from None

    def _check_types(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"structured_outputs {name} {why}, got {getattr(self, name)!r}")

        check(isinstance(self.json, dict | str | None), "json", "must be an object or JSON text")
        check(isinstance(self.regex, str | None), "regex", "must be a string")
        check(
            self.choice is None
            or (
                isinstance(self.choice, list)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice)
            ),
            "choice",
            "must be a non-empty list of non-empty strings",
        )
        check(isinstance(self.grammar, str | None), "grammar", "must be a string")
        check(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        check(
            isinstance(self.disable_any_whitespace, bool)
            and not (self.disable_any_whitespace and self.kind not in ("json", "json_object")),
            "disable_any_whitespace",
            "must be a boolean, true only with json or json_object",
        )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None

    def _kinds_set(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        """Which of `KINDS` is set."""
        return self._kinds_set()[0]

    @functools.cached_property
    def key(self) -> GrammarKey:
        """The constraint as xgrammar takes it, which is also its compile-cache key: a JSON
        schema's text (json_object: `{"type": "object"}`), a regex, or an EBNF grammar (a
        choice: its strings as alternatives)."""
        any_whitespace = not self.disable_any_whitespace
        if self.json_object:
            return "json_schema", '{"type": "object"}', any_whitespace
        if self.json is not None:
            if isinstance(self.json, str):
                return "json_schema", self.json, any_whitespace
            try:  # key order kept: it is the order of the properties in the text
                return "json_schema", json.dumps(self.json, allow_nan=False), any_whitespace
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"structured_outputs json is not a JSON value: {e}") from None
        if self.regex is not None:
            return "regex", self.regex, True
        if self.choice is not None:
            # JSON's string escapes are EBNF's (\", \\, \n, \uXXXX)
            return "ebnf", "root ::= " + " | ".join(json.dumps(c) for c in self.choice), True
        return "ebnf", self.grammar, True


def _parse(key: GrammarKey) -> xgr.Grammar:
    """The grammar of a constraint, without the vocabulary; raises RuntimeError if invalid."""
    form, text, any_whitespace = key
    if form == "json_schema":
        return xgr.Grammar.from_json_schema(
            text, any_whitespace=any_whitespace, max_whitespace_cnt=MAX_WHITESPACE
        )
    if form == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


def _message(error: Exception) -> str:
    """An error's first line, without xgrammar's prefix."""
    lines = str(error).strip().splitlines()
    return _XGR_ERROR_PREFIX.sub("", lines[0]) if lines else type(error).__name__


class StructuredOutputGrammar:
    """One request's matcher: where its text stands in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size  # the model's logits width, which the bitmask covers

    def accept_token(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and no change) if the grammar does not allow it."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(token_id)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar allows from here; no state change."""
        num_valid = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            self.matcher.rollback(num_valid)
        return token_ids[:num_valid]

    def is_terminated(self) -> bool:
        """The grammar's text is complete and its stop token (EOS) accepted."""
        return self.matcher.is_terminated()


def grammar_bitmask(rows: list[tuple[StructuredOutputGrammar, list[int]]]) -> torch.Tensor:
    """[sum(len(drafts) + 1), ceil(V / 32)] int32, bit t of a row set = token t allowed.

    Per (grammar, drafts) in `rows`, in order: the row after the known tokens, then the row
    after each draft, the matcher advanced over the drafts and rolled back. A draft the
    grammar refuses leaves the rows after it full: its own row refuses it, so the verifier
    rejects it and never reads them; a terminated matcher's rows are full too.
    """
    bitmask = xgr.allocate_token_bitmask(
        sum(len(drafts) + 1 for _, drafts in rows), rows[0][0].vocab_size
    )
    row = 0
    for grammar, drafts in rows:
        num_accepted = 0
        for j in range(len(drafts) + 1):
            if num_accepted == j and not grammar.is_terminated():
                grammar.matcher.fill_next_token_bitmask(bitmask, row + j)
                if j < len(drafts) and grammar.accept_token(drafts[j]):
                    num_accepted += 1
        if num_accepted:
            grammar.matcher.rollback(num_accepted)
        row += len(drafts) + 1
    return bitmask


class StructuredOutputManager:
    """Compiles requests' grammars on its own thread, caches them by spec, and gives each
    request its matcher. Every method runs on the engine's thread; the compile thread only
    compiles (its first compile builds xgrammar's tokenizer info: it reads the vocabulary,
    which the Rust tokenizer serves beside a tokenizer thread's encodes)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiler: xgr.GrammarCompiler | None = None  # on the compile thread, when needed
        # One compile at a time, and xgrammar's own threads at 1 (measured 10.6 ms a typical
        # schema, 6.5 ms with 2): it takes one core from the model's threads, not both. The
        # thread starts with the first compile.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvrail-grammar")
        self._cache: OrderedDict[GrammarKey, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._compiling: dict[GrammarKey, Future[xgr.CompiledGrammar]] = {}
        self._waiting: dict[GrammarKey, list[Request]] = {}  # for each compile in flight

    @property
    def is_compiling(self) -> bool:
        return bool(self._compiling)

    def grammar_init(self, request: Request) -> None:
        """Give `request` its matcher now if its spec is compiled, else once it is (`update`).
        A resumed request's matcher accepts its resumed tokens first: `ValueError` if the
        grammar refuses them."""
        key = request.sampling_params.structured_outputs.key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            request.grammar = self._new_grammar(request, compiled)
            return
        if key not in self._compiling:
            self._compiling[key] = self._executor.submit(self._compile, key)
        self._waiting.setdefault(key, []).append(request)

    def update(self) -> list[tuple[str, str]]:
        """Give finished compiles' matchers to their waiting requests; returns the (request
        id, error) of those that cannot run: their compile failed or refused resumed tokens."""
        failed = []
        for key in [key for key, future in self._compiling.items() if future.done()]:
            future = self._compiling.pop(key)
            requests = [r for r in self._waiting.pop(key) if not r.is_finished()]
            try:
                compiled = future.result()
            except Exception as e:  # of this spec alone: its requests fail, nothing else
                error = f"structured_outputs could not be compiled: {_message(e)}"
                failed += [(r.request_id, error) for r in requests]
                continue
            self._insert(key, compiled)
            for request in requests:
                try:
                    request.grammar = self._new_grammar(request, compiled)
                except ValueError as e:
                    failed.append((request.request_id, str(e)))
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until a compile in flight finishes, at most `timeout_s`: what a step does
        when every request waits for its grammar, instead of spinning."""
        wait(self._compiling.values(), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """On the compile thread."""
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,  # the logits' width, padded ids included
                stop_token_ids=None if self.eos_token_id is None else [self.eos_token_id],
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(_parse(key))

    def _insert(self, key: GrammarKey, compiled: xgr.CompiledGrammar) -> None:
        self._cache[key] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= evicted.memory_size_bytes

    def _new_grammar(
        self, request: Request, compiled: xgr.CompiledGrammar
    ) -> StructuredOutputGrammar:
        grammar = StructuredOutputGrammar(compiled, self.vocab_size)
        resumed = request.prompt_token_ids[request.num_prompt_tokens - request.num_resumed_tokens :]
        for token_id in resumed:
            if not grammar.accept_token(token_id):
                raise ValueError(_REFUSED_RESUME)
        return grammar
