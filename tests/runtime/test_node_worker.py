"""The node worker as a real process (no Slurm): lanes, fail-fast, stagger, signals, preflight."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmgate.runtime.run.node_failures import StepOutcome, blame
from slurmgate.runtime.steps.node_worker import (
    LaneSpec,
    NodeSpec,
    WorkerSpec,
    WorkerSpecError,
)

from .conftest import assert_no_orphans

HOST = socket.gethostname().split(".")[0]

# A lane that records its GPUs and a SIGTERM, then sleeps until stopped.
LANE = (
    "import os,signal,sys,time\n"
    "out=sys.argv[1]\n"
    "open(out,'a').write('start '+os.environ['CUDA_VISIBLE_DEVICES']+'\\n')\n"
    "def term(*a):\n"
    "    open(out,'a').write('term\\n'); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 300)\n"
    "sys.exit(int(sys.argv[3]) if len(sys.argv) > 3 else 0)\n"
)


def _lane(
    tmp: Path, i: int, *extra: str, delay: float = 0.0, gpus: list[int] | None = None
) -> LaneSpec:
    return LaneSpec(
        id=f"lane-{i}",
        argv=[sys.executable, "-c", LANE, str(tmp / f"lane-{i}.txt"), *extra],
        gpus=[i] if gpus is None else gpus,
        delay_s=delay,
        env={},
    )


def _spec(token: str, lanes: list[LaneSpec], **kw: object) -> WorkerSpec:
    return WorkerSpec(
        run_id=token,
        name="d",
        gpus_per_node=int(kw.get("gpus", 2)),  # type: ignore[call-overload]
        model_path=kw.get("model_path"),  # type: ignore[arg-type]
        grace_s=2.0,
        nodes=[NodeSpec(host=HOST, ports=list(kw.get("ports", [])), lanes=lanes)],  # type: ignore[call-overload]
        model_paths=list(kw.get("model_paths", [])),  # type: ignore[call-overload]
    )


def _worker(mode: str, spec: WorkerSpec, gpus: str = "3,5") -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.update(
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURMD_NODENAME=HOST,
        CUDA_VISIBLE_DEVICES=gpus,
        SLURMGATE_RUN_ID=spec.run_id,
    )
    # As the runtime sends it: on stdin, since argv is public in /proc.
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmgate.runtime.steps.node_worker", mode, "--spec", "-"],
        env=env,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(spec.encode())
    proc.stdin.close()
    return proc


def _wait_for(path: Path, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never contained {text!r}")


def test_spec_round_trips_and_rejects_untrusted_payloads(tmp_path: Path) -> None:
    spec = _spec("tok", [_lane(tmp_path, 0), _lane(tmp_path, 1)])
    assert WorkerSpec.decode(spec.encode()) == spec
    with pytest.raises(WorkerSpecError):
        WorkerSpec.decode("not-base64-json!!")
    shared = _spec("tok", [_lane(tmp_path, 0), _lane(tmp_path, 1, gpus=[0])])
    with pytest.raises(WorkerSpecError, match="GPU 0 is shared"):
        WorkerSpec.decode(shared.encode())
    with pytest.raises(WorkerSpecError, match="over"):
        WorkerSpec.decode("A" * (64 * 1024 + 1))


def test_lanes_get_mapped_gpus_and_a_lane_exit_0_fails_the_node(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-exit0"
    # lane 1 exits 0 after 1 s: a server lane must never end, so the worker exits 1.
    spec = _spec(token, [_lane(tmp_path, 0), _lane(tmp_path, 1, "1", "0")])
    proc = _worker("serve", spec)
    rc = proc.wait(timeout=20)
    assert rc == 1, proc.stderr.read() if proc.stderr else ""
    lane0 = (tmp_path / "lane-0.txt").read_text()
    assert lane0.startswith("start 3\n") and "term" in lane0  # GPU 0 → visible[0] = 3, stopped
    assert (tmp_path / "lane-1.txt").read_text().startswith("start 5\n")
    assert_no_orphans(token)


def test_failing_lane_status_is_propagated_and_sibling_stopped(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-exit23"
    # lane 1 fails after 2 s: lane 0 has started (and written its file) by then, even on a
    # loaded machine
    spec = _spec(token, [_lane(tmp_path, 0), _lane(tmp_path, 1, "2", "23")])
    proc = _worker("serve", spec)
    assert proc.wait(timeout=20) == 23
    assert "term" in (tmp_path / "lane-0.txt").read_text()
    assert_no_orphans(token)
    # The worker's own line is what node-failure blame reads: a lane dead after 2 s is its
    # command's fault, not the node's.
    err = proc.stderr.read() if proc.stderr else ""
    found = blame("readiness", [StepOutcome("serve-d", (HOST, "other"), 23, err)])
    assert found.node is None and f"lane lane-1 on {HOST} exited 23 after 2." in found.reason


def test_partial_startup_cleans_the_first_lane(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-spawn"
    broken = LaneSpec(id="lane-1", argv=["/nonexistent/server"], gpus=[1], delay_s=0.3, env={})
    proc = _worker("serve", _spec(token, [_lane(tmp_path, 0), broken]))
    rc = proc.wait(timeout=20)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 71, err
    assert "lane-1 failed to start" in err
    assert "term" in (tmp_path / "lane-0.txt").read_text()
    assert_no_orphans(token)


def test_sigterm_during_a_long_stagger_returns_within_2s(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-stagger"
    spec = _spec(token, [_lane(tmp_path, 0), _lane(tmp_path, 1, delay=30.0)])
    proc = _worker("serve", spec)
    _wait_for(tmp_path / "lane-0.txt", "start")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=10)
    assert time.monotonic() - t0 < 2.0
    assert rc == 128 + signal.SIGTERM
    assert not (tmp_path / "lane-1.txt").exists()  # the delayed lane never started
    assert "term" in (tmp_path / "lane-0.txt").read_text()
    assert_no_orphans(token)


@pytest.mark.serial  # a wall-clock window: the grace, then the kill
def test_lane_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-stubborn"
    started = tmp_path / "lane-0.txt"
    stubborn = LaneSpec(
        id="lane-0",
        argv=[
            sys.executable,
            "-c",
            "import pathlib,signal,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).write_text('start'); time.sleep(300)",
            str(started),
        ],
        gpus=[0],
        delay_s=0,
        env={},
    )
    proc = _worker("serve", _spec(token, [stubborn]))
    _wait_for(started, "start")  # the worker runs its lane: its own signal handlers are set
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 128 + signal.SIGINT
    assert 1.5 < time.monotonic() - t0 < 5.0  # grace 2 s, then SIGKILL
    assert_no_orphans(token)


@pytest.mark.parametrize(
    "kw,gpus,check",
    [
        ({"gpus": 8}, "0,1", "gpu-count"),
        ({"model_path": "/nonexistent/model"}, "0,1", "model-path"),
        # the engine's model flag in the command (`vllm serve /models/x`), checked the same way
        ({"model_paths": ["/nonexistent/checkpoint"]}, "0,1", "model-path"),
    ],
)
def test_preflight_failures_name_node_and_check(kw: dict, gpus: str, check: str) -> None:
    proc = _worker("preflight", _spec("tok", [], **kw), gpus=gpus)
    rc = proc.wait(timeout=20)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 70
    assert f"SLURMGATE-PREFLIGHT host={HOST} check={check}:" in err


@pytest.mark.parametrize("written", [None, "another run's token"])
def test_preflight_fails_a_discovery_directory_the_node_does_not_share(
    tmp_path: Path, written: str | None
) -> None:
    """The controller wrote a token in the shared directory; a node that reads another (or
    none: its own mount of the path is elsewhere) does not share it, and says which field."""
    token_file = tmp_path / "slurmgate-preflight-token"
    if written is not None:
        token_file.write_text(written)
    spec = dataclasses.replace(_spec("tok", []), shared_tokens={str(token_file): "the token"})
    proc = _worker("preflight", spec, gpus="0,1")
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=20) == 70, err
    assert f"SLURMGATE-PREFLIGHT host={HOST} check=shared-dir:" in err, err
    assert f"frontend.discovery_dir: {tmp_path} is not shared with this node" in err, err
    token_file.write_text("the token")
    proc = _worker("preflight", spec, gpus="0,1")
    assert proc.wait(timeout=20) == 0, proc.stderr.read() if proc.stderr else ""


def test_preflight_busy_port() -> None:
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        proc = _worker("preflight", _spec("tok", [], ports=[port]), gpus="0,1")
        assert proc.wait(timeout=20) == 70
        err = proc.stderr.read() if proc.stderr else ""
        assert f"check=port: port {port} is not bindable" in err
        found = blame("preflight", [StepOutcome("preflight-d", (HOST,), 70, err)])
        assert found.node == HOST and "check port failed" in found.reason
    finally:
        sock.close()
    ok = _worker("preflight", _spec("tok", [], ports=[port]), gpus="0,1")
    assert ok.wait(timeout=20) == 0


def test_wrong_procid_is_an_identity_failure() -> None:
    spec = _spec("tok", [])
    env = dict(os.environ, SLURM_PROCID="0", SLURM_NTASKS="2", CUDA_VISIBLE_DEVICES="0,1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurmgate.runtime.steps.node_worker",
            "preflight",
            "--spec",
            spec.encode(),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 70 and "check=ntasks" in out.stderr


def test_preflight_accepts_more_visible_gpus_than_planned_and_reports_its_node() -> None:
    # The seed's rule: the node shows 8, the plan needs 4: fine (lanes take the first ones).
    proc = _worker("preflight", _spec("tok", [], gpus=4), gpus="0,1,2,3,4,5,6,7")
    rc = proc.wait(timeout=20)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err
    assert f"SLURMGATE-PREFLIGHT-OK host={HOST} cpus=" in err and "gpus=8" in err


def test_preflight_rejects_a_gpu_listed_twice() -> None:
    proc = _worker("preflight", _spec("tok", [], gpus=2), gpus="0,1,1")
    rc = proc.wait(timeout=20)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 70
    assert f"SLURMGATE-PREFLIGHT host={HOST} check=gpu-list:" in err and "'0,1,1'" in err


def test_a_task_on_another_node_than_planned_is_a_hostname_failure() -> None:
    # Slurm says the task runs on node7 while the plan (and the hostname) say HOST: Slurm's
    # node name is what the plan is made of, so the task is on the wrong node.
    spec = _spec("tok", [])
    env = dict(
        os.environ,
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURMD_NODENAME="node7",
        CUDA_VISIBLE_DEVICES="0,1",
    )
    out = subprocess.run(
        [sys.executable, "-m", "slurmgate.runtime.steps.node_worker", "preflight", "--spec", "-"],
        input=spec.encode(),
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 70, out.stderr
    assert (
        f"SLURMGATE-PREFLIGHT host=node7 check=hostname: task 0 runs on node7 but the plan "
        f"puts it on {HOST}"
    ) in out.stderr


def test_the_commands_model_paths_travel_and_an_older_spec_without_them_still_decodes() -> None:
    spec = _spec("tok", [], model_path="/a", model_paths=["/b", "/a"])
    again = WorkerSpec.decode(spec.encode())
    assert again.model_paths == ["/b", "/a"] and again.checked_paths() == ["/a", "/b"]
    data = spec.to_json()
    del data["model_paths"]
    assert WorkerSpec.from_json(data).checked_paths() == ["/a"]


def test_a_lanes_files_are_written_in_its_private_dir_and_removed_at_stop(tmp_path: Path) -> None:
    token = f"nw-{os.getpid()}-files"
    # The lane copies its config out of {lane_dir}, then exits 3: the worker names it.
    copy = (
        "import os,shutil,sys\n"
        "d=os.path.dirname(sys.argv[1])\n"
        "shutil.copy(sys.argv[1], sys.argv[2])\n"
        "open(sys.argv[2]+'.mode','w').write(oct(os.stat(d).st_mode & 0o777))\n"
        "open(sys.argv[2]+'.dir','w').write(d)\n"
        "sys.exit(3)\n"
    )
    out = tmp_path / "seen.yaml"
    lane = LaneSpec(
        id="lane-0",
        argv=[sys.executable, "-c", copy, "{lane_dir}/engine.yaml", str(out)],
        gpus=[0],
        delay_s=0.0,
        env={},
        files={"engine.yaml": "tensor_parallel_size: 2\n"},
    )
    spec = _spec(token, [lane])
    assert WorkerSpec.decode(spec.encode()) == spec
    proc = _worker("serve", spec)
    assert proc.wait(timeout=20) == 3
    assert out.read_text() == "tensor_parallel_size: 2\n"
    assert (tmp_path / "seen.yaml.mode").read_text() == "0o700"
    assert not Path((tmp_path / "seen.yaml.dir").read_text()).exists()  # gone with the lanes
    stderr = proc.stderr.read() if proc.stderr else ""
    assert f"SLURMGATE-LANE-EXIT host={HOST} lane=lane-0 status=3" in stderr
    assert_no_orphans(token)


def test_a_lanes_temporary_files_go_to_its_own_tmpdir_and_are_removed_at_stop(
    tmp_path: Path,
) -> None:
    token = f"nw-{os.getpid()}-tmpdir"
    # The lane leaves a file where Python's tempfile puts it (as vLLM leaves its rendezvous
    # file), says where, and exits 3; a second lane whose spec sets TMPDIR keeps that one.
    leave = (
        "import os,sys,tempfile\n"
        "fd, path = tempfile.mkstemp(prefix='left-')\n"
        "mode = oct(os.stat(os.path.dirname(path)).st_mode & 0o777)\n"
        "open(sys.argv[1],'w').write(path + '\\n' + mode)\n"
        "sys.exit(3)\n"
    )
    own = tmp_path / "own-tmp"
    own.mkdir()
    lanes = [
        LaneSpec(id="lane-0", argv=[sys.executable, "-c", leave, str(tmp_path / "a")], gpus=[0],
                 delay_s=0.0, env={}),
        LaneSpec(id="lane-1", argv=[sys.executable, "-c", "import time; time.sleep(30)"],
                 gpus=[1], delay_s=0.0, env={"TMPDIR": str(own)}),
    ]  # fmt: skip
    proc = _worker("serve", _spec(token, lanes))
    assert proc.wait(timeout=20) == 3
    left, mode = (tmp_path / "a").read_text().splitlines()
    assert mode == "0o700" and Path(left).parent.name.startswith("sg-tmp-")
    assert not Path(left).exists() and not Path(left).parent.exists()  # gone with the lanes
    assert own.is_dir()  # a TMPDIR the spec names is the spec's, and stays
    assert_no_orphans(token)


@pytest.mark.parametrize("name", ["../escape.yaml", "sub/dir.yaml", ".hidden", ""])
def test_a_lane_file_outside_its_dir_is_refused(tmp_path: Path, name: str) -> None:
    lane = LaneSpec(id="lane-0", argv=["true"], gpus=[0], delay_s=0.0, env={}, files={name: "x"})
    with pytest.raises(WorkerSpecError, match="plain file name"):
        WorkerSpec.decode(_spec("tok", [lane]).encode())
