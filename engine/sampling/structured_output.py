"""Structured outputs: a grammar per request masks every token that would break it (xgrammar, as vLLM).

A request's ``StructuredOutput`` (protocol/serving.py) asks for JSON following a schema, any JSON
object, a regex, one of a list of strings, or an EBNF grammar. Its life on a worker:

1. Admission: ``Grammars.guide`` compiles the grammar against this model's vocabulary (xgrammar
   caches compiled grammars by their text) and returns a fresh ``Guide``, kept on the Sequence. A bad
   grammar is a ``StructuredOutputError`` naming what is wrong; nothing is queued. The workers compile
   on a thread of their own (``guide_async``), as vLLM does, so a slow grammar holds up only its request.
2. Each sampled step: ``apply_grammars_`` sets to -inf, before anything reads the logits, every token the
   matcher would refuse. Logprobs are then those of the masked distribution, as in vLLM.
3. The scheduler feeds the sampled token to the guide; a grammar that accepted a stop token has
   ended, and so has the sequence ("stop"), even under ``ignore_eos``. A completion forked for n > 1
   forks the guide; a decode worker feeds its guide the first token the prefill worker sampled.

A request whose output starts inside a model's reasoning (``StructuredOutput.after``, set by the
gateway's reasoning parser) gets its grammar only after the reasoning's end: a ``ReasoningGate`` in
front of the guide takes the tokens until then, unmasked.

xgrammar is imported on first use, and the tokenizer read then (as vLLM does): a worker that never
sees a structured output pays nothing for them.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.sampling.grammar_compiles import CompiledCache, CompileTicket, GrammarLimits, StructuredOutputError
from protocol.serving import StructuredOutput

# JSON is generated without free whitespace between tokens: a model is never stuck emitting spaces,
# and the output parses the same. (vLLM's xgrammar backend allows any whitespace unless told not to.)
_JSON_OPTIONS = dict(any_whitespace=False)
_JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's json_object: any JSON object
_CONTROL_BYTE = re.compile(rb"[\x00-\x1f]")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class ReasoningGate:
    """Holds a grammar back until the output has written ``end`` (a reasoning parser's ``</think>``):
    a thinking model reasons freely, and the grammar applies from the token after, as in vLLM. The
    output's bytes are matched, not token ids, so an end spelled in several tokens counts too."""

    __slots__ = ("_end", "_token_bytes", "_tail", "passed")

    def __init__(self, end: bytes, token_bytes: list[bytes]):
        self._end = end
        self._token_bytes = token_bytes  # each token id's bytes (xgrammar's decoded vocabulary)
        self._tail = b""  # the output's last len(end) - 1 bytes: where an end may have begun
        self.passed = False

    def feed(self, token_id: int) -> None:
        piece = self._token_bytes[token_id] if token_id < len(self._token_bytes) else b""
        seen = self._tail + piece
        self.passed = self._end in seen
        self._tail = seen[1 - len(self._end) :] if len(self._end) > 1 else b""

    def copy(self) -> ReasoningGate:
        twin = ReasoningGate(self._end, self._token_bytes)
        twin._tail, twin.passed = self._tail, self.passed
        return twin


class Guide:
    """One sequence's place in its grammar: an xgrammar matcher, plus the tokens its kind never allows,
    and the reasoning gate in front of it where the request has one."""

    __slots__ = ("_matcher", "_keep", "_gate")

    def __init__(self, matcher, keep: torch.Tensor | None, gate: ReasoningGate | None = None):
        self._matcher = matcher
        self._keep = keep  # [ceil(V / 32)] int32 ANDed into every bitmask row; None keeps all
        self._gate = gate

    @property
    def constrains(self) -> bool:
        """False while the output is still reasoning: every token is allowed, none reaches the matcher."""
        return self._gate is None or self._gate.passed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Sets ``bitmask[row]`` to the tokens allowed next (bit t of the row: token t)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._keep is not None:
            bitmask[row] &= self._keep

    def accept(self, token_id: int) -> bool:
        if not self.constrains:
            self._gate.feed(token_id)
            return True
        return self._matcher.accept_token(token_id)

    @property
    def is_ended(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        return self.constrains and self._matcher.is_terminated()

    def fork(self) -> Guide:
        return Guide(self._matcher.fork(), self._keep, self._gate.copy() if self._gate is not None else None)


class Grammars:
    """Compiles requests' grammars against one model's vocabulary; the tokenizer is read on first use."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        stop_token_ids: list[int],
        limits: GrammarLimits = GrammarLimits(),
    ):
        self._tokenizer_path = str(tokenizer_path)
        self._limits = limits
        self._loaded_at: float | None = None  # time.monotonic() when the tokenizer was read (compile deadlines start)
        self._vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's size)
        self._stop_token_ids = list(stop_token_ids)  # the grammar's end: the model's EOS ids
        self._compiler = None
        self._compiled = CompiledCache(limits.cache_bytes)  # bounded by pdserve, not by xgrammar
        self._json_keep: torch.Tensor | None = None  # tokens JSON output may use (see _load)
        self._token_bytes: list[bytes] = []  # each token id's bytes, for reasoning gates (see _load)
        self._executor: ThreadPoolExecutor | None = None  # guide_async's threads, started on first use
        self._loading = threading.Lock()  # guide() runs on that thread and, offline, on the caller's

    def guide_async(self, spec: StructuredOutput) -> CompileTicket:
        """``guide(spec)`` on this object's compiling threads: a worker's loop goes on serving while a
        grammar compiles (xgrammar lets go of the GIL; one schema tried took 1 s) or the tokenizer
        loads. The ticket raises StructuredOutputError where ``guide`` would, and past the compile
        deadline (engine/sampling/grammar_compiles.py)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._limits.num_threads, thread_name_prefix="grammar")
        return CompileTicket(
            self._executor.submit(self.guide, spec), self._limits.compile_timeout_s, lambda: self._loaded_at
        )

    @property
    def cache_size_bytes(self) -> int:
        """Bytes the cache of compiled grammars holds now (CompiledCache measures them)."""
        return self._compiled.size_bytes

    def guide(self, spec: StructuredOutput) -> Guide:
        """A fresh Guide for ``spec``; raises StructuredOutputError."""
        import xgrammar as xgr

        with self._loading:
            if self._compiler is None:
                self._load()
        compiled = self._compiled.get((spec.kind, spec.spec))
        if compiled is None:
            compiled = self._compile(spec)
            self._compiled.put((spec.kind, spec.spec), compiled)
        is_json = spec.kind in ("json", "json_object")
        gate = ReasoningGate(spec.after.encode(), self._token_bytes) if spec.after else None
        return Guide(xgr.GrammarMatcher(compiled), self._json_keep if is_json else None, gate)

    def _compile(self, spec: StructuredOutput):
        compiler = self._compiler
        with _errors_named(spec):
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, **_JSON_OPTIONS)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, **_JSON_OPTIONS)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            return compiler.compile_grammar(_ebnf_of(spec))

    def _load(self) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        except (OSError, ValueError) as exc:
            raise StructuredOutputError(
                f"structured outputs need the model's tokenizer, which did not load "
                f"from {self._tokenizer_path}: {str(exc)[:200]}"
            ) from None
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids or None
        )
        # xgrammar's JSON strings admit raw control characters (U+0000-U+001F), which JSON forbids and
        # strict parsers reject; with no free whitespace, JSON output never needs one. A UTF-8 byte
        # below 0x20 is always such a character, so the token bytes tell.
        self._token_bytes = info.decoded_vocab
        control = [t for t, piece in enumerate(self._token_bytes) if _CONTROL_BYTE.search(piece)]
        keep = xgr.allocate_token_bitmask(1, self._vocab_size)[0]  # all ones
        for t in control:
            keep[t // 32] &= _CLEAR_BIT[t % 32]
        self._json_keep = keep
        # xgrammar's own cache off: its limit is approximate, so CompiledCache holds the grammars
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._loaded_at = time.monotonic()


def apply_grammars_(logits: torch.Tensor, seqs: list) -> set[int]:
    """Sets (in place) the logits of tokens each row's grammar refuses to -inf; rows without a grammar
    are untouched. Returns the rows whose grammar allows nothing but a stop token: ``min_tokens`` must
    not mask those, or no token would be left."""
    rows = [i for i, s in enumerate(seqs) if s.guide is not None and s.guide.constrains]
    if not rows:
        return set()
    import xgrammar as xgr

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab)  # [S, ceil(V / 32)] int32; bit t: token t allowed
    for i in rows:
        seqs[i].guide.fill(bitmask, i)
    only_stop = set()
    for i in rows:
        stops = [t for t in seqs[i].stop_token_ids if t < vocab]
        if stops and not _allows_other_than(bitmask[i], stops):
            only_stop.add(i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)
    return only_stop


def _allows_other_than(words: torch.Tensor, token_ids: list[int]) -> bool:
    """Whether the bitmask row ``words`` allows any token outside ``token_ids``."""
    rest = words.clone()
    for t in token_ids:
        rest[t // 32] &= _CLEAR_BIT[t % 32]
    return bool(rest.any())


_CLEAR_BIT = [~(1 << b) for b in range(31)] + [0x7FFFFFFF]  # int32 words: bit 31 is the sign bit


def _ebnf_of(spec: StructuredOutput) -> str:
    if spec.kind == "grammar":
        return spec.spec
    try:  # choice: a JSON list of strings, one alternative each (JSON string escapes are EBNF's)
        choices = json.loads(spec.spec)
    except ValueError:
        choices = None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@contextlib.contextmanager
def _errors_named(spec: StructuredOutput):
    """Turns xgrammar's RuntimeError into a StructuredOutputError naming the kind of grammar."""
    try:
        yield
    except StructuredOutputError:
        raise
    except (RuntimeError, ValueError) as exc:
        reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
        raise StructuredOutputError(f"invalid {_WHAT[spec.kind]}: {reason[:300]}") from None


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "EBNF grammar",
}
