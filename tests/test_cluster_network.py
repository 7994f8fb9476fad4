"""How the workers find each other on a cluster: the rendezvous on the IP Ray knows the node by, a port from
--rendezvous-port-range, the collectives on --socket-ifname (or gloo on the interface of the node's Ray IP),
every value checked in one sentence before any actor starts."""

from __future__ import annotations

import socket
import sys

import pytest

from llmq_ray.actors import collectives
from llmq_ray.errors import ConfigError
from llmq_ray.observe.runlog import read_log
from llmq_ray.settings.rules import port_range as parse_port_range
from llmq_ray.train.trainer import LLMQTrainer
from _helpers import train_settings


def test_port_ranges_are_parsed_or_refused_in_one_sentence(tmp_path):
    assert parse_port_range("29500-29599") == (29500, 29599) and parse_port_range(None) is None
    for bad in ("29599-29500", "80-90", "abc", "29500", "29500-70000"):
        with pytest.raises(ConfigError, match=r"must be two ports LO-HI with 1024 <= LO <= HI <= 65535"):
            parse_port_range(bad)
    with pytest.raises(ConfigError, match=r"^rendezvous_port_range='x' must be two ports"):
        LLMQTrainer(device="cpu", synthetic_data=True, rendezvous_port_range="x", out_dir=str(tmp_path),
                    verbose=False)


def test_a_free_port_comes_from_the_range_or_the_range_is_named():
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=rf"^--rendezvous-port-range={port}-{port}: every port of the range "
                                               r"is in use"):
            collectives.free_port_in(port, port)
    finally:
        busy.close()
    assert collectives.free_port_in(port, port + 5) in range(port, port + 6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface lookup by address is Linux's ioctl")
def test_gloo_takes_the_interface_of_the_nodes_ray_ip(monkeypatch):
    assert collectives.interface_of("127.0.0.1") == "lo"
    assert collectives.interface_of("203.0.113.77") is None  # an address this machine does not hold
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(collectives, "node_ip", lambda: "127.0.0.1")
    assert collectives.set_socket_interface(None) == {"GLOO_SOCKET_IFNAME": "lo"}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stays
    assert collectives.set_socket_interface(None) == {}
    assert collectives.set_socket_interface("lo") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--socket-ifname lo is Linux's loopback name")
def test_two_workers_meet_on_a_port_of_the_range_over_the_named_interface(ray_cluster, shards, tmp_path):
    lo = collectives.free_port_in(29500, 29999)
    result = LLMQTrainer(model="tiny", device="cpu", workers=2, backend="torch", batch_size=2, seq_len=16, steps=2,
                         train_file=shards.train, out_dir=str(tmp_path), export=False, final_eval=False,
                         eval_every_n_steps=0, verbose=False, rendezvous_port_range=f"{lo}-{lo + 99}",
                         socket_ifname="lo").fit()
    assert len(result.history) == 2
    (rec,) = [r for r in read_log(result.log_file) if r["log"] == "rendezvous"]
    port = int(rec["address"].rsplit(":", 1)[1])
    assert lo <= port <= lo + 99, rec


def test_a_rank_on_a_node_ray_reports_dead_is_named_as_such_not_as_a_hang(monkeypatch):
    """A step that stopped because a machine vanished: the error names the node's IP and says it died."""
    import ray

    from llmq_ray.actors import coordinator as coord_mod
    from llmq_ray.actors import coordinator_checkpoints as recovery
    from llmq_ray.actors.failures import dead_nodes_of

    nodes = [{"node_id": "aaa", "ip": "10.0.0.4"}, {"node_id": "bbb", "ip": "10.0.0.5"}]
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "aaa", "Alive": True}, {"NodeID": "bbb", "Alive": False}])
    assert dead_nodes_of(nodes, [0, 1]) == [1]
    c = coord_mod.Coordinator.__new__(coord_mod.Coordinator)  # only what _explain_hang reads
    c.workers, c.nodes, c.step = [None, None], nodes, 6
    monkeypatch.setattr(recovery, "probe_activities", lambda workers, ranks, died=None: {0: {"step": 6, "at": 3,
                                                                               "what": "in a collective",
                                                                               "seconds": 40.0}, 1: None})
    err = c._explain_hang([0, 1], None, None)
    assert str(err) == "node 10.0.0.5 died during step 7 (Ray reports it dead), taking rank 1 with it."
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "aaa", "Alive": True}, {"NodeID": "bbb", "Alive": True}])
    from _helpers import train_settings

    c.plan = type("Plan", (), {"settings": train_settings(step_timeout_s=30.0)})()
    assert "hung in step 7, not even answering a status probe" in str(c._explain_hang([0, 1], None, None))


def test_a_tune_sweep_over_learning_rates_gets_every_steps_metrics(ray_cluster, shards, tmp_path):
    """LLMQTrainer.fit() inside a Ray Tune trainable reports each step to Tune; two learning rates give two
    trials whose reported losses differ as the rates do (the same data and seed)."""
    from ray import tune

    train_file, root = shards.train, str(tmp_path)  # plain strings: the trainable is shipped to a Tune actor

    def trainable(config):
        LLMQTrainer(model="tiny", device="cpu", workers=1, backend="torch", batch_size=2, seq_len=16, steps=4,
                    learning_rate=config["lr"], warmup=0, train_file=train_file, out_dir=f"{root}/lr{config['lr']}",
                    export=False, final_eval=False, eval_every_n_steps=0, verbose=False).fit()

    run_config = (tune.RunConfig if hasattr(tune, "RunConfig") else __import__("ray.train").train.RunConfig)(
        storage_path=str(tmp_path / "tune"), name="lr_sweep")
    grid = tune.Tuner(trainable, param_space={"lr": tune.grid_search([1e-4, 3e-2])},
                      tune_config=tune.TuneConfig(max_concurrent_trials=1), run_config=run_config).fit()
    assert not grid.errors, grid.errors
    by_lr = {r.config["lr"]: r.metrics_dataframe for r in grid}
    for df in by_lr.values():
        assert list(df["step"]) == [1, 2, 3, 4]
    slow, fast = by_lr[1e-4]["loss"].tolist(), by_lr[3e-2]["loss"].tolist()
    assert slow[0] == fast[0]  # the first step's loss comes before any update: same init, same batch
    assert fast[-1] < slow[-1] - 0.05  # the larger rate has moved the loss further after 3 updates
