"""llmq-ray: quantized LLM training on Ray (see README.md).

One import namespace: ``llmq_ray`` (this folder: the layers ``model``, ``engine``, ``checkpoints``, ``observe`` and ``train``, and
the leaf modules every layer may import: errors, settings, options, lr_schedule, host_memory, heap), ``llmq_ray.backends`` (the kernel
backends), ``llmq_ray.actors`` (the Ray actors) and ``llmq_ray.data_pipeline`` (token shards, tokenizer, streaming).
The last three live in the folders ``backends/``, ``actors/`` and ``data_pipeline/`` at the top of the repository;
an installed wheel holds them inside this package (``pyproject.toml`` maps them with setuptools' package-dir). In
a source checkout run without installing (``PYTHONPATH=<repository>``, as on the GPU machine and in the Ray
workers) the repository root is added to this package's search path below, so the same names resolve to the
same files there too.
"""

import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (_os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isdir(_os.path.join(_ROOT, "backends"))
        and _ROOT not in __path__):
    __path__.append(_ROOT)  # a source checkout: llmq_ray.backends -> <repository>/backends, etc.

from llmq_ray.errors import CheckpointError, ConfigError, DataError, LLMQError  # noqa: E402



def __getattr__(name):  # ``from llmq_ray import LLMQTrainer``; imported on first use (it brings in Ray)
    if name == "LLMQTrainer":
        from llmq_ray.train.trainer import LLMQTrainer

        return LLMQTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LLMQError", "ConfigError", "DataError", "CheckpointError", "LLMQTrainer"]
__version__ = "0.1.0"
