"""Builds raycoll's native core (raycoll/native/*.c) with the platform's C compiler.

Everything else about the package is in pyproject.toml. The extension is optional: where it
cannot be built (no compiler), raycoll installs without it and runs its Python transports
(``raycoll.native_status()`` says why). Two environment variables, set by CI:

- ``RAYCOLL_NATIVE_REQUIRED=1``: a failed build fails the install;
- ``RAYCOLL_NATIVE_WERROR=1``: compiler warnings are errors;
- ``RAYCOLL_NATIVE_SANITIZE=address,undefined``: build with AddressSanitizer and
  UndefinedBehaviorSanitizer (the sanitizer run; every report is fatal). The built module
  says so: ``raycoll.native.core.SANITIZE`` is the list, ``""`` in a normal build.
"""

import os
import sys

from setuptools import Extension, setup

flags = []
link = []
if sys.platform != "win32":
    flags = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
             "-Wno-missing-field-initializers", "-fno-strict-aliasing"]
    if os.environ.get("RAYCOLL_NATIVE_WERROR") == "1":
        flags.append("-Werror")
    sanitize = os.environ.get("RAYCOLL_NATIVE_SANITIZE")
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer", "-g", f'-DRAYCOLL_SANITIZE="{sanitize}"']
        link += [f"-fsanitize={sanitize}"]
libraries = ["rt"] if sys.platform.startswith("linux") else []

core = Extension(
    "raycoll.native._core",
    sources=["raycoll/native/module.c", "raycoll/native/exec.c", "raycoll/native/segment.c",
             "raycoll/native/net.c", "raycoll/native/reduce.c", "raycoll/native/cma.c",
             "raycoll/native/pipe.c", "raycoll/native/pipemodule.c",
             "raycoll/native/sockpipe.c", "raycoll/native/sockpipemodule.c",
             "raycoll/native/pipebind.c"],
    depends=["raycoll/native/core.h", "raycoll/native/segment.h", "raycoll/native/net.h",
             "raycoll/native/reduce.h", "raycoll/native/cma.h",
             "raycoll/native/pipe.h", "raycoll/native/sockpipe.h", "raycoll/native/binding.h", "raycoll/native/futex.h",
             "raycoll/native/pipebind.h"],
    extra_compile_args=flags,
    extra_link_args=link,
    libraries=libraries,
    optional=os.environ.get("RAYCOLL_NATIVE_REQUIRED") != "1",
)

setup(ext_modules=[core])
