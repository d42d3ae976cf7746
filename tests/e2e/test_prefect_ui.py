"""The Prefect UI in a real browser: the README's deployment steps, then headless Chromium on the UI.

A Prefect server (with its UI) on a free port, the `flexmarl-pool` process work pool, `prefect deploy` of
`flexmarl-train/tiny` from prefect.yaml and a `prefect worker` are real processes, started as a user would.
The test runs the deployment, waits for the run, then drives Debian's chromium with Playwright: the flow
run's Artifacts tab must lead to the per-agent metrics table, and the deployment's custom-run form must offer
the training parameters with their types and the deployment's values. A second test runs `flexmarl train`
as a newcomer's `make run` does (the run starts its own server): the "View at" link it prints must open the
run in the UI while it trains, and after it, `prefect server start` on the same PREFECT_HOME must still show
it. Screenshots land in the test's tmp_path and in `test-output/prefect-ui/` (gitignored).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

import httpx
import psutil
import pytest
from playwright.sync_api import Page, expect, sync_playwright
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterName,
)

from flexmarl.config import PRESETS
from flows.prefect_server import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# Headless in a closed network: no sandbox as root, no GPU, and none of Chromium's own connections
# (updates, sync, QUIC probes) that would fail and spam the log here.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic", "--no-first-run",
    "--disable-component-update", "--disable-sync",
]
DEPLOYMENT = "flexmarl-train/tiny"
POOL = "flexmarl-pool"
RUN_TIMEOUT_S = 600
UI_TIMEOUT_MS = 30_000  # a UI page on this shared machine can take a few seconds to render
expect.set_options()

if not CHROMIUM.exists():
    pytest.skip(
        f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install -y chromium`; .ci/run does) "
        "to run the Prefect UI browser test",
        allow_module_level=True,
    )


def stop_process_tree(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Stop a process we started and every process below it (a worker's flow run, its Dask cluster)."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    # a worker whose API is gone retries for a long time before it exits: do not wait for it forever
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def wait_until(what: str, check, timeout_s: float, *, interval_s: float = 1.0, detail=lambda: ""):
    """Poll ``check`` until it returns a truthy value; fail with a message naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{detail()}")
        time.sleep(interval_s)


def log_tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def prefect_cli(args: list[str], env: dict, log: Path, timeout_s: float) -> None:
    res = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout_s)
    log.write_text(res.stdout + res.stderr)
    assert res.returncode == 0, f"`prefect {' '.join(args)}` failed ({res.returncode}):\n{log_tail(log)}"


