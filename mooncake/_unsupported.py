"""Stand-ins for published names this package cannot provide (GPU-only builds).

The published wheel ships modules whose work is done by CUDA extensions built with
``WITH_EP=ON`` / against one torch version (``mooncake.ep``, ``mooncake.pg``,
``mooncake.mooncake_ep_buffer``, ``mooncake.mooncake_elastic_buffer``). Here those modules
import, so code that imports them unconditionally keeps working, and every name they export
raises :class:`~mooncake.errors.NotSupportedError` at use (a call, or constructing a class),
naming the module, the name and what is missing.
"""

from __future__ import annotations

from typing import Any, NoReturn

from mooncake.errors import NotSupportedError


def refusal(module: str, name: str, missing: str) -> str:
    """The message every stand-in raises with."""
    return (
        f"{module}.{name} is not supported by this Mooncake build: it needs {missing}, "
        "which this package (mooncake-py) does not include"
    )


def function(module: str, name: str, missing: str) -> Any:
    """A function ``name`` that raises :class:`NotSupportedError` when called."""

    def stand_in(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotSupportedError(refusal(module, name, missing))

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__module__ = module
    stand_in.__doc__ = f"Not supported here: needs {missing}."
    return stand_in


def cls(module: str, name: str, missing: str) -> Any:
    """A class ``name`` whose constructor raises :class:`NotSupportedError`."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(refusal(module, name, missing))

    return type(
        name,
        (),
        {
            "__init__": __init__,
            "__module__": module,
            "__doc__": f"Not supported here: needs {missing}.",
        },
    )
