"""Token-in/token-out state of one agent episode: what the model sampled, what the
environment added, and the budget left. Pure (no HTTP); :mod:`~asyncrl.tasks.inference.proxy`
serves it.

Output tokens are model tokens (``output_mask`` True) or environment tokens (False: turn
ends, tool results, user messages, the next generation prompt). History is never
re-tokenised: only new messages are rendered, as a delta against a fixed anchor conversation
A = [user "x"] with gen = render(A, generation prompt):

    env tokens = encode(render(A + [assistant "y"] + new, generation prompt)[len(gen + "y"):])

so the trainer trains on exactly the tokens the model saw and sampled; a template that breaks
the anchor raises :class:`TemplateError`. Why: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from asyncrl.tasks.inference.samples import FinishReason, SampleOutput
from asyncrl.tasks.inference.tool_calls import parse_tool_calls

ChatFinishReason = Literal["stop", "length", "tool_calls"]
ANCHOR_USER: dict[str, Any] = {"role": "user", "content": "x"}
"""The anchor conversation's user message (never modified)."""
ANCHOR_REPLY = "y"


class ChatTokenizer(Protocol):
    """The part of a transformers tokenizer used here."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


class ConversationError(ValueError):
    """A request that does not extend the episode token-exactly (HTTP 400); says why."""


class BudgetExhausted(ConversationError):
    """No token budget is left for another model turn (the episode ends with ``length``)."""


class TemplateError(RuntimeError):
    """The chat template breaks an assumption the delta rendering needs (a setup error)."""


@dataclass(frozen=True)
class EpisodeBudget:
    """Token caps of one episode.

    Allowance of the next model turn = min(max_episode_tokens - model tokens so far,
    max_context_tokens - (prompt + output + new environment tokens)); a request's
    max_tokens is clipped to it, and a request with allowance < 1 is refused.
    """

    max_episode_tokens: int
    """Model-sampled tokens over all turns."""
    max_context_tokens: int
    """Prompt + every output token (model and environment), i.e. the longest sequence the
    trainer gets; at most the servers' max model length."""

    def __post_init__(self) -> None:
        for name in ("max_episode_tokens", "max_context_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")

    def allowance(self, model_tokens: int, context_tokens: int) -> int:
        return min(self.max_episode_tokens - model_tokens, self.max_context_tokens - context_tokens)


@dataclass(frozen=True)
class EpisodeTokens:
    """The trajectory of one episode; the five output arrays have one entry per output token."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_mask: list[bool]
    """True: sampled by the model (trained on); False: added by the environment."""
    behaviour_logprobs: list[float]
    """log pi_behav of each model token; 0.0 for environment tokens."""
    token_versions: list[int]
    """Weight version of each model token; environment tokens repeat the previous model token's."""
    turn_starts: list[int]
    """Output offsets where each model turn begins (increasing; the first is 0)."""
    finish_reason: FinishReason
    """``length`` if the episode's budget cut or refused a turn, else the last turn's reason."""
    final_text: str
    """The last model turn's text: the assistant message content (chat) or completion text."""
    budget_exhausted: bool = False
    """The episode's budget (not a request's own ``max_tokens``) cut or refused a turn."""

    def __post_init__(self) -> None:
        n = len(self.output_token_ids)
        lengths = (len(self.output_mask), len(self.behaviour_logprobs), len(self.token_versions))
        if lengths != (n, n, n):
            raise ValueError(f"EpisodeTokens: {n} output tokens but mask/logprobs/versions lengths {lengths}")
        if not self.turn_starts or self.turn_starts[0] != 0 or self.turn_starts != sorted(set(self.turn_starts)):
            raise ValueError(f"EpisodeTokens: turn_starts {self.turn_starts} must be increasing from 0")
        if not all(self.output_mask[i] for i in self.turn_starts if i < n) or self.turn_starts[-1] >= n:
            raise ValueError(f"EpisodeTokens: turn_starts {self.turn_starts} must point at model tokens")


@dataclass(frozen=True)
class TurnPlan:
    """What the next model turn continues and how long it may be; nothing is recorded yet."""

    context_token_ids: list[int]
    """prompt + output so far + ``new_token_ids``: the model's input."""
    new_token_ids: list[int]
    """The prompt (first turn) or the environment tokens added before this turn."""
    max_new_tokens: int
    clipped: bool
    """The request asked for more tokens than the budget allows."""
    base_output_len: int
    """Output length the plan was made on; a plan is recorded only onto that same state."""


