"""The engine's front door: the local engine and the remote one both implement engine.api's
EngineClient, every method and property of it, with the protocol's own signatures (names, kinds,
defaults and annotations of every parameter, and the return annotation); and a remote engine
answers the questions only a local one can with a failed Future that says so."""

from __future__ import annotations

import inspect

import pytest

from app.remote.engine import RemoteEngine
from app.remote.target import RemoteTarget
from engine.api import EngineClient
from engine.config import EngineConfig
from engine.core.service import Engine
from engine.request import Request

IMPLEMENTATIONS = (Engine, RemoteEngine)


def protocol_members() -> dict[str, object]:
    return {
        name: member
        for name, member in vars(EngineClient).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    }


def test_the_protocol_names_every_question_the_app_asks():
    names = set(protocol_members())
    lifecycle = {"start", "wait_until_loaded", "load_error", "is_alive", "shutdown"}
    requests = {"events", "submit", "cancel", "run"}
    questions = {
        "count_prompt",
        "limits",
        "prompt_spans",
        "fit_context",
        "decode",
        "tokens_of",
        "device",
        "device_limits",
        "what_if",
        "inspect_token",
        "expert_routes",
        "score_text",
        "read_control_vector",
        "contrast_vector",
        "steer",
        "measure_speedup",
        "loaded_model",
    }
    assert names == lifecycle | requests | questions
    assert "call" not in names  # running any closure on the engine thread is the engine's own


def signature(function) -> tuple:
    sig = inspect.signature(function)
    params = tuple((p.name, p.kind, repr(p.default), str(p.annotation)) for p in sig.parameters.values())
    return params, str(sig.return_annotation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_engine_implements_the_protocol_with_its_signatures(implementation):
    for name, member in protocol_members().items():
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        own = getattr(implementation, name)
        if isinstance(member, property):
            assert isinstance(own, property), f"{implementation.__name__}.{name} is no property"
            assert signature(own.fget)[1] == signature(member.fget)[1], name
        else:
            assert signature(own) == signature(member), f"{implementation.__name__}.{name}"


def test_instances_are_engine_clients():
    local = Engine(EngineConfig(), sink=[].append)
    remote = RemoteEngine(RemoteTarget.parse("http://127.0.0.1:9"), [].append, [].append)
    assert isinstance(local, EngineClient) and isinstance(remote, EngineClient)
    assert not hasattr(local, "call") and not hasattr(remote, "call")


def test_a_remote_engine_says_which_questions_need_the_engine_here():
    remote = RemoteEngine(RemoteTarget.parse("http://127.0.0.1:9"), [].append, [].append)
    request = Request.chat("hi")
    for future in (
        remote.count_prompt(request),
        remote.limits(),
        remote.prompt_spans(request),
        remote.decode([1, 2]),
        remote.tokens_of(["hi"]),
        remote.device(),
        remote.device_limits(),
        remote.loaded_model(),
        remote.fit_context((), (), (), 16, "drop"),
        remote.inspect_token(request, [], 5),
        remote.expert_routes(request, [5]),
        remote.score_text("some text"),
        remote.read_control_vector("vector.gguf"),
        remote.contrast_vector("happy", "sad"),
    ):
        with pytest.raises(RuntimeError, match="not available on a remote engine"):
            future.result(0)
    assert remote.run([]).result(0) == []
