"""End to end: `ray job submit` of examples/job_allreduce.py to a real Ray head node.

The head is started by `ray start --head --block` in a subprocess with its own temp dir, its
own ports and its own auth token, its job server on 127.0.0.1, so that it lives beside any
local Ray that other test modules start with `ray.init()` in the same session:

* `--temp-dir` puts this head's `ray_current_cluster` file in that temp dir, not in
  /tmp/ray, so a later `ray.init()` (address=None) does not connect to this head; nothing
  here sets RAY_ADDRESS in the pytest process.
* Every port is given explicitly (free ports picked just before the start), so nothing
  collides with a `ray.init()` instance's defaults (dashboard 8265, agent 52365, client 10001).
* Token auth (the default in this Ray) uses a per-test token passed as RAY_AUTH_TOKEN to the
  head and to the `ray job` CLI subprocesses only: ~/.ray/auth_token and the pytest
  process's own environment are left alone.
* Teardown never runs `ray stop` (it kills every Ray process on the machine, including the
  session's `ray.init()` instance). `ray start --block` owns the node: SIGTERM makes it kill
  every process it started. Anything that outlives it among the processes recorded under it
  (raylet's workers, the job's driver) is then SIGKILLed by pid.

The job uploads the repository as its working_dir (minus .gitignore'd files and .git). Ray puts
the working_dir first on the PYTHONPATH of the job's driver and of every actor, so the job
imports the uploaded raycoll/ whether or not raycoll is pip-installed here.
"""

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/job_allreduce.py"
OK_LINE = "raycoll job OK: world_size=2"
# Kept out of the working_dir upload; Ray also leaves out what .gitignore lists, not .git.
UPLOAD_EXCLUDES = [".git", "**/__pycache__", ".pytest_cache", "*.egg-info", ".venv"]

# Seen on 2 busy CPUs: head up in 5-22 s, the job in 14-36 s, teardown in 2.5-5 s. The sum of
# the limits (with teardown's 25 s and the REST calls) stays under the test's 240 s.
START_TIMEOUT_S = 80
JOB_TIMEOUT_S = 110
CLI_TIMEOUT_S = 30


def _ray_cli():
    return [sys.executable, "-m", "ray.scripts.scripts"]


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):  # hold them all open so that the n ports are distinct
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


try:  # loaded here, so that the forked child only makes the call
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None
except OSError:
    _LIBC = None


def _die_with_parent():
    """In the `ray start` child: get SIGTERM if pytest dies, so the head is not orphaned
    (it runs in its own session, out of reach of signals sent to pytest's process group)."""
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class HeadNode:
    dashboard_url: str
    token: str = field(repr=False)
    env: dict = field(repr=False)  # environment for `ray job ...` CLI calls against this head
    temp_dir: str
    log_path: str
    proc: subprocess.Popen = field(repr=False)

    def log_tail(self, n=40):
        with contextlib.suppress(OSError):
            return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def api(self, path, timeout=10):
        """GET a dashboard REST endpoint (JSON), with this head's token."""
        req = urllib.request.Request(self.dashboard_url + path,
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def cli(self, *args, timeout=CLI_TIMEOUT_S):
        return subprocess.run([*_ray_cli(), *args], env=self.env, cwd=self.temp_dir,
                              capture_output=True, text=True, timeout=timeout)


def _wait_dashboard(head, deadline):
    while True:
        if head.proc.poll() is not None:
            raise RuntimeError(f"`ray start` exited with {head.proc.returncode}:\n{head.log_tail()}")
        with contextlib.suppress(OSError, ValueError):  # URLError, HTTPError are OSErrors
            head.api("/api/version", timeout=5)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"dashboard not up after {START_TIMEOUT_S}s:\n{head.log_tail()}")
        time.sleep(0.5)