class Trajectory:
    """Prompt + output tokens with mask, log-probs, versions and turn starts, under a budget."""

    def __init__(self, budget: EpisodeBudget) -> None:
        self._budget = budget
        self.prompt: list[int] | None = None
        self.output: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turn_starts: list[int] = []
        self.model_tokens = 0
        self.last_finish: FinishReason | None = None
        self.budget_exhausted = False

    @property
    def last_token(self) -> int | None:
        return self.output[-1] if self.output else None

    def plan(self, new_token_ids: list[int], requested_max_tokens: int | None) -> TurnPlan:
        """Plan a model turn after ``new_token_ids``; :class:`BudgetExhausted` (and the episode
        ends with ``length``) if the budget leaves no token for it."""
        context = new_token_ids if self.prompt is None else self.prompt + self.output + new_token_ids
        if not context:
            raise ConversationError("the prompt is empty: at least one token is needed")
        allowance = self._budget.allowance(self.model_tokens, len(context))
        if allowance < 1:
            self.budget_exhausted = True
            raise BudgetExhausted(
                f"episode budget exhausted: {self.model_tokens}/{self._budget.max_episode_tokens} model tokens "
                f"used, context would be {len(context)}/{self._budget.max_context_tokens} tokens before this turn"
            )
        requested = allowance if requested_max_tokens is None else requested_max_tokens
        return TurnPlan(
            context_token_ids=list(context),
            new_token_ids=list(new_token_ids),
            max_new_tokens=min(requested, allowance),
            clipped=requested > allowance,
            base_output_len=len(self.output) if self.prompt is not None else -1,
        )

    def record(self, plan: TurnPlan, sample: SampleOutput) -> None:
        """Append the plan's environment tokens (or set its prompt), then the sampled turn."""
        if plan.base_output_len != (len(self.output) if self.prompt is not None else -1):
            raise ConversationError("the episode changed while this call was generating (concurrent calls)")
        if not sample.output_token_ids or len(sample.output_token_ids) > plan.max_new_tokens:
            raise RuntimeError(
                f"Trajectory: a turn of {len(sample.output_token_ids)} tokens for a budget of {plan.max_new_tokens}"
            )
        if self.prompt is None:
            self.prompt = list(plan.new_token_ids)
        else:
            env = plan.new_token_ids
            self.output += env
            self.mask += [False] * len(env)
            self.logprobs += [0.0] * len(env)
            self.versions += [self.versions[-1]] * len(env)
        if not self.output or not self.mask[-1]:  # a continuation with nothing inserted extends its turn
            self.turn_starts.append(len(self.output))
        self.output += sample.output_token_ids
        self.mask += [True] * len(sample.output_token_ids)
        self.logprobs += sample.behaviour_logprobs
        self.versions += sample.token_versions
        self.model_tokens += len(sample.output_token_ids)
        self.last_finish = sample.finish_reason
        if sample.finish_reason == "length" and plan.clipped:
            self.budget_exhausted = True

    def episode_tokens(self, final_text: str) -> EpisodeTokens | None:
        """The trajectory so far; None before the first model turn."""
        if self.prompt is None or self.last_finish is None:
            return None
        return EpisodeTokens(
            prompt_token_ids=list(self.prompt),
            output_token_ids=list(self.output),
            output_mask=list(self.mask),
            behaviour_logprobs=list(self.logprobs),
            token_versions=list(self.versions),
            turn_starts=list(self.turn_starts),
            finish_reason="length" if self.budget_exhausted else self.last_finish,
            budget_exhausted=self.budget_exhausted,
            final_text=final_text,
        )


def turn_text(tokenizer: ChatTokenizer, sample: SampleOutput) -> str:
    """Text of a model turn: its tokens without the final stop token, special tokens kept."""
    ids = sample.output_token_ids[:-1] if sample.finish_reason == "stop" else sample.output_token_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


# ----- chat messages -----