@pytest.fixture
def prefect_env(tmp_path: Path) -> dict:
    """The environment of every Prefect process of the test: its own PREFECT_HOME, this tree first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture
def prefect_server(prefect_env: dict, tmp_path: Path) -> Iterator[str]:
    """`prefect server start` with its UI on a free port; yields the base URL (UI at /, API at /api)."""
    with running_server(prefect_env, tmp_path / "server.log") as base:
        yield base


@contextmanager
def running_server(prefect_env: dict, log: Path) -> Iterator[str]:
    """`prefect server start` as a user runs it (its database under the env's PREFECT_HOME), on a free port."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # the UI asks this URL for its API; left unset, it would call the default port 4200
    env = {**prefect_env, "PREFECT_UI_API_URL": f"{base}/api"}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        def healthy() -> bool:
            assert server.poll() is None, f"the Prefect server exited ({server.returncode}):\n{log_tail(log)}"
            try:
                return httpx.get(f"{base}/api/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(f"the Prefect server at {base}/api/health", healthy, 120, detail=lambda: log_tail(log))
        yield base
    finally:
        stop_process_tree(server)


@pytest.fixture
def deployed_worker(prefect_server: str, prefect_env: dict, tmp_path: Path) -> Iterator[str]:
    """The README's steps: create the pool, deploy `tiny` from prefect.yaml, start a worker. Yields the API URL."""
    api = f"{prefect_server}/api"
    # the worker polls every 2 s instead of 10 s, so the run starts sooner
    env = {**prefect_env, "PREFECT_API_URL": api, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    prefect_cli(["work-pool", "create", POOL, "--type", "process"], env, tmp_path / "work-pool.log", 180)
    prefect_cli(["--no-prompt", "deploy", "--name", "tiny"], env, tmp_path / "deploy.log", 300)
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        yield api
    finally:
        # before the server fixture's teardown: a worker without its API keeps retrying
        stop_process_tree(worker)


def test_ui_shows_the_agent_metrics_and_the_training_parameters(deployed_worker: str, tmp_path: Path) -> None:
    api = deployed_worker
    base = api.removesuffix("/api")
    run_dir = tmp_path / "run"
    shots = tmp_path / "screenshots"
    shots.mkdir()

    with SyncPrefectClient(api) as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
        # the schema the UI form is built from: every training parameter typed, described, with its default
        props = deployment.parameter_openapi_schema["properties"]
        assert props["preset"]["default"] == "default"
        assert {"enum": list(PRESETS), "type": "string"} in props["preset"]["anyOf"]
        assert {"type": "string"} in props["config"]["anyOf"] and props["config"]["default"] is None
        assert {"type": "integer"} in props["steps"]["anyOf"] and props["steps"]["default"] is None
        assert {"items": {"type": "string"}, "type": "array"} in props["overrides"]["anyOf"]
        assert {"enum": ["flexmarl", "sync"], "type": "string"} in props["mode"]["anyOf"]  # typed from the config
        assert {"type": "number"} in props["lr"]["anyOf"] and props["lr"]["default"] is None
        assert all(props[name]["description"] for name in ("preset", "config", "steps", "mode", "lr", "overrides"))
        assert deployment.parameters == {"preset": "tiny", "steps": 2}
        assert deployment.enforce_parameter_schema and deployment.work_pool_name == POOL

        flow_run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"steps": 2, "run_dir": str(run_dir), "mode": "flexmarl", "queries_per_step": 2,
                        "group_size": 4},
        )

        def finished():
            state = client.read_flow_run(flow_run.id).state
            return state if state is not None and state.is_final() else None

        state = wait_until(
            f"flow run {flow_run.id} of {DEPLOYMENT} to finish (through the worker of pool {POOL})",
            finished, RUN_TIMEOUT_S, interval_s=2, detail=lambda: log_tail(tmp_path / "worker.log"),
        )
        assert state.is_completed(), f"the run ended {state.name}: {state.message}\n{log_tail(tmp_path / 'worker.log')}"
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
        assert {"agent-metrics", "meg", "agent-rewards"} <= {a.key for a in artifacts}
        # the run graph: a task run per agent update, the two agents' updates overlapping in time
        updates = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="update-")))
        spans = {r.name: (r.expected_start_time, r.end_time) for r in updates if r.state.is_completed()}
        assert sorted(spans) == [f"update-{a}-v{v}" for a in ("solver", "verifier") for v in (1, 2)]
        (s0, s1), (v0, v1) = spans["update-solver-v1"], spans["update-verifier-v1"]
        assert s0 < v1 and v0 < s1

    agents = list(json.loads((run_dir / "report.json").read_text())["agents"])
    assert sorted(agents) == ["solver", "verifier"]

    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"),  # a fresh profile for every run
                executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000},
            )
            try:
                page = browser.new_page()
                page.set_default_timeout(UI_TIMEOUT_MS)
                check_metrics_table(page, base, flow_run.id, agents, shots)
                check_graph_picture(page, base, flow_run.id, shots)
                check_custom_run_form(page, base, deployment.id, shots)
            finally:
                browser.close()
    finally:
        # a copy a person can look at, kept after pytest prunes old tmp dirs
        keep = ROOT / "test-output" / "prefect-ui"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(shots, keep)

    assert {p.name for p in shots.iterdir()} == {"flow-run-artifacts.png", "agent-metrics.png", "meg.png",
                                                 "custom-run.png"}


def check_metrics_table(page: Page, base: str, flow_run_id: UUID, agents: list[str], shots: Path) -> None:
    """Flow run page -> Artifacts tab -> the `agent-metrics` card -> a table with a row per agent."""
    page.goto(f"{base}/runs/flow-run/{flow_run_id}")
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    card = page.get_by_text("agent-metrics", exact=True)
    expect(card).to_be_visible()
    page.screenshot(path=shots / "flow-run-artifacts.png", full_page=True)
    card.click()
    expect(page).to_have_url(re.compile(r"/artifacts/artifact/[0-9a-f-]+$"))
    table = page.locator("table")
    for column in ("agent", "policy_version", "samples_trained", "mean_reward_last"):
        expect(table.get_by_role("columnheader", name=column, exact=True)).to_be_visible()
    # one row per agent, named in the first column (rendered as markdown, so no accessible cell name)
    expect(table.locator("tbody tr td:first-child")).to_have_text(agents)
    page.screenshot(path=shots / "agent-metrics.png", full_page=True)


def check_graph_picture(page: Page, base: str, flow_run_id: UUID, shots: Path) -> None:
    """Flow run page -> Artifacts tab -> the `meg` card -> the graph's picture, drawn in the page."""
    page.goto(f"{base}/runs/flow-run/{flow_run_id}")
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    page.get_by_text("meg", exact=True).click()
    expect(page).to_have_url(re.compile(r"/artifacts/artifact/[0-9a-f-]+$"))
    picture = page.locator("img[src^='data:image/png']").first
    expect(picture).to_be_visible()
    assert picture.evaluate("img => img.naturalWidth") > 100  # decoded, not a broken image
    page.screenshot(path=shots / "meg.png", full_page=True)


