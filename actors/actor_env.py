"""The environment of a run's actors (the coordinator and every worker): what Ray must set before the actor's
process starts, and what the actor sets itself as the first thing its ``__init__`` does.

Ray starts an actor whose options carry a ``runtime_env`` through a setup process of its own (a Python that
imports Ray, then execs the worker, which imports Ray again): about 0.6 CPU-seconds more per actor on a small
machine than an actor without one, paid by every coordinator and worker, at every start and restart. Most of
what an actor needs is read only once the run's code uses it -- the forwarded credentials and endpoints,
``OMP_NUM_THREADS`` and the NCCL/gloo/torch settings, all read after ``__init__`` began and before torch is
imported there -- so the actor receives those as a constructor argument and puts them into ``os.environ``
itself (``apply_env``). ``runtime_env`` carries only what must be there when the process starts:

* on a GPU worker, everything (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is read by Ray before the actor's
  ``__init__`` runs, when it sets CUDA_VISIBLE_DEVICES; the setup process costs nothing next to CUDA's start);
* ``PYTHONPATH`` (this checkout), unless llmq-ray is installed from this very folder (a wheel, or
  ``pip install -e`` of this checkout): the actor's process imports llmq_ray to unpickle the actor's class;
* the names given to ``--forward-env``: the user's own choice, which may be read at process start
  (``LD_LIBRARY_PATH``, ``PYTHONHASHSEED``).

A secret that travels as a constructor argument is not shown with the actor's runtime_env in Ray's dashboard
and state API either.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import llmq_ray

# the folder that holds the llmq_ray package: a source checkout's root, or site-packages
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(llmq_ray.__file__)))


@functools.lru_cache(maxsize=None)
def installed_from(folder: str) -> bool:
    """True when a plain Python of this environment (no PYTHONPATH, any working directory) imports llmq_ray
    from ``folder``: the llmq-ray distribution found in site-packages is a wheel installed there, or an
    editable install of ``folder``. (Only site-packages are searched: a checkout's own stale
    ``llmq_ray.egg-info`` says nothing about what another process imports.)"""
    import importlib.metadata
    import json
    import site
    import urllib.parse

    folder = os.path.realpath(folder)
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    for dist in importlib.metadata.distributions(name="llmq-ray", path=dirs):
        if os.path.realpath(str(dist.locate_file(""))) == folder:  # a wheel: <site-packages>/llmq_ray
            return True
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            return False
        editable = url.get("dir_info", {}).get("editable") and str(url.get("url", "")).startswith("file://")
        return bool(editable) and os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url["url"]).path)) == folder
    return False


def start_env(env: dict, *, gpu: bool, forward_env: Optional[list] = None) -> dict:
    """The part of ``env`` (the actor's whole environment) that must reach the actor's process through
    ``runtime_env`` (the module docstring says why each); empty when none does. ``forward_env``: the
    --forward-env names."""
    if gpu:
        return dict(env)
    start = {k: env[k] for k in (forward_env or []) if k in env}
    if "PYTHONPATH" in env and not installed_from(PACKAGE_PARENT):
        start["PYTHONPATH"] = env["PYTHONPATH"]
    return start


def actor_options(env: dict, *, gpu: bool, forward_env: Optional[list] = None) -> dict:
    """The ``.options(...)`` keywords that give an actor ``env``'s start-up part: ``runtime_env`` only when
    there is one."""
    start = start_env(env, gpu=gpu, forward_env=forward_env)
    return {"runtime_env": {"env_vars": start}} if start else {}


def apply_env(env: Optional[dict]) -> None:
    """In the actor's own process, first thing in ``__init__``: the variables of ``env`` into ``os.environ``."""
    os.environ.update(env or {})
