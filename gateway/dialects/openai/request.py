"""Completion and chat request bodies parsed into one ``ParsedRequest``, validated with vLLM's ranges.

Prompt length is only known after tokenizing, so ``max_tokens`` may stay ``None`` here; ``resolve_max_tokens``
settles it against the context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.http.errors import bad_request
from gateway.http.request_fields import Fields
from gateway.text.tool_calls import ToolChoice, parse_tool_choice, parse_tools
from gateway.text.tool_parsers import READS_SPECIAL_TOKENS
from protocol.serving import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, SamplingSpec, StructuredOutput, TokenBias

from .chat_prompt import ChatPrompt, parse_chat_prompt
from .structured_fields import parse_structured_output

MAX_N = 16  # completions per prompt
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_SCALE = 2.0**16  # temperature and repetition_penalty: the engine (SamplingParams) refuses more (and
# a repetition_penalty under 1 / MAX_SCALE)
MAX_PROMPTS = 64  # prompts in one completion request


@dataclass(slots=True)
class ParsedRequest:
    model: str | None
    prompts: list[str | list[int]]  # completions: one entry per prompt; chat: empty
    chat_prompt: ChatPrompt | None  # chat only: what the prompt is rendered from
    max_tokens: int | None  # None: up to the end of the context (chat) or 16 (completions)
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token; None: no logprobs
    sampling: dict = field(default_factory=dict)  # SamplingSpec fields except max_tokens, n and the logprobs
    user: str | None = None
    # completions: each choice's text (and logprobs) starts with its prompt; chat (vLLM's): each message
    # starts with the last one's content where that is the assistant's (a continued answer, whole)
    echo: bool = False
    prompt_logprobs: int | None = None  # asked for explicitly: the response carries a prompt_logprobs field
    structured_output: StructuredOutput | None = None  # the grammar the output follows
    tool_choice: ToolChoice | None = None  # chat: forced (its grammar is structured_output) or "auto" tool calls
    include_reasoning: bool = True  # chat, vLLM's: False drops the reasoning a reasoning parser splits off
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text in the output
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last k tokens (-1: the context)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    # vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries its choice's usage so far
    continuous_usage: bool = False
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the stop string that matched stays in the text

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top-k of the prompt logprobs the workers compute. Echo with logprobs needs them for the prompt's
        part (vLLM's rule); asked for both ways, the larger k serves both and each keeps its own top."""
        echoes_prompt = self.echo and self.chat_prompt is None
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if echoes_prompt else None) if k is not None]
        return max(wanted) if wanted else None

    def sampling_options(self, max_tokens: int) -> SamplingSpec:
        if self.sampling.get("min_tokens", 0) > max_tokens:
            raise bad_request(
                f"min_tokens ({self.sampling['min_tokens']}) must be <= max_tokens ({max_tokens})", "min_tokens"
            )
        return SamplingSpec(
            max_tokens=max_tokens,
            n=self.n,
            logprobs=self.logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            structured_output=self.structured_output,
            **self.sampling,
        )


def _refuse_unsupported(f: Fields, chat: bool) -> None:
    """A 400 for a field whose meaning this server does not implement. Unknown fields are ignored, as
    OpenAI and vLLM do; these are known ones, and an answer without them is not what was asked for."""

    def refuse(name: str, what: str | None = None) -> None:
        raise bad_request(f"{what or name} is not supported by this server", name)

    best_of = f.int("best_of", None, lo=1)
    if best_of is not None and best_of != f.raw("n", 1):
        refuse("best_of", "best_of other than n")
    if not chat:
        if f.raw("suffix", "") != "":
            refuse("suffix")
        return
    chosen = f.raw("function_call", "auto" if f.raw("functions") else "none")  # the legacy form of tools
    if f.raw("functions") and chosen != "none":
        refuse("functions", "tool calling with the legacy functions (use tools)")
    if chosen not in ("none", "auto"):
        refuse("function_call", f"function_call {str(chosen)[:60]!r}")


def _cache_salt(f: Fields) -> str:
    """vLLM's cache_salt: absent is "" (the shared prefix cache); given, a non-empty string of bounded size."""
    salt = f.str("cache_salt", None)
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
            "cache_salt",
        )
    return salt