def check_custom_run_form(page: Page, base: str, deployment_id: UUID, shots: Path) -> None:
    """Deployment page -> Run -> Custom run: each training parameter with its type choices and prefilled value."""
    page.goto(f"{base}/deployments/deployment/{deployment_id}")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    expect(page).to_have_url(re.compile(rf"/deployments/deployment/{deployment_id}/run"))

    def field(name: str):
        label = page.locator(".schema-form-property__label", has_text=re.compile(rf"^{name}( \(Optional\))?$"))
        return page.locator(".schema-form-property").filter(has=label)

    # (parameter, the type buttons the form offers, the one selected) - selected "None" means left unset
    expected = [("preset", ["str", "None"], "str"), ("config", ["str", "None"], "None"),
                ("steps", ["int", "None"], "int"), ("mode", ["str", "None"], "None"),
                ("overrides", ["list", "None"], "None")]
    for name, types, selected in expected:
        buttons = field(name).locator(".p-button-group button")
        expect(buttons).to_have_text(types)
        expect(field(name).locator(".p-button-group button[aria-selected=true]")).to_have_text(selected)
        expect(field(name).locator(".schema-form-property__description")).not_to_be_empty()
    # the deployment's values prefill the form: steps 2, and preset tiny, a choice of the shipped presets
    expect(field("steps").locator("input[type=number]")).to_have_value("2")
    expect(field("preset").locator(".p-select-button__value")).to_have_text("tiny")
    page.screenshot(path=shots / "custom-run.png", full_page=True)
    field("preset").locator("button.p-select-button__control").focus()
    page.keyboard.press("ArrowDown")  # opens the choices (a mouse click here toggles them twice)
    expect(page.get_by_role("listbox").get_by_role("option")).to_have_text(list(PRESETS))
    page.keyboard.press("Escape")


# Prefect's flow engine logs this when the run starts, from the UI URL it derives from the API's
VIEW_AT = re.compile(r"View at (http://127\.0\.0\.1:\d+)/runs/flow-run/([0-9a-f-]{36})")


def test_the_link_flexmarl_train_prints_shows_the_run_while_it_trains_and_after(prefect_env: dict,
                                                                               tmp_path: Path) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    log = tmp_path / "train.log"
    train_args = ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
                  "--set", "run.steps=6", "--set", "run.queries_per_step=2"]
    with log.open("wb") as out:
        train = subprocess.Popen([sys.executable, "-m", "flows.cli", *train_args], cwd=ROOT, env=prefect_env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def linked():
            assert train.poll() is None, f"flexmarl train exited ({train.returncode}):\n{log_tail(log)}"
            return VIEW_AT.search(log.read_text(errors="replace"))

        found = wait_until("the 'View at' link of `flexmarl train`", linked, 300, detail=lambda: log_tail(log))
        base, flow_run_id = found.group(1), UUID(found.group(2))
        link = f"{base}/runs/flow-run/{flow_run_id}"
        # the run's own server serves its UI (which, like any single-page app, answers a browser's request for
        # a page, Accept: text/html; with the UI off it answered 404)
        assert httpx.get(link, headers={"Accept": "text/html"}, timeout=30).status_code == 200
        with SyncPrefectClient(f"{base}/api") as client:
            name = client.read_flow_run(flow_run_id).name
        with browser_page(tmp_path / "chromium-profile") as page:
            page.goto(link)
            expect(page.get_by_text(name, exact=True).first).to_be_visible()
            page.screenshot(path=shots / "run-link-while-training.png", full_page=True)
        assert train.poll() is None, "the run ended before its link was checked: it was not seen while training"
        assert train.wait(timeout=RUN_TIMEOUT_S) == 0, log_tail(log)

        # the run's server has stopped with it; a server a user starts on the same PREFECT_HOME shows the run
        with running_server(prefect_env, tmp_path / "later-server.log") as later:
            with SyncPrefectClient(f"{later}/api") as client:
                assert client.read_flow_run(flow_run_id).state.is_completed()
            with browser_page(tmp_path / "chromium-profile-later") as page:
                page.goto(f"{later}/runs/flow-run/{flow_run_id}")
                expect(page.get_by_text(name, exact=True).first).to_be_visible()
                expect(page.get_by_text("Completed").first).to_be_visible()
                page.screenshot(path=shots / "run-link-after.png", full_page=True)
    finally:
        stop_process_tree(train)
        keep = ROOT / "test-output" / "prefect-ui-run-link"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(shots, keep)


@contextmanager
def browser_page(profile: Path) -> Iterator[Page]:
    """A page of headless Chromium with a fresh profile."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield page
        finally:
            browser.close()
