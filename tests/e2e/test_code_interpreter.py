"""The official `e2b-code-interpreter` SDK (2.11), unchanged, against a real server: its
`Sandbox.create()` asks for template `code-interpreter-v1`, which the server builds on first
use (wheels downloaded on the host, installed into the template's venv, snapshot with a
running kernel) and then serves E2B's code-interpreter protocol on port 49999.

The module's first create pays for the build (about a minute); every later create is a
restore of that snapshot.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import SandboxException, TimeoutException
from e2b_code_interpreter import Sandbox

from aenv.builds.code_interpreter import RECIPE_NAME_PREFIX, TEMPLATE_NAME
from aenv.devserver import ServerProcess

BUILD_TIMEOUT_S = 900  # the first create builds the template


@pytest.fixture(scope="module")
def sbx(server: ServerProcess) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=600, request_timeout=BUILD_TIMEOUT_S)
    try:
        yield s
    finally:
        s.kill()


def test_the_template_is_built_on_first_use_and_marked_as_ours(
        sbx: Sandbox, api: httpx.Client) -> None:
    templates = api.get("/templates").json()
    ours = [t for t in templates if TEMPLATE_NAME in t.get("aliases", t.get("names", []))]
    assert len(ours) == 1, templates
    names = ours[0].get("aliases", ours[0].get("names", []))
    assert any(n.startswith(RECIPE_NAME_PREFIX) for n in names), names
    info = sbx.get_info()
    assert info.template_id == ours[0]["templateID"]


def test_state_survives_across_cells(sbx: Sandbox) -> None:
    first = sbx.run_code("x = 41\ndef bump(v):\n    return v + 1")
    assert first.error is None and first.results == []
    second = sbx.run_code("bump(x)")
    assert second.error is None
    assert second.text == "42"
    assert second.results[0].is_main_result
    assert second.execution_count is not None and second.execution_count > (
        first.execution_count or 0)


def test_stdout_and_stderr_stream_to_callbacks_while_the_cell_runs(sbx: Sandbox) -> None:
    seen: list[tuple[str, float]] = []
    err: list[str] = []
    start = time.monotonic()
    execution = sbx.run_code(
        "import sys, time\n"
        "for i in range(3):\n"
        "    print(f'tick {i}', flush=True)\n"
        "    time.sleep(0.4)\n"
        "print('oops', file=sys.stderr, flush=True)\n",
        on_stdout=lambda m: seen.append((m.line, time.monotonic() - start)),
        on_stderr=lambda m: err.append(m.line))
    assert execution.error is None
    assert "".join(line for line, _ in seen) == "tick 0\ntick 1\ntick 2\n"
    assert err == ["oops\n"]
    assert execution.logs.stdout == [line for line, _ in seen]
    # streamed, not delivered at the end: the first tick arrived well before the last
    assert seen[-1][1] - seen[0][1] > 0.6, seen


def test_errors_carry_name_value_and_traceback(sbx: Sandbox) -> None:
    errors = []
    execution = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=errors.append)
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "return 1 / 0" in execution.error.traceback
    assert "\x1b[" not in execution.error.traceback  # plain text, no terminal colours
    assert errors and errors[0].name == "ZeroDivisionError"
    # the kernel is still usable after an error
    assert sbx.run_code("'still alive'").text == "still alive"


def test_rich_results_json_html_png(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "from IPython.display import display, JSON, HTML\n"
        "display(JSON({'a': [1, 2]}))\n"
        "display(HTML('<b>bold</b>'))\n"
        "'main'")
    assert execution.error is None
    kinds = [(r.is_main_result, r.json, r.html, r.text) for r in execution.results]
    assert (False, {"a": [1, 2]}, None, "<IPython.core.display.JSON object>") in kinds, kinds
    assert any(r.html == "<b>bold</b>" for r in execution.results), kinds
    assert execution.results[-1].is_main_result and execution.results[-1].text == "main"


def test_a_matplotlib_chart_comes_back_as_png(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots()\n"
        "ax.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.show()")
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw.startswith(b"\x89PNG\r\n\x1a\n") and len(raw) > 5000


def test_a_pandas_dataframe_comes_back_as_html(sbx: Sandbox) -> None:
    execution = sbx.run_code(
        "import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [3, 19]})")
    assert execution.error is None, execution.error
    result = execution.results[0]
    assert result.html is not None and "<table" in result.html and "Lima" in result.html
    assert result.text is not None and "Oslo" in result.text


def test_contexts_have_their_own_state_and_cwd(sbx: Sandbox) -> None:
    sbx.commands.run("mkdir -p /tmp/ctx-dir")
    ctx = sbx.create_code_context(cwd="/tmp/ctx-dir")
    try:
        assert ctx.cwd == "/tmp/ctx-dir" and ctx.language == "python"
        assert any(c.id == ctx.id for c in sbx.list_code_contexts())
        assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp/ctx-dir"
        sbx.run_code("only_here = 'ctx'", context=ctx)
        assert sbx.run_code("only_here", context=ctx).text == "ctx"
        # the default context does not see it, and keeps its own cwd
        default = sbx.run_code("only_here")
        assert default.error is not None and default.error.name == "NameError"
        assert sbx.run_code("import os; os.getcwd()").text == "/home/user"
        sbx.restart_code_context(ctx)
        assert sbx.run_code("only_here", context=ctx).error is not None  # restarted: state gone
    finally:
        sbx.remove_code_context(ctx)
    assert all(c.id != ctx.id for c in sbx.list_code_contexts())


def test_envs_reach_the_kernel_per_run_and_from_create(server: ServerProcess) -> None:
    s = Sandbox.create(envs={"FROM_CREATE": "yes"}, timeout=120)
    try:
        assert s.run_code("import os; os.environ.get('FROM_CREATE')").text == "yes"
        one = s.run_code("os.environ.get('PER_RUN')", envs={"PER_RUN": "only-now"})
        assert one.text == "only-now"
        after = s.run_code("os.environ.get('PER_RUN', 'unset')")
        assert after.text == "unset"
    finally:
        s.kill()


def test_bash_runs_in_its_own_kernel_when_asked_for(sbx: Sandbox) -> None:
    first = sbx.run_code("cd /tmp && GREETING=hello-from-bash", language="bash")
    assert first.error is None, first.error
    execution = sbx.run_code("echo $GREETING in $PWD", language="bash")
    assert execution.error is None, execution.error
    assert "".join(execution.logs.stdout) == "hello-from-bash in /tmp\n"
    # python's default context is another kernel: the shell variable is not there
    assert sbx.run_code("import os; os.environ.get('GREETING', 'none')").text == "none"


def test_a_cell_whose_client_gave_up_is_interrupted(sbx: Sandbox) -> None:
    """The SDK's execution timeout closes the connection; the server interrupts the kernel,
    so the context's next cell does not queue behind an endless loop (E2B's #213)."""
    ctx = sbx.create_code_context()
    try:
        with pytest.raises(TimeoutException):
            sbx.run_code("import time\nwhile True:\n    time.sleep(0.05)", context=ctx, timeout=2)
        t = time.monotonic()
        assert sbx.run_code("'next'", context=ctx, timeout=60).text == "next"
        assert time.monotonic() - t < 10
    finally:
        sbx.remove_code_context(ctx)


