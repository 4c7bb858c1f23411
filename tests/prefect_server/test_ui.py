"""The Prefect UI in headless Debian Chromium: run reconcile from its deployment page."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import REPO, PrefectServer

pytestmark = pytest.mark.prefect_server

ARTIFACTS_DIR = REPO / "tests" / "artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str:
    """Debian's chromium, or skip saying how to get it (we never download a browser)."""
    found = os.environ.get("SLURMGATE_CHROMIUM") or shutil.which("chromium")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        reason = "chromium is not installed: `apt-get install -y --no-install-recommends chromium`"
    else:
        reason = "chromium is not installed and cannot be (needs root on Debian)"
    pytest.skip(reason)


@pytest.fixture
def page(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh headless page; when the test fails, a screenshot goes to tests/artifacts/."""
    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.set_default_timeout(30_000)
        page = context.new_page()
        try:
            yield page
        finally:
            report = getattr(request.node, "rep_call", None)
            if report is None or report.failed:
                ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
                shot = ARTIFACTS_DIR / f"{request.node.name}-{int(time.time())}.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot saved: {shot.relative_to(REPO)}")
            context.close()
            browser.close()


def test_quick_run_of_reconcile_from_its_deployment_page_completes_with_the_board(
    served: PrefectServer, emulator: Any, page: Any
) -> None:
    from playwright.sync_api import expect

    # a job too wide for the pool: this tick's board differs from the last, so it is written
    wide = emulator.admin.add_job(
        ["self-hosted", "cluster:a", "ci-job-1.000-ui", "ci-attempt-1", "nodes:9"], 600
    )["id"]
    deployment_id = served.deployment_id("reconcile/reconcile")
    before = {r["id"] for r in served_runs(served, deployment_id)}

    page.goto(served.url + "/deployments")
    # the list links both the flow and the deployment as "reconcile": take the deployment's
    page.locator(f'a[href*="/deployments/deployment/{deployment_id}"]').first.click()
    page.wait_for_url(f"**/deployments/deployment/{deployment_id}**")
    page.wait_for_load_state("networkidle")
    for attempt in range(3):
        page.get_by_role("button", name="Run", exact=True).click()
        with page.expect_response(lambda r: "create_flow_run" in r.url) as answer:
            page.get_by_text("Quick run", exact=True).click()
        status = answer.value.status
        # the UI does not retry SQLite's "database busy" 503s (the Python client does); a
        # person clicks again
        if status != 503:
            break
        print(f"Quick run answered 503 (attempt {attempt + 1}); clicking again")
    assert status in (200, 201), f"create_flow_run answered {status}: {answer.value.text()}"

    run = wait_new_run(served, deployment_id, before)
    page.goto(f"{served.url}/runs/flow-run/{run}")
    expect(page.get_by_text("Completed").first).to_be_visible(timeout=60_000)
    (board,) = [a for a in served.artifacts([run]) if a["key"] == "slurmgate-pool-board"]
    assert f"job {wide} (9n)" in str(board["data"])
    # The tab lists what the API had when it opened: on a loaded machine the page can show
    # "Completed" from a state update before that list is fetched and drawn, so a person
    # waits, and reloads once if the tab is still empty.
    card = page.get_by_text("slurmgate pools: capacity, leases, blocked jobs").first
    for attempt in range(2):
        page.get_by_text("Artifacts", exact=True).click()
        try:
            expect(card).to_be_visible(timeout=20_000)
            break
        except AssertionError:
            if attempt:
                raise
            page.reload()
    card.click()  # the artifact page renders the table itself
    expect(page.get_by_text(f"job {wide} (9n)").first).to_be_visible(timeout=20_000)


def served_runs(served: PrefectServer, deployment_id: str) -> list[dict[str, Any]]:
    response = served.api.post(
        "/flow_runs/filter",
        json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "limit": 200},
    )
    response.raise_for_status()
    runs: list[dict[str, Any]] = response.json()
    return runs


def wait_new_run(served: PrefectServer, deployment_id: str, before: set[str]) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = [
            r
            for r in served_runs(served, deployment_id)
            if r["id"] not in before and "auto-scheduled" not in r["tags"]
        ]
        if new:
            return str(new[0]["id"])
        time.sleep(0.3)
    raise AssertionError("the Quick run click created no flow run")


def test_a_custom_run_of_allocation_takes_a_preset_file_and_overrides(
    served: PrefectServer, page: Any, tmp_path: Any
) -> None:
    """The short form: a spec file on the worker's host and one override, typed into the
    deployment's custom-run form. The file is absent from the worker's presets folder, so the
    run fails naming `spec_file`."""
    from playwright.sync_api import expect

    deployment_id = served.deployment_id("allocation/allocation")
    before = {r["id"] for r in served_runs(served, deployment_id)}
    missing = "nightly.yaml"  # a name in the worker's presets folder, which has none

    page.goto(f"{served.url}/deployments/deployment/{deployment_id}/run")
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(tmp_path / "form.png"), full_page=True)
    # Each optional parameter is a choice of its type or None: pick the type, then type in it.
    spec_file = optional_property(page, "spec_file", "str")
    spec_file.locator("textarea, input").first.fill(missing)
    overrides = optional_property(page, "overrides", "SpecOverrides")
    optional_property(overrides, "Name", "str").locator("textarea, input").first.fill("nightly-ui")
    page.screenshot(path=str(tmp_path / "form-filled.png"), full_page=True)
    for attempt in range(3):  # as above: a person clicks again after SQLite's busy 503
        with page.expect_response(lambda r: "create_flow_run" in r.url) as answer:
            page.get_by_role("button", name="Submit").click()
        if answer.value.status != 503:
            break
        print(f"Submit answered 503 (attempt {attempt + 1}); clicking again")
    assert answer.value.status in (200, 201), answer.value.text()

    run = wait_new_run(served, deployment_id, before)
    failed = served.wait_state(run, {"FAILED", "CRASHED", "COMPLETED"}, timeout=90)
    assert failed["parameters"]["spec_file"] == missing
    assert failed["parameters"]["overrides"]["name"] == "nightly-ui"
    assert failed["name"] == "allocation-nightly-ui"
    assert failed["state"]["type"] == "FAILED"
    assert (
        "spec_file" in failed["state"]["message"] and "cannot be read" in failed["state"]["message"]
    )
    page.goto(f"{served.url}/runs/flow-run/{run}")
    expect(page.get_by_text("Failed").first).to_be_visible(timeout=30_000)


def optional_property(scope: Any, name: str, kind: str) -> Any:
    """The form block of optional parameter `name`, switched from None to `kind`."""
    label = scope.get_by_text(f"{name} (Optional)", exact=True).first
    block = label.locator(f"xpath=ancestor::*[.//button[normalize-space()='{kind}']][1]")
    block.get_by_role("button", name=kind, exact=True).first.click()
    return block
