"""Servers the workbench launches itself (``launch:`` blocks): start, readiness, one-line errors, and that the
whole process group is gone afterwards."""

import os
import sys
import time

import httpx
import pytest

from server_helpers import free_port
from workbench.launch import LaunchError, LaunchedServer, LaunchPlan, LaunchPool, plan_for
from workbench.scenario.launch_spec import LaunchSpec


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def plan(tmp_path, argv, ready_url, timeout=60.0, **kw) -> LaunchPlan:
    return LaunchPlan("test-engine", argv, kw.pop("env", {}), ready_url, timeout, kw.pop("stop_timeout_s", 5.0),
                      tmp_path / "server.log")


def serve_argv(model_dir, port: int) -> list[str]:
    return [sys.executable, "-m", "workbench", "serve", "--model", str(model_dir), "--port", str(port),
            "--served-model-name", "tiny", "--kv-cache-tokens", "2048", "--max-model-len", "256"]


def test_workbench_serve_is_launched_ready_and_gone_after(tiny_llama_dir, tmp_path):
    port = free_port()
    server = LaunchedServer(plan(tmp_path, serve_argv(tiny_llama_dir, port), f"http://127.0.0.1:{port}/v1/models"))
    with server:
        pid = server.proc.pid
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == "tiny"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "tiny", "prompt": "fox", "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3
        assert server.started_s is not None and server.started_s > 0
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)