def test_unknown_language_and_bad_cwd_are_refused(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match="not supported"):
        sbx.run_code("1", language="cobol")
    with pytest.raises(SandboxException, match="working directory"):
        sbx.create_code_context(cwd="/no/such/dir")


def test_kernel_state_survives_pause_and_connect(server: ServerProcess) -> None:
    s = Sandbox.create(timeout=300)
    try:
        s.run_code("import random\nsecret = random.random()\ncounter = 7")
        secret = s.run_code("secret").text
        s.pause()
        resumed = Sandbox.connect(s.sandbox_id)
        assert resumed.run_code("secret").text == secret
        assert resumed.run_code("counter += 1; counter").text == "8"
    finally:
        s.kill()


def test_fork_children_continue_from_the_parents_variables(server: ServerProcess) -> None:
    parent = Sandbox.create(timeout=300)
    children: list[Sandbox] = []
    try:
        parent.run_code("import random\nseed = random.random()\nsteps = [1, 2, 3]")
        seed = parent.run_code("seed").text
        results = parent.fork(count=3)
        children = [c for c in results if isinstance(c, Sandbox)]
        assert len(children) == 3, results

        def step(pair: tuple[int, Sandbox]) -> tuple[str | None, str | None]:
            i, child = pair
            got = child.run_code("seed").text
            return got, child.run_code(f"steps.append({i}); steps").text

        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(step, enumerate(children)))
        for i, (got, steps) in enumerate(outcomes):
            assert got == seed
            assert steps == f"[1, 2, 3, {i}]"  # each child diverges on its own
        assert parent.run_code("steps").text == "[1, 2, 3]"
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda s: s.kill(), [parent, *children]))