def _proc_stat(pid):
    """(ppid, start time) of a live process, from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie has exited; its parent reaps it
        return None
    return int(fields[1]), fields[19]


def _descendants(root):
    """{pid: start time} of every process below `root` (Linux /proc; no psutil needed)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st:
                children.setdefault(st[0], []).append((int(entry), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _alive(procs):
    return {pid: start for pid, start in procs.items() if (_proc_stat(pid) or (0, None))[1] == start}


def _stop_head(head):
    """Stop exactly this head: SIGTERM `ray start --block`, then SIGKILL leftovers by pid."""
    procs = _descendants(head.proc.pid)  # raylet's workers and the job's driver included
    if head.proc.poll() is None:
        head.proc.send_signal(signal.SIGTERM)
        try:
            head.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            head.proc.kill()
            head.proc.wait(timeout=5)
    deadline = time.monotonic() + 5
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in _alive(procs):  # start time checked, so a reused pid is never hit
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return procs


@contextlib.contextmanager
def ray_head_node(num_cpus=2):
    # A short path: Ray's unix sockets live under <temp_dir>/session_*/sockets (108-byte limit).
    temp_dir = tempfile.mkdtemp(prefix="rcjob")
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # SIGTERM: no 30 s drain wait
    gcs, dash, client, agent, agent_grpc, rt_env, metrics = _free_ports(7)
    cmd = [*_ray_cli(), "start", "--head", "--block", "--disable-usage-stats",
           f"--port={gcs}", f"--num-cpus={num_cpus}", "--num-gpus=0",
           f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}"]
    log_path = os.path.join(temp_dir, "ray_start.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=temp_dir, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent if _LIBC else None)
    head = HeadNode(f"http://127.0.0.1:{dash}", token, env, temp_dir, log_path, proc)
    try:
        _wait_dashboard(head, time.monotonic() + START_TIMEOUT_S)
        yield head
    finally:
        _stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


#: What `ray job submit` says when the dashboard's job agent is not up yet.
NO_AGENT = "No available agent to submit job"
#: Resubmit after that only while this much of the job's time is left.
AGENT_RETRY_MIN_S = 60


def _submit(head, args, entrypoint, timeout):
    """(the CLI's completed process, None), or (None, its TimeoutExpired)."""
    try:
        return head.cli(*args, "--", *entrypoint, timeout=max(timeout, 1)), None
    except subprocess.TimeoutExpired as e:
        return None, e


def submit_and_wait(head, working_dir, entrypoint, excludes=(), timeout=JOB_TIMEOUT_S):
    """`ray job submit` (it uploads working_dir, waits and streams the logs).

    Returns (job status, job logs, the CLI's output); the status and logs come from the
    job server's REST API, not from the CLI's output.
    """
    deadline = time.monotonic() + timeout
    while True:
        sub_id = f"raycoll-test-{uuid.uuid4().hex[:8]}"
        args = ["job", "submit", "--address", head.dashboard_url, "--submission-id", sub_id,
                "--working-dir", str(working_dir)]
        if excludes:
            args += ["--runtime-env-json", json.dumps({"excludes": list(excludes)})]
        submit, timed_out = _submit(head, args, entrypoint, deadline - time.monotonic())
        out = submit.stdout + submit.stderr if submit is not None else ""
        # the dashboard answers before its job agent is up (seen on 2 loaded CPUs): the
        # submission is refused at once, and a later one is taken
        if NO_AGENT in out and deadline - time.monotonic() > AGENT_RETRY_MIN_S:
            time.sleep(2.0)
            continue
        break
    if timed_out is not None:
        e = timed_out
        with contextlib.suppress(Exception):
            head.cli("job", "stop", "--address", head.dashboard_url, "--no-wait", sub_id)
        logs = ""
        with contextlib.suppress(Exception):
            logs = head.api(f"/api/jobs/{sub_id}/logs")["logs"]
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"job {sub_id} did not finish within {timeout}s\n{said}\n"
                    f"--- job logs ---\n{logs}")
    try:
        status = head.api(f"/api/jobs/{sub_id}")["status"]
    except Exception as e:
        pytest.fail(f"no status for job {sub_id} ({e!r}); `ray job submit` said:\n{out}")
    logs = head.api(f"/api/jobs/{sub_id}/logs")["logs"]
    return status, logs, out


@pytest.fixture(scope="module")
def ray_head():
    with ray_head_node() as head:
        yield head


@pytest.mark.timeout(240)
def test_job_submit_example(ray_head):
    t0 = time.monotonic()
    status, logs, out = submit_and_wait(ray_head, REPO, ["python", EXAMPLE], excludes=UPLOAD_EXCLUDES)
    detail = f"--- status ---\n{status}\n--- job logs ---\n{logs}\n--- submit output ---\n{out}"
    assert status == "SUCCEEDED", detail
    assert OK_LINE in logs, detail
    print(f"job finished in {time.monotonic() - t0:.1f}s")
