"""The build: the packages are every folder with an __init__.py under the repository root (which
is the `ds4f` package), found here so that none is left out of a wheel; cffi compiles the C
kernels at install time (native/build_kernels.py)."""
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
NOT_PACKAGES = {"tests", "tools", "build", "dist"}     # folders at the root that are not installed


def packages() -> list[str]:
    """ds4f and every folder below the root with an __init__.py (hidden folders, caches, build
    outputs, tests and tools aside)."""
    found = ["ds4f"]
    for folder, dirs, files in os.walk(ROOT):
        parts = Path(folder).relative_to(ROOT).parts
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")) and not d.endswith(".egg-info")
                         and not (not parts and d in NOT_PACKAGES))
        if parts and "__init__.py" in files:
            found.append(".".join(("ds4f", *parts)))
    return found


class BuildPy(build_py):
    """The package's modules, less this file (it sits in the package's folder, the root)."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir)
                if not (package == "ds4f" and m[1] == "setup")]


setup(packages=packages(), cffi_modules=["native/build_kernels.py:ffibuilder"], cmdclass={"build_py": BuildPy})
