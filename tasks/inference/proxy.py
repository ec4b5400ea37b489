"""A recording, OpenAI-compatible endpoint in front of the rollout servers.

Agent episodes are plain async functions using the official ``openai`` client
(``AsyncOpenAI(base_url=proxy.open_episode(id), api_key="unused")``); every call goes
through :class:`RecordingProxy`, which renders the request into tokens
(:mod:`~asyncrl.tasks.inference.conversation`), generates one sample on the rollout servers
(:meth:`~asyncrl.tasks.inference.client.RolloutClient.generate_one`, sticky to the episode's
server) and records exactly the tokens sampled, with log-probs and versions;
:meth:`RecordingProxy.close_episode` hands the trajectory over. With a turn journal
(:mod:`~asyncrl.tasks.inference.turn_journal`) a call that repeats a journaled turn of a
resumed episode is answered from it instead of sampled. Whatever the proxy cannot
honour is refused with an HTTP error and the reason. It listens on loopback only and ignores
the key. Routes and accepted options: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from asyncrl.tasks.model.tokenizer import EOS_TOKEN, IM_END_TOKEN
from asyncrl.tasks.inference.client_errors import RolloutRequestError
from asyncrl.tasks.inference.conversation import (
    BudgetExhausted,
    ChatConversation,
    ChatTokenizer,
    CompletionChain,
    ConversationError,
    EpisodeBudget,
    EpisodeTokens,
    TurnPlan,
)
from asyncrl.tasks.system.network import is_loopback
from asyncrl.tasks.inference.routing import NoLiveServerError
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.turn_journal import TurnJournal

logger = logging.getLogger(__name__)

EPISODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
IGNORED_PARAMS = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "stream_options"})
"""Request fields accepted and ignored: they do not change what is sampled."""
NEUTRAL_PARAMS: Mapping[str, tuple[object, ...]] = MappingProxyType({
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "response_format": ({"type": "text"},),
    "stop": ("", []),
    "seed": (),
})
"""Options the proxy cannot honour, accepted only when null or at these no-op values."""
CHAT_FIELDS = frozenset({"messages", "tools", "tool_choice"})
COMPLETION_FIELDS = frozenset({"prompt"})
SAMPLING_FIELDS = frozenset({"n", "stream", "temperature", "top_p", "max_tokens", "max_completion_tokens"})


class SampleGenerator(Protocol):
    """What the proxy generates with: :class:`~asyncrl.tasks.inference.client.RolloutClient` fits."""

    async def generate_one(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        stop_token_ids: Sequence[int] = (),
        prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]: ...


class ProxyError(ValueError):
    """A refused request: HTTP ``status``, OpenAI error ``code`` and the reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int | None
    """Requested cap on the turn's tokens; None = whatever the budget allows."""


def end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids generation stops on: the tokenizer's EOS, and ``<|endoftext|>``/``<|im_end|>`` where they exist."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in (EOS_TOKEN, IM_END_TOKEN) if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("tokenizer: has no EOS or <|im_end|> token to stop generation on")
    return tuple(sorted(ids))


