"""Build the compiled hot path under ``mooncake/_fast``.

The package is importable without any of these extensions (``MOONCAKE_NO_EXTENSIONS=1`` forces the
pure-Python twins); building them needs only gcc and the Python headers.
"""

from __future__ import annotations

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O3", "-fno-strict-aliasing"]

extensions = [
    Extension("mooncake._fast._io", ["mooncake/_fast/_io.pyx"], extra_compile_args=CFLAGS),
    Extension("mooncake._fast._tcp", ["mooncake/_fast/_tcp.pyx"], extra_compile_args=CFLAGS),
    Extension(
        "mooncake._fast._copyq",
        ["mooncake/_fast/_copyq.pyx"],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
        quiet=True,
        force=bool(os.environ.get("MOONCAKE_CYTHON_FORCE")),
    ),
)
