"""llmq-ray: quantized LLM training on Ray (see README.md)."""

from llmq_ray.errors import CheckpointError, ConfigError, DataError, LLMQError

__all__ = ["LLMQError", "ConfigError", "DataError", "CheckpointError"]
__version__ = "0.1.0"
