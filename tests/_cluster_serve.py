"""A simulated Ray cluster with a job server, kept up until stdin closes (tests/test_ray_job.py runs it).

    python tests/_cluster_serve.py INFO_JSON

Starts ``ray.cluster_utils.Cluster``: a head node with the dashboard (Ray's job server) on a free port on
127.0.0.1 and no CPUs, and one worker node with 3 CPUs; writes {"dashboard": "http://127.0.0.1:PORT"} to INFO_JSON
once the job server answers, then waits for EOF on stdin and shuts the cluster down. A process of its own
because a Cluster cannot share a process with the test session's Ray instance. Ray's job supervisor gives each
job's driver the address of the cluster named in ``<RAY_TMPDIR>/ray/ray_current_cluster``, which is this one
because tests/conftest.py gives each pytest process a RAY_TMPDIR of its own (this process inherits it).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request


def main(info_path: str) -> None:
    from ray.cluster_utils import Cluster

    from llmq_ray.actors.collectives import free_port

    port = free_port("127.0.0.1")
    # every node's dashboard agent on a free port of its own: the default one (52365) may be taken by another Ray
    # instance on this machine (the test session's), and a head without its agent takes no jobs
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=True,
                                                                dashboard_host="127.0.0.1", dashboard_port=port,
                                                                dashboard_agent_listen_port=free_port("127.0.0.1")))
    cluster.add_node(num_cpus=3, dashboard_agent_listen_port=free_port("127.0.0.1"))
    cluster.wait_for_nodes()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:  # the job server answers once the dashboard's job module is up
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    with open(info_path, "w") as f:
        json.dump({"dashboard": url, "address": cluster.address}, f)
    sys.stdin.read()  # until the test closes our stdin
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
