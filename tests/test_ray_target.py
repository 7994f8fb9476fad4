"""Which Ray a trainer that starts Ray itself uses (llmq_ray/train/ray_target.py): a fresh local instance, the
cluster named by --ray-address / RAY_ADDRESS, or the one a `ray start` on this machine recorded in
``<temp>/ray/ray_current_cluster`` -- joined without ``num_cpus`` (Ray refuses that with a traceback), and refused
in one sentence when that cluster is gone. The real `ray start`-style cluster is joined in tests/test_ray_job.py;
the CLI's refusal of a stale file is in tests/test_preflight.py."""

from __future__ import annotations

import contextlib
import socket

import pytest

from llmq_ray.errors import ConfigError
from llmq_ray.train.ray_target import RayTarget, answers, ray_address_file, resolve_ray_target


def _record(tmp_path, address: str) -> dict:
    """An environment whose Ray temp folder is ``tmp_path`` with ``address`` in its address file."""
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)
    return {"RAY_TMPDIR": str(tmp_path)}


@contextlib.contextmanager
def _listening():
    """host:port of a TCP server that accepts connections (as a live cluster's GCS does) while the block runs."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_the_address_file_is_where_ray_start_writes_it():
    assert ray_address_file({"RAY_TMPDIR": "/a", "TMPDIR": "/b"}) == "/a/ray/ray_current_cluster"
    assert ray_address_file({"TMPDIR": "/b"}) == "/b/ray/ray_current_cluster"
    assert ray_address_file({}) == "/tmp/ray/ray_current_cluster"


def test_no_address_anywhere_starts_a_fresh_local_instance(tmp_path):
    assert resolve_ray_target(None, {"RAY_TMPDIR": str(tmp_path)}) == RayTarget("local", False)
    assert resolve_ray_target(None, _record(tmp_path, "  \n")) == RayTarget("local", False)  # an empty file


def test_a_named_address_or_ray_address_wins_over_the_file(tmp_path):
    env = _record(tmp_path, f"127.0.0.1:{_closed_port()}")  # a dead one: never consulted here
    with _listening() as address:
        assert resolve_ray_target(address, env) == RayTarget(address, True)
        assert resolve_ray_target(f"ray://{address}", env) == RayTarget(f"ray://{address}", True)  # Ray Client
        assert resolve_ray_target(None, {**env, "RAY_ADDRESS": address}) == RayTarget(None, True)
    assert resolve_ray_target("local", env) == RayTarget("local", False)
    assert resolve_ray_target(None, {**env, "RAY_ADDRESS": "local"}) == RayTarget(None, False)


def test_an_address_nobody_answers_at_is_refused_in_one_sentence(tmp_path):
    """ray.init would retry it for minutes (seen: still retrying after 200 s with RAY_ADDRESS=127.0.0.1:1)."""
    env = {"RAY_TMPDIR": str(tmp_path)}
    dead = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ConfigError) as err:
        resolve_ray_target(dead, env)
    assert str(err.value) == (f"--ray-address={dead}: no Ray cluster answers at {dead}; check the address and that "
                              f"the cluster is up.")
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS={dead}: no Ray cluster answers at {dead};"):
        resolve_ray_target(None, {**env, "RAY_ADDRESS": dead})
    for bad in ("10.0.0.1", "head:port", ":6379"):
        with pytest.raises(ConfigError, match=rf"^--ray-address={bad} is not a Ray cluster address: give host:port"):
            resolve_ray_target(bad, env)


def test_auto_means_the_file_s_cluster_which_must_exist(tmp_path):
    with pytest.raises(ConfigError, match=r"^Ray address 'auto' asks for the Ray cluster that `ray start` runs on "
                                          r"this machine, but none does \(no address in "):
        resolve_ray_target("auto", {"RAY_TMPDIR": str(tmp_path)})
    with pytest.raises(ConfigError, match="does not answer"):
        resolve_ray_target(None, {**_record(tmp_path, f"127.0.0.1:{_closed_port()}"), "RAY_ADDRESS": "auto"})
    with _listening() as address:
        target = resolve_ray_target(None, {**_record(tmp_path, address), "RAY_ADDRESS": "auto"})
    assert target.address == address and target.joins and address in target.line


def test_a_live_cluster_in_the_file_is_joined_and_said(tmp_path):
    with _listening() as address:
        target = resolve_ray_target(None, _record(tmp_path, address + "\n"))
    assert target.address == address and target.joins
    assert target.line == (f"Ray: joining the cluster at {address} that `ray start` started on this machine "
                           f"(named in {tmp_path}/ray/ray_current_cluster); --ray-address=local starts a fresh one")


def test_a_file_whose_cluster_is_gone_is_refused_in_one_sentence(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    env = _record(tmp_path, address)
    with pytest.raises(ConfigError) as err:
        resolve_ray_target(None, env)
    assert str(err.value) == (f"Ray's address file {tmp_path}/ray/ray_current_cluster names a cluster at {address} "
                              f"that does not answer (its `ray start` is gone): start it again, delete the file "
                              f"(as `ray stop` does), or pass --ray-address=local for a fresh Ray instance.")


def test_answers_takes_host_port_forms():
    with _listening() as address:
        port = address.rpartition(":")[2]
        assert answers(address) and answers(f"localhost:{port}")
    assert not answers(f"127.0.0.1:{_closed_port()}")
    assert not answers("no-port-here") and not answers("127.0.0.1:notaport")


@pytest.mark.parametrize("dashboard", [True, False])
def test_a_fresh_local_instance_starts_the_dashboard_unless_told_not_to(tmp_path, monkeypatch, dashboard):
    """A trainer that starts its own local Ray binds the dashboard to loopback; ``dashboard=False``
    (``--no-dashboard``) starts that Ray without it. The trainer's own ``ray.init`` call is captured, not run."""
    import ray

    from llmq_ray.train.trainer import LLMQTrainer

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no ray_current_cluster there: a fresh local instance
    trainer = LLMQTrainer(model="tiny", device="cpu", synthetic_data=True, out_dir=str(tmp_path / "out"),
                          verbose=False, ray_address="local", dashboard=dashboard)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    trainer._init_ray()
    (kwargs,) = calls
    assert kwargs["address"] == "local"
    if dashboard:
        assert kwargs["dashboard_host"] == "127.0.0.1" and "include_dashboard" not in kwargs
    else:
        assert kwargs["include_dashboard"] is False and "dashboard_host" not in kwargs
    trainer.close()  # ray.is_initialized is still patched: this shuts no Ray down (the session's stays up)