def _content_text(content: object, where: str) -> str:
    """Message content as text: None -> "", a string, or a list of ``{"type": "text"}`` parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ConversationError(f"{where}.content[{i}]: only text parts are supported, got {part!r:.200}")
            parts.append(part["text"])
        return "".join(parts)
    raise ConversationError(f"{where}.content: must be a string, null or a list of text parts, got {content!r:.200}")


def _arguments_value(arguments: object) -> object:
    """Tool-call arguments compared by value: JSON text is parsed (unparsable text stays text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize_message(message: object, where: str) -> dict[str, Any]:
    """A request message in the form the template renders: text content ("" for None),
    tool calls as ``{"id", "type": "function", "function": {"name", "arguments": str}}``,
    ``tool_call_id``/``name`` kept."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
        raise ConversationError(f"{where}: a message is an object with a string 'role', got {message!r:.200}")
    normalized: dict[str, Any] = {"role": message["role"], "content": _content_text(message.get("content"), where)}
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ConversationError(f"{where}.tool_calls: must be a list, got {calls!r:.200}")
    if calls:
        normalized["tool_calls"] = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConversationError(f"{where}.tool_calls[{i}]: needs function.name, got {call!r:.200}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        normalized["tool_calls"].append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            normalized[key] = message[key]
    return normalized


def _compared(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal between a history message and its resent copy: role, content,
    tool calls (name and argument values; ids are not compared)."""
    calls = message.get("tool_calls", [])
    compared_calls = [(c["function"]["name"], _arguments_value(c["function"]["arguments"])) for c in calls]
    return message["role"], message["content"], compared_calls


def check_history(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> None:
    """``ConversationError`` unless ``messages`` starts with ``history`` (compared by :func:`_compared`)."""
    if len(messages) < len(history):
        raise ConversationError(
            f"messages: {len(messages)} messages but the episode's history has {len(history)}: each request must "
            "resend the whole conversation so far (including the assistant message returned last), then new messages"
        )
    for i, (old, new) in enumerate(zip(history, messages)):
        if _compared(old) != _compared(new):
            raise ConversationError(
                f"messages[{i}] ({new['role']}) differs from the episode's history "
                f"({_compared(new)!r:.300} != recorded {_compared(old)!r:.300}): history cannot be edited, "
                "only extended (the recorded tokens would no longer be what the model saw)"
            )


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n :]


class TurnRenderer:
    """Renders prompts and environment tokens with a chat template, tools fixed."""

    def __init__(self, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        self._anchor = [ANCHOR_USER, {"role": "assistant", "content": ANCHOR_REPLY}]
        self._head = self.render([ANCHOR_USER], add_generation_prompt=True) + ANCHOR_REPLY
        """``gen + "y"``: what every anchored render must start with."""
        closed = [
            self.render([ANCHOR_USER, {"role": "assistant", "content": reply}], add_generation_prompt=False)
            for reply in (ANCHOR_REPLY, "z")
        ]
        self.close_token_ids = self._encode(_common_suffix(*closed))
        """Tokens that end an assistant turn (``<|im_end|>\\n`` for ChatML): what follows the
        content of a one-character assistant message (whatever the template puts before it)."""
        # Fails now rather than at an episode's second turn when the template cannot do deltas.
        self.env_ids(None, [{"role": "user", "content": "z"}])

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        text = self._tokenizer.apply_chat_template(
            messages, tools=self._tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        if not isinstance(text, str):
            raise TemplateError(f"chat template: rendering returned {type(text).__name__}, not text")
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Tokens of a first request: its messages and the generation prompt."""
        return self._encode(self.render(messages, add_generation_prompt=True))

    def env_ids(self, stop_token: int | None, new_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens after a model turn: the end of that turn, the new messages and the next
        generation prompt, i.e. ``render(A + [assistant "y"] + new)[len(gen + "y"):]``
        (see the module docstring), less its first token if that is ``stop_token`` (the
        token the model ended its turn with)."""
        full = self.render([*self._anchor, *new_messages], add_generation_prompt=True)
        if not full.startswith(self._head):
            raise TemplateError(
                "chat template: with later messages, an assistant turn does not render as the generation prompt + "
                f"its content ({full[: len(self._head) + 20]!r} does not start with {self._head!r}); the "
                "environment tokens between model turns cannot be computed as a delta"
            )
        ids = self._encode(full[len(self._head) :])
        return ids[1:] if ids and ids[0] == stop_token else ids


@dataclass(frozen=True)
class ChatPlan:
    turn: TurnPlan
    messages: list[dict[str, Any]]
    """The request's messages, normalised."""
    parse_tools: bool
    renderer: TurnRenderer
    tools_key: str
    """The request's tools, canonical JSON: every request of an episode must send the same."""


@dataclass(frozen=True)
class AssistantTurn:
    message: dict[str, Any]
    """The OpenAI assistant message: role, content (None when only tool calls), tool_calls if any."""
    finish_reason: ChatFinishReason


class ChatConversation:
    """A chat episode: messages in, tokens recorded; see the module docstring for the rules."""

    def __init__(self, tokenizer: ChatTokenizer, budget: EpisodeBudget, episode_id: str) -> None:
        self._tokenizer = tokenizer
        self._episode_id = episode_id
        self._trajectory = Trajectory(budget)
        self._renderer: TurnRenderer | None = None
        self._tools_key: str | None = None
        self._history: list[dict[str, Any]] = []
        self.turn_texts: list[str] = []
        """Decoded text of each model turn."""
        self._final_text = ""

    def plan(
        self, messages: object, tools: list[dict[str, Any]] | None, requested_max_tokens: int | None, parse_tools: bool
    ) -> ChatPlan:
        """The next turn for a request; ``ConversationError`` if it does not extend the episode."""
        if not isinstance(messages, list) or not messages:
            raise ConversationError("messages: must be a non-empty list")
        normalized = [normalize_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        tools_key = json.dumps(tools or [], sort_keys=True)
        if self._renderer is None:  # no turn recorded yet (a first call that failed leaves no trace)
            renderer = TurnRenderer(self._tokenizer, tools or None)
            new_ids = renderer.prompt_ids(normalized)
        else:
            if tools_key != self._tools_key:
                raise ConversationError("tools: differ from the episode's first request; they must stay the same")
            check_history(self._history, normalized)
            renderer = self._renderer
            stop_token = self._trajectory.last_token if self._trajectory.last_finish == "stop" else None
            new_ids = renderer.env_ids(stop_token, normalized[len(self._history) :])
        turn = self._trajectory.plan(new_ids, requested_max_tokens)
        return ChatPlan(turn, normalized, parse_tools, renderer, tools_key)

    def record(self, plan: ChatPlan, sample: SampleOutput) -> AssistantTurn:
        """Record the sampled turn; the assistant message the client must resend next time."""
        turn_index = len(self._trajectory.turn_starts)
        self._trajectory.record(plan.turn, sample)
        self._renderer, self._tools_key = plan.renderer, plan.tools_key
        text = turn_text(self._tokenizer, sample)
        parsed = parse_tool_calls(text, self._episode_id, turn_index) if plan.parse_tools else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish: ChatFinishReason = sample.finish_reason
        if parsed is not None and parsed.tool_calls:
            message = {"role": "assistant", "content": parsed.content or None, "tool_calls": parsed.tool_calls}
            finish = "tool_calls"
        self._history = [*plan.messages, normalize_message(message, "assistant")]
        self.turn_texts.append(text)
        self._final_text = message["content"] or ""
        return AssistantTurn(message, finish)

    def tokens(self) -> EpisodeTokens | None:
        return self._trajectory.episode_tokens(self._final_text)


@dataclass(frozen=True)
class CompletionPlan:
    turn: TurnPlan
    prompt_text: str
    """The request's prompt as text (decoded if it came as token ids)."""


class CompletionChain:
    """A plain-completions episode: each prompt must start with the previous prompt + completion.

    As text: the previous call's prompt text + the text returned (which, as in the OpenAI
    API, leaves out the final stop token, although it stays in the recorded context). As
    token ids: every recorded token (prompt + output, stop tokens included). Only the rest
    is tokenised, as environment tokens.
    """

    def __init__(self, tokenizer: ChatTokenizer, budget: EpisodeBudget) -> None:
        self._tokenizer = tokenizer
        self._trajectory = Trajectory(budget)
        self._text = ""
        self.turn_texts: list[str] = []

    def plan(self, prompt: str | Sequence[int], requested_max_tokens: int | None) -> CompletionPlan:
        recorded = [] if self._trajectory.prompt is None else self._trajectory.prompt + self._trajectory.output
        if isinstance(prompt, str):
            if not prompt.startswith(self._text):
                raise ConversationError(
                    "prompt: must start with the previous prompt followed by the text returned for it "
                    f"({len(self._text)} characters ending {self._text[-40:]!r}); history cannot be edited"
                )
            new_ids = list(self._tokenizer.encode(prompt[len(self._text) :], add_special_tokens=False))
            text = prompt
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ConversationError("prompt: token ids must be non-negative ints")
            if ids[: len(recorded)] != recorded:
                raise ConversationError(
                    f"prompt: token ids must start with the episode's {len(recorded)} recorded tokens "
                    "(previous prompt and output, stop token included)"
                )
            new_ids = ids[len(recorded) :]
            text = self._text + self._tokenizer.decode(new_ids, skip_special_tokens=False)
        return CompletionPlan(self._trajectory.plan(new_ids, requested_max_tokens), text)

    def record(self, plan: CompletionPlan, sample: SampleOutput) -> str:
        """Record the sampled turn; returns its text."""
        self._trajectory.record(plan.turn, sample)
        text = turn_text(self._tokenizer, sample)
        self._text = plan.prompt_text + text
        self.turn_texts.append(text)
        return text

    def tokens(self) -> EpisodeTokens | None:
        return self._trajectory.episode_tokens(self.turn_texts[-1] if self.turn_texts else "")
