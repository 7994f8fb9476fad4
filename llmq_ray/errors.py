"""The few exception types a user ever sees.

Every user mistake ends in one of these, with one sentence that names the file, flag or value at fault and
what to do about it. Code deep inside (kernels, Ray plumbing) raises them or lets the caller wrap its error.
"""


class LLMQError(Exception):
    """Base class of all errors that are the user's to fix."""


class ConfigError(LLMQError, ValueError):
    """A setting, flag or combination of them is wrong."""


class ModelConfigError(ConfigError):
    """A model's config.json, preset name or model folder cannot be used (raised by llmq_ray/model/, which knows
    no flags; a ConfigError, so callers that catch those catch it too)."""


class DataError(LLMQError, ValueError):
    """A token shard, glob or dataset is wrong (names the file and, where it applies, the offset)."""


class CheckpointError(LLMQError, RuntimeError):
    """A checkpoint or weights file is missing, incomplete, corrupt or of another model."""


class RayStartError(LLMQError, RuntimeError):
    """The local Ray instance a run starts for itself did not come up (a machine too busy for Ray's fixed
    start-up wait, several times over)."""
