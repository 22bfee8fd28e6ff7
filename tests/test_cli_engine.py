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


_SCRIPT = """
import atexit, sys
import typer
from dynsteer.cli.app import app, main
from dynsteer.cli.engine import shutdown_engine

class Loud:
    def __del__(self):
        print("torn down", flush=True)

KEEP = Loud()  # a module global: finalised only by the interpreter's teardown

@app.command("engine-test")
def engine_test(code: int = 0, fail: bool = False, engine: bool = True):
    if engine:
        shutdown_engine(object())  # a command's engine (stopping it is best effort)
    atexit.register(lambda: print("exit handler ran", flush=True))
    print("result", end="")  # left in stdout's buffer
    if fail:
        raise RuntimeError("boom")
    raise typer.Exit(code)

main()
"""


@pytest.mark.parametrize(("args", "rc"), [([], 0), (["--code", "3"], 3), (["--fail"], 1)])
def test_a_command_that_ran_an_engine_ends_without_teardown(args, rc):
    """The console script's end after an engine ran: its exit code, its buffered output and exit handlers kept, the
    interpreter's teardown (where native threads left by vLLM's libraries abort the process) skipped."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "engine-test", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == rc, proc.stderr[-2000:]
    assert proc.stdout.startswith("result") and "exit handler ran" in proc.stdout
    assert "torn down" not in proc.stdout
    assert ("boom" in proc.stderr) == ("--fail" in args)


def test_a_command_without_an_engine_exits_as_usual():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "engine-test", "--no-engine", "--code", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "exit handler ran" in proc.stdout and "torn down" in proc.stdout  # the teardown ran