def test_a_server_that_dies_at_start_up_is_a_one_line_error_with_its_last_log_line(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('loading...'); print('error: unknown flag --bogus'); sys.exit(3)"]
    with pytest.raises(LaunchError) as e:
        LaunchedServer(plan(tmp_path, argv, f"http://127.0.0.1:{free_port()}/v1/models")).start()
    msg = str(e.value)
    assert "\n" not in msg and "engine test-engine" in msg and "exited with code 3" in msg
    assert "error: unknown flag --bogus" in msg


def test_a_server_never_ready_times_out_and_its_group_is_killed(tmp_path):
    pid_file = tmp_path / "child.pid"
    # the server starts a worker of its own and ignores SIGTERM: both must still go
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('still warming up', flush=True); time.sleep(120)")
    server = LaunchedServer(plan(tmp_path, [sys.executable, "-c", code], f"http://127.0.0.1:{free_port()}/health",
                                 timeout=3.0, stop_timeout_s=1.0))
    t0 = time.time()
    with pytest.raises(LaunchError) as e:
        server.start()
    assert "not ready" in str(e.value) and "within 3 s" in str(e.value) and "still warming up" in str(e.value)
    assert time.time() - t0 < 15
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_the_workers_of_a_server_that_exited_are_killed_too(tmp_path):
    """The leader exits (and is reaped while the runner waits for readiness) but leaves a worker behind."""
    pid_file = tmp_path / "worker.pid"
    code = (f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('config error', flush=True); sys.exit(1)")
    with pytest.raises(LaunchError, match="exited with code 1"):
        LaunchedServer(plan(tmp_path, [sys.executable, "-c", code], f"http://127.0.0.1:{free_port()}/health")).start()
    worker = int(pid_file.read_text())
    deadline = time.time() + 10
    while alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


def test_something_already_on_the_port_is_refused(tiny_llama_dir, tmp_path):
    port = free_port()
    ready = f"http://127.0.0.1:{port}/v1/models"
    with LaunchedServer(plan(tmp_path, serve_argv(tiny_llama_dir, port), ready)):
        with pytest.raises(LaunchError, match="already answers"):
            LaunchedServer(plan(tmp_path, serve_argv(tiny_llama_dir, port), ready)).start()


def test_the_pool_reuses_the_same_server_and_replaces_another(tmp_path):
    code = "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()"
    p1, p2 = free_port(), free_port()
    a = plan(tmp_path, [sys.executable, "-c", code, str(p1)], f"http://127.0.0.1:{p1}/")
    b = plan(tmp_path, [sys.executable, "-c", code, str(p2)], f"http://127.0.0.1:{p2}/")
    with LaunchPool() as pool:
        s1 = pool.ensure(a)
        assert pool.ensure(a) is s1 and len(pool.launches) == 1
        pid1 = s1.proc.pid
        s2 = pool.ensure(b)
        assert s2 is not s1 and len(pool.launches) == 2 and not s1.alive
        assert not alive(pid1)
        pid2 = s2.proc.pid
    time.sleep(0.5)
    assert not alive(pid2)


def test_plan_fills_placeholders_and_names_unknown_ones(tmp_path):
    spec = LaunchSpec(command="{python} -m workbench serve --port {port} --max-num-seqs {max_concurrency}",
                      env={"OMP_NUM_THREADS": "2", "WHERE": "{peers}"})
    p = plan_for("eng", spec, "http://127.0.0.1:8123/v1", tmp_path, max_concurrency=8)
    assert p.argv == [sys.executable, "-m", "workbench", "serve", "--port", "8123", "--max-num-seqs", "8"]
    assert p.ready_url == "http://127.0.0.1:8123/v1/models" and p.env["WHERE"].endswith("peers")
    assert p.log_file == tmp_path / "eng.server.log"
    with pytest.raises(LaunchError, match=r"engine eng: launch.command: unknown placeholder 'nope'"):
        plan_for("eng", LaunchSpec(command=["x", "{nope}"]), "http://127.0.0.1:1/v1", tmp_path)
    with pytest.raises(ValueError):
        LaunchSpec(command="")


# ----------------------------------------------------------------------------------- through the runner

TRACE = {"format": "synthetic", "synthetic": {"num_requests": 6, "request_rate": 30.0, "lengths": "uniform",
                                              "input_range": [8, 40], "output_range": [2, 8]}}


def launched_engine(model_dir, port: int, **kw) -> dict:
    return {"name": "served", "kind": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "tiny",
            "launch": {"command": ["{python}", "-m", "workbench", "serve", "--model", str(model_dir), "--port",
                                   "{port}", "--served-model-name", "tiny", "--kv-cache-tokens", "2048",
                                   "--max-model-len", "256"], "startup_timeout_s": 120, **kw}}


def write_scenario(tmp_path, model_dir, engines, trace=TRACE):
    import yaml

    p = tmp_path / "sc.yaml"
    p.write_text(yaml.safe_dump({"name": "launch", "model": str(model_dir), "seed": 1, "trace": trace,
                                 "engines": engines}))
    return p


def server_pids(port: int) -> list[int]:
    """Processes whose command line names ``--port <port>`` (the launched server, if still there)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"--port" in cmd and str(port).encode() in cmd and b"serve" in cmd and alive(int(d)):
                out.append(int(d))
    return out


def test_a_scenario_launches_its_server_replays_and_stops_it(tiny_llama_dir, tmp_path):
    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    port = free_port()
    res = run_scenario(load_scenario(write_scenario(tmp_path, tiny_llama_dir, [launched_engine(tiny_llama_dir, port)])),
                       tmp_path / "out")
    assert res["engines"]["served"]["summary"]["num_finished"] == 6
    [launch] = res["launches"]
    assert launch["engine"] == "served" and f"--port {port}" in launch["command"] and launch["ready_s"] > 0
    assert res["engines"]["served"]["runtime"]["server"]["log_file"].endswith("served.server.log")
    assert (tmp_path / "out" / "served.server.log").exists()
    assert server_pids(port) == []


def test_the_server_is_stopped_when_the_replay_fails(tiny_llama_dir, tmp_path):
    from workbench.openai_replay import EndpointError
    from workbench.runner import run_scenario
    from workbench.scenario import load_scenario

    port = free_port()
    eng = launched_engine(tiny_llama_dir, port)
    eng["model"] = "not-served"  # the endpoint check fails once the server is up
    with pytest.raises(EndpointError):
        run_scenario(load_scenario(write_scenario(tmp_path, tiny_llama_dir, [eng])), tmp_path / "out")
    assert server_pids(port) == []


def test_a_server_that_cannot_start_names_the_engine_and_its_last_log_line(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    port = free_port()
    eng = launched_engine(tiny_llama_dir, port)
    eng["launch"]["command"] = ["{python}", "-m", "workbench", "serve", "--model", str(tmp_path / "no-such-model"),
                                "--port", "{port}"]
    path = write_scenario(tmp_path, tiny_llama_dir, [eng])
    r = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert r.exit_code != 0
    lines = [ln for ln in r.output.splitlines() if "engine served" in ln]
    assert lines and "exited with code" in lines[0] and "Traceback" not in r.output, r.output
    assert server_pids(port) == []


def test_a_sweep_over_users_launches_the_server_once(tiny_llama_dir, tmp_path):
    from workbench.sweep import run_sweep

    port = free_port()
    path = write_scenario(tmp_path, tiny_llama_dir, [launched_engine(tiny_llama_dir, port)])
    run_sweep(path, ["trace.max_concurrency=1,3"], tmp_path / "sweep", point_reports=False)
    import json

    launches = [json.loads((tmp_path / "sweep" / p / "results.json").read_text()).get("launches", [])
                for p in ("p000", "p001")]
    assert len(launches[0]) == 1 and launches[1] == []  # the second point reused the first point's server
    assert server_pids(port) == []


def test_reuse_false_gives_every_point_a_fresh_server(tiny_llama_dir, tmp_path):
    import json

    from workbench.sweep import run_sweep

    port = free_port()
    path = write_scenario(tmp_path, tiny_llama_dir, [launched_engine(tiny_llama_dir, port, reuse=False)])
    run_sweep(path, ["trace.max_concurrency=1,3"], tmp_path / "sweep", point_reports=False)
    launches = [json.loads((tmp_path / "sweep" / p / "results.json").read_text())["launches"] for p in ("p000", "p001")]
    assert [len(x) for x in launches] == [1, 1]
    assert server_pids(port) == []
