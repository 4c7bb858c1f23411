"""The allocation flow: one subflow per phase, supervised from the main thread, cleaned up once."""

# No `from __future__ import annotations`: Prefect builds the parameter model from the real
# annotation types when it loads this flow from its entrypoint (string annotations fail there).
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.schemas.objects import FlowRun, State
from prefect.flows import Flow

import slurmgate.tasks.allocation as registry
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.node_failures import NodeRetry, run_with_node_retry
from slurmgate.runtime.run.state import new_run_id
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.presets import SpecOverrides, configured_presets_dir, resolve_spec
from slurmgate.tasks.allocation import (
    Progress,
    log,
    publish_endpoint_stats,
    publish_layout,
    publish_record,
    quiet_known_failures,
    read_secret_block,
)
from slurmgate.tasks.hooks import run_site_hook
from slurmgate.tasks.load_reports import publish_load_reports
from slurmgate.tasks.outputs import check_bucket_block, node_collector, upload_outputs

quiet_known_failures()


def _run(run_id: str) -> AllocationRun:
    return registry.LIVE_RUNS[run_id]


@flow(name="allocation-preflight", validate_parameters=False)
def preflight_phase(run_id: str) -> list[str]:
    """Attach or allocate, resolve the hosts, run the site's prolog, then preflight the client
    and every node."""
    run = _run(run_id)
    run.allocate()
    run.resolve()
    publish_layout(run)
    run.prolog()
    run.preflight()
    return list(run.layout.hosts) if run.layout else []


@flow(name="allocation-launch", validate_parameters=False)
def launch_phase(run_id: str) -> None:
    """One coordinated srun per deployment, started from this (main) thread."""
    run = _run(run_id)
    run.launch()
    publish_record(run)


@flow(name="allocation-readiness", validate_parameters=False)
def readiness_phase(run_id: str) -> float:
    """Poll every lane head until ready; a dead step fails at once."""
    run = _run(run_id)
    return run.wait_ready()


@flow(name="allocation-endpoints", validate_parameters=False)
def endpoints_phase(run_id: str) -> dict[str, str]:
    """One logical endpoint per deployment on the client host."""
    run = _run(run_id)
    run.start_endpoints()
    assert run.layout is not None
    return {d.name: run.layout.endpoint_url(d) for d in run.plan.deployments}


@flow(name="allocation-client", validate_parameters=False)
def client_phase(run_id: str) -> int:
    """The client workload; then the endpoints' metrics, read before anything stops."""
    run = _run(run_id)
    try:
        return run.run_client()
    finally:
        run.collect_endpoint_metrics()
        publish_endpoint_stats(run)
        publish_load_reports(run.client_reports_dir, run.run_id)


@flow(name="allocation-cleanup", validate_parameters=False)
def cleanup_phase(run_id: str) -> list[str]:
    """Stop every step in reverse order and release an owned allocation (idempotent)."""
    run = _run(run_id)
    report = run.cleanup()
    publish_record(run)
    return report.actions