def test_a_fresh_start_that_timed_out_is_tried_again_then_refused_in_one_sentence(monkeypatch, capsys):
    """Ray gives a fresh local node a fixed 30 s to register (a busy machine exceeds it, Ray raises a bare
    Exception): ``start_ray`` shuts the half-started instance down and starts it again, up to START_ATTEMPTS
    times, then raises one RayStartError sentence; joining a cluster, and any other failure, is not retried."""
    import ray

    from llmq_ray.errors import RayStartError
    from llmq_ray.train.ray_target import START_ATTEMPTS, start_ray

    timed_out = Exception("The current node timed out during startup. This could happen because some of the raylet "
                          "failed to startup or the GCS has become overloaded.")
    calls = {"init": [], "shutdown": 0}

    def init_failing(times, error=timed_out):
        def init(**kwargs):
            calls["init"].append(kwargs)
            if len(calls["init"]) <= times:
                raise error
        return init

    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    monkeypatch.setattr(ray, "init", init_failing(2))
    start_ray({"address": "local", "num_cpus": 4, "dashboard_host": None}, fresh=True)
    assert calls["init"] == [{"address": "local", "num_cpus": 4}] * 3 and calls["shutdown"] == 2
    assert capsys.readouterr().err.count("did not register within 30 s (a busy machine); starting it again") == 2

    calls.update(init=[], shutdown=0)
    monkeypatch.setattr(ray, "init", init_failing(99))
    with pytest.raises(RayStartError, match=rf"^the local Ray instance did not start: its node did not register "
                                            rf"within Ray's 30 s, {START_ATTEMPTS} times; this machine is too busy"):
        start_ray({"address": "local"}, fresh=True)
    assert len(calls["init"]) == START_ATTEMPTS == calls["shutdown"]

    for fresh, error in ((False, timed_out), (True, ValueError("something else"))):
        calls.update(init=[], shutdown=0)
        monkeypatch.setattr(ray, "init", init_failing(99, error))
        with pytest.raises(type(error)) as info:
            start_ray({"address": "10.0.0.1:6379"}, fresh=fresh)
        assert info.value is error and len(calls["init"]) == 1 and calls["shutdown"] == 0
