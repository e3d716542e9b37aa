"""How the agent calls its plug-ins' hooks: bounded in time and in threads, what they return
validated, and whatever they raise kept from the agent."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from client.plugins import load_plugin, parse_plugin_ref
from nodeagent._plugins import MAX_REASON, MAX_RUNNING, AgentPlugins, RoundInfo, load_agent_plugins

INFO = RoundInfo(job_id="j", attempt=0, round=1, node="n", global_ranks=(0, 1), world_size=2)


class Hooks:
    def __init__(self, value: object = None, *, raises: BaseException | None = None) -> None:
        self.value, self.raises = value, raises
        self.release = threading.Event()
        self.hang = False

    def _answer(self) -> object:
        if self.hang:
            self.release.wait(30)
        if self.raises is not None:
            raise self.raises
        return self.value

    def before_round(self, info: RoundInfo) -> object:
        return self._answer()

    def health_check(self) -> object:
        return self._answer()


@pytest.mark.parametrize(
    ("value", "veto"),
    [
        (None, ""),
        (True, ""),
        (False, "plug-in p: vetoed"),
        ("disk\nfull", "plug-in p: disk full"),
        (42, ""),  # nonsense: no objection, counted
    ],
)
async def test_what_before_round_returns_decides_the_veto(value: object, veto: str) -> None:
    plugins = AgentPlugins([("p", Hooks(value))], timeout=5)
    assert await plugins.before_round(INFO) == veto
    assert plugins.errors == (1 if value == 42 else 0)


async def test_a_long_reason_is_cut() -> None:
    plugins = AgentPlugins([("p", Hooks("x" * 10_000))], timeout=5)
    why = await plugins.health_check()
    assert why.startswith("plug-in p: xxx") and len(why) <= MAX_REASON + 3


@pytest.mark.parametrize("exc", [RuntimeError("boom"), SystemExit(3), KeyboardInterrupt()])
async def test_a_hook_that_raises_is_no_objection(exc: BaseException) -> None:
    plugins = AgentPlugins([("p", Hooks(raises=exc))], timeout=5)
    assert await plugins.before_round(INFO) == ""
    assert await plugins.health_check() == ""
    assert plugins.errors == 2


async def test_a_hook_that_hangs_times_out_and_holds_a_bounded_number_of_threads() -> None:
    hooks = Hooks("sick")
    hooks.hang = True
    plugins = AgentPlugins([("p", hooks)], timeout=0.05)
    try:
        for _ in range(MAX_RUNNING + 3):
            assert await plugins.health_check() == ""
        assert plugins.errors == MAX_RUNNING + 3
        hung = [t for t in threading.enumerate() if t.name == "plugin p health_check"]
        assert len(hung) == MAX_RUNNING
    finally:
        hooks.release.set()


def test_a_plugin_without_hooks_is_refused() -> None:
    with pytest.raises(ValueError, match="has none of the hooks"):
        load_agent_plugins(["tests.service._site_plugins:RECEIVED"], timeout=1)


@pytest.mark.parametrize(
    "ref", ["x", "x:", ":y", "a-b:c", "a:b c", "a..b:c", "os:path;rm", "a:" + "b" * 101]
)
def test_a_malformed_plugin_name_is_refused(ref: str) -> None:
    with pytest.raises(ValueError, match="expected module:object"):
        parse_plugin_ref(ref)


def test_a_class_is_instantiated_and_a_missing_object_named() -> None:
    obj: Any = load_plugin("tests.service._site_plugins:Veto")
    assert obj.before_round(INFO).startswith("scratch disk full on n")
    with pytest.raises(ValueError, match="has no Nothing"):
        load_plugin("tests.service._site_plugins:Nothing")