def _cleanup_hook(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """on_cancellation / on_crashed: the same single owner; a no-op when already clean.

    Prefect calls hooks with keyword arguments, so the parameter names are fixed.
    """
    run_id = registry.RUNS_BY_FLOW_RUN.get(str(flow_run.id))
    if run_id and run_id in registry.LIVE_RUNS:
        registry.LIVE_RUNS[run_id].cleanup()


def _run_name() -> str:
    """allocation-<name>: the spec's name, the override's, or the preset file's stem."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    overrides, spec = parameters.get("overrides"), parameters.get("spec")
    for source in (overrides, spec):
        name = source.get("name") if isinstance(source, dict) else getattr(source, "name", None)
        if name:
            return f"allocation-{name}"
    preset = parameters.get("spec_file") or parameters.get("recipe_file") or "spec"
    return f"allocation-{Path(str(preset)).stem}"


@flow(
    name="allocation",
    flow_run_name=_run_name,
    on_cancellation=[_cleanup_hook],
    on_crashed=[_cleanup_hook],
)
def allocation(
    spec: AllocationSpec | None = None,
    runs_dir: str | None = None,
    spec_file: str | None = None,
    overrides: SpecOverrides | None = None,
    recipe_file: str | None = None,
    local: bool = False,
    vllm_cpu: bool = False,
    outputs_bucket: str | None = None,
) -> dict[str, Any]:
    """Run one allocation: preflight, launch, readiness, endpoints, client, cleanup; once
    more on a new allocation without the node, when one node failed it (node_failures.py).

    Give the spec in full, or as a preset: `spec_file`, a spec file on this worker's host, with
    a few fields replaced by `overrides` (the short form for the Prefect UI); or `recipe_file`,
    an srt-slurm recipe in the same folder, which `local` maps onto the bundled cluster with
    CPU stand-ins (as `slurmgate allocation run --recipe R --local`); with `vllm_cpu`, a plain
    vLLM recipe runs one real vLLM-CPU worker instead of Dynamo's mocker (`--vllm-cpu`; the
    worker's SLURMGATE_VLLM_PYTHON names the venv).

    Before cleanup releases the allocation, every node's lane logs and results are collected
    (redacted, each file bounded) into the run's `outputs/`; with `outputs_bucket`, the name
    of a prefect-aws S3Bucket block (its AwsCredentials block holds the keys), they are also
    uploaded under `<bucket folder>/<run id>/`. A failed upload keeps the local copy.
    """
    from prefect.runtime import flow_run

    spec = resolve_spec(
        spec,
        spec_file,
        overrides,
        configured_presets_dir(),
        recipe_file=recipe_file,
        local=local,
        vllm_cpu=vllm_cpu,
    )
    preset = spec_file or recipe_file
    if preset:
        log(
            f"spec from the {'recipe' if recipe_file else 'preset'} {preset} on this host"
            + (" mapped onto the bundled cluster (local)" if local else "")
            + (", on one vLLM-CPU worker (vllm_cpu)" if vllm_cpu else "")
            + (", with overrides" if overrides and not overrides.is_empty() else "")
        )
    if outputs_bucket:
        check_bucket_block(outputs_bucket)  # a typo fails now, not after the run
    node_retry = NodeRetry(log=log)

    def attempt(
        exclude: tuple[str, ...], retry_of: str | None
    ) -> tuple[AllocationRun, BaseException | None]:
        return _attempt(spec, runs_dir, str(flow_run.id), exclude, retry_of, outputs_bucket)

    run = run_with_node_retry(attempt, node_retry)
    result = run.result()
    return {
        "run_id": result.run_id,
        "job_id": result.job_id,
        "hosts": result.hosts,
        "timings": result.timings,
        "record": result.record_path,
        "hooks": result.hooks,
        "hooks_failed": result.hooks_failed,
        "retry_of": run.retry_of,
        "excluded_nodes": list(run.excluded_nodes),
        "outputs": str(run.context.outputs_dir) if run.context.outputs else None,
        "outputs_upload": run.context.outputs_upload,
    }


def _attempt(
    spec: AllocationSpec,
    runs_dir: str | None,
    flow_run_id: str,
    exclude: tuple[str, ...],
    retry_of: str | None,
    outputs_bucket: str | None = None,
) -> tuple[AllocationRun, BaseException | None]:
    """One allocation, its phases as subflows, cleaned up once: the run and what failed it.

    A failure that is not an Exception (a signal, a cancellation) and a failed cleanup raise.
    """
    run_id = new_run_id(spec.name)
    run = AllocationRun(
        spec,
        run_id=run_id,
        runs_root=Path(runs_dir) if runs_dir else None,
        log=log,
        on_progress=Progress(run_id),
        resolve_secret=read_secret_block,
        hook_runner=run_site_hook,
        exclude_nodes=exclude,
        retry_of=retry_of,
    )
    registry.LIVE_RUNS[run.run_id] = run
    registry.RUNS_BY_FLOW_RUN[flow_run_id] = run.run_id
    # each node's outputs through a retryable task, when cleanup collects them
    run.context.collect_nodes = node_collector(run)
    again = f", again without {','.join(exclude)} (retry of {retry_of})" if retry_of else ""
    log(
        f"run {run.run_id}: {spec.total_nodes} node(s){again}; its record.json and one log per "
        f"step (NN-<step>.log) are in {run.run_dir}"
    )
    for reference in spec.secret_references():
        log(f"secret resolved on this host: {reference}")
    failure: BaseException | None = None
    try:
        preflight_phase(run.run_id)
        launch_phase(run.run_id)
        readiness_phase(run.run_id)
        endpoints_phase(run.run_id)
        client_phase(run.run_id)
    except Exception as exc:
        failure = exc
        run.note_failure(exc)
    except BaseException as exc:
        failure = exc
        run.note_failure(exc)
        raise
    finally:
        try:
            cleanup_phase(run.run_id)
        finally:
            try:
                run.finish(failure)  # idempotent: settles the status, raises if cleanup failed
            finally:
                if outputs_bucket:
                    upload_outputs(run, outputs_bucket)  # never raises: the local copy stays
                publish_record(run)
                registry.LIVE_RUNS.pop(run.run_id, None)
                registry.RUNS_BY_FLOW_RUN.pop(flow_run_id, None)
    return run, failure
