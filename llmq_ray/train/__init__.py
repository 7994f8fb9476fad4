"""What a user drives: ``LLMQTrainer`` (``.fit()`` from a Ray program), the command line (``llmq-train`` /
``examples/train.py``), the shared run defaults and the TOML config file, pre-flight checks, signal handling and
the default data set. The top layer: it imports the actors, the engine and everything below, and nothing
imports it (but the examples).
"""


def __getattr__(name):  # LLMQTrainer imports Ray: only when asked for
    if name == "LLMQTrainer":
        from llmq_ray.train.trainer import LLMQTrainer

        return LLMQTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LLMQTrainer"]