def _common(f: Fields, chat: bool) -> dict:
    _refuse_unsupported(f, chat)
    stream = f.bool("stream", False)
    options = f.object("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    max_tokens = f.int("max_completion_tokens", None, lo=1) if chat else None
    if max_tokens is None:
        max_tokens = f.int("max_tokens", None, lo=1)
    prompt_logprobs = f.int("prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:  # as vLLM: stream chunks have no place for them
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    sampling = dict(
        temperature=f.float("temperature", 1.0, lo=0.0, hi=MAX_SCALE),
        top_p=f.float("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=f.int("top_k", 0, lo=-1),
        min_p=f.float("min_p", 0.0, lo=0.0, hi=1.0),
        seed=f.int("seed", None),
        presence_penalty=f.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, lo=1.0 / MAX_SCALE, hi=MAX_SCALE),
        min_tokens=f.int("min_tokens", 0, lo=0),
        stop_token_ids=f.token_ids("stop_token_ids"),
        ignore_eos=f.bool("ignore_eos", False),
        logit_bias=[TokenBias(t, b) for t, b in f.logit_bias("logit_bias", MAX_LOGIT_BIAS).items()],
        allowed_token_ids=_allowed_token_ids(f),
        cache_salt=_cache_salt(f),
    )
    if sampling["top_k"] == -1:
        sampling["top_k"] = 0
    structured_output = parse_structured_output(f)
    return dict(
        model=f.str("model", None),
        max_tokens=max_tokens,
        n=f.int("n", 1, lo=1, hi=MAX_N),
        stop=f.stop_strings(),
        stream=stream,
        include_usage=options.bool("include_usage", False) if options else False,
        continuous_usage=options.bool("continuous_usage_stats", False) if options else False,
        sampling=sampling,
        user=f.str("user", None),
        prompt_logprobs=prompt_logprobs,
        structured_output=structured_output,
        skip_special_tokens=f.bool("skip_special_tokens", True),
        tokens_as_ids=f.bool("return_tokens_as_token_ids", False),
        truncate_prompt_tokens=_truncation(f),
        include_stop_str=f.bool("include_stop_str_in_output", False),
    )


def _allowed_token_ids(f: Fields) -> list[int] | None:
    """vLLM's allowed_token_ids: only these ids are ever sampled (null or absent: any)."""
    if f.raw("allowed_token_ids") is None:
        return None
    ids = f.token_ids("allowed_token_ids")
    if not ids:
        raise bad_request("allowed_token_ids must name at least one token id", "allowed_token_ids")
    return ids


def _truncation(f: Fields) -> int | None:
    k = f.int("truncate_prompt_tokens", None, lo=-1)
    if k == 0:
        raise bad_request(
            "truncate_prompt_tokens must be -1 (the model's context) or >= 1, got 0", "truncate_prompt_tokens"
        )
    return k


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``k`` tokens (-1: as many as the context holds)."""
    if k is None:
        return ids
    if k > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({k}) is larger than this model's context ({max_model_len} tokens)",
            "truncate_prompt_tokens",
        )
    return ids[-(max_model_len if k == -1 else k) :]


def parse_completion(body) -> ParsedRequest:
    f = Fields(body)
    common = _common(f, chat=False)
    logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return ParsedRequest(
        prompts=_prompts(f.raw("prompt")), chat_prompt=None, logprobs=logprobs, echo=f.bool("echo", False), **common
    )


def parse_chat(body, tool_call_parser: str | None = None) -> ParsedRequest:
    """``tool_call_parser``: the server's reader of free-form tool calls (tool_choice "auto")."""
    f = Fields(body)
    common = _common(f, chat=True)
    top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    wants_logprobs = f.bool("logprobs", False)
    if top is not None and not wants_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if wants_logprobs else None
    tools = parse_tools(f.raw("tools"))
    tool_choice = parse_tool_choice(f, tools, tool_call_parser)
    forced = tool_choice.structured_output() if tool_choice is not None else None
    if forced is not None:
        if common["structured_output"] is not None:
            raise bad_request("tool_choice and a structured output both constrain the output; use one", "tool_choice")
        common["structured_output"] = forced
    if tool_choice is not None and tool_choice.auto_parser in READS_SPECIAL_TOKENS:
        common["skip_special_tokens"] = False
    return ParsedRequest(
        prompts=[],
        chat_prompt=parse_chat_prompt(f, tools),
        logprobs=logprobs,
        tool_choice=tool_choice,
        include_reasoning=f.bool("include_reasoning", True),
        echo=f.bool("echo", False),
        **common,
    )


def _prompts(prompt) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""

    def is_ids(p) -> bool:
        return (
            isinstance(p, list)
            and len(p) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
        )

    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists, and not empty",
            "prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    if any(p == "" for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, chat: bool) -> int:
    """``max_tokens`` checked against the context; errors give both numbers, as clients need them."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} "
            "tokens, which leaves no room to generate",
            "prompt" if not chat else "messages",
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if chat else min(16, room)
    if requested > room:
        raise bad_request(
            f"this model's context is {max_model_len} tokens; you requested {num_prompt_tokens + requested} "
            f"({num_prompt_tokens} in the prompt, {requested} to generate)",
            "max_tokens",
        )
    return requested
