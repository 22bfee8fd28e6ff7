"""CLI commands stop the engine core they started before returning, also when the command fails."""

import pytest

from dynsteer.cli.engine import closing_engine, shutdown_engine


class _Core:
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def shutdown(self) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("already gone")


class _LLM:
    def __init__(self, core: _Core) -> None:
        self.llm_engine = type("E", (), {"engine_core": core})()


def test_engine_stops_when_the_block_raises():
    core = _Core()
    with pytest.raises(ValueError, match="bad prompt"):
        with closing_engine(_LLM(core)):
            raise ValueError("bad prompt")
    assert core.calls == 1


def test_engine_stops_once_after_a_clean_block():
    core = _Core()
    with closing_engine(_LLM(core)) as llm:
        assert llm.llm_engine.engine_core is core
    assert core.calls == 1


def test_a_failing_stop_does_not_hide_the_commands_result():
    core = _Core(fail=True)
    shutdown_engine(_LLM(core))  # must not raise
    assert core.calls == 1
