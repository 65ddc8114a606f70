"""A decorator as transformers wraps HF models' ``forward`` (``deprecate_kwarg``): a
``functools.wraps`` wrapper defined in another module, whose frame reads the wrapped
function's name, an enum of its own module and a closure flag. The precompile tests'
models use it (``tests/test_precompiled.py``)."""

from __future__ import annotations

import enum
import functools
import inspect
import warnings


class Action(enum.Enum):
    NONE = "none"
    NOTIFY = "notify"


def renamed_kwarg(old_name: str, new_name: str):
    def wrapper(func):
        is_instance_method = "self" in inspect.signature(func).parameters

        @functools.wraps(func)
        def wrapped_func(*args, **kwargs):
            func_name = func.__name__
            if is_instance_method:
                func_name = f"{args[0].__class__.__name__}.{func_name}"
            action = Action.NONE
            if old_name in kwargs:
                action = Action.NOTIFY
                kwargs[new_name] = kwargs.pop(old_name)
            if action == Action.NOTIFY:
                warnings.warn(f"`{old_name}` is deprecated for `{func_name}`", FutureWarning, stacklevel=2)
            return func(*args, **kwargs)

        return wrapped_func

    return wrapper