def _number(body: dict[str, Any], name: str, default: float, ok: Callable[[float], bool], rule: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ProxyError(400, "invalid_request", f"{name}: must be {rule}, got {value!r}")
    return float(value)


def parse_sampling(body: dict[str, Any], fields: frozenset[str], temperature: float, top_p: float) -> Sampling:
    """Check a request's fields against what the proxy honours; ``ProxyError`` (400) naming the field."""
    for name, value in body.items():
        if name in fields or name in SAMPLING_FIELDS or name in IGNORED_PARAMS or value is None:
            continue
        if name in NEUTRAL_PARAMS:
            if value in NEUTRAL_PARAMS[name]:
                continue
            raise ProxyError(
                400, "unsupported_parameter", f"{name}: {value!r} is not supported by the recording proxy"
            )
        raise ProxyError(400, "unsupported_parameter", f"{name}: unknown or unsupported parameter")
    if body.get("n") not in (None, 1):
        raise ProxyError(400, "invalid_request", f"n: only n=1 is supported (one call, one sample), got {body['n']!r}")
    if body.get("stream"):
        raise ProxyError(400, "invalid_request", "stream: streaming is not supported; send stream=false")
    limits = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(set(map(repr, limits.values()))) > 1:
        raise ProxyError(400, "invalid_request", f"max_tokens and max_completion_tokens differ: {limits}")
    max_tokens = next(iter(limits.values()), None)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ProxyError(400, "invalid_request", f"max_tokens: must be an int >= 1, got {max_tokens!r}")
    return Sampling(
        temperature=_number(body, "temperature", temperature, lambda v: v >= 0, "a number >= 0"),
        top_p=_number(body, "top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
        max_tokens=max_tokens,
    )


def _usage(turn: TurnPlan, sample: SampleOutput) -> dict[str, int]:
    prompt, completion = len(turn.context_token_ids), len(sample.output_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_body(code: str, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if code != "internal_error" else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass
class _Episode:
    episode_id: str
    conversation: ChatConversation | CompletionChain | None = None
    server: str | None = None
    """URL of the server that produced the previous turn (preferred for the next)."""
    busy: bool = False
    generation: asyncio.Task[tuple[SampleOutput, str]] | None = None
    closed: bool = False


@dataclass
class _Stats:
    refusals: Counter[str] = field(default_factory=Counter)
    calls: int = 0


class _EmbeddedServer:
    """uvicorn in the caller's event loop; the host process keeps its own signal handlers
    (uvicorn's would turn Ctrl-C into a quiet proxy shutdown)."""

    def __init__(self, app: Any, sock: socket.socket) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        # log_config=None: leave the host process's logging configuration alone.
        config = uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        self.server = Server(config)
        self.sock = sock
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.sock.close()
                error = None if self.task.cancelled() else self.task.exception()
                raise RuntimeError(f"recording proxy: the HTTP server did not start: {error!r}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


class RecordingProxy:
    """OpenAI-compatible endpoint per episode that records the episode's tokens.

    ``max_episode_tokens`` / ``max_context_tokens``: see
    :class:`~asyncrl.tasks.inference.conversation.EpisodeBudget`; ``default_temperature`` /
    ``default_top_p`` apply when a request leaves them out.
    """

    def __init__(
        self,
        client: SampleGenerator,
        tokenizer: ChatTokenizer,
        *,
        default_temperature: float = 1.0,
        default_top_p: float = 1.0,
        max_episode_tokens: int,
        max_context_tokens: int,
        model_name: str = "policy",
        turns: TurnJournal | None = None,
    ) -> None:
        defaults = {"temperature": default_temperature, "top_p": default_top_p}
        self._defaults = parse_sampling(defaults, frozenset(), 1.0, 1.0)
        self._client = client
        self._tokenizer = tokenizer
        self._budget = EpisodeBudget(max_episode_tokens, max_context_tokens)
        self._stop_ids = end_token_ids(tokenizer)
        self._model_name = model_name
        self._turns = turns
        self._episodes: dict[str, _Episode] = {}
        self._stats = _Stats()
        self._http: _EmbeddedServer | None = None
        self._url: str | None = None
        self._app = self._build_app()

    # ----- lifecycle -----

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port) in the running event loop; returns :attr:`url`."""
        if self._http is not None:
            raise RuntimeError("recording proxy: already started")
        if not is_loopback(host):
            raise ValueError(f"host: the proxy has no authentication and listens on loopback only, got {host!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        http = _EmbeddedServer(self._app, sock)
        await http.start()
        self._http = http
        bound = sock.getsockname()[1]
        self._url = f"http://[{host}]:{bound}" if family == socket.AF_INET6 else f"http://{host}:{bound}"
        return self._url

    async def stop(self) -> None:
        """Stop serving; generations still running are cancelled (their calls get HTTP 503)."""
        for episode in self._episodes.values():
            if episode.generation is not None:
                episode.generation.cancel()
        if self._http is not None:
            await self._http.stop()
            self._http = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("recording proxy: not started; await start() first")
        return self._url

    # ----- episodes -----

    def open_episode(self, episode_id: str) -> str:
        """Start recording an episode; returns its OpenAI ``base_url``."""
        if not EPISODE_ID.fullmatch(episode_id):
            raise ValueError(f"episode_id: 1-128 characters of [A-Za-z0-9._-], got {episode_id!r}")
        if episode_id in self._episodes:
            raise ValueError(f"episode_id: {episode_id!r} is already open")
        self._episodes[episode_id] = _Episode(episode_id)
        return f"{self.url}/episodes/{episode_id}/v1"

    def close_episode(self, episode_id: str) -> EpisodeTokens | None:
        """Stop recording; the trajectory, or None if the episode made no model call. A call
        still generating is cancelled (it gets HTTP 404) and not recorded."""
        episode = self._episodes.pop(episode_id, None)
        if episode is None:
            raise KeyError(f"episode_id: {episode_id!r} is not open")
        episode.closed = True
        if episode.generation is not None:
            episode.generation.cancel()
        return episode.conversation.tokens() if episode.conversation is not None else None

    def stats(self) -> dict[str, Any]:
        """Calls served, refusals by error code, open episodes (a copy)."""
        stats = self._stats
        return {"calls": stats.calls, "refusals": dict(stats.refusals), "open_episodes": len(self._episodes)}

    # ----- HTTP -----

    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        prefix = "/episodes/{episode_id}/v1"
        routes = [
            Route(prefix + "/chat/completions", self._wrap(self._chat), methods=["POST"]),
            Route(prefix + "/completions", self._wrap(self._completions), methods=["POST"]),
            Route(prefix + "/models", self._wrap(self._models), methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def _wrap(self, handler: Callable[[Any, _Episode], Awaitable[dict[str, Any]]]) -> Callable[[Any], Awaitable[Any]]:
        """Look up the episode, run ``handler`` once at a time per episode, map errors to
        OpenAI error bodies with their reason (each refusal counted by code)."""
        from starlette.responses import JSONResponse

        async def endpoint(request: Any) -> Any:
            episode: _Episode | None = None
            acquired = False
            try:
                episode_id = request.path_params["episode_id"]
                episode = self._episodes.get(episode_id)
                if episode is None:
                    raise ProxyError(404, "episode_not_found", f"episode {episode_id!r} is not open (unknown, closed)")
                if episode.busy:
                    reason = f"episode {episode_id!r} has a call in flight; an episode's calls must be sequential"
                    raise ProxyError(409, "episode_busy", reason)
                episode.busy = acquired = True
                body = await handler(request, episode)
                self._stats.calls += 1
                return JSONResponse(body)
            except ProxyError as error:
                status, code, message = error.status, error.code, str(error)
            except BudgetExhausted as error:
                status, code, message = 400, "budget_exhausted", str(error)
            except (ConversationError, RolloutRequestError) as error:
                status, code, message = 400, "invalid_request", str(error)
            except NoLiveServerError as error:
                status, code, message = 503, "no_live_server", str(error)
            except Exception as error:  # noqa: BLE001 - answered with its reason, logged with the traceback
                logger.exception("recording proxy: %s %s failed", request.method, request.url.path)
                status, code, message = 500, "internal_error", f"{type(error).__name__}: {error}"
            finally:
                if acquired and episode is not None:
                    episode.busy = False
            self._stats.refusals[code] += 1
            logger.info("recording proxy: %s %s -> %d %s: %s", request.method, request.url.path, status, code, message)
            return JSONResponse(_error_body(code, message), status_code=status)

        return endpoint

    async def _json(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise ProxyError(400, "invalid_request", f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "invalid_request", "the request body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self._model_name

    async def _turn(self, episode: _Episode, index: int, turn: TurnPlan, sampling: Sampling) -> SampleOutput:
        """The episode's model turn ``index``: replayed from the turn journal where the call
        repeats a journaled turn (:mod:`~asyncrl.tasks.inference.turn_journal`), else sampled."""
        if self._turns is not None:
            replayed = self._turns.replay(episode.episode_id, index, turn.context_token_ids, turn.max_new_tokens)
            if replayed is not None:
                return replayed
        return await self._generate(episode, turn, sampling)

    def _completed(self, episode: _Episode, index: int, turn: TurnPlan, sample: SampleOutput) -> None:
        """A turn the episode recorded, for the turn journal."""
        if self._turns is not None:
            self._turns.record(episode.episode_id, index, turn.context_token_ids, turn.max_new_tokens, sample)

    async def _generate(self, episode: _Episode, turn: TurnPlan, sampling: Sampling) -> SampleOutput:
        """One sample of the planned turn on the episode's server (404 if the episode is
        closed meanwhile, 503 if the proxy stops)."""
        generation = asyncio.create_task(
            self._client.generate_one(
                turn.context_token_ids,
                turn.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                stop_token_ids=self._stop_ids,
                prefer_server=episode.server,
            )
        )
        episode.generation = generation
        try:
            sample, server = await generation
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this handler itself is cancelled
            if episode.closed:
                raise self._closed_meanwhile(episode) from None
            raise ProxyError(503, "proxy_stopping", "the recording proxy stopped while generating") from None
        finally:
            episode.generation = None
        if episode.closed:
            raise self._closed_meanwhile(episode)
        episode.server = server
        return sample

    @staticmethod
    def _closed_meanwhile(episode: _Episode) -> ProxyError:
        return ProxyError(404, "episode_not_found", f"episode {episode.episode_id!r} was closed while generating")

    async def _chat(self, request: Any, episode: _Episode) -> dict[str, Any]:
        body = await self._json(request)
        sampling = parse_sampling(body, CHAT_FIELDS, self._defaults.temperature, self._defaults.top_p)
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ProxyError(400, "invalid_request", "tools: must be a list of tool objects")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise ProxyError(400, "unsupported_parameter", f"tool_choice: only 'auto' and 'none', got {tool_choice!r}")
        if episode.conversation is None:
            episode.conversation = ChatConversation(self._tokenizer, self._budget, episode.episode_id)
        conversation = episode.conversation
        if not isinstance(conversation, ChatConversation):
            raise ProxyError(400, "invalid_request", "this episode uses completions; one episode uses one API")
        parse_tools = bool(tools) and tool_choice != "none"
        plan = conversation.plan(body.get("messages"), tools or None, sampling.max_tokens, parse_tools)
        index = len(conversation.turn_texts)
        sample = await self._turn(episode, index, plan.turn, sampling)
        turn = conversation.record(plan, sample)
        self._completed(episode, index, plan.turn, sample)
        message = {k: v for k, v in turn.message.items() if k != "tool_calls" or v}
        return {
            "id": f"chatcmpl-{episode.episode_id}-{len(conversation.turn_texts)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self._model(body),
            "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": None}],
            "usage": _usage(plan.turn, sample),
        }

    async def _completions(self, request: Any, episode: _Episode) -> dict[str, Any]:
        body = await self._json(request)
        sampling = parse_sampling(body, COMPLETION_FIELDS, self._defaults.temperature, self._defaults.top_p)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ProxyError(400, "invalid_request", "prompt: one string or one list of token ids (no batches)")
        if episode.conversation is None:
            episode.conversation = CompletionChain(self._tokenizer, self._budget)
        chain = episode.conversation
        if not isinstance(chain, CompletionChain):
            raise ProxyError(400, "invalid_request", "this episode uses chat completions; one episode uses one API")
        plan = chain.plan(prompt, sampling.max_tokens)
        index = len(chain.turn_texts)
        sample = await self._turn(episode, index, plan.turn, sampling)
        text = chain.record(plan, sample)
        self._completed(episode, index, plan.turn, sample)
        return {
            "id": f"cmpl-{episode.episode_id}-{len(chain.turn_texts)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self._model(body),
            "choices": [{"index": 0, "text": text, "finish_reason": sample.finish_reason, "logprobs": None}],
            "usage": _usage(plan.turn, sample),
        }

    async def _models(self, request: Any, episode: _Episode) -> dict[str, Any]:
        model = {"id": self._model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return {"object": "list", "data": [model]}
