"""The optional compiled reading core (tokenload/transport/_chunked.c); everything else is in pyproject.toml.

Optional: where it cannot be built (no C compiler, not Linux) the install goes on
and the load generator reads with its pure-Python path (tokenload.transport.reader).
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(Extension("tokenload.transport._chunked", ["tokenload/transport/_chunked.c"], optional=True,
                                 extra_compile_args=["-O2"]))
setup(ext_modules=ext_modules)
