# The C kernels are compiled by cffi (API mode) at install time; see native/build_kernels.py.
from setuptools import setup

setup(cffi_modules=["native/build_kernels.py:ffibuilder"])
