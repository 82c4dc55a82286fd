"""Engine errors that carry a message a user can act on (what is wrong, how to fix it)."""


class EngineError(Exception):
    """Base class: anything the engine refuses with an explanation rather than a traceback."""


class ModelNotFoundError(EngineError):
    pass


class UnsupportedModelError(EngineError):
    pass


class CorruptModelError(EngineError):
    pass


class ConfigError(EngineError):
    pass
