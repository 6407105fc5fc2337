"""
The one-line error every part of nanoGRPO raises for bad input, and the two imports that can fail on it: an
optional package (wandb, gguf) and a user's own 'module:attribute' (a reward function, an environment).
"""
import importlib


class ConfigError(ValueError):
    """A mistake in what the user gave: the configuration, a data file, a checkpoint, a tokenizer, a reward function.
    train.py prints it as one line, `error: ...`; every other exception keeps its traceback (a bug's, a fork's)."""


def unknown(key, value, valid):
    """The error for a setting whose value is none of its choices: it lists them."""
    return ConfigError(f"unknown {key} '{value}'; choose one of {', '.join(valid)}")


def need_package(name, why):
    """Import an optional package (wandb, gguf) where it is asked for, or say in one line how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"{why} needs the {name} package: pip install {name} (or pip install -r "
                          f"requirements-extra.txt)") from None


def import_named(name, what):
    """The object 'module:attribute' names, imported from the Python path: a user's own reward function or
    environment, named in the config; a one-line error when it is not there."""
    module, _, attr = name.partition(':')
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {name!r} cannot be imported ({e}); put {module}.py on the Python path (e.g. the "
                          f"directory you run from) with {attr} in it") from None
